"""Chapter 33: asynchronous scheduling, the host plans step t+1 while the device runs step t.

The synchronous step is a relay: the host schedules and builds a batch while the device
waits, then the device computes while the host waits for the sampled tokens. Each engine
call of this module does, in this order:

    1. schedule step t+1; a request whose token from step t is not read back yet holds a
       PLACEHOLDER in its token list (num_placeholders counts them), so the scheduler sees
       the right lengths and gives it its next decode;
    2. build step t+1's batch on the host and hand its device part (swaps, placeholder
       inputs filled from step t's sampled tokens, forward, sampling) to the device queue,
       behind step t: the device never waits for the host;
    3. only now wait for step t's tokens and hand them to EngineCore.update, whose hooks
       this stepper extends: each token is written over its placeholder, the stop rules
       apply to it, and the outputs are made there, as for a synchronous step.

So step t's device work overlaps step t+1's host work. The cost: a request that stops at
step t (an EOS nobody knew about yet) has already been given a row in step t+1, computed
for nothing and thrown away; max_tokens is known in advance, so the scheduler never gives
a request a row past its last token (its last token is "in flight").

Sampling. Chapter 31's SimpleSampler is redone on the device (`sample_on_device`): nothing is
read back until step 3. Any other sampler (Chapter 34's full sampler, a custom one) reads
the requests' token lists (penalties, bad words, min_tokens), so it runs inside the device
part, after step t's tokens exist, on copies of the requests whose placeholder holds step
t's token (`settled_view`): it sees exactly what the synchronous engine shows it. With the
"thread" queue that still overlaps; with "cuda" the host thread reads step t's tokens
before sampling step t+1, which costs the overlap but not the outputs. Guided decoding is
refused (EngineCore.add_request): its mask for step t+1 must be built from a guide advanced
by step t's token, on the host, before the step can be launched.

The device queue keeps the device part of each step in order:
    "cuda"    runs it on the host thread, which only enqueues kernels on the current stream,
              and copies the sampled tokens to pinned host memory behind an event;
    "thread"  one worker thread runs the steps one after another (CPU: real overlap when
              the forward pass releases the GIL, as torch's kernels do);
    "inline"  runs it at once (CPU default): the same code path, no overlap.
"""
from __future__ import annotations

import copy
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch

from ..sampling import sample
from .batch import build_batch
from .request import PLACEHOLDER, Request, RequestOutput, Status
from .sampler import SimpleSampler
from .update import SampledTokens, StepUpdate

if TYPE_CHECKING:
    from .batch import Batch
    from .engine import EngineCore
    from .scheduler import SchedulerOutput

QUEUE_MODES = ("cuda", "thread", "inline")


@dataclass
class InflightStep:
    """A launched step whose tokens the host has not read yet (EngineCore.inflight).

    plan: its SchedulerOutput; sampling: the requests with a sampled row, in row order;
    row_of: request id -> its row in `tokens`; tokens: int64 [len(sampling)] on the device
    once the device part ran; handle: what DeviceQueue.wait needs to read them.
    With a sampler other than SimpleSampler the device part also leaves logprobs and
    failed (by request id, as EngineCore._sample returns them) and, when the batch has
    prompt-logprob rows (Chapter 34), batch and prompt_rows (their logits)."""
    plan: SchedulerOutput
    sampling: list[Request]
    row_of: dict[str, int]
    tokens: torch.Tensor | None = None
    handle: Any = None
    launched_at: float = field(default_factory=time.perf_counter)
    logprobs: dict[str, Any] = field(default_factory=dict)
    failed: dict[str, Exception] = field(default_factory=dict)
    batch: Batch | None = None
    prompt_rows: torch.Tensor | None = None


