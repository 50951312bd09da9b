"""Chapter 33 milestone: decode buckets and CUDA graphs, the fused add + RMSNorm, async scheduling.

Oracles: the reference package's solo greedy `generate` (course.testing.oracles.solo) and the
synchronous, unpadded, unfused engine of the implementation under test for whole-engine
outputs (greedy outputs identical, token for token); torch's own operators for the fused
kernel (x + delta, then Chapter 4's formula written out here in float64-free torch ops);
course.testing.oracles.assert_engine_idle for block accounting. The CUDA paths (graph capture and
replay, the stream/event device queue) run only where torch sees a GPU; on a CPU the same
padded static path runs eagerly (cuda_graphs="static") and the device queue runs inline or
on a worker thread.
"""
import json
import os
import random

import pytest
import torch

from course.testing.oracles import assert_engine_idle, solo

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytestmark = pytest.mark.chapter(33)

EOS = 257
BLOCK = 16
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs and streams need a GPU")


@pytest.fixture(scope="module")
def graphs(impl):
    return impl.load("serve.graphs")


@pytest.fixture(scope="module")
def overlap(impl):
    return impl.load("serve.overlap")


def five_requests(seed=0):
    """Five prompts (one shares two blocks with another) and their output lengths."""
    rng = random.Random(seed)
    tokens = lambda n: [rng.randrange(256) for _ in range(n)]   # noqa: E731
    r1 = tokens(37)
    prompts = {"r0": tokens(5), "r1": r1, "r3": tokens(21), "r4": tokens(50)}
    prompts["r2"] = r1[:2 * BLOCK] + tokens(14)
    max_tokens = {"r0": 24, "r1": 30, "r2": 20, "r3": 26, "r4": 28}
    return prompts, max_tokens


def serve_all(serve, model, prompts, max_tokens, stop=(), **config):
    engine = serve.engine.EngineCore(model, serve.config.EngineConfig(block_size=BLOCK, **config), eos_token_id=EOS)
    rids = list(prompts)
    params = [serve.request.SamplingParams(max_tokens=max_tokens[r], stop_token_ids=list(stop)) for r in rids]
    results = engine.generate([prompts[r] for r in rids], params)
    assert_engine_idle(engine, f"after serving with {config}")
    return engine, {rid: out.output_token_ids for rid, out in zip(rids, results)}


def expect_same(label, got, want):
    for rid in want:
        if got[rid] != want[rid]:
            i = next((k for k, (a, b) in enumerate(zip(want[rid], got[rid])) if a != b),
                     min(len(want[rid]), len(got[rid])))
            pytest.fail(f"[{label}] request {rid}: output token {i} differs from the synchronous engine\n"
                        f"  expected {want[rid]}\n  got      {got[rid]}")


_BASELINE: dict = {}


@pytest.fixture
def baseline(serve, tiny_model, ref_model):
    """The synchronous, unpadded, unfused engine's outputs, checked against solo generate
    (computed once per implementation and device)."""
    key = (serve.engine.__name__, str(next(tiny_model.parameters()).device))
    if key not in _BASELINE:
        prompts, max_tokens = five_requests()
        _, outputs = serve_all(serve, tiny_model, prompts, max_tokens, num_blocks=64)
        for rid, prompt in prompts.items():
            assert outputs[rid] == solo(ref_model, prompt, max_tokens[rid], EOS), f"baseline {rid} != solo generate"
        _BASELINE[key] = prompts, max_tokens, outputs
    return _BASELINE[key]


# --- 1. buckets and the static path ------------------------------------------------------------------

def test_bucket_sizes(graphs):
    assert graphs.bucket_sizes(16) == [1, 2, 4, 8, 16]
    assert graphs.bucket_sizes(13) == [1, 2, 4, 8, 13], "max_num_seqs is always a bucket"
    assert graphs.bucket_sizes(1) == [1]
    for bad in (0, -3, True, 2.0):
        with pytest.raises(ValueError, match="max batch"):
            graphs.bucket_sizes(bad)


def static_engine(serve, model, **config):
    return serve.engine.EngineCore(model, serve.config.EngineConfig(
        **{"block_size": BLOCK, "num_blocks": 32, "max_num_seqs": 8, "cuda_graphs": "static", **config}),
        eos_token_id=EOS)


