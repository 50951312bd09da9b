"""Chapter 38: the one thread that owns the engine, and the door in front of it.

EngineCore is not thread-safe and does not need to be: exactly one thread, the engine
loop, ever calls it. HTTP handlers run on asyncio's event loop in another thread; they
talk to the engine loop through two one-way channels:

    handler --(inbox: ("add", Submission, None) | ("abort", Submission, id))--> engine loop
    engine loop --(Submission.deliver(item), thread-safe)--> the handler's asyncio.Queue

The loop drains the inbox before every step, so an abort (a client that hung up) takes
effect before the next forward pass: the request's blocks are back in the pool within
one step. Between steps it publishes a snapshot of counters that /metrics and /health
read without touching the engine.

AdmissionControl is the bounded queue in front: the server holds at most
max_running + max_waiting requests; past that it answers 429 at once instead of letting
latency grow without bound for everyone.
"""
from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, TypedDict

from ..serve.request import RequestOutput, SamplingParams

if TYPE_CHECKING:
    from ..serve.engine import EngineCore

logger = logging.getLogger(__name__)

ACCEPTED = "accepted"          # delivered once add_request has taken a submission

# What the engine thread hands a submission: ACCEPTED once, then outputs, or one Exception
# (a ValueError: the engine refused the client's input; a RequestFailed: the server failed).
Delivery = str | RequestOutput | Exception


class RequestFailed(Exception):
    """The server, not the client, failed one request (an HTTP 500 for that request alone)."""


@dataclass
class Submission:
    """One HTTP request on its way to the engine.

    request_id is what the engine gets; with params.n > 1 the engine names the samples
    "<request_id>:0" .. ":<n-1>" (engine_ids). deliver(item) must be safe to call from the
    engine thread: it receives ACCEPTED, then RequestOutputs, or one Exception."""
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    deliver: Callable[[Delivery], None]
    engine_ids: list[str] = field(default_factory=list)
    arrival: float = field(default_factory=time.monotonic)
    lora: str | None = None             # the LoRA adapter asked for by name (Chapter 43)

    def __post_init__(self) -> None:
        n = self.params.n
        self.engine_ids = [self.request_id] if n == 1 else [f"{self.request_id}:{i}" for i in range(n)]


class EngineSnapshot(TypedDict):
    """The engine's counters after an iteration, for /metrics and /health."""
    running: int
    waiting: int
    blocks_total: int
    blocks_in_use: int
    prefix_hit_rate: float
    preemptions: int
    steps: int
    max_model_len: int
    alive: bool