class DeviceQueue:
    """Runs each step's device part in order and gives back its sampled tokens on the host."""

    def __init__(self, mode: str) -> None:
        if mode not in QUEUE_MODES:
            raise ValueError(f"device queue mode must be one of {QUEUE_MODES}, got {mode!r}")
        if mode == "cuda" and not torch.cuda.is_available():
            raise ValueError("the 'cuda' device queue needs a CUDA device")
        self.mode = mode
        self.worker = ThreadPoolExecutor(1, thread_name_prefix="device-queue") if mode == "thread" else None

    def submit(self, step: InflightStep, work: Callable[[], torch.Tensor]) -> None:
        """Queue `work` (returns the step's sampled tokens) behind every earlier step."""
        def run() -> torch.Tensor:
            step.tokens = work()
            return step.tokens
        if self.worker is not None:
            step.handle = self.worker.submit(run)
            return
        tokens = run()
        if self.mode == "cuda":
            host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            host.copy_(tokens, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
            step.handle = (host, done)

    def wait(self, step: InflightStep) -> list[int]:
        """Block until `step`'s tokens exist; return them as Python ints (the one host read)."""
        if isinstance(step.handle, Future):
            return step.handle.result().tolist()
        if self.mode == "cuda":
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
    index = request.num_tokens - request.num_placeholders
    if request.num_placeholders < 1 or request.token_ids[index] != PLACEHOLDER:
        raise RuntimeError(f"request {request.request_id!r}: no placeholder at position {index} to settle")
    request.token_ids[index] = int(token)
    request.num_placeholders -= 1
    reason = check_stop(request, index)
    if reason is not None:
        drop_placeholders(request)
    return reason


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


def settled_view(request: Request, length: int, row: int | None, previous_tokens: Callable[[], list[int]]) -> Request:
    """A shallow copy of `request` as the synchronous engine would hand it to its sampler:
    its first `length` tokens (its length when the step was launched), the trailing
    placeholder replaced by the previous step's token for it (row `row` of
    previous_tokens(), which reads them only when asked). The copy owns its token list, so
    the host may settle or extend the request's own list meanwhile."""
    view = copy.copy(request)
    view.token_ids = request.token_ids[:length]          # one slice: atomic beside the host thread
    view.num_placeholders = 0
    if view.token_ids and view.token_ids[-1] == PLACEHOLDER:
        if row is None:
            raise RuntimeError(f"request {request.request_id!r}: a placeholder with no step in flight to fill it")
        view.token_ids[-1] = previous_tokens()[row]
    return view


def move(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without making the host wait: on CUDA through pinned memory
    (a copy from pageable memory waits for every kernel already queued: no overlap left)."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def upload(batch: Batch, device: torch.device) -> Batch:
    """A batch built on the host, moved to `device` with `move`."""
    meta = replace(batch.meta, query_start_loc=move(batch.meta.query_start_loc, device),
                   seq_lens=move(batch.meta.seq_lens, device), block_table=move(batch.meta.block_table, device),
                   slot_mapping=move(batch.meta.slot_mapping, device))
    return replace(batch, input_ids=move(batch.input_ids, device), positions=move(batch.positions, device), meta=meta,
                   logits_indices=move(batch.logits_indices, device))


class AsyncStepper(StepUpdate):
    """EngineCore.step when EngineConfig.async_scheduling is on (see the module docstring).

    It extends Chapter 31's update through its hooks: rows are counted when a step is
    launched (advance does nothing when its tokens arrive), a token is written over its
    placeholder (commit), and outputs list only known tokens (report)."""

    doing = "settling its token"

    def __init__(self, engine: EngineCore, mode: str | None = None) -> None:
        self.engine = engine
        # Chapter 31's SimpleSampler is redone on the device, drawing from its generator;
        # any other sampler runs on settled views.
        sampler = engine.sampler
        self.device_sampler = sampler if type(sampler) is SimpleSampler else None
        self.queue = DeviceQueue(mode or ("cuda" if engine.device.type == "cuda" else "inline"))
        self.host_seconds = 0.0           # time spent scheduling and building batches
        self.wait_seconds = 0.0           # time spent waiting for tokens

    def step(self) -> list[RequestOutput]:
        engine = self.engine
        started = time.perf_counter()
        plan = engine.last_plan = engine.scheduler.schedule()
        if engine.checks is not None:
            engine.checks.check_plan(plan, engine.scheduler, f"async engine step {engine.steps}, the plan")
        engine.preemptions += len(plan.preempted)
        launched = self.launch(plan, engine.inflight) if plan.scheduled or plan.swap_out or plan.swap_in else None
        self.host_seconds += time.perf_counter() - started
        outputs = self.settle(engine.inflight) if engine.inflight is not None else []
        engine.inflight = launched if launched is not None and launched.plan.scheduled else None
        if engine.checks is not None:
            engine.checks.check_scheduler(engine.scheduler, f"after async engine step {engine.steps}")
        return outputs

    def launch(self, plan: SchedulerOutput, previous: InflightStep | None) -> InflightStep:
        """Build the plan's batch, queue its device part, and advance the requests as if
        their tokens were known: num_computed_tokens moves on, sampled rows become
        placeholders."""
        engine, runner = self.engine, self.engine.runner
        scheduled = plan.scheduled
        batch = None
        fill_rows: list[int] = []          # rows whose input is a placeholder
        fill_from: list[int] = []          # ... and the row of `previous.tokens` that holds its value
        if scheduled:
            pad_to = runner.graphs.pad_size(scheduled) if runner.graphs is not None else None
            batch = build_batch(scheduled, plan.block_tables, runner.block_size, "cpu", pad_to)
            runner.add_step_inputs(batch, scheduled)
            for (request, n), start in zip(scheduled, batch.meta.query_start_loc_cpu):
                for offset in range(n):
                    if request.token_ids[request.num_computed_tokens + offset] == PLACEHOLDER:
                        if previous is None or request.request_id not in previous.row_of:
                            raise RuntimeError(f"request {request.request_id!r}: a placeholder input with no "
                                               f"step in flight to fill it")
                        fill_rows.append(start + offset)
                        fill_from.append(previous.row_of[request.request_id])
            batch = upload(batch, runner.device)
        fill_index = [move(torch.tensor(x, dtype=torch.int64), runner.device) for x in (fill_rows, fill_from)]
        counts = {r.request_id: k for (r, _), k in zip(scheduled, batch.sample_counts if batch else []) if k}
        sampling = [r for r, _ in scheduled if r.request_id in counts]
        lengths = [r.num_tokens for r in sampling]       # before this step's placeholders are appended
        step = InflightStep(plan, sampling, {r.request_id: i for i, r in enumerate(sampling)})
        generators = {r.request_id: engine.generators[r.request_id] for r in sampling
                      if r.request_id in engine.generators}
        device = runner.device

        def device_part() -> torch.Tensor:
            for victim, old_blocks in plan.swap_out:
                runner.swap_out(victim, old_blocks)
            for resumed, new_blocks in plan.swap_in:
                runner.swap_in(resumed, new_blocks)
            if batch is None:
                return torch.empty(0, dtype=torch.int64, device=device)
            if fill_rows:
                assert previous is not None and previous.tokens is not None
                batch.input_ids[fill_index[0]] = previous.tokens[fill_index[1]]
            logits = runner.execute(batch)
            if batch.prompt_spans:             # prompt-logprob rows follow the sampling rows (Chapter 34)
                step.batch, step.prompt_rows = batch, logits[batch.num_sample_rows:]
                logits = logits[:batch.num_sample_rows]
            if not sampling:
                return torch.empty(0, dtype=torch.int64, device=device)
            if self.device_sampler is not None:
                return sample_on_device(logits, sampling, generators, self.device_sampler.generator)
            return self.sample_views(step, logits, previous, lengths, counts, generators)

        self.queue.submit(step, device_part)
        for request, n in scheduled:
            request.num_computed_tokens += n
        for request in sampling:
            request.token_ids.append(PLACEHOLDER)
            request.num_placeholders += 1
        for request, _ in scheduled:
            engine.scheduler.publish_computed(request)
        return step

    def sample_views(self, step: InflightStep, logits: torch.Tensor, previous: InflightStep | None,
                     lengths: list[int], counts: dict[str, int], generators: dict[str, torch.Generator]
                     ) -> torch.Tensor:
        """The engine's own sampler (EngineCore._sample: its isolation of failing requests
        included) on settled views of the step's requests; leaves logprobs and failures on
        `step` and returns the tokens as an int64 device tensor (0 for a failed request,
        whose next row is thrown away)."""
        known: list[list[int]] = []

        def previous_tokens() -> list[int]:        # read step t's tokens once, and only if a view needs them
            if not known:
                assert previous is not None and previous.tokens is not None
                known.append(previous.tokens.tolist())
            return known[0]

        row_of = previous.row_of if previous is not None else {}
        views = [settled_view(r, n, row_of.get(r.request_id), previous_tokens) for r, n in zip(step.sampling, lengths)]
        sampled = self.engine._sample(logits, views, counts, generators)
        step.logprobs, step.failed = sampled.logprobs, sampled.failed
        chosen = [sampled.tokens[r.request_id][0] if r.request_id in sampled.tokens else 0 for r in step.sampling]
        return torch.tensor(chosen, dtype=torch.int64, device=logits.device)

    def settle(self, step: InflightStep) -> list[RequestOutput]:
        """Wait for a launched step's tokens and apply them through the engine's update."""
        engine = self.engine
        waited = time.perf_counter()
        tokens = self.queue.wait(step)
        self.wait_seconds += time.perf_counter() - waited
        if step.prompt_rows is not None and step.batch is not None:
            engine._record_prompt_logprobs(step.batch, step.prompt_rows)
        sampled = SampledTokens({r.request_id: [token] for r, token in zip(step.sampling, tokens)},
                                step.logprobs, step.failed)
        return engine.update(step.plan, sampled)

    # --- the update's hooks -------------------------------------------------------------------

    def advance(self, engine: EngineCore, request: Request, n: int) -> None:
        """Nothing: launch counted the rows (the next step was planned on them)."""

    def commit(self, engine: EngineCore, request: Request, tokens: list[int]) -> tuple[list[int], Status | None]:
        (token,) = tokens
        return [int(token)], settle_token(request, token, engine.check_stop)

    def report(self, engine: EngineCore, request: Request, kept: list[int], logprobs: Any) -> RequestOutput:
        """The output lists only known tokens: a placeholder's value is not read yet."""
        return replace(engine.make_output(request, kept, logprobs), output_token_ids=known_output(request))
