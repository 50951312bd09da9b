"""Engine core reliability (issue 6, part 3): malformed requests and configurations.

Every case meets a BUSY engine (requests running, one preempted with its K/V swapped to the
host, an n > 1 group, cached blocks) and must be refused with a ValueError whose message
names the rule (matched below), leaving the engine exactly as it was: the block manager's
ref counts, keys, free queue, hash map and tables, the scheduler's queues and request
table, the generators, groups and host copies (course.testing.engine_checks.engine_state). After
all of them, the engine still finishes its work with outputs equal to the REFERENCE
package's solo greedy `generate`.
"""
import pytest
import torch

from course.testing.engine_checks import check_scheduler, engine_state
from course.testing.oracles import assert_engine_idle, make_engine, solo

pytestmark = pytest.mark.chapter(31)

VOCAB = 320                     # the tiny model's vocabulary
BUSY = dict(block_size=8, num_blocks=10, max_num_batched_tokens=48, enable_chunked_prefill=False,
            preemption_mode="swap", max_num_seqs=4)
PROMPTS = {"run0": list(range(10, 30)), "run1": list(range(40, 60)), "grp": list(range(70, 82)),
           "solo:1": [5, 6, 7, 8, 9]}
MAX_TOKENS = {"run0": 30, "run1": 30, "grp": 20, "solo:1": 10}


def busy_engine(serve, model):
    engine = make_engine(serve, model, **BUSY)
    for rid, prompt in PROMPTS.items():
        n = 2 if rid == "grp" else 1
        engine.add_request(rid, prompt, serve.request.SamplingParams(max_tokens=MAX_TOKENS[rid], n=n))
    for _ in range(200):
        engine.step()
        if engine.runner.swapped and engine.scheduler.running:
            break
    assert engine.runner.swapped, "the busy engine never swapped a request out: the fixture lost its point"
    assert engine.blocks.cached, "the busy engine has no cached blocks: the fixture lost its point"
    check_scheduler(engine.scheduler, "busy engine")
    return engine


@pytest.fixture
def busy(serve, tiny_model):
    return busy_engine(serve, tiny_model)


def P(serve, max_tokens=4, **kwargs):
    return serve.request.SamplingParams(max_tokens=max_tokens, **kwargs)


def a_preempted_id(engine):
    return next(r.request_id for r in engine.scheduler.waiting if r.swapped_out)