def decoding_requests(serve, count, lengths=(5, 18, 33, 9, 16, 2, 40)):
    """`count` requests that each have a prompt in the cache and one token to decode."""
    out = []
    for i in range(count):
        n = lengths[i % len(lengths)]
        request = serve.request.Request(f"d{i}", [(7 * i + j) % 256 for j in range(n)])
        request.num_computed_tokens = n - 1
        out.append(request)
    return out


def block_tables(requests, start=0):
    tables, nxt = {}, start
    for r in requests:
        need = -(-r.num_tokens // BLOCK)
        tables[r.request_id] = list(range(nxt, nxt + need))
        nxt += need
    return tables


def test_bucket_choice_and_what_may_be_padded(serve, tiny_model):
    runner = static_engine(serve, tiny_model).runner
    g = runner.graphs
    assert g is not None and not g.use_graphs, "cuda_graphs='static' runs the padded path eagerly"
    assert [g.bucket_for(n) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, None]
    decodes = decoding_requests(serve, 3)
    assert g.pad_size([(r, 1) for r in decodes]) == 4
    chunk = serve.request.Request("chunk", list(range(20)))
    assert g.pad_size([(decodes[0], 1), (chunk, 8)]) is None, "a prefill chunk makes the step mixed: no padding"
    chunk.num_computed_tokens = 7
    assert g.pad_size([(chunk, 1)]) is None, "a one-token mid-prompt chunk samples nothing: not a decode"


def test_load_inputs_writes_into_the_same_buffers(serve, tiny_model):
    runner = static_engine(serve, tiny_model).runner
    g = runner.graphs
    for buffer in (g.input_ids, g.positions, g.slot_mapping, g.seq_lens, g.block_table):
        buffer.fill_(99)                       # stale values of an earlier, bigger step
    addresses = [t.data_ptr() for t in (g.input_ids, g.positions, g.slot_mapping, g.seq_lens, g.block_table)]
    decodes = decoding_requests(serve, 3)
    batch = serve.batch.build_batch([(r, 1) for r in decodes], block_tables(decodes), BLOCK, "cpu", pad_to=4)
    assert g.can_run(batch)
    size = g.load_inputs(batch)
    assert size == 4, (
        f"load_inputs returns the batch's bucket size (3 requests padded to 4: the graph to replay), got {size}")
    assert [t.data_ptr() for t in (g.input_ids, g.positions, g.slot_mapping, g.seq_lens, g.block_table)] \
        == addresses, "load_inputs must copy INTO the static buffers: a captured graph keeps their addresses"
    assert g.input_ids[:4].tolist() == batch.input_ids.tolist()
    assert g.positions[:4].tolist() == [4, 17, 32, 0]
    assert g.slot_mapping[:4].tolist() == batch.meta.slot_mapping.tolist() and g.slot_mapping[3] == -1
    assert g.seq_lens[:4].tolist() == [5, 18, 33, 0], \
        f"seq_lens hold {g.seq_lens[:4].tolist()}: the batch's meta.seq_lens (the new token included), 0 on padding"
    width = batch.meta.block_table.shape[1]
    assert torch.equal(g.block_table[:4, :width], batch.meta.block_table)
    assert int(g.block_table[:4, width:].abs().sum()) == 0, "columns past the batch's table must be 0, not stale"
    assert g.query_start_loc[:5].tolist() == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("backend", ["reference", "vectorised"])
def test_padded_static_step_equals_the_unpadded_step(serve, tiny_model, backend):
    """Same decode step, two ways: unpadded through FlatModel, padded 5 -> 8 through the
    static buffers. Real rows' logits agree; the pools differ only in the scratch block."""
    plain = static_engine(serve, tiny_model, cuda_graphs="off", attention_backend=backend).runner
    padded = static_engine(serve, tiny_model, attention_backend=backend).runner
    gen = torch.Generator().manual_seed(1)
    for a, b in zip(plain.kv_caches, padded.kv_caches):
        for x, y in zip(a, b):
            y.copy_(x.copy_(torch.randn(x.shape, generator=gen)))
    decodes = decoding_requests(serve, 5)
    scheduled, tables = [(r, 1) for r in decodes], block_tables(decodes)
    want = plain.execute(plain.prepare(scheduled, tables))
    batch = padded.prepare(scheduled, tables)
    assert batch.meta.num_reqs == 8 and batch.meta.slot_mapping[5:].tolist() == [-1] * 3, "5 decodes pad to 8"
    got = padded.execute(batch)
    assert padded.graphs.runs["eager"] == 1, "the padded decode step must go through the GraphRunner"
    assert got.shape == want.shape == (5, tiny_model.cfg.vocab_size)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), f"padded logits differ by {(got - want).abs().max()}"
    for layer, (a, b) in enumerate(zip(plain.kv_caches, padded.kv_caches)):
        for x, y in zip(a, b):
            assert torch.allclose(x[:-1], y[:-1], atol=1e-6), f"layer {layer}: a padding row wrote a real block"


