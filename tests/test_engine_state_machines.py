"""Engine core reliability (issue 6, part 1): the BlockManager and the Scheduler driven by
hypothesis state machines through random interleavings of their operations.

Both machines run the implementation under test (`impl`, Chapter 31), so
`pytest --impl engine tests/test_engine_state_machines.py` checks a learner's engine too.
No model: a fake step stands in for the forward pass. It keeps a FakePool, the identity
of what the real pool would hold in every slot, (cache_key, the tokens up to and including
that position): two slots with equal identities hold equal K/V. Every step writes its
tokens' identities through the block tables, then reads back every position each scheduled
request attends to. So besides the bookkeeping rules (course.engine_checks, checked after
every rule) the machines prove the point of those rules: nobody ever attends to a slot
that holds somebody else's keys, whether it got there by the prefix cache, a preemption,
a swap or a reused block.

Default run: small example counts (seconds). `--stress`: many more, not derandomized.
"""
import random

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition, rule,
                                 run_state_machine_as_test)

from course.engine_checks import (block_manager_state, check_block_manager, check_plan, check_scheduler)

pytestmark = pytest.mark.chapter(31)

# A fixed pool of prompts that share heads of several lengths (so prefix hits and partial
# hits happen whatever hypothesis draws), optionally extended by a few small token ids (so
# suffixes and generated tokens collide too). Index 0, where hypothesis shrinks to, shares
# its first 12 tokens with three others.
_rng = random.Random(31)
_HEAD, _OTHER = [_rng.randrange(40) for _ in range(12)], [_rng.randrange(40) for _ in range(8)]
PROMPTS = [_HEAD + [1], _HEAD + [2, 3], _HEAD[:8] + [4, 4, 4], _OTHER + [5], _OTHER + [6, 7, 8, 9],
           [9], _HEAD + [1], _HEAD + _OTHER]
SALTS = [(), (), ("tenant-a",), ("tenant-b",)]

def next_token(tokens):
    """The fake model: a deterministic function of the whole sequence."""
    return (sum(tokens) * 31 + len(tokens) * 7) % 17


def machine_settings(request, examples, steps, stress_examples, stress_steps):
    stress = request.config.getoption("stress")
    # The default run reports a failing run as found (shrinking it can take minutes on a busy
    # machine); --stress shrinks it to a minimal one.
    phases = list(Phase) if stress else [p for p in Phase if p is not Phase.shrink]
    return settings(max_examples=stress_examples if stress else examples,
                    stateful_step_count=stress_steps if stress else steps, phases=phases,
                    deadline=None, database=None, derandomize=not stress, print_blob=True,
                    suppress_health_check=list(HealthCheck))


prompts = st.tuples(st.integers(0, len(PROMPTS) - 1), st.lists(st.integers(0, 7), max_size=3))


def prompt_tokens(prompt):
    index, extension = prompt
    return PROMPTS[index] + extension