class EngineLoop:
    """Runs `engine` (an EngineCore) on a thread of its own.

    submit/abort may be called from any thread; they only write to the inbox. The engine's
    state is read elsewhere only through `snapshot` (a new dict after every iteration)."""

    def __init__(self, engine: EngineCore, idle_wait_s: float = 0.5) -> None:
        self.engine = engine
        # ("add", submission, None) or ("abort", submission, engine id)
        self.inbox: queue.SimpleQueue[tuple[str, Submission, str | None]] = queue.SimpleQueue()
        self.routes: dict[str, Submission] = {}      # engine request id -> its submission
        self.wake = threading.Event()
        self.idle_wait_s = idle_wait_s
        self.stopping = False
        self.error: BaseException | None = None
        self.failing = threading.Lock()     # orders "the loop died" against late submissions
        self.thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.snapshot: EngineSnapshot
        self._publish()

    # --- called from handlers ---------------------------------------------------------------

    def start(self) -> "EngineLoop":
        self.thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self.stopping = True
        self.wake.set()
        if self.thread.is_alive():
            self.thread.join(timeout)

    def submit(self, submission: Submission) -> None:
        with self.failing:
            if self.error is not None:     # nobody would ever answer it
                submission.deliver(RequestFailed(f"the engine loop stopped: {self.error!r}"))
                return
            self.inbox.put(("add", submission, None))
        self.wake.set()

    def abort(self, submission: Submission, engine_id: str | None = None) -> None:
        """Abort the whole submission, or (engine_id) one sample of an n > 1 group."""
        self.inbox.put(("abort", submission, engine_id or submission.request_id))
        self.wake.set()

    @property
    def alive(self) -> bool:
        return self.thread.is_alive() and self.error is None

    # --- the engine thread ------------------------------------------------------------------

    def run_once(self) -> bool:
        """One turn of the engine loop: apply the inbox, take one step, hand out the outputs.
        (Your engine: Chapter 38)

        Engine thread only. Returns True when a step ran or was tried, False when the engine
        had nothing to do. Contract:
        - Every ("add", s, None) and ("abort", s, engine_id) in self.inbox is applied, in
          arrival order, before the step: a request aborted during step k never runs in k+1.
        - An admitted s has every id of s.engine_ids in self.routes and hears ACCEPTED before
          any output; a refused one (any exception) ends through self.fail and holds nothing.
        - Each output reaches the submission its id routes to; unrouted ids are dropped; an
          output with an `error` fails its submission; a finished id leaves self.routes.
        - Isolation: a failure costs one submission (self.fail), or, for a step that raises
          as a whole, the step's submissions (self.fail_step); run_once never raises for a
          request's sake.
        Trap: a submission's deliver may raise; deliver only through self.hand.
        """
        while True:
            try:
                kind, submission, engine_id = self.inbox.get_nowait()
            except queue.Empty:
                break
            if kind == "abort":
                assert engine_id is not None        # abort() always names the id to abort
                self.drop(submission, engine_id)
                continue
            try:
                self.engine.add_request(submission.request_id, submission.prompt_ids, submission.params,
                                        lora=submission.lora)
            except Exception as exc:
                self.fail(submission, exc)
                continue
            for routed in submission.engine_ids:
                self.routes[routed] = submission
            self.hand(submission, ACCEPTED)
        if not self.engine.has_unfinished:
            return False
        try:
            outputs = self.engine.step()
        except Exception as exc:
            self.fail_step(exc)
            return True
        for output in outputs:
            owner = self.routes.get(output.request_id)
            if owner is None:
                continue
            if output.error is not None:
                self.fail(owner, RequestFailed(output.error))
                continue
            self.hand(owner, output)
            if output.finished:
                self.routes.pop(output.request_id, None)
        return True

    # --- what run_once leans on: each costs one submission at most, and never raises --------

    def hand(self, submission: Submission, item: Delivery) -> None:
        """Deliver `item` to `submission`; a deliver that raises ends that submission alone."""
        try:
            submission.deliver(item)
        except Exception:
            logger.exception("delivering to request %r failed; it is aborted", submission.request_id)
            self.drop(submission, submission.request_id)

    def drop(self, submission: Submission, engine_id: str) -> None:
        """Abort `engine_id` (the whole submission when it is submission.request_id, else one
        sample) in the engine and forget its routes: nothing more is delivered for it."""
        whole = engine_id == submission.request_id
        for gone in (submission.engine_ids if whole else [engine_id]):
            self.routes.pop(gone, None)
        try:
            self.engine.abort_request(engine_id)
        except Exception:
            logger.exception("aborting %r failed", engine_id)

    def fail(self, submission: Submission, exc: Exception) -> None:
        """End `submission` with an error: a ValueError as is (the client's input: a 400),
        anything else as RequestFailed (the server's fault: a 500). Whatever of it the engine
        still runs is aborted first."""
        if any(self.routes.get(engine_id) is submission for engine_id in submission.engine_ids):
            self.drop(submission, submission.request_id)
        if not isinstance(exc, (ValueError, RequestFailed)):
            logger.error("request %r failed", submission.request_id, exc_info=exc)
            exc = RequestFailed(f"request {submission.request_id!r} failed: {type(exc).__name__}: {exc}")
        try:
            submission.deliver(exc)
        except Exception:
            logger.exception("telling request %r of its failure failed", submission.request_id)

    def fail_step(self, exc: Exception) -> None:
        """A step raised with no one request to blame: every routed submission fails with it.
        The engine must come out whole (nothing unfinished, every block free); if it does
        not, it cannot be trusted with more requests and the error is raised again, which
        stops the loop (/health then answers 503 and names it)."""
        logger.error("an engine step failed", exc_info=exc)
        failure = RequestFailed(f"the engine step failed: {type(exc).__name__}: {exc}")
        submissions = list({id(s): s for s in self.routes.values()}.values())
        for submission in submissions:
            self.drop(submission, submission.request_id)
        blocks = self.engine.blocks
        broken = None
        if self.engine.has_unfinished or blocks.num_free != blocks.num_blocks:
            broken = RuntimeError(f"the engine did not recover from a failed step ({blocks.num_free} of "
                                  f"{blocks.num_blocks} blocks free after aborting every request)")
            broken.__cause__ = exc
            with self.failing:             # before any client hears of the failure, /health knows
                self.error = broken
        for submission in submissions:
            self.fail(submission, failure)
        if broken is not None:
            raise broken

    def _run(self) -> None:
        try:
            while not self.stopping:
                self.wake.clear()          # a submit after this line wakes the wait below at once
                busy = self.run_once()
                self._publish()
                if not busy:
                    self.wake.wait(self.idle_wait_s)
        except BaseException as exc:       # a broken engine must fail its requests, not hang them
            traceback.print_exc()
            with self.failing:
                self.error = exc
                waiting = [item[1] for item in self._drain() if item[0] == "add"]
            failure = RequestFailed(f"the engine loop stopped: {exc!r}")
            for submission in {id(s): s for s in [*self.routes.values(), *waiting]}.values():
                with contextlib.suppress(Exception):
                    submission.deliver(failure)
            self.routes.clear()
            self._publish()

    def _drain(self) -> list[tuple[str, Submission, str | None]]:
        items = []
        while True:
            try:
                items.append(self.inbox.get_nowait())
            except queue.Empty:
                return items

    def _publish(self) -> None:
        engine, blocks = self.engine, self.engine.blocks
        self.snapshot = {"running": len(engine.scheduler.running), "waiting": len(engine.scheduler.waiting),
                         "blocks_total": blocks.num_blocks, "blocks_in_use": blocks.num_blocks - blocks.num_free,
                         "prefix_hit_rate": blocks.hit_rate, "preemptions": engine.preemptions,
                         "steps": engine.steps, "max_model_len": engine.max_model_len, "alive": self.alive}


