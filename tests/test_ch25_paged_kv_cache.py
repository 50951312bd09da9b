"""Chapter 25 milestone: the paged KV cache, the prefix cache and the paged engine.

Oracles: for the cache itself, the tensors written into it (gathering a sequence must give
back exactly what was stored, in position order, whatever blocks it landed in) and hand-
counted block arithmetic; for the engine, the reference package's solo greedy `generate` on
the reference tiny model, with and without prefix sharing, in an ample pool and in one so
small that the engine must evict cached blocks and preempt requests. When the engine is idle
and the prefix cache is emptied, every block must be free with no reference left.
Deterministic (seeded; the tiny model's greedy margins are wide). The parity tests were run
over 200 workload seeds once, all passing.
"""
import random

import pytest
import torch

from course.testing.milestone_helpers import assert_same_tokens
from course.testing.oracles import TINY_EOS as EOS
from course.testing.oracles import solo

pytestmark = pytest.mark.chapter(25)

HEADS, DIM = 2, 4


def make_cache(impl, num_blocks=12, block_size=4, layers=2):
    return impl.paged.PagedKVCache(layers, num_blocks, block_size, HEADS, DIM)


def fill(kv, seq_id, count, generator, store):
    """Reserve and write `count` new positions of seq_id with random K/V, remembering them in store."""
    if seq_id not in kv.block_tables:
        kv.add_sequence(seq_id)
    kv.reserve(seq_id, count)
    start = kv.seq_lens[seq_id]
    need = kv.blocks_for(start + count)
    assert len(kv.block_tables[seq_id]) == need, (
        f"reserve({seq_id!r}, {count}) with {start} positions stored left {len(kv.block_tables[seq_id])} blocks; "
        f"the table must cover the positions stored plus the new ones: {need} blocks of {kv.block_size}")
    for layer in range(len(kv.k)):
        k = torch.randn(HEADS, count, DIM, generator=generator)
        v = torch.randn(HEADS, count, DIM, generator=generator)
        kv.write(layer, seq_id, start, k, v)
        store.setdefault((seq_id, layer), []).append((k, v))
    kv.advance(seq_id, count)


def expected(store, seq_id, layer):
    parts = store[(seq_id, layer)]
    return torch.cat([k for k, _ in parts], dim=1), torch.cat([v for _, v in parts], dim=1)


def check_accounting(kv, where):
    """Every block is either free (count 0, on the free list once) or referenced."""
    free = list(kv.free_blocks)
    assert len(free) == len(set(free)), f"{where}: a block is on the free list twice: {free}"
    for block in range(kv.num_blocks):
        on_list = block in free
        assert on_list == (kv.ref_count[block] == 0), (
            f"{where}: block {block} has ref_count {kv.ref_count[block]} but is "
            f"{'on' if on_list else 'not on'} the free list")


def test_gather_returns_what_was_written_across_blocks(impl):
    kv = make_cache(impl)
    gen = torch.Generator().manual_seed(0)
    store = {}
    # Interleave the growth of three sequences so their blocks are not contiguous in the pool.
    for seq_id, count in [("a", 3), ("b", 6), ("a", 4), ("c", 1), ("b", 2), ("a", 5), ("c", 7)]:
        fill(kv, seq_id, count, gen, store)
        check_accounting(kv, f"after writing {count} positions of {seq_id!r}")
    for seq_id, length in [("a", 12), ("b", 8), ("c", 8)]:
        assert kv.seq_lens[seq_id] == length
        table = kv.block_tables[seq_id]
        assert len(table) == kv.blocks_for(length), (
            f"sequence {seq_id!r} holds {length} positions in blocks of 4: it needs {kv.blocks_for(length)} "
            f"blocks, its table has {len(table)} ({table}): a paged cache wastes nothing beyond the last block")
        for layer in range(2):
            got_k, got_v = kv.gather(layer, seq_id)
            want_k, want_v = expected(store, seq_id, layer)
            assert got_k.shape == want_k.shape, (
                f"gather({layer}, {seq_id!r}): shape {tuple(got_k.shape)}, expected {tuple(want_k.shape)}: "
                f"the slots of the last block past length must not appear in the result")
            assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v), (
                f"gather({layer}, {seq_id!r}) differs from the K/V written (table {table})")
            part_k, _ = kv.gather(layer, seq_id, 5)
            assert torch.equal(part_k, want_k[:, :5]), (
                f"gather({layer}, {seq_id!r}, length=5) is not the first 5 positions (shape {tuple(part_k.shape)}): "
                "the slots of the last block past length must not appear in the result")
    used = {b for t in kv.block_tables.values() for b in t}
    assert len(used) == 3 + 2 + 2 and kv.num_free == 12 - 7