@pytest.mark.parametrize("backend", ["reference", "vectorised"])
def test_engine_with_static_graph_path_equals_the_synchronous_engine(serve, tiny_model, baseline, backend):
    prompts, max_tokens, want = baseline
    engine, got = serve_all(serve, tiny_model, prompts, max_tokens, num_blocks=64, cuda_graphs="static",
                            attention_backend=backend)
    expect_same(f"static graphs, {backend}", got, want)
    assert engine.runner.graphs.runs["eager"] > 0, "no decode step went through the padded path"


def lying_meta(serve, meta):
    """The same device tensors with host lists that lie (what a replayed graph sees)."""
    return serve.batch.BatchMeta(meta.query_start_loc, meta.seq_lens, meta.block_table, meta.slot_mapping,
                                 meta.block_size, list(meta.query_start_loc_cpu), [1] * meta.num_reqs, 1, 1)


def backend_objects(serve, impl):
    out = {"reference": serve.backends.get_backend("reference"), "vectorised": serve.backends.get_backend("vectorised")}
    try:
        import triton  # noqa: F401
        out["triton"] = serve.backends.get_backend("triton")
    except ImportError:
        pass
    return out


def test_graph_safety_is_what_each_backend_declares(serve, impl, graphs):
    """A graph replays the host decisions of its capture. Feed each backend a decode step
    whose host lists lie: a graph-safe backend must not notice."""
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    decodes = decoding_requests(serve, 3)
    tables = block_tables(decodes)
    meta = serve.batch.build_batch([(r, 1) for r in decodes], tables, BLOCK, device).meta
    gen = torch.Generator().manual_seed(2)
    pools = tuple(torch.randn(12, BLOCK, 2, 16, generator=gen).to(device) for _ in "kv")
    q = torch.randn(3, 4, 16, generator=gen).to(device)
    for name, backend in backend_objects(serve, impl).items():
        honest = backend.forward(q, pools, meta)
        fooled = backend.forward(q, pools, lying_meta(serve, meta))
        safe = torch.allclose(honest, fooled, atol=1e-6)
        assert safe == graphs.graph_safe(backend), (
            f"backend {name!r}: graph_safe() says {graphs.graph_safe(backend)}, but with lying host lists its "
            f"output {'did not change' if safe else 'changed'}")
    assert not graphs.graph_safe(serve.backends.get_backend("reference"))


def test_cuda_graphs_on_is_refused_where_it_cannot_run(serve, tiny_model):
    with pytest.raises(ValueError, match="CUDA graph"):
        static_engine(serve, tiny_model, cuda_graphs="on")          # reference backend: never graph-safe


# --- 2. the fused add + RMSNorm ---------------------------------------------------------------------------

def unfused(x, delta, weight, eps):
    """The oracle: torch ops, the order Chapter 4's RMSNorm prescribes."""
    s = x + delta
    normed = (s.float() * torch.rsqrt(s.float().pow(2).mean(-1, keepdim=True) + eps)).to(s.dtype)
    return weight * normed, s


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_torch_fallback_equals_the_unfused_ops(impl, dtype):
    fused = impl.load("serve.fused")
    gen = torch.Generator().manual_seed(3)
    x, delta = (torch.randn(7, 64, generator=gen).to(dtype) for _ in range(2))
    weight = (1 + 0.1 * torch.randn(64, generator=gen)).to(dtype)
    got, want = fused.add_rms_norm(x, delta, weight, 1e-6), unfused(x, delta, weight, 1e-6)
    assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0]), "the fallback must round as the ops do"


@pytest.fixture(scope="module")
def fused_kernels(impl):
    pytest.importorskip("triton")
    return impl.load("fused_kernels")