class QueueFull(Exception):
    """The server holds as many requests as it may; the client should retry later."""


class AdmissionControl:
    """A bounded door: at most max_running + max_waiting requests (samples: n counts n)
    inside the server at once. Used from the event loop's thread only, so no lock."""

    def __init__(self, max_running: int, max_waiting: int) -> None:
        if max_running < 1 or max_waiting < 0:
            raise ValueError(f"AdmissionControl needs max_running >= 1 and max_waiting >= 0, "
                             f"got {max_running} and {max_waiting}")
        self.capacity = max_running + max_waiting
        self.inside = 0

    def try_admit(self, count: int) -> None:
        """Let `count` more samples in, or refuse.  (Your engine: Chapter 38)

        count: the request's n (int >= 1). Errors, each leaving self.inside unchanged:
        ValueError when count exceeds self.capacity (never servable: a 400); QueueFull when
        the server has no room for count more now (a 429). Otherwise self.inside grows by
        count. Invariant: 0 <= self.inside <= self.capacity, and each admitted count is
        released exactly once, however its request ends.
        """
        if count > self.capacity:
            raise ValueError(f"n={count} exceeds the {self.capacity} requests this server holds at once")
        if self.inside + count > self.capacity:
            raise QueueFull(f"the server holds {self.inside} of {self.capacity} requests")
        self.inside += count

    def release(self, count: int) -> None:
        self.inside -= count


__all__ = ["ACCEPTED", "Delivery", "RequestFailed", "Submission", "EngineSnapshot", "EngineLoop", "QueueFull",
           "AdmissionControl"]