def test_reserve_is_all_or_nothing_and_free_returns_blocks(impl):
    kv = make_cache(impl, num_blocks=5, block_size=4)
    kv.add_sequence("a")
    kv.reserve("a", 9)                                   # 3 blocks
    assert kv.block_tables["a"] == [0, 1, 2] and kv.num_free == 2, (
        f"a fresh pool of 5 blocks, reserve 9 positions in blocks of 4: the table is {kv.block_tables['a']}, "
        "expected [0, 1, 2]: new blocks come off the front of the free list, in order")
    assert [kv.ref_count[b] for b in range(5)] == [1, 1, 1, 0, 0], (
        f"ref counts {kv.ref_count} after reserving blocks 0, 1, 2: a block taken off the free list has ref_count 1")
    assert kv.seq_lens["a"] == 0, "reserve must not move the sequence's length (advance does)"
    kv.reserve("a", 9)                                   # still fits in the same 3 blocks
    assert len(kv.block_tables["a"]) == 3, "reserving room that already exists must not take blocks"
    kv.add_sequence("b")
    try:
        kv.reserve("b", 12)                              # 3 blocks, only 2 free
    except impl.paged.OutOfBlocks:
        pass
    except Exception as error:
        pytest.fail(f"reserve of 3 blocks with 2 free raised {type(error).__name__}: {error}; reserve is all or "
                    "nothing: it raises OutOfBlocks before taking any block")
    else:
        pytest.fail("reserve of 3 blocks with 2 free returned; reserve is all or nothing: it raises OutOfBlocks")
    assert kv.block_tables["b"] == [] and kv.num_free == 2, (
        "a failed reserve must take no block: reserve is all or nothing")
    check_accounting(kv, "after a failed reserve")
    kv.reserve("b", 8)
    assert kv.num_free == 0
    kv.free("a")
    kv.free("b")
    assert kv.num_free == 5 and all(c == 0 for c in kv.ref_count), f"blocks leaked: ref counts {kv.ref_count}"
    check_accounting(kv, "after freeing everything")


def publish_sequence(impl, kv, cache, seq_id, tokens):
    kv.add_sequence(seq_id)
    kv.reserve(seq_id, len(tokens))
    kv.advance(seq_id, len(tokens))
    cache.publish(tokens, kv.block_tables[seq_id])


def test_prefix_cache_matches_whole_prefixes_only(impl):
    kv = make_cache(impl, num_blocks=16, block_size=4)
    cache = impl.paged.PrefixCache(kv)
    tokens = list(range(10, 24))                          # 14 tokens: 3 full blocks + 2
    publish_sequence(impl, kv, cache, "a", tokens)
    table = kv.block_tables["a"]
    assert len(cache) == 3, f"3 full blocks should be published, the cache holds {len(cache)}"
    assert [kv.ref_count[b] for b in table] == [2, 2, 2, 1], (
        f"published blocks carry the cache's extra reference: counts {[kv.ref_count[b] for b in table]}")
    assert cache.match(tokens) == table[:3]
    assert cache.match(tokens[:12] + [99]) == table[:3]
    assert cache.match(tokens, max_tokens=len(tokens[:12]) - 1) == table[:2], (
        "max_tokens = 11 allows only the blocks ending at or before token 11: two blocks")
    assert cache.match(tokens[:7]) == table[:1], "a partial block never matches"
    changed_first = [0] + tokens[1:]
    assert cache.match(changed_first) == [], (
        "blocks 1 and 2 hold the same tokens but follow a different block 0: their keys differ, no match")
    changed_second = tokens[:5] + [0] + tokens[6:]
    assert cache.match(changed_second) == table[:1], "the match stops at the first block that differs"
    kv.free("a")
    assert [kv.ref_count[b] for b in table[:3]] == [1, 1, 1] and kv.num_free == 16 - 3, (
        "after the sequence ends its published blocks stay, held by the cache alone")


