"""Chapter 14: measuring a forward pass honestly.

Two tools. `time_it` times a callable the way GPU code must be timed: warm up first, wait
for the device before starting and before stopping the clock, repeat, report the median.
`profile_forward` runs one forward pass under torch.profiler and splits its time into
shares per kind of work (matmul, attention, norm, other) that add up to the whole.
"""
from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.autograd.profiler_util import FunctionEvent
from torch.profiler import ProfilerActivity, profile, record_function

KINDS = ("matmul", "attention", "norm", "other")
LABEL_PREFIX = "kind:"          # profiler ranges opened around labelled modules are named kind:<kind>


def synchronizer(device: torch.device | str) -> Callable[[], None]:
    """A function that blocks until all work queued on `device` has finished.

    CUDA kernels run asynchronously: a Python call returns as soon as the kernel is queued.
    On the CPU every op has finished when its call returns, so there is nothing to wait for.
    """
    device = torch.device(device)
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    if device.type == "mps":
        return torch.mps.synchronize
    if device.type == "xpu":
        return lambda: torch.xpu.synchronize(device)
    return lambda: None


@dataclass
class Timing:
    """Seconds taken by each timed repeat (warm-up calls are not in `samples`)."""
    samples: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def best(self) -> float:
        return min(self.samples)

    @property
    def spread(self) -> float:
        """(max - min) / median: how much the repeats disagree."""
        return (max(self.samples) - min(self.samples)) / self.median if self.median else 0.0


def time_it(fn: Callable[[], Any], *, warmup: int = 3, repeats: int = 10, device: torch.device | str = "cpu",
            sync: Callable[[], Any] | None = None) -> Timing:
    """Time fn() like a benchmark should; returns a Timing.  (Your engine: Chapter 14)

    fn: the work, called with no arguments; warmup >= 0 untimed calls first (first calls pay
    for allocation, caching, compilation); repeats >= 1 timed calls; device and sync:
    sync (default synchronizer(device)) waits until the device has finished all queued work.
    Returns Timing(samples): `repeats` durations in seconds (floats, time.perf_counter), in
    call order, sample i covering exactly the i-th timed call's own work: none of it still
    queued when its clock stops, none of an earlier call's (warm-up included) still running
    when it starts. fn is called exactly warmup + repeats times.
    Trap: a CUDA call returns once its kernels are queued, not finished; a timer that does
    not wait measures launch time, not work.
    """
    raise NotImplementedError("Your engine: Chapter 14: time_it")


def module_kind(module: nn.Module) -> str | None:
    """The kind of work a module does, or None when its children should decide.

    Linear layers are matmuls; anything whose class name ends in RMSNorm is a norm; an
    attention module is "attention" for whatever it does outside its own Linear and norm
    children (rotary embedding, the score/softmax/weighted-sum core, reshapes). Works on our
    modules and on transformers' (Qwen3RMSNorm, Qwen3Attention) alike.
    """
    name = type(module).__name__
    if isinstance(module, nn.Linear):
        return "matmul"
    if name.endswith("RMSNorm"):
        return "norm"
    if name.endswith("Attention"):
        return "attention"
    return None


@contextmanager
def label_modules(model: nn.Module,
                  kind_of: Callable[[nn.Module], str | None] = module_kind) -> Iterator[nn.Module]:
    """Open a profiler range named kind:<kind> around every labelled module's forward.

    Ranges nest like the modules do, so an op inside q_proj sits in kind:matmul inside
    kind:attention; the innermost label is the one that counts.
    """
    open_ranges, handles = [], []

    def enter(label: str) -> Callable[[nn.Module, Any], None]:
        def hook(module: nn.Module, args: Any) -> None:
            scope = record_function(label)
            scope.__enter__()
            open_ranges.append(scope)
        return hook

    def leave(module: nn.Module, args: Any, output: Any) -> None:
        open_ranges.pop().__exit__(None, None, None)

    for module in model.modules():
        kind = kind_of(module)
        if kind is not None:
            handles.append(module.register_forward_pre_hook(enter(LABEL_PREFIX + kind)))
            handles.append(module.register_forward_hook(leave))
    try:
        yield model
    finally:
        for handle in handles:
            handle.remove()
        while open_ranges:                      # a forward that raised leaves ranges open
            open_ranges.pop().__exit__(None, None, None)


def op_shares(events: Iterable[FunctionEvent], device_time: bool = False) -> dict[str, float]:
    """Seconds of a profile per kind of work; the values add up to the profiled total.  (Your engine: Chapter 14)

    events: the profiler's events (prof.events()), each with .name, .cpu_parent (the event it
    ran inside, or None), its SELF time in microseconds (.self_cpu_time_total, or with
    device_time .self_device_time_total: the GPU time of the kernels it launched itself) and
    its inclusive time (.cpu_time_total: its own time plus its descendants').
    Returns {kind: seconds} with every kind of KINDS present (0.0 when absent), such that:
    - every event's self time is in exactly one kind, so the values add up to the sum of the
      events' self times (on a whole pass, the root's inclusive time): no microsecond is
      counted twice, however deep the ranges nest;
    - that kind is the one of the innermost range named kind:<kind> that encloses the event,
      the event itself counting as enclosing (a labelled range's own Python time belongs to
      its own kind); an event with no such range is "other".
    Trap: an aten::mm inside aten::linear inside kind:matmul inside kind:attention is matmul
    work, counted once.
    """
    raise NotImplementedError("Your engine: Chapter 14: op_shares")