# name -> (call(engine, serve), words the ValueError must contain)
REQUEST_CASES = {
    "empty prompt": (lambda e, s: e.add_request("e", [], P(s)), r"prompt is empty"),
    "max_tokens 0": (lambda e, s: P(s, 0), r"max_tokens must be an integer >= 1"),
    "max_tokens negative, set after construction": (
        lambda e, s: e.add_request("m", [1, 2], _mutated(P(s), max_tokens=-3)), r"max_tokens must be an integer >= 1"),
    "token beyond the vocabulary": (
        lambda e, s: e.add_request("v", [1, 2, VOCAB], P(s)),
        rf"token {VOCAB} at prompt position 2 is outside the vocabulary \(0..{VOCAB - 1}\)"),
    "negative token": (lambda e, s: e.add_request("n", [5, -1], P(s)), r"token -1 .* outside the vocabulary"),
    "float token": (lambda e, s: e.add_request("f", [1, 2.0], P(s)), r"integer token ids"),
    "bool token": (lambda e, s: e.add_request("b", [True, 3], P(s)), r"integer token ids"),
    "text instead of token ids": (lambda e, s: e.add_request("t", "hello", P(s)), r"not text"),
    "float tensor prompt": (lambda e, s: e.add_request("ft", torch.tensor([1.0, 2.0]), P(s)), r"integer token ids"),
    "duplicate id (running)": (lambda e, s: e.add_request(e.scheduler.running[0].request_id, [1, 2], P(s)),
                               r"already in the engine"),
    "duplicate id (preempted, swapped out)": (lambda e, s: e.add_request(a_preempted_id(e), [1, 2], P(s)),
                                              r"already in the engine"),
    "group id over a live request": (lambda e, s: e.add_request("run1", [1, 2], P(s, n=2)), r"'run1' is already"),
    "plain id over a live group": (lambda e, s: e.add_request("grp", [1, 2], P(s)), r"'grp' is already"),
    "a sample id taken": (lambda e, s: e.add_request("solo", [1, 2], P(s, n=2)), r"'solo:1' is already"),
    "prompt + max_tokens beyond the pool": (lambda e, s: e.add_request("big", list(range(60)), P(s, 30)),
                                            r"more than the whole pool holds"),
    "beyond the model's positions": (lambda e, s: e.add_request("long", [1] * 10, P(s, 5000)), r"positions"),
    "prompt over the step budget, chunked prefill off": (
        lambda e, s: e.add_request("wide", [1] * 49, P(s, 2)), r"step budget and chunked prefill is off"),
    "request id not a string": (lambda e, s: e.add_request(7, [1, 2], P(s)), r"non-empty strings"),
    "empty request id": (lambda e, s: e.add_request("", [1, 2], P(s)), r"non-empty strings"),
    "priority not an integer": (lambda e, s: e.add_request("p", [1, 2], P(s), priority=1.5),
                                r"priority must be an integer"),
    "unhashable cache_key": (lambda e, s: e.add_request("c", [1, 2], P(s), cache_key=([1],)), r"cache_key"),
    # Block keys hash a salt's printed form: two tensors (or floats, or objects with their own
    # __repr__) that print alike would let two tenants read each other's K/V.
    "a tensor salt in cache_key": (lambda e, s: e.add_request("ct", [1, 2], P(s), cache_key=(torch.zeros(3),)),
                                   r"cache_key salts must be str, bytes or int"),
    "a float salt in cache_key": (lambda e, s: e.add_request("cf", [1, 2], P(s), cache_key=("tenant", 0.1)),
                                  r"cache_key salts must be str, bytes or int"),
    "a str subclass salt in cache_key": (lambda e, s: e.add_request("cs", [1, 2], P(s), cache_key=(_Salt("a"),)),
                                         r"cache_key salts must be str, bytes or int"),
    # generate() runs the engine until ITS prompts finish: queued requests would finish inside
    # it too, and their outputs would reach no step() their owner calls.
    "generate on an engine that holds requests": (lambda e, s: e.generate([[1, 2, 3]], P(s)),
                                                  r"generate: the engine already holds requests"),
    "params not SamplingParams": (lambda e, s: e.add_request("d", [1, 2], {"max_tokens": 4}),
                                  r"params must be a SamplingParams, got dict"),
    "arrival_time not a number": (lambda e, s: e.add_request("a", [1, 2], P(s), arrival_time="soon"),
                                  r"arrival_time must be a finite number"),
    "negative temperature": (lambda e, s: P(s, temperature=-1.0), r"temperature must be >= 0"),
    "top_p 0": (lambda e, s: P(s, top_p=0.0), r"top_p must be in \(0, 1\]"),
    "fractional stop token": (lambda e, s: P(s, stop_token_ids=[1.5]), r"stop_token_ids must be .*integer token ids"),
    "bool stop token": (lambda e, s: P(s, stop_token_ids=[True]),
                        r"stop_token_ids must be integer token ids, got \[True\]"),
    "logprobs with the simple sampler": (lambda e, s: e.add_request("lp", [1, 2], P(s, logprobs=2)), r"Chapter 34"),
    "penalties with the simple sampler": (lambda e, s: e.add_request("pe", [1, 2], P(s, presence_penalty=0.5)),
                                          r"presence_penalty is not honoured by the simple sampler"),
    "logit_bias with the simple sampler": (lambda e, s: e.add_request("lb", [1, 2], P(s, logit_bias={5: 1.0})),
                                           r"logit_bias is not honoured by the simple sampler"),
    "min_tokens with the simple sampler": (lambda e, s: e.add_request("mt", [1, 2], P(s, min_tokens=2)),
                                           r"min_tokens is not honoured by the simple sampler"),
    "abort with a non-string id": (lambda e, s: e.abort_request(["run0"]), r"non-empty strings"),
}


class _Salt(str):
    """A salt type that prints the same for every value."""
    def __repr__(self):
        return "'salt'"


def _mutated(params, **fields):
    for name, value in fields.items():
        setattr(params, name, value)
    return params


def _engine_with(serve, model, **config):
    return make_engine(serve, model, **{**BUSY, **config})


CONFIG_CASES = {
    "block_size 0": (dict(block_size=0), r"EngineConfig.block_size must be an integer >= 1"),
    "num_blocks 0": (dict(num_blocks=0), r"EngineConfig.num_blocks must be an integer >= 1"),
    "token budget 0": (dict(max_num_batched_tokens=0), r"EngineConfig.max_num_batched_tokens must be an integer >= 1"),
    "max_num_seqs 0": (dict(max_num_seqs=0), r"EngineConfig.max_num_seqs must be an integer >= 1"),
    "memory budget below one block": (dict(num_blocks=None, kv_cache_bytes=100), r"pool would hold no block"),
    "unknown attention backend": (dict(attention_backend="warp-speed"), r"unknown attention backend"),
    "unknown policy": (dict(policy="lifo"), r"EngineConfig.policy must be one of"),
    "unknown preemption mode": (dict(preemption_mode="drop"), r"EngineConfig.preemption_mode must be one of"),
    "negative chunk cap": (dict(long_prefill_token_threshold=-1),
                           r"long_prefill_token_threshold must be an integer >= 0"),
    "max_model_len 0": (dict(max_model_len=0), r"EngineConfig.max_model_len must be an integer >= 1"),
    "max_model_len beyond the model's positions": (dict(max_model_len=10**6),
                                                   r"max_model_len=1000000 exceeds the model's 1024 positions"),
    "GPU share above 1": (dict(gpu_memory_utilization=1.5), r"gpu_memory_utilization must be in \(0, 1\]"),
    "GPU share not a number": (dict(gpu_memory_utilization="most"), r"gpu_memory_utilization must be in \(0, 1\]"),
    "prefix caching not a bool": (dict(enable_prefix_caching="yes"), r"enable_prefix_caching must be True or False"),
    "CUDA graphs forced without CUDA or a graph-safe backend": (dict(cuda_graphs="on"), r"CUDA graph"),
}