class FakePool:
    """The identity of the K/V in each slot of the pool, and host copies of swapped blocks."""

    def __init__(self, block_size):
        self.block_size = block_size
        self.slots = {}
        self.host = {}

    @staticmethod
    def identity(request, position):
        return tuple(request.cache_key), tuple(request.token_ids[:position + 1])

    def slot(self, table, position):
        return table[position // self.block_size] * self.block_size + position % self.block_size

    def write(self, request, table, start, stop):
        for p in range(start, stop):
            self.slots[self.slot(table, p)] = self.identity(request, p)

    def check_read(self, request, table, upto, what):
        for p in range(upto):
            got = self.slots.get(self.slot(table, p))
            if got != self.identity(request, p):
                owner = "nothing" if got is None else f"salt {got[0]!r}, {len(got[1])} tokens ending {got[1][-3:]}"
                raise AssertionError(
                    f"{what}: request {request.request_id!r} attends to position {p} in block "
                    f"{table[p // self.block_size]}, which holds the K/V of {owner}, not its own "
                    f"(salt {tuple(request.cache_key)!r}, token {request.token_ids[p]})")

    def swap_out(self, request_id, blocks):
        size = self.block_size
        self.host[request_id] = [[self.slots.get(b * size + j) for j in range(size)] for b in blocks]

    def swap_in(self, request_id, blocks):
        saved = self.host.pop(request_id, None)
        if saved is None:
            raise AssertionError(f"request {request_id!r} swapped in without a swap-out")
        if len(blocks) < len(saved):
            raise AssertionError(f"request {request_id!r}: {len(saved)} blocks swapped out, {len(blocks)} to swap in")
        size = self.block_size
        for b, contents in zip(blocks, saved):
            for j, identity in enumerate(contents):
                if identity is None:
                    self.slots.pop(b * size + j, None)
                else:
                    self.slots[b * size + j] = identity

    def check_published(self, bm, key_prefix, what):
        """A block published under a key holds exactly the K/V that key names."""
        size = self.block_size
        for b, key in enumerate(bm.block_hash):
            if key is None or key not in key_prefix:
                continue
            salt, tokens = key_prefix[key]
            for j in range(size):
                want = (salt, tuple(tokens[:len(tokens) - size + j + 1]))
                if self.slots.get(b * size + j) != want:
                    raise AssertionError(f"{what}: block {b} is published under the key of a {len(tokens)}-token "
                                         f"prefix (salt {salt!r}) but slot {j} holds other K/V")


def learn_keys(key_prefix, request, block_size):
    """Remember which prefix each of the request's block keys stands for."""
    for i, key in enumerate(request.block_hashes):
        key_prefix.setdefault(key, (tuple(request.cache_key), tuple(request.token_ids[:(i + 1) * block_size])))


# --- the block manager ---------------------------------------------------------------------------

class BlockManagerMachine(RuleBasedStateMachine):
    """Requests come and go through find_cached_prefix / allocate_slots / cache_full_blocks /
    free / reset_prefix_cache, the way the scheduler would call them, in any order."""
    serve = None

    def __init__(self):
        super().__init__()
        self.bm = None
        self.resets = 0
        self.live = {}              # request id -> Request, holding blocks or about to ask for them
        self.key_prefix = {}
        self.counter = 0
        self.log = []

    @initialize(num_blocks=st.integers(2, 16), block_size=st.sampled_from([4, 2, 3, 1]),
                caching=st.sampled_from([True, True, True, False]))
    def make(self, num_blocks, block_size, caching):
        self.bm = self.serve.blocks.BlockManager(num_blocks, block_size, enable_prefix_caching=caching)
        self.pool = FakePool(block_size)
        self.log.append(f"BlockManager({num_blocks}, {block_size}, caching={caching})")

    def holders(self):
        return sorted(rid for rid in self.live if self.bm.req_blocks.get(rid))

    def idle_ones(self):
        return sorted(rid for rid in self.live if not self.bm.req_blocks.get(rid))

    def compute(self, request, n, what):
        """Publish at allocation time, then run the fake forward over the n new tokens."""
        bm, start = self.bm, request.num_computed_tokens
        bm.cache_full_blocks(request, start + n)
        table = bm.req_blocks[request.request_id]
        assert len(table) * bm.block_size >= start + n, (
            f"{what}: request {request.request_id!r} got {len(table)} block(s) for {start + n} tokens")
        self.pool.write(request, table, start, start + n)
        self.pool.check_read(request, table, start + n, what)
        request.num_computed_tokens = start + n
        if request.num_computed_tokens == request.num_tokens:
            request.append(next_token(request.token_ids))
        bm.cache_full_blocks(request)
        learn_keys(self.key_prefix, request, bm.block_size)

    @precondition(lambda self: self.bm is not None and len(self.live) < 6)
    @rule(prompt=prompts, salt=st.sampled_from(SALTS))
    def new_request(self, prompt, salt):
        self.counter += 1
        rid = f"r{self.counter}"
        self.live[rid] = self.serve.request.Request(rid, prompt_tokens(prompt), cache_key=salt)
        self.log.append(f"new {rid} {prompt_tokens(prompt)} salt={salt}")

    @precondition(lambda self: self.bm is not None and self.idle_ones())
    @rule(data=st.data())
    def admit(self, data):
        """A request without blocks asks for room: fresh or recomputing (prefix lookup first),
        or swapped out (its computed tokens come back from the host)."""
        bm = self.bm
        request = self.live[data.draw(st.sampled_from(self.idle_ones()), label="request")]
        swapped = request.num_computed_tokens > 0
        cached = [] if swapped else bm.find_cached_prefix(request)
        reused = len(cached) * bm.block_size
        assert reused < request.num_tokens, "find_cached_prefix must leave at least one token to compute"
        remaining = request.num_tokens - request.num_computed_tokens - reused
        n = data.draw(st.one_of(st.just(remaining), st.integers(1, remaining)), label="tokens")
        before = block_manager_state(bm)
        ok = bm.allocate_slots(request, n, cached)
        what = f"admit {request.request_id} ({n} new, {len(cached)} cached blocks)"
        self.log.append(f"{what}: {ok}")
        if not ok:
            assert block_manager_state(bm) == before, f"{what}: a failed allocation changed the block manager"
            if not swapped:
                bm.forget_lookup(request, cached)
            return
        table = bm.req_blocks[request.request_id]
        assert table[:len(cached)] == cached, f"{what}: adopted blocks must come first, in order"
        if swapped:
            self.pool.swap_in(request.request_id, table)
        request.num_computed_tokens += reused
        self.compute(request, n, what)

    @precondition(lambda self: self.bm is not None and self.holders())
    @rule(data=st.data())
    def grow(self, data):
        """A running request asks for its next tokens (a chunk or a decode)."""
        bm = self.bm
        request = self.live[data.draw(st.sampled_from(self.holders()), label="request")]
        left = request.num_tokens - request.num_computed_tokens
        n = data.draw(st.one_of(st.just(left), st.integers(1, left)), label="tokens")
        before = block_manager_state(bm)
        ok = bm.allocate_slots(request, n)
        what = f"grow {request.request_id} by {n}"
        self.log.append(f"{what}: {ok}")
        if not ok:
            assert block_manager_state(bm) == before, f"{what}: a failed allocation changed the block manager"
            return
        self.compute(request, n, what)

    @precondition(lambda self: self.bm is not None and self.holders())
    @rule(data=st.data(), how=st.sampled_from(["finish", "recompute", "swap"]))
    def release(self, data, how):
        """A request gives its blocks back: finished, preempted to recompute, or swapped out."""
        request = self.live[data.draw(st.sampled_from(self.holders()), label="request")]
        rid = request.request_id
        if how == "swap":
            self.pool.swap_out(rid, list(self.bm.req_blocks[rid]))
        self.bm.free(request)
        self.log.append(f"free {rid} ({how})")
        assert not self.bm.req_blocks.get(rid), f"free({rid}) left it holding {self.bm.req_blocks.get(rid)}"
        if how == "finish":
            del self.live[rid]
        elif how == "recompute":
            request.num_computed_tokens = 0

    @precondition(lambda self: self.bm is not None and self.holders())
    @rule(data=st.data())
    def publish_again(self, data):
        """Publishing what is already published changes nothing."""
        request = self.live[data.draw(st.sampled_from(self.holders()), label="request")]
        before = block_manager_state(self.bm)
        self.bm.cache_full_blocks(request)
        assert block_manager_state(self.bm) == before, (
            f"cache_full_blocks({request.request_id}) twice in a row changed the block manager")

    @precondition(lambda self: self.bm is not None and self.resets * 3 < self.counter)
    @rule()
    def reset(self):
        """Forget the cached-free blocks (kept rare: it wipes what the other rules build up)."""
        self.resets += 1
        held = {b: self.bm.block_hash[b] for b, c in enumerate(self.bm.ref_count) if c}
        self.bm.reset_prefix_cache()
        self.log.append("reset_prefix_cache")
        assert all(self.bm.block_hash[b] == k for b, k in held.items()), "reset_prefix_cache unpublished a block in use"
        assert all(self.bm.ref_count[b] or self.bm.block_hash[b] is None for b in range(self.bm.num_blocks)), (
            "reset_prefix_cache left a free block findable")

    @invariant()
    def rules_hold(self):
        if self.bm is None:
            return
        where = f"after {self.log[-1] if self.log else 'start'}"
        check_block_manager(self.bm, where)
        for rid, request in self.live.items():
            table = self.bm.req_blocks.get(rid, [])
            if table:
                self.pool.check_read(request, table, request.num_computed_tokens, where)
            for i, b in enumerate(table):
                key = self.bm.block_hash[b]
                assert key is None or (i < len(request.block_hashes) and key == request.block_hashes[i]), (
                    f"{where}: {rid} holds block {b} at position {i} under another prefix's key")
        self.pool.check_published(self.bm, self.key_prefix, where)
        if not self.holders():
            assert self.bm.num_free == self.bm.num_blocks, f"{where}: nobody holds blocks, yet some are not free"


def test_block_manager_state_machine(serve, request):
    BlockManagerMachine.serve = serve
    run_state_machine_as_test(BlockManagerMachine,
                              settings=machine_settings(request, 40, 40, stress_examples=1500, stress_steps=80))


# --- the scheduler with a fake model step ---------------------------------------------------------

class SchedulerMachine(RuleBasedStateMachine):
    """A Scheduler over a BlockManager, with schedule() and the step that completes it as
    separate rules; requests arrive, are aborted or finish between steps."""
    serve = None

    def __init__(self):
        super().__init__()
        self.sched = None
        self.plan = None
        self.resets = self.aborts = 0
        self.counter = 0
        self.gone = []
        self.key_prefix = {}
        self.log = []
        self.steps = 0

    @initialize(num_blocks=st.integers(4, 20), block_size=st.sampled_from([4, 2, 3]),
                budget=st.integers(1, 32), max_num_seqs=st.integers(1, 4), chunked=st.booleans(),
                threshold=st.sampled_from([0, 0, 1, 3, 8]), policy=st.sampled_from(["fcfs", "priority"]),
                mode=st.sampled_from(["recompute", "swap"]), caching=st.sampled_from([True, True, False]))
    def make(self, num_blocks, block_size, budget, max_num_seqs, chunked, threshold, policy, mode, caching):
        config = self.serve.config.SchedulerConfig(
            max_num_batched_tokens=budget, max_num_seqs=max_num_seqs, enable_chunked_prefill=chunked,
            long_prefill_token_threshold=threshold, policy=policy, preemption_mode=mode)
        bm = self.serve.blocks.BlockManager(num_blocks, block_size, enable_prefix_caching=caching)
        self.sched = self.serve.scheduler.Scheduler(config, bm)
        self.pool = FakePool(block_size)
        self.log.append(f"{config}, {num_blocks} blocks of {block_size}, caching={caching}")

    @property
    def ready(self):
        return self.sched is not None

    def where(self):
        return f"step {self.steps}, after {self.log[-1] if self.log else 'start'}"

    @precondition(lambda self: self.ready and len(self.sched.requests) < 8)
    @rule(prompt=prompts, max_tokens=st.integers(1, 10), priority=st.integers(0, 2), salt=st.sampled_from(SALTS))
    def add(self, prompt, max_tokens, priority, salt):
        self.counter += 1
        rid = f"q{self.counter}"
        params = self.serve.request.SamplingParams(max_tokens=max_tokens)
        request = self.serve.request.Request(rid, prompt_tokens(prompt), params, priority=priority,
                                             arrival_time=float(self.counter), cache_key=salt)
        sched, bm = self.sched, self.sched.blocks
        before = (block_manager_state(bm), [r.request_id for r in sched.waiting], sorted(sched.requests))
        fits_pool = request.num_tokens + max_tokens <= bm.num_blocks * bm.block_size
        fits_step = sched.config.enable_chunked_prefill or request.num_tokens <= sched.config.max_num_batched_tokens
        try:
            sched.add(request)
        except ValueError as exc:
            self.log.append(f"add {rid} rejected: {exc}")
            after = (block_manager_state(bm), [r.request_id for r in sched.waiting], sorted(sched.requests))
            assert after == before, f"rejecting {rid} changed the scheduler"
            assert not (fits_pool and fits_step), f"{rid} fits the pool and the step budget, yet was rejected: {exc}"
            return
        assert fits_pool and fits_step, (
            f"{rid} ({request.num_tokens} prompt + {max_tokens} tokens) can never run here, yet was accepted")
        self.log.append(f"add {rid}: {request.token_ids} max_tokens={max_tokens} priority={priority} salt={salt}")

    @precondition(lambda self: self.ready and self.plan is None and self.sched.has_unfinished)
    @rule()
    def schedule(self):
        sched = self.sched
        plan = sched.schedule()
        self.log.append("schedule: " + ", ".join(f"{r.request_id}+{n}" for r, n in plan.scheduled)
                        + (f"; preempted {[r.request_id for r in plan.preempted]}" if plan.preempted else ""))
        check_plan(plan, sched, self.where())
        assert plan.scheduled or not sched.has_unfinished, (
            f"{self.where()}: the scheduler planned nothing while "
            f"{[r.request_id for r in sched.waiting]} wait and {[r.request_id for r in sched.running]} run")
        mode = sched.config.preemption_mode
        for victim, blocks in plan.swap_out:
            assert mode == "swap" and victim.swapped_out, f"{self.where()}: swap-out of {victim.request_id} in {mode} mode"
            self.pool.swap_out(victim.request_id, blocks)
        for resumed, blocks in plan.swap_in:
            self.pool.swap_in(resumed.request_id, blocks)
        self.plan = plan

    @precondition(lambda self: self.ready and self.plan is not None)
    @rule()
    def complete_step(self):
        """The fake forward: every scheduled row writes its K/V, then each request reads all
        of its context; then the engine's update (computed += n, sample when due, stop)."""
        sched, bm, plan = self.sched, self.sched.blocks, self.plan
        self.plan = None
        self.steps += 1
        what = self.where()
        for request, n in plan.scheduled:
            table = bm.req_blocks[request.request_id]
            self.pool.write(request, table, request.num_computed_tokens, request.num_computed_tokens + n)
        for request, n in plan.scheduled:
            self.pool.check_read(request, bm.req_blocks[request.request_id], request.num_computed_tokens + n, what)
        finished = []
        for request, n in plan.scheduled:
            request.num_computed_tokens += n
            if request.num_computed_tokens < request.num_tokens:
                bm.cache_full_blocks(request)
                continue
            request.append(next_token(request.token_ids))
            bm.cache_full_blocks(request)
            learn_keys(self.key_prefix, request, bm.block_size)
            if request.num_output_tokens >= request.params.max_tokens:
                sched.finish(request, self.serve.request.Status.FINISHED_LENGTH)
                finished.append(request.request_id)
                self.gone.append(request.request_id)
        self.log.append(f"complete step {self.steps}" + (f", finished {finished}" if finished else ""))

    @precondition(lambda self: self.ready and self.plan is None and self.sched.has_unfinished)
    @rule(count=st.integers(1, 6))
    def run_steps(self, count):
        """Whole engine steps back to back: most of a server's life is this."""
        for _ in range(count):
            if not self.sched.has_unfinished:
                break
            self.schedule()
            self.rules_hold()
            self.complete_step()
            self.rules_hold()

    @precondition(lambda self: self.ready and self.plan is None and self.aborts * 3 < self.counter)
    @rule(data=st.data())
    def abort(self, data):
        sched = self.sched
        choices = sorted(sched.requests) + self.gone[-2:] + ["no-such-request"]
        rid = data.draw(st.sampled_from(choices), label="abort")
        self.aborts += 1
        known = rid in sched.requests
        before = block_manager_state(sched.blocks)
        result = sched.abort(rid)
        self.log.append(f"abort {rid}")
        if not known:
            assert result is None, f"aborting unknown or finished {rid!r} returned {result!r}"
            assert block_manager_state(sched.blocks) == before, f"aborting unknown {rid!r} changed the blocks"
            return
        assert result is not None and result.status.name == "FINISHED_ABORTED", f"abort {rid} gave {result!r}"
        assert rid not in sched.requests and not sched.blocks.req_blocks.get(rid)
        self.pool.host.pop(rid, None)              # the engine drops the host copies of a swapped request
        self.gone.append(rid)

    @precondition(lambda self: self.ready and self.plan is None and self.sched.running)
    @rule(data=st.data())
    def finish(self, data):
        """A running request meets a stop token."""
        request = data.draw(st.sampled_from(list(self.sched.running)), label="finish")
        self.sched.finish(request, self.serve.request.Status.FINISHED_STOPPED)
        self.log.append(f"finish {request.request_id}")
        self.gone.append(request.request_id)

    @precondition(lambda self: self.ready and self.resets * 3 < self.counter)
    @rule()
    def reset(self):
        """Forget the cached-free blocks (kept rare: it wipes what the other rules build up)."""
        self.resets += 1
        self.sched.blocks.reset_prefix_cache()
        self.log.append("reset_prefix_cache")

    @invariant()
    def rules_hold(self):
        if not self.ready:
            return
        sched, bm, where = self.sched, self.sched.blocks, self.where()
        check_scheduler(sched, where)
        swapped = sorted(r.request_id for r in sched.waiting if r.swapped_out)
        assert sorted(self.pool.host) == swapped, (
            f"{where}: host copies for {sorted(self.pool.host)}, swapped-out requests {swapped}")
        if self.plan is None:
            for request in sched.running:
                self.pool.check_read(request, bm.req_blocks.get(request.request_id, []),
                                     request.num_computed_tokens, where)
            self.pool.check_published(bm, self.key_prefix, where)

    def teardown(self):
        """Whatever state the rules left, the work drains: every request finishes, the pool
        ends all free."""
        if not self.ready:
            return
        for _ in range(2000):
            if self.plan is None and not self.sched.has_unfinished:
                break
            if self.plan is None:
                self.schedule()
            self.complete_step()
            self.rules_hold()
        assert not self.sched.has_unfinished, f"requests never finished: {sorted(self.sched.requests)}"
        bm = self.sched.blocks
        assert bm.num_free == bm.num_blocks and not any(bm.ref_count), (
            f"drained, but {bm.num_blocks - bm.num_free} block(s) are still held")


def test_scheduler_state_machine(serve, request):
    SchedulerMachine.serve = serve
    run_state_machine_as_test(SchedulerMachine,
                              settings=machine_settings(request, 60, 50, stress_examples=2000, stress_steps=100))
