"""Chapter 31: deciding, each step, which requests compute how many tokens.

The scheduler's whole answer is a list of (request, n): compute the next n tokens of this
request. A decode is n = 1, a prompt chunk is n = chunk, a resumed request is n = what it
lost. Running requests are served first (they hold memory and someone is reading their
stream), then waiting requests are admitted with whatever is left of the token budget.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from .blocks import BlockManager
from .config import Policy, SchedulerConfig
from .request import Request, Status


@dataclass
class SchedulerOutput:
    """One step's plan.

    scheduled   [(request, n)] in row order of the batch
    preempted   requests that lost their blocks this step
    swap_out    [(request, blocks)]: copy these blocks to host memory BEFORE the forward
                pass (the blocks are already free and may be reused by this very step)
    swap_in     [(request, blocks)]: copy the saved K/V back into these new blocks
    block_tables  request id -> the blocks each scheduled request holds for this step, in
                logical order (a copy taken when the plan is made): what the runner's
                prepare(scheduled, block_tables) reads, so nothing outside the scheduler
                reads the block manager's tables
    """
    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    swap_out: list[tuple[Request, list[int]]] = field(default_factory=list)
    swap_in: list[tuple[Request, list[int]]] = field(default_factory=list)
    block_tables: dict[str, list[int]] = field(default_factory=dict)

    @property
    def empty(self) -> bool:
        return not self.scheduled

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class RequestQueue:
    """The waiting queue under policy "fcfs": requests are admitted in the order they came,
    except that a preempted request goes back ahead of everyone who arrived after it.

    Every policy is a queue with these methods (vLLM's `create_request_queue(policy)`), so
    `Scheduler.schedule` reads the policy only through them: `peek()` is the request to
    admit next, `pop()` takes that very request, `sort_running(running)` puts the running
    requests in the policy's order of service (the last is preempted first). Iterating
    gives the requests in admission order as it stands now."""

    def __init__(self) -> None:
        self.requests: deque[Request] = deque()

    def add(self, request: Request, front: bool = False) -> None:
        """Queue `request`; front=True: a preempted request, admitted before everyone queued."""
        if front:
            self.requests.appendleft(request)
        else:
            self.requests.append(request)

    def peek(self) -> Request:
        return self.requests[0]

    def pop(self) -> Request:
        return self.requests.popleft()

    def remove(self, request: Request) -> None:
        self.requests.remove(request)

    def sort_running(self, running: list[Request]) -> None:
        """Put `running` in the policy's order of service, in place: "fcfs" serves in the
        order of admission, which is the list's own."""

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self) -> Iterator[Request]:
        return iter(list(self.requests))

    def __contains__(self, request: object) -> bool:
        return request in self.requests


class PriorityQueue(RequestQueue):
    """Policy "priority": smaller `priority` first (vLLM's convention), then earlier
    arrival; a preempted request takes its place by the same rule. Running requests are
    served in that order too."""

    def rank(self, request: Request) -> tuple[float, float]:
        return request.priority, request.arrival_time

    def add(self, request: Request, front: bool = False) -> None:
        rank = self.rank(request)         # after every request of equal rank: they came first
        spot = next((i for i, other in enumerate(self.requests) if self.rank(other) > rank), len(self.requests))
        self.requests.insert(spot, request)

    def sort_running(self, running: list[Request]) -> None:
        running.sort(key=self.rank)


class AgingQueue(PriorityQueue):
    """Policy "aging": "priority" where waiting earns precedence. Every aging_seconds a
    request has waited since it arrived lowers its priority value by one level, so a
    low-priority request overtakes the high-priority ones that keep arriving after it
    instead of starving behind them. Ranks change as time passes, so the queue orders its
    requests when asked (peek, iteration, sort_running) at the clock's time then, not when
    they are added; pop takes the request the last peek returned."""

    def __init__(self, aging_seconds: float, clock: Callable[[], float]) -> None:
        super().__init__()
        self.aging_seconds, self.clock = aging_seconds, clock
        self.now = clock()

    def rank(self, request: Request) -> tuple[float, float]:
        levels = (self.now - request.arrival_time) // self.aging_seconds
        return request.priority - max(levels, 0), request.arrival_time

    def add(self, request: Request, front: bool = False) -> None:
        self.requests.append(request)

    def _reorder(self) -> None:
        self.now = self.clock()
        self.requests = deque(sorted(self.requests, key=self.rank))   # stable: equal ranks keep their order

    def peek(self) -> Request:
        self._reorder()
        return self.requests[0]

    def __iter__(self) -> Iterator[Request]:
        self._reorder()
        return super().__iter__()

    def sort_running(self, running: list[Request]) -> None:
        self.now = self.clock()
        super().sort_running(running)


