"""Chapter 20: int8 weight-only quantization of the linear layers.

A decode step is bound by reading the weights (Chapter 18), so storing them in fewer
bytes makes the step cheaper almost one for one. Weight-only int8 keeps activations in the
model's float dtype and stores each weight matrix as int8 plus one float scale per output
channel (per row of the [out, in] matrix):

    scale[o] = max_i |W[o, i]| / 127        q[o, i] = round(W[o, i] / scale[o])  in [-127, 127]
    W[o, i] ~= q[o, i] * scale[o]            with |error| <= scale[o] / 2

Symmetric (no zero point) because trained weights are centred on zero; per output channel
because rows differ in magnitude by orders of magnitude and one scale for the whole matrix
would waste most of the 255 levels on the rows with small weights.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.nn import functional as F

QMAX = 127


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 quantization of weight [out, in], one scale per output row.
    (Your engine: Chapter 20)

    weight: a float matrix [out, in] of any float dtype. Returns (q, scale): q int8
    [out, in], scale float32 [out] (computed in float32 whatever weight's dtype), such that:
      - q * scale[:, None] stands for the weight, each element within half a step:
        |q * scale - weight| <= scale / 2;
      - each row's largest magnitude sits exactly on the edge of the range: the row's
        largest |q| is 127, and every q lies in [-127, 127] (-128 unused: the range is
        symmetric, no zero point);
      - a row of zeros has q all zeros and a tiny positive scale (never 0, never NaN).
    Trap: the scale is per output row; a row of small weights keeps all its precision
    next to a row a thousand times larger.
    """
    raise NotImplementedError("Your engine: Chapter 20: quantize_per_channel")


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q int8 [out, in] and scale [out] -> the float weight they stand for, in dtype."""
    return (q.float() * scale[:, None].float()).to(dtype)


class Int8Linear(nn.Module):
    """A drop-in replacement for nn.Linear holding int8 weights and per-row float32 scales.

    Buffers (so .to(device) moves them and state_dict() saves them, but no optimizer sees
    them): qweight int8 [out, in], scale float32 [out], and bias (the float one, kept as it
    was) when the original layer had one.
    """

    qweight: torch.Tensor
    scale: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 device: torch.device | str | None = None, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("qweight", torch.zeros(out_features, in_features, dtype=torch.int8, device=device))
        self.register_buffer("scale", torch.ones(out_features, dtype=torch.float32, device=device))
        self.register_buffer("bias", torch.zeros(out_features, dtype=dtype, device=device) if bias else None)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8Linear:
        """Quantize an nn.Linear's weight; its bias is copied unchanged."""
        weight = linear.weight
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, weight.device, weight.dtype)
        q, scale = quantize_per_channel(weight)
        layer.qweight.copy_(q)
        layer.scale.copy_(scale)
        if linear.bias is not None and layer.bias is not None:
            layer.bias.copy_(linear.bias.detach())
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """y = x W^T + b for x [..., in] in x's own dtype, W the dequantized weight.
        (Your engine: Chapter 20)

        x: [..., in_features] in any float dtype. Returns [..., out_features] in x's dtype:
        x @ (qweight * scale[:, None])^T + bias, with W and the bias in x.dtype, so one quantized
        layer serves any activation dtype; equal to a float nn.Linear holding the dequantized
        weight. The module is unchanged.
        Trap (part of the contract): in float16, multiplying by the int8 codes first and applying
        the scale afterwards overflows: each output sums hundreds of products as large as
        127 |x|, past float16's 65,504. (A real int8 kernel dequantizes tiles in registers and
        never writes W to memory; this reference materialises W, saving memory, not time.)
        """
        raise NotImplementedError("Your engine: Chapter 20: Int8Linear.forward")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def quantize_model(model: nn.Module, skip: Iterable[str] = ()) -> nn.Module:
    """Swap every nn.Linear inside `model` for Int8Linear.from_linear(it), in place; returns model.
    (Your engine: Chapter 20)

    model: any nn.Module (a Qwen3ForCausalLM in the chapter); skip: qualified module names
    (as named_modules gives them, e.g. "lm_head") that stay float.
    Afterwards: every nn.Linear not in skip has been replaced, at the same place in the
    module tree, by the Int8Linear built from it, so module names and therefore state_dict
    keys stay where they were (model.layers.0.mlp.up_proj.qweight, ...); nothing else
    changed: embedding tables are not nn.Linear and stay float, and a tied LM head becomes an
    int8 copy while the embedding keeps the float original. Returns the same model object.
    Trap: layers at every depth count (the projections sit inside layers inside the model),
    and a skip name is the full dotted name.
    """
    raise NotImplementedError("Your engine: Chapter 20: quantize_model")


def linear_weight_bytes(model: nn.Module) -> int:
    """Bytes held by the weights of the linear layers (float nn.Linear and Int8Linear alike,
    scales and biases included): what a decode step must read for its matmuls."""
    total = 0
    for module in model.modules():
        if isinstance(module, nn.Linear):
            total += sum(t.numel() * t.element_size() for t in module.parameters(recurse=False))
        elif isinstance(module, Int8Linear):
            total += sum(t.numel() * t.element_size() for t in module.buffers(recurse=False))
    return total


def weight_error_bound(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The worst-case error of y = x W^T that int8 rounding can cause, per output channel.

    Each weight is off by at most scale[o] / 2, so |y_q[..., o] - y[..., o]| is at most
    sum_i |x_i| * scale[o] / 2. x [..., in], scale [out] -> bound [..., out].
    """
    return x.abs().sum(dim=-1, keepdim=True).float() * scale.float() / 2
