"""Chapter 32 milestone: fast attention backends over the block pool, and `run.py bench`.

Oracles: Chapter 31's ReferenceBackend of the REFERENCE package (`course.reference()`),
which loops over requests and calls Chapter 5's attention, for every backend-level test;
the reference package's solo greedy `generate` for the engine tests (whatever backend the
core uses, its greedy tokens must be solo generate's). Tolerances: the vectorised backend
and the Triton kernels add the same products in another order, so they agree with the
reference to float32 rounding (atol 1e-5 on O(1) values); int8 pools are compared with the
bound that Chapter 28's per-token scales give.

The Triton tests run the kernels in Triton's interpreter on a CPU (TRITON_INTERPRET=1, set
before triton is imported) and compiled on a GPU; their sizes stay tiny because the
interpreter runs every program one after another in NumPy.
"""
import inspect
import json
import os
import random

import pytest
import torch

from course import reference
from course.testing.milestone_helpers import OperatorCounter
from course.testing.oracle_records import recorded
from course.testing.oracles import reference_generate

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytestmark = pytest.mark.chapter(32)

EOS = 257
BLOCK = 16


# --- a hand-made batch over a random pool ------------------------------------------------------

def make_meta(serve, requests, block_size, device="cpu"):
    """requests: [(seq_len, new_rows, block_table)]. A BatchMeta laid out as build_batch would."""
    rows_per_request = [rows for _, rows, _ in requests]
    starts = [0]
    for rows in rows_per_request:
        starts.append(starts[-1] + rows)
    width = max(1, max(len(t) for *_, t in requests))
    slots = []
    for length, rows, table in requests:
        for p in range(length - rows, length):
            slots.append(table[p // block_size] * block_size + p % block_size if length else -1)
    lengths = [r[0] for r in requests]
    as_int32 = dict(dtype=torch.int32, device=device)
    return serve.batch.BatchMeta(
        query_start_loc=torch.tensor(starts, **as_int32), seq_lens=torch.tensor(lengths, **as_int32),
        block_table=torch.tensor([list(t) + [0] * (width - len(t)) for *_, t in requests], dtype=torch.int32,
                                 device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device), block_size=block_size,
        query_start_loc_cpu=starts, seq_lens_cpu=lengths,
        max_query_len=max(rows_per_request), max_seq_len=max(lengths))


def random_requests(rng, shapes, block_size, num_blocks):
    """shapes: [(seq_len, new_rows)]; each request gets distinct random blocks of the pool."""
    free = list(range(num_blocks))
    rng.shuffle(free)
    out = []
    for length, rows in shapes:
        need = -(-length // block_size)
        out.append((length, rows, [free.pop() for _ in range(need)]))
    return out


SCENARIOS = {
    # (seq_len, new rows) per request
    "mixed prefill chunks and decodes": [(9, 3), (5, 1), (4, 4), (17, 1), (12, 5)],
    "decode only": [(7, 1), (16, 1), (33, 1), (1, 1)],
    "block boundaries": [(8, 8), (9, 1), (16, 8), (17, 2), (24, 1)],
    "one long prompt": [(40, 40)],
    "padding requests": [(6, 2), (0, 1), (11, 1), (0, 1)],
    "decode with padding": [(6, 1), (0, 1), (11, 1)],
}


def pools_and_queries(heads, kv_heads, dim, block_size, num_blocks, rows, seed):
    gen = torch.Generator().manual_seed(seed)
    shape = (num_blocks + 1, block_size, kv_heads, dim)
    return (torch.randn(shape, generator=gen), torch.randn(shape, generator=gen),
            torch.randn(rows, heads, dim, generator=gen))


def reference_forward(q, pools, shapes_meta, window=0):
    return recorded("ReferenceBackend.forward", (q, pools, shapes_meta, window), lambda: reference().load(
        "serve.backends").ReferenceBackend().forward(q, pools, shapes_meta, window=window))


def describe_mismatch(name, got, want, meta, window=0):
    """Where the first differing row sits, and the rule that row depends on."""
    bad = (got - want).abs().amax(dim=(1, 2))
    row = int(bad.argmax())
    request = next(r for r in range(len(meta.seq_lens_cpu)) if meta.query_start_loc_cpu[r + 1] > row)
    rows = meta.query_start_loc_cpu[request + 1] - meta.query_start_loc_cpu[request]
    if meta.seq_lens_cpu[request] == 0:
        rule = "rows of a padding request (seq_len 0) come back as zeros"
    elif window:
        rule = f"with window {window} a row sees only the keys at positions > its own - {window}"
    elif rows > 1:
        rule = ("row i of a request's t new rows sits at position seq_len - t + i and sees the keys up to and "
                "including its own")
    else:
        rule = "a decode row sees every key of its request, up to and including the last one"
    return (f"[{name}] row {row} (request {request}: seq_len {meta.seq_lens_cpu[request]}, rows "
            f"{meta.query_start_loc_cpu[request]}..{meta.query_start_loc_cpu[request + 1] - 1}) differs from "
            f"ReferenceBackend by {float(bad[row]):.2e}: {rule}")


# --- the vectorised backend ----------------------------------------------------------------------

@pytest.mark.parametrize("name", list(SCENARIOS))
@pytest.mark.parametrize("heads, kv_heads", [(4, 2), (4, 1), (2, 2)])
def test_vectorised_backend_matches_reference(serve, name, heads, kv_heads):
    block_size, num_blocks, dim = 8, 24, 16
    rng = random.Random(f"{name}{heads}{kv_heads}")
    requests = random_requests(rng, SCENARIOS[name], block_size, num_blocks)
    meta = make_meta(serve, requests, block_size)
    k_pool, v_pool, q = pools_and_queries(heads, kv_heads, dim, block_size, num_blocks,
                                          meta.query_start_loc_cpu[-1], seed=len(name))
    backend = serve.backends.get_backend("vectorised")
    for window in (0, 5):
        got = backend.forward(q, (k_pool, v_pool), meta, window=window)
        want = reference_forward(q, (k_pool, v_pool), meta, window=window)
        assert got.shape == q.shape and got.dtype == q.dtype, f"[{name}] output {tuple(got.shape)} {got.dtype}"
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), describe_mismatch(f"{name}, window {window}",
                                                                                  got, want, meta, window)


def test_plan_is_built_once_per_step(serve, monkeypatch):
    """The layout of query rows and the mask depend on the batch, not on the layer: all
    layers of one step share one plan, and a new step gets a new one. A step that mixes
    decodes with chunks is split in two groups, so decodes are not padded to a chunk."""
    backends = serve.backends
    calls = []
    real = backends.plan_step
    monkeypatch.setattr(backends, "plan_step", lambda meta, *rest: calls.append(meta) or real(meta, *rest))
    rng = random.Random(1)
    backend = backends.get_backend("vectorised")
    for step in range(2):
        meta = make_meta(serve, random_requests(rng, SCENARIOS["mixed prefill chunks and decodes"], 8, 24), 8)
        k_pool, v_pool, q = pools_and_queries(4, 2, 16, 8, 24, meta.query_start_loc_cpu[-1], seed=step)
        for _layer in range(3):
            backend.forward(q, (k_pool, v_pool), meta)
    assert len(calls) == 2, f"3 layers x 2 steps built {len(calls)} plans; expected one per step"
    groups = backend.plan_for(meta, torch.device("cpu"))
    assert [g.decode_only for g in groups] == [True, False], "decodes and chunks belong in separate groups"
    assert [g.rows.tolist() for g in groups] == [[3, 8], [0, 1, 2, 4, 5, 6, 7, 9, 10, 11, 12, 13]]



def _sdpa_parameters(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                     enable_gqa=False):
    """scaled_dot_product_attention's parameters as torch documents them (the builtin has no
    signature inspect can read), so a spy binds arguments however the caller passed them."""


SDPA_SIGNATURE = inspect.signature(_sdpa_parameters)

def test_attend_all_makes_one_attention_call_per_group_and_shares_the_window_mask(serve, monkeypatch):
    """attend_all's cost contract, seen from torch's attention function: each group of a
    step is served by one call whose keys keep their Hkv heads (never repeated to H), and
    the windowed mask built for the first layer is the very tensor the later layers use."""
    heads, kv_heads, layers = 4, 2, 3
    calls = []
    real = torch.nn.functional.scaled_dot_product_attention

    def counting(*args, **kwargs):
        bound = SDPA_SIGNATURE.bind(*args, **kwargs)         # a mask passed by position is seen too
        calls.append((bound.arguments["key"].shape[1], bound.arguments.get("attn_mask")))
        return real(*args, **kwargs)

    meta = make_meta(serve, random_requests(random.Random(3), SCENARIOS["mixed prefill chunks and decodes"], 8, 24), 8)
    k_pool, v_pool, q = pools_and_queries(heads, kv_heads, 16, 8, 24, meta.query_start_loc_cpu[-1], seed=3)
    backend = serve.backends.get_backend("vectorised")
    groups = len(backend.plan_for(meta, torch.device("cpu")))
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counting)
    for _layer in range(layers):
        backend.forward(q, (k_pool, v_pool), meta, window=5)
    assert len(calls) == groups * layers, \
        f"attend_all: {len(calls)} attention calls for {groups} groups x {layers} layers; one call serves a whole group"
    assert all(key_heads == kv_heads for key_heads, _ in calls), \
        f"attend_all: keys reached attention with {sorted({h for h, _ in calls})} heads, not the pool's {kv_heads}: " \
        "K/V heads are never repeated in memory"
    first_layer = [mask for _, mask in calls[:groups]]
    assert all(mask is first_layer[i % groups] for i, (_, mask) in enumerate(calls)), \
        "attend_all: a windowed mask is built once per step and kept in plan.masks, so later layers reuse that tensor"


def test_a_step_reads_nothing_back_and_copies_its_indices_once(serve, monkeypatch):
    """On a GPU every read of a device value (.item(), .tolist(), bool()) and every small
    torch.tensor(..., device=...) is the host waiting for the device. A step's plans are
    made from the batch's host lists, and each group's index tensors cross in one copy."""
    backend = serve.backends.get_backend("vectorised")
    meta = make_meta(serve, random_requests(random.Random(2), SCENARIOS["padding requests"] + [(9, 4)], 8, 24), 8)
    k_pool, v_pool, q = pools_and_queries(4, 2, 16, 8, 24, meta.query_start_loc_cpu[-1], seed=0)
    want = reference_forward(q, (k_pool, v_pool), meta)
    made = []
    real_tensor = torch.tensor
    monkeypatch.setattr(torch, "tensor", lambda *a, **k: made.append(a) or real_tensor(*a, **k))

    def host_read(self, *args):
        raise AssertionError("the backend read a tensor's value on the host during a step")
    for name in ("item", "tolist", "__bool__", "__int__", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, host_read)
    got = backend.forward(q, (k_pool, v_pool), meta)
    monkeypatch.undo()
    groups = len(backend.plan_for(meta, torch.device("cpu")))
    assert len(made) <= groups, f"{len(made)} torch.tensor calls for {groups} groups: one copy per group"
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), describe_mismatch("no host reads", got, want, meta)


