"""Chapter 33: asynchronous scheduling, the host plans step t+1 while the device runs step t.

The synchronous step is a relay: the host schedules and builds a batch while the device
waits, then the device computes while the host waits for the sampled tokens. The
asynchronous engine calls the synchronous engine's own parts (EngineCore.schedule,
ModelRunner.prepare, EngineCore.execute_model, EngineCore.sample_tokens, EngineCore.update)
in another order, chosen by what each part needs:

  * scheduling step t+1 needs only how MANY tokens each request has: a request whose
    token from step t is not read back yet holds a PLACEHOLDER in its token list
    (num_placeholders counts them), so the scheduler sees the right lengths;
  * preparing step t+1's batch needs step t's tokens only on the device: ModelRunner.prepare,
    given step t as `previous`, fills each placeholder input from step t's sampled tokens
    there, never read back; its device part (swaps, forward and, with Chapter 31's
    SimpleSampler, the sampling: `sample_on_device`) queues behind step t's;
  * applying step t (EngineCore.update, whose hooks this stepper extends: each token over
    its placeholder, the stop rule on it, outputs of known tokens only) needs step t's
    tokens on the host: the one wait;
  * any other sampler reads the requests' histories, so it must see exactly what the
    synchronous engine shows it: step t's tokens applied, step t+1's placeholders not yet
    there (EngineCore.sample_tokens, on the host, from the logits step t+1's forward left).

So step t's device work overlaps step t+1's host work. The cost: a request that stops at
step t (an EOS nobody knew about yet) has already been given a row in step t+1, computed
for nothing and thrown away; max_tokens is known in advance, so the scheduler never gives
a request a row past its last token (its last token is "in flight"). A host sampler costs
more: the host waits for step t+1's forward before it can plan step t+2, as vLLM's
asynchronous scheduler does for structured outputs.

The device queue keeps the device part of each step in order:
    "cuda"    runs it on the host thread, which only enqueues kernels on the current stream,
              and copies the sampled tokens to pinned host memory behind an event;
    "thread"  one worker thread runs the steps one after another (CPU: real overlap when
              the forward pass releases the GIL, as torch's kernels do). Step t's tokens
              exist only once the worker has run it, and prepare fills step t+1's
              placeholder inputs from them, so the host waits for step t's device part
              after scheduling step t+1 and before preparing its batch (wait_for_tokens):
              step t's forward overlaps the scheduling of step t+1 and the update of step
              t-1, not the building of step t+1's batch;
    "inline"  runs it at once (CPU default): the same code path, no overlap.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch

from ..devices import to_device
from ..sampling import sample
from .interfaces import SampledTokens, StopRule
from .request import PLACEHOLDER, Request, RequestOutput, Status
from .sampler import SimpleSampler
from .update import StepUpdate

if TYPE_CHECKING:
    from .batch import Batch
    from .engine import EngineCore, ModelOutput
    from .scheduler import SchedulerOutput

QUEUE_MODES = ("cuda", "thread", "inline")


@dataclass
class InflightStep:
    """A launched step whose tokens the host has not read yet (AsyncStepper.inflight); the
    next step's ModelRunner.prepare reads it as its `previous` (interfaces.StepInFlight).

    plan: its SchedulerOutput; batch: its Batch on the device (None: swaps only);
    sampling: the requests with a sampled row, in row order; row_of: request id -> its row
    in `tokens`; tokens: int64 [len(sampling)] on the device once sampled (0 in the row of
    a request that was not sampled); handle: what DeviceQueue.wait needs to read them;
    output: the ModelOutput its forward left (EngineCore.execute_model); sampled: the
    host's SampledTokens, when the host sampled it (AsyncStepper.sample_on_host)."""
    plan: SchedulerOutput
    batch: Batch | None
    sampling: list[Request]
    row_of: dict[str, int]
    tokens: torch.Tensor | None = None
    handle: Future[torch.Tensor | None] | tuple[torch.Tensor, torch.cuda.Event] | None = None
    launched_at: float = field(default_factory=time.perf_counter)
    output: ModelOutput | None = None
    sampled: SampledTokens | None = None


