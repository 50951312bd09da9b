"""Engine core reliability (issue 10): the scheduler's RULES, pinned one by one.

The invariant checks and the parity tests prove the engine safe and right; they do not
notice a scheduler that serves requests in another order than Chapter 31 says, or counts
its statistics twice. These tests pin each rule on a small, exact scenario, the way vLLM's
scheduler tests do: the real Scheduler and BlockManager of the implementation under test,
the real `EngineCore.step` around a scripted model (course.testing.oracles.ScriptedRunner), and
expected values written out by hand.
"""
import pytest
import torch

from course.testing.oracles import ScriptedRunner, assert_engine_idle, make_engine

pytestmark = pytest.mark.chapter(31)


def next_token(tokens):
    """The scripted model: a fixed function of the sequence, never a stop token."""
    return 1 + (len(tokens) * 7) % 50


def scripted(serve, tiny_model, **config):
    return make_engine(serve, tiny_model, eos_token_id=None, runner=ScriptedRunner.factory(serve, next_token),
                       **config)


def add(serve, engine, rid, prompt, max_tokens=8, **kwargs):
    return engine.add_request(rid, prompt, serve.request.SamplingParams(max_tokens=max_tokens), **kwargs)


def ids(requests):
    return [r.request_id for r in requests]


def scheduled(plan):
    return [(r.request_id, n) for r, n in plan.scheduled]


def step_until_preemption(engine, limit=50):
    for _ in range(limit):
        engine.step()
        if engine.last_plan.preempted:
            return engine.last_plan
    pytest.fail(f"no preemption in {limit} steps: the scenario lost its point")


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_preempted_request_resumes_before_later_arrivals(serve, tiny_model, mode):
    """a and b run; c waits (max_num_seqs = 2); the pool runs out and b, the last running, is
    preempted. b was admitted before c, so b goes back to the FRONT of the queue, ahead of c,
    and is the next one admitted when a finishes."""
    engine = scripted(serve, tiny_model, block_size=4, num_blocks=6, max_num_seqs=2, preemption_mode=mode,
                      enable_prefix_caching=False)
    a = add(serve, engine, "a", [1] * 8, max_tokens=6)
    add(serve, engine, "b", [2] * 8, max_tokens=12)
    engine.step()
    add(serve, engine, "c", [3] * 3, max_tokens=2)
    plan = step_until_preemption(engine)
    assert ids(plan.preempted) == ["b"], f"the LAST running request is preempted: got {ids(plan.preempted)}"
    assert ids(engine.scheduler.waiting) == ["b", "c"], (
        f"a preempted request goes back to the front of the waiting queue, ahead of later arrivals: "
        f"waiting is {ids(engine.scheduler.waiting)}")
    while a.status.name == "RUNNING":
        engine.step()
    admitted = [rid for rid, _ in scheduled(engine.last_plan) if rid != "a"]
    while not admitted:
        engine.step()
        admitted = [rid for rid, _ in scheduled(engine.last_plan)]
    assert admitted[0] == "b", f"once a finishes, b (preempted) must resume before c; the step ran {admitted}"


def test_nothing_is_admitted_in_a_step_that_preempted(serve, tiny_model):
    """Preemption says memory is full: the same step admits nobody, even a request that would
    fit in the blocks the victim just gave back."""
    engine = scripted(serve, tiny_model, block_size=4, num_blocks=6, max_num_seqs=4, enable_prefix_caching=False)
    add(serve, engine, "a", [1] * 8, max_tokens=12)
    add(serve, engine, "b", [2] * 8, max_tokens=12)
    engine.step()
    add(serve, engine, "small", [3], max_tokens=1)     # 1 block; a preemption frees 3
    plan = step_until_preemption(engine)
    assert "small" not in dict(scheduled(plan)), f"a step that preempted admitted 'small': {scheduled(plan)}"
    assert engine.scheduler.requests["small"].status.name == "WAITING"
    for _ in range(100):
        if not engine.has_unfinished:
            break
        engine.step()
    assert_engine_idle(engine)


def test_an_urgent_request_is_not_admitted_in_a_step_that_preempted(serve, tiny_model):
    """As above, but the waiting request is more urgent than the victim, so the queue puts it
    ahead of the preempted one: only the rule (no admission in a step that preempted) keeps
    it out of that step."""
    engine = scripted(serve, tiny_model, block_size=4, num_blocks=6, max_num_seqs=2, policy="priority",
                      enable_prefix_caching=False)
    add(serve, engine, "a", [1] * 8, max_tokens=12, priority=1)
    add(serve, engine, "b", [2] * 8, max_tokens=12, priority=1)
    engine.step()
    add(serve, engine, "urgent", [3], max_tokens=1, priority=0)
    plan = step_until_preemption(engine)
    assert "urgent" not in dict(scheduled(plan)), (
        f"a step that preempted admitted 'urgent': {scheduled(plan)}")
    for _ in range(100):
        if not engine.has_unfinished:
            break
        engine.step()
    assert_engine_idle(engine)


def test_without_chunked_prefill_a_long_prompt_blocks_the_queue(serve, tiny_model):
    """Chunked prefill off: a prompt that does not fit the budget left this step waits for a
    step with room, and the shorter prompt behind it waits too (first come, first served)."""
    engine = scripted(serve, tiny_model, block_size=4, num_blocks=32, max_num_batched_tokens=10,
                      enable_chunked_prefill=False, enable_prefix_caching=False)
    add(serve, engine, "running", [1, 2, 3], max_tokens=8)
    engine.step()
    add(serve, engine, "long", [4] * 10)
    add(serve, engine, "short", [5, 6])
    engine.step()
    assert scheduled(engine.last_plan) == [("running", 1)], (
        f"chunked prefill off: 10 tokens do not fit the 9 left after a decode, and 'short' may not overtake "
        f"'long': "
        f"the step ran {scheduled(engine.last_plan)}")
    assert ids(engine.scheduler.waiting) == ["long", "short"]