def test_match_counts_the_blocks_it_looked_at(impl):
    """The counters behind the chapter's hit rate: each match adds to `queries` the full
    blocks it looked at (the first miss included, nothing after it) and to `hits` the ones it
    found; max_tokens limits both."""
    kv = make_cache(impl, num_blocks=16, block_size=4)
    cache = impl.paged.PrefixCache(kv)
    tokens = list(range(10, 24))                          # 14 tokens: 3 full blocks + 2
    publish_sequence(impl, kv, cache, "a", tokens)
    cases = [(tokens, None, 3, 3), (tokens[:5] + [0] + tokens[6:], None, 2, 1), ([0] + tokens[1:], None, 1, 0),
             (tokens, 11, 2, 2), (tokens[:3], None, 0, 0), (tokens + list(range(50, 60)), None, 4, 3)]
    for probe, limit, queries, hits in cases:
        before = cache.queries, cache.hits
        cache.match(probe, max_tokens=limit)
        grew = cache.queries - before[0], cache.hits - before[1]
        assert grew == (queries, hits), (
            f"match of {len(probe)} tokens (max_tokens {limit}) against 3 cached blocks: queries +{grew[0]}, "
            f"hits +{grew[1]}; expected +{queries}, +{hits} (the first miss is a query; nothing after it is)")


def test_evict_frees_only_unreferenced_blocks_in_lru_order(impl):
    kv = make_cache(impl, num_blocks=16, block_size=4)
    cache = impl.paged.PrefixCache(kv)
    old = list(range(100, 108))                           # 2 blocks, published first
    new = list(range(200, 208))                           # 2 blocks, published later
    publish_sequence(impl, kv, cache, "old", old)
    publish_sequence(impl, kv, cache, "new", new)
    old_blocks, new_blocks = kv.block_tables["old"][:2], kv.block_tables["new"][:2]
    kv.free("old")
    kv.free("new")
    # A running request adopts the first block of `new`: it must survive eviction.
    user = cache.match(new[:4] + [1, 2, 3], max_tokens=6)
    assert user == new_blocks[:1]
    kv.add_sequence("user", user)
    assert cache.evict(1) == 1, "evict(1) frees one block"
    assert kv.ref_count[old_blocks[1]] == 0 and kv.ref_count[old_blocks[0]] == 1, (
        "evict(1) must free the least recently used entry, old's second block (a leaf published "
        "before everything else), and keep old's first block")
    freed = cache.evict()
    assert freed == 2, f"evict() should free the 2 remaining unreferenced blocks, freed {freed}"
    assert cache.match(new[:4]) == new_blocks[:1], "a block still in a block table must stay cached"
    assert all(kv.ref_count[b] == 0 for b in old_blocks + new_blocks[1:]), f"ref counts {kv.ref_count}"
    kv.free("user")
    assert cache.evict() == 1 and len(cache) == 0 and kv.num_free == 16, "idle and evicted: every block free"
    check_accounting(kv, "after evicting everything")


def test_evict_takes_least_recently_used_leaves_first(impl):
    kv = make_cache(impl, num_blocks=16, block_size=4)
    cache = impl.paged.PrefixCache(kv)
    a, b = list(range(8)), list(range(50, 58))
    publish_sequence(impl, kv, cache, "a", a)
    publish_sequence(impl, kv, cache, "b", b)
    kv.free("a")
    kv.free("b")
    cache.match(a)                                       # a is now more recent than b
    assert cache.evict(1) == 1
    assert cache.match(b) == kv_blocks_prefix(cache, b, 1), "b's deepest block (least recent leaf) goes first"
    assert len(cache.match(a)) == 2, "a was used recently: both its blocks stay"
    assert cache.evict(1) == 1
    assert cache.match(b) == [], "then b's first block"
    assert len(cache.match(a)) == 2
    cache.match(a)                                        # only a's two blocks are left
    first_block = kv_blocks_prefix(cache, a, 1)
    assert cache.evict(1) == 1
    assert cache.match(a) == first_block, (
        "after match(a) a's first block must be at least as recent as its second (every prefix at least as "
        "recent as its extensions): evict(1) takes the least recent leaf, a's second block, and keeps its first")