def test_a_short_chunk_is_not_padded_to_a_long_one(serve):
    """Chunks split by their rows as decodes split by context: one 200-row prompt beside
    fifteen 12-row suffixes (requests that adopted its prefix in the same step) would lay
    every suffix out as 200 query slots. Below SPLIT_CHUNKS_FROM rows the chunks stay whole."""
    assert serve.backends.context_groups([0, 1, 2, 3], [200, 12, 90, 12], split_from=32) == [[0], [2], [1, 3]]
    assert serve.backends.context_groups([0, 1, 2], [20, 3, 9], split_from=32) == [[0, 1, 2]]
    requests = random_requests(random.Random(7), [(210, 200)] + [(220, 12)] * 15 + [(230, 1)], 16, 260)
    meta = make_meta(serve, requests, 16)
    k_pool, v_pool, q = pools_and_queries(4, 2, 16, 16, 260, meta.query_start_loc_cpu[-1], seed=7)
    backend = serve.backends.get_backend("vectorised")
    got = backend.forward(q, (k_pool, v_pool), meta)
    groups = backend.plan_for(meta, torch.device("cpu"))
    slots = sorted(len(g.block_table) * g.visible.shape[2] for g in groups)
    assert slots == [1, 15 * 12, 200], (
        f"query slots per group {slots}: the 200-row chunk, the fifteen 12-row chunks and the decode "
        "each need a group of their own, or the short chunks are padded to 200 rows")
    want = reference_forward(q, (k_pool, v_pool), meta)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), describe_mismatch("split chunks", got, want, meta)