def test_with_chunked_prefill_the_long_prompt_is_split(serve, tiny_model):
    engine = scripted(serve, tiny_model, block_size=4, num_blocks=32, max_num_batched_tokens=10,
                      enable_prefix_caching=False)
    add(serve, engine, "running", [1, 2, 3], max_tokens=8)
    engine.step()
    add(serve, engine, "long", [4] * 10)
    add(serve, engine, "short", [5, 6])
    engine.step()
    assert scheduled(engine.last_plan) == [("running", 1), ("long", 9)], (
        f"chunked prefill fills the budget with a 9-token chunk of 'long': {scheduled(engine.last_plan)}")


def test_the_last_token_of_the_budget_still_serves_a_running_request(serve, tiny_model):
    """Running requests are served while any budget is left: with a budget of 2 and two
    decoding requests, the second decode takes the last token of the budget."""
    engine = scripted(serve, tiny_model, block_size=4, num_blocks=8, max_num_batched_tokens=2)
    add(serve, engine, "a", [1])
    add(serve, engine, "b", [2])
    engine.step()
    engine.step()
    assert scheduled(engine.last_plan) == [("a", 1), ("b", 1)], (
        f"both running requests decode, the second with the budget's last token: {scheduled(engine.last_plan)}")


@pytest.mark.parametrize("done_first", [True, False])
def test_a_request_with_all_its_output_tokens_gets_no_row(serve, tiny_model, done_first):
    """A running request that already has params.max_tokens output tokens (with asynchronous
    scheduling its last one is still a placeholder, Chapter 33) is not scheduled again, and
    the requests after it in the running order still are."""
    engine = scripted(serve, tiny_model, block_size=4, num_blocks=8)
    order = [("done", [1, 2], 2), ("other", [3, 4], 4)]
    made = {rid: add(serve, engine, rid, prompt, max_tokens=k) for rid, prompt, k in order[::1 if done_first else -1]}
    engine.step()
    made["done"].append(7)                            # its second and last output token, as if in flight
    plan = engine.scheduler.schedule()
    assert scheduled(plan) == [("other", 1)], (
        f"a request with max_tokens outputs gets no row; only 'other' decodes: {scheduled(plan)}")


def test_requests_without_a_priority_have_priority_0(serve, tiny_model):
    """add_request's default priority is 0: under "priority" an explicit 0 that arrives later
    still waits behind it, and -1 goes first."""
    engine = scripted(serve, tiny_model, block_size=4, num_blocks=32, policy="priority", max_num_seqs=1)
    add(serve, engine, "default", [1, 2], arrival_time=1.0)
    add(serve, engine, "zero", [3, 4], priority=0, arrival_time=2.0)
    add(serve, engine, "urgent", [5, 6], priority=-1, arrival_time=3.0)
    assert ids(engine.scheduler.waiting) == ["urgent", "default", "zero"], ids(engine.scheduler.waiting)


def test_an_engine_built_without_a_config_takes_the_defaults(serve, tiny_model):
    engine = serve.engine.EngineCore(tiny_model)
    assert engine.config == serve.config.EngineConfig(), "EngineCore(model) runs with EngineConfig()'s defaults"


def test_prompt_plus_max_tokens_may_reach_max_model_len_exactly(serve, tiny_model):
    engine = scripted(serve, tiny_model, block_size=4, num_blocks=32, max_model_len=16)
    add(serve, engine, "fits", [1] * 6, max_tokens=10)          # 6 + 10 == 16: the last position is used
    with pytest.raises(ValueError, match="positions"):
        add(serve, engine, "over", [1] * 6, max_tokens=11)


def test_a_tensor_prompt_and_the_params_are_the_engines_own_copies(serve, tiny_model):
    """A 1-D integer tensor is a prompt like a list; the engine keeps its own copy of the
    SamplingParams, nested dicts included, so the caller may change theirs afterwards. A
    request that names no adapter has lora_slot 0 (Chapter 43's "none")."""
    engine = scripted(serve, tiny_model, block_size=4, num_blocks=32, sampler="full")
    params = serve.request.SamplingParams(max_tokens=3, logit_bias={5: 1.0})
    request = engine.add_request("t", torch.tensor([7, 8, 9]), params)
    params.logit_bias[5] = 99.0
    assert request.prompt_token_ids == [7, 8, 9] and request.params.logit_bias == {5: 1.0}
    assert request.lora_slot == 0


def test_exact_block_ids_and_free_queue_order(serve):
    """Fresh blocks come from the front of the free queue; free() appends a request's blocks
    to the back tail first; an allocation that does not fit changes nothing."""
    bm = serve.blocks.BlockManager(6, 4, enable_prefix_caching=False)
    r = {rid: serve.request.Request(rid, [7] * n) for rid, n in (("r1", 5), ("r2", 3), ("r3", 9), ("r4", 8))}
    assert bm.allocate_slots(r["r1"], 5) and bm.req_blocks["r1"] == [0, 1]
    assert bm.allocate_slots(r["r2"], 3) and bm.req_blocks["r2"] == [2]
    assert list(bm.free_queue) == [3, 4, 5]
    bm.free(r["r1"])
    assert list(bm.free_queue) == [3, 4, 5, 1, 0], (
        f"free() gives blocks back tail first, to the back of the queue: {list(bm.free_queue)}")
    assert bm.allocate_slots(r["r3"], 9) and bm.req_blocks["r3"] == [3, 4, 5]
    assert not bm.allocate_slots(r["r4"], 9) and list(bm.free_queue) == [1, 0] and "r4" not in bm.req_blocks
    bm.free(r["r2"])
    assert bm.allocate_slots(r["r4"], 8) and bm.req_blocks["r4"] == [1, 0]
    assert list(bm.free_queue) == [2] and bm.ref_count == [1, 1, 0, 1, 1, 1]


