"""Chapter 28: a quantized KV cache.

Keys and values are kept as 8-bit codes (int8 or fp8 e4m3) with what it takes to decode
them: 1 byte per number instead of 2 (bfloat16) or 4 (float32), plus a few bytes per stored
vector, each vector's error bounded by its own range.

QuantizedKVCache is a drop-in replacement for Chapter 16's KVCache: the model calls the same
update / advance / truncate and gets float keys and values back, so Qwen3 runs unchanged.
It dequantizes the whole prefix at every step, which is slow on purpose: the point here is
the numbers. Chapter 32's kernels read the 8-bit pool directly and scale inside attention.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from .kv_cache import KVCache

if TYPE_CHECKING:
    from .qwen3 import Qwen3Config, Qwen3ForCausalLM

FORMATS = {
    # name: (storage dtype, largest representable magnitude)
    "int8": (torch.int8, 127.0),
    "fp8": (torch.float8_e4m3fn, 448.0),
}


def quantize_kv(x: torch.Tensor, fmt: str = "int8") -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize x with one scale per last-axis vector.  (Your engine: Chapter 28)

    x: [..., head_dim] float, one vector per token and head; fmt: a key of FORMATS, whose
    entry is (the code dtype, qmax, the largest code: 127 for "int8", 448 for "fp8" e4m3).
    Returns (codes [..., head_dim] in FORMATS[fmt][0], scale [...] float32) with
    codes * scale[..., None] close to x:
    - one float32 scale per vector, fixed by this: the vector's element of largest magnitude
      gets the code +-qmax and decodes back to itself (to float32 rounding); no code lies
      outside [-qmax, qmax];
    - int8: each code is the integer nearest x / scale (error per element at most scale / 2);
      fp8: each code is the e4m3 value nearest x / scale.
    Trap (part of the contract): an all-zero vector comes back as zero codes with a positive,
    finite scale; no NaN or inf anywhere in the result.
    """
    raise NotImplementedError("Your engine: Chapter 28: quantize_kv")


def dequantize_kv(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """codes [..., D] and scale [...] -> codes * scale in `dtype`."""
    return (codes.float() * scale[..., None]).to(dtype)


class QuantizedKVCache(KVCache):
    """KVCache with 8-bit storage: update takes and returns float keys and values like
    Chapter 16's cache, but what it keeps is 8-bit codes and what decodes them. `dtype` is
    what update returns (the model's dtype); `fmt` is "int8" or "fp8"."""

    def __init__(self, num_layers: int, batch: int, kv_heads: int, head_dim: int, max_len: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", fmt: str = "int8") -> None:
        """Allocate, once, everything the cache will keep for num_layers layers of batch
        sequences, kv_heads heads and max_len tokens.  (Your engine: Chapter 28)

        A stored vector is one token's head_dim keys (or values) of one head. The cache must
        give each one back as quantize_kv then dequantize_kv would (so every element within
        half a code step of its own vector's range) while keeping at most head_dim + 4 bytes
        for it, the codes included: never a float copy. Afterwards, as for KVCache:
        length == 0, max_len is set, and k[layer], v[layer] are the code tensors
        [batch, kv_heads, max_len, head_dim] in FORMATS[fmt][0] (advance and truncate rely
        on that layout); fmt and dtype are kept as self.fmt and self.dtype. Whatever else is
        kept lives in attributes that are tensors or lists of tensors: nbytes counts every
        such tensor, and it is the memory figure the milestone checks. No two layers, and
        not keys and values, share storage.
        """
        raise NotImplementedError("Your engine: Chapter 28: QuantizedKVCache.__init__")

    @classmethod
    def for_model(cls, model: Qwen3ForCausalLM, batch: int, max_len: int, fmt: str = "int8") -> QuantizedKVCache:
        cfg, weight = model.cfg, next(model.parameters())
        return cls(cfg.num_hidden_layers, batch, cfg.num_key_value_heads, cfg.head_dim, max_len,
                   weight.dtype, weight.device, fmt)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keep the new keys and values in the form __init__ chose; return ALL keys and
        values so far as floats.  (Your engine: Chapter 28)

        Same contract as KVCache.update: k, v [batch, kv_heads, T, head_dim] go to slots
        length .. length + T - 1 (ValueError, before anything is written, when they do not
        fit), `length` does not move, and the result is (keys, values) of slots
        0 .. length + T - 1, shape [batch, kv_heads, length + T, head_dim], in self.dtype.
        Every returned vector, the T new ones included, is what its stored form decodes to:
        dequantize_kv(*quantize_kv(vector, self.fmt)), the same on this call as on every
        later one, whichever layer or tensor (keys or values) was written in between.
        """
        raise NotImplementedError("Your engine: Chapter 28: QuantizedKVCache.update")

    @property
    def nbytes(self) -> int:
        """Bytes of every tensor the cache keeps (an attribute, or an element of a list
        attribute): the codes and whatever decodes them."""
        kept = [item for value in vars(self).values() for item in (value if isinstance(value, list) else [value])]
        return sum(t.numel() * t.element_size() for t in kept if isinstance(t, torch.Tensor))


def kv_bytes_per_token(cfg: Qwen3Config, dtype: torch.dtype = torch.bfloat16, fmt: str | None = None) -> int:
    """Bytes of K and V one token occupies across all layers: float storage in `dtype`, or
    8-bit codes plus one float32 scale per kv head when fmt is "int8"/"fp8"."""
    per_head = cfg.head_dim * torch.tensor([], dtype=dtype).element_size() if fmt is None else cfg.head_dim + 4
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * per_head


@torch.inference_mode()
def greedy_with_cache(model: Qwen3ForCausalLM, prompt_ids: Sequence[int], max_new_tokens: int, cache: KVCache,
                      forced: Sequence[int] | None = None) -> tuple[list[int], torch.Tensor]:
    """Greedy decoding through any cache with KVCache's protocol (float or quantized):
    prefill once, then one token per step. Returns (new tokens, logits [max_new_tokens, vocab]).

    forced: a list of tokens to feed instead of the model's own choices (teacher forcing),
    so that two caches can be compared on the same sequence even after their choices part."""
    device = next(model.parameters()).device
    feed, out, rows = list(prompt_ids), [], []
    for step in range(max_new_tokens):
        logits = model(torch.tensor([feed], device=device), cache=cache)[0, -1]
        rows.append(logits)
        out.append(int(logits.argmax()))
        feed = [out[-1] if forced is None else forced[step]]
    return out, torch.stack(rows)
