"""Chapter 33: FlatModel's fused residual add + RMSNorm, and how the engine picks it.

FlatModel.fused chooses the implementation of its add_norm seam:
    False     the unfused torch ops (x + delta, then the norm module): the oracle
    "torch"   add_rms_norm below: the same arithmetic as one function (any device)
    "triton"  the Triton kernel of fused_kernels.py (compiled on CUDA, interpreted on a CPU)
    True      "triton" for CUDA tensors, "torch" elsewhere
Only this package's own RMSNorm modules (layers.RMSNorm) are fused; any other module keeps the
unfused path.
"""
from __future__ import annotations

import torch
from torch import nn

from ..layers import RMSNorm

FUSED_MODES = (False, True, "torch", "triton")


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight * rms_norm(x + delta), x + delta) with torch ops: the kernel's fallback,
    rounding exactly as the unfused path does (sum in x's dtype, statistic in float32)."""
    stream = x + delta
    wide = stream.float()
    normed = (wide * torch.rsqrt(wide.pow(2).mean(dim=-1, keepdim=True) + eps)).to(stream.dtype)
    return weight * normed, stream


def fused_add_norm(norm: nn.Module, x: torch.Tensor, delta: torch.Tensor,
                   mode: bool | str) -> tuple[torch.Tensor, torch.Tensor] | None:
    """norm(x + delta), x + delta through the fused path of `mode`, or None when `norm` is
    not an RMSNorm (the caller then runs the unfused ops)."""
    if not isinstance(norm, RMSNorm):
        return None
    weight, eps = norm.weight, norm.eps
    if mode == "triton" or (mode is True and x.is_cuda):
        from ..fused_kernels import fused_add_rms_norm
        return fused_add_rms_norm(x, delta, weight, eps)
    return add_rms_norm(x, delta, weight, eps)