def create_request_queue(config: SchedulerConfig, clock: Callable[[], float] = time.monotonic) -> RequestQueue:
    """The waiting queue of config.policy. `clock` is for policies whose order changes as
    time passes (the seconds of time.monotonic, which requests' arrival_time uses too)."""
    queues: dict[Policy, Callable[[], RequestQueue]] = {
        "fcfs": RequestQueue, "priority": PriorityQueue,
        "aging": lambda: AgingQueue(config.aging_seconds, clock)}
    return queues[config.policy]()


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config, self.blocks = config, block_manager
        self.waiting = create_request_queue(config, clock)   # the policy's order of admission
        self.running: list[Request] = []             # order of service; the last one is preempted first
        self.requests: dict[str, Request] = {}       # every unfinished request by id
        self.on_finish: Callable[[Request], None] | None = None   # called before a finished request's blocks go back

    # --- entering and leaving -------------------------------------------------------------

    def check(self, request: Request) -> None:
        """Raise ValueError if `request` could never run here; changes nothing."""
        capacity = self.blocks.num_blocks * self.blocks.block_size
        need = request.num_tokens + request.params.max_tokens
        if need > capacity:
            raise ValueError(f"request {request.request_id!r}: prompt ({request.num_tokens}) + max_tokens "
                             f"({request.params.max_tokens}) needs {need} KV slots, more than the whole "
                             f"pool holds ({self.blocks.num_blocks} blocks x {self.blocks.block_size} = {capacity})")
        budget = self.config.max_num_batched_tokens
        if not self.config.enable_chunked_prefill and request.num_tokens > budget:
            raise ValueError(f"request {request.request_id!r}: its {request.num_tokens}-token prompt exceeds the "
                             f"{budget}-token step budget and chunked prefill is off")
        if request.request_id in self.requests:
            raise ValueError(f"request {request.request_id!r} is already in the engine")

    def add(self, request: Request) -> None:
        self.check(request)
        self.waiting.add(request)
        self.requests[request.request_id] = request

    def finish(self, request: Request, status: Status) -> None:
        """End a request: out of the queues, on_finish(request), then its blocks go back."""
        request.status = status
        request.finish_time = time.monotonic()
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        if self.on_finish is not None:
            self.on_finish(request)          # e.g. ship its K/V elsewhere (Chapter 41): blocks still valid
        self.blocks.free(request)
        self.requests.pop(request.request_id, None)

    def abort(self, request_id: str) -> Request | None:
        """Finish a request as aborted wherever it is; returns it, or None if unknown."""
        request = self.requests.get(request_id)
        if request is not None:
            request.swapped_out = False
            self.finish(request, Status.FINISHED_ABORTED)
        return request

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # --- the blocks, for those who run the plan --------------------------------------------------

    def block_table(self, request: Request) -> list[int]:
        """A copy of the blocks `request` holds, in logical order ([] when it holds none)."""
        return list(self.blocks.req_blocks.get(request.request_id, ()))

    def publish_computed(self, request: Request) -> None:
        """Publish the request's full blocks among its computed tokens: the update calls this
        once a step's tokens have landed (a generated token's key exists only then)."""
        self.blocks.cache_full_blocks(request)

    def trim(self, request: Request, num_tokens: int) -> None:
        """Give back, unpublished, the request's blocks past its first num_tokens tokens (the
        blocks of rejected drafts, Chapter 37)."""
        self.blocks.trim(request, num_tokens)

    def _adapter_waits(self, request: Request) -> bool:
        """Chapter 43: True when admitting `request` would make more than config.max_loras
        distinct LoRA adapters run at once (slot 0, no adapter, never counts)."""
        slot = request.lora_slot
        if not slot:
            return False
        running = {r.lora_slot for r in self.running} - {0}
        return slot not in running and len(running) >= self.config.max_loras

    def _chunk(self, wanted: int, budget: int) -> int:
        cap = self.config.long_prefill_token_threshold
        n = min(wanted, budget)
        return min(n, cap) if cap else n

    # --- the stubs ---------------------------------------------------------------------------

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        """Take a running request off the device.  (Your engine: Chapter 31)

        request: one of self.running; out: this step's SchedulerOutput. Afterwards the request:
          - is not running, holds no blocks, and has no draft tokens (drafts are for one step);
          - has status PREEMPTED, num_preemptions one higher, and is listed in out.preempted;
          - waits ahead of every request still waiting (self.waiting, at its front): it was
            admitted before all of them.
        What it keeps depends on self.config.preemption_mode:
          "recompute": nothing computed (num_computed_tokens 0): its prompt and outputs so far
            are prefilled again, much of them probably from the prefix cache;
          "swap": num_computed_tokens as it was, swapped_out True, and out.swap_out names the
            blocks it held when preempted, so the runner copies their K/V to the host
            before anyone else writes them.
        Example (block_size 4): r has 13 tokens, 12 computed, blocks [4, 7, 9]. Recompute:
        r computed 0, no blocks; 4, 7 and 9 back in the free queue with their keys. Swap:
        r computed 12, no blocks, out.swap_out == [(r, [4, 7, 9])].
        """
        self.running.remove(request)
        request.spec_token_ids = []
        if self.config.preemption_mode == "recompute":
            request.num_computed_tokens = 0                 # its K/V are forgotten
        else:
            out.swap_out.append((request, self.block_table(request)))   # a copy: free() empties the list
            request.swapped_out = True
        self.blocks.free(request)
        request.num_preemptions += 1
        request.status = Status.PREEMPTED
        out.preempted.append(request)
        self.waiting.add(request, front=True)

    def schedule(self) -> SchedulerOutput:
        """Plan one step within the token budget.  (Your engine: Chapter 31)

        Returns a SchedulerOutput: scheduled, (request, n) pairs with n >= 1, running requests
        first, then newly admitted ones; preempted; swap_out and swap_in, (request, block ids)
        pairs for the runner; block_tables, each scheduled request's id -> self.block_table(request)
        once the plan is complete (the runner reads these, never the block manager). Invariants of the plan:
          - sum of n <= config.max_num_batched_tokens; each n <= self._chunk's cap; no more than
            config.max_num_seqs requests run;
          - every scheduled request holds blocks for num_computed_tokens + n tokens, and the
            full ones among them are published before schedule returns (before the forward
            pass writes them), so a request admitted later in the same step can adopt them;
          - running requests are served in the policy's order, which
            self.waiting.sort_running(self.running) sets first; one that already has
            params.max_tokens output tokens gets no row (its
            last token may still be a placeholder, Chapter 33). When blocks run short, the LAST
            running request is preempted (as _preempt defines), as often as needed; once the
            request being served is itself the victim, no further running request is served;
          - waiting requests are admitted in the queue's order (self.waiting.peek() is the next,
            self.waiting.pop() takes it), never by preempting, and not at all in a step that
            preempted; the first that cannot be admitted stops admission (no skipping);
            a request for which self._adapter_waits(request) holds (Chapter 43) waits before any
            lookup;
          - a fresh request (no computed tokens) adopts its longest cached prefix, which counts
            as computed; a swapped-out request keeps its tokens, gets fresh blocks, goes to
            out.swap_in with a copy of its new block list and is no longer swapped_out;
          - with chunked prefill off, a request whose remaining tokens do not fit the budget left
            waits, unless they exceed a whole budget (then it is chunked anyway);
          - a request that looked up and still waits is passed to blocks.forget_lookup(request,
            cached), so the hit rate counts each admission once. Trap: a swapped request never
            looked up, and must NOT be forgotten;
          - an admitted request is RUNNING and appended to self.running; on its first admission
            (status WAITING) num_cached_tokens records the tokens its prefix supplied.
        """
        out = SchedulerOutput()
        cfg, blocks = self.config, self.blocks
        budget = cfg.max_num_batched_tokens
        self.waiting.sort_running(self.running)

        i = 0
        while budget > 0 and i < len(self.running):
            request = self.running[i]
            # With async scheduling (Chapter 33) the final output token may still be a
            # placeholder: the request has all its tokens and must not get another row.
            complete = request.num_output_tokens >= request.params.max_tokens
            n = 0 if complete else self._chunk(request.num_tokens_with_spec - request.num_computed_tokens, budget)
            if n <= 0:
                i += 1
                continue
            gave_up = False
            while not blocks.allocate_slots(request, n):
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is request:
                    gave_up = True
                    break
            if gave_up:
                break
            out.scheduled.append((request, n))
            blocks.cache_full_blocks(request, request.num_computed_tokens + n)
            budget -= n
            i += 1

        while (self.waiting and budget > 0 and not out.preempted
               and len(self.running) < cfg.max_num_seqs):
            request = self.waiting.peek()
            if self._adapter_waits(request):
                break
            cached = blocks.find_cached_prefix(request) if request.num_computed_tokens == 0 else []
            reused = len(cached) * blocks.block_size
            remaining = request.num_tokens - request.num_computed_tokens - reused
            n = self._chunk(remaining, budget)
            waits = not cfg.enable_chunked_prefill and budget < remaining <= cfg.max_num_batched_tokens
            if waits or not blocks.allocate_slots(request, n, cached):
                if request.num_computed_tokens == 0:
                    blocks.forget_lookup(request, cached)      # it will be looked up again next time
                break
            self.waiting.pop()
            if request.swapped_out:
                out.swap_in.append((request, self.block_table(request)))
                request.swapped_out = False
            request.num_computed_tokens += reused
            if request.status is Status.WAITING:
                request.num_cached_tokens = reused
            request.status = Status.RUNNING
            self.running.append(request)
            out.scheduled.append((request, n))
            blocks.cache_full_blocks(request, request.num_computed_tokens + n)
            budget -= n
        out.block_tables = {r.request_id: self.block_table(r) for r, _ in out.scheduled}
        return out
