"""Chapter 18: where the time of one decode step goes.

A decode step feeds one token per sequence. Chapter 2's roofline says such a step is
bound by memory: every weight matrix is read once, however few tokens use it, so the
step cannot be faster than weight bytes / memory bandwidth. Real steps are often slower
than that bound, for a second reason the roofline leaves out: each operation is a separate
kernel launch (or, on a CPU, a separate trip through PyTorch's dispatcher), and a small
model at batch 1 spends more time launching work than doing it.

This module measures both:
  decode_step_seconds  the time of one decode step at a given batch size and context;
  launch_overhead      the fixed cost of one tiny operation, from a chain of them;
  count_ops            how many operations one decode step dispatches;
  decode_report        the step set against the roofline: how much of it the launches
                       explain, and what memory bandwidth it achieved.
Timing uses Chapter 14's time_it (warm-up, device synchronisation, median).
"""
from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from . import roofline
from .cost import step_cost
from .kv_cache import KVCache
from .profiling import synchronizer, time_it

if TYPE_CHECKING:
    from .cost import Hardware
    from .qwen3 import Qwen3ForCausalLM


def _param_dtype(model: nn.Module) -> torch.dtype:
    return next(model.parameters()).dtype


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


@torch.inference_mode()
def decode_step_seconds(model: Qwen3ForCausalLM, batch: int, context: int, *, repeats: int = 10,
                        warmup: int = 2) -> float:
    """Median seconds of ONE decode step: `batch` sequences, each with `context` tokens
    already in its cache, feed one new token each.  (Your engine: Chapter 18)

    model: a Qwen3ForCausalLM (on any device); batch >= 1; context >= 0; repeats, warmup: as
    for Chapter 14's time_it (warm-up calls untimed, device synchronised, median reported).
    Returns a float in seconds: the median over `repeats` of one model call on ids
    [batch, 1] against a KVCache holding `context` tokens per row.
    Invariant that makes it a measurement: every call, warm-up included, sees exactly the
    same state (context tokens cached per row, one fed), so the repeats measure the same
    step. What the cached slots hold is not part of the contract: only how many there are.
    """
    device = _device(model)
    cache = KVCache.for_model(model, batch, context + 1)
    cache.advance(context)
    ids = torch.zeros(batch, 1, dtype=torch.long, device=device)

    def one_step() -> None:
        model(ids, cache=cache)
        cache.truncate(context)

    return time_it(one_step, warmup=warmup, repeats=repeats, device=device).median


@torch.inference_mode()
def launch_overhead(device: torch.device | str = "cpu", *, num_ops: int = 200, repeats: int = 10,
                    warmup: int = 2) -> float:
    """Seconds of fixed cost per operation, measured on a chain of tiny operations.
    (Your engine: Chapter 18)

    device: where the operations run; num_ops >= 1: the length of the chain; repeats,
    warmup: as for time_it. Returns a float: time_it's median for one chain of num_ops
    dependent elementwise operations on a one-element tensor on `device`, divided by
    num_ops. The data is a single number, so the arithmetic costs nothing and what is
    measured is the price every operation pays to be dispatched (and, on a GPU, launched).
    Trap: each operation must consume the previous one's result; independent operations
    measure nothing a model does.
    """
    x = torch.zeros(1, device=device)

    def chain() -> torch.Tensor:
        y = x
        for _ in range(num_ops):
            y = y + 1
        return y

    return time_it(chain, warmup=warmup, repeats=repeats, device=device).median / num_ops


class _OpCounter(TorchDispatchMode):
    """Counts the ATen operations that reach a kernel (views and metadata changes excluded)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: torch._ops.OpOverload, types: Any, args: Sequence[Any] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        if not func.is_view:
            self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


@torch.inference_mode()
def count_ops(model: Qwen3ForCausalLM, batch: int = 1, context: int = 16) -> Counter[str]:
    """How many operations one decode step runs: a Counter {aten op name: count}.

    Operations that only create a view (reshape, transpose, slicing) are left out: they
    launch no kernel. The total is, to a good approximation, the number of kernel launches
    the step costs on a GPU in eager mode; it does not depend on batch or context, only on
    the model's code and its number of layers.
    """
    device = _device(model)
    cache = KVCache.for_model(model, batch, context + 1)
    cache.advance(context)
    ids = torch.zeros(batch, 1, dtype=torch.long, device=device)
    with _OpCounter() as counter:
        model(ids, cache=cache)
    return counter.ops


def measure_hardware(device: torch.device | str = "cpu", *, copy_mib: int = 64,
                     matmul_size: int | None = None) -> Hardware:
    """This machine as a cost.Hardware: Chapter 15's measured roofline, sized for the device
    (a bfloat16 8192-square matmul on CUDA, where tensor cores set the peak that matters;
    float32 and 1024 on a CPU)."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    hardware, _ = roofline.measure_hardware(device, matmul_size or (8192 if cuda else 1024), copy_mib,
                                            torch.bfloat16 if cuda else torch.float32)
    return hardware


