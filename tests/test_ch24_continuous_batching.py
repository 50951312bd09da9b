"""Chapter 24 milestone: ContinuousBatchingEngine.

Oracle: the reference package's solo greedy `generate` on the reference tiny model, one
request at a time, with the same weights. Every request served by the engine, whatever else
shares its steps, must produce exactly those tokens. Beside parity, the tests pin down the
design of the chapter: prefill runs one request per forward call (in chunks when asked),
all decoding requests share one call per step, a freed slot is reused at the next step, and
stop tokens end a request with the stop token included.

The tiny model's greedy choices have wide margins (course.models.greedy_margins), so the
bit-level differences between a batched decode and a solo one never flip a token: these
tests are deterministic. They were run over 200 workload seeds once, all passing.
"""
import random

import pytest
import torch

from course.testing.milestone_helpers import assert_same_tokens
from course.testing.oracles import TINY_EOS as EOS
from course.testing.oracles import solo

pytestmark = pytest.mark.chapter(24)



def make_prompts(seed, count, low=3, high=60, vocab=256):
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(low, high))] for _ in range(count)]


def assert_same_request_tokens(request_id, expected, got):
    assert_same_tokens(f"request {request_id}", expected, got)


def serve(engine, requests):
    """Add (request_id, prompt, max_new[, stops]) and step to the end, checking the step's
    contract after every step (check_step). Returns (outputs, events_per_step)."""
    for request in requests:
        engine.add_request(*request)
    outputs = {r[0]: [] for r in requests}
    history = []
    finished = set()
    guard = 10_000
    while engine.has_unfinished:
        guard -= 1
        assert guard > 0, "engine.has_unfinished never became False (10,000 steps)"
        before = ([r.request_id for r in engine.waiting], {r.request_id: r.slot for r in engine.running},
                  engine.slots.count(None))
        events = engine.step()
        history.append(events)
        check_step(engine, len(history), before, events, finished)
        for request_id, tokens, _finished in events:
            assert request_id in outputs, f"step {len(history)}: unknown request id {request_id!r}"
            outputs[request_id].extend(tokens)
    return outputs, history


def check_step(engine, step, before, events, finished):
    """The contract of ContinuousBatchingEngine.step, seen from outside after one step."""
    waiting_before, slot_before, free_before = before
    waiting = [r.request_id for r in engine.waiting]
    admitted = len(waiting_before) - len(waiting)
    assert admitted == min(free_before, len(waiting_before)), (
        f"step {step}: {free_before} slots were free and {len(waiting_before)} requests waiting, and the step "
        f"admitted {admitted}: a step admits one waiting request per free slot, no more and no fewer")
    assert waiting == waiting_before[admitted:], (
        f"step {step}: waiting {waiting_before} became {waiting}: admission is first come, first served "
        f"(the oldest waiting request first)")
    for slot, request in enumerate(engine.slots):
        if request is None:
            continue
        assert request.slot == slot, (
            f"step {step}: request {request.request_id} sits in slot {slot} but its slot says {request.slot}")
        moved = slot_before.get(request.request_id, slot)
        assert moved == slot, (f"step {step}: request {request.request_id} moved from slot {moved} to slot {slot}: "
                               f"a running request keeps its slot")
    got = [request_id for request_id, _, _ in events]
    for request_id, tokens, _ in events:
        assert got.count(request_id) == 1 and len(tokens) == 1 and all(isinstance(t, int) for t in tokens), (
            f"step {step}: request {request_id} got {[e[1] for e in events if e[0] == request_id]}: a request gets at "
            f"most one token per step, and a mid-prompt chunk yields no token")
        assert request_id not in finished, (
            f"step {step}: request {request_id} got a token after it finished: a finished request is never run again")
    running = {r.request_id: r.slot for r in engine.running}
    for request_id, _, is_finished in events:
        if is_finished:
            finished.add(request_id)
            assert request_id not in running, (
                f"step {step}: request {request_id} finished but still holds slot {running[request_id]}: a finished "
                f"request gives its slot back in the step that finishes it")
    for request in engine.running:
        in_cache = request.num_prefilled + max(0, len(request.output_ids) - 1)
        assert engine.cache.lengths[request.slot] == in_cache, (
            f"step {step}: slot {request.slot} holds {engine.cache.lengths[request.slot]} positions but request "
            f"{request.request_id} has {in_cache} tokens in the cache: an admitted request starts on an empty slot "
            f"(cache length 0)")