def test_cached_free_blocks_are_reused_least_recent_first(serve):
    """With prefix caching on, a freed block keeps its key (cached-free) until the allocator
    hands it to someone else; the least recently freed goes first and leaves the cache."""
    bm = serve.blocks.BlockManager(4, 2)
    first = serve.request.Request("first", [1, 2, 3, 4, 5])
    assert bm.allocate_slots(first, 5) and bm.req_blocks["first"] == [0, 1, 2]
    first.num_computed_tokens = 5
    bm.cache_full_blocks(first)
    assert [bm.state(b) for b in range(4)] == ["used", "used", "used", "free"]
    bm.free(first)
    assert list(bm.free_queue) == [3, 2, 1, 0]
    assert [bm.state(b) for b in range(4)] == ["cached", "cached", "free", "free"]
    other = serve.request.Request("other", [9, 9, 9, 9, 9])
    assert bm.allocate_slots(other, 5) and bm.req_blocks["other"] == [3, 2, 1]
    assert bm.stats["evictions"] == 1 and bm.state(0) == "cached" and bm.block_hash[1] is None, (
        "block 1 was cached-free and reused: it leaves the prefix cache (one eviction); block 0 stays cached")


def test_a_lookup_counts_once_however_many_times_admission_is_retried(serve, tiny_model):
    """A request that finds cached blocks but waits for room is looked up again every step;
    the hit rate must count its admission once."""
    engine = scripted(serve, tiny_model, block_size=4, num_blocks=8, max_num_seqs=4)
    shared = list(range(10, 22))                  # three full blocks
    add(serve, engine, "seed", shared + [1], max_tokens=1)
    while engine.has_unfinished:
        engine.step()
    stats = dict(engine.blocks.stats)
    add(serve, engine, "hog", [2] * 20, max_tokens=8)          # 5 of 8 blocks, then more as it decodes
    engine.step()
    reader = add(serve, engine, "reader", shared + [3, 4, 5, 6, 7, 8, 9], max_tokens=4)   # needs 5 blocks
    retries = 0
    while reader.status.name == "WAITING":
        engine.step()
        retries += 1
    assert retries >= 3, f"the reader was admitted after {retries} tries: the scenario lost its point"
    queries = engine.blocks.stats["queries"] - stats["queries"]
    hits = engine.blocks.stats["hits"] - stats["hits"]
    assert queries == 20 + reader.num_tokens - reader.num_output_tokens, (
        f"prompt tokens looked up: the hog's 20 and the reader's {reader.num_prompt_tokens} once, not once per "
        f"retry ({retries + 1} tries); the statistics counted {queries}")
    assert hits == reader.num_cached_tokens, f"hits counted {hits}, the reader reused {reader.num_cached_tokens}"


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_running_requests_are_served_in_policy_order(serve, tiny_model, policy):
    """Under "priority" the running list is served (and preempted from the back) in
    (priority, arrival) order, whatever order the requests were admitted in; under "fcfs" the
    priority field is ignored."""
    engine = scripted(serve, tiny_model, block_size=4, num_blocks=32, policy=policy)
    add(serve, engine, "late-but-urgent", [1, 2, 3], priority=0, arrival_time=2.0)
    add(serve, engine, "early-but-lax", [4, 5, 6], priority=5, arrival_time=1.0)
    engine.step()
    add(serve, engine, "newcomer", [7, 8], priority=-1, arrival_time=3.0)
    engine.step()                                  # the newcomer is admitted after the running ones
    engine.step()
    want = {"priority": ["newcomer", "late-but-urgent", "early-but-lax"],
            "fcfs": ["late-but-urgent", "early-but-lax", "newcomer"]}[policy]
    assert [rid for rid, _ in scheduled(engine.last_plan)] == want, (
        f"{policy}: the step serves {scheduled(engine.last_plan)}, expected the order {want}")


def test_aging_lets_an_old_low_priority_request_overtake_newer_urgent_ones(serve):
    """Policy "aging" (one priority level per 10 s waited), on an injected clock: a request
    of priority 3 waits behind urgent ones (priority 0) while it is young, and once it has
    waited 30 s it goes ahead of every urgent request younger than 10 s; schedule() admits
    in that order. Under "priority" it would stay last for ever."""
    now = [0.0]
    config = serve.config.SchedulerConfig(policy="aging", aging_seconds=10.0, max_num_seqs=3)
    sched = serve.scheduler.Scheduler(config, serve.blocks.BlockManager(32, 4), clock=lambda: now[0])
    for rid, priority, arrival in (("old", 3, 0.0), ("u1", 0, 1.0), ("u2", 0, 12.0), ("u3", 0, 29.0)):
        now[0] = arrival
        sched.add(serve.request.Request(rid, [1, 2, 3], priority=priority, arrival_time=arrival))
    assert ids(sched.waiting) == ["u1", "u2", "u3", "old"], (
        f"at 29 s the old request (3 - 2 levels) still waits behind the urgent ones: {ids(sched.waiting)}")
    now[0] = 30.0
    assert ids(sched.waiting) == ["u1", "u2", "old", "u3"], (
        f"at 30 s the old request (3 - 3 levels = 0, arrived first) overtakes u3 (0, 1 s old): {ids(sched.waiting)}")
    admitted = ids(r for r, _ in sched.schedule().scheduled)
    assert admitted == ["u1", "u2", "old"], f"schedule() admits in the queue's order at 30 s: {admitted}"
    priority = serve.scheduler.create_request_queue(serve.config.SchedulerConfig(policy="priority"))
    for request in sched.running + list(sched.waiting):
        priority.add(request)
    assert ids(priority)[-1] == "old", "under plain priority the old request stays last"