@dataclass
class ForwardProfile:
    """One profiled forward pass.

    shares: seconds per kind; total: the time the shares divide (the root range's CPU time,
    or the GPU time of all kernels with device_time); wall: perf_counter time around the
    profiled call (device synchronized), which also includes profiler bookkeeping.
    """
    shares: dict[str, float]
    total: float
    wall: float
    device_time: bool
    table: str = ""

    def fractions(self) -> dict[str, float]:
        return {kind: (s / self.total if self.total else 0.0) for kind, s in self.shares.items()}


ROOT_RANGE = "forward"


@contextmanager
def quiet_native_stderr() -> Iterator[None]:
    """Silence the C++ side's stderr (file descriptor 2) inside the block: the profiler's
    native library prints a line each time it starts and stops. Python exceptions still
    propagate; only what native code writes to the descriptor is dropped."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            try:
                yield
            finally:
                os.dup2(saved, 2)
    finally:
        os.close(saved)


@torch.inference_mode()
def record_forward(model: nn.Module, input_ids: torch.Tensor, *, warmup: int = 1, passes: int = 5,
                   labels: bool = True, **forward_kwargs: Any) -> tuple[list[FunctionEvent], FunctionEvent, float]:
    """Record model(input_ids, **forward_kwargs) with torch.profiler; returns
    (events, root, wall): the CPU-side events of one pass (its root range named "forward"
    and everything under it), the root event, and the pass's wall time in seconds.

    `passes` passes are recorded in one session, each in its own root range, and the
    fastest is kept: the first recorded pass pays the profiler's own start-up, and on a
    busy machine any pass may be interrupted. With labels, modules are wrapped in
    kind:<kind> ranges (label_modules). The forward runs warmup + passes times, so
    forward_kwargs must allow repeated calls (no KV cache: each call would append to it).
    """
    device = input_ids.device
    sync = synchronizer(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    labelled = label_modules(model) if labels else nullcontext()
    with labelled, quiet_native_stderr():
        for _ in range(warmup):
            model(input_ids, **forward_kwargs)
        sync()
        walls = []
        with profile(activities=activities) as prof:
            for _ in range(max(passes, 2)):
                start = time.perf_counter()
                with record_function(ROOT_RANGE):
                    model(input_ids, **forward_kwargs)
                sync()
                walls.append(time.perf_counter() - start)
    cpu_events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU]
    roots = sorted((e for e in cpu_events if e.name == ROOT_RANGE and e.cpu_parent is None),
                   key=lambda e: e.time_range.start)
    best = min(range(1, len(roots)), key=lambda i: roots[i].cpu_time_total)    # never the first
    root = roots[best]
    return [e for e in cpu_events if _inside(e, root)], root, walls[best]


def profile_forward(model: nn.Module, input_ids: torch.Tensor, *, warmup: int = 1, passes: int = 5,
                    device_time: bool | None = None, **forward_kwargs: Any) -> ForwardProfile:
    """Shares of one forward pass per kind of work: record_forward, then op_shares.

    device_time defaults to True on CUDA (the GPU's time is what matters there) and False on
    the CPU. Returns a ForwardProfile; its total is the root's inclusive CPU time, or with
    device_time the summed duration of every kernel launched inside the root.
    """
    if device_time is None:
        device_time = input_ids.device.type == "cuda"
    events, root, wall = record_forward(model, input_ids, warmup=warmup, passes=passes, **forward_kwargs)
    shares = op_shares(events, device_time=device_time)
    if device_time:
        total = sum(k.duration for e in events for k in e.kernels) / 1e6
    else:
        total = root.cpu_time_total / 1e6
    return ForwardProfile(shares, total, wall, device_time, self_time_table(events, device_time))


def self_time_table(events: Sequence[FunctionEvent], device_time: bool = False, rows: int = 10) -> str:
    """Events grouped by name, largest self time first: a text table of name, calls, self
    ms and inclusive ms (the latter double counts nested names: shown for contrast)."""
    groups: dict[str, tuple[int, float, float]] = {}
    for e in events:
        self_us = e.self_device_time_total if device_time else e.self_cpu_time_total
        total_us = e.device_time_total if device_time else e.cpu_time_total
        calls, s, t = groups.get(e.name, (0, 0.0, 0.0))
        groups[e.name] = (calls + 1, s + self_us, t + total_us)
    ranked = sorted(groups.items(), key=lambda item: -item[1][1])[:rows]
    lines = [f"{'name':<28} {'calls':>5} {'self ms':>9} {'inclusive ms':>13}"]
    lines += [f"{name[:28]:<28} {calls:>5} {s / 1e3:>9.3f} {t / 1e3:>13.3f}" for name, (calls, s, t) in ranked]
    return "\n".join(lines)


def _inside(event: FunctionEvent | None, root: FunctionEvent) -> bool:
    while event is not None:
        if event is root:
            return True
        event = event.cpu_parent
    return False


def format_shares(prof: ForwardProfile) -> str:
    """A small text table: kind, milliseconds, percent of the total."""
    lines = [f"{'kind':<10} {'ms':>9} {'share':>7}"]
    for kind in KINDS:
        seconds = prof.shares[kind]
        lines.append(f"{kind:<10} {seconds * 1e3:9.3f} {seconds / prof.total:7.1%}")
    lines.append(f"{'total':<10} {prof.total * 1e3:9.3f} {sum(prof.shares.values()) / prof.total:7.1%}")
    return "\n".join(lines)