def test_evicted_block_reused_for_other_tokens_loses_its_key(impl):
    """nano-vllm issue 163: a block freed by eviction goes back to the pool; once another
    sequence fills it with other tokens, the old prefix must no longer find it."""
    kv = make_cache(impl, num_blocks=2, block_size=4)
    cache = impl.paged.PrefixCache(kv)
    old, new = list(range(10, 18)), list(range(50, 58))
    publish_sequence(impl, kv, cache, "old", old)
    kv.free("old")
    assert cache.evict() == 2
    publish_sequence(impl, kv, cache, "new", new)          # the same two blocks, other tokens
    found = cache.match(old)
    assert found == [], (
        f"after evicting old's blocks and reusing them for other tokens, match(old prefix) found {found}: "
        "a freed block reused with other tokens must not keep its old prefix")
    assert cache.match(new) == kv.block_tables["new"], "the new tokens' blocks are found under their own prefix"


def test_prompt_fully_in_the_prefix_cache_still_computes_one_token(impl, tiny_model, ref_model):
    """nano-vllm issue 144: a prompt of exactly two blocks, served twice. The second time
    its blocks are all cached, yet the last prompt token must still be computed: its logits
    give the first new token."""
    prompt = list(range(30, 38))                          # 2 blocks of 4
    engine = impl.paged.PagedEngine(tiny_model, num_blocks=16, block_size=4, eos_token_id=EOS)
    rule = "a prompt fully covered by the prefix cache still needs one token computed for its logits"
    outputs = {}
    try:
        for request_id in ("first", "again"):
            engine.add_request(request_id, prompt, 4)
            before = engine.stats["computed_tokens"]
            outputs[request_id] = []
            while engine.has_unfinished:
                for rid, tokens, _ in engine.step():
                    outputs[rid].extend(tokens)
            computed = engine.stats["computed_tokens"] - before
    except Exception as error:
        pytest.fail(f"serving an 8-token prompt whose 2 blocks are cached raised {type(error).__name__}: "
                    f"{error}; {rule}")
    assert computed == 4 + 3, (
        f"the repeat of a cached 8-token prompt computed {computed} tokens for 4 outputs, expected 7: its "
        f"second block again (the cache may supply only full blocks before the last prompt token), then 3 "
        f"decodes; {rule}")
    assert_same_request_tokens("again", solo(ref_model, prompt, 4), outputs["again"], "fully cached prompt")


def kv_blocks_prefix(cache, tokens, n):
    return [cache.entries[tuple(tokens[:(i + 1) * cache.kv.block_size])] for i in range(n)]


# --- the engine -----------------------------------------------------------------------------

def assert_same_request_tokens(request_id, expected_tokens, got, config):
    assert_same_tokens(f"[{config}] request {request_id}", expected_tokens, got)


def shared_requests(seed, count=7, system=21, block_size=4):
    """Requests sharing a system prompt (5 full blocks and a bit), two of them identical prompts."""
    rng = random.Random(seed)
    prefix = [rng.randrange(256) for _ in range(system)]
    requests = []
    for i in range(count):
        question = [rng.randrange(256) for _ in range(rng.randint(1, 9))]
        requests.append((f"r{i}", prefix + question, rng.randint(2, 14)))
    requests.append((f"r{count}", list(requests[0][1]), 5))           # a repeat of r0's prompt
    requests.append((f"r{count + 1}", prefix[:8], 6))                 # a prompt that is exactly 2 blocks
    return requests


