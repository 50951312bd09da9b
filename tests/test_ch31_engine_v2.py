"""Chapter 31 milestone: the engine core (serve/).

Oracle for every generation test: the REFERENCE package's solo greedy `generate` on the
reference tiny model (`course.reference()`), one prompt at a time, same weights. Whatever
the engine does with a request (chunk it, batch it with others, preempt it and recompute
or swap it back, serve half of it from the prefix cache), its greedy tokens must be
exactly those. The unit tests pin down the rules the chapter calls easy to get wrong,
with oracles written out by hand or taken from torch (scaled_dot_product_attention) and
the dense model's own forward.

The tiny model's greedy choices have wide margins (course.models.greedy_margins): the
bit-level differences between a flattened batch and a solo run never flip a token, so
these tests are deterministic. The four-configuration test was run once over 300 workload
seeds, all passing.
"""
import hashlib
import random
from array import array

import pytest
import torch

from course import reference
from course.testing import oracles
from course.testing.engine_checks import engine_state
from course.testing.milestone_helpers import OperatorCounter, first_difference, token_at
from course.testing.oracle_records import recorded
from course.testing.oracles import TINY_EOS as EOS
from course.testing.oracles import ScriptedRunner, solo
from course.testing.oracles import assert_engine_idle as assert_idle

pytestmark = pytest.mark.chapter(31)

BLOCK = 16


# --- helpers ---------------------------------------------------------------------------------

def make_engine(serve, model, **config):
    return oracles.make_engine(serve, model, **{"block_size": BLOCK, "num_blocks": 64, **config})


def params(serve, max_tokens, **kwargs):
    return serve.request.SamplingParams(max_tokens=max_tokens, **kwargs)


def five_requests(seed=0):
    """Five prompts of different lengths; r2 starts with r1's first two blocks (32 tokens)."""
    rng = random.Random(seed)
    tokens = lambda n: [rng.randrange(256) for _ in range(n)]   # noqa: E731
    r1 = tokens(37)
    prompts = {"r0": tokens(5), "r1": r1, "r3": tokens(21), "r4": tokens(70)}
    prompts["r2"] = r1[:2 * BLOCK] + tokens(14)          # arrives last, when r1's blocks exist
    max_tokens = {"r0": 30, "r1": 40, "r2": 28, "r3": 36, "r4": 44}
    return prompts, max_tokens


class Trace:
    """Runs an engine step by step and remembers who got which token at which step."""

    def __init__(self, engine):
        self.engine = engine
        self.outputs, self.token_steps, self.finished = {}, {}, {}
        self.steps = self.preemptions = self.swap_outs = self.swap_ins = 0
        self.plans = []

    def add(self, request_id, prompt, p, **kwargs):
        self.engine.add_request(request_id, prompt, p, **kwargs)

    def run(self, max_steps=5000):
        while self.engine.has_unfinished:
            if self.steps >= max_steps:
                pytest.fail(f"engine still busy after {max_steps} steps: waiting "
                            f"{[r.request_id for r in self.engine.scheduler.waiting]}, running "
                            f"{[r.request_id for r in self.engine.scheduler.running]}")
            outputs = self.engine.step()
            plan = self.engine.last_plan
            self.steps += 1
            if plan is not None:
                self.plans.append([(r.request_id, n) for r, n in plan.scheduled])
                self.preemptions += len(plan.preempted)
                self.swap_outs += len(plan.swap_out)
                self.swap_ins += len(plan.swap_in)
            for out in outputs:
                self.outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
                self.token_steps.setdefault(out.request_id, []).extend([self.steps] * len(out.new_token_ids))
                if out.finished:
                    self.finished[out.request_id] = out
        return self

    def expect(self, request_id, expected, label=""):
        got = self.outputs.get(request_id, [])
        if got == expected:
            return
        i = first_difference(expected, got)
        step = self.token_steps[request_id][i] if i < len(got) else "(never)"
        pytest.fail(f"{label}request {request_id}: output token {i} (step {step}) differs from solo generate: "
                    f"expected {token_at(expected, i)}, got {token_at(got, i)}"
                    f"\n  expected {expected}\n  got      {got}")


class FakeRequest:
    """Just what BlockManager and build_batch read."""

    def __init__(self, serve, request_id, tokens, computed=0, cache_key=(), params=None):
        self.inner = serve.request.Request(request_id, list(tokens), params or serve.request.SamplingParams(),
                                           cache_key=tuple(cache_key))
        self.inner.num_computed_tokens = computed

    def __getattr__(self, name):
        return getattr(self.inner, name)


# --- the spec's correctness test ----------------------------------------------------------------

