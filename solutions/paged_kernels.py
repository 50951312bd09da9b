"""Chapter 32: Triton kernels over the engine's block pool, and the backend that uses them.

Two kernels replace the PyTorch work of Chapter 31's backends:

    store_kv_kernel         one program per new row: copy its K and V into the pool at the
                            row's flat slot (slot -1, a padding row, is skipped on the device)
    paged_attention_kernel  one launch for the whole step, prefill chunks and decodes alike:
                            program (tile, head) takes BLOCK_M query rows of ONE request and
                            one query head, walks that request's blocks through the block
                            table (one pool block per iteration) and keeps Chapter 29's
                            online softmax, so no request's context is ever copied out

The pool layout is Chapter 31's: [num_blocks + 1, block_size, kv_heads, head_dim], so the
key at logical position p of a request lives at block block_table[r, p // block_size],
row p % block_size. Query head h reads K/V head h // (heads // kv_heads) (GQA).

On a machine without a GPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1,
chosen by importing Chapter 30's triton_kernels first): slow, but the same code.
On a GPU, tl.dot needs the inner dimension of each product (head_dim, then block_size) to be
at least 16 (32 for 8-bit inputs); a tile with fewer rows is padded by the compiler.

A quantized pool (TritonBackend(kv_cache_dtype="int8" or "fp8")) is read in place too: the
kernel loads the 8-bit codes and each token's per-head scale and multiplies them in
registers, so the pool is never dequantized into a float copy. Its writes go through
ReferenceBackend's write_quantized_kv (quantizing is a handful of torch operations).
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from .serve.backends import ReferenceBackend, upload_indices
from .triton_kernels import interpreting  # noqa: F401  (imported first: it chooses the interpreter before triton loads)

# isort: split
import triton  # after the interpreter choice, on purpose
import triton.language as tl

if TYPE_CHECKING:
    from .serve.backends import KVCache
    from .serve.batch import BatchMeta


# --- storing this step's keys and values ---------------------------------------------------------

# Kernel parameters carry no Python annotations: Triton reads them to decide how to compile.
@triton.jit
def store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, row_size,  # type: ignore[no-untyped-def]
                    BLOCK: tl.constexpr):
    """Program i stores row i of k and v in the pools.  (Your engine: Chapter 32)

    k_ptr, v_ptr: [N, Hkv * D] rows, contiguous; k_cache_ptr, v_cache_ptr: pools whose flat
    slot s starts at element s * row_size (the pool is slot-major, so a row's Hkv * D
    numbers are one contiguous run in both places); slot_ptr: int64 [N]; BLOCK: a power of
    two >= row_size. Afterwards the pool's slot slot[i] holds row i cast to the pool's
    element type (pointer.dtype.element_ty). A negative slot is a padding row: store
    nothing at all (the device decides; the host never counts real rows).
    """
    row = tl.program_id(0)
    slot = tl.load(slot_ptr + row)
    if slot >= 0:
        offsets = tl.arange(0, BLOCK)
        inside = offsets < row_size
        k = tl.load(k_ptr + row * row_size + offsets, mask=inside)
        v = tl.load(v_ptr + row * row_size + offsets, mask=inside)
        tl.store(k_cache_ptr + slot * row_size + offsets, k.to(k_cache_ptr.dtype.element_ty), mask=inside)
        tl.store(v_cache_ptr + slot * row_size + offsets, v.to(v_cache_ptr.dtype.element_ty), mask=inside)


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write this step's keys and values through the slot mapping with one launch.

    k_cache, v_cache: [num_blocks + 1, block_size, Hkv, D] (contiguous); k, v: [N, Hkv, D];
    slot_mapping: int64 [N]. Row i goes to flat slot slot_mapping[i] of
    k_cache.view(-1, Hkv, D); rows with slot -1 change nothing."""
    rows = k.shape[0]
    if rows == 0:
        return
    row_size = k.shape[1] * k.shape[2]
    store_kv_kernel[(rows,)](k.contiguous(), v.contiguous(), k_cache, v_cache, slot_mapping, row_size,
                             BLOCK=triton.next_power_of_2(row_size))


# --- attention over the pool ---------------------------------------------------------------------

