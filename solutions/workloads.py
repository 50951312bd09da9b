"""Chapter 22: workloads to serve and the numbers that say how well they were served.

A workload is a list of `WorkItem`s: a prompt, how many tokens to generate, and when the
request arrives. Every benchmark from Chapter 24 on draws its requests from here, so two
engines compared in one run see exactly the same requests. Everything is seeded with
Python's `random.Random`, so a workload is a pure function of its arguments (no torch, no
global state).

The metrics side turns what a server observed about each request (`RequestRecord`: when it
arrived, when its first token came out, when it finished, how many tokens it produced) into
the figures serving papers report: time to first token (TTFT), time per output token (TPOT),
end-to-end latency, throughput, and their percentiles (`summarize`). `replay` drives any
engine with the step API of Chapters 24, 25 and 31-lite (`add_request`, `step`,
`has_unfinished`) through a timed workload and records those observations.
"""
from __future__ import annotations

import math
import random
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from .kv_cache import KVCache
    from .qwen3 import Qwen3ForCausalLM


@dataclass
class WorkItem:
    """One request of a workload. arrival_time is in seconds from the start of the run."""
    request_id: str
    prompt_ids: list[int]
    max_tokens: int
    arrival_time: float = 0.0


class StepEngine(Protocol):
    """The step API every engine of Part V speaks (Chapters 22, 24, 25, 31), which `replay`
    and `run_to_completion` drive: queue a request, run one step, ask whether work is left.
    A step returns one (request_id, new_token_ids, finished) triple per request it advanced."""

    def add_request(self, request_id: str, prompt_ids: list[int], max_new_tokens: int, /) -> None: ...

    def step(self) -> list[tuple[str, list[int], bool]]: ...

    @property
    def has_unfinished(self) -> bool: ...