@pytest.mark.parametrize("rows, dim", [(5, 64), (3, 24), (1, 8)])
def test_fused_triton_kernel_matches_torch_ops(fused_kernels, rows, dim):
    """float32: the kernel's sum of squares runs in another order than torch's mean: atol 1e-5."""
    device = torch.device("cpu") if fused_kernels.interpreting() else torch.device("cuda")
    gen = torch.Generator().manual_seed(rows * dim)
    x, delta = (torch.randn(rows, dim, generator=gen) for _ in range(2))
    weight = 1 + 0.1 * torch.randn(dim, generator=gen)
    normed, summed = fused_kernels.fused_add_rms_norm(x.to(device), delta.to(device), weight.to(device), 1e-6)
    want_normed, want_sum = unfused(x, delta, weight, 1e-6)
    assert torch.equal(summed.cpu(), want_sum), "the residual sum must be exactly x + delta"
    assert torch.allclose(normed.cpu(), want_normed, atol=1e-5, rtol=1e-5), (
        f"dim {dim}: fused norm differs by {(normed.cpu() - want_normed).abs().max()}; out is weight times "
        "rms_norm of the residual sum x + delta, and the mean of squares is over dim (masked lanes past dim "
        "must not count)")


@needs_cuda
def test_fused_triton_kernel_in_bfloat16_on_the_gpu(fused_kernels):
    gen = torch.Generator().manual_seed(4)
    x, delta = (torch.randn(33, 1024, generator=gen).cuda().bfloat16() for _ in range(2))
    weight = (1 + 0.1 * torch.randn(1024, generator=gen)).cuda().bfloat16()
    normed, summed = fused_kernels.fused_add_rms_norm(x, delta, weight, 1e-6)
    want_normed, want_sum = unfused(x, delta, weight, 1e-6)
    assert torch.equal(summed, want_sum)
    assert torch.allclose(normed.float(), want_normed.float(), atol=0.02, rtol=0.01), "bf16: a rounding step apart"


@pytest.mark.parametrize("mode", ["torch", "triton"])
def test_engine_with_fused_add_norm_equals_the_synchronous_engine(serve, impl, tiny_model, baseline, mode):
    if mode == "triton":
        pytest.importorskip("triton")
    prompts, max_tokens, want = baseline
    flat = serve.flat_model.FlatModel(tiny_model)
    flat.fused = mode
    if mode == "triton":                     # the interpreter is slow: one request, its first 6 tokens
        prompts, max_tokens, want = {"r0": prompts["r0"]}, {"r0": 6}, {"r0": want["r0"][:6]}
    _, got = serve_all(serve, flat, prompts, max_tokens, num_blocks=64)
    expect_same(f"fused {mode}", got, want)


# --- 3. asynchronous scheduling ------------------------------------------------------------------------------

def placeholder_request(serve, tokens, placeholders):
    request = serve.request.Request("p", [1, 2, 3])
    request.token_ids += list(tokens) + [serve.request.PLACEHOLDER] * placeholders
    request.num_placeholders = placeholders
    return request


def test_settle_token_fills_the_oldest_placeholder(serve, overlap):
    request = placeholder_request(serve, [10], 2)
    seen = []
    reason = overlap.settle_token(request, 11, lambda r, i: seen.append((i, r.token_ids[i])) or None)
    assert reason is None and seen == [(4, 11)], "the stop rules must look at the settled token's index"
    assert request.token_ids == [1, 2, 3, 10, 11, serve.request.PLACEHOLDER], \
        f"token_ids {request.token_ids}: the token replaces the oldest placeholder, the newer one stays"
    assert request.num_placeholders == 1, \
        f"num_placeholders is {request.num_placeholders}: settling a token leaves one placeholder fewer"


def test_settle_token_that_stops_drops_the_tokens_after_it(serve, overlap):
    request = placeholder_request(serve, [], 2)
    stopped = serve.request.Status.FINISHED_STOPPED
    assert overlap.settle_token(request, EOS, lambda r, i: stopped) is stopped
    assert request.token_ids == [1, 2, 3, EOS] and request.num_placeholders == 0, (
        "a token computed past a stop is not output")


def test_settle_token_twice_is_an_error(serve, overlap):
    request = placeholder_request(serve, [10], 0)
    with pytest.raises(RuntimeError, match="placeholder"):
        overlap.settle_token(request, 5, lambda r, i: None)
    assert request.token_ids == [1, 2, 3, 10], "a refused settle changes nothing"


class HostGreedy:
    """A sampler other than SimpleSampler, so the asynchronous engine samples on the host:
    the plain argmax, the synchronous engine's greedy tokens."""

    def __call__(self, logits, requests, generators):
        return [[int(row.argmax())] for row in logits], None


STEP_PARTS = ("wait_for_tokens", "launch", "settle", "sample_on_host", "count_launched")