@dataclass
class DecodeReport:
    """One decode step set against the roofline (all times in seconds)."""
    batch: int
    context: int
    step_seconds: float        # measured
    num_ops: int               # operations dispatched per step
    overhead_seconds: float    # fixed cost of one operation
    launch_seconds: float      # num_ops * overhead_seconds
    bytes_moved: int           # weights + KV cache read and written (Chapter 2)
    flops: int                 # FLOPs of the step (Chapter 2)
    roofline_seconds: float    # Chapter 2's lower bound on this hardware
    achieved_bandwidth: float  # bytes_moved / step_seconds

    @property
    def launch_share(self) -> float:
        """Part of the step the operation overhead alone accounts for (can exceed 1 when the
        chain's per-op cost overestimates a model's ops)."""
        return self.launch_seconds / self.step_seconds

    @property
    def roofline_fraction(self) -> float:
        """How close the step came to the bound: 1.0 means as fast as the hardware allows."""
        return self.roofline_seconds / self.step_seconds

    def as_dict(self) -> dict[str, Any]:
        out = dict(self.__dict__)
        out.update(launch_share=self.launch_share, roofline_fraction=self.roofline_fraction)
        return out


def decode_report(model: Qwen3ForCausalLM, batch: int, context: int, hardware: Hardware, *,
                  step_seconds: float | None = None, overhead_seconds: float | None = None,
                  num_ops: int | None = None) -> DecodeReport:
    """Measure a decode step and explain it.  (Your engine: Chapter 18)

    Returns a DecodeReport for `batch` sequences decoding one token each with `context`
    tokens in the cache. Its measured fields are the arguments when given, else this
    chapter's measurements: decode_step_seconds(model, batch, context), launch_overhead on
    the model's device, and count_ops summed over every op name. Its roofline fields
    (flops, bytes_moved, roofline_seconds on `hardware`) are Chapter 2's step_cost of that
    decode step at the model's parameter dtype; the derived fields follow the definitions
    on DecodeReport. Nothing is measured that was given.
    """
    if step_seconds is None:
        step_seconds = decode_step_seconds(model, batch, context)
    if overhead_seconds is None:
        overhead_seconds = launch_overhead(_device(model))
    if num_ops is None:
        num_ops = sum(count_ops(model, batch, context).values())
    cost = step_cost(model.cfg, 1, context, batch, _param_dtype(model))
    return DecodeReport(batch=batch, context=context, step_seconds=step_seconds, num_ops=num_ops,
                        overhead_seconds=overhead_seconds, launch_seconds=num_ops * overhead_seconds,
                        bytes_moved=cost.bytes, flops=cost.flops, roofline_seconds=cost.time(hardware),
                        achieved_bandwidth=cost.bytes / step_seconds)


@torch.inference_mode()
def step_breakdown(model: Qwen3ForCausalLM, batch: int, context: int, *, repeats: int = 5) -> dict[str, float]:
    """Where one decode step's time goes, part by part: {part: seconds}.

    Parts are the embedding, each decoder layer (layer.0, layer.1, ...), the final norm
    and the LM head, timed by forward hooks that synchronise the device and read the clock
    at each part's entry and exit, inside the same call that times the whole step
    ("total"). Of `repeats` calls (after one warm-up) the one with the median total is
    reported, so every figure comes from one call, and "other" (total minus the parts) is
    the glue between them: rotary tables, the cache's bookkeeping, Python. Parts never
    overlap, so "other" is never negative.
    """
    device = _device(model)
    sync = synchronizer(device)
    parts: dict[str, nn.Module] = {"embed": model.model.embed_tokens}
    parts.update({f"layer.{i}": layer for i, layer in enumerate(model.model.layers)})
    parts.update({"norm": model.model.norm, "lm_head": model.lm_head})
    started: dict[str, float] = {}
    current: dict[str, float] = {}

    def enter(name: str) -> Callable[[nn.Module, Any], None]:
        def hook(module: nn.Module, args: Any) -> None:
            sync()
            started[name] = time.perf_counter()
        return hook

    def leave(name: str) -> Callable[[nn.Module, Any, Any], None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            sync()
            current[name] = time.perf_counter() - started[name]
        return hook

    handles = []
    for name, module in parts.items():
        handles.append(module.register_forward_pre_hook(enter(name)))
        handles.append(module.register_forward_hook(leave(name)))
    cache = KVCache.for_model(model, batch, context + 1)
    cache.advance(context)
    ids = torch.zeros(batch, 1, dtype=torch.long, device=device)
    calls = []
    try:
        for _ in range(repeats + 1):
            current.clear()
            sync()
            start = time.perf_counter()
            model(ids, cache=cache)
            sync()
            calls.append(dict(current, total=time.perf_counter() - start))
            cache.truncate(context)
    finally:
        for handle in handles:
            handle.remove()
    calls = sorted(calls[1:], key=lambda call: call["total"])          # drop the warm-up
    chosen = calls[len(calls) // 2]
    chosen["other"] = chosen["total"] - sum(chosen[name] for name in parts)
    return chosen
