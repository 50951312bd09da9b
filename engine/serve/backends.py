"""Chapter 31: attention over the block pool, and the registry of attention backends.

Every layer's pool is a pair (k_cache, v_cache) of shape
[num_blocks + 1, block_size, kv_heads, head_dim]: block-major, then slot within the block.
With that order a flat slot number s = block * block_size + offset addresses one row of
k_cache.view(-1, kv_heads, head_dim), so storing a whole step's keys is a single scatter.
The extra last block is scratch: padding rows (slot -1) write there and nobody reads it.

A backend is any object with (serve.interfaces.AttentionBackend states the full contract)
    name
    allocate(shape, dtype, device) -> cache (a tuple: k, v, then anything else it needs)
    write(cache, k, v, meta)                   store this step's k, v [N, Hkv, D]
    forward(q, cache, meta, scale=None, window=0) -> [N, H, D]
Chapter 32 registers faster ones with `register_backend`; they are tested against
ReferenceBackend, which stays slow on purpose: VectorisedBackend below (every request in
one attention call per layer), and TritonBackend (paged_kernels.py: Triton kernels that
read the blocks in place).
"""
from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, cast

import torch
import torch.nn.functional as F

from ..attention import causal_attention
from ..devices import to_device
from ..kv_quant import FORMATS, quantize_kv
from .interfaces import AttentionBackend

if TYPE_CHECKING:
    from .batch import BatchMeta

# One layer's pool as a backend allocates it: (k_cache, v_cache), then anything else it needs.
KVCache = tuple[torch.Tensor, ...]


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store this step's keys and values in the pool.  (Your engine: Chapter 31)

    k_cache, v_cache: one layer's pools, [num_blocks + 1, block_size, Hkv, D], written in
    place (nothing is returned). k, v: [N, Hkv, D], any float dtype; they are stored in the
    pool's dtype. slot_mapping: int64 [N]; entry i is the slot that receives row i of k and
    of v, counted over the whole pool with its block and offset axes taken as one flat axis.
    Afterwards slot slot_mapping[i] of each pool holds row i; no other slot of a request's
    blocks changes. Padding rows carry slot -1: they must land in the pool's very last slot,
    inside the scratch block no request owns, and never be filtered out on the host (that
    would need the number of real rows, a device sync a CUDA graph cannot hold). Nothing
    reads slot_mapping on the host: the write is queued on the device like any other kernel.
    """
    raise NotImplementedError("Your engine: Chapter 31: write_kv")


def raw_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A view that index_copy_ accepts for any element type: one-byte floats (fp8) as uint8."""
    if tensor.dtype.is_floating_point and tensor.element_size() == 1:
        return tensor.view(torch.uint8)
    return tensor


def write_quantized_kv(cache: KVCache, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
                       fmt: str) -> None:
    """Store this step's keys and values in a quantized pool.  (Your engine: Chapter 32)

    cache: (k_codes, v_codes, k_scale, v_scale): codes [num_blocks + 1, block_size, Hkv, D]
    in FORMATS[fmt]'s storage dtype (int8, or a one-byte float for fp8), scales
    [num_blocks + 1, block_size, Hkv] float32; k, v: [N, Hkv, D] float; slot_mapping: int64
    [N], as write_kv takes it (-1: a padding row). Afterwards row n's codes and its scales,
    one per head (Chapter 28's quantize_kv), sit at slot slot_mapping[n] of their pools, so
    codes * scale[..., None] there gives back k[n] (and v[n]) to within scale / 2 per
    element for int8; a padding row touches no request's slot. Nothing else changes.
    Trap: the result must be the same on every device, and some devices have no copy
    kernel for one-byte floats (index_copy_ refuses fp8 on a CPU).
    """
    raise NotImplementedError("Your engine: Chapter 32: write_quantized_kv")


