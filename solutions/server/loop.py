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

import queue
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, TypedDict

from ..serve.request import RequestOutput, SamplingParams

if TYPE_CHECKING:
    from ..serve.engine import EngineCore

ACCEPTED = "accepted"          # delivered once add_request has taken a submission

# What the engine thread hands a submission: ACCEPTED once, then outputs, or one Exception.
Delivery = str | RequestOutput | Exception


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
                submission.deliver(RuntimeError(f"the engine loop stopped: {self.error!r}"))
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

        Runs on the engine thread only. Returns True when a step ran, False when the engine
        had nothing to do (the caller then sleeps until woken). Contract:
        - Every ("add", s, None) and ("abort", s, engine_id) waiting in self.inbox is
          applied, in arrival order, BEFORE the step, so a request aborted during step k
          never runs in step k+1.
        - add: self.engine.add_request(s.request_id, s.prompt_ids, s.params, lora=s.lora). A ValueError is
          delivered to that submission (s.deliver(exc)) and nothing else happens; on success
          every id in s.engine_ids routes to s (self.routes) and s.deliver(ACCEPTED).
        - abort: self.engine.abort_request(engine_id). engine_id is s.request_id (the whole
          submission; a group id aborts every sample) or one of s.engine_ids (one sample).
          The aborted ids leave self.routes: nothing more is delivered for them.
        - Then, if the engine has unfinished requests, one self.engine.step(); each
          RequestOutput goes to the submission its request id routes to, and a finished
          request's route is removed after its last delivery.
        """
        while True:
            try:
                kind, submission, engine_id = self.inbox.get_nowait()
            except queue.Empty:
                break
            if kind == "add":
                try:
                    self.engine.add_request(submission.request_id, submission.prompt_ids, submission.params,
                                            lora=submission.lora)
                except ValueError as exc:
                    submission.deliver(exc)
                    continue
                for routed in submission.engine_ids:
                    self.routes[routed] = submission
                submission.deliver(ACCEPTED)
            else:
                assert engine_id is not None        # abort() always names the id to abort
                self.engine.abort_request(engine_id)
                whole = engine_id == submission.request_id
                for aborted in (submission.engine_ids if whole else [engine_id]):
                    self.routes.pop(aborted, None)
        if not self.engine.has_unfinished:
            return False
        for output in self.engine.step():
            owner = self.routes.get(output.request_id)
            if owner is None:
                continue
            owner.deliver(output)
            if output.finished:
                del self.routes[output.request_id]
        return True

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
            failure = RuntimeError(f"the engine loop stopped: {exc!r}")
            for submission in {id(s): s for s in [*self.routes.values(), *waiting]}.values():
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

        count: the request's n (int >= 1). Contract:
        - count > self.capacity: ValueError (this request could never be served; the
          client must change it, so it is a 400, not a 429), nothing changes.
        - self.inside + count > self.capacity: raise QueueFull, nothing changes.
        - otherwise self.inside grows by count.
        Every admitted count is given back exactly once through release(), whatever way
        the request ends (finished, stop string, client gone, engine error).
        """
        if count > self.capacity:
            raise ValueError(f"n={count} exceeds the {self.capacity} requests this server holds at once")
        if self.inside + count > self.capacity:
            raise QueueFull(f"the server holds {self.inside} of {self.capacity} requests")
        self.inside += count

    def release(self, count: int) -> None:
        self.inside -= count


__all__ = ["ACCEPTED", "Delivery", "Submission", "EngineSnapshot", "EngineLoop", "QueueFull", "AdmissionControl"]
