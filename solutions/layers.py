"""Chapters 4 and 6: RMSNorm and rotary position embeddings."""
import torch
from torch import nn


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Normalise the last axis to unit root-mean-square, then scale.  (Your engine: Chapter 4)

    x: float [..., n]; weight: [n]; eps > 0. Returns x's shape and dtype, each row (last
    axis) normalised on its own: y = x / sqrt(mean(x^2 over the row) + eps) * weight.
    Properties: within about one rounding of that formula evaluated in float64, for float32,
    bfloat16 and float16 inputs alike; finite for every finite input, even float16 values
    whose squares exceed float16's range; for 16-bit inputs, bit for bit equal to
    transformers' Qwen3RMSNorm (the rounding Qwen3 was trained with); a row of zeros stays
    zeros; scaling a row by c > 0 leaves its output unchanged (up to eps).
    """
    variance = x.float().pow(2).mean(dim=-1, keepdim=True)
    normed = (x.float() * torch.rsqrt(variance + eps)).to(x.dtype)
    return weight * normed


class RMSNorm(nn.Module):
    """RMSNorm over the last axis with a learned per-channel scale (initialised to ones)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float,
                 dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Cosine and sine tables for rotary embeddings.  (Your engine: Chapter 6)

    positions: int tensor [T] or [B, T]. Returns cos, sin of shape [1, 1, T, head_dim]
    (or [B, 1, T, head_dim]) in `dtype`, ready to broadcast over [B, H, T, head_dim].
    With D = head_dim and c < D/2, columns c and c + D/2 hold the same angle, positions[t]
    * theta ** (-2c / D) ("rotate half" layout: channel c pairs with c + D/2). Property:
    the values are those of float32 angles from the exact integer positions, whatever
    `dtype` is (in bfloat16 a position like 30001 is not even representable).
    """
    half = head_dim // 2
    inv_freq = theta ** (-torch.arange(0, half, dtype=torch.float32, device=positions.device) * 2 / head_dim)
    angles = positions.float()[..., None] * inv_freq               # [..., T, half]
    angles = torch.cat([angles, angles], dim=-1)
    if angles.dim() == 2:
        angles = angles[None]
    angles = angles[:, None]                                        # [B, 1, T, head_dim]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) on the two halves of the last axis."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each channel pair (c, c + D/2) of x by its position's angle.  (Your engine: Chapter 6)

    x: [..., D] with cos/sin broadcastable to it ([B, 1, T, D] for [B, H, T, D] inputs,
    [N, 1, D] for the flat [N, H, D] rows of Chapter 31). Elementwise only: the function
    never looks at which axis is time, so every layout works.
    """
    return x * cos + rotate_half(x) * sin