def test_decodes_of_far_apart_contexts_are_gathered_in_separate_groups(serve):
    """A short context is not gathered out to the longest: decodes split where a context
    is at most half its group's longest (groups under 256 tokens stay whole), chunks apart;
    with a budget, a group's gathered keys and values stay within it."""
    assert serve.backends.context_groups([0, 1, 2, 3, 5], [300, 40, 700, 290, 9, 100]) == [[2], [0, 3], [1, 5]]
    assert serve.backends.context_groups([0, 1, 2], [200, 9, 60]) == [[0, 1, 2]]
    assert serve.backends.context_groups([0, 1, 2, 3], [100, 90, 80, 70], token_bytes=1000,
                                         budget=200_000) == [[0, 1], [2, 3]], "2 x 100 tokens x 1,000 bytes fit"
    requests = random_requests(random.Random(5), [(300, 1), (40, 1), (700, 1), (290, 1), (20, 5)], 16, 90)
    meta = make_meta(serve, requests, 16)
    k_pool, v_pool, q = pools_and_queries(4, 2, 16, 16, 90, meta.query_start_loc_cpu[-1], seed=5)
    backend = serve.backends.get_backend("vectorised")
    got = backend.forward(q, (k_pool, v_pool), meta)
    groups = backend.plan_for(meta, torch.device("cpu"))
    assert [g.rows.tolist() for g in groups] == [[2], [0, 3], [1], [4, 5, 6, 7, 8]]
    want = reference_forward(q, (k_pool, v_pool), meta)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), describe_mismatch("split decodes", got, want, meta)


def test_a_cpu_group_stays_within_the_cache_budget(serve):
    """On a CPU a group's gathered keys and values stay within GROUP_BYTES_ON_CPU, so
    attention reads the copy back from cache: eight decodes of about 600 tokens (1.2 MB of
    keys and values at 256 bytes a token) split into groups, and every row still equals
    the reference's."""
    backends = serve.backends
    block_size, kv_heads, dim = 16, 2, 16
    requests = random_requests(random.Random(7), [(600 - 7 * i, 1) for i in range(8)], block_size, 320)
    meta = make_meta(serve, requests, block_size)
    k_pool, v_pool, q = pools_and_queries(4, kv_heads, dim, block_size, 320, meta.query_start_loc_cpu[-1], seed=7)
    backend = backends.get_backend("vectorised")
    got = backend.forward(q, (k_pool, v_pool), meta)
    token_bytes = 2 * kv_heads * dim * q.element_size()
    plans = backend.plan_for(meta, torch.device("cpu"))
    assert len(plans) > 1, "1.2 MB of gathered keys and values in one group: over the CPU budget"
    for rows in (plan.rows.tolist() for plan in plans):      # decodes: row r is request r
        size = len(rows) * max(meta.seq_lens_cpu[r] for r in rows) * token_bytes
        assert size <= backends.GROUP_BYTES_ON_CPU, f"group {rows} gathers {size:,} bytes, over the budget"
    want = reference_forward(q, (k_pool, v_pool), meta)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), describe_mismatch("budgeted groups", got, want, meta)