def test_equal_priorities_keep_their_arrival_order(serve):
    bm = serve.blocks.BlockManager(8, 4)
    sched = serve.scheduler.Scheduler(serve.config.SchedulerConfig(policy="priority"), bm)
    for rid in ("first", "second", "third"):
        sched.add(serve.request.Request(rid, [1, 2], priority=1, arrival_time=7.0))
    assert ids(sched.waiting) == ["first", "second", "third"], (
        f"requests with equal (priority, arrival) are queued in the order they came: {ids(sched.waiting)}")
    with pytest.raises(ValueError, match="'second' is already in the engine"):
        sched.add(serve.request.Request("second", [3]))


def test_preemptions_are_counted_and_finish_is_stamped(serve, tiny_model):
    """Each preemption counts (a request preempted twice says 2), a finished request carries
    its finish time, and an aborted swapped request is no longer marked swapped out."""
    engine = scripted(serve, tiny_model, block_size=2, num_blocks=8, max_num_seqs=3, preemption_mode="swap",
                      enable_prefix_caching=False)
    victims = [add(serve, engine, rid, [i + 1] * 3, max_tokens=10) for i, rid in enumerate(("a", "b", "c"))]
    swapped = None
    for _ in range(200):
        if not engine.has_unfinished:
            break
        engine.step()
        waiting_swapped = [r for r in engine.scheduler.waiting if r.swapped_out]
        if swapped is None and waiting_swapped and max(r.num_preemptions for r in victims) >= 2:
            swapped = waiting_swapped[0]
            assert engine.abort_request(swapped.request_id) is swapped
            assert swapped.swapped_out is False and swapped.status.name == "FINISHED_ABORTED"
    assert max(r.num_preemptions for r in victims) >= 2 and engine.preemptions == sum(
        r.num_preemptions for r in victims), (
        f"preemptions per request {[r.num_preemptions for r in victims]}, engine counted {engine.preemptions}")
    assert swapped is not None, "no request was preempted twice and then found swapped out: scenario lost its point"
    assert all(r.finish_time is not None and r.finish_time >= r.arrival_time for r in victims)
    assert_engine_idle(engine)


def test_first_token_time_is_stamped_once(serve, tiny_model):
    engine = scripted(serve, tiny_model, block_size=4, num_blocks=16)
    request = add(serve, engine, "a", [1, 2, 3], max_tokens=4)
    engine.step()
    first = request.first_token_time
    assert first is not None, "the step that gives a request its first token stamps first_token_time"
    while engine.has_unfinished:
        engine.step()
    assert request.first_token_time == first, (
        "first_token_time is stamped once, at the first token; later tokens never move it")


def test_trim_gives_back_draft_blocks_and_republishes(serve):
    """BlockManager.trim (Chapter 37's rejected drafts): the blocks past num_tokens go back to
    the free queue unpublished, the published count shrinks with them, and publishing after
    regrowth covers the new blocks again; trimming a request with no blocks does nothing."""
    from course.testing.engine_checks import check_block_manager

    bm = serve.blocks.BlockManager(8, 4)
    bm.trim(serve.request.Request("nobody", [1]), 0)
    assert "nobody" not in bm.num_registered and not bm.req_blocks.get("nobody")
    r = serve.request.Request("r", list(range(1, 14)))
    assert bm.allocate_slots(r, 13)
    bm.cache_full_blocks(r, 12)
    assert bm.num_registered["r"] == 3 and len(bm.cached) == 3
    kept, dropped = bm.req_blocks["r"][:1], bm.req_blocks["r"][1:]
    bm.trim(r, 4)
    check_block_manager(bm, "after trim")
    assert bm.req_blocks["r"] == kept and bm.num_registered["r"] == 1 and len(bm.cached) == 1
    assert all(bm.state(b) == "free" and bm.block_hash[b] is None for b in dropped), (
        f"trimmed blocks hold wrong K/V for their keys: they must be plain free, got "
        f"{[bm.state(b) for b in dropped]}")
    assert list(bm.free_queue)[-len(dropped):] == dropped[::-1], "trimmed blocks go back tail first"
    assert bm.allocate_slots(r, 9 - r.num_computed_tokens)
    bm.cache_full_blocks(r, 8)
    assert bm.num_registered["r"] == 2 and len(bm.cached) == 2, "publishing after a trim covers the regrown block"
    check_block_manager(bm, "after regrowth")