def gather_context(cache: torch.Tensor, table_row: torch.Tensor, length: int) -> torch.Tensor:
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
    graph_safe = False          # it reads the host lists (seq_lens_cpu): a graph would replay them

    def __init__(self, kv_cache_dtype: str = "auto") -> None:
        if kv_cache_dtype != "auto" and kv_cache_dtype not in FORMATS:
            raise ValueError(f"kv_cache_dtype must be 'auto' or one of {sorted(FORMATS)}, got {kv_cache_dtype!r}")
        self.kv_cache_dtype = kv_cache_dtype

    @property
    def quantized(self) -> bool:
        return self.kv_cache_dtype != "auto"

    def allocate(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> KVCache:
        """One layer's pool: (k_cache, v_cache), zero-filled; a quantized pool (Chapter 32)
        stores 8-bit codes and adds (k_scale, v_scale) of shape [num_blocks + 1, block_size, Hkv]."""
        if not self.quantized:
            return tuple(torch.zeros(shape, dtype=dtype, device=device) for _ in "kv")
        codes = FORMATS[self.kv_cache_dtype][0]
        return (torch.zeros(shape, dtype=codes, device=device), torch.zeros(shape, dtype=codes, device=device),
                torch.zeros(shape[:-1], device=device), torch.zeros(shape[:-1], device=device))

    def write(self, cache: KVCache, k: torch.Tensor, v: torch.Tensor, meta: BatchMeta) -> None:
        if len(cache) == 2:
            write_kv(cache[0], cache[1], k, v, meta.slot_mapping)
        else:
            write_quantized_kv(cache, k, v, meta.slot_mapping, self.kv_cache_dtype)

    def forward(self, q: torch.Tensor, cache: KVCache, meta: BatchMeta, scale: float | None = None,
                window: int = 0) -> torch.Tensor:
        """Attention of this step's queries against the pool.  (Your engine: Chapter 31)

        q: [N, H, D], the step's query rows (already rotated); cache: the layer's pool tuple
        (k_cache, v_cache[, k_scales, v_scales]) already holding this step's keys and values;
        meta: the step's BatchMeta; scale: the softmax scale (None: 1 / sqrt(D)); window: a
        sliding window in tokens (0: none, Chapter 42). Returns [N, H, D] in q's dtype.
        Request r owns rows query_start_loc[r] .. query_start_loc[r + 1] - 1; they are the newest
        tokens of its seq_lens[r]-token context, whose keys it reads through block_table[r]
        (the Hkv key heads are shared by H // Hkv query heads each). Each row attends causally to
        the keys at or before its own position and, with window > 0, only to keys less than
        `window` positions behind it. Values come out of the pool as float through
        self.dequantize, so a quantized pool (Chapter 32) reads the same way.
        Sizes come from the host lists meta.query_start_loc_cpu and meta.seq_lens_cpu: no device
        reads. A padding request (seq_len 0, or no rows) contributes nothing: its output rows are
        zero. Each request's rows equal causal_attention on its gathered keys and values.
        """
        raise NotImplementedError("Your engine: Chapter 31: ReferenceBackend.forward")

    @staticmethod
    def dequantize(x: torch.Tensor, cache: KVCache, which: int, meta: BatchMeta, r: int,
                   length: int) -> torch.Tensor:
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


# --- Chapter 32: the whole batch at once ---------------------------------------------------------

@dataclass
class StepPlan:
    """Index tensors that say where each query row and each key of a group of requests
    sits, built once per step and shared by every layer (the batch's layout is the same in
    all of them).

    rows [N]            the step's row numbers of the group's rows (int64); None: all rows
    num_blocks          blocks gathered per request: ceil(largest seq_len / block_size)
    block_table [R, num_blocks]  the block table cut to those columns (int64)
    decode_only         every request has exactly one row, so row r IS request r
    row_request [N]     request index of each query row (int64); None when decode_only
    row_offset [N]      the row's index among its request's rows (int64); None when decode_only
    visible [R, 1, Tq, K]  key j of request r's context may be read by its query i:
                        j <= that query's position (Tq = the group's longest chunk, K = num_blocks *
                        block_size); padded slots (i >= t_r) get a mask too, and
                        nobody reads their output
    query_positions [R, Tq]  position of request r's query slot i (int64, clamped at 0)
    empty_rows [N, 1, 1] the group's rows of padding requests (seq_len 0), whose output must be zero;
                        None when the step has none
    masks               visible intersected with a sliding window, by window size
    """
    rows: torch.Tensor | None
    num_blocks: int
    block_table: torch.Tensor
    decode_only: bool
    row_request: torch.Tensor | None
    row_offset: torch.Tensor | None
    visible: torch.Tensor
    empty_rows: torch.Tensor | None
    query_positions: torch.Tensor
    masks: dict[int, torch.Tensor] = field(default_factory=dict)


class VectorisedBackend(ReferenceBackend):
    """Every request of the step in one gather and one attention call per layer.

    The Python loop of ReferenceBackend becomes three tensor steps: gather every request's
    blocks at once through the block table ([R, num_blocks] indices -> [R, K, Hkv, D]),
    lay the N query rows out as [R, max_query_len] (a decode-only step needs no re-layout:
    row r is request r), and call scaled_dot_product_attention once with a boolean mask
    built from positions. A step that mixes decodes with longer chunks is split in two
    kinds of groups (one call each), so decodes are never padded to a chunk's length, and
    requests of very different context lengths are split again (context_groups), so a
    short context is not gathered out to the longest one; on a CPU a group's gathered
    keys and values also stay small enough to be read back from cache. The plans
    (indices and masks) depend only on the batch, so they are made on the first layer and
    reused by the others.
    Pools, writes and quantized pools (kv_cache_dtype) are ReferenceBackend's."""
    name = "vectorised"

    def __init__(self, kv_cache_dtype: str = "auto") -> None:
        super().__init__(kv_cache_dtype)
        self._plan_key: BatchMeta | None = None
        self._plan: list[StepPlan] = []

    def plan_for(self, meta: BatchMeta, device: torch.device, token_bytes: int = 0) -> list[StepPlan]:
        """The StepPlans of this batch: built on the first layer's call, reused after.
        token_bytes: what one context token's gathered key and value take (0: unknown)."""
        if self._plan_key is not meta:
            self._plan = plan_step(meta, device, token_bytes)
            self._plan_key = meta
        return self._plan

    def forward(self, q: torch.Tensor, cache: KVCache, meta: BatchMeta, scale: float | None = None,
                window: int = 0) -> torch.Tensor:
        """Attention of this step's queries against the pool, one call per group of requests.
        q [N, H, D] -> [N, H, D] in q's dtype; matches ReferenceBackend.forward."""
        kv_heads, head_dim = cache[0].shape[2:]
        plans = self.plan_for(meta, q.device, 2 * kv_heads * head_dim * q.element_size())
        if len(plans) == 1:
            return self.attend_group(q, cache, plans[0], scale, window)
        out = torch.empty_like(q)
        for plan in plans:                      # a few groups, not a loop over requests
            assert plan.rows is not None        # a split step's groups always name their rows
            out.index_copy_(0, plan.rows, self.attend_group(q.index_select(0, plan.rows), cache, plan, scale, window))
        return out

    def attend_group(self, q: torch.Tensor, cache: KVCache, plan: StepPlan, scale: float | None,
                     window: int) -> torch.Tensor:
        """One gather per pool and one attention call for one group's rows q [N, H, D],
        computed in attention_dtype(q) and returned in q's dtype."""
        work = attention_dtype(q)
        keys, values = (self.gather_all(pool, cache, which, plan, work) for which, pool in enumerate(cache[:2]))
        return attend_all(q.to(work), keys, values, plan, scale, window).to(q.dtype)

    def gather_all(self, pool: torch.Tensor, cache: KVCache, which: int, plan: StepPlan,
                   dtype: torch.dtype) -> torch.Tensor:
        """Every request's context from one pool, dequantized when the pool carries scales:
        [R, Hkv, K, D] in `dtype`."""
        rows = gather_blocks(pool, plan.block_table).to(dtype)
        if len(cache) > 2:                       # quantized: per-token scales follow K and V
            rows = rows * gather_blocks(cache[2 + which], plan.block_table).to(dtype).unsqueeze(-1)
        return rows.transpose(1, 2)


def attention_dtype(q: torch.Tensor) -> torch.dtype:
    """The dtype VectorisedBackend attends in: float32 for 16-bit queries on a CPU, q's own
    dtype elsewhere. On a CPU, torch's scaled_dot_product_attention is 3-5x slower in
    bfloat16 than in float32 at decode shapes (16 requests, 9 query heads over 3 key heads,
    64 channels, 64-512 keys; the casts included), and took 38% of a bfloat16 SmolLM2 step;
    the pool and the weights stay 16-bit, only the gathered copy is widened."""
    if q.device.type == "cpu" and q.element_size() < 4:
        return torch.float32
    return q.dtype


def upload_indices(parts: Sequence[Sequence[int]], device: torch.device | str) -> list[torch.Tensor]:
    """Several int64 index lists made on the host, on `device` after ONE copy: one host
    tensor, moved by devices.to_device (pinned, without blocking, on CUDA), then split on
    the device (views).
    Made one by one with torch.tensor(..., device="cuda"), each small tensor would be its
    own blocking copy, a hidden wait for the device in every step."""
    flat = to_device(torch.tensor([x for part in parts for x in part], dtype=torch.int64), device)
    return list(flat.split([len(part) for part in parts]))


# Requests whose longest context is below this many tokens stay in one group: padding them
# costs less than one more gather and attention call per layer.
SPLIT_CONTEXTS_FROM = 256

# Chunks whose longest is below this many rows stay in one group, whatever their lengths.
# Chunks of very different lengths meet in every step that admits requests sharing a prefix:
# the first computes the whole prompt, the others only what follows the blocks they adopt from
# it (run.py core's workload: one 228-row chunk beside fifteen of about 36). Kept together, the
# short ones were laid out as 228 query slots each; split, the workload ran 1.19x faster (CPU
# time, 6 alternating runs), the serving and chat workloads unchanged within noise.
SPLIT_CHUNKS_FROM = 32

# On a CPU, the most bytes of gathered keys and values one group may hold: half of one core's
# L2 cache on the course's machine (2 MiB per core). Attention then reads the copy gather_all
# has just written while it is still in cache; one group holding every request's copy (64
# decodes of 300-800 tokens: 26 MB on the serving workload) goes out to memory and back, and
# lost to the reference loop, whose one request at a time stays cached. Replaying the
# serving workload's attention alone, one group per kind took 1.16x the
# reference's time; groups of 1 MiB 0.86x, of 256 KiB 0.92x, of 4 MiB 0.97x.
GROUP_BYTES_ON_CPU = 1 << 20


def context_groups(requests: list[int], lengths: Sequence[int], token_bytes: int = 0,
                   budget: int | None = None, split_from: int = SPLIT_CONTEXTS_FROM) -> list[list[int]]:
    """Split requests (indices, increasing) by length (lengths[r]: request r's context, or
    its chunk's rows) so that every request's length is more than half its group's longest,
    unless that longest is below split_from; with a budget, also so that a group's gathered
    keys and values (its size x its longest length x token_bytes) stay within budget bytes.
    Each group's indices stay increasing; the groups run from the longest to the shortest."""
    groups: list[list[int]] = []
    for r in sorted(requests, key=lambda r: -lengths[r]):
        if groups:
            group = groups[-1]
            longest = lengths[group[0]]
            similar = 2 * lengths[r] > longest or longest < split_from
            fits = budget is None or (len(group) + 1) * longest * token_bytes <= budget
            if similar and fits:
                group.append(r)
                continue
        groups.append([r])
    return [sorted(group) for group in groups]


def plan_step(meta: BatchMeta, device: torch.device | str, token_bytes: int = 0) -> list[StepPlan]:
    """The plans of one step: its decodes, and apart from them its longer chunks in groups
    of similar chunk length, each of these in groups of similar context length
    (context_groups; token_bytes: one context token's gathered key and value, which on a
    CPU caps a group at GROUP_BYTES_ON_CPU).

    Laying queries out as [R, max_query_len] pads every request to the longest chunk: with
    one 512-token chunk beside 63 decodes that computes about sixty times the scores needed.
    Gathering every context out to the longest does the same to the keys: 60 decodes of 300
    tokens beside 4 of 8,000 would read about ten times the keys needed. Each split
    costs one more gather and attention call per layer and pads only among similar rows.
    A group covering every request (most steps of a small batch) gets rows=None: no row
    selection at all."""
    starts = meta.query_start_loc_cpu
    budget = GROUP_BYTES_ON_CPU if torch.device(device).type == "cpu" and token_bytes else None
    rows = [starts[r + 1] - starts[r] for r in range(meta.num_reqs)]
    singles = [r for r in range(meta.num_reqs) if rows[r] == 1]
    chunks = [r for r in range(meta.num_reqs) if rows[r] > 1]
    kinds = [singles, *context_groups(chunks, rows, split_from=SPLIT_CHUNKS_FROM)]
    groups = [group for kind in kinds
              for group in context_groups(kind, meta.seq_lens_cpu, token_bytes, budget) if group]
    if len(groups) == 1 and len(groups[0]) == meta.num_reqs:
        return [plan_group(meta, None, device)]
    return [plan_group(meta, group, device) for group in groups]


def plan_group(meta: BatchMeta, requests: list[int] | None, device: torch.device | str) -> StepPlan:
    """The StepPlan of some of a step's requests: where their query rows and keys sit.  (Your engine: Chapter 32)

    meta: the step's BatchMeta; requests: the group's request indices, increasing, or None
    for all. With R the group's requests, t_r request r's rows, N their sum, Tq the largest
    t_r and K = num_blocks * block_size, the plan's tensors (on `device`) hold:
      - rows: int64 [N], the group's step rows, request by request (None for all requests);
      - num_blocks: the fewest blocks holding the group's longest context, at least 1;
        block_table: int64 [R, num_blocks], the group's rows of meta.block_table;
      - decode_only: every t_r is 1 (then row_request, row_offset are None: row r is
        request r); else row_request, row_offset: int64 [N], row i's request in the group
        and its index among that request's rows;
      - query_positions: int64 [R, Tq]; slot i < t_r is the position of request r's i-th
        row (its rows are its newest tokens, the last at seq_len - 1); no entry negative;
      - visible: bool [R, 1, Tq, K], key j visible exactly where j <= the slot's position;
      - empty_rows: bool [N, 1, 1], True on rows of padding requests (seq_len 0); None when
        the group has none.
    Example, block_size 4: a (seq_len 9, 3 rows, step rows 0-2) and c (seq_len 4, 4 rows,
    step rows 4-7): rows [0, 1, 2, 4, 5, 6, 7]; num_blocks 3; row_request [0, 0, 0, 1, 1,
    1, 1]; row_offset [0, 1, 2, 0, 1, 2, 3]; query_positions [[6, 7, 8, 9], [0, 1, 2, 3]]
    (a's slot 3 is read by no row).
    Cost contract: sizes come from the host lists (query_start_loc_cpu, seq_lens_cpu), never
    from a device value; the index lists reach the device in one copy, not one per request.
    """
    raise NotImplementedError("Your engine: Chapter 32: plan_group")


def gather_blocks(pool: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """Every request's blocks from one pool in a single indexing call.  (Your engine: Chapter 32)

    pool: [num_blocks + 1, block_size, ...] (K or V rows, or their scales [.., Hkv]);
    block_table: int64 [R, W]. Returns [R, W * block_size, ...]: row r holds request r's
    blocks in its table's order, so its context position p is at [r, p] for every p below
    W * block_size (rows past its seq_len are whatever the blocks hold: the mask hides them).
    A copy; the pool is unchanged.
    Example, block_size 2: table [[5, 1], [2, 2]] -> row 0 is block 5's two rows then block
    1's; row 1 is block 2's rows twice.
    Cost contract: one indexing call for the whole table, whatever R is (no loop over
    requests, no call per block).
    """
    raise NotImplementedError("Your engine: Chapter 32: gather_blocks")


def attend_all(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, plan: StepPlan,
               scale: float | None = None, window: int = 0) -> torch.Tensor:
    """One attention call for every request of a group.  (Your engine: Chapter 32)

    q [N, H, D] (the group's rows, in the group's order); keys, values [R, Hkv, K, D] from
    gather_all; plan: the group's StepPlan, whose row_request/row_offset say where row i
    sits among its request's query slots and whose visible mask says which keys each slot
    may read. Returns [N, H, D] in q's dtype, equal (to float rounding) to
    ReferenceBackend.forward on the same rows: row i attends over the keys plan.visible marks
    for its slot and, when window > 0, only over keys at positions > its own - window.
    Rows of padding requests (plan.empty_rows) come back as zeros.
    Cost contract: ONE call of scaled_dot_product_attention per group, whatever its requests
    and rows; keys and values reach it with their Hkv heads (never repeated to H); a windowed
    mask is built once per step and window, kept in plan.masks[window] for the other layers.
    """
    raise NotImplementedError("Your engine: Chapter 32: attend_all")


# --- the registry ----------------------------------------------------------------------------

_BACKENDS: dict[str, Callable[..., AttentionBackend]] = {}


def register_backend(name: str, factory: Callable[..., AttentionBackend],
                     replace: bool = False) -> Callable[..., AttentionBackend]:
    """Make `get_backend(name, **options)` return factory(**options). Chapter 32 adds its
    kernels this way; re-registering a taken name needs replace=True."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"backend names are non-empty strings, got {name!r}")
    if name in _BACKENDS and not replace:
        raise ValueError(f"attention backend {name!r} is already registered")
    _BACKENDS[name] = factory
    return factory


def available_backends() -> list[str]:
    return sorted(_BACKENDS)


def get_backend(name: str, **options: Any) -> AttentionBackend:
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
register_backend("vectorised", VectorisedBackend)


def lazy_backend(module: str, name: str) -> Callable[..., AttentionBackend]:
    """A factory for the backend class `name` of `module` (relative to this package), whose
    module is imported on the first get_backend, as vLLM's registry resolves a backend by its
    qualified name. The core names a plug-in without importing it: the plug-in imports the
    core (Chapter 32's TritonBackend extends ReferenceBackend), never the other way round."""
    def build(**options: Any) -> AttentionBackend:
        backend_class = getattr(importlib.import_module(module, __package__), name)
        return cast("AttentionBackend", backend_class(**options))
    return build


# Importing triton decides, once, whether kernels are compiled or interpreted: a process that
# never asks for this backend should not make that choice.
register_backend("triton", lazy_backend("..paged_kernels", "TritonBackend"))
