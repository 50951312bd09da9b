"""Engine core reliability (issue 10): one request can never hurt another.

- Isolation: nothing a request carries makes a step fail for the others. Temperatures near
  zero and filters below float32's range are sampled robustly (Chapter 8's `sample`); a
  request whose own processing still fails inside a step (its sampling, its stop check)
  finishes alone, aborted, with the error on its output, its blocks freed, while every other
  request goes on and draws exactly what it would have drawn.
- All-or-nothing: a seed torch refuses, a group with a taken sample id, lists of the wrong
  length, a batched prompt: each is a ValueError before anything changes; the engine keeps
  its own copies of what the caller may still mutate.
- `generate()` leaves nothing behind when a step raises.
Oracle: the REFERENCE package's solo `generate` (course.testing.oracles.solo).
"""
import pytest
import torch

from course.testing.engine_checks import engine_state
from course.testing.oracles import TINY_EOS, assert_engine_idle, make_engine, solo

pytestmark = pytest.mark.chapter(31)

PROMPTS = {"a": list(range(10, 23)), "b": list(range(40, 47)), "c": [5, 6, 7, 8, 9, 10, 11, 12, 13]}


def P(serve, max_tokens=6, **kwargs):
    return serve.request.SamplingParams(max_tokens=max_tokens, **kwargs)


def engine_for(serve, model, **config):
    return make_engine(serve, model, **{"block_size": 4, "num_blocks": 64, **config})


def drain(engine, limit=500):
    outputs = {}
    for _ in range(limit):
        if not engine.has_unfinished:
            break
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out
    assert_engine_idle(engine)
    return outputs


@pytest.mark.parametrize("extreme", [dict(temperature=1e-39), dict(temperature=1e-30, top_p=0.5),
                                     dict(temperature=1.0, top_p=1e-39), dict(temperature=1e-6, min_p=1e-320)],
                         ids=["temperature 1e-39", "temperature 1e-30", "top_p 1e-39", "temperature 1e-6"])
def test_extreme_sampling_parameters_do_not_stall_the_engine(serve, tiny_model, ref_model, extreme):
    """Found case 1: a 1e-39 temperature or top_p made every step raise. Such a request is
    greedy (near-zero temperature) or keeps only its top token (tiny top_p): solo greedy output."""
    engine = engine_for(serve, tiny_model)
    engine.add_request("extreme", PROMPTS["a"], P(serve, **extreme))
    engine.add_request("plain", PROMPTS["b"], P(serve))
    outputs = drain(engine)
    for rid, prompt in (("extreme", PROMPTS["a"]), ("plain", PROMPTS["b"])):
        assert outputs[rid].error is None and outputs[rid].output_token_ids == solo(ref_model, prompt, 6), (
            f"{extreme}: request {rid} gave {outputs[rid].output_token_ids} ({outputs[rid].error}), "
            f"solo greedy generate gives {solo(ref_model, prompt, 6)}")


class FailingFor:
    """A sampler that fails whenever request `bad` is among its requests, else SimpleSampler."""

    def __init__(self, inner, bad):
        self.inner, self.bad = inner, bad

    def __call__(self, logits, requests, generators):
        if any(r.request_id == self.bad for r in requests):
            raise RuntimeError("probability tensor contains inf or nan")
        return self.inner(logits, requests, generators)


def test_a_request_whose_sampling_fails_is_aborted_alone(serve, tiny_model, ref_model):
    engine = engine_for(serve, tiny_model)
    engine.sampler = FailingFor(engine.sampler, "bad")
    engine.add_request("a", PROMPTS["a"], P(serve))
    engine.add_request("seeded", PROMPTS["c"], P(serve, temperature=0.9, seed=3))
    engine.add_request("bad", PROMPTS["b"], P(serve))
    outputs = drain(engine)
    bad = outputs["bad"]
    assert bad.finished and bad.finish_reason == "abort" and bad.output_token_ids == [], (
        f"the failing request ends aborted with no tokens: {bad}")
    assert bad.error and "'bad'" in bad.error and "sampling" in bad.error and "inf or nan" in bad.error, (
        f"the error on its output names the request, what failed and why: {bad.error!r}")
    assert outputs["a"].output_token_ids == solo(ref_model, PROMPTS["a"], 6) and outputs["a"].error is None
    alone = engine_for(serve, tiny_model)
    alone.add_request("seeded", PROMPTS["c"], P(serve, temperature=0.9, seed=3))
    assert outputs["seeded"].output_token_ids == drain(alone)["seeded"].output_token_ids, (
        "a seeded request must draw the same tokens whether or not another request's sampling failed beside it")