def recorded_calls(stepper):
    """Wrap the stepper's named parts (on the instance) so that each call of step() leaves,
    in `log`, the parts it ran in order, each with the launched step it handled (its
    launch number; None for wait_for_tokens)."""
    log, launched = [], []          # launched: every step launch returned, kept alive in order

    def wrap(name):
        part = getattr(stepper, name)

        def recorded(*args):
            result = part(*args)
            if name == "launch":
                launched.append(result)
            handled = result if name == "launch" else args[0]
            number = next((k for k, step in enumerate(launched) if step is handled), None)
            log.append((name, number))
            return result
        setattr(stepper, name, recorded)
    for name in STEP_PARTS:
        wrap(name)
    return log


@pytest.mark.parametrize("where", ["device", "host"])
def test_async_step_launches_the_next_step_before_it_settles_the_one_in_flight(serve, tiny_model, baseline, where):
    """AsyncStepper.step's order of the engine's named parts, call by call: wait for what the
    next batch needs, launch step t+1, settle step t (each launched step once, in the next
    call), sample step t+1 on the host (a host sampler only) and only then append its
    placeholders. The engine's checks run once per plan and once per settled step."""
    from types import SimpleNamespace

    prompts, max_tokens, want = baseline
    engine = serve.engine.EngineCore(tiny_model, serve.config.EngineConfig(
        block_size=BLOCK, num_blocks=64, async_scheduling=True), eos_token_id=EOS,
        sampler=HostGreedy() if where == "host" else None)
    checks = {"plan": 0, "scheduler": 0}
    engine.checks = SimpleNamespace(check_plan=lambda *_: checks.update(plan=checks["plan"] + 1),
                                    check_scheduler=lambda *_: checks.update(scheduler=checks["scheduler"] + 1))
    log = recorded_calls(engine.async_steps)
    params = [serve.request.SamplingParams(max_tokens=max_tokens[r]) for r in prompts]
    for rid, prompt, p in zip(prompts, prompts.values(), params):
        engine.add_request(rid, prompt, p)
    got = {rid: [] for rid in prompts}
    in_flight, settled, calls = None, set(), 0
    while engine.has_unfinished:
        calls += 1
        assert calls < 500, "the engine still has unfinished work after 500 calls of step()"
        del log[:]
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
        names = [name for name, _ in log]
        said = f"call {calls} of step() ran {names}"
        launched = next((k for name, k in log if name == "launch"), None)
        if "launch" in names:
            assert "wait_for_tokens" in names and names.index("wait_for_tokens") < names.index("launch"), (
                f"{said}: wait_for_tokens comes before the plan is prepared (launch), whose placeholder inputs "
                f"are filled from the step in flight's tokens")
        if "launch" in names and "settle" in names:
            assert names.index("launch") < names.index("settle"), (
                f"{said}: step t+1 is launched before the host waits for step t's tokens (settle): that is the "
                f"overlap")
        for name, k in log:
            if name == "settle":
                assert k == in_flight and k not in settled, (
                    f"{said}: it settled launch {k}, the step in flight was launch {in_flight}: each launched "
                    f"step is settled exactly once, in the next call")
                settled.add(k)
            if name in ("sample_on_host", "count_launched"):
                assert k == launched, f"{said}: {name} handled launch {k}, not the step this call launched"
        if "sample_on_host" in names:
            assert where == "host", f"{said}: with SimpleSampler the device samples; nothing is sampled on the host"
            assert "settle" not in names or names.index("settle") < names.index("sample_on_host"), (
                f"{said}: the host samples step t+1 only once step t is settled (its sampler sees step t's tokens)")
            assert "count_launched" not in names or names.index("sample_on_host") < names.index("count_launched"), (
                f"{said}: step t+1's placeholders are appended (count_launched) only after it is sampled on the host")
        elif where == "host" and launched is not None and "count_launched" in names:
            pytest.fail(f"{said}: with a host sampler every launched step is sampled on the host")
        if in_flight is not None and in_flight not in settled:
            pytest.fail(f"{said}: launch {in_flight} was in flight and not settled: each launched step is settled "
                        f"exactly once, in the next call")
        in_flight = launched if "count_launched" in names else None
    expect_same(f"async step order, {where} sampling", got, want)
    assert checks == {"plan": calls, "scheduler": engine.steps}, (
        f"{calls} calls of step, {engine.steps} steps settled; the checks ran {checks}: the asynchronous step goes "
        f"through the engine's named parts, so each plan is checked once (schedule) and the scheduler once per "
        f"settled step (update)")