def test_blocks_are_published_when_allocated_so_the_same_step_can_adopt_them(serve, tiny_model):
    """A running request's chunk publishes its blocks at allocation time, before the forward:
    a request admitted later in the SAME step adopts them (one flattened step writes every
    K/V before any attention reads)."""
    engine = scripted(serve, tiny_model, block_size=4, num_blocks=32, max_num_batched_tokens=12)
    prompt = list(range(30, 47))                       # 17 tokens: four full blocks and one more token
    add(serve, engine, "first", prompt)
    engine.step()                                      # first: tokens 0-11, blocks 0-2
    second = add(serve, engine, "second", prompt)
    engine.step()                                      # first: tokens 12-16 (block 3 fills); second admitted
    assert scheduled(engine.last_plan)[0] == ("first", 5) and "second" in dict(scheduled(engine.last_plan))
    assert second.num_cached_tokens == 16, (
        f"'second' arrives in the step where 'first' fills its fourth block, and must adopt all four: "
        f"{second.num_cached_tokens} cached tokens")


def test_block_manager_edges(serve):
    """Evictions are counted one by one; publishing for a request without blocks does nothing;
    draft tokens (Chapter 37) past the known tokens are never published; a block released
    more often than it was taken is an error naming it."""
    bm = serve.blocks.BlockManager(4, 2)
    stranger = serve.request.Request("stranger", [1, 2, 3, 4])
    bm.cache_full_blocks(stranger, 4)
    assert not bm.cached and "stranger" not in bm.num_registered
    first = serve.request.Request("first", [1, 2, 3, 4, 5, 6, 7, 8])
    assert bm.allocate_slots(first, 8)
    bm.cache_full_blocks(first, 8)
    bm.free(first)                                   # four cached-free blocks
    other = serve.request.Request("other", [9, 9, 9, 9, 9])
    assert bm.allocate_slots(other, 5) and bm.stats["evictions"] == 3, (
        f"three cached-free blocks were handed out, three evictions: {bm.stats['evictions']}")
    bm.free(other)
    drafted = serve.request.Request("drafted", [5, 6, 7, 8])
    drafted.spec_token_ids = [1, 2, 3, 4]
    assert bm.allocate_slots(drafted, 8)
    bm.cache_full_blocks(drafted, 8)
    assert bm.num_registered["drafted"] == 2, "blocks of unverified draft tokens are not published"
    bm.ref_count[bm.req_blocks["drafted"][0]] = 0
    with pytest.raises(RuntimeError, match=f"block {bm.req_blocks['drafted'][0]} released more times"):
        bm.free(drafted)


# --- pool sizing, generate's ids and loop, the counters (found by mutation testing) -------------
# The tiny model: 2 layers, 2 KV heads, head_dim 16, float32 (course.models.tiny_config). One
# block of 4 tokens holds K and V: 2 pools x 2 layers x 4 tokens x 2 heads x 16 x 4 bytes = 2048.
TINY_BLOCK_BYTES = 2 * 2 * 4 * 2 * 16 * 4


@pytest.mark.parametrize("case", [
    dict(kv_cache_bytes=5 * TINY_BLOCK_BYTES + TINY_BLOCK_BYTES - 1, block_size=4, expect=5),
    dict(kv_cache_bytes=5 * TINY_BLOCK_BYTES + TINY_BLOCK_BYTES - 1, block_size=8, expect=2),   # 4096 a block
    dict(kv_cache_bytes=TINY_BLOCK_BYTES, block_size=4, expect=1),
    dict(kv_cache_bytes=5 * TINY_BLOCK_BYTES + TINY_BLOCK_BYTES - 1, block_size=4, dtype="bfloat16", expect=11),
    dict(kv_cache_bytes=5 * TINY_BLOCK_BYTES + TINY_BLOCK_BYTES - 1, block_size=4, kv_pools=1, expect=11),
], ids=["5 blocks and a bit", "blocks of 8", "exactly one block", "bfloat16 halves a block", "one latent pool"])
def test_the_pool_is_sized_from_kv_cache_bytes(serve, tiny_model, monkeypatch, case):
    """Off CUDA with num_blocks=None, the pool holds kv_cache_bytes // (bytes of one block), a
    block's bytes following block_size, the model's dtype and its number of pools (K and V: 2;
    a model whose capabilities declare kv_pools=1 keeps one latent pool)."""
    import dataclasses

    import torch
    model = tiny_model.to(torch.bfloat16) if case.get("dtype") == "bfloat16" else tiny_model
    if "kv_pools" in case:
        monkeypatch.setattr(model, "capabilities", dataclasses.replace(model.capabilities, kv_pools=case["kv_pools"]))
    engine = make_engine(serve, model, num_blocks=None, kv_cache_bytes=case["kv_cache_bytes"],
                         block_size=case["block_size"])
    assert engine.blocks.num_blocks == case["expect"], (
        f"{case}: a pool of {case['kv_cache_bytes']} bytes holds {case['expect']} whole blocks, "
        f"the engine made {engine.blocks.num_blocks}")


def test_a_plan_that_schedules_nobody_still_copies_its_blocks_out(serve, tiny_model):
    """A step whose plan only swaps a request out (nothing scheduled) returns no output, yet
    the request's K/V reach the host, so it resumes where it stopped."""
    def run(preempt_once):
        engine = scripted(serve, tiny_model, num_blocks=16, block_size=4, preemption_mode="swap")
        add(serve, engine, "a", [3, 1, 4, 1, 5], max_tokens=6)
        outputs = [engine.step()]
        if preempt_once:
            victim, blocks = engine.scheduler.running[0], engine.scheduler.block_table(engine.scheduler.running[0])

            def only_a_swap():
                plan = serve.scheduler.SchedulerOutput()
                engine.scheduler._preempt(victim, plan)
                return plan

            engine.scheduler.schedule = only_a_swap
            outputs.append(engine.step())
            del engine.scheduler.schedule
            assert outputs[-1] == [] and engine.runner.swapped == {"a": blocks}, (
                f"a plan that schedules nobody still carries out its block copies: a step that only swapped "
                f"request 'a' out must copy its blocks {blocks} out and return []; got outputs {outputs[-1]}, "
                f"copied out {engine.runner.swapped}")
        while engine.has_unfinished:
            outputs.append(engine.step())
        assert_engine_idle(engine)
        return [token for step in outputs for out in step for token in out.new_token_ids]

    assert run(preempt_once=True) == run(preempt_once=False)