class CallRecorder(torch.nn.Module):
    """Wraps a model and records the [B, T] shape of every forward call."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.cfg = inner.cfg
        self.calls = []

    @property
    def context_limit(self):
        return self.inner.context_limit

    def forward(self, input_ids, *args, **kwargs):
        self.calls.append(tuple(input_ids.shape))
        return self.inner(input_ids, *args, **kwargs)


def test_slot_rows_update_writes_each_row_at_its_own_length(impl):
    """SlotRows.update on a 3-slot cache of 6 positions, rows given out of slot order."""
    torch.manual_seed(0)
    cache = impl.continuous.SlotKVCache(1, 3, 2, 4, 6)
    for pool in cache.k + cache.v:
        pool.copy_(torch.randn_like(pool))
    before_k, before_v = cache.k[0].clone(), cache.v[0].clone()
    cache.lengths = [2, 0, 4]
    k, v = torch.randn(2, 2, 2, 4), torch.randn(2, 2, 2, 4)
    try:
        keys, values = cache.rows([2, 0]).update(0, k, v)
    except ValueError as error:
        pytest.fail(f"slot 2 at length 4 of 6 takes 2 more entries exactly; update raised {error}: a row may "
                    "fill its slot to slot_len")
    want_k, want_v = before_k.clone(), before_v.clone()
    want_k[2, :, 4:6], want_k[0, :, 2:4] = k[0], k[1]
    want_v[2, :, 4:6], want_v[0, :, 2:4] = v[0], v[1]
    assert torch.equal(cache.k[0], want_k) and torch.equal(cache.v[0], want_v), (
        "rows [slot 2 at length 4, slot 0 at length 2] with 2 new entries each: each slot must hold its row's "
        "new entries at its own length (slot 2 at 4..5, slot 0 at 2..3) and nothing else may change")
    assert cache.lengths == [2, 0, 4], f"update moved lengths to {cache.lengths}; advance() moves them"
    assert keys.shape == (2, 2, 6, 4), (
        f"returned keys of shape {tuple(keys.shape)}, expected (2, 2, 6, 4): every row's positions up to "
        "the longest row's new end")
    assert torch.equal(keys[0], want_k[2]) and torch.equal(keys[1], want_k[0]) and torch.equal(values[1], want_v[0]), (
        "the returned row b must be slot slot_ids[b]'s keys and values, in the order the rows were given")
    cache.lengths = [4, 0, 4]
    try:
        cache.rows([0]).update(0, k[:1], v[:1])
    except ValueError as error:
        pytest.fail(f"slot 0 at length 4 of 6 takes 2 more entries exactly; update raised {error}: a row may "
                    "fill its slot to slot_len")
    single_k, _ = cache.rows([1]).update(0, k[:1, :, :1], v[:1, :, :1])
    assert single_k.shape == (1, 2, 1, 4)
    cache.lengths = [6, 1, 4]
    history, _ = cache.rows([1]).update(0, k[:1], v[:1])
    assert history.shape == (1, 2, 3, 4) and torch.equal(history[0, :, :1], single_k[0]), (
        f"a single row at length 1 given 2 entries returned shape {tuple(history.shape)}: it must return "
        "the slot's keys so far (its history first), not only the new ones")
    snapshot = cache.k[0].clone()
    with pytest.raises(ValueError, match="slot 0"):
        cache.rows([1, 0]).update(0, k, v)
    assert torch.equal(cache.k[0], snapshot), "a row that would overflow its slot is refused before anything is written"


@pytest.mark.parametrize("chunk_size", [None, 7])
def test_every_request_matches_solo_generate(impl, tiny_model, ref_model, chunk_size):
    prompts = make_prompts(seed=1, count=9)
    max_new = [random.Random(i).randint(2, 24) for i in range(len(prompts))]
    engine = impl.continuous.ContinuousBatchingEngine(tiny_model, num_slots=4, slot_len=96,
                                                      chunk_size=chunk_size, eos_token_id=EOS)
    requests = [(f"r{i}", p, n) for i, (p, n) in enumerate(zip(prompts, max_new))]
    outputs, _ = serve(engine, requests)
    for request_id, prompt, n in requests:
        assert_same_request_tokens(request_id, solo(ref_model, prompt, n), outputs[request_id])


def test_run_helper_serves_work_items(impl, tiny_model, ref_model):
    items = impl.workloads.shared_prefix_workload(num_requests=6, prefix_len=40, question_len=(2, 12),
                                                  output_len=(3, 12), seed=3)
    engine = impl.continuous.ContinuousBatchingEngine(tiny_model, num_slots=3, slot_len=80, eos_token_id=EOS)
    outputs = engine.run(items)
    assert set(outputs) == {it.request_id for it in items}
    for it in items:
        assert_same_request_tokens(it.request_id, solo(ref_model, it.prompt_ids, it.max_tokens), outputs[it.request_id])


def test_one_prefill_call_per_request_and_one_decode_call_per_step(impl, tiny_model, ref_model):
    """4 requests, 4 slots, prompts of 5, 9, 13 and 17 tokens, 6 new tokens each.
    Step 1: four prefill calls [1, P] (each yields the first token).
    Steps 2-6: ONE decode call [4, 1] each. Total: 9 calls, 6 steps."""
    recorder = CallRecorder(tiny_model)
    engine = impl.continuous.ContinuousBatchingEngine(recorder, num_slots=4, slot_len=64, eos_token_id=EOS)
    prompts = [make_prompts(seed=5 + n, count=1, low=n, high=n)[0] for n in (5, 9, 13, 17)]
    outputs, history = serve(engine, [(f"r{i}", p, 6) for i, p in enumerate(prompts)])
    for i, p in enumerate(prompts):
        assert_same_request_tokens(f"r{i}", solo(ref_model, p, 6), outputs[f"r{i}"])
    expected_calls = [(1, 5), (1, 9), (1, 13), (1, 17)] + [(4, 1)] * 5
    assert sorted(recorder.calls[:4]) == expected_calls[:4] and recorder.calls[4:] == expected_calls[4:], (
        f"forward calls (batch, tokens) were {recorder.calls}; expected one [1, P] prefill call per request "
        f"in step 1, then one [4, 1] decode call per step")
    assert engine.forward_calls == len(recorder.calls) == 9, f"forward_calls = {engine.forward_calls}"
    assert engine.steps == len(history) == 6, f"steps = {engine.steps}, step() was called {len(history)} times"


def test_chunked_prefill_does_not_stall_decoding(impl, tiny_model, ref_model):
    """A short request is decoding when a 30-token prompt arrives; with chunk_size 8 the long
    prompt takes 4 steps of prefill (8 + 8 + 8 + 6 tokens, one [1, <=8] call per step) while
    the short request keeps getting one token every step."""
    recorder = CallRecorder(tiny_model)
    engine = impl.continuous.ContinuousBatchingEngine(recorder, num_slots=2, slot_len=64, chunk_size=8,
                                                      eos_token_id=EOS)
    short, long = make_prompts(seed=7, count=2, low=4, high=4)[0], make_prompts(seed=8, count=1, low=30, high=30)[0]
    engine.add_request("short", short, 12)
    first = engine.step()
    assert [e[0] for e in first] == ["short"], f"step 1 events: {first}"
    engine.add_request("long", long, 5)
    outputs = {"short": list(first[0][1]), "long": []}
    expected_calls = {2: [(1, 1), (1, 8)], 3: [(1, 1), (1, 8)], 4: [(1, 1), (1, 8)], 5: [(1, 1), (1, 6)], 6: [(2, 1)]}
    long_first_token_step = None
    for step in range(2, 40):
        if not engine.has_unfinished:
            break
        before = len(recorder.calls)
        events = {e[0]: e for e in engine.step()}
        calls = sorted(recorder.calls[before:])
        for request_id, tokens, _ in events.values():
            outputs[request_id].extend(tokens)
        if step in expected_calls:
            assert calls == expected_calls[step], (
                f"step {step}: forward calls (batch, tokens) {calls}, expected {expected_calls[step]} "
                f"(the decoding request's [1, 1] call plus one chunk of the next 8 prompt tokens, fewer only "
                f"for the prompt's last chunk)")
        if step <= 5:
            assert "short" in events and len(events["short"][1]) == 1, (
                f"step {step}: the decoding request got no token while the long prompt was prefilling "
                f"(events {list(events.values())})")
        if "long" in events and long_first_token_step is None:
            long_first_token_step = step
    assert long_first_token_step == 5, (
        f"a 30-token prompt in chunks of 8 should produce its first token at step 5 (4 chunk steps "
        f"starting at step 2), got step {long_first_token_step}")
    assert_same_request_tokens("short", solo(ref_model, short, 12), outputs["short"])
    assert_same_request_tokens("long", solo(ref_model, long, 5), outputs["long"])


def test_freed_slot_is_reused_at_the_next_step(impl, tiny_model, ref_model):
    """2 slots, 5 requests: never more than 2 in flight, and a waiting request is admitted
    (prefilled, first token out) in the step right after a slot frees."""
    prompts = make_prompts(seed=11, count=5, low=5, high=20)
    max_new = [3, 7, 4, 5, 2]
    engine = impl.continuous.ContinuousBatchingEngine(tiny_model, num_slots=2, slot_len=48, eos_token_id=EOS)
    requests = [(f"r{i}", p, n) for i, (p, n) in enumerate(zip(prompts, max_new))]
    outputs, history = serve(engine, requests)
    first_step, finish_step = {}, {}
    for step, events in enumerate(history, 1):
        for request_id, tokens, finished in events:
            if tokens:
                first_step.setdefault(request_id, step)
            if finished:
                finish_step[request_id] = step
    for step in range(1, len(history) + 1):
        live = [r for r in first_step if first_step[r] <= step and finish_step[r] >= step]
        assert len(live) <= 2, f"step {step}: requests {live} in flight with only 2 slots"
    # FCFS admission: a request starts the step after the earliest unclaimed finish.
    frees = sorted(finish_step[r] for r in ("r0", "r1"))
    for request_id in ("r2", "r3", "r4"):
        free_step = frees.pop(0)
        assert first_step[request_id] == free_step + 1, (
            f"request {request_id}: a slot freed at step {free_step} but its first token came at step "
            f"{first_step[request_id]} (expected step {free_step + 1})")
        frees = sorted(frees + [finish_step[request_id]])
    for request_id, prompt, n in requests:
        assert_same_request_tokens(request_id, solo(ref_model, prompt, n), outputs[request_id])


def test_stop_tokens_and_eos_end_a_request(impl, tiny_model, ref_model):
    prompts = make_prompts(seed=13, count=3, low=6, high=30)
    plain = [solo(ref_model, p, 16) for p in prompts]
    # Stop request 0 at the token its solo run emits 5th; request 1 keeps running.
    stop = plain[0][4]
    engine = impl.continuous.ContinuousBatchingEngine(tiny_model, num_slots=3, slot_len=64, eos_token_id=EOS)
    outputs, history = serve(engine, [("r0", prompts[0], 16, (stop,)), ("r1", prompts[1], 16)])
    assert_same_request_tokens("r0", solo(ref_model, prompts[0], 16, stop_token_ids=(stop,)), outputs["r0"])
    assert outputs["r0"][-1] == stop, f"request r0: the stop token {stop} must end the output (got {outputs['r0']})"
    assert_same_request_tokens("r1", plain[1], outputs["r1"])
    finished = [e[0] for events in history for e in events if e[2]]
    assert sorted(finished) == ["r0", "r1"], f"finished events {finished}: each request finishes exactly once"
    # The engine's eos_token_id: make request 2's 3rd greedy token the EOS.
    eos = plain[2][2]
    engine = impl.continuous.ContinuousBatchingEngine(tiny_model, num_slots=2, slot_len=64, eos_token_id=eos)
    outputs, _ = serve(engine, [("r2", prompts[2], 16)])
    expected = solo(ref_model, prompts[2], 16, eos_token_id=eos)
    assert_same_request_tokens("r2", expected, outputs["r2"])


def test_request_that_cannot_fit_a_slot_is_refused(impl, tiny_model):
    engine = impl.continuous.ContinuousBatchingEngine(tiny_model, num_slots=2, slot_len=32, eos_token_id=EOS)
    with pytest.raises(ValueError):
        engine.add_request("too-long", list(range(30)), 8)


def test_bfloat16_engine_packs_its_linears_and_keeps_the_plain_tokens(impl, tiny_model):
    """In bfloat16 on a CPU the engine lays its linear weights out for oneDNN once, when it is
    built (devices.prepack_linears, as Chapter 31's engine does); the greedy tokens must be
    those of the same engine on nn.Linear's own forward."""
    if next(tiny_model.parameters()).device.type != "cpu" or not torch.backends.mkldnn.is_available():
        pytest.skip("weights are packed for oneDNN on a CPU only")
    model = tiny_model.to(torch.bfloat16)
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    requests = [(f"r{i}", p, 6) for i, p in enumerate(make_prompts(seed=4, count=5))]
    tokens = []
    for packed in (True, False):
        engine = impl.continuous.ContinuousBatchingEngine(model, num_slots=3, slot_len=96, eos_token_id=None)
        assert all(isinstance(vars(m).get("forward"), impl.devices.PackedLinear) for m in linears), \
            "a bfloat16 model on a CPU must have its linear weights packed when the engine is built"
        if not packed:
            for m in linears:
                del m.forward
        tokens.append(serve(engine, requests)[0])
    assert tokens[0] == tokens[1], "packing the weights must not change a greedy token"
