"""Chapter 12: numbers that drift. Floating-point formats, measured error, tolerances,
and why the same row computed alone or inside a batch can come out with different bits.

Every measurement here compares a low-precision result with a float64 reference of the
same computation: float64 carries 53 significant bits, so its own error is far below
anything float32, bfloat16 or float16 can show.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .qwen3 import Qwen3ForCausalLM

# Significant bits (including the implicit leading 1) and exponent bits of each format.
FORMATS = {
    torch.float64: (53, 11),
    torch.float32: (24, 8),
    torch.bfloat16: (8, 8),
    torch.float16: (11, 5),
}


def unit_roundoff(dtype: torch.dtype) -> float:
    """The largest relative error of one rounding to nearest in `dtype`: eps / 2."""
    return torch.finfo(dtype).eps / 2


def ulp(x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The spacing of `dtype`'s number grid at each element of x.  (Your engine: Chapter 12)

    x: a float tensor of any shape; dtype: the format whose grid is meant (default x.dtype).
    Returns a float64 tensor shaped like x: the distance from |x| to the next larger
    representable magnitude in `dtype`. For a normal number in [2**k, 2**(k+1)) that is
    finfo(dtype).eps * 2**k; below the smallest normal number (finfo(dtype).tiny), and at
    zero, it is the smallest spacing, eps * tiny (subnormals); inf and nan give nan.
    Trap, as a property: exact whatever the pair of formats, though x may be in another
    format than `dtype` (float32's smallest spacing, 2**-149, is 0 in bfloat16; a bfloat16
    value above 65504 is inf in float16).
    """
    dtype = x.dtype if dtype is None else dtype
    info = torch.finfo(dtype)
    magnitude = x.double().abs()
    _, exponent = torch.frexp(magnitude)
    spacing = info.eps * torch.exp2(exponent.double() - 1)
    spacing = spacing.clamp(min=info.eps * info.tiny).masked_fill(magnitude == 0, info.eps * info.tiny)
    return spacing.masked_fill(~torch.isfinite(magnitude), float("nan"))


@dataclass
class ErrorStats:
    """How far an approximation is from a reference, over all elements."""
    max_abs: float          # largest |approx - reference|
    mean_abs: float         # mean |approx - reference|
    max_rel: float          # largest |approx - reference| / |reference| over nonzero references
    max_ulp: float          # largest error counted in ulps of the approximation's dtype

    def __str__(self) -> str:
        return (f"max abs {self.max_abs:.3g}, mean abs {self.mean_abs:.3g}, "
                f"max rel {self.max_rel:.3g}, max {self.max_ulp:.3g} ulp")


def measure_error(approx: torch.Tensor, reference: torch.Tensor) -> ErrorStats:
    """Error statistics of `approx` against `reference` (same shape).  (Your engine: Chapter 12)

    Trap, as a property: every statistic is exact to float64, whatever the inputs' dtypes
    (a difference taken in a 16-bit format would round the error itself). Absolute error |a - r|;
    relative error |a - r| / |r| over the elements whose reference is not zero (a relative
    error at zero is meaningless; max_rel is 0.0 when every reference is zero); ulp error
    |a - r| / ulp(r, approx.dtype), the error in units of the grid the approximation lives
    on (1/2 ulp is the best one rounding can do). Returns ErrorStats with plain Python floats.
    """
    a, r = approx.double(), reference.double()
    err = (a - r).abs()
    nonzero = r != 0
    rel = err[nonzero] / r[nonzero].abs()
    ulps = err / ulp(r, approx.dtype)
    return ErrorStats(max_abs=float(err.max()), mean_abs=float(err.mean()),
                      max_rel=float(rel.max()) if rel.numel() else 0.0, max_ulp=float(ulps.max()))


@dataclass(frozen=True)
class Tolerance:
    rtol: float
    atol: float

    def allows(self, approx: torch.Tensor, reference: torch.Tensor) -> bool:
        """True when every |approx - reference| <= atol + rtol * |reference| (in float64)."""
        a, r = approx.double(), reference.double()
        return bool(((a - r).abs() <= self.atol + self.rtol * r.abs()).all())