def test_a_request_whose_stop_check_fails_is_aborted_alone(serve, tiny_model, ref_model):
    class BrokenStops(tuple):
        def __contains__(self, token):          # the stop rules ask whether the new token is a stop token
            raise KeyError("state 17")

    engine = engine_for(serve, tiny_model)
    engine.add_request("a", PROMPTS["a"], P(serve))
    broken = engine.add_request("broken", PROMPTS["b"], P(serve))
    broken.params.stop_token_ids = BrokenStops()
    try:
        outputs = drain(engine)
    except KeyError as exc:
        pytest.fail(f"one request's failure is never the step's: request 'broken''s stop check raised {exc!r}, "
                    f"and the step raised it instead of finishing that request alone, as aborted")
    assert outputs["broken"].finish_reason == "abort" and "'broken'" in outputs["broken"].error
    assert "stop" in outputs["broken"].error and "state 17" in outputs["broken"].error
    assert outputs["a"].output_token_ids == solo(ref_model, PROMPTS["a"], 6)


def busy(serve, model):
    engine = engine_for(serve, model, num_blocks=24)
    engine.add_request("run", PROMPTS["a"], P(serve, 12))
    engine.add_request("grp", PROMPTS["b"], P(serve, 12, n=2))
    engine.step()
    return engine


# name -> (call(engine, serve), words the ValueError must contain)
REFUSED = {
    "seed 2**63 (64 bits, signed)": (lambda e, s: e.add_request("s", [1, 2], P(s, seed=2 ** 63)), r"seed"),
    "seed + n - 1 beyond 64 bits": (lambda e, s: e.add_request("s", [1, 2], P(s, seed=2 ** 63 - 1, n=2)),
                                    r"seed \+ n - 1"),
    "a sample id that is a live group's id": (lambda e, s: e.add_request("grp:0", [1, 2], P(s)), r"'grp:0'"),
    "a group whose sample id is a live group": (lambda e, s: _group_over_group(e, s), r"'twin:0'"),
    "a [1, T] tensor prompt": (lambda e, s: e.add_request("t", torch.tensor([[1, 2, 3]]), P(s)), r"1-D"),
    "a nested list prompt": (lambda e, s: e.add_request("t", [[1, 2, 3]], P(s)), r"integer token ids"),
}

# generate() refuses an engine holding requests (test_engine_rules.py): these meet one whose
# request finished (its cached blocks still there).
GENERATE_REFUSED = {
    "generate: fewer priorities than prompts": (
        lambda e, s: e.generate([[1, 2], [3, 4], [5, 6]], P(s), priorities=[0, 1]), r"2 priorities for 3 prompts"),
    "generate: more params than prompts": (
        lambda e, s: e.generate([[1, 2]], [P(s), P(s)]), r"2 SamplingParams for 1 prompts"),
    "generate: one bad prompt among good ones": (
        lambda e, s: e.generate([[1, 2], [3, 10_000]], P(s)), r"outside the vocabulary"),
}


def _group_over_group(engine, serve):
    engine.add_request("twin:0", [1, 2], P(serve, n=2))   # a live group named like a sample of "twin"
    engine_state_before = engine_state(engine)
    try:
        engine.add_request("twin", [1, 2], P(serve, n=2))
    finally:
        assert engine_state(engine) == engine_state_before
        engine.abort_request("twin:0")


