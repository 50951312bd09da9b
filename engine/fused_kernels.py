"""Chapter 33: the residual add and the next RMSNorm in one Triton kernel.

Unfused, a decoder layer's seam `add_norm` is two passes over the [N, D] residual stream:
    s = x + delta              reads x and delta, writes s
    y = rms_norm(s) * weight   reads s (and weight), writes y
The fused kernel reads x and delta once, keeps the row in registers, and writes s and y:
three row-sized transfers instead of five, and one launch instead of the handful the torch
ops take. Both matter most at decode, where a row is a few kilobytes and each launch costs
more than its arithmetic.

On a machine without a GPU the kernel runs in Triton's interpreter (TRITON_INTERPRET=1,
chosen by importing Chapter 30's triton_kernels first), in float32.
"""
from __future__ import annotations

import functools
import inspect

import torch

from .triton_kernels import interpreting  # noqa: F401  (imported first: it chooses the interpreter before triton loads)

# isort: split
import triton  # after the interpreter choice, on purpose
import triton.language as tl


# Kernel parameters carry no Python annotations: Triton reads them to decide how to compile.
@triton.jit
def add_rms_norm_kernel(x_ptr, delta_ptr, weight_ptr, sum_ptr, out_ptr, dim, eps,  # type: ignore[no-untyped-def]
                        BLOCK: tl.constexpr):
    """One row per program: sum = x + delta, out = weight * rms_norm(sum).  (Your engine: Chapter 33)

    x_ptr, delta_ptr, sum_ptr, out_ptr: [N, dim] contiguous, one dtype; weight_ptr: [dim];
    BLOCK: a power of two >= dim; launched with N programs, program r handling row r.
    Afterwards row r of sum holds x + delta exactly (rounded to the stream's dtype) and row
    r of out equals the unfused torch ops (FlatModel.add_norm with fused off) to float
    rounding: the row normalised is the STORED sum, not x; the mean of squares and the
    scaling are float32; the normalised row is rounded to the stream's dtype, then
    multiplied by the weight and rounded again, as Chapter 4's rms_norm does. Nothing
    outside the N x dim entries is read or written.
    Trap: the mean of squares is over the dim real entries; the lanes from dim up to BLOCK
    are padding and must add nothing to it.
    """
    raise NotImplementedError("Your engine: Chapter 33: add_rms_norm_kernel")


@functools.cache
def _kernel_written() -> bool:
    """False while the kernel is the skeleton's stub (Triton cannot compile a `raise`).
    Read once per process: this runs 57 times per step of a 28-layer model."""
    return 'raise NotImplementedError("Your engine: Chapter' not in inspect.getsource(add_rms_norm_kernel.fn)


def fused_add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight * rms_norm(x + delta), x + delta) for x, delta [..., D], in one launch of
    add_rms_norm_kernel. The interpreter computes 16-bit inputs in float32 (it has no
    16-bit arithmetic) and casts the results back."""
    if x.shape != delta.shape or weight.shape != x.shape[-1:]:
        raise ValueError(f"fused add + RMSNorm needs x and delta of one shape [..., D] and weight [D], got "
                         f"{tuple(x.shape)}, {tuple(delta.shape)}, {tuple(weight.shape)}")
    if not _kernel_written():
        raise NotImplementedError("Your engine: Chapter 33: add_rms_norm_kernel")
    if not interpreting() and not x.is_cuda:
        raise ValueError("the compiled kernel needs CUDA tensors (TRITON_INTERPRET=1 runs it on the CPU)")
    work = torch.float32 if interpreting() and x.dtype in (torch.bfloat16, torch.float16) else x.dtype
    dim = x.shape[-1]
    rows = x.reshape(-1, dim).contiguous().to(work)
    summed, out = torch.empty_like(rows), torch.empty_like(rows)
    if rows.shape[0]:
        add_rms_norm_kernel[(rows.shape[0],)](rows, delta.reshape(-1, dim).contiguous().to(work),
                                              weight.contiguous().to(work), summed, out, dim, eps,
                                              BLOCK=triton.next_power_of_2(dim))
    return out.to(x.dtype).view(x.shape), summed.to(x.dtype).view(x.shape)