def test_each_step_checks_its_plan_once_and_the_scheduler_once_per_update(serve, tiny_model):
    """With debug checks on, a step's plan is checked once (EngineCore.schedule) and the
    scheduler once per applied step (EngineCore.update). Chapter 33's milestone holds the
    asynchronous engine, which calls the same parts, to the same counts."""
    from types import SimpleNamespace

    engine = make_engine(serve, tiny_model, num_blocks=32, block_size=4)
    calls = {"plan": 0, "scheduler": 0}
    engine.checks = SimpleNamespace(check_plan=lambda *_: calls.update(plan=calls["plan"] + 1),
                                    check_scheduler=lambda *_: calls.update(scheduler=calls["scheduler"] + 1))
    engine.add_request("a", [1, 2, 3, 4, 5], serve.request.SamplingParams(max_tokens=4, ignore_eos=True))
    engine.add_request("b", [6, 7, 8], serve.request.SamplingParams(max_tokens=6, ignore_eos=True))
    steps = 0
    while engine.has_unfinished:
        engine.step()
        steps += 1
    assert calls == {"plan": steps, "scheduler": engine.steps}, (
        f"a step goes through its named parts: self.schedule() checks each plan once, self.update() the "
        f"scheduler once per applied step; {steps} calls of step, {engine.steps} steps applied, the checks ran "
        f"{calls}")


def test_a_model_declares_its_capabilities_in_one_typed_attribute(serve, tiny_model):
    """ModelCapabilities.of reads `model.capabilities` and nothing else: a model without one
    is refused by name, and a misspelt capability fails where it is declared instead of
    falling back to a default."""
    import dataclasses

    capabilities = serve.interfaces.ModelCapabilities
    assert capabilities.of(tiny_model) == tiny_model.capabilities
    assert capabilities.of(tiny_model).context_limit == tiny_model.context_limit
    with pytest.raises(TypeError, match="object declares no ModelCapabilities"):
        capabilities.of(object())
    with pytest.raises(TypeError, match="kv_pool"):
        dataclasses.replace(tiny_model.capabilities, kv_pool=1)


def test_a_pool_too_small_for_one_block_is_refused(serve, tiny_model):
    whole_message = r"^the KV pool would hold no block: give more memory or set EngineConfig\.num_blocks$"
    with pytest.raises(ValueError, match=whole_message):
        make_engine(serve, tiny_model, num_blocks=None, kv_cache_bytes=TINY_BLOCK_BYTES - 1, block_size=4)


def test_on_cuda_the_pool_is_profiled_with_the_configs_budget(serve, tiny_model, monkeypatch):
    """On CUDA with num_blocks=None the engine asks runner.profile_num_blocks, passing the block
    size, the model's dtype and device, the step's token budget and gpu_memory_utilization.
    A model that says it lives on CUDA, and a stand-in profiler that records its arguments
    and stops the construction there, check the call on any machine."""
    import inspect
    from types import SimpleNamespace

    import torch

    class Stop(Exception):
        pass

    class SaysCuda(serve.flat_model.FlatModel):
        def parameters(self, recurse=True):
            yield SimpleNamespace(device=torch.device("cuda"), dtype=torch.bfloat16)

    calls = []

    def profiler(*args, **kwargs):
        calls.append(inspect.signature(serve.runner.profile_num_blocks).bind(*args, **kwargs))
        raise Stop

    monkeypatch.setattr(serve.engine, "profile_num_blocks", profiler)
    flat = SaysCuda(tiny_model)
    with pytest.raises(Stop):
        make_engine(serve, flat, num_blocks=None, block_size=8, max_num_batched_tokens=96,
                    gpu_memory_utilization=0.5)
    assert len(calls) == 1, f"the engine must profile the pool once on CUDA, it called the profiler {len(calls)} times"
    calls[0].apply_defaults()
    got = dict(calls[0].arguments)
    backend = got.pop("backend")
    assert backend is not None and hasattr(backend, "allocate"), f"the profiler needs the attention backend: {backend}"
    assert got == dict(flat=flat, block_size=8, dtype=torch.bfloat16, device=torch.device("cuda"), max_tokens=96,
                       utilization=0.5), f"profile_num_blocks was called with {got}"


def test_generate_never_runs_a_callers_queued_request(serve, tiny_model):
    """generate() runs the engine until its own prompts finish. A request the caller queued
    would finish inside it, its final output reaching no step() the caller sees: generate
    refuses (ValueError, nothing queued), and the caller's request still finishes through
    the caller's own steps, its final output among theirs."""
    P = serve.request.SamplingParams
    engine = scripted(serve, tiny_model, block_size=4, num_blocks=32)
    mine = add(serve, engine, "mine", [5, 6], max_tokens=3)
    with pytest.raises(ValueError, match=r"generate: the engine already holds requests \['mine'\]"):
        engine.generate([[1, 2]], P(max_tokens=2))
    assert list(engine.scheduler.requests) == ["mine"] and mine.num_output_tokens == 0, (
        "a refused generate must leave the engine as it was")
    finals = []
    while engine.has_unfinished:
        finals += [o for o in engine.step() if o.finished]
    assert [(o.request_id, len(o.output_token_ids)) for o in finals] == [("mine", 3)], (
        f"the caller's request must finish through the caller's step(): {finals}")
    outs = engine.generate([[1, 2], [3, 4]], P(max_tokens=2))    # an idle engine runs generate again
    assert [len(o.output_token_ids) for o in outs] == [2, 2]
    assert_engine_idle(engine)