def test_gather_blocks_reads_every_table_at_once(serve):
    pool = torch.arange(5 * 4 * 2, dtype=torch.float32).reshape(5, 4, 2)
    table = torch.tensor([[3, 0], [1, 2], [4, 4]])                  # three requests of two blocks
    got = serve.backends.gather_blocks(pool, table)
    want = torch.stack([torch.cat([pool[3], pool[0]]), torch.cat([pool[1], pool[2]]), torch.cat([pool[4], pool[4]])])
    assert got.shape == (3, 8, 2), f"shape {tuple(got.shape)}: one run of W * block_size rows per request"
    assert torch.equal(got, want), "request r's rows are its blocks in table order"


def test_gather_blocks_makes_one_indexing_call_whatever_the_number_of_requests(serve):
    """The cost contract: the same operators for 2 requests as for 16, not a call per request."""
    pool = torch.randn(20, 4, 2, 3)
    few, many = (torch.randint(0, 20, (rows, 3)) for rows in (2, 16))
    counts = []
    for table in (few, many):
        with OperatorCounter() as counter:
            serve.backends.gather_blocks(pool, table)
        counts.append(dict(counter.ops))
    assert counts[0] == counts[1], (
        f"gather_blocks reads every table at once, in one indexing call whatever the number of requests: "
        f"torch operators for 2 requests {counts[0]}, for 16 {counts[1]}")


# --- the engine with each backend ------------------------------------------------------------------

def five_requests(seed=0):
    rng = random.Random(seed)
    tokens = lambda n: [rng.randrange(256) for _ in range(n)]   # noqa: E731
    r1 = tokens(37)
    prompts = {"r0": tokens(5), "r1": r1, "r3": tokens(21), "r4": tokens(70)}
    prompts["r2"] = r1[:2 * BLOCK] + tokens(14)
    max_tokens = {"r0": 30, "r1": 40, "r2": 28, "r3": 36, "r4": 44}
    return prompts, max_tokens


CONFIGS = {
    "small chunks, tight budget": dict(max_num_batched_tokens=24, long_prefill_token_threshold=8),
    "12 blocks, recompute": dict(num_blocks=12, preemption_mode="recompute"),
    "12 blocks, swap": dict(num_blocks=12, preemption_mode="swap"),
    "no prefix cache, 2 at a time": dict(enable_prefix_caching=False, max_num_seqs=2),
}

_SOLO = {}


def solo(ref_model, prompt, max_tokens):
    key = (tuple(prompt), max_tokens)
    if key not in _SOLO:
        _SOLO[key] = reference_generate(ref_model, list(prompt), max_tokens, eos_token_id=EOS)
    return _SOLO[key]


def serve_all(serve, model, prompts, max_tokens, **config):
    config = {"block_size": BLOCK, "num_blocks": 64, **config}
    engine = serve.engine.EngineCore(model, serve.config.EngineConfig(**config), eos_token_id=EOS)
    rids = list(prompts)
    results = engine.generate([prompts[r] for r in rids],
                              [serve.request.SamplingParams(max_tokens=max_tokens[r]) for r in rids])
    return engine, {rid: out.output_token_ids for rid, out in zip(rids, results)}