CONFIGS = {
    "ample pool, prefix sharing": dict(num_blocks=64, block_size=4, max_num_seqs=4),
    "ample pool, no sharing": dict(num_blocks=64, block_size=4, max_num_seqs=4, enable_prefix_caching=False),
    "chunks of 5, sharing": dict(num_blocks=64, block_size=4, max_num_seqs=3, chunk_size=5),
    "12-block pool (evicts, preempts)": dict(num_blocks=12, block_size=4, max_num_seqs=4),
}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_engine_matches_solo_generate(impl, tiny_model, ref_model, config):
    requests = shared_requests(seed=3)
    engine = impl.paged.PagedEngine(tiny_model, eos_token_id=EOS, **CONFIGS[config])
    for request in requests:
        engine.add_request(*request)
    outputs = {r[0]: [] for r in requests}
    steps = 0
    while engine.has_unfinished:
        steps += 1
        assert steps < 2000, f"[{config}] the engine is still busy after 2000 steps"
        for request_id, tokens, _ in engine.step():
            outputs[request_id].extend(tokens)
        check_accounting(engine.kv, f"[{config}] step {steps}")
    for request_id, prompt, max_new in requests:
        assert_same_request_tokens(request_id, solo(ref_model, prompt, max_new), outputs[request_id], config)
    if engine.prefix_cache is not None:
        assert engine.stats["cached_tokens"] > 0, f"[{config}] no prompt token came from the prefix cache"
    if config.startswith("12-block"):
        assert engine.stats["preemptions"] > 0, f"[{config}] this pool is meant to force preemption"
    kv = engine.kv
    assert not kv.block_tables, f"[{config}] idle engine still has sequences {list(kv.block_tables)}"
    if engine.prefix_cache is not None:
        engine.prefix_cache.evict()
    leaked = [b for b, c in enumerate(kv.ref_count) if c]
    assert not leaked and kv.num_free == kv.num_blocks, (
        f"[{config}] idle engine with an emptied prefix cache: blocks {leaked} still referenced "
        f"({kv.num_free} of {kv.num_blocks} free)")


def test_shared_prefix_is_not_recomputed(impl, tiny_model, ref_model):
    """Two requests with the same 20-token prefix (5 blocks of 4), served one after the
    other: the second one's prefill call must feed only its own tokens after the cached
    blocks, and share those blocks (same physical ids) while both run."""
    rng = random.Random(9)
    prefix = [rng.randrange(256) for _ in range(20)]
    a, b = prefix + [1, 2, 3], prefix + [7, 8, 9, 10, 11]
    calls = []

    class Recorder(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner, self.cfg = inner, inner.cfg

        @property
        def context_limit(self):
            return self.inner.context_limit

        def forward(self, ids, *args, **kwargs):
            calls.append(tuple(ids.shape))
            return self.inner(ids, *args, **kwargs)

    engine = impl.paged.PagedEngine(Recorder(tiny_model), num_blocks=32, block_size=4, eos_token_id=EOS)
    engine.add_request("a", a, 6)
    first = engine.step()
    assert calls == [(1, 23)], f"step 1 forward calls {calls}: expected one prefill of a's 23 tokens"
    engine.add_request("b", b, 6)
    calls.clear()
    second = engine.step()
    assert sorted(calls) == [(1, 1), (1, 5)], (
        f"step 2 forward calls {sorted(calls)}: expected a's decode [1, 1] and b's prefill of only its "
        f"5 uncached tokens [1, 5] (its first 20 come from the prefix cache)")
    shared = engine.kv.block_tables["a"][:5]
    assert engine.kv.block_tables["b"][:5] == shared, "b must point at a's prefix blocks, not copies"
    assert all(engine.kv.ref_count[blk] == 3 for blk in shared), (
        "each shared block is referenced by a, b and the prefix cache: "
        f"counts {[engine.kv.ref_count[x] for x in shared]}")
    outputs = {"a": list(first[0][1]), "b": []}
    for request_id, tokens, _ in second:
        outputs[request_id].extend(tokens)
    while engine.has_unfinished:
        for request_id, tokens, _ in engine.step():
            outputs[request_id].extend(tokens)
    assert_same_request_tokens("a", solo(ref_model, a, 6), outputs["a"], "shared prefix")
    assert_same_request_tokens("b", solo(ref_model, b, 6), outputs["b"], "shared prefix")