def tolerance_for(dtype: torch.dtype, roundings: float = 8, scale: float = 1.0) -> Tolerance:
    """The tolerance for comparing two computations of the same quantity in `dtype`
    against each other (or one against float64), for values of size ~`scale`.

    Each rounding costs at most one unit roundoff u (relative), so a result that went
    through `roundings` roundings in sequence is within about roundings * u of the exact
    value: rtol = roundings * u. Near zero a relative bound is useless (cancellation
    leaves an absolute error of the size of the operands), so atol = roundings * u * scale.
    The default of 8 roundings fits one layer-sized computation (a norm, a projection, an
    activation); a whole model needs a larger budget, which Chapter 13 measures.
    """
    u = unit_roundoff(dtype)
    return Tolerance(rtol=roundings * u, atol=roundings * u * scale)


def bits_differ(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many elements of two same-dtype tensors differ in their bit patterns."""
    if a.dtype != b.dtype or a.shape != b.shape:
        raise ValueError(f"compare like with like: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}")
    ints = {8: torch.int64, 4: torch.int32, 2: torch.int16}[a.element_size()]
    return int((a.contiguous().view(ints) != b.contiguous().view(ints)).sum())


def matmul_alone_vs_batched(x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, K] @ weight.T, once as one [N, K] batch and once row by row ([1, K] each).
    Returns (batched, alone): the same numbers in exact arithmetic; the kernels that a
    library picks for N rows and for 1 row may add the K products in different orders."""
    batched = torch.nn.functional.linear(x, weight)
    alone = torch.cat([torch.nn.functional.linear(x[i:i + 1], weight) for i in range(x.shape[0])])
    return batched, alone


@dataclass
class BatchDrift:
    """Solo versus batched logits of one prompt."""
    max_abs: float          # largest |solo - batched| logit difference over positions and vocab
    differing: int          # logits whose bits differ
    argmax_flips: int       # positions whose greedy choice differs


@torch.inference_mode()
def batch_drift(model: Qwen3ForCausalLM, prompts: Sequence[Sequence[int]]) -> list[BatchDrift]:
    """Run each prompt alone and all prompts as one batch; compare.  (Your engine: Chapter 12)

    prompts: a list of equal-length lists of token ids (no padding needed), run on the
    device of the model's parameters. For prompt i,
    solo = model(ids [1, T]) and batched = row i of model(ids [N, T]); both are float32
    logits [T, vocab] of the same sequence, so in exact arithmetic they are equal. Returns
    one BatchDrift per prompt: the largest absolute difference, how many logits differ in
    their bits (bits_differ), and at how many positions the argmax differs. The greedy
    margins of the test model are chosen so that argmax_flips stays 0.
    """
    device = next(model.parameters()).device
    ids = torch.tensor(prompts, device=device)
    batched = model(ids)
    report = []
    for i in range(len(prompts)):
        solo = model(ids[i:i + 1])[0]
        row = batched[i]
        report.append(BatchDrift(max_abs=float((solo.double() - row.double()).abs().max()),
                                 differing=bits_differ(solo, row),
                                 argmax_flips=int((solo.argmax(-1) != row.argmax(-1)).sum())))
    return report


def sum_in_order(values: torch.Tensor, block: int | None = None) -> float:
    """Add float values in float32 left to right, or in blocks of `block` whose partial
    sums are then added: two orders a kernel might choose. Returns a Python float."""
    values = values.float()
    if block is None:
        total = torch.zeros((), dtype=torch.float32)
        for v in values:
            total = total + v
        return float(total)
    partial = [sum_in_order(values[i:i + block]) for i in range(0, values.numel(), block)]
    return sum_in_order(torch.tensor(partial, dtype=torch.float32))


def format_table() -> list[dict[str, Any]]:
    """Rows describing each format: bits, eps, unit roundoff, smallest normal, largest."""
    rows = []
    for dtype, (digits, exp_bits) in FORMATS.items():
        info = torch.finfo(dtype)
        rows.append(dict(dtype=str(dtype).removeprefix("torch."), bits=info.bits, significant_bits=digits,
                         exponent_bits=exp_bits, eps=info.eps, unit_roundoff=info.eps / 2,
                         smallest_normal=info.tiny, largest=info.max,
                         decimal_digits=round(digits * math.log10(2), 1)))
    return rows