def assert_unchanged(before, engine, name):
    after = engine_state(engine)
    changed = [k for k in before if before[k] != after[k]]
    assert not changed, (f"refusing '{name}' changed the engine: {changed}\n"
                         + "\n".join(f"  {k}: {before[k]!r}\n   -> {after[k]!r}" for k in changed))


# The refusals of add_request that must name the request they refuse, by case.
NAMED = {"empty prompt": "e", "token beyond the vocabulary": "v", "negative token": "n", "float token": "f",
         "bool token": "b", "text instead of token ids": "t", "float tensor prompt": "ft",
         "prompt + max_tokens beyond the pool": "big", "beyond the model's positions": "long",
         "priority not an integer": "p", "unhashable cache_key": "c", "a tensor salt in cache_key": "ct",
         "params not SamplingParams": "d", "arrival_time not a number": "a",
         "logprobs with the simple sampler": "lp", "logit_bias with the simple sampler": "lb"}


@pytest.mark.parametrize("name", list(REQUEST_CASES))
def test_bad_request_is_refused_and_changes_nothing(serve, busy, name):
    call, words = REQUEST_CASES[name]
    before = engine_state(busy)
    with pytest.raises(ValueError, match=words) as refused:
        call(busy, serve)
    if name in NAMED:
        assert f"request {NAMED[name]!r}" in str(refused.value), (
            f"a refusal names the request it refuses ({NAMED[name]!r}): {refused.value}")
    assert_unchanged(before, busy, name)


@pytest.mark.parametrize("name", list(CONFIG_CASES))
def test_bad_config_is_refused(serve, busy, tiny_model, name):
    fields, words = CONFIG_CASES[name]
    before = engine_state(busy)
    with pytest.raises(ValueError, match=words):
        _engine_with(serve, tiny_model, **fields)
    assert_unchanged(before, busy, name)


def test_bad_block_manager_sizes(serve):
    for args in ((0, 16), (4, 0)):
        with pytest.raises(ValueError, match=r"block"):
            serve.blocks.BlockManager(*args)


def test_aborting_unknown_or_finished_ids_is_a_no_op(serve, busy):
    """abort_request's contract: an id the engine does not hold (never added, or finished)
    returns None and touches nothing."""
    before = engine_state(busy)
    assert busy.abort_request("no-such-request") is None
    assert_unchanged(before, busy, "abort of an unknown id")
    finished = busy.add_request("quick", [1, 2, 3], P(serve, 1))
    while finished.status.name not in ("FINISHED_LENGTH", "FINISHED_STOPPED"):
        busy.step()
    before = engine_state(busy)
    assert busy.abort_request("quick") is None
    assert_unchanged(before, busy, "abort of a finished id")


def test_a_finished_group_frees_its_id(serve, tiny_model):
    engine = _engine_with(serve, tiny_model, num_blocks=32)
    first = engine.add_request("g", [1, 2, 3], P(serve, 2, n=2))
    while engine.has_unfinished:
        engine.step()
    assert all(r.status.finished for r in first)
    again = engine.add_request("g", [4, 5, 6], P(serve, 2))      # the id is free again, as a plain request
    assert engine.abort_request("g") is again, "abort_request('g') must reach the live request, not the old group"
    assert_engine_idle(engine)


def test_the_engine_finishes_its_work_after_every_refusal(serve, busy, tiny_model, ref_model):
    for call, words in REQUEST_CASES.values():
        with pytest.raises(ValueError, match=words):
            call(busy, serve)
    requests = {r.request_id: r for r in list(busy.scheduler.waiting) + list(busy.scheduler.running)}
    for _ in range(1000):
        if not busy.has_unfinished:
            break
        busy.step()
        check_scheduler(busy.scheduler, f"step {busy.steps}")
    assert_engine_idle(busy)
    for rid, request in requests.items():
        base = rid.split(":")[0] if rid.startswith("grp") else rid
        want = solo(ref_model, PROMPTS[base], MAX_TOKENS[base])
        assert request.output_token_ids == want, f"{rid}: {request.output_token_ids} != solo generate's {want}"