def _tokens(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    return [rng.randrange(vocab_size) for _ in range(n)]


def _between(rng: random.Random, bounds: int | tuple[int, int]) -> int:
    """An int drawn uniformly from an inclusive (low, high) pair, or the int itself."""
    if isinstance(bounds, int):
        return bounds
    low, high = bounds
    return rng.randint(low, high)


def shared_prefix_workload(num_requests: int = 16, prefix_len: int = 192,
                           question_len: int | tuple[int, int] = (8, 48),
                           output_len: int | tuple[int, int] = (8, 40), vocab_size: int = 256,
                           seed: int = 0) -> list[WorkItem]:
    """Requests that all start with the same system prompt, then ask their own question.

    The prefix (prefix_len tokens) is drawn once; each request appends a question of a length
    drawn uniformly from question_len (inclusive) and asks for a number of output tokens drawn
    from output_len. Token ids are below vocab_size (256: byte-sized ids, so they never hit
    the tiny model's special tokens). All requests arrive at time 0. This is the workload
    of `python run.py batch` and of Chapter 31's `python run.py core`.
    """
    rng = random.Random(seed)
    prefix = _tokens(rng, prefix_len, vocab_size)
    items = []
    for i in range(num_requests):
        question = _tokens(rng, _between(rng, question_len), vocab_size)
        items.append(WorkItem(f"req-{i}", prefix + question, _between(rng, output_len)))
    return items


def poisson_arrivals(rate: float, n: int, seed: int = 0) -> list[float]:
    """Arrival times of n requests from a Poisson process of `rate` requests per second.
    (Your engine: Chapter 22)

    rate > 0 (requests per second); n >= 0; seed: an int. Returns a list of n
    non-decreasing floats (seconds): the running sums of n independent gaps, each
    exponentially distributed with mean 1 / rate, so the first arrival is one gap after 0,
    not at 0. All randomness comes from one random.Random(seed): the same (rate, n, seed)
    gives the same list, and nothing else's random state is touched.
    Errors: ValueError naming the rate when rate <= 0.
    Trap: a uniform draw can be exactly 0.0; no arrival may be inf or NaN.
    """
    if rate <= 0:
        raise ValueError(f"arrival rate must be positive, got {rate}")
    rng = random.Random(seed)
    times, now = [], 0.0
    for _ in range(n):
        now += -math.log(1.0 - rng.random()) / rate
        times.append(now)
    return times


def with_arrivals(items: Sequence[WorkItem], arrival_times: Sequence[float]) -> list[WorkItem]:
    """A copy of items with the given arrival times (one per item, in order)."""
    if len(arrival_times) != len(items):
        raise ValueError(f"{len(items)} items but {len(arrival_times)} arrival times")
    return [WorkItem(it.request_id, list(it.prompt_ids), it.max_tokens, float(t))
            for it, t in zip(items, arrival_times)]


@dataclass
class LengthClass:
    """One kind of request in a length mix: its share of requests and its length ranges."""
    name: str
    weight: float
    prompt_len: tuple[int, int]
    output_len: tuple[int, int]


CHAT_MIX = (LengthClass("chat", 0.7, (16, 64), (16, 64)),
            LengthClass("summarise", 0.2, (192, 384), (8, 32)),
            LengthClass("write", 0.1, (8, 24), (96, 160)))


def length_mix_workload(num_requests: int = 32, mix: Sequence[LengthClass] = CHAT_MIX, rate: float | None = None,
                        vocab_size: int = 256, seed: int = 0) -> list[WorkItem]:
    """Independent prompts whose lengths come from a mix of request kinds.

    Each request picks a LengthClass with probability proportional to its weight, then a
    prompt length and an output length uniformly from that class's inclusive ranges. With
    `rate`, requests arrive as a Poisson process (poisson_arrivals with the same seed);
    otherwise all at time 0. The class name is kept in the request id ("req-3-summarise") so
    a plot can colour by kind.
    """
    rng = random.Random(seed)
    weights = [c.weight for c in mix]
    items = []
    for i in range(num_requests):
        kind = rng.choices(mix, weights)[0]
        prompt = _tokens(rng, _between(rng, kind.prompt_len), vocab_size)
        items.append(WorkItem(f"req-{i}-{kind.name}", prompt, _between(rng, kind.output_len)))
    if rate is not None:
        items = with_arrivals(items, poisson_arrivals(rate, num_requests, seed))
    return items


def multi_turn_workload(num_conversations: int = 4, num_turns: int = 4, system_len: int = 64,
                        message_len: int | tuple[int, int] = (8, 32), answer_len: int | tuple[int, int] = (8, 32),
                        shared_system: bool = True, turn_gap: float = 1.0, vocab_size: int = 256,
                        seed: int = 0) -> list[WorkItem]:
    """Chat sessions: each turn's prompt is the previous turn's prompt, the answer to it and a
    new user message.

    Conversation c starts with a system prompt (one shared by all conversations when
    shared_system, else one each) and a first message. The "answer" appended before the next
    message is a stand-in drawn here (a workload cannot know what a model will say), of the
    length that turn asks the model to generate, so prompts grow as they would in a real
    chat. Turn t arrives at t * turn_gap (conversations interleave). Ids: "c{c}-t{t}".

    What a prefix cache can reuse: every turn after the first repeats the whole previous
    prompt, and with shared_system all conversations share the system prompt.
    """
    rng = random.Random(seed)
    shared = _tokens(rng, system_len, vocab_size)
    items = []
    for c in range(num_conversations):
        history = list(shared) if shared_system else _tokens(rng, system_len, vocab_size)
        for t in range(num_turns):
            history = history + _tokens(rng, _between(rng, message_len), vocab_size)
            answer = _between(rng, answer_len)
            items.append(WorkItem(f"c{c}-t{t}", list(history), answer, t * turn_gap))
            history = history + _tokens(rng, answer, vocab_size)
    items.sort(key=lambda it: (it.arrival_time, it.request_id))
    return items


# ----------------------------------------------------------------------------------------
# Metrics

@dataclass
class RequestRecord:
    """What a server saw of one request. Times in seconds on one clock."""
    request_id: str
    arrival_time: float
    first_token_time: float | None = None
    finish_time: float | None = None
    num_output_tokens: int = 0
    token_times: list[float] = field(default_factory=list)   # when each output token came out

    def _stamp(self, stamp: float | None, event: str) -> float:
        if stamp is None:
            raise ValueError(f"request {self.request_id!r} has no {event} yet")
        return stamp

    @property
    def ttft(self) -> float:
        """Time to first token: waiting in the queue plus prefill."""
        return self._stamp(self.first_token_time, "first token") - self.arrival_time

    @property
    def e2e(self) -> float:
        """End-to-end latency: arrival to last token."""
        return self._stamp(self.finish_time, "finish time") - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first; None with fewer than two tokens."""
        if self.num_output_tokens < 2:
            return None
        first, last = self._stamp(self.first_token_time, "first token"), self._stamp(self.finish_time, "finish time")
        return (last - first) / (self.num_output_tokens - 1)

    @property
    def inter_token_gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0 <= q <= 100) of a non-empty list of numbers, interpolating
    linearly between the two nearest order statistics.  (Your engine: Chapter 22)

    values: a non-empty sequence of floats, in any order (not modified); q: a float in
    [0, 100]. Returns a float equal to numpy.percentile(values, q) with its default
    ("linear") method: p0 is the minimum, p100 the maximum, p50 of [1, 2, 3, 4] is 2.5.
    Errors: ValueError on an empty list, or on q outside [0, 100] (naming q).
    """
    if not values:
        raise ValueError("percentile of an empty list")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    ordered = sorted(values)
    rank = q / 100 * (len(ordered) - 1)
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    frac = rank - low
    return ordered[low] + (ordered[high] - ordered[low]) * frac


PERCENTILES = (50, 90, 99)


def summarize(records: Sequence[RequestRecord]) -> dict[str, Any]:
    """Aggregate figures of a served workload.  (Your engine: Chapter 22)

    records: RequestRecords of finished requests (each with first_token_time, finish_time
    and num_output_tokens set). Returns a dict with
      num_requests, output_tokens (sum), duration_s (first arrival to last finish),
      throughput_tok_s (output_tokens / duration_s), requests_per_s (both inf when
      duration_s is 0),
      and for each metric m in ttft, tpot, e2e: m_mean, m_p50, m_p90, m_p99 (PERCENTILES)
      computed with `percentile`.
    TPOT is undefined for a request with fewer than two tokens: leave such requests out of
    the TPOT figures (and report None for them all if no request has two tokens). Note
    that throughput divides by the whole span, not by the sum of latencies: requests
    overlap, and that overlap is what a batching server sells.
    Errors: ValueError for no records, or for a record without a finish_time (naming its
    request_id).
    """
    if not records:
        raise ValueError("summarize needs at least one finished request")
    start = min(r.arrival_time for r in records)
    finish_times = [r.finish_time for r in records if r.finish_time is not None]
    if len(finish_times) < len(records):
        unfinished = [r.request_id for r in records if r.finish_time is None]
        raise ValueError(f"summarize needs finished requests; {unfinished} have no finish_time")
    end = max(finish_times)
    duration = end - start
    tokens = sum(r.num_output_tokens for r in records)
    out: dict[str, Any] = {"num_requests": len(records), "output_tokens": tokens, "duration_s": duration,
           "throughput_tok_s": tokens / duration if duration > 0 else float("inf"),
           "requests_per_s": len(records) / duration if duration > 0 else float("inf")}
    samples = {"ttft": [r.ttft for r in records], "tpot": [r.tpot for r in records if r.tpot is not None],
               "e2e": [r.e2e for r in records]}
    for name, values in samples.items():
        out[f"{name}_mean"] = sum(values) / len(values) if values else None
        for q in PERCENTILES:
            out[f"{name}_p{q}"] = percentile(values, q) if values else None
    return out


# ----------------------------------------------------------------------------------------
# Driving an engine through a timed workload

class SkipIdleClock:
    """Wall time that jumps over idle gaps.

    While a server computes, time is real (perf_counter). When it has nothing to do until
    the next arrival, `skip_to(t)` moves the clock forward instead of sleeping, so a
    workload spread over a minute of arrivals replays in the seconds of compute it needs,
    with the same queueing behaviour as if we had waited.
    """

    def __init__(self) -> None:
        self._start = time.perf_counter()
        self._skipped = 0.0

    def __call__(self) -> float:
        return time.perf_counter() - self._start + self._skipped

    def skip_to(self, t: float) -> None:
        now = self()
        if t > now:
            self._skipped += t - now


def replay(engine: StepEngine, items: Iterable[WorkItem],
           clock: SkipIdleClock | None = None) -> dict[str, RequestRecord]:
    """Serve a timed workload on an engine with the step API; returns {request_id: RequestRecord}.
    (Your engine: Chapter 22)

    engine: add_request(request_id, prompt_ids, max_tokens), step() -> a list of
    (request_id, new_token_ids, finished) triples, and the property has_unfinished;
    items: WorkItems in any order; clock: a SkipIdleClock (default: a new one): clock() is
    the time now, clock.skip_to(t) moves it forward to t.
    Returns one RequestRecord per item, keyed by request_id, arrival_time the item's, where:
      - each item is handed to the engine exactly once, at the first moment the clock reads
        at least its arrival_time, never before; items due together go in arrival order;
      - a step's tokens are stamped with the clock read after that step returned:
        first_token_time is the stamp of the step that returned the request's first token,
        finish_time that of the step that said finished, token_times holds the stamp once
        per token, num_output_tokens counts every token returned;
      - when the engine has nothing unfinished and items are still to come, time jumps to
        the next arrival (clock.skip_to), never sleeps; it returns once every item was
        handed over and the engine has nothing unfinished.
    Trap: a stamp read before step() returns credits each token with time it never waited.
    """
    clock = clock or SkipIdleClock()
    pending = sorted(items, key=lambda it: it.arrival_time)
    records, next_item = {}, 0
    while next_item < len(pending) or engine.has_unfinished:
        now = clock()
        while next_item < len(pending) and pending[next_item].arrival_time <= now:
            item = pending[next_item]
            records[item.request_id] = RequestRecord(item.request_id, item.arrival_time)
            engine.add_request(item.request_id, item.prompt_ids, item.max_tokens)
            next_item += 1
        if not engine.has_unfinished:
            clock.skip_to(pending[next_item].arrival_time)
            continue
        outputs = engine.step()
        stamp = clock()
        for request_id, new_tokens, finished in outputs:
            record = records[request_id]
            if new_tokens and record.first_token_time is None:
                record.first_token_time = stamp
            record.num_output_tokens += len(new_tokens)
            record.token_times.extend([stamp] * len(new_tokens))
            if finished:
                record.finish_time = stamp
    return records


class OneAtATimeEngine:
    """The simplest server: requests queue, and one at a time is prefilled and decoded to the
    end before the next starts. It has the step API, so `replay` measures it like any other
    engine; Chapter 22 uses it to show what queueing does to TTFT, and Chapter 24 beats it.
    Each step is one forward call: the whole prompt of the request at the head of the queue,
    or one decode token of the request being served. Greedy only.
    """

    def __init__(self, model: Qwen3ForCausalLM, eos_token_id: int | None = None) -> None:
        from .kv_cache import KVCache
        self._kv_cache = KVCache
        self.model = model
        self.eos_token_id = eos_token_id
        self.device = next(model.parameters()).device
        self.queue: list[tuple[str, list[int], int, tuple[int, ...]]] = []   # request_id, prompt, max_new, stops
        self.current: tuple[str, KVCache, list[int], int, tuple[int, ...]] | None = None  # ... its cache, outputs
        self.steps = self.forward_calls = 0

    def add_request(self, request_id: str, prompt_ids: Iterable[int], max_new_tokens: int,
                    stop_token_ids: Iterable[int] = ()) -> None:
        prompt = list(prompt_ids)
        if not prompt:
            raise ValueError(f"{request_id}: empty prompt")
        self.queue.append((request_id, prompt, max_new_tokens, tuple(stop_token_ids)))

    @property
    def has_unfinished(self) -> bool:
        return bool(self.queue) or self.current is not None

    def step(self) -> list[tuple[str, list[int], bool]]:
        import torch
        if self.current is None:
            if not self.queue:
                return []
            request_id, prompt, max_new, stops = self.queue.pop(0)
            cache = self._kv_cache.for_model(self.model, 1, len(prompt) + max_new)
            self.current = (request_id, cache, [], max_new, stops)
            feed = prompt
        else:
            feed = self.current[2][-1:]
        request_id, cache, outputs, max_new, stops = self.current
        with torch.inference_mode():
            logits = self.model(torch.tensor([feed], device=self.device), cache=cache)
        self.steps += 1
        self.forward_calls += 1
        token = int(logits[0, -1].argmax())
        outputs.append(token)
        finished = (len(outputs) >= max_new or token == self.eos_token_id or token in stops)
        if finished:
            self.current = None
        return [(request_id, [token], finished)]

    def run(self, items: Iterable[WorkItem]) -> dict[str, list[int]]:
        return run_to_completion(self, items)


def run_to_completion(engine: StepEngine, items: Iterable[WorkItem]) -> dict[str, list[int]]:
    """Serve WorkItems on any engine with the Part V step API (add_request, step, has_unfinished)
    until none is left; returns {request_id: output token ids}."""
    outputs: dict[str, list[int]] = {}
    for item in items:
        engine.add_request(item.request_id, item.prompt_ids, item.max_tokens)
        outputs[item.request_id] = []
    while engine.has_unfinished:
        for request_id, tokens, _ in engine.step():
            outputs[request_id].extend(tokens)
    return outputs