@pytest.mark.parametrize("name", list(REFUSED) + list(GENERATE_REFUSED))
def test_refused_before_any_change(serve, tiny_model, name):
    if name in GENERATE_REFUSED:
        engine = engine_for(serve, tiny_model, num_blocks=24)
        engine.add_request("done", PROMPTS["a"], P(serve, 4))
        drain(engine)
    else:
        engine = busy(serve, tiny_model)
    call, words = {**REFUSED, **GENERATE_REFUSED}[name]
    before = engine_state(engine)
    with pytest.raises(ValueError, match=words):
        call(engine, serve)
    after = engine_state(engine)
    changed = [k for k in before if before[k] != after[k]]
    assert not changed, f"refusing '{name}' changed the engine: {changed}"


def test_an_abort_never_reaches_another_request(serve, tiny_model):
    """A group's sample that finished frees its id; a new request under that id is not the
    group's: aborting the group must not reach it."""
    engine = busy(serve, tiny_model)
    engine.abort_request("grp:0")
    stranger = engine.add_request("grp:0", [1, 2, 3], P(serve))
    result = engine.abort_request("grp")
    assert result[0] is None and result[1].request_id == "grp:1", f"aborting the group returned {result}"
    assert stranger.status.name in ("WAITING", "RUNNING"), "aborting group 'grp' reached the newcomer 'grp:0'"
    engine.abort_request("run")
    engine.abort_request("grp:0")
    assert_engine_idle(engine)


def test_the_engine_copies_what_the_caller_may_change(serve, tiny_model, ref_model):
    engine = engine_for(serve, tiny_model)
    params, prompt = P(serve, 6), list(PROMPTS["a"])
    request = engine.add_request("a", prompt, params)
    params.max_tokens, params.temperature = 1, 5.0
    prompt.append(99)
    assert request.params.max_tokens == 6 and request.params.temperature == 0.0 and request.params is not params
    assert drain(engine)["a"].output_token_ids == solo(ref_model, PROMPTS["a"], 6)


def test_generate_cleans_up_when_a_step_raises(serve, tiny_model, ref_model):
    """Found case 3: generate() left its requests in the engine when step() raised, so every
    later call failed too."""
    engine = engine_for(serve, tiny_model)
    real_execute, calls = engine.runner.execute, []

    def fails_once(batch):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("device lost")
        return real_execute(batch)

    engine.runner.execute = fails_once
    with pytest.raises(RuntimeError, match="device lost"):
        engine.generate([PROMPTS["a"], PROMPTS["b"]], P(serve, 4, n=2))
    assert_engine_idle(engine, "after a generate whose step raised")
    outs = engine.generate([PROMPTS["a"], PROMPTS["c"]], P(serve, 4))
    assert [o.output_token_ids for o in outs] == [solo(ref_model, PROMPTS["a"], 4), solo(ref_model, PROMPTS["c"], 4)]


def test_debug_checks_run_inside_every_step(serve, tiny_model, monkeypatch):
    """EngineConfig(debug_checks=True) (or COURSE_ENGINE_DEBUG_CHECKS=1) checks the invariants
    of course.testing.engine_checks inside step(): a corrupted block manager is caught at once."""
    for how in ("config", "environment"):
        if how == "environment":
            monkeypatch.setenv("COURSE_ENGINE_DEBUG_CHECKS", "1")
        engine = engine_for(serve, tiny_model, debug_checks=how == "config")
        engine.add_request("a", PROMPTS["a"], P(serve))
        engine.step()
        engine.blocks.ref_count[engine.blocks.req_blocks["a"][0]] += 1      # a leak the step cannot see
        with pytest.raises(AssertionError, match="ref count"):
            engine.step()
    monkeypatch.delenv("COURSE_ENGINE_DEBUG_CHECKS")
    quiet = engine_for(serve, tiny_model)
    assert quiet.checks is None, "debug checks are opt-in"


def test_eos_of_the_oracles_is_the_tiny_models(tiny_model):
    assert tiny_model.cfg.eos_token_id == TINY_EOS