class DeviceOnlyTokens(torch.Tensor):
    """A step's sampled tokens that refuse every read on the host: prepare must copy them
    on the device (index them, copy them into the batch), never turn them into numbers."""
    HOST_READS = {torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.cpu, torch.Tensor.numpy,
                  torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__index__, torch.Tensor.__float__,
                  torch.Tensor.__iter__, torch.Tensor.__repr__, torch.Tensor.__format__}

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in cls.HOST_READS:
            raise AssertionError(f"prepare read the step in flight's tokens on the host ({func.__name__}): with "
                                 f"asynchronous scheduling they are still being computed, and reading them waits "
                                 f"for the device")
        return super().__torch_function__(func, types, args, kwargs or {})


class StepInFlight:
    def __init__(self, tokens, row_of):
        self.tokens, self.row_of = tokens, row_of


def requests_with_placeholders(serve):
    """a and c decode with their newest token a placeholder; b prefills 6 prompt tokens."""
    a = placeholder_request(serve, [11], 1)
    a.request_id = "a"
    a.num_computed_tokens = 4
    b = serve.request.Request("b", [40, 41, 42, 43, 44, 45])
    c = placeholder_request(serve, [12, 13], 1)
    c.request_id = "c"
    c.num_computed_tokens = 5
    return [(a, 1), (b, 6), (c, 1)], {"a": [0], "b": [1], "c": [2]}


def test_prepare_fills_placeholder_inputs_from_the_step_in_flight_on_the_device(serve, tiny_model):
    runner = serve.runner.ModelRunner(tiny_model, num_blocks=8, block_size=BLOCK)
    scheduled, tables = requests_with_placeholders(serve)
    tokens = torch.tensor([70, 71, 72], device=runner.device).as_subclass(DeviceOnlyTokens)
    batch = runner.prepare(scheduled, tables, previous=StepInFlight(tokens, {"c": 0, "x": 1, "a": 2}))
    got = torch.Tensor.tolist(batch.input_ids.as_subclass(torch.Tensor))
    assert got == [72, 40, 41, 42, 43, 44, 45, 70], (
        f"input_ids {got}: each placeholder input takes previous.tokens[previous.row_of[its request]] "
        f"(a -> row 2 = 72, c -> row 0 = 70) and every other row keeps its known token")
    assert batch.input_ids.device == runner.device and batch.meta.slot_mapping.device == runner.device
    assert batch.positions.tolist() == [4, 0, 1, 2, 3, 4, 5, 5], "the placeholder rows keep their positions"


def test_prepare_refuses_a_placeholder_nothing_fills(serve, tiny_model):
    runner = serve.runner.ModelRunner(tiny_model, num_blocks=8, block_size=BLOCK)
    scheduled, tables = requests_with_placeholders(serve)
    with pytest.raises(RuntimeError, match="'a'.*placeholder"):
        runner.prepare(scheduled, tables)
    with pytest.raises(RuntimeError, match="'c'.*placeholder"):
        runner.prepare(scheduled, tables, previous=StepInFlight(torch.tensor([70, 71, 72]), {"a": 2}))


ASYNC_CONFIGS = {
    "ample pool": dict(num_blocks=64),
    "12 blocks, recompute": dict(num_blocks=12, preemption_mode="recompute"),
    "12 blocks, swap": dict(num_blocks=12, preemption_mode="swap"),
    "small chunks, 2 at a time": dict(num_blocks=64, max_num_batched_tokens=24, max_num_seqs=2),
    "static graph path": dict(num_blocks=64, cuda_graphs="static"),
}


@pytest.mark.parametrize("name", list(ASYNC_CONFIGS))
def test_async_engine_equals_the_synchronous_engine(serve, tiny_model, baseline, name):
    prompts, max_tokens, want = baseline
    engine, got = serve_all(serve, tiny_model, prompts, max_tokens, async_scheduling=True, debug_checks=True,
                            **ASYNC_CONFIGS[name])
    expect_same(f"async, {name}", got, want)
    if "12 blocks" in name:
        assert engine.preemptions > 0, f"[{name}] nothing was preempted: the configuration lost its point"
    assert engine.inflight is None and not engine.has_unfinished