def test_eos_comes_from_the_model_config_unless_told_otherwise(serve, impl, ref_model):
    """EngineCore(model) without eos_token_id stops on the model config's eos_token_id (a
    tiny model whose config names as EOS the token greedy decoding emits third); an explicit
    None turns EOS off, and an explicit id overrides the config's."""
    from course.models import tiny_qwen3
    from course.testing.oracles import solo
    prompt = [3, 1, 4, 1, 5]
    free = solo(ref_model, prompt, 8, eos_token_id=None)
    eos = free[2]
    model = tiny_qwen3(impl.package, eos_token_id=eos)
    P = serve.request.SamplingParams(max_tokens=8)

    def run(**eos_arg):
        engine = serve.engine.EngineCore(model, serve.config.EngineConfig(num_blocks=16, block_size=4), **eos_arg)
        return engine.generate([prompt], P)[0].output_token_ids

    assert run() == free[:free.index(eos) + 1], (
        f"an engine built without eos_token_id must stop on the model's EOS {eos}: got {run()}, want "
        f"{free[:free.index(eos) + 1]}")
    assert run(eos_token_id=None) == free, "eos_token_id=None means no EOS: the request runs to max_tokens"
    other = free[1] if free[1] != eos else free[3]
    assert run(eos_token_id=other) == free[:free.index(other) + 1], "an explicit eos_token_id wins over the config's"


def test_generate_runs_through_steps_without_outputs_and_returns_only_its_own(serve, tiny_model):
    """A prompt longer than the step's budget spends steps with no output (mid-prompt chunks):
    generate keeps stepping; its prompts come back, finished, in the order given."""
    P = serve.request.SamplingParams
    engine = scripted(serve, tiny_model, block_size=4, num_blocks=32, max_num_batched_tokens=8)
    outs = engine.generate([list(range(1, 20)), [7, 7]], [P(max_tokens=3), P(max_tokens=2)])
    assert [(len(o.output_token_ids), o.finished) for o in outs] == [(3, True), (2, True)], (
        f"generate returns each prompt's FINAL output: {outs}")
    assert outs[0].output_token_ids == [next_token(list(range(1, 20)) + outs[0].output_token_ids[:k])
                                        for k in range(3)]


def test_generate_raises_when_the_scheduler_plans_nothing(serve, tiny_model):
    """A scheduler that plans nothing while generate's requests are unfinished would spin
    forever: generate raises a RuntimeError naming (at most four of) them, and leaves the
    engine empty."""
    P = serve.request.SamplingParams
    engine = scripted(serve, tiny_model, block_size=4, num_blocks=32)
    engine.scheduler.schedule = lambda: serve.scheduler.SchedulerOutput()
    with pytest.raises(RuntimeError, match=r"planned nothing while 5 request\(s\) are unfinished") as caught:
        engine.generate([[1, 2]] * 5, P(max_tokens=2))
    listed = str(caught.value).split("unfinished:")[1]
    assert listed.count("'") == 8, f"the error lists the first four unfinished ids: {caught.value}"
    assert_engine_idle(engine, "after generate raised")


def test_stats_counts_by_hand(serve, tiny_model):
    """stats() after one step: a (8 tokens) runs, b (the same 8 tokens) waits (max_num_seqs = 1).
    a was looked up (8 tokens queried, nothing cached) and holds 2 of the 6 blocks."""
    engine = scripted(serve, tiny_model, block_size=4, num_blocks=6, max_num_seqs=1)
    add(serve, engine, "a", [1] * 8, max_tokens=4)
    add(serve, engine, "b", [1] * 8, max_tokens=4)
    engine.step()
    assert engine.stats() == {"steps": 1, "preemptions": 0, "prefix_hit_rate": 0.0, "blocks_free": 4,
                              "num_blocks": 6, "waiting": 1, "running": 1, "prefix_queries": 8,
                              "prefix_hits": 0, "prefix_evictions": 0}, engine.stats()


def test_generate_passes_its_priorities_on(serve, tiny_model):
    """Under policy="priority" generate's prompts are served in the order of the priorities
    given (smaller first), by default all at priority 0 (then in the order given).
    max_num_seqs = 1 makes the order visible."""
    P = serve.request.SamplingParams
    engine = scripted(serve, tiny_model, block_size=4, num_blocks=32, max_num_seqs=1, policy="priority")
    served = []
    schedule = engine.scheduler.schedule

    def recording():
        plan = schedule()
        served.extend(r.prompt_token_ids[0] for r, _ in plan.scheduled if r.prompt_token_ids[0] not in served)
        return plan

    engine.scheduler.schedule = recording
    engine.generate([[1, 2], [3, 4]], P(max_tokens=2))
    assert served == [1, 3], f"at the default priority 0 the prompts run in the order given: {served}"
    served.clear()
    engine.generate([[1, 2], [3, 4]], P(max_tokens=2), priorities=[5, 1])
    assert served == [3, 1], f"the priority-1 prompt must be served before the priority-5 one: {served}"