def test_a_sampler_that_loses_rows_is_caught(serve, tiny_model, ref_model):
    """A sampler answering fewer token lists than requests is not silently zipped short:
    the engine samples each request alone, and the ones still failing end with the error."""
    class DropsTheLast:
        def __init__(self, inner):
            self.inner = inner

        def __call__(self, logits, requests, generators):
            tokens, logprobs = self.inner(logits, requests, generators)
            return tokens[:-1], logprobs

    engine = engine_for(serve, tiny_model)
    engine.sampler = DropsTheLast(engine.sampler)
    engine.add_request("a", PROMPTS["a"], P(serve))
    engine.add_request("b", PROMPTS["b"], P(serve))
    outputs = drain(engine)
    assert all(o.finish_reason == "abort" and o.error for o in outputs.values()), (
        f"alone, each request gets no token from this sampler and must end with an error: {outputs}")


def test_an_aborted_request_reports_the_error_type_and_logs_it(serve, tiny_model, caplog):
    """The output of a request aborted by its own failure carries no new tokens and an error
    naming the exception's type and text; the same line goes to the engine's log at ERROR
    level with the exception attached (its traceback), and the request's blocks are free."""
    import logging

    engine = engine_for(serve, tiny_model)
    engine.sampler = FailingFor(engine.sampler, "bad")
    engine.add_request("bad", PROMPTS["b"], P(serve))
    with caplog.at_level(logging.ERROR):
        (out,) = engine.step()
    assert out.request_id == "bad" and out.new_token_ids == [] and out.finish_reason == "abort", out
    assert out.error == "request 'bad': sampling failed: RuntimeError: probability tensor contains inf or nan", (
        out.error)
    logged = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert [r.getMessage() for r in logged] == [out.error], f"log: {[r.getMessage() for r in logged]}"
    assert logged[0].exc_info and isinstance(logged[0].exc_info[1], RuntimeError), "the traceback is logged"
    assert_engine_idle(engine, "after a request aborted by its own failure")


def test_seed_zero_is_a_seed_and_an_abort_forgets_the_generator(serve, tiny_model):
    """seed=0 seeds the request's own generator with 0 (it is not "no seed"): its draws differ
    from seed=1's. An aborted seeded request leaves no generator behind: a later unseeded
    request under the same id draws from the engine's generator, as in a fresh engine."""
    def sampled(**kwargs):
        return P(serve, 8, temperature=1.0, **kwargs)

    engine = engine_for(serve, tiny_model)
    engine.add_request("zero", PROMPTS["a"], sampled(seed=0))
    engine.add_request("one", PROMPTS["a"], sampled(seed=1))
    outs = drain(engine)
    assert outs["zero"].output_token_ids != outs["one"].output_token_ids, (
        f"seeds 0 and 1 drew the same tokens {outs['one'].output_token_ids}: seed 0 was not used as a seed")
    fresh = engine_for(serve, tiny_model)
    fresh.add_request("x", PROMPTS["b"], sampled())
    engine = engine_for(serve, tiny_model)
    engine.add_request("x", PROMPTS["b"], sampled(seed=5))
    engine.abort_request("x")
    engine.add_request("x", PROMPTS["b"], sampled())
    assert drain(engine)["x"].output_token_ids == drain(fresh)["x"].output_token_ids, (
        "an unseeded request drew from the generator of an aborted seeded request with the same id")


def test_unseeded_requests_draw_from_the_engines_seeded_generator(serve, tiny_model):
    """EngineConfig.seed makes unseeded sampled requests reproducible: two engines with the
    same seed draw the same tokens whatever torch's global generator did in between."""
    outputs = []
    for global_seed in (1, 2):
        torch.manual_seed(global_seed)
        engine = engine_for(serve, tiny_model, seed=7)
        engine.add_request("x", PROMPTS["a"], P(serve, 8, temperature=1.0))
        outputs.append(drain(engine)["x"].output_token_ids)
    assert outputs[0] == outputs[1], f"same EngineConfig.seed, different draws: {outputs}"
