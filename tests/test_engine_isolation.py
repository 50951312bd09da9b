"""Engine core reliability (issue 6, part 4): cache_key salts isolate tenants.

A request's cache_key (a tenant's salt, an adapter, image hashes) is hashed into every block
key of its prefix, so two requests with different salts never share a block, even with
identical prompts, at the same time or one after the other, with or without preemption;
requests with the same salt share as usual. Checked on the engine under test (`impl`,
Chapter 31): which blocks each request holds at every step, how many prompt tokens it got
from the cache, and its output (solo greedy `generate` of the REFERENCE package: the salt
never changes what the model computes).
"""
import pytest

from course.testing import oracles
from course.testing.engine_checks import check_scheduler
from course.testing.oracles import assert_engine_idle, solo

pytestmark = pytest.mark.chapter(31)

BLOCK = 8
PROMPT = list(range(100, 133))            # 33 tokens: four full blocks and one more token


def make_engine(serve, model, **config):
    config = {"block_size": BLOCK, "num_blocks": 64, **config}
    return oracles.make_engine(serve, model, **config)


def P(serve, max_tokens=6, **kwargs):
    return serve.request.SamplingParams(max_tokens=max_tokens, **kwargs)


class Watch:
    """Steps an engine to the end, recording for every pair of live requests whether they
    ever held a block in common."""

    def __init__(self, serve, engine):
        self.serve, self.engine, self.shared = serve, engine, set()
        self.requests = {}

    def add(self, rid, prompt, salt, max_tokens=6, **kwargs):
        added = self.engine.add_request(rid, prompt, P(self.serve, max_tokens, **kwargs), cache_key=salt)
        for r in added if isinstance(added, list) else [added]:
            self.requests[r.request_id] = r
        return added

    def run(self):
        engine = self.engine
        for _ in range(2000):
            if not engine.has_unfinished:
                break
            engine.step()
            check_scheduler(engine.scheduler, f"step {engine.steps}")
            tables = {rid: set(t) for rid, t in engine.blocks.req_blocks.items() if t}
            for a in tables:
                for b in tables:
                    if a < b and tables[a] & tables[b]:
                        self.shared.add((a, b))
        assert_engine_idle(engine)
        return self


def test_salts_hash_into_every_block_key(serve):
    hash_block = serve.blocks.hash_block
    tokens = PROMPT[:BLOCK]
    for left, right in (((), ("tenant-a",)), (("tenant-a",), ("tenant-b",)), (("1",), (1,)),
                        ((("a", "b"),), ("a", "b")), (("a", "b"), ("b", "a"))):
        assert hash_block(None, tokens, left) != hash_block(None, tokens, right), (
            f"salts {left!r} and {right!r} give the same key to the same tokens")
    a, b = hash_block(None, tokens, ("tenant-a",)), hash_block(None, tokens, ("tenant-b",))
    nxt = PROMPT[BLOCK:2 * BLOCK]
    assert hash_block(a, nxt, ("tenant-a",)) != hash_block(b, nxt, ("tenant-b",))


@pytest.mark.parametrize("left,right", [((), ("tenant-a",)), (("tenant-a",), ("tenant-b",)), (("1",), (1,))],
                         ids=["none-vs-salt", "two-tenants", "str-vs-int"])
def test_different_salts_never_share_blocks(serve, tiny_model, ref_model, left, right):
    engine = make_engine(serve, tiny_model)
    watch = Watch(serve, engine)
    # Same time: both prompts are admitted in one step; then one after the other.
    first = watch.add("left", PROMPT, left)
    other = watch.add("right", PROMPT, right)
    watch.run()
    assert not watch.shared, f"requests salted {left!r} and {right!r} shared blocks: {watch.shared}"
    assert first.num_cached_tokens == other.num_cached_tokens == 0
    later = watch.add("right-later", PROMPT, right)
    watch.run()
    assert later.num_cached_tokens == 4 * BLOCK, (
        f"the same salt ({right!r}) must find its own earlier blocks: got {later.num_cached_tokens} cached tokens")
    stranger = watch.add("third-salt", PROMPT, ("someone-else",))
    watch.run()
    assert stranger.num_cached_tokens == 0, "a third salt found another tenant's blocks"
    want = solo(ref_model, PROMPT, 6)
    for rid, r in watch.requests.items():
        assert r.output_token_ids == want, f"{rid}: {r.output_token_ids} != solo generate's {want}"


def test_the_same_salt_shares(serve, tiny_model, ref_model):
    engine = make_engine(serve, tiny_model)
    watch = Watch(serve, engine)
    a = watch.add("a", PROMPT, ("tenant-a",), max_tokens=12)
    b = watch.add("b", PROMPT, ("tenant-a",), max_tokens=12)
    samples = watch.add("c", PROMPT, ("tenant-a",), max_tokens=12, n=2)
    watch.run()
    assert a.num_cached_tokens == 0 and b.num_cached_tokens == 4 * BLOCK, (
        f"b arrives in a's step and must adopt a's four full prompt blocks: {b.num_cached_tokens} cached tokens")
    assert all(s.num_cached_tokens == 4 * BLOCK for s in samples)
    assert ("a", "b") in watch.shared and ("a", "c:0") in watch.shared
    want = solo(ref_model, PROMPT, 12)
    for rid, r in watch.requests.items():
        assert r.output_token_ids == want, f"{rid}: {r.output_token_ids} != solo generate's {want}"


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_isolation_survives_preemption(serve, tiny_model, ref_model, mode):
    """In a pool too small for everyone, tenants are preempted and come back (recomputing
    from the prefix cache, or swapped in); a returning request finds only its own tenant's
    blocks."""
    engine = make_engine(serve, tiny_model, num_blocks=12, preemption_mode=mode)
    watch = Watch(serve, engine)
    tenants = [("t0",), ("t1",), ("t0",), ("t1",), ()]
    for i, salt in enumerate(tenants):
        watch.add(f"r{i}", PROMPT, salt, max_tokens=20)
    watch.run()
    assert engine.preemptions > 0, "nobody was preempted: the pool is not small enough for this test"
    salts = {rid: tenants[int(rid[1:])] for rid in watch.requests}
    crossed = [(x, y) for x, y in watch.shared if salts[x] != salts[y]]
    assert not crossed, f"blocks shared across tenants: {crossed}"
    want = solo(ref_model, PROMPT, 20)
    for rid, r in watch.requests.items():
        assert r.output_token_ids == want, f"{rid} ({mode}): {r.output_token_ids} != solo generate's {want}"