def test_async_engine_applies_stop_tokens_once_known(serve, overlap, tiny_model):
    """Stop tokens are known only after the step that samples them; the request has by then
    been given one more row, whose token must not reach the output."""
    prompts, max_tokens = five_requests(seed=3)
    _, sync = serve_all(serve, tiny_model, prompts, max_tokens, num_blocks=64)
    stop = sorted({t for out in sync.values() for t in out[2:6]})[:3]
    _, want = serve_all(serve, tiny_model, prompts, max_tokens, stop=stop, num_blocks=64)
    assert any(len(want[r]) < max_tokens[r] for r in want), "no request stopped early: pick other stop tokens"
    for mode in ("inline", "thread"):
        engine = serve.engine.EngineCore(tiny_model, serve.config.EngineConfig(
            block_size=BLOCK, num_blocks=64, async_scheduling=True, device_queue=mode), eos_token_id=EOS)
        params = [serve.request.SamplingParams(max_tokens=max_tokens[r], stop_token_ids=stop) for r in prompts]
        got = {r: o.output_token_ids for r, o in zip(prompts, engine.generate(list(prompts.values()), params))}
        engine.async_steps.queue.close()
        expect_same(f"async {mode} queue with stop tokens", got, want)
        assert_engine_idle(engine, f"async {mode} queue after stop tokens")


def test_a_request_whose_last_token_is_in_flight_is_not_scheduled_again(serve, tiny_model):
    engine = serve.engine.EngineCore(tiny_model, serve.config.EngineConfig(
        block_size=BLOCK, num_blocks=16, async_scheduling=True, debug_checks=True), eos_token_id=EOS)
    engine.add_request("one", [5, 6, 7], serve.request.SamplingParams(max_tokens=3, ignore_eos=True))
    seen = []
    while engine.has_unfinished:
        outputs = engine.step()
        seen.append([n for _, n in engine.last_plan.scheduled])
        for out in outputs:
            assert serve.request.PLACEHOLDER not in out.output_token_ids, f"a placeholder was reported: {out}"
    assert engine.steps == 3, f"3 output tokens need 3 forward passes, the async engine launched {engine.steps}"
    assert seen == [[3], [1], [1], []], f"schedules per call: {seen} (the last call only settles)"
    assert out.finished and len(out.output_token_ids) == 3


def test_aborting_a_request_in_flight_leaves_no_placeholder(serve, tiny_model):
    engine = serve.engine.EngineCore(tiny_model, serve.config.EngineConfig(
        block_size=BLOCK, num_blocks=16, async_scheduling=True), eos_token_id=EOS)
    engine.add_request("a", [5, 6, 7], serve.request.SamplingParams(max_tokens=8, ignore_eos=True))
    engine.add_request("b", [9, 9], serve.request.SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()
    engine.step()
    aborted = engine.abort_request("a")
    assert serve.request.PLACEHOLDER not in aborted.token_ids and aborted.num_placeholders == 0
    while engine.has_unfinished:
        for out in engine.step():
            assert out.request_id == "b", "an aborted request reported a token"
    assert_engine_idle(engine, "after aborting a request in flight")


def test_seeded_sampling_is_the_same_with_async_scheduling(serve, tiny_model):
    prompts, max_tokens = five_requests(seed=5)
    outs = []
    for asynchronous in (False, True):
        engine = serve.engine.EngineCore(tiny_model, serve.config.EngineConfig(
            block_size=BLOCK, num_blocks=64, async_scheduling=asynchronous), eos_token_id=EOS)
        params = [serve.request.SamplingParams(max_tokens=max_tokens[r], temperature=1.0, top_k=20, seed=i)
                  for i, r in enumerate(prompts)]
        outs.append([o.output_token_ids for o in engine.generate(list(prompts.values()), params)])
    assert outs[0] == outs[1], "a seeded request's draws must not depend on when its step is scheduled"


class ShiftedGreedy:
    """A custom sampler that reads each request's history: the argmax moved on by the value
    of the request's newest token (the one still in flight on the async engine) and never
    a token the request has output already; it fails for the fourth prompt at its sixth
    token."""

    def __call__(self, logits, requests, generators):
        tokens = []
        for row, request in zip(logits, requests):
            if request.request_id.endswith("-3") and request.num_output_tokens == 5:
                raise RuntimeError("scripted sampler failure")
            row = row.roll(-request.token_ids[-1]).clone()
            row[request.output_token_ids] = float("-inf")
            tokens.append([int(row.argmax())])
        return tokens, None


def test_async_with_a_custom_sampler_equals_the_synchronous_engine(serve, overlap, tiny_model):
    """A sampler other than SimpleSampler runs on the host once the step before is applied,
    on requests that hold step t's token and not yet step t + 1's placeholder: its tokens,
    and the request its failure aborts, must be the synchronous engine's."""
    prompts, max_tokens = five_requests(seed=1)
    outputs = {}
    for asynchronous in (False, True):
        engine = serve.engine.EngineCore(tiny_model, serve.config.EngineConfig(
            block_size=BLOCK, num_blocks=9, async_scheduling=asynchronous, device_queue="thread"), eos_token_id=EOS,
            sampler=ShiftedGreedy())
        params = [serve.request.SamplingParams(max_tokens=max_tokens[r]) for r in prompts]
        got = engine.generate(list(prompts.values()), params)
        if asynchronous:
            engine.async_steps.queue.close()
        assert engine.preemptions > 0, "nothing was preempted: the configuration lost its point"
        assert_engine_idle(engine, f"custom sampler, async={asynchronous}")
        outputs[asynchronous] = {r: o.output_token_ids for r, o in zip(prompts, got)}
        aborted = [r for r, o in zip(prompts, got) if o.error is not None]
        assert aborted == [list(prompts)[3]] and len(outputs[asynchronous][aborted[0]]) == 5, \
            f"async={asynchronous}: the scripted failure must abort the fourth prompt alone, aborted {aborted}"
    expect_same("async, custom sampler", outputs[True], outputs[False])


# --- 4. the pool of a quantized cache holds the blocks its bytes allow ------------------------------------

@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_quantized_pool_is_sized_from_its_own_bytes(serve, impl, fmt):
    """kv_cache_bytes sizes the pool off CUDA (a GPU profiles its memory): a CPU model."""
    from course.models import tiny_qwen3
    budget = 1 << 20
    engine = serve.engine.EngineCore(tiny_qwen3(impl.package), serve.config.EngineConfig(
        kv_cache_bytes=budget, kv_cache_dtype=fmt, block_size=BLOCK), eos_token_id=EOS)
    blocks = engine.blocks.num_blocks
    per_block = engine.runner.pool_bytes // (blocks + 1)           # the pool has one scratch block more
    assert blocks == budget // per_block, (
        f"{fmt}: {blocks} blocks of {per_block} bytes for a {budget}-byte budget; expected {budget // per_block} "
        f"(a pool sized by the model's dtype holds ~3x too few)")