CONFIGS = {
    "small chunks, tight budget": dict(max_num_batched_tokens=24, long_prefill_token_threshold=8),
    "12 blocks, recompute": dict(num_blocks=12, preemption_mode="recompute"),
    "12 blocks, swap": dict(num_blocks=12, preemption_mode="swap"),
    "no prefix cache, 2 at a time": dict(enable_prefix_caching=False, max_num_seqs=2),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_five_requests_match_solo_generate(serve, tiny_model, ref_model, name):
    prompts, max_tokens = five_requests()
    engine = make_engine(serve, tiny_model, **CONFIGS[name])
    trace = Trace(engine)
    for rid, prompt in prompts.items():
        trace.add(rid, prompt, params(serve, max_tokens[rid]))
    trace.run()
    for rid, prompt in prompts.items():
        trace.expect(rid, solo(ref_model, prompt, max_tokens[rid]), f"[{name}] ")
    assert_idle(engine, f"[{name}] ")
    # The configuration really exercises what it is named after.
    if "12 blocks" in name:
        assert trace.preemptions > 0 and engine.preemptions == trace.preemptions, (
            f"[{name}] no request was preempted: the configuration lost its point")
    if "swap" in name:
        assert trace.swap_outs > 0 and trace.swap_ins == trace.swap_outs, (
            f"[{name}] {trace.swap_outs} swap-outs, {trace.swap_ins} swap-ins")
    if "recompute" in name:
        assert trace.swap_outs == 0
    if "no prefix" in name:
        assert engine.blocks.stats["hits"] == 0 and not engine.blocks.cached
        assert max(len(p) for p in trace.plans) <= 2, "max_num_seqs=2 but more requests ran in one step"
    else:
        assert engine.blocks.stats["hits"] > 0, f"[{name}] r2 shares two blocks with r1 but the cache never hit"
    if "tight budget" in name:
        assert all(sum(n for _, n in plan) <= 24 for plan in trace.plans), "a step exceeded the token budget"
        assert all(n <= 8 for plan in trace.plans for _, n in plan), "a chunk exceeded long_prefill_token_threshold"
        assert trace.steps > 10


def test_preempted_requests_resume_correctly(serve, tiny_model, ref_model):
    """Long outputs in a small pool: requests are preempted (some more than once) and resumed
    with the right state; their outputs still match solo generate."""
    prompts, max_tokens = five_requests(seed=3)
    for mode in ("recompute", "swap"):
        engine = make_engine(serve, tiny_model, num_blocks=10, preemption_mode=mode)
        trace = Trace(engine)
        requests = {rid: engine.add_request(rid, prompt, params(serve, max_tokens[rid]))
                    for rid, prompt in prompts.items()}
        trace.run()
        preempted = [rid for rid, r in requests.items() if r.num_preemptions]
        assert preempted, f"[{mode}] nobody was preempted in a 10-block pool"
        for rid in prompts:
            trace.expect(rid, solo(ref_model, prompts[rid], max_tokens[rid]), f"[{mode}] ")
        assert_idle(engine, f"[{mode}] ")


# --- hash chains and the block manager ----------------------------------------------------------

def test_hash_block_chain_and_extra_keys(serve):
    hash_block = serve.blocks.hash_block
    a = hash_block(None, [1, 2, 3, 4])
    assert isinstance(a, bytes) and len(a) == 16, "a BLAKE2b-128 key is 16 bytes"
    assert hash_block(None, [1, 2, 3, 4]) == a, "keys must be deterministic"
    assert hash_block(None, [1, 2, 3, 5]) != a
    b = hash_block(a, [5, 6, 7, 8])
    assert hash_block(hash_block(None, [9, 2, 3, 4]), [5, 6, 7, 8]) != b, "a key must depend on its parent"
    assert hash_block(a, [5, 6, 7, 8], ("lora-1",)) != b, "extra keys must change the key"
    assert hash_block(a, [5, 6, 7, 8], ("lora-1",)) != hash_block(a, [5, 6, 7, 8], ("lora-2",))
    assert hash_block(None, [256]) != hash_block(None, [0, 1]), "tokens must be packed as whole integers"
    by_hand = hashlib.blake2b(serve.blocks.ROOT_PARENT + array("q", [7, -1, 300]).tobytes(), digest_size=16)
    assert hash_block(None, [7, -1, 300]) == by_hand.digest(), (
        "the key is the 16-byte BLAKE2b of the parent key (ROOT_PARENT for the first block), then the "
        "tokens as signed 64-bit integers: its exact bytes are part of the contract")


def test_cache_key_isolates_prefixes(serve):
    mgr = serve.blocks.BlockManager(16, 4)
    tokens = list(range(13))
    alice = FakeRequest(serve, "alice", tokens, cache_key=("tenant-a",))
    assert mgr.allocate_slots(alice, 13)
    alice.inner.num_computed_tokens = 13
    mgr.cache_full_blocks(alice)
    same = FakeRequest(serve, "alice2", tokens, cache_key=("tenant-a",))
    other = FakeRequest(serve, "bob", tokens, cache_key=("tenant-b",))
    assert len(mgr.find_cached_prefix(same)) == 3
    assert mgr.find_cached_prefix(other) == [], "a different cache_key must never share cached blocks"
    assert other.block_hashes and other.block_hashes[0] != alice.block_hashes[0]


def test_find_cached_prefix_leaves_one_token(serve):
    mgr = serve.blocks.BlockManager(16, 4)
    first = FakeRequest(serve, "a", range(12))
    assert mgr.allocate_slots(first, 12)
    first.inner.num_computed_tokens = 12
    mgr.cache_full_blocks(first)
    assert len(mgr.block_hash) == 16 and sum(h is not None for h in mgr.block_hash) == 3
    exact = FakeRequest(serve, "b", range(12))          # all three blocks cached
    assert mgr.find_cached_prefix(exact) == mgr.req_blocks["a"][:2], (
        "a 12-token prompt in 4-token blocks may reuse at most 2 blocks: the block holding the last "
        "prompt token must be computed, its logits choose the first output token")
    longer = FakeRequest(serve, "c", list(range(12)) + [99])
    assert mgr.find_cached_prefix(longer) == mgr.req_blocks["a"]
    diverging = FakeRequest(serve, "d", [0, 1, 2, 3, 77, 5, 6, 7, 8, 9, 10, 11, 12])
    assert mgr.find_cached_prefix(diverging) == mgr.req_blocks["a"][:1], "the match stops at the first miss"
    wants_logprobs = FakeRequest(serve, "p", range(13), params=params(serve, 1, prompt_logprobs=0))
    assert mgr.find_cached_prefix(wants_logprobs) == [], (
        "a request that asks for prompt logprobs computes every prompt position: it reuses no cached block")
    off = serve.blocks.BlockManager(16, 4, enable_prefix_caching=False)
    assert off.find_cached_prefix(FakeRequest(serve, "e", range(13))) == []


def test_a_lookup_stops_at_the_first_evicted_block(serve):
    """The first block of a chain was evicted while the second stayed cached: a lookup finds
    nothing, since the cache serves only a leading run of the prompt."""
    mgr = serve.blocks.BlockManager(4, 4)
    a = FakeRequest(serve, "a", range(9))
    assert mgr.allocate_slots(a, 9)
    a.inner.num_computed_tokens = 9
    mgr.cache_full_blocks(a)
    head, second = mgr.req_blocks["a"][:2]
    mgr.free(a)
    keeper = FakeRequest(serve, "keep", range(100, 104))
    assert mgr.allocate_slots(keeper, 0, [second])          # holds the second block only
    filler = FakeRequest(serve, "fill", range(200, 212))
    assert mgr.allocate_slots(filler, 12)                   # takes the other three, evicting the head
    assert mgr.block_hash[head] is None and mgr.block_hash[second] is not None
    assert mgr.find_cached_prefix(FakeRequest(serve, "b", range(9))) == [], (
        "the match stops at the first miss: a later block still cached is of no use without those before it")


def test_adopting_cached_free_block_costs_a_free_slot(serve):
    mgr = serve.blocks.BlockManager(4, 4)
    first = FakeRequest(serve, "a", range(8))
    assert mgr.allocate_slots(first, 8)
    first.inner.num_computed_tokens = 8
    mgr.cache_full_blocks(first)
    mgr.free(first)                                         # 2 cached-free + 2 free blocks
    assert mgr.num_free == 4
    second = FakeRequest(serve, "b", list(range(8)) + list(range(100, 112)))   # 20 tokens = 5 blocks
    cached = mgr.find_cached_prefix(second)
    assert len(cached) == 2
    before = (list(mgr.ref_count), list(mgr.free_queue), dict(mgr.cached), list(mgr.block_hash))
    # 2 adopted + 3 fresh = 5 blocks > 4: the adopted ones come out of the same free queue.
    overcommitted = "allocate_slots over-committed the pool: adopting a cached-free block uses up a free block"
    try:
        fitted = mgr.allocate_slots(second, 12, cached)
    except Exception as exc:                                # ran out of free blocks half-way
        pytest.fail(f"{overcommitted} (it raised {exc!r} half-way)")
    assert fitted is False, overcommitted
    after = (list(mgr.ref_count), list(mgr.free_queue), dict(mgr.cached), list(mgr.block_hash))
    assert after == before, "a failed allocation must change nothing (all or nothing)"
    assert "b" not in mgr.req_blocks, (
        "a failed allocation must leave no trace, not even an empty block list for the request")
    assert mgr.allocate_slots(second, 8, cached) is True     # 2 adopted + 2 fresh = 4 fits
    assert mgr.req_blocks["b"][:2] == cached, "the adopted blocks come first, in logical order"
    assert mgr.num_free == 0 and not any(b in mgr.free_queue for b in cached), (
        "an adopted cached-free block leaves the free queue")


def test_allocation_is_all_or_nothing(serve):
    mgr = serve.blocks.BlockManager(6, 4)
    a = FakeRequest(serve, "a", range(10))
    assert mgr.allocate_slots(a, 10)                         # 3 blocks
    b = FakeRequest(serve, "b", range(50, 65))
    before = (list(mgr.ref_count), list(mgr.free_queue), {k: list(v) for k, v in mgr.req_blocks.items()})
    assert mgr.allocate_slots(b, 15) is False                # needs 4, 3 free
    assert (list(mgr.ref_count), list(mgr.free_queue),
            {k: list(v) for k, v in mgr.req_blocks.items() if v}) == before
    assert mgr.allocate_slots(b, 12) is True
    a.inner.num_computed_tokens = 10
    assert mgr.allocate_slots(a, 2) is True, "10 + 2 tokens still fit a's 3 blocks: no new block needed"
    assert len(mgr.req_blocks["a"]) == 3
    assert mgr.allocate_slots(a, 3) is False


def test_free_is_tail_first_and_blocks_keep_their_hash(serve):
    mgr = serve.blocks.BlockManager(8, 4)
    a = FakeRequest(serve, "a", range(14))
    assert mgr.allocate_slots(a, 14)
    a.inner.num_computed_tokens = 14
    mgr.cache_full_blocks(a)
    owned = list(mgr.req_blocks["a"])                         # 4 blocks, 3 of them full
    mgr.free(a)
    assert list(mgr.free_queue)[-4:] == owned[::-1], (
        f"freed blocks must join the back of the free queue tail first: expected {owned[::-1]}, "
        f"got {list(mgr.free_queue)[-4:]}")
    assert [mgr.state(b) for b in owned] == ["cached", "cached", "cached", "free"], (
        "a freed block keeps its hash: its full blocks are cached-free until the allocator reuses them")
    assert all(mgr.block_hash[b] is not None for b in owned[:3]), "a freed block keeps its hash"
    # Fresh allocations take the untouched free blocks first, then a's tail before its head.
    c = FakeRequest(serve, "c", range(200, 224))
    assert mgr.allocate_slots(c, 24)                         # 6 blocks: 4 never used, then a's last two
    assert mgr.req_blocks["c"][-2:] == owned[::-1][:2]
    assert mgr.block_hash[owned[2]] is None and mgr.block_hash[owned[3]] is None, "reallocated: hash dropped"
    assert mgr.block_hash[owned[0]] is not None, "a's first block was not reused and is still cached"
    d = FakeRequest(serve, "d", list(range(14)))
    assert mgr.find_cached_prefix(d) == owned[:2], "a's first two blocks should still be found"


def test_hitting_a_cached_free_block_keeps_its_hash(serve):
    mgr = serve.blocks.BlockManager(8, 4)
    a = FakeRequest(serve, "a", range(9))
    assert mgr.allocate_slots(a, 9)
    a.inner.num_computed_tokens = 9
    mgr.cache_full_blocks(a)
    mgr.free(a)
    b = FakeRequest(serve, "b", range(9))
    hit = mgr.find_cached_prefix(b)
    assert len(hit) == 2
    keys = [mgr.block_hash[x] for x in hit]
    assert mgr.allocate_slots(b, 1, hit)
    assert [mgr.block_hash[x] for x in hit] == keys and None not in keys, (
        "adopting a cached-free block must not reset its hash")
    assert all(mgr.cached[k] == x for k, x in zip(keys, hit))
    assert all(mgr.ref_count[x] == 1 for x in hit) and not any(x in mgr.free_queue for x in hit)
    c = FakeRequest(serve, "c", range(9))
    assert mgr.find_cached_prefix(c) == hit, "a third request must still find the adopted blocks"
    assert mgr.allocate_slots(c, 1, hit) and all(mgr.ref_count[x] == 2 for x in hit)
    mgr.free(b)
    assert all(mgr.ref_count[x] == 1 and x not in mgr.free_queue for x in hit), (
        "a block shared by several requests stays in use until the last of them frees it")
    mgr.free(c)
    assert mgr.num_free == 8
    assert mgr.hit_rate == pytest.approx(16 / 18), (
        "the hit rate is the tokens found over ALL the prompt tokens looked up (2 lookups of 8 found in 18)")


def test_publishing_at_allocation_time_and_trim(serve):
    mgr = serve.blocks.BlockManager(8, 4)
    a = FakeRequest(serve, "a", range(10))
    assert mgr.allocate_slots(a, 10)
    mgr.cache_full_blocks(a, 10)                    # before any compute: blocks 0 and 1 are published
    assert len(mgr.cached) == 2, (
        "blocks are published when allocated: cache_full_blocks(request, num_tokens) counts num_tokens "
        "as written, before the forward pass writes them")
    b = FakeRequest(serve, "b", range(11))
    assert mgr.find_cached_prefix(b) == mgr.req_blocks["a"][:2]
    mgr.trim(a, 4)                                   # keep one block
    assert len(mgr.req_blocks["a"]) == 1 and len(mgr.cached) == 1, "trimmed blocks leave the cache"
    mgr.reset_prefix_cache()
    assert len(mgr.cached) == 1, "blocks in use keep their keys"
    mgr.free(a)
    mgr.reset_prefix_cache()
    assert not mgr.cached and all(h is None for h in mgr.block_hash)


def test_only_blocks_written_by_this_step_are_published(serve):
    """nano-vllm issue 208: a chunk writes tokens 0..5 of a 16-token prompt. Block 1 (tokens
    4..7) is allocated but only half written this step; published, a request of the same step
    would adopt it and read slots 6 and 7 before anyone wrote them."""
    mgr = serve.blocks.BlockManager(8, 4)
    a = FakeRequest(serve, "a", range(16))
    assert mgr.allocate_slots(a, 6)                  # blocks 0 and 1
    mgr.cache_full_blocks(a, 6)
    assert [mgr.state(b) for b in mgr.req_blocks["a"]] == ["used", "used"]
    assert list(mgr.cached.values()) == mgr.req_blocks["a"][:1], (
        "only full blocks among the tokens written so far (or this step) are published: a request must not "
        "adopt a block another is still filling")
    assert mgr.find_cached_prefix(FakeRequest(serve, "b", range(16))) == mgr.req_blocks["a"][:1]
    # Two requests computed the same block privately: the first published keeps the key.
    twin = FakeRequest(serve, "twin", range(16))
    assert mgr.allocate_slots(twin, 4)
    mgr.cache_full_blocks(twin, 4)
    key = a.block_hashes[0]
    assert mgr.cached[key] == mgr.req_blocks["a"][0] and mgr.block_hash[mgr.req_blocks["twin"][0]] is None, (
        "the first block published under a key keeps it; a duplicate computed by another request stays private")


# --- the flattened batch --------------------------------------------------------------------------

def test_slot_mapping_crosses_block_boundaries(serve):
    req = FakeRequest(serve, "a", range(100, 112), computed=2)
    batch = serve.batch.build_batch([(req, 7)], {"a": [7, 2, 9]}, 4)
    # positions 2..8 -> blocks [7, 7, 2, 2, 2, 2, 9], offsets [2, 3, 0, 1, 2, 3, 0]
    assert batch.meta.slot_mapping.tolist() == [30, 31, 8, 9, 10, 11, 36], (
        "a token's slot is in the physical block its block table gives: table[p // 4] * 4 + p % 4")
    assert batch.positions.tolist() == list(range(2, 9))
    assert batch.input_ids.tolist() == list(range(102, 109))
    assert batch.meta.seq_lens_cpu == [9], "seq_lens is the context length after this step (2 computed + 7 new)"
    assert batch.meta.query_start_loc_cpu == [0, 7]
    assert batch.logits_indices.tolist() == [] and batch.sample_counts == [0], "a mid-prompt chunk samples nothing"
    with pytest.raises(ValueError, match="a"):
        serve.batch.build_batch([(req, 11)], {"a": [7, 2, 9]}, 4)


def test_flattened_batch_layout_and_logits_rows(serve):
    mid = FakeRequest(serve, "mid", range(20), computed=4)          # chunk 4..9 of a 20-token prompt
    end = FakeRequest(serve, "end", range(9), computed=6)           # chunk that finishes the prompt
    dec = FakeRequest(serve, "dec", range(13), computed=12)          # a decode
    new = FakeRequest(serve, "new", range(4))                        # a whole 4-token prompt
    tables = {"mid": [3, 4, 5, 6, 7], "end": [8, 9, 10], "dec": [0, 1, 2, 11], "new": [12]}
    batch = serve.batch.build_batch([(mid, 6), (end, 3), (dec, 1), (new, 4)], tables, 4, pad_to=6)
    meta = batch.meta
    assert meta.query_start_loc_cpu == [0, 6, 9, 10, 14, 15, 16]
    assert meta.seq_lens_cpu == [10, 9, 13, 4, 0, 0]
    assert meta.query_start_loc.tolist() == meta.query_start_loc_cpu and meta.seq_lens.tolist() == meta.seq_lens_cpu
    assert batch.positions.tolist() == [4, 5, 6, 7, 8, 9, 6, 7, 8, 12, 0, 1, 2, 3, 0, 0]
    assert batch.sample_counts == [0, 1, 1, 1] and batch.num_sample_rows == 3
    assert batch.logits_indices.tolist() == [8, 9, 13], "sampled rows: end's last, the decode, new's last"
    assert meta.slot_mapping.tolist()[-2:] == [-1, -1], "padding rows write to slot -1"
    assert meta.block_table.shape == (6, 5) and meta.block_table.dtype == torch.int32
    assert meta.block_table[2].tolist() == [0, 1, 2, 11, 0]
    assert meta.max_query_len == 6 and meta.max_seq_len == 13 and meta.num_reqs == 6
    assert batch.request_ids == ["mid", "end", "dec", "new"]



def test_build_batch_makes_as_many_tensor_operations_for_a_large_batch_as_a_small_one(serve):
    """build_batch runs every step: its cost in tensor operations may not grow with the batch.
    The oracle is the small batch itself: a batch six times as wide, with many times the rows,
    may run no more torch operators (tensors made from lists, element writes, copies, views)."""
    def batch_of(num_requests, rows_each):
        requests, tables = [], {}
        for r in range(num_requests):
            prompt = FakeRequest(serve, f"p{r}", range(rows_each + 3), computed=3)        # a prompt chunk
            decode = FakeRequest(serve, f"d{r}", range(30 + r), computed=29 + r)         # a decode
            requests += [(prompt, rows_each), (decode, 1)]
            tables[f"p{r}"] = list(range(r, r + (rows_each + 3) // 4 + 1))
            tables[f"d{r}"] = list(range(40 + r, 40 + r + (30 + r) // 4 + 1))
        return requests, tables

    counts = {}
    for size in ("small", "large"):
        requests, tables = batch_of(*((1, 2) if size == "small" else (6, 14)))
        with OperatorCounter() as counter:
            batch = serve.batch.build_batch(requests, tables, 4, pad_to=len(requests) + 2)
        counts[size] = (counter.ops, batch.num_tokens, len(requests))
    (small, small_rows, small_reqs), (large, large_rows, large_reqs) = counts["small"], counts["large"]
    grew = {name: f"{small[name]} -> {n}" for name, n in large.items() if n > small[name]}
    assert sum(large.values()) <= sum(small.values()), (
        f"build_batch made {sum(small.values())} tensor operations for {small_reqs} requests ({small_rows} rows) "
        f"but {sum(large.values())} for {large_reqs} requests ({large_rows} rows); grew: {grew} (it runs every "
        "step, and on a GPU each tensor operation is a copy to the device or a kernel launch: their number "
        "must not grow with the number of requests or rows)")


def test_write_kv_and_the_scratch_block(serve):
    k_cache = torch.zeros(4, 2, 1, 3)               # 3 blocks + scratch, block_size 2
    v_cache = torch.zeros(4, 2, 1, 3)
    k = torch.arange(9, dtype=torch.float32).reshape(3, 1, 3) + 1
    serve.backends.write_kv(k_cache, v_cache, k, -k, torch.tensor([5, -1, 0]))
    flat = k_cache.view(-1, 1, 3)
    assert torch.equal(flat[5], k[0]) and torch.equal(flat[0], k[2])
    assert torch.equal(flat[7], k[1]), "a slot -1 row must land in the pool's last slot (scratch)"
    assert torch.count_nonzero(flat[1:5]) == 0 and torch.count_nonzero(flat[6]) == 0
    assert torch.equal(v_cache.view(-1, 1, 3)[5], -k[0]), "values go to the value pool, keys to the key pool"


def test_reference_backend_matches_sdpa(serve):
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, bs = 4, 2, 8, 4
    pool_k = torch.randn(11, bs, kv_heads, dim, generator=gen)
    pool_v = torch.randn(11, bs, kv_heads, dim, generator=gen)
    reqs = [("a", 9, 3, [6, 1, 8]), ("b", 5, 1, [2, 9]), ("c", 4, 4, [0])]   # (id, seq_len, new rows, table)
    starts, rows = [0], 0
    for _, _, t, _ in reqs:
        rows += t
        starts.append(rows)
    q = torch.randn(rows, heads, dim, generator=gen)
    width = max(len(t) for *_, t in reqs)
    meta = serve.batch.BatchMeta(
        query_start_loc=torch.tensor(starts, dtype=torch.int32), seq_lens=torch.tensor([r[1] for r in reqs]),
        block_table=torch.tensor([t + [0] * (width - len(t)) for *_, t in reqs], dtype=torch.int32),
        slot_mapping=torch.zeros(rows, dtype=torch.int64), block_size=bs, query_start_loc_cpu=starts,
        seq_lens_cpu=[r[1] for r in reqs], max_query_len=4, max_seq_len=9)
    for window in (0, 3):
        out = serve.backends.ReferenceBackend().forward(q, (pool_k, pool_v), meta, window=window)
        assert out.shape == q.shape
        for (rid, length, t, table), s in zip(reqs, starts):
            keys = pool_k[table].reshape(-1, kv_heads, dim)[:length].transpose(0, 1).repeat_interleave(2, 0)
            values = pool_v[table].reshape(-1, kv_heads, dim)[:length].transpose(0, 1).repeat_interleave(2, 0)
            q_pos = torch.arange(length - t, length)
            mask = torch.arange(length)[None, :] <= q_pos[:, None]
            if window:
                mask &= torch.arange(length)[None, :] > q_pos[:, None] - window
            want = torch.nn.functional.scaled_dot_product_attention(
                q[s:s + t].transpose(0, 1), keys, values, attn_mask=mask).transpose(0, 1)
            torch.testing.assert_close(out[s:s + t], want, atol=1e-5, rtol=1e-5,
                                       msg=lambda m, rid=rid, window=window: (
                                           f"request {rid} (window {window}): each row attends causally to its "
                                           f"own context's keys, read through its block table row: {m}"))


def test_flat_model_matches_dense_forward(serve, tiny_model, ref_model, device):
    """Two requests flattened into one batch (one mid-sequence) give the dense model's logits,
    RoPE tables are built once per step, and only the selected rows reach the LM head."""
    runner = serve.runner.ModelRunner(tiny_model, num_blocks=8, block_size=4)
    calls = []
    rope = runner.flat.rope
    runner.flat.rope = lambda *a: calls.append(1) or rope(*a)
    a = FakeRequest(serve, "a", [5, 9, 13, 200, 7, 1, 2])
    b = FakeRequest(serve, "b", [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50])
    tables = {"a": [3, 0], "b": [1, 6, 2]}
    first = runner.prepare([(a, 7), (b, 6)], tables)
    logits = runner.execute(first)
    assert len(calls) == 1, f"RoPE tables built {len(calls)} times in one step (want once per step)"
    assert logits.shape == (1, tiny_model.cfg.vocab_size), "only a's last row samples in this step"
    b.inner.num_computed_tokens = 6
    second = runner.prepare([(b, 5)], tables)
    logits_b = runner.execute(second)
    with torch.inference_mode():
        dense_a = ref_model(torch.tensor([a.token_ids], device=device))[0, -1]
        dense_b = ref_model(torch.tensor([b.token_ids], device=device))[0, -1]
    torch.testing.assert_close(logits[0], dense_a, atol=1e-4, rtol=1e-4, msg=lambda m: (
        f"a's whole prompt, flattened with b's first chunk, must give the dense model's logits (QK-norm, then "
        f"RoPE on q and k, this step's K/V written before attention reads, the final norm): {m}"))
    torch.testing.assert_close(logits_b[0], dense_b, atol=1e-4, rtol=1e-4, msg=lambda m: (
        f"b's second chunk must read its first chunk's K/V from the pool and match the dense model: {m}"))



def test_flat_model_goes_through_its_seams(serve, tiny_model):
    """Every residual add and norm goes through add_norm (the final norm too), every sublayer
    through attention and mlp: Chapter 33 fuses add_norm, Chapters 42 and 43 change the others."""
    runner = serve.runner.ModelRunner(tiny_model, num_blocks=8, block_size=4)
    flat, calls = runner.flat, {"add_norm": 0, "attention": 0, "mlp": 0}

    def counted(name):
        seam = getattr(flat, name)
        return lambda *args: calls.update({name: calls[name] + 1}) or seam(*args)

    for name in calls:
        setattr(flat, name, counted(name))
    a = FakeRequest(serve, "a", [5, 9, 13, 200, 7])
    runner.execute(runner.prepare([(a, 5)], {"a": [3, 0]}))
    layers = tiny_model.cfg.num_hidden_layers
    want = {"add_norm": 2 * layers + 1, "attention": layers, "mlp": layers}
    assert calls == want, (
        f"FlatModel.forward goes through its seams, never around them: a {layers}-layer model makes "
        f"{want} calls (add_norm for every residual add and norm, the final norm included), got {calls}")

# --- the scheduler and the engine ------------------------------------------------------------------

def test_priority_policy_orders_admission(serve, tiny_model, ref_model):
    engine = make_engine(serve, tiny_model, policy="priority", max_num_seqs=1)
    trace = Trace(engine)
    prompts = {"low": [1, 2, 3], "high": [4, 5, 6], "mid": [7, 8, 9]}
    for rid, prio in (("low", 5), ("high", 0), ("mid", 2)):
        trace.add(rid, prompts[rid], params(serve, 4), priority=prio)
    trace.run()
    first_step = {rid: steps[0] for rid, steps in trace.token_steps.items()}
    assert sorted(first_step, key=first_step.get) == ["high", "mid", "low"], f"first-token steps {first_step}"
    for rid, prompt in prompts.items():
        trace.expect(rid, solo(ref_model, prompt, 4))


def test_priority_preempts_the_lowest_priority_request(serve, tiny_model, ref_model):
    engine = make_engine(serve, tiny_model, policy="priority", num_blocks=6)
    rng = random.Random(5)
    prompts = {rid: [rng.randrange(256) for _ in range(20)] for rid in ("p0", "p1", "p2")}
    requests = {rid: engine.add_request(rid, prompts[rid], params(serve, 40), priority=int(rid[1]))
                for rid in prompts}
    trace = Trace(engine).run()
    assert requests["p2"].num_preemptions > 0, "the lowest-priority request (priority 2) should be the victim"
    assert requests["p0"].num_preemptions == 0, "the highest-priority request must never be preempted"
    for rid, prompt in prompts.items():
        trace.expect(rid, solo(ref_model, prompt, 40))


def test_scheduler_preempt_states(serve, tiny_model):
    for mode in ("recompute", "swap"):
        engine = make_engine(serve, tiny_model, preemption_mode=mode)
        request = engine.add_request("x", list(range(30)), params(serve, 5))
        engine.step()
        assert request.num_computed_tokens == 30 and request.status.name == "RUNNING"
        out = serve.scheduler.SchedulerOutput()
        engine.scheduler._preempt(request, out)
        assert request.status.name == "PREEMPTED" and request.num_preemptions == 1, (
            "a preempted request has status PREEMPTED and one more preemption counted")
        assert out.preempted == [request] and engine.scheduler.waiting.peek() is request
        assert not engine.scheduler.running and engine.blocks.num_free == engine.blocks.num_blocks
        if mode == "swap":
            assert request.num_computed_tokens == 30 and request.swapped_out, (
                "swap mode: a preempted request keeps its computed tokens and is marked swapped_out")
            assert len(out.swap_out) == 1 and out.swap_out[0][0] is request and len(out.swap_out[0][1]) == 2, (
                f"swap mode: swap_out names the blocks the request held when preempted (its two blocks, listed "
                f"before they were freed), got {out.swap_out}")
        else:
            assert request.num_computed_tokens == 0 and not out.swap_out, (
                "recompute mode: a preempted request computes prompt and output again from position 0, no swap")


@pytest.mark.parametrize("where", ["waiting", "running", "preempted", "swapped"])
def test_abort_gives_everything_back(serve, tiny_model, ref_model, where):
    mode = "swap" if where == "swapped" else "recompute"
    engine = make_engine(serve, tiny_model, num_blocks=6, preemption_mode=mode,
                         max_num_seqs=2 if where == "waiting" else 8)
    rng = random.Random(11)
    prompts = {rid: [rng.randrange(256) for _ in range(20)] for rid in ("a", "b", "c")}
    requests = {rid: engine.add_request(rid, p, params(serve, 40)) for rid, p in prompts.items()}
    victim = None
    for _ in range(200):
        engine.step()
        states = {rid: r.status.name for rid, r in requests.items()}
        if where == "waiting" and states["c"] == "WAITING":
            victim = "c"
        elif where == "running" and states["a"] == "RUNNING" and requests["a"].num_output_tokens >= 3:
            victim = "a"
        elif where in ("preempted", "swapped"):
            victim = next((rid for rid, r in requests.items() if r.status.name == "PREEMPTED"), None)
            if where == "swapped" and victim is not None:
                assert requests[victim].swapped_out and victim in engine.runner.swapped
        if victim:
            break
    assert victim, f"never reached a {where} request to abort"
    aborted = engine.abort_request(victim)
    assert aborted is requests[victim] and aborted.status.name == "FINISHED_ABORTED"
    assert victim not in engine.runner.swapped and engine.abort_request(victim) is None
    trace = Trace(engine).run()
    assert victim not in trace.outputs
    assert_idle(engine, f"[abort {where}] ")
    for rid in prompts:
        if rid != victim:
            full = requests[rid].output_token_ids
            assert full == solo(ref_model, prompts[rid], 40), f"request {rid} went wrong after aborting {victim}"


def test_n_samples_share_the_prompt(serve, tiny_model, ref_model):
    engine = make_engine(serve, tiny_model)
    prompt = list(range(40, 90))
    children = engine.add_request("multi", prompt, params(serve, 6, n=3))
    assert [c.request_id for c in children] == ["multi:0", "multi:1", "multi:2"]
    engine.step()
    plan = engine.last_plan
    assert [n for _, n in plan.scheduled] == [50, 2, 2], (
        f"samples 1 and 2 should adopt sample 0's three full blocks, published when allocated in the same "
        f"step, and compute only the 2 remaining tokens: scheduled {[(r.request_id, n) for r, n in plan.scheduled]}")
    assert [c.num_cached_tokens for c in children] == [0, 48, 48]
    held = {c.request_id: engine.blocks.req_blocks[c.request_id] for c in children}
    assert plan.block_tables == held, (
        f"the plan's block_tables should give each scheduled request the blocks it holds for the step: "
        f"got {plan.block_tables}, the block manager has {held}")
    assert len({tuple(t[:3]) for t in plan.block_tables.values()}) == 1, "the samples share the prompt's 3 blocks"
    assert all(plan.block_tables[rid] is not held[rid] for rid in held), (
        "block_tables holds copies (scheduler.block_table): a later allocation must not change a plan already made")
    trace = Trace(engine).run()
    want = solo(ref_model, prompt, 6)
    for child in children:
        assert child.output_token_ids == want, f"{child.request_id}: {child.output_token_ids} != {want}"
    assert_idle(engine)
    outs = make_engine(serve, tiny_model).generate([prompt, [1, 2, 3]], [params(serve, 6, n=2), params(serve, 3)])
    assert isinstance(outs[0], list) and [o.output_token_ids for o in outs[0]] == [want, want]
    assert outs[1].output_token_ids == solo(ref_model, [1, 2, 3], 3)
    assert trace.steps > 0


def test_a_prompt_that_is_entirely_cached(serve, tiny_model, ref_model):
    engine = make_engine(serve, tiny_model)
    exact = list(range(100, 132))                    # exactly two blocks
    first = engine.generate([exact], params(serve, 5))[0]
    assert first.output_token_ids == solo(ref_model, exact, 5)
    again = engine.add_request("again", exact, params(serve, 5))
    engine.step()
    assert engine.last_plan.scheduled[0][1] == 16 and again.num_cached_tokens == 16, (
        "both blocks are cached, but the block holding the last prompt token must be recomputed")
    Trace(engine).run()
    assert again.output_token_ids == first.output_token_ids
    plus_one = exact + [7]
    last = engine.add_request("plus-one", plus_one, params(serve, 5))
    engine.step()
    assert engine.last_plan.scheduled[0][1] == 1 and last.num_cached_tokens == 32
    Trace(engine).run()
    assert last.output_token_ids == solo(ref_model, plus_one, 5)
    assert_idle(engine)


def test_on_finish_runs_before_blocks_are_freed(serve, tiny_model):
    engine = make_engine(serve, tiny_model)
    seen = []

    def hook(request):
        blocks = engine.blocks.req_blocks.get(request.request_id, [])
        seen.append((request.request_id, request.status.name, [engine.blocks.ref_count[b] for b in blocks]))

    engine.scheduler.on_finish = hook
    engine.generate([list(range(20))], params(serve, 3))
    assert len(seen) == 1 and seen[0][1] == "FINISHED_LENGTH" and seen[0][2] and all(c > 0 for c in seen[0][2])
    assert_idle(engine)


def test_check_stop_rules(serve, tiny_model):
    engine = make_engine(serve, tiny_model, max_model_len=12)
    Request = serve.request.Request
    Status = serve.request.Status

    def req(output, **kw):
        r = Request("s", [1, 2, 3], params(serve, kw.pop("max_tokens", 8), **kw), eos_token_id=EOS)
        for t in output:
            r.append(t)
        return r

    assert engine.check_stop(req([5])) is None
    r = req([5, 9], stop_token_ids=[9])
    assert engine.check_stop(r) is Status.FINISHED_STOPPED and r.stop_reason == 9
    assert engine.check_stop(req([EOS])) is Status.FINISHED_STOPPED
    assert engine.check_stop(req([EOS], ignore_eos=True)) is None, "ignore_eos lets a request run past EOS"
    assert engine.check_stop(req([EOS], min_tokens=2)) is None, "min_tokens holds back EOS"
    assert engine.check_stop(req([4, EOS], min_tokens=2)) is Status.FINISHED_STOPPED
    assert engine.check_stop(req([9], min_tokens=2, stop_token_ids=[9])) is None
    assert engine.check_stop(req([4, 4, 4], max_tokens=3)) is Status.FINISHED_LENGTH
    assert engine.check_stop(req([4, 4, 4], max_tokens=3), index=-2) is None, (
        "check_stop judges the token at `index` (here the second output token of three), not the newest")
    assert engine.check_stop(req([4] * 9)) is Status.FINISHED_LENGTH, "3 + 9 = 12 positions: the context limit"
    assert engine.check_stop(req([4] * 8)) is Status.FINISHED_LENGTH
    assert engine.check_stop(req([4] * 9, max_tokens=20)) is Status.FINISHED_LENGTH, (
        "3 + 9 = 12 positions reach max_model_len: the context limit ends the request")
    assert engine.check_stop(req([4] * 8, max_tokens=20)) is None, "3 + 8 = 11 positions: one is left"


def test_sampled_requests_reproduce_with_a_seed(serve, tiny_model, ref_model, device):
    prompt = list(range(30, 52))
    solo_sampled = solo(ref_model, prompt, 12, temperature=0.9, top_k=50,
                        generator=torch.Generator(device=device).manual_seed(123))
    engine = make_engine(serve, tiny_model)
    outs = engine.generate([prompt, list(range(60, 90))],
                           [params(serve, 12, temperature=0.9, top_k=50, seed=123), params(serve, 7)])
    assert outs[0].output_token_ids == solo_sampled, "a seeded request must draw like solo generate with that seed"


def test_bad_input_leaves_the_engine_untouched(serve, tiny_model):
    engine = make_engine(serve, tiny_model, num_blocks=8, max_num_batched_tokens=64, enable_chunked_prefill=False)
    engine.add_request("busy", list(range(20)), params(serve, 4))
    engine.add_request("x:1", [1, 2, 3], params(serve, 4))
    engine.step()
    before = engine_state(engine)
    cases = {
        "empty": (("e", [], params(serve, 4)), "empty"),
        "duplicate": (("busy", [1, 2], params(serve, 4)), "busy"),
        "vocabulary": (("v", [1, 2, 10_000], params(serve, 4)), "10000"),
        "negative": (("neg", [1, -1], params(serve, 4)), "-1"),
        "pool": (("big", list(range(60)), params(serve, 100)), "pool"),
        "positions": (("long", [1] * 10, params(serve, 2000)), "positions"),
        "budget": (("budget", [1] * 65, params(serve, 4)), "budget"),
        "n>1 clash": (("x", [1, 2, 3], params(serve, 4, n=3)), "x:1"),
        "later chapter": (("lp", [1, 2, 3], params(serve, 4, logprobs=2)), "Chapter 34"),
        "guided": (("g", [1, 2, 3], params(serve, 4, guided_regex="a+")), "Chapter 35"),
    }
    for name, (args, words) in cases.items():
        with pytest.raises(ValueError, match=words):
            engine.add_request(*args)
        assert engine_state(engine) == before, f"rejecting the {name} request changed the engine"
    with pytest.raises(ValueError, match="Chapter 43"):
        engine.add_request("img", [1, 2], params(serve, 2), features={"image": 1})
    with pytest.raises(ValueError, match="temperature"):
        params(serve, 4, temperature=-1)
    with pytest.raises(ValueError, match="max_tokens"):
        params(serve, 0)
    for bad, words in ((dict(cuda_graphs="fast"), "cuda_graphs"),
                       (dict(policy="lifo"), "policy"), (dict(block_size=0), "block_size"),
                       (dict(attention_backend="nope"), "nope")):
        with pytest.raises(ValueError, match=words):
            make_engine(serve, tiny_model, **bad)
    assert engine_state(engine) == before
    Trace(engine).run()
    assert_idle(engine)


def test_backend_registry(serve):
    backends = serve.backends

    class Custom(backends.ReferenceBackend):
        name = "custom-test"

        def __init__(self, flavour="plain"):
            super().__init__()
            self.flavour = flavour

    backends.register_backend("custom-test", Custom, replace=True)
    made = backends.get_backend("custom-test", flavour="salty")
    assert isinstance(made, Custom) and made.flavour == "salty"
    assert isinstance(backends.get_backend("reference"), backends.ReferenceBackend)
    with pytest.raises(ValueError, match="unknown attention backend"):
        backends.get_backend("missing")


def test_pool_sizing(serve):
    runner = serve.runner
    # Qwen3-8B in bfloat16: 36 layers, 8 KV heads of 128 -> 147,456 bytes per token.
    assert runner.kv_bytes_per_block(36, 8, 128, 1, torch.bfloat16) == 147_456
    assert runner.kv_bytes_per_block(36, 8, 128, 16, torch.bfloat16) == 16 * 147_456
    assert runner.num_blocks_for_memory(53e9, 36, 8, 128, 16, torch.bfloat16) == int(53e9 // (16 * 147_456))
    assert runner.kv_bytes_per_block(2, 2, 16, 16, torch.float32, pools=1) == 2 * 2 * 16 * 16 * 4


def test_qwen3_moe_runs_through_the_flat_model_unchanged(serve, impl, device):
    """Chapter 27's sparse MoE block already works on [N, D] rows: the same FlatModel serves
    Qwen3-MoE with no change, in a pool small enough to preempt."""
    from course.models.moe import tiny_qwen3_moe
    model = tiny_qwen3_moe(impl.package, device=device)
    prompts, max_tokens = five_requests(seed=1)
    engine = make_engine(serve, model, num_blocks=12)
    trace = Trace(engine)
    for rid, prompt in prompts.items():
        trace.add(rid, prompt, params(serve, max_tokens[rid]))
    trace.run()
    def solo_on_the_reference_moe():
        oracle = tiny_qwen3_moe(reference().package, device=device)
        return {rid: solo(oracle, prompt, max_tokens[rid]) for rid, prompt in prompts.items()}
    wants = recorded("solo generate on the tiny Qwen3-MoE", (prompts, max_tokens), solo_on_the_reference_moe)
    for rid, want in wants.items():
        trace.expect(rid, want, "[Qwen3-MoE] ")
    assert trace.preemptions > 0 and engine.blocks.stats["hits"] > 0
    assert_idle(engine, "[Qwen3-MoE] ")


# --- the chapter's command ---------------------------------------------------------------------

def test_run_py_core_serves_the_workload_three_ways(impl, device, capsys):
    """`python run.py core` on the implementation under test, shortened (4 requests, one timed
    run), with --check: Chapter 24's engine and the core with both pools give the same tokens
    as solo `generate` (the command exits 2 otherwise), and each prints its JSON line."""
    import json

    from course import cli
    status = cli.main(["core", "--impl", impl.spec.text, "--device", str(device), "--requests", "4",
                       "--repeat", "1", "--check"])
    out, err = capsys.readouterr()
    assert status == 0, f"run.py core failed:\n{out}{err}"
    lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    engines = {line["engine"]: line for line in lines if "engine" in line}
    assert list(engines) == ["ch24 slots", "ch31 core, ample pool", "ch31 core, 24-block pool"], out
    fields = {"engine", "kv_slots", "output_tokens", "tok_s", "steps", "prefix_hit_rate", "preemptions"}
    for line in engines.values():
        assert fields <= set(line), f"{line['engine']}: missing {sorted(fields - set(line))}"
        assert line["tok_s"] > 0 and line["steps"] > 0, line
    assert [line["kv_slots"] for line in engines.values()] == [8 * 320, 4096 * BLOCK, 24 * BLOCK]
    assert len({line["output_tokens"] for line in engines.values()}) == 1, out
    # Four requests share a 192-token system prompt: the last three find it cached.
    assert engines["ch31 core, ample pool"]["prefix_hit_rate"] > 0.5, out
    assert lines[-1]["outputs_identical"] is True, out


def test_statistics_after_a_swap_in(serve, tiny_model):
    """A swapped request comes back with its K/V: no prefix lookup, so its retries while it
    waits for room are not taken back from the hit rate either (it never looked up);
    num_cached_tokens stays as recorded at its first admission; one preemption is counted;
    its tokens are those of a run without the preemption. The real EngineCore.step runs
    around a scripted model (course.testing.oracles.ScriptedRunner)."""
    def run(num_blocks):
        engine = make_engine(serve, tiny_model, block_size=4, num_blocks=num_blocks, max_num_seqs=2,
                             preemption_mode="swap",
                             runner=ScriptedRunner.factory(serve, lambda tokens: 1 + len(tokens) * 7 % 50))
        engine.add_request("a", list(range(10, 18)), params(serve, 16))
        engine.step()
        b = engine.add_request("b", list(range(10, 18)) + [1, 2], params(serve, 10))
        lookups = []
        while engine.has_unfinished:
            before = engine.blocks.stats["queries"]
            engine.step()
            lookups.append(engine.blocks.stats["queries"] - before)
        return engine, b, lookups

    _, b_alone, _ = run(32)
    engine, b, lookups = run(7)
    assert engine.preemptions == 1 and b.num_preemptions == 1, (
        f"expected exactly b preempted once: engine {engine.preemptions}, b {b.num_preemptions}")
    assert b.num_cached_tokens == b_alone.num_cached_tokens == 8, (
        f"b found a's two prompt blocks at its first admission; a swap-in changes nothing: {b.num_cached_tokens}")
    assert lookups == [b.num_prompt_tokens] + [0] * (len(lookups) - 1), (
        f"prompt tokens looked up per step: only b's first admission counts ({b.num_prompt_tokens}); a swapped "
        f"request waiting for room never looked up, so nothing is taken back (forget_lookup) either: {lookups}")
    assert b.output_token_ids == b_alone.output_token_ids and b.swapped_out is False
    assert_idle(engine)


def test_the_defaults_satisfy_the_interfaces(serve, tiny_model):
    """serve/interfaces.py states the seams later chapters implement; Chapter 31's own
    objects provide them."""
    interfaces = serve.interfaces
    engine = make_engine(serve, tiny_model)
    assert isinstance(engine.runner.backend, interfaces.AttentionBackend)
    assert isinstance(engine.sampler, interfaces.TokenSampler)
    assert isinstance(engine.update_hooks, interfaces.UpdateHooks), "Chapter 31's update hooks (serve.update)"
    assert not isinstance(object(), interfaces.Drafter) and not isinstance(object(), interfaces.Guide)