def expect_solo(label, outputs, prompts, max_tokens, ref_model):
    for rid, prompt in prompts.items():
        want, got = solo(ref_model, prompt, max_tokens[rid]), outputs[rid]
        if got != want:
            i = next((k for k, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
            pytest.fail(f"[{label}] request {rid}: output token {i} differs from solo generate\n"
                        f"  expected {want}\n  got      {got}")


@pytest.mark.parametrize("name", list(CONFIGS))
def test_engine_with_vectorised_backend_matches_solo_generate(serve, tiny_model, ref_model, name):
    prompts, max_tokens = five_requests()
    engine, outputs = serve_all(serve, tiny_model, prompts, max_tokens, attention_backend="vectorised",
                                **CONFIGS[name])
    expect_solo(f"vectorised, {name}", outputs, prompts, max_tokens, ref_model)
    assert engine.runner.backend.name == "vectorised"
    if "12 blocks" in name:
        assert engine.preemptions > 0, f"[{name}] no request was preempted: the configuration lost its point"


# --- the Triton kernels ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def kernels(impl):
    pytest.importorskip("triton")
    return impl.load("paged_kernels")


@pytest.fixture(scope="module")
def where(device, kernels):
    """The kernels' device: the GPU when compiled, the CPU when interpreted."""
    return torch.device("cpu") if kernels.interpreting() else device


TRITON_SCENARIOS = {
    "prefill chunks and decodes in one launch": [(20, 3), (5, 1), (18, 18), (33, 1)],
    "padding requests": [(6, 2), (0, 1), (17, 1)],
}


@pytest.mark.parametrize("name", list(TRITON_SCENARIOS))
@pytest.mark.parametrize("heads, kv_heads", [(4, 2), (2, 2)])
def test_triton_paged_attention_matches_reference(serve, kernels, where, name, heads, kv_heads):
    """Tolerance: float32 throughout; the kernel sums a row's weights block by block with
    rescaling (online softmax), so it agrees with one softmax to rounding: atol 1e-5."""
    block_size, num_blocks, dim = 16, 10, 16
    rng = random.Random(name)
    requests = random_requests(rng, TRITON_SCENARIOS[name], block_size, num_blocks)
    meta = make_meta(serve, requests, block_size, device=where)
    k_pool, v_pool, q = pools_and_queries(heads, kv_heads, dim, block_size, num_blocks,
                                          meta.query_start_loc_cpu[-1], seed=3)
    cpu_meta = make_meta(serve, requests, block_size)
    for window in (0, 7):
        got = kernels.paged_attention(q.to(where), k_pool.to(where), v_pool.to(where), meta, window=window)
        want = reference_forward(q, (k_pool, v_pool), cpu_meta, window=window)
        assert torch.allclose(got.cpu(), want, atol=1e-5, rtol=1e-5), describe_mismatch(
            f"triton, {name}, window {window}", got.cpu(), want, cpu_meta, window)


def test_query_tiles_split_each_request(serve, kernels):
    meta = make_meta(serve, [(40, 40, [0, 1, 2]), (0, 1, []), (9, 1, [3]), (5, 5, [4])], BLOCK)
    requests, rows = kernels.query_tiles(meta, 16)
    assert list(zip(requests, rows)) == [(0, 0), (0, 16), (0, 32), (2, 41), (3, 42)], (
        "a 40-row chunk makes 3 tiles of 16, a padding request none, a decode one")


def test_triton_store_writes_through_the_slot_mapping(kernels, where):
    pool_k = torch.zeros(4, 2, 2, 3, device=where)          # 3 blocks + scratch, block_size 2, Hkv 2
    pool_v = torch.zeros_like(pool_k)
    k = torch.arange(18, dtype=torch.float32, device=where).reshape(3, 2, 3) + 1
    kernels.store_kv(pool_k, pool_v, k, -k, torch.tensor([5, -1, 0], device=where))
    flat_k, flat_v = pool_k.view(-1, 2, 3), pool_v.view(-1, 2, 3)
    assert torch.equal(flat_k[5], k[0]) and torch.equal(flat_k[0], k[2]) and torch.equal(flat_v[5], -k[0]) \
        and torch.equal(flat_v[0], -k[2]), "row i of k and v is stored whole at slot slot_mapping[i] (slot 0 too)"
    untouched = [i for i in range(8) if i not in (0, 5)]
    assert torch.count_nonzero(flat_k[untouched]) == 0, "a slot -1 row must not be stored anywhere"


def test_engine_with_triton_backend_matches_solo_generate(serve, tiny_model, ref_model, kernels):
    """Two short requests, one sharing the other's first block, through EngineCore with the
    Triton backend (prefill chunks, decodes and a prefix hit; kept small for the interpreter)."""
    rng = random.Random(5)
    first = [rng.randrange(256) for _ in range(20)]
    prompts = {"a": first, "b": first[:BLOCK] + [rng.randrange(256) for _ in range(3)]}
    max_tokens = {"a": 4, "b": 3}
    engine, outputs = serve_all(serve, tiny_model, prompts, max_tokens, attention_backend="triton",
                                max_num_batched_tokens=16)
    expect_solo("triton", outputs, prompts, max_tokens, ref_model)


# --- the chapter's command -----------------------------------------------------------------------------

def test_run_py_bench_on_a_tiny_workload(impl, device, tmp_path, capsys):
    """`python run.py bench` shrunk to a few seconds: every contender (transformers'
    continuous batching among them) serves the seed workload (2 requests, 320-token
    vocabulary) with identical outputs (the command exits 2 otherwise), prints its JSON
    line, the summary has the ratios, the profile's shares add up to the whole step, and
    --plot writes a picture."""
    from course import cli
    picture = tmp_path / "bench.png"
    status = cli.main(["bench", "--impl", impl.spec.text, "--device", str(device), "--workloads", "seed:vocab=320",
                       "--scale", "0.15", "--backends", "reference,vectorised", "--repeat", "1",
                       "--profile", "--quiet",
                       "--plot", str(picture)])
    out, err = capsys.readouterr()
    assert status == 0, f"run.py bench failed:\n{out}{err}"
    lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    runs = {line["contender"]: line for line in lines if "contender" in line}
    assert {"core/reference", "core/vectorised", "ch24 slots", "hf default", "hf static", "hf generate_batch",
            "hf one at a time, first 8"} <= set(runs), out
    assert all(line["tok_s"] > 0 and line["requests"] == 2 for line in runs.values()), out
    named = {line["workload"] for line in lines if "skipped" not in line}
    assert named == {"seed:vocab=320"}, "a workload's own options name its lines"
    assert len({line["output_tokens"] for line in runs.values()}) == 1, "contenders counted different tokens"
    assert all(line.get("identical", True) for line in runs.values()), out
    assert runs["core/vectorised"]["tpot_p99_ms"] > 0, "streaming contenders report latency percentiles"
    summary = next(line for line in lines if "outputs_identical" in line)
    assert summary["outputs_identical"] and summary["vectorised_vs_ch24"] > 0, summary
    profiles = [line for line in lines if "profile" in line]
    assert [p["profile"] for p in profiles] == ["core/reference", "core/vectorised"], out
    for p in profiles:
        assert abs(sum(p["percent_of_step_time"].values()) - 100) < 1.0, p
    assert picture.stat().st_size > 1000, "--plot wrote no picture"


# --- quantized pools ---------------------------------------------------------------------------------

def test_quantized_write_keeps_codes_and_scales_per_token_and_head(serve):
    """int8 codes plus one float32 scale per (token, head) at the row's slot; reading back
    codes * scale gives the row to within scale / 2 per element (Chapter 28's bound)."""
    backend = serve.backends.get_backend("vectorised", kv_cache_dtype="int8")
    cache = backend.allocate((4, 2, 2, 8), torch.float32, "cpu")     # 3 blocks + scratch, block_size 2
    assert [t.dtype for t in cache] == [torch.int8, torch.int8, torch.float32, torch.float32]
    assert cache[2].shape == (4, 2, 2), "scales: [num_blocks + 1, block_size, kv_heads]"
    k = torch.randn(3, 2, 8, generator=torch.Generator().manual_seed(0))
    meta = make_meta(serve, [(3, 3, [1, 2])], 2)                    # slots 2, 3, 4
    backend.write(cache, k, -2 * k, meta)
    codes, scales = cache[0].view(-1, 2, 8), cache[2].view(-1, 2)
    assert torch.equal(scales[2:5], k.abs().amax(-1) / 127), "scale = max|x| / 127 per token and head"
    back = codes[2:5].float() * scales[2:5, :, None]
    assert torch.all((back - k).abs() <= scales[2:5, :, None] / 2 + 1e-6), "int8 rows exceed the scale/2 bound"
    assert torch.count_nonzero(codes[:2]) == 0 and torch.count_nonzero(codes[5:]) == 0
    v_codes, v_scales = cache[1].view(-1, 2, 8), cache[3].view(-1, 2)
    assert torch.equal(v_scales[2:5], 2 * scales[2:5]) and torch.equal(v_codes[2:5], -codes[2:5]), \
        "v's codes and scales are v's own (here -2k: twice k's scales, negated codes), at the same slots as k's"
    fp8 = serve.backends.get_backend("vectorised", kv_cache_dtype="fp8")
    cache = fp8.allocate((4, 2, 2, 8), torch.float32, "cpu")
    try:
        fp8.write(cache, k, -2 * k, meta)
    except NotImplementedError as exc:
        pytest.fail(f"an fp8 pool is written on every device, a CPU too, whose index_copy_ has no kernel for "
                    f"one-byte floats ({exc}): the codes' bytes are what must land in the pool")
    codes, scales = serve.backends.quantize_kv(k, "fp8")
    assert torch.equal(cache[0].view(torch.uint8).view(-1, 2, 8)[2:5], codes.view(torch.uint8)), (
        "fp8 codes land at the rows' slots bit for bit, as quantize_kv made them")
    assert torch.equal(cache[2].view(-1, 2)[2:5], scales), "fp8 scales land beside their codes, per token and head"


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_quantized_pools_read_alike_in_both_backends(serve, fmt):
    """The same writes, read by ReferenceBackend (its dequantize) and by the vectorised
    backend: the same dequantized keys, so the same attention to float rounding."""
    block_size, num_blocks, heads, kv_heads, dim = 8, 12, 4, 2, 16
    requests = random_requests(random.Random(fmt), [(9, 9), (14, 1), (20, 4)], block_size, num_blocks)
    meta = make_meta(serve, requests, block_size)
    gen = torch.Generator().manual_seed(7)
    rows = meta.query_start_loc_cpu[-1]
    q, k, v = (torch.randn(rows, n, dim, generator=gen) for n in (heads, kv_heads, kv_heads))
    full = make_meta(serve, [(n, n, t) for n, _, t in requests], block_size)     # every position written once
    k_all, v_all = (torch.randn(full.query_start_loc_cpu[-1], kv_heads, dim, generator=gen) for _ in "kv")
    outputs = {}
    for name in ("reference", "vectorised"):
        backend = serve.backends.get_backend(name, kv_cache_dtype=fmt)
        cache = backend.allocate((num_blocks + 1, block_size, kv_heads, dim), torch.float32, "cpu")
        backend.write(cache, k_all, v_all, full)
        backend.write(cache, k, v, meta)
        outputs[name] = backend.forward(q, cache, meta)
    assert torch.allclose(outputs["vectorised"], outputs["reference"], atol=1e-5, rtol=1e-5), describe_mismatch(
        f"{fmt} pool", outputs["vectorised"], outputs["reference"], meta)


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_triton_kernel_reads_quantized_pools_like_the_reference(serve, kernels, where, fmt):
    """The Triton backend reads a quantized pool's codes and per-token-per-head scales in
    place; ReferenceBackend reads the same pool through its dequantize. Both compute in
    float32 from the same dequantized values, so they agree to rounding: atol 1e-5."""
    block_size, num_blocks, heads, kv_heads, dim = 16, 6, 4, 2, 16
    requests = random_requests(random.Random(fmt), [(21, 3), (9, 1), (0, 1)], block_size, num_blocks)
    meta, cpu_meta = make_meta(serve, requests, block_size, device=where), make_meta(serve, requests, block_size)
    gen = torch.Generator().manual_seed(11)
    full = make_meta(serve, [(n, n, t) for n, _, t in requests], block_size)      # every position written once
    k_all, v_all = (torch.randn(full.query_start_loc_cpu[-1], kv_heads, dim, generator=gen) for _ in "kv")
    q = torch.randn(meta.query_start_loc_cpu[-1], heads, dim, generator=gen)
    reference_backend = serve.backends.get_backend("reference", kv_cache_dtype=fmt)
    cache = reference_backend.allocate((num_blocks + 1, block_size, kv_heads, dim), torch.float32, "cpu")
    reference_backend.write(cache, k_all, v_all, full)
    triton_backend = serve.backends.get_backend("triton", kv_cache_dtype=fmt)
    got = triton_backend.forward(q.to(where), tuple(t.to(where) for t in cache), meta).cpu()
    want = reference_backend.forward(q, cache, cpu_meta)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), describe_mismatch(f"triton, {fmt} pool", got, want,
                                                                              cpu_meta)


@pytest.mark.parametrize("fmt, bound", [("int8", 0.02), ("fp8", 0.08)])
def test_quantized_pool_logit_error_is_bounded(serve, tiny_model, fmt, bound):
    """Four prompts prefilled through ModelRunner with a float pool and with a quantized
    one: the largest logit difference, relative to the largest logit. Measured over 20
    prompt sets: at most 0.0076 (int8) and 0.033 (fp8); the bounds leave a factor 2.5."""
    rng = random.Random(11)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(5, 60))] for _ in range(4)]
    logits, sizes = {}, {}
    for dtype in ("auto", fmt):
        runner = serve.runner.ModelRunner(tiny_model, 32, BLOCK,
                                          backend=serve.backends.get_backend("vectorised", kv_cache_dtype=dtype))
        requests = [serve.request.Request(f"r{i}", p) for i, p in enumerate(prompts)]
        tables, used = {}, 0
        for r in requests:
            need = -(-len(r.token_ids) // BLOCK)
            tables[r.request_id], used = list(range(used, used + need)), used + need
        batch = runner.prepare([(r, len(r.token_ids)) for r in requests], tables)
        logits[dtype], sizes[dtype] = runner.execute(batch), runner.pool_bytes
    error = float((logits[fmt] - logits["auto"]).abs().max() / logits["auto"].abs().max())
    assert error <= bound, f"{fmt} pool: relative logit error {error:.4f} exceeds {bound}"
    # 1-byte codes plus a 4-byte scale per head_dim (16) numbers, against 4-byte floats.
    assert sizes[fmt] / sizes["auto"] == pytest.approx((16 + 4) / (16 * 4)), sizes


def test_quantized_pool_survives_swapping(serve, tiny_model):
    """Scales travel with their codes: an int8 engine that preempts and swaps gives the same
    tokens as the same engine with room for everyone."""
    prompts, max_tokens = five_requests(seed=2)
    _, roomy = serve_all(serve, tiny_model, prompts, max_tokens, attention_backend="vectorised",
                         kv_cache_dtype="int8")
    engine, tight = serve_all(serve, tiny_model, prompts, max_tokens, attention_backend="vectorised",
                              kv_cache_dtype="int8", num_blocks=12, preemption_mode="swap")
    assert engine.preemptions > 0, "the 12-block pool should preempt"
    for rid in prompts:
        assert tight[rid] == roomy[rid], f"request {rid}: swapped int8 K/V gave different tokens"


def _ledger(impl_text, device, capsys):
    from course import cli
    status = cli.main(["ledger", "--impl", impl_text, "--device", str(device), "--scale", "0.05", "--vocab-size", "320",
                       "--repeat", "1", "--quiet"])
    out, err = capsys.readouterr()
    assert status == 0, f"run.py ledger failed:\n{out}{err}"
    head, *lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return head, {line["contender"]: line for line in lines}


def test_run_py_ledger_rates_every_chapter_beside_transformers(impl, device, capsys):
    """`python run.py ledger` at a tiny scale: one line per chapter that changes speed (17,
    19, 21, 24, 25, 31, 32, 33), each through Chapter 32 with a rate, its ratio to the
    transformers' best named in the first line, its roofline share, and transformers'
    tokens (greedy, float32)."""
    head, lines = _ledger(impl.spec.text, device, capsys)
    assert head["transformers_best"].startswith("hf") and head["transformers_best_tok_s"] > 0, head
    assert head["roofline"]["matmul_tflops"]["float32"] > 0 and head["roofline"]["memory_gb_s"] > 0, head
    chapters = sorted({line["chapter"] for line in lines.values()})
    assert chapters == [17, 19, 21, 24, 25, 31, 32, 33], f"the ledger's chapters are {chapters}"
    for label, line in lines.items():
        if line["chapter"] > 32 and line.get("status") == "not written yet":
            continue
        assert line.get("tok_s", 0) > 0, f"{label}: no rate in {line}"
        assert line["vs_transformers_best"] == round(line["tok_s"] / head["transformers_best_tok_s"], 2), line
        assert line["roofline"]["of_matmul_peak"] > 0, f"{label}: no roofline share in {line}"
        assert line["identical_to_transformers"], f"{label}: greedy tokens differ from transformers' in {line}"


def test_run_py_ledger_reports_unwritten_chapters_instead_of_crashing(impl, device, capsys):
    """A learner who has finished Chapter 24 sees rates up to Chapter 24 and every later
    chapter as "not written yet", naming the stub, and the command succeeds."""
    _, lines = _ledger(f"{impl.source}@24", device, capsys)     # the package under test, as after Chapter 24
    for label, line in lines.items():
        if line["chapter"] <= 24:
            assert line.get("tok_s", 0) > 0, f"{label}: Chapter {line['chapter']} is written, yet {line}"
        else:
            assert line.get("status") == "not written yet" and "Chapter" in line["stub"], \
                f"{label}: Chapter {line['chapter']} is a stub after Chapter 24, yet {line}"


def test_run_py_bench_says_how_to_get_llama_cpp_when_it_is_missing(impl, device, monkeypatch, tmp_path, capsys):
    """Without llama-cpp-python (and no llama.cpp binary on PATH) the bench still runs, and
    one line says llama.cpp was skipped, why, and how to get it."""
    import sys

    from course import cli
    monkeypatch.setitem(sys.modules, "llama_cpp", None)           # `import llama_cpp` raises ImportError
    monkeypatch.setenv("PATH", str(tmp_path))
    status = cli.main(["bench", "--impl", impl.spec.text, "--device", str(device), "--workloads", "seed:vocab=320",
                       "--scale", "0.15", "--backends", "vectorised", "--repeat", "1", "--no-hf", "--quiet"])
    out, err = capsys.readouterr()
    assert status == 0, f"run.py bench failed without llama.cpp:\n{out}{err}"
    skipped = [json.loads(line) for line in out.splitlines() if '"skipped"' in line]
    assert len(skipped) == 1 and skipped[0]["skipped"] == "llama.cpp", out
    assert "llama-cpp-python" in skipped[0]["to_run_it"] and "llama_cpp" in skipped[0]["why"], skipped


@pytest.fixture(scope="module")
def llama_cpp_chat(smollm2_path):
    """Two chat questions of the bench's chat workload (3 tokens each, tokenized by the
    reference package: the learner's Chapter 36 and 39 come later) and the bench's llama.cpp
    contenders on SmolLM2's file; skipped where llama-cpp-python is not installed."""
    from course import bench
    missing = bench.llama_cpp_missing()
    if missing:
        pytest.skip(f"llama.cpp: {missing}")
    workload, = bench.make_workloads(reference(), ["chat"], scale=2 / 16)
    for item in workload.items:
        item.max_tokens = 3
    eos = reference().gguf.GGUFFile(smollm2_path).metadata["tokenizer.ggml.eos_token_id"]
    return workload, {c.label: c for c in bench.llama_cpp_contenders(workload.checkpoint, eos, float32_engine=True)}


def test_llama_cpp_contender_serves_a_batch_as_one_request_at_a_time(llama_cpp_chat):
    """The bench's batched llama.cpp contender (its own loop over llama.cpp's batch API:
    positions, sequence ids, which rows give logits) gives a request what llama-cpp-
    python's Llama gives it, on the same file: one request in the batch, where the two
    compute the same thing."""
    workload, contenders = llama_cpp_chat
    alone = workload.items[:1]
    labels = ("llama.cpp batched, Q4_1", "llama.cpp one at a time, Q4_1")
    assert set(labels) <= set(contenders), f"the bench's llama.cpp contenders are {sorted(contenders)}"
    batched, single = (contenders[label].serve(contenders[label].make(workload), alone)[0] for label in labels)
    assert len(single[alone[0].request_id]) == 3, f"3 tokens were asked, got {single}"
    assert batched == single, f"batched llama.cpp gave {batched}, llama-cpp-python's Llama {single}"


def test_llama_cpp_on_float32_weights_gives_the_engines_tokens(llama_cpp_chat, request):
    """llama.cpp batched on the GGUF file it dequantized to float32 runs the engine's own
    weights: two chat questions together give the reference engine core's greedy tokens
    (another program's sums, but no near tie in 3 tokens of these questions). The first run
    converts the file (half a gigabyte), and the core loads SmolLM2: --stress only. A
    maintainer's test: the chapter's text names no --stress run (llama-cpp-python is not a
    requirement), so the learner's edition does not promise it and it is not edition_stress."""
    if not request.config.getoption("stress"):
        pytest.skip("converts SmolLM2 to float32 and loads it twice: run with --stress")
    workload, contenders = llama_cpp_chat
    llama = contenders["llama.cpp batched, F32"]
    theirs = llama.serve(llama.make(workload), workload.items)[0]
    ref = reference()
    model = ref.checkpoint.load_model(workload.checkpoint)
    engine, config, params = (ref.load(f"serve.{name}") for name in ("engine", "config", "request"))
    core = engine.EngineCore(model, config.EngineConfig(num_blocks=32, attention_backend="vectorised"),
                             eos_token_id=model.cfg.eos_token_id)
    results = core.generate([it.prompt_ids for it in workload.items],
                            [params.SamplingParams(max_tokens=3) for _ in workload.items])
    mine = {it.request_id: result.output_token_ids for it, result in zip(workload.items, results)}
    assert theirs == mine, f"llama.cpp on float32 weights gave {theirs}, the engine core {mine}"
