"""Chapter 16: a contiguous KV cache, one preallocated row per sequence."""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from .qwen3 import Qwen3ForCausalLM


class ModelCache(Protocol):
    """What Qwen3Model asks of a cache: this KVCache, Chapter 24's rows of a slot cache and
    Chapter 28's quantized cache all speak it.

    length: the filled slots before this call (an int, or a long tensor [B] of per-row
    lengths); update(layer, k, v) stores a layer's new keys and values and returns every key
    and value so far; advance(T) moves `length` once every layer has written.
    """

    @property
    def length(self) -> int | torch.Tensor: ...

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def advance(self, num_tokens: int) -> None: ...


class KVCache:
    """Keys and values of every layer for `batch` sequences of up to `max_len` tokens.

    Layout per layer: k[layer], v[layer] of shape [batch, kv_heads, max_len, head_dim].
    `length` slots of every row are filled; all rows advance together (a padded batch keeps
    its rows aligned, Chapter 21). The model writes each layer's new keys with `update` and
    calls `advance` once after the last layer, so every layer of a step sees the same start.
    """

    def __init__(self, num_layers: int, batch: int, kv_heads: int, head_dim: int, max_len: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        """Make room, once, for the keys and values of num_layers layers of `batch` sequences
        of up to max_len tokens, kv_heads heads of head_dim numbers each.  (Your engine: Chapter 16)

        Afterwards: `length` == 0 and `max_len` is kept; `k` and `v` are lists of num_layers
        tensors, k[layer] and v[layer] each [batch, kv_heads, max_len, head_dim] in `dtype` on
        `device` (update, advance and truncate, the subclasses of Chapters 19 and 28, and
        nbytes all rely on these names and this layout). `length` is the only write position:
        one int for every row and every layer. Every slot reads 0 until something is written
        there. These tensors are all the memory the cache ever has: no later call allocates,
        grows or rebinds them. Writing any one of the 2 x num_layers tensors changes no other.
        """
        shape = (batch, kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.max_len = max_len
        self.length = 0

    @classmethod
    def for_model(cls, model: Qwen3ForCausalLM, batch: int, max_len: int) -> KVCache:
        """A cache shaped for `model` (its config, dtype and device). A model whose cache is
        not K/V heads of head_dim (latent attention, Chapter 42) gives its shape by kv_spec()."""
        cfg, weight = model.cfg, next(model.parameters())
        own = getattr(model, "kv_spec", None)
        layers, kv_heads, width = own() if own is not None else (cfg.num_hidden_layers, cfg.num_key_value_heads,
                                                                 cfg.head_dim)
        return cls(layers, batch, kv_heads, width, max_len, weight.dtype, weight.device)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [batch, kv_heads, T, head_dim] at slots length .. length + T - 1 and
        return the keys and values of slots 0 .. length + T - 1.  (Your engine: Chapter 16)

        Raises ValueError when the T new tokens do not fit in max_len. Does not move
        `length`: the model calls advance(T) once all layers have written.
        """
        end = self.length + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} tokens; {end} requested")
        self.k[layer][:, :, self.length:end] = k
        self.v[layer][:, :, self.length:end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]

    def advance(self, num_tokens: int) -> None:
        self.length += num_tokens

    def truncate(self, length: int) -> None:
        """Forget every slot from `length` on (speculative decoding rolls back this way)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a {self.length}-token cache to {length}")
        self.length = length

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)
