"""Engine core reliability (issues 6 and 10): the BlockManager and the engine core driven by
hypothesis state machines through random interleavings of their operations.

Both machines run the implementation under test (`impl`, Chapter 31), so
`pytest --impl engine tests/test_engine_state_machines.py` checks a learner's engine too.
No model: the block manager machine calls the block manager as the scheduler would, and the
engine machine runs the real EngineCore.step around a scripted model
(course.testing.oracles.ScriptedRunner). Both keep a FakePool, the identity
of what the real pool would hold in every slot, (cache_key, the tokens up to and including
that position): two slots with equal identities hold equal K/V. Every step writes its
tokens' identities through the block tables, then reads back every position each scheduled
request attends to. So besides the bookkeeping rules (course.testing.engine_checks, checked after
every rule) the machines prove the point of those rules: nobody ever attends to a slot
that holds somebody else's keys, whether it got there by the prefix cache, a preemption,
a swap or a reused block.

Default run: small example counts (seconds). `--stress`: many more, not derandomized.
"""
import random

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from course.testing.engine_checks import block_manager_state, check_block_manager, check_scheduler, engine_state
from course.testing.oracles import ScriptedRunner, assert_engine_idle, make_engine

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
    # A failing run is shrunk before it is reported: for at most course.pytest_plugin's
    # SHRINK_SECONDS in the default run, for as long as Hypothesis likes under --stress.
    return settings(max_examples=stress_examples if stress else examples,
                    stateful_step_count=stress_steps if stress else steps,
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
        # Draft tokens being verified (Chapter 37) sit after the request's own tokens.
        tokens = list(request.token_ids) + list(getattr(request, "spec_token_ids", ()))
        return tuple(request.cache_key), tuple(tokens[:position + 1])

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


# --- the engine with a scripted model ----------------------------------------------------------------

class EngineMachine(RuleBasedStateMachine):
    """The REAL EngineCore.step (schedule, swaps, build_batch, sampling, stop rules, finishing)
    around a scripted model (course.testing.oracles.ScriptedRunner): its logits make next_token the
    greedy choice, and its forward writes each new token's identity into the FakePool and
    reads back every position each scheduled request attends to. Requests arrive and are
    aborted between steps; the engine runs with debug_checks, so course.testing.engine_checks'
    plan and scheduler invariants are checked inside every step too."""
    serve = None
    model = None

    def __init__(self):
        super().__init__()
        self.engine = None
        self.aborts = self.resets = self.counter = self.steps = 0
        self.gone = []
        self.key_prefix = {}
        self.log = []

    @initialize(num_blocks=st.integers(4, 20), block_size=st.sampled_from([4, 2, 3]),
                budget=st.integers(1, 32), max_num_seqs=st.integers(1, 4), chunked=st.booleans(),
                threshold=st.sampled_from([0, 0, 1, 3, 8]), policy=st.sampled_from(["fcfs", "priority"]),
                mode=st.sampled_from(["recompute", "swap"]), caching=st.sampled_from([True, True, False]),
                sampler=st.sampled_from(["simple", "full"]))
    def make(self, num_blocks, block_size, budget, max_num_seqs, chunked, threshold, policy, mode, caching, sampler):
        config = dict(num_blocks=num_blocks, block_size=block_size, max_num_batched_tokens=budget,
                      max_num_seqs=max_num_seqs, enable_chunked_prefill=chunked,
                      long_prefill_token_threshold=threshold, policy=policy, preemption_mode=mode,
                      enable_prefix_caching=caching, debug_checks=True, sampler=sampler)
        self.engine = self.build_engine(config, runner=ScriptedRunner.factory(self.serve, next_token))
        self.pool = FakePool(block_size)
        runner = self.engine.runner
        runner.on_swap_out = lambda request, blocks: self.pool.swap_out(request.request_id, blocks)
        runner.on_swap_in = lambda request, blocks: self.pool.swap_in(request.request_id, blocks)
        runner.on_execute = self.forward
        self.log.append(f"EngineConfig({config})")

    def build_engine(self, config, **parts):
        """The engine under test, with the parts given (the scripted runner; later chapters'
        machines give it more: Chapter 35's the vocabulary's bytes, Chapter 37's a drafter)."""
        return make_engine(self.serve, self.model, eos_token_id=None, **parts, **config)

    @property
    def ready(self):
        return self.engine is not None

    def where(self):
        return f"step {self.steps}, after {self.log[-1] if self.log else 'start'}"

    def forward(self, batch, requests):
        """Every scheduled row writes its K/V, then each request reads all of its context."""
        bm, what = self.engine.blocks, f"the forward of {self.where()}"
        plan = [(r, n) for r, n in self.engine.last_plan.scheduled]
        assert [r.request_id for r, _ in plan] == [r.request_id for r in requests], (
            f"{what}: the batch's requests {[r.request_id for r in requests]} are not the plan's")
        for request, n in plan:
            table = bm.req_blocks[request.request_id]
            self.pool.write(request, table, request.num_computed_tokens, request.num_computed_tokens + n)
        for request, n in plan:
            self.pool.check_read(request, bm.req_blocks[request.request_id], request.num_computed_tokens + n, what)

    @precondition(lambda self: self.ready and len(self.engine.scheduler.requests) < 8)
    @rule(prompt=prompts, max_tokens=st.integers(1, 10), priority=st.integers(0, 2), salt=st.sampled_from(SALTS),
          stops=st.sampled_from([(), (), (3,), (5, 11)]))
    def add(self, prompt, max_tokens, priority, salt, stops):
        self.counter += 1
        rid = f"q{self.counter}"
        engine = self.engine
        params = self.serve.request.SamplingParams(max_tokens=max_tokens, stop_token_ids=stops)
        tokens = prompt_tokens(prompt)
        cfg = engine.config
        before = engine_state(engine)
        fits_pool = len(tokens) + max_tokens <= cfg.num_blocks * cfg.block_size
        fits_step = cfg.enable_chunked_prefill or len(tokens) <= cfg.max_num_batched_tokens
        try:
            engine.add_request(rid, tokens, params, priority=priority, cache_key=salt, arrival_time=float(self.counter))
        except ValueError as exc:
            self.log.append(f"add {rid} rejected: {exc}")
            assert engine_state(engine) == before, f"rejecting {rid} changed the engine"
            assert not (fits_pool and fits_step), f"{rid} fits the pool and the step budget, yet was rejected: {exc}"
            return
        assert fits_pool and fits_step, (
            f"{rid} ({len(tokens)} prompt + {max_tokens} tokens) can never run here, yet was accepted")
        self.log.append(f"add {rid}: {tokens} max_tokens={max_tokens} stops={stops} priority={priority} salt={salt}")

    def step(self):
        engine = self.engine
        outputs = engine.step()
        self.steps += 1
        plan = engine.last_plan
        self.log.append("step: " + ", ".join(f"{r.request_id}+{n}" for r, n in plan.scheduled)
                        + (f"; preempted {[r.request_id for r in plan.preempted]}" if plan.preempted else ""))
        assert plan.scheduled or not engine.has_unfinished, (
            f"{self.where()}: the scheduler planned nothing while {sorted(engine.scheduler.requests)} are unfinished")
        for request, _ in plan.scheduled:
            learn_keys(self.key_prefix, request, engine.blocks.block_size)
        for out in outputs:
            request = next(r for r, _ in plan.scheduled if r.request_id == out.request_id)
            assert out.error is None, f"{self.where()}: {out.request_id} failed: {out.error}"
            self.check_output(request, out)
            if out.finished:
                self.gone.append(out.request_id)

    def check_output(self, request, out):
        """A step's output for one request: the scripted model's greedy token, and a finish
        only by a stop token or max_tokens."""
        assert out.new_token_ids == [next_token(request.token_ids[:-1])], (
            f"{self.where()}: {out.request_id} got {out.new_token_ids}, the scripted model says "
            f"{next_token(request.token_ids[:-1])}")
        if out.finished:
            params = request.params
            stopped = out.output_token_ids[-1] in params.stop_token_ids
            assert stopped or len(out.output_token_ids) == params.max_tokens, (
                f"{self.where()}: {out.request_id} finished ({out.finish_reason}) after "
                f"{len(out.output_token_ids)} of {params.max_tokens} tokens without a stop token")

    @precondition(lambda self: self.ready and self.engine.has_unfinished)
    @rule(count=st.integers(1, 6))
    def run_steps(self, count):
        """Whole engine steps back to back: most of a server's life is this."""
        for _ in range(count):
            if not self.engine.has_unfinished:
                break
            self.step()
            self.rules_hold()

    @precondition(lambda self: self.ready and self.aborts * 3 < self.counter)
    @rule(data=st.data())
    def abort(self, data):
        engine = self.engine
        choices = sorted(engine.scheduler.requests) + self.gone[-2:] + ["no-such-request"]
        rid = data.draw(st.sampled_from(choices), label="abort")
        self.aborts += 1
        known = rid in engine.scheduler.requests
        before = engine_state(engine)
        result = engine.abort_request(rid)
        self.log.append(f"abort {rid}")
        if not known:
            assert result is None, f"aborting unknown or finished {rid!r} returned {result!r}"
            assert engine_state(engine) == before, f"aborting unknown {rid!r} changed the engine"
            return
        assert result is not None and result.status.name == "FINISHED_ABORTED", f"abort {rid} gave {result!r}"
        assert rid not in engine.scheduler.requests and not engine.blocks.req_blocks.get(rid)
        assert rid not in engine.runner.swapped, f"aborting {rid} left its host copies"
        self.pool.host.pop(rid, None)
        self.gone.append(rid)

    @precondition(lambda self: self.ready and self.resets * 3 < self.counter)
    @rule()
    def reset(self):
        """Forget the cached-free blocks (kept rare: it wipes what the other rules build up)."""
        self.resets += 1
        self.engine.blocks.reset_prefix_cache()
        self.log.append("reset_prefix_cache")

    @invariant()
    def rules_hold(self):
        if not self.ready:
            return
        engine, where = self.engine, self.where()
        sched, bm = engine.scheduler, engine.blocks
        check_scheduler(sched, where)
        swapped = sorted(r.request_id for r in sched.waiting if r.swapped_out)
        assert sorted(self.pool.host) == sorted(engine.runner.swapped) == swapped, (
            f"{where}: host copies for {sorted(self.pool.host)}, swapped-out requests {swapped}")
        for request in sched.running:
            self.pool.check_read(request, bm.req_blocks.get(request.request_id, []), request.num_computed_tokens, where)
        self.pool.check_published(bm, self.key_prefix, where)

    def teardown(self):
        """Whatever state the rules left, the work drains: every request finishes, the engine
        ends idle."""
        if not self.ready:
            return
        for _ in range(2000):
            if not self.engine.has_unfinished:
                break
            self.step()
            self.rules_hold()
        assert_engine_idle(self.engine, f"drained after {self.where()}")


def test_engine_state_machine(serve, tiny_model, request):
    EngineMachine.serve, EngineMachine.model = serve, tiny_model
    run_state_machine_as_test(EngineMachine,
                              settings=machine_settings(request, 60, 50, stress_examples=2000, stress_steps=100))