class DeviceQueue:
    """Runs each step's device part in order and gives back its sampled tokens on the host."""

    def __init__(self, mode: str) -> None:
        if mode not in QUEUE_MODES:
            raise ValueError(f"device queue mode must be one of {QUEUE_MODES}, got {mode!r}")
        if mode == "cuda" and not torch.cuda.is_available():
            raise ValueError("the 'cuda' device queue needs a CUDA device")
        self.mode = mode
        self.worker = ThreadPoolExecutor(1, thread_name_prefix="device-queue") if mode == "thread" else None

    def submit(self, step: InflightStep, work: Callable[[], torch.Tensor | None]) -> None:
        """Queue `work` behind every earlier step; it returns the step's sampled tokens, or
        None when the host samples them afterwards (AsyncStepper.sample_on_host)."""
        def run() -> torch.Tensor | None:
            step.tokens = work()
            return step.tokens
        if self.worker is not None:
            step.handle = self.worker.submit(run)
            return
        tokens = run()
        if self.mode == "cuda" and tokens is not None:
            host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            host.copy_(tokens, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
            step.handle = (host, done)

    def ran(self, step: InflightStep) -> None:
        """Block until `step`'s device part has run on the worker thread (its output exists)."""
        if isinstance(step.handle, Future):
            step.handle.result()

    def wait(self, step: InflightStep) -> list[int]:
        """Block until `step`'s tokens exist; return them as Python ints (the one host read)."""
        self.ran(step)
        if isinstance(step.handle, tuple):
            host, done = step.handle
            done.synchronize()
            return host.tolist()
        assert step.tokens is not None
        return step.tokens.tolist()

    def close(self) -> None:
        if self.worker is not None:
            self.worker.shutdown(wait=True)


def settle_token(request: Request, token: int, check_stop: Callable[[Request, int], Status | None]) -> Status | None:
    """Write a late-arriving sampled token over the request's oldest placeholder and apply
    the stop rules to it.  (Your engine: Chapter 33)

    request: a running request with num_placeholders >= 1 trailing PLACEHOLDER entries in
    request.token_ids (the newest tokens, still being computed); token: the real id of the
    OLDEST of them; check_stop(request, index) -> Status | None is EngineCore.check_stop
    (the stop rules of the token at `index`).
    Afterwards the token sits at index i = num_tokens - num_placeholders (counted before
    the call) and num_placeholders is one less. Returns check_stop's answer for index i;
    when it is a finish status, every entry after index i is removed and num_placeholders
    is 0 (tokens computed past a stop are not output). Raises RuntimeError, changing
    nothing, when the request has no placeholder there (a token settled twice); its message
    names the request and says "placeholder".
    Trap: the stop rules must see the token at i, not the newest entry of the list (a
    placeholder when the request was scheduled again before this token was known).
    """
    raise NotImplementedError("Your engine: Chapter 33: settle_token")


def drop_placeholders(request: Request) -> None:
    """Remove a finished request's trailing placeholders: tokens nobody will read."""
    if request.num_placeholders:
        del request.token_ids[request.num_tokens - request.num_placeholders:]
        request.num_placeholders = 0


def known_output(request: Request) -> list[int]:
    """The output tokens whose values are known (placeholders excluded)."""
    return request.token_ids[request.num_prompt_tokens:request.num_tokens - request.num_placeholders]


def sample_on_device(logits: torch.Tensor, requests: list[Request], generators: dict[str, torch.Generator],
                     default: torch.Generator | None) -> torch.Tensor:
    """SimpleSampler's choices as an int64 device tensor [L], without reading anything back:
    greedy rows by one argmax, the others through Chapter 8's `sample` with the same
    generators in the same order, so the draws equal the synchronous engine's."""
    tokens = logits.argmax(dim=-1)
    for row, request in enumerate(requests):
        p = request.params
        if not p.greedy:
            generator = generators.get(request.request_id, default)
            tokens[row] = sample(logits[row:row + 1], temperature=p.temperature, top_k=p.top_k, top_p=p.top_p,
                                 min_p=p.min_p, generator=generator)[0]
    return tokens


class AsyncStepper(StepUpdate):
    """EngineCore.step when EngineConfig.async_scheduling is on (see the module docstring).

    It calls the engine's own parts (schedule, runner.prepare, execute_model, sample_tokens,
    record_prompt_logprobs, update) and owns only what is its own: the step in flight, the
    placeholders, the device queue. It extends Chapter 31's update through its hooks: rows
    are counted when a step is launched (advance does nothing when its tokens arrive), a
    token is written over its placeholder (commit), and outputs list only known tokens (report)."""

    doing = "settling its token"

    def __init__(self, engine: EngineCore, mode: str | None = None) -> None:
        self.engine = engine
        # Chapter 31's SimpleSampler is redone on the device, drawing from its generator;
        # any other sampler runs on the host once the step before is applied (sample_on_host).
        sampler = engine.sampler
        self.device_sampler = sampler if type(sampler) is SimpleSampler else None
        self.queue = DeviceQueue(mode or ("cuda" if engine.device.type == "cuda" else "inline"))
        self.inflight: InflightStep | None = None      # the launched, unread step
        self.host_seconds = 0.0           # time spent scheduling and building batches
        self.wait_seconds = 0.0           # time spent waiting for tokens

    def step(self) -> list[RequestOutput]:
        """One call of the asynchronous engine: launch the next step, then apply the one in
        flight.  (Your engine: Chapter 33)

        The parts, each named once: self.schedule() plans step t+1; self.wait_for_tokens(plan)
        must come before that plan is prepared (it waits only where the thread queue has not
        made step t's tokens yet); self.launch(plan) prepares step t+1 (previous = the step in
        flight) and queues its device part; self.settle(step) waits for a launched step's
        tokens and applies them, returning the outputs; self.sample_on_host(step) samples a
        launched step on the host; self.count_launched(step) counts its rows and appends its
        placeholders. self.inflight is the launched step not yet settled (None: none).
        Ordering guarantees:
          * overlap: step t+1 is launched BEFORE the host waits for step t's tokens, so the
            device always has work queued while the host settles;
          * a plan is launched when it schedules rows or swaps; only a plan with scheduled
            rows becomes the step in flight (a swaps-only plan samples nothing);
          * every launched step in flight is settled exactly once, in the next call; the
            last call (nothing left to schedule) only settles;
          * with a host sampler (self.device_sampler is None), step t+1 is sampled after step
            t is settled and before step t+1's placeholders are appended, so the sampler
            sees the synchronous engine's histories;
          * count_launched comes last: the next call's schedule sees step t+1's rows as
            computed and its placeholders in the token lists.
        Returns the RequestOutputs of the step settled in this call ([] on the first call).
        """
        raise NotImplementedError("Your engine: Chapter 33: AsyncStepper.step")

    def schedule(self) -> SchedulerOutput:
        """Plan the next step (EngineCore.schedule), counting its time as host work."""
        started = time.perf_counter()
        plan = self.engine.schedule()
        self.host_seconds += time.perf_counter() - started
        return plan

    def wait_for_tokens(self, plan: SchedulerOutput) -> None:
        """Call before `plan` is prepared. The thread queue's price: the step in flight's tokens
        are made on the worker thread, and the plan's placeholder inputs are filled from them
        when it is prepared, so when the plan has any and they are not made yet, the host
        waits for that step's device part first (counted as waiting). Otherwise a no-op."""
        step = self.inflight
        if step is None or step.tokens is not None or not any(r.num_placeholders for r, _ in plan.scheduled):
            return
        waited = time.perf_counter()
        self.queue.ran(step)
        self.wait_seconds += time.perf_counter() - waited

    def launch(self, plan: SchedulerOutput) -> InflightStep:
        """Prepare the plan's batch (ModelRunner.prepare fills its placeholder inputs from the
        step in flight's tokens, on the device) and queue its device part behind the step in
        flight: swaps and forward (EngineCore.execute_model), and with SimpleSampler the
        sampling too. Its time counts as host work."""
        started = time.perf_counter()
        engine, runner = self.engine, self.engine.runner
        scheduled = plan.scheduled
        batch = runner.prepare(scheduled, plan.block_tables, previous=self.inflight) if scheduled else None
        counts = batch.sample_counts if batch is not None else []
        sampling = [r for (r, _), k in zip(scheduled, counts) if k]
        step = InflightStep(plan, batch, sampling, {r.request_id: i for i, r in enumerate(sampling)})
        # Seeded requests' generators as they are now: a request may finish (and its
        # generator go) before a worker thread samples this step.
        generators = {r.request_id: engine.generators[r.request_id] for r in sampling
                      if r.request_id in engine.generators}
        device_sampler = self.device_sampler

        def device_part() -> torch.Tensor | None:
            step.output = engine.execute_model(plan, batch)
            if step.output is None or device_sampler is None:
                return None
            if not sampling:
                return torch.empty(0, dtype=torch.int64, device=runner.device)
            return sample_on_device(step.output.logits, sampling, generators, device_sampler.generator)

        self.queue.submit(step, device_part)
        self.host_seconds += time.perf_counter() - started
        return step

    def sample_on_host(self, step: InflightStep) -> None:
        """Once the step before is applied, sample `step` with the engine's own
        sampler (EngineCore.sample_tokens) from the logits its forward left; its tokens go
        to the device, where the next step's placeholders are filled from them."""
        self.queue.ran(step)
        assert step.output is not None and step.batch is not None
        step.sampled = self.engine.sample_tokens(step.plan, step.batch, step.output.logits)
        chosen = [step.sampled.tokens[r.request_id][0] if r.request_id in step.sampled.tokens else 0
                  for r in step.sampling]
        step.tokens = to_device(torch.tensor(chosen, dtype=torch.int64), self.engine.runner.device)

    def count_launched(self, step: InflightStep) -> None:
        """Advance the launched step's requests as if their tokens were known: their rows
        count as computed, each sampled request gets a placeholder, full blocks are
        published. A request that finished meanwhile is left as it is."""
        publish = self.engine.scheduler.publish_computed
        for request, n in step.plan.scheduled:
            if not request.status.finished:
                request.num_computed_tokens += n
        for request in step.sampling:
            if not request.status.finished:
                request.token_ids.append(PLACEHOLDER)
                request.num_placeholders += 1
        for request, _ in step.plan.scheduled:
            if not request.status.finished:
                publish(request)

    def settle(self, step: InflightStep) -> list[RequestOutput]:
        """Wait for a launched step's tokens and apply them through the engine's update."""
        engine = self.engine
        waited = time.perf_counter()
        sampled = step.sampled
        if sampled is None:
            tokens = self.queue.wait(step)
            sampled = SampledTokens({r.request_id: [token] for r, token in zip(step.sampling, tokens)})
        self.wait_seconds += time.perf_counter() - waited
        if step.batch is not None and step.output is not None:
            engine.record_prompt_logprobs(step.batch, step.output.prompt_rows)
        return engine.update(step.plan, sampled)

    # --- the update's hooks -------------------------------------------------------------------

    def advance(self, request: Request, n: int) -> None:
        """Nothing: the rows were counted at launch (the next step was planned on them)."""

    def commit(self, request: Request, tokens: list[int], stop: StopRule) -> tuple[list[int], Status | None]:
        (token,) = tokens
        return [int(token)], settle_token(request, token, stop)

    def report(self, request: Request, output: RequestOutput) -> RequestOutput:
        """The output lists only known tokens: a placeholder's value is not read yet."""
        return replace(output, output_token_ids=known_output(request))