@triton.jit
def paged_attention_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_table_ptr, table_width,  # type: ignore[no-untyped-def]
                           seq_lens_ptr, query_start_ptr, tile_request_ptr, tile_row_ptr,
                           scale, num_heads, num_kv_heads, head_dim, window, k_scale_ptr, v_scale_ptr,
                           BLOCK_M: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_D: tl.constexpr,
                           QUANTIZED: tl.constexpr):
    """Program (tile, head): attention of one tile of query rows for one query head.  (Your engine: Chapter 32)

    q_ptr, out_ptr: [N, H, D] contiguous (out zero-filled); k_cache_ptr, v_cache_ptr:
    [num_blocks + 1, BLOCK_SIZE, Hkv, D] contiguous; block_table_ptr: int32 [R, table_width];
    seq_lens_ptr: int32 [R]; query_start_ptr: int32 [R + 1]; tile_request_ptr,
    tile_row_ptr: int32 [num_tiles] (query_tiles: the tile's request and first row).
    BLOCK_M rows per tile, BLOCK_SIZE = the pool's block size, BLOCK_D = next power of two
    >= head_dim (mask the extra lanes). Computes, for each row i of the tile that belongs
    to its request (rows past the request's last row are masked: they belong to the next
    request), out[i, head] = softmax(scale * q[i, head] . K^T) V over the request's keys at
    positions 0 .. pos_i, pos_i being row i's own position (a request's rows this step are
    its newest positions, the last of them at seq_len - 1), and with window > 0 only keys
    > pos_i - window. K and V come from the KV head whose group the query head belongs to
    (equal consecutive groups, as in Chapter 5); the key at position p sits where the
    request's block table puts it, in the pool layout of Chapter 31's slot mapping.
    Cost contract: the pool is read in place (no gathered copy of the context), and only the
    blocks holding a key some row of the tile can see; scores never exist beyond one
    [BLOCK_M, BLOCK_SIZE] tile (an online softmax, Chapter 29, with float32 statistics).
    Trap: a row that has seen no visible key yet must not produce NaN. out is stored in its
    own element type.
    Quantized pools (QUANTIZED true): the pools hold int8 or fp8 codes and k_scale_ptr,
    v_scale_ptr point at float32 scales [num_blocks + 1, BLOCK_SIZE, Hkv]; the key (value)
    of a slot and KV head is its codes times that slot's and head's scale. Otherwise the
    scale pointers are not read.
    """
    tile = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // (num_heads // num_kv_heads)
    request = tl.load(tile_request_ptr + tile)
    first_row = tl.load(tile_row_ptr + tile)
    query_start = tl.load(query_start_ptr + request)
    query_end = tl.load(query_start_ptr + request + 1)
    seq_len = tl.load(seq_lens_ptr + request)

    rows = first_row + tl.arange(0, BLOCK_M)
    row_ok = rows < query_end
    positions = seq_len - (query_end - query_start) + (rows - query_start)
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < head_dim
    row_stride = num_heads * head_dim
    q = tl.load(q_ptr + rows[:, None] * row_stride + head * head_dim + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)

    # The keys this tile needs: up to its last row's position; with a window, from the
    # first row's oldest visible key on. Whole pool blocks, one per iteration.
    last_position = seq_len - (query_end - query_start) + (tl.minimum(first_row + BLOCK_M, query_end) - 1
                                                           - query_start)
    first_key = 0
    if window > 0:
        first_key = tl.maximum(0, seq_len - (query_end - query_start) + (first_row - query_start) - window + 1)
    offsets = tl.arange(0, BLOCK_SIZE)
    slot_stride = num_kv_heads * head_dim
    best = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    total = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for logical in range(first_key // BLOCK_SIZE, last_position // BLOCK_SIZE + 1):
        block = tl.load(block_table_ptr + request * table_width + logical).to(tl.int64)
        where = (block * BLOCK_SIZE + offsets[:, None]) * slot_stride + kv_head * head_dim + dims[None, :]
        # Lanes past head_dim are zeroed after the cast (`other` has no fp8 form to cast to).
        k = tl.where(dim_ok[None, :], tl.load(k_cache_ptr + where, mask=dim_ok[None, :]).to(tl.float32), 0.0)
        v = tl.where(dim_ok[None, :], tl.load(v_cache_ptr + where, mask=dim_ok[None, :]).to(tl.float32), 0.0)
        if QUANTIZED:                 # codes times the slot's per-head scale, in registers
            scale_at = (block * BLOCK_SIZE + offsets) * num_kv_heads + kv_head
            k = k * tl.load(k_scale_ptr + scale_at)[:, None]
            v = v * tl.load(v_scale_ptr + scale_at)[:, None]
        scores = tl.dot(q.to(tl.float32), tl.trans(k)) * scale       # [BLOCK_M, BLOCK_SIZE]
        key_positions = logical * BLOCK_SIZE + offsets
        visible = key_positions[None, :] <= positions[:, None]
        if window > 0:
            visible = visible & (key_positions[None, :] > positions[:, None] - window)
        scores = tl.where(visible, scores, float("-inf"))
        new_best = tl.maximum(best, tl.max(scores, axis=1))
        # A row that has seen no visible key yet keeps best = -inf; shift by 0 instead of
        # -inf so exp() gives 0, not NaN.
        shift = tl.where(new_best == float("-inf"), 0.0, new_best)
        weights = tl.exp(scores - shift[:, None])
        rescale = tl.exp(best - shift)
        total = total * rescale + tl.sum(weights, axis=1)
        acc = acc * rescale[:, None] + tl.dot(weights, v)
        best = new_best
    out = acc / tl.where(total > 0, total, 1.0)[:, None]
    tl.store(out_ptr + rows[:, None] * row_stride + head * head_dim + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


def query_tiles(meta: BatchMeta, block_m: int) -> tuple[list[int], list[int]]:
    """The tile list of one step: (request, first row) of every BLOCK_M-row piece of every
    request with context, from the batch's host lists (no device read).  (Your engine: Chapter 32)

    meta: BatchMeta; block_m: rows per tile. Returns two Python lists of equal length,
    tile_request and tile_row: request r with rows s .. e - 1 contributes tiles starting at
    s, s + block_m, ... (< e), in request order. Padding requests (seq_len 0) and requests
    with no rows contribute none. A decode gives one tile, a 40-row chunk with block_m 16
    three.
    """
    tile_request, tile_row = [], []
    starts = meta.query_start_loc_cpu
    for r, seq_len in enumerate(meta.seq_lens_cpu):
        if seq_len == 0:
            continue
        for row in range(starts[r], starts[r + 1], block_m):
            tile_request.append(r)
            tile_row.append(row)
    return tile_request, tile_row


def tile_tensors(meta: BatchMeta, block_m: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """query_tiles as two int32 tensors on `device`, moved there in one copy."""
    return tuple(t.to(torch.int32) for t in upload_indices(query_tiles(meta, block_m), device))


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: BatchMeta,
                    scale: float | None = None, window: int = 0, block_m: int = 16,
                    tiles: tuple[torch.Tensor, ...] | None = None,
                    scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """One launch of paged_attention_kernel for the whole step: q [N, H, D] -> [N, H, D].

    tiles: the step's query_tiles, as two int32 device tensors (computed here when None).
    scales: (k_scale, v_scale) float32 [num_blocks + 1, block_size, Hkv] when the pools hold
    8-bit codes (a quantized pool), else None. Rows of padding requests come back as zeros."""
    num_rows, heads, dim = q.shape
    out = torch.zeros_like(q)
    if tiles is None:
        tiles = tile_tensors(meta, block_m, q.device)
    if tiles[0].numel() == 0:
        return out
    block_size = k_cache.shape[1]
    scale = 1.0 / math.sqrt(dim) if scale is None else scale
    table = meta.block_table.to(torch.int32).contiguous()
    grid = (tiles[0].numel(), heads)
    k_scale, v_scale = scales if scales is not None else (k_cache, v_cache)     # not read when not quantized
    paged_attention_kernel[grid](q.contiguous(), k_cache, v_cache, out, table, table.shape[1], meta.seq_lens,
                                 meta.query_start_loc, tiles[0], tiles[1], scale, heads, k_cache.shape[2], dim,
                                 window, k_scale, v_scale, BLOCK_M=block_m, BLOCK_SIZE=block_size,
                                 BLOCK_D=triton.next_power_of_2(dim), QUANTIZED=scales is not None)
    return out


class TritonBackend(ReferenceBackend):
    """Chapter 31's backend interface on the two kernels: one launch to store K/V, one to
    attend, per layer. Pools are ReferenceBackend's: plain (k, v) pairs, or with
    kv_cache_dtype "int8" / "fp8" codes and scales, which the attention kernel reads in
    place (written by ReferenceBackend's quantized write). The tile list is built once per
    step and shared by every layer."""
    name = "triton"
    graph_safe = True           # lengths and block tables are read on the device (Chapter 33)

    def __init__(self, block_m: int = 16, kv_cache_dtype: str = "auto") -> None:
        if block_m < 1 or block_m & (block_m - 1):
            raise ValueError(f"TritonBackend block_m must be a power of two, got {block_m}")
        super().__init__(kv_cache_dtype)
        self.block_m = block_m
        self._tiles_for: BatchMeta | None = None
        self._tiles: tuple[torch.Tensor, ...] | None = None

    def allocate(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> KVCache:
        block_size = shape[1]
        if block_size & (block_size - 1):
            raise ValueError(f"the Triton backend needs a power-of-two block_size, got {block_size}")
        return super().allocate(shape, dtype, device)

    def write(self, cache: KVCache, k: torch.Tensor, v: torch.Tensor, meta: BatchMeta) -> None:
        if self.quantized:
            super().write(cache, k, v, meta)
        else:
            store_kv(cache[0], cache[1], k, v, meta.slot_mapping)

    def forward(self, q: torch.Tensor, cache: KVCache, meta: BatchMeta, scale: float | None = None,
                window: int = 0) -> torch.Tensor:
        if self._tiles_for is not meta:
            self._tiles = tile_tensors(meta, self.block_m, q.device)
            self._tiles_for = meta
        scales = (cache[2], cache[3]) if len(cache) > 2 else None
        return paged_attention(q, cache[0], cache[1], meta, scale, window, self.block_m, self._tiles, scales)

