"""Chapter 30: first Triton kernels, a vector add and a row softmax.

A Triton kernel is a Python function compiled for the GPU. It is launched over a grid of
programs; each program handles one block of data, addressed through pointers and offsets:
    offsets = program_id * BLOCK + tl.arange(0, BLOCK)
Loads and stores take a mask so the last, partial block never touches memory past the end.

Without a GPU, Triton's interpreter (environment variable TRITON_INTERPRET=1) runs the same
kernels on the CPU with NumPy, one program after another: slow, but exact enough to test.
Triton reads the variable when it is imported (its own library functions, tl.max and
friends, are built then) and again when each kernel is defined, so it must be set before
anything imports triton, and some libraries do (transformers, torch's compiler). This
module sets it when torch sees no CUDA device and triton is not loaded yet; the course's
pytest plugin and the chapter's notebook set it first thing. The interpreter has no
bfloat16 arithmetic, so the wrappers compute in float32 there and cast the result back.
"""
import inspect
import os
import sys
from typing import Any

import torch

# True when triton was imported before the interpreter was chosen: its library functions
# are then compiled-mode objects, and interpreted kernels that call them fail.
_CHOSEN_TOO_LATE = False
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    _CHOSEN_TOO_LATE = "triton" in sys.modules
    os.environ["TRITON_INTERPRET"] = "1"

import triton  # noqa: E402  (after the interpreter choice, on purpose)
import triton.language as tl  # noqa: E402


def interpreting() -> bool:
    """True when kernels run in Triton's CPU interpreter rather than compiled for a GPU."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# Kernel parameters carry no Python annotations: Triton reads them to decide how to compile.
@triton.jit
def add_kernel(x_ptr, y_ptr, out_ptr, n_elements, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
    """out[i] = x[i] + y[i] for the BLOCK elements of this program.  (Your engine: Chapter 30)

    x_ptr, y_ptr, out_ptr: pointers to contiguous 1-D tensors of n_elements elements of one
    dtype; BLOCK: a compile-time power of two. The launch grid is cdiv(n_elements, BLOCK)
    programs along axis 0, and program p is responsible for elements
    p * BLOCK .. p * BLOCK + BLOCK - 1. Afterwards out[i] == x[i] + y[i] for every i of this
    program below n_elements. Trap: the last program usually hangs over the end, and it may
    neither read nor write a lane at or past n_elements (pointer arithmetic counts
    elements, not bytes).
    """
    raise NotImplementedError("Your engine: Chapter 30: add_kernel")


@triton.jit
def softmax_kernel(x_ptr, out_ptr, n_cols, x_row_stride, out_row_stride,  # type: ignore[no-untyped-def]
                   BLOCK: tl.constexpr):
    """Softmax of one row per program.  (Your engine: Chapter 30)

    x_ptr, out_ptr: 2-D tensors of the same shape [rows, n_cols] whose rows start
    x_row_stride and out_row_stride elements apart (columns contiguous); float32, float16 or
    bfloat16. BLOCK: a compile-time power of two >= n_cols. The grid has one program per
    row; program r writes softmax(x[r]) over its n_cols columns into out[r] (in out's dtype),
    and touches no element outside them.
    Numerics that are part of the contract: arithmetic in float32 whatever the input dtype,
    and no overflow for large logits (a row of 1000s gives a proper distribution, not NaN);
    each written row sums to 1 within float32 rounding.
    """
    raise NotImplementedError("Your engine: Chapter 30: softmax_kernel")


def _require_written(kernel: Any) -> None:
    """An unwritten stub kernel cannot compile on a GPU (Triton has no `raise`), and the
    interpreter wraps its exception in its own error type: say so in the course's words."""
    if 'raise NotImplementedError("Your engine: Chapter' in inspect.getsource(kernel.fn):
        raise NotImplementedError(f"Your engine: Chapter 30: {kernel.fn.__name__}")


def _check_device(*tensors: torch.Tensor) -> None:
    if _CHOSEN_TOO_LATE:
        raise RuntimeError("triton was imported (by transformers, say) before TRITON_INTERPRET=1 was set, so "
                           "its library functions were built for a GPU: set TRITON_INTERPRET=1 before anything "
                           "imports triton (the environment, or the first lines of the notebook)")
    for t in tensors:
        if not interpreting() and not t.is_cuda:
            raise ValueError("compiled Triton kernels need CUDA tensors (set TRITON_INTERPRET=1 for the CPU)")


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    """The interpreter has no 16-bit float arithmetic: compute in float32 there."""
    return torch.float32 if interpreting() and t.dtype in (torch.bfloat16, torch.float16) else t.dtype


def vector_add(x: torch.Tensor, y: torch.Tensor, block_size: int = 1024) -> torch.Tensor:
    """x + y for two tensors of the same shape, through add_kernel.

    One program per block_size elements: grid = (ceil(n / block_size),). Inputs are made
    contiguous, since the kernel addresses elements as one flat array."""
    if x.shape != y.shape:
        raise ValueError(f"vector_add needs equal shapes, got {tuple(x.shape)} and {tuple(y.shape)}")
    _require_written(add_kernel)
    _check_device(x, y)
    dtype = _compute_dtype(x)
    xc, yc = x.contiguous().to(dtype), y.contiguous().to(dtype)
    out = torch.empty_like(xc)
    n = out.numel()
    grid = (triton.cdiv(n, block_size),)
    add_kernel[grid](xc, yc, out, n, BLOCK=block_size)
    return out.to(x.dtype)


def softmax(x: torch.Tensor) -> torch.Tensor:
    """Softmax over the last axis of a 2-D tensor [rows, cols], through softmax_kernel:
    one program per row, BLOCK the next power of two of cols."""
    if x.dim() != 2:
        raise ValueError(f"softmax expects [rows, cols], got shape {tuple(x.shape)}")
    _require_written(softmax_kernel)
    _check_device(x)
    dtype = _compute_dtype(x)
    xc = x.to(dtype)
    if xc.stride(-1) != 1:
        xc = xc.contiguous()
    rows, cols = xc.shape
    out = torch.empty((rows, cols), dtype=dtype, device=x.device)
    block = triton.next_power_of_2(cols)
    softmax_kernel[(rows,)](xc, out, cols, xc.stride(0), out.stride(0), BLOCK=block)
    return out.to(x.dtype)


def program_ranges(n_elements: int, block_size: int) -> list[tuple[int, int, int]]:
    """(program id, first element, last element + 1) for each program of vector_add's grid."""
    return [(p, p * block_size, min((p + 1) * block_size, n_elements))
            for p in range(triton.cdiv(n_elements, block_size))]
