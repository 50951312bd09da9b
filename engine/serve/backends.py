"""Chapter 31: attention over the block pool, and the registry of attention backends.

Every layer's pool is a pair (k_cache, v_cache) of shape
[num_blocks + 1, block_size, kv_heads, head_dim]: block-major, then slot within the block.
With that order a flat slot number s = block * block_size + offset addresses one row of
k_cache.view(-1, kv_heads, head_dim), so storing a whole step's keys is a single scatter.
The extra last block is scratch: padding rows (slot -1) write there and nobody reads it.

A backend is any object with
    name
    allocate(shape, dtype, device) -> cache (a tuple: k, v, then anything else it needs)
    write(cache, k, v, meta)                   store this step's k, v [N, Hkv, D]
    forward(q, cache, meta, scale=None, window=0) -> [N, H, D]
Chapter 32 registers faster ones with `register_backend`; they are tested against
ReferenceBackend, which stays slow on purpose.
"""
from __future__ import annotations

import torch

from ..attention import causal_attention


def write_kv(k_cache, v_cache, k, v, slot_mapping):
    """Store this step's keys and values in the pool.  (Your engine: Chapter 31)

    k_cache, v_cache: [num_blocks + 1, block_size, Hkv, D]; k, v: [N, Hkv, D] (cast them to
    the pool's dtype); slot_mapping: int64 [N] flat slots. Row i goes to flat slot
    slot_mapping[i] of cache.view(-1, Hkv, D): one index_copy_ per pool, in place.
    Slot -1 (a padding row) must not be dropped on the host side, which would need to know
    how many rows are real (a device sync a CUDA graph cannot contain): send it to the
    pool's very last slot instead, inside the scratch block no request owns.
    """
    raise NotImplementedError("Your engine: Chapter 31: write_kv")


def gather_context(cache, table_row, length):
    """The first `length` rows of one request's history, read through its block table.

    cache: [num_blocks + 1, block_size, ...]; table_row: its blocks in logical order
    (a 1-D int tensor, possibly zero-padded past the blocks in use).
    Returns [length, ...], a copy in logical order.
    """
    block_size = cache.shape[1]
    used = -(-length // block_size)
    blocks = cache.index_select(0, table_row[:used])
    return blocks.reshape(used * block_size, *cache.shape[2:])[:length]


class ReferenceBackend:
    """Attention that gathers each request's context and calls Chapter 5's causal_attention,
    one request at a time. Slow and plainly right: every faster backend is compared to it."""
    name = "reference"

    def allocate(self, shape, dtype, device):
        """One layer's pool: (k_cache, v_cache), zero-filled."""
        return tuple(torch.zeros(shape, dtype=dtype, device=device) for _ in "kv")

    def write(self, cache, k, v, meta):
        k_pool, v_pool = cache[:2]
        write_kv(k_pool, v_pool, k, v, meta.slot_mapping)

    def forward(self, q, cache, meta, scale=None, window=0):
        """Attention of this step's queries against the pool.  (Your engine: Chapter 31)

        q: [N, H, D]; cache: (k_cache, v_cache, ...) already holding this step's keys;
        returns [N, H, D] in q's dtype. Loop over requests using the HOST lists
        meta.query_start_loc_cpu and meta.seq_lens_cpu (no device reads). Request r owns
        rows s = query_start_loc[r] .. e = query_start_loc[r + 1]. Those t = e - s rows are
        the newest t tokens of a context of seq_len tokens: their positions run from
        seq_len - t to seq_len - 1, and the keys cover 0 .. seq_len - 1 (gather_context through
        meta.block_table[r], then self.dequantize). Call causal_attention on
        [1, H, t, D] / [1, Hkv, seq_len, D] with those positions; with window > 0 (sliding
        window, Chapter 42) also pass allowed = key position > query position - window.
        Skip padding requests (seq_len 0 or no rows): their output rows stay zero.
        """
        raise NotImplementedError("Your engine: Chapter 31: ReferenceBackend.forward")

    @staticmethod
    def dequantize(x, cache, which, meta, r, length):
        """Turn rows read from request r's blocks ([length, Hkv, D]) into float32 keys or
        values laid out for causal_attention ([1, Hkv, length, D]).

        A quantized pool (Chapter 32) keeps per-token scales after K and V in the cache
        tuple (cache[2] for K, cache[3] for V, each [num_blocks + 1, block_size, Hkv]),
        read through the same block table."""
        values = x.float()
        if len(cache) > 2:                       # quantized: per-token scales follow K and V
            scales = gather_context(cache[2 + which], meta.block_table[r], length)
            values = values * scales.float().unsqueeze(-1)
        return values.transpose(0, 1).unsqueeze(0)


# --- the registry ----------------------------------------------------------------------------

_BACKENDS = {}


def register_backend(name, factory, replace=False):
    """Make `get_backend(name, **options)` return factory(**options). Chapter 32 adds its
    kernels this way; re-registering a taken name needs replace=True."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"backend names are non-empty strings, got {name!r}")
    if name in _BACKENDS and not replace:
        raise ValueError(f"attention backend {name!r} is already registered")
    _BACKENDS[name] = factory
    return factory


def available_backends():
    return sorted(_BACKENDS)


def get_backend(name, **options):
    """A new backend object registered under `name`, built with `options`."""
    factory = _BACKENDS.get(name)
    if factory is None:
        raise ValueError(f"unknown attention backend {name!r}; registered: {', '.join(available_backends())} "
                         f"(Chapter 32 adds faster ones)")
    try:
        return factory(**options)
    except TypeError as exc:
        raise ValueError(f"attention backend {name!r} does not take options {sorted(options)}: {exc}") from None


register_backend("reference", ReferenceBackend)
