"""Chapter 15: prefill and decode, measured.

Chapter 2 predicted, from the config alone, how many FLOPs a forward step does and how
many bytes it moves (cost.step_cost). Here we count both on a real forward pass: a
TorchDispatchMode sees every aten operation the model runs, with its real tensors, and
adds up the FLOPs of the matrix products and the bytes every op reads and writes. The
ratio, FLOPs per byte, is the step's arithmetic intensity; the roofline (cost.Hardware)
turns it into a bound on speed, and timing the same step shows where it really lands.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from .cost import Hardware, StepCost
from .profiling import time_it

if TYPE_CHECKING:
    from .qwen3 import Qwen3Config

aten = torch.ops.aten

# Operations whose result is a new view of an input's memory (or a fresh tensor header over
# it): they move no data. OpOverload.is_view covers most; these few are views in all but name.
FREE_OPS = {aten._unsafe_view.default, aten.lift_fresh.default, aten.detach.default, aten.alias.default}
# Operations that read only the rows they gather, not the whole table they index into.
GATHER_OPS = {aten.embedding.default, aten.index_select.default, aten.index.Tensor}


def matmul_flops(func: torch._ops.OpOverload, args: Sequence[Any]) -> int:
    """FLOPs of one aten operation: 2 per multiply-add of a matrix product.  (Your engine: Chapter 15)

    func: an aten OpOverload such as torch.ops.aten.mm.default; args: its positional
    arguments (real tensors). Count these four, 0 for every other op:
      aten.mm(a [m, k], b [k, n])                    2 * m * k * n
      aten.addmm(bias, a [m, k], b [k, n])           2 * m * k * n (the bias add is not counted)
      aten.bmm(a [B, m, k], b [B, k, n])             2 * B * m * k * n
      aten.baddbmm(bias, a [B, m, k], b [B, k, n])   2 * B * m * k * n
    Under torch.no_grad, nn.Linear reaches the dispatcher as mm/addmm on 2-D views and
    einsum as bmm, so these four cover every product of our model. Return a Python int.
    """
    raise NotImplementedError("Your engine: Chapter 15: matmul_flops")


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of memory a tensor's elements occupy: a broadcast axis (stride 0) holds one
    element however long it looks, so it does not multiply the count."""
    elements = math.prod(size for size, stride in zip(t.shape, t.stride()) if stride != 0)
    return elements * t.element_size()


def _tensors(values: Iterable[Any]) -> Iterator[torch.Tensor]:
    for value in values:
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from _tensors(value)


def op_bytes(func: torch._ops.OpOverload, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]) -> int:
    """Bytes one aten operation moves to and from memory.  (Your engine: Chapter 15)

    inputs: the tensors among its arguments (for a gather, the table first, then the
    indices); outputs: the tensors it returned. Returns an int under the model "each piece
    of memory the op touches is read or written once, nothing stays cached between ops",
    which must hold these properties:
      - a view (func.is_view, or func in FREE_OPS) moves 0 bytes;
      - a gather (func in GATHER_OPS) is charged for the rows it picks, never for the
        table: embedding of 3 int64 ids from a [1000, 64] float32 table is 1,560 bytes
        (ids 24, rows read 768, rows written 768), not 256,000+;
      - memory that is both an input and an output counts once: copy_ of a [2, 16] float32
        tensor into a slice of a cache is 256 bytes, and so is x.mul_(2.0) of 64 floats;
      - a tensor weighs what it occupies (tensor_bytes): a [64] bias broadcast over
        [1024, 64] weighs 256 bytes, so (a [1024, 64] + that bias) is 524,544 bytes.
    """
    raise NotImplementedError("Your engine: Chapter 15: op_bytes")


class TrafficCounter(TorchDispatchMode):
    """Counts FLOPs (matmul_flops) and bytes (op_bytes) of every aten op run inside it.

    `ops` keeps one (name, flops, bytes) row per operation, in order, for tables and plots.
    """

    def __init__(self) -> None:
        super().__init__()
        self.flops, self.bytes = 0, 0
        self.ops: list[tuple[str, int, int]] = []

    def __torch_dispatch__(self, func: torch._ops.OpOverload, types: Any, args: Sequence[Any] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        flops = matmul_flops(func, args)
        moved = op_bytes(func, list(_tensors(list(args) + list(kwargs.values()))), list(_tensors([out])))
        self.flops += flops
        self.bytes += moved
        self.ops.append((str(func.overloadpacket.__name__), flops, moved))
        return out

    @property
    def cost(self) -> StepCost:
        return StepCost(flops=self.flops, bytes=self.bytes)


def count_step(model: nn.Module, input_ids: torch.Tensor, **forward_kwargs: Any) -> tuple[StepCost, TrafficCounter]:
    """FLOPs and bytes of model(input_ids, **forward_kwargs), counted op by op.

    Runs under torch.no_grad (not inference mode, under which nn.Linear and einsum reach the
    dispatcher whole instead of as mm/bmm). Returns (StepCost, TrafficCounter)."""
    with torch.inference_mode(False), torch.no_grad(), TrafficCounter() as counter:
        model(input_ids, **forward_kwargs)
    return counter.cost, counter


def measure_hardware(device: torch.device | str = "cpu", matmul_size: int = 1024, copy_mib: int = 64,
                     dtype: torch.dtype = torch.float32, repeats: int = 5) -> tuple[Hardware, dict[str, float]]:
    """This machine's roofline, measured: (Hardware, details).

    Peak: the FLOP rate of one square matmul of matmul_size (2 n^3 FLOPs). Bandwidth: a copy
    of copy_mib MiB, which reads and writes every byte (2x the size moved). Both are the
    median of `repeats` synchronized timings, so they are what this machine delivers to
    torch now, not a datasheet number (on a shared CPU they move from run to run).
    """
    device = torch.device(device)
    a = torch.randn(matmul_size, matmul_size, device=device, dtype=dtype)
    b = torch.randn(matmul_size, matmul_size, device=device, dtype=dtype)
    matmul = time_it(lambda: a @ b, warmup=2, repeats=repeats, device=device)
    elements = copy_mib * 2**20 // torch.empty((), dtype=dtype).element_size()
    src = torch.randn(elements, device=device, dtype=dtype)
    dst = torch.empty_like(src)
    copy = time_it(lambda: dst.copy_(src), warmup=2, repeats=repeats, device=device)
    peak = 2 * matmul_size**3 / matmul.median
    bandwidth = 2 * src.numel() * src.element_size() / copy.median
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "this CPU"
    return Hardware(f"{name} (measured)", peak, bandwidth), dict(matmul_s=matmul.median, copy_s=copy.median)


def measure_step(model: nn.Module, input_ids: torch.Tensor, *, warmup: int = 2, repeats: int = 5,
                 **forward_kwargs: Any) -> float:
    """Median seconds of model(input_ids), synchronized (profiling.time_it)."""
    def step() -> None:
        with torch.inference_mode():
            model(input_ids, **forward_kwargs)
    return time_it(step, warmup=warmup, repeats=repeats, device=input_ids.device).median


def causal_overcount(cfg: Qwen3Config, new_tokens: int, past_tokens: int = 0, batch: int = 1) -> int:
    """FLOPs a step spends on masked-out scores when attention computes every query x key
    product and masks afterwards (as causal_attention does): the upper triangle of the
    new tokens' block. cost.step_cost counts only the keys each query sees."""
    per_key = 4 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim
    return batch * per_key * (new_tokens * (new_tokens - 1) // 2)