# --- the chapter's command ------------------------------------------------------------------------------------

def test_run_py_overlap_on_a_tiny_workload(impl, device, capsys):
    from course import cli
    status = cli.main(["overlap", "--impl", impl.spec.text, "--device", str(device), "--requests", "2",
                       "--vocab-size", "320", "--repeat", "1"])
    out, err = capsys.readouterr()
    assert status == 0, f"run.py overlap failed:\n{out}{err}"
    lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    runs = {line["engine"]: line for line in lines if "engine" in line}
    assert {"sync", "sync, static buckets", "async inline", "async thread", "sync, fused torch"} <= set(runs), out
    assert len({line["output_tokens"] for line in runs.values()}) == 1, "engines counted different tokens"
    summary = next(line for line in lines if "outputs_identical" in line)
    assert summary["outputs_identical"], summary


# --- on a GPU ------------------------------------------------------------------------------------------------------

@needs_cuda
def test_cuda_graphs_replay_decodes_and_match_the_eager_engine(serve, impl, tiny_model, baseline):
    pytest.importorskip("triton")
    prompts, max_tokens, _ = baseline
    model = tiny_model                       # on the GPU: the device fixture chose cuda
    _, want = serve_all(serve, model, prompts, max_tokens, num_blocks=64, attention_backend="triton")
    for config in (dict(cuda_graphs="on"), dict(cuda_graphs="on", async_scheduling=True)):
        engine, got = serve_all(serve, model, prompts, max_tokens, num_blocks=64, attention_backend="triton",
                                max_num_seqs=8, **config)
        expect_same(f"CUDA graphs {config}", got, want)
        assert engine.runner.graphs.runs["replayed"] > 0 and len(engine.runner.graphs.graphs) == 4


@needs_cuda
def test_async_device_queue_on_cuda_equals_the_synchronous_engine(serve, tiny_model, baseline):
    prompts, max_tokens, _ = baseline
    model = tiny_model
    _, want = serve_all(serve, model, prompts, max_tokens, num_blocks=12, preemption_mode="swap")
    engine, got = serve_all(serve, model, prompts, max_tokens, num_blocks=12, preemption_mode="swap",
                            async_scheduling=True)
    assert engine.async_steps.queue.mode == "cuda"
    expect_same("async on CUDA, swap", got, want)