def test_outputs_carry_the_stop_token_and_the_cached_prefix(serve, tiny_model):
    """A request's output names the stop token that ended it (stop_reason) and how many prompt
    tokens came from the prefix cache: b repeats finished a's 8-token prompt, 2 full blocks of
    4, so 8 of its tokens are cached. Without prompt logprobs a batch records no prompt spans."""
    engine = scripted(serve, tiny_model, block_size=4, num_blocks=16)
    add(serve, engine, "a", [1] * 8, max_tokens=1)
    (a,) = engine.step()
    assert a.finished and a.num_cached_tokens == 0 and a.stop_reason is None, a
    stopper = next_token([1] * 8 + [3])               # the scripted model's first token for b
    engine.add_request("b", [1] * 8 + [3], serve.request.SamplingParams(max_tokens=5, stop_token_ids=[stopper]))
    (b,) = engine.step()
    assert (b.finished, b.finish_reason, b.stop_reason, b.num_cached_tokens) == (True, "stop", stopper, 8), (
        f"a request that meets a stop token finishes as 'stop', with the token and its cached prefix: {b}")
    request = serve.request.Request("plain", [1, 2, 3])
    batch = serve.batch.build_batch([(request, 3)], {"plain": [0]}, 4, "cpu")
    assert batch.prompt_spans == [], f"no prompt logprobs asked, yet prompt_spans is {batch.prompt_spans!r}"


def test_prompt_logprob_rows_and_spans_by_hand(serve):
    """With params.prompt_logprobs set (Chapter 34's seam), the rows whose next token is a
    prompt token follow the sampling rows in logits_indices and prompt_spans records
    (request, first position, the prompt tokens they predict). Prompt 10..14 in chunks of 3,
    1 and 1 behind a plain 3-token prompt; then a request with two draft tokens (Chapter 37)."""
    import torch
    plain = serve.request.Request("plain", [1, 2, 3])
    scored = serve.request.Request("scored", [10, 11, 12, 13, 14], serve.request.SamplingParams(prompt_logprobs=0))
    tables = {"plain": [0], "scored": [1, 2]}
    batch = serve.batch.build_batch([(plain, 3), (scored, 3)], tables, 4, "cpu")
    assert (batch.logits_indices.tolist(), batch.sample_counts) == ([2, 3, 4, 5], [1, 0]), (
        f"plain samples row 2; scored's rows 3..5 predict prompt tokens 11..13: {batch.logits_indices.tolist()}")
    assert [(r.request_id, c, tokens) for r, c, tokens in batch.prompt_spans] == [("scored", 0, [11, 12, 13])]
    for done, rows, spans in ((3, [0], [("scored", 3, [14])]), (4, [0], [])):
        scored.num_computed_tokens = done
        batch = serve.batch.build_batch([(scored, 1)], tables, 4, "cpu")
        assert batch.logits_indices.tolist() == rows and [
            (r.request_id, c, tokens) for r, c, tokens in batch.prompt_spans] == spans, (
            f"scored at position {done}: rows {batch.logits_indices.tolist()}, spans {batch.prompt_spans}")
    drafted = serve.request.Request("drafted", [1, 2, 3])
    drafted.num_computed_tokens, drafted.spec_token_ids = 2, [7, 8]
    batch = serve.batch.build_batch([(drafted, 3)], {"drafted": [0, 1]}, 4, "cpu")
    assert batch.input_ids.tolist() == [3, 7, 8] and batch.input_ids.dtype == torch.int64, batch.input_ids


def test_padding_rows_by_hand(serve):
    """pad_to (Chapter 33's seam) appends one-row dummies (token 0, position 0, slot -1,
    seq_len 0, an all-zero block-table row) until there are pad_to requests, and none when
    there are already that many. A one-block table keeps the block table one column wide."""
    import torch
    plain = serve.request.Request("p", [1, 2, 3])
    for pad_to, ids, slots, lens, starts, table in (
            (2, [1, 2, 3, 0], [20, 21, 22, -1], [3, 0], [0, 3, 4], [[5], [0]]),
            (1, [1, 2, 3], [20, 21, 22], [3], [0, 3], [[5]])):
        batch = serve.batch.build_batch([(plain, 3)], {"p": [5]}, 4, "cpu", pad_to)
        meta = batch.meta
        got = (batch.input_ids.tolist(), batch.positions.tolist()[3:], meta.slot_mapping.tolist(),
               meta.seq_lens.tolist(), meta.query_start_loc.tolist(), meta.block_table.tolist())
        assert got == (ids, [0] * (len(ids) - 3), slots, lens, starts, table), f"pad_to={pad_to}: {got}"
        assert (meta.block_size, meta.max_query_len, meta.max_seq_len) == (4, 3, 3), meta
        assert [t.dtype for t in (meta.query_start_loc, meta.seq_lens, meta.block_table, meta.slot_mapping)] == [
            torch.int32, torch.int32, torch.int32, torch.int64], "the spec's index dtypes: int32, slots int64"
    only_padding = serve.batch.build_batch([], {}, 4, "cpu", 2).meta
    assert (only_padding.max_query_len, only_padding.max_seq_len) == (1, 0), (
        "two one-row dummies: the longest query is 1 row, the longest context 0")
    mid_prompt = serve.batch.build_batch([(serve.request.Request("m", [1, 2, 3, 4, 5]), 2)], {"m": [0, 1]}, 4, "cpu")
    assert mid_prompt.logits_indices.tolist() == [] and mid_prompt.logits_indices.dtype == torch.int64, (
        f"a mid-prompt chunk samples no row, and its empty logits_indices is still int64: {mid_prompt.logits_indices}")
