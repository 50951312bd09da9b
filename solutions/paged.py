"""Chapter 25: a paged KV cache, a prefix cache over its blocks, and an engine that uses both.

Chapter 24 gave every request a row of slot_len positions. A request that uses 40 of them
wastes the rest, and two requests that start with the same 200-token system prompt store
those 200 tokens' keys twice. Paging fixes both, the way an operating system's virtual
memory does:

  * K/V live in a pool of fixed-size BLOCKS (block_size positions each) shared by all
    sequences. Per layer the pool is [num_blocks, kv_heads, block_size, head_dim].
  * Each sequence has a BLOCK TABLE: its physical block ids in logical order. Position p
    of the sequence lives in block table[p // block_size], at offset p % block_size.
    Blocks are taken from a free list only when a sequence grows into them, so the only
    waste is the unused tail of each sequence's last block.
  * Blocks are reference counted, so several tables can point at one block. The PREFIX
    CACHE publishes full blocks under a key that is the whole token prefix up to the
    block's end; a new request whose prompt starts with the same tokens adopts those
    blocks instead of recomputing them. The cache holds one reference of its own on each
    published block, so cached blocks outlive their requests until evicted explicitly.

`PagedEngine` serves requests over this cache with Chapter 24's step structure (one
forward call per prefill chunk, one for all decodes) plus prefix sharing, and preemption
by recompute when the pool runs dry.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from .workloads import WorkItem, run_to_completion

if TYPE_CHECKING:
    from .qwen3 import Qwen3ForCausalLM


class OutOfBlocks(RuntimeError):
    """The pool has fewer free blocks than a request needs."""


class PagedKVCache:
    """A pool of KV blocks per layer, a free list, reference counts and block tables.

    k[layer], v[layer]: [num_blocks, kv_heads, block_size, head_dim].
    block_tables[seq_id]: physical block ids in logical order; seq_lens[seq_id]: positions
    of the sequence whose K/V are stored. ref_count[b]: how many tables (and the prefix
    cache) point at block b; a block is on the free list exactly when its count is 0.
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("a paged cache needs at least one block of at least one position")
        shape = (num_blocks, kv_heads, block_size, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.num_blocks, self.block_size = num_blocks, block_size
        self.device = torch.device(device)
        self.free_blocks = deque(range(num_blocks))
        self.ref_count = [0] * num_blocks
        self.block_tables: dict[Hashable, list[int]] = {}
        self.seq_lens: dict[Hashable, int] = {}

    @classmethod
    def for_model(cls, model: Qwen3ForCausalLM, num_blocks: int, block_size: int) -> PagedKVCache:
        cfg, weight = model.cfg, next(model.parameters())
        return cls(cfg.num_hidden_layers, num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim,
                   weight.dtype, weight.device)

    # -- accounting ---------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold num_tokens positions."""
        return -(-num_tokens // self.block_size)

    def incref(self, block: int) -> None:
        if self.ref_count[block] == 0:
            raise ValueError(f"block {block} is free; only a block in use can gain a reference")
        self.ref_count[block] += 1

    def decref(self, block: int) -> None:
        if self.ref_count[block] <= 0:
            raise ValueError(f"block {block} has no reference to drop (double free?)")
        self.ref_count[block] -= 1
        if self.ref_count[block] == 0:
            self.free_blocks.append(block)

    def add_sequence(self, seq_id: Hashable, shared_blocks: Sequence[int] = ()) -> None:
        """Start a sequence, optionally on top of full blocks another sequence computed (a
        prefix-cache hit): the table starts with them, each gains a reference, and the
        sequence's length starts at len(shared_blocks) * block_size."""
        if seq_id in self.block_tables:
            raise ValueError(f"sequence {seq_id!r} already exists")
        for block in shared_blocks:
            self.incref(block)
        self.block_tables[seq_id] = list(shared_blocks)
        self.seq_lens[seq_id] = len(shared_blocks) * self.block_size

    def reserve(self, seq_id: Hashable, num_tokens: int) -> None:
        """Make room for num_tokens more positions of seq_id.  (Your engine: Chapter 25)

        seq_id: a sequence already in block_tables; num_tokens >= 0: positions about to be
        written after its seq_lens[seq_id] stored ones.
        Afterwards the sequence's table has exactly blocks_for(seq_lens[seq_id] + num_tokens)
        blocks (never fewer than before: reserving less than is held adds nothing); each added
        block came off the FRONT of free_blocks, in order, and has ref_count 1; seq_lens is
        unchanged (advance moves it once the K/V are written).
        Errors: OutOfBlocks, saying how many blocks are needed and how many are free, when the
        free list is too short; then nothing has changed (all or nothing), so the caller can
        evict or preempt and try again.
        """
        table = self.block_tables[seq_id]
        missing = self.blocks_for(self.seq_lens[seq_id] + num_tokens) - len(table)
        if missing > len(self.free_blocks):
            raise OutOfBlocks(f"sequence {seq_id!r} needs {missing} more blocks; {len(self.free_blocks)} are free")
        for _ in range(max(0, missing)):
            block = self.free_blocks.popleft()
            self.ref_count[block] = 1
            table.append(block)

    def free(self, seq_id: Hashable) -> None:
        """Drop the sequence: each of its blocks loses one reference (shared ones survive)."""
        for block in self.block_tables.pop(seq_id):
            self.decref(block)
        del self.seq_lens[seq_id]

    def advance(self, seq_id: Hashable, num_tokens: int) -> None:
        self.seq_lens[seq_id] += num_tokens

    # -- data ---------------------------------------------------------------------------
    def write(self, layer: int, seq_id: Hashable, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [kv_heads, T, head_dim] at positions start .. start + T - 1 of seq_id
        (its blocks must be reserved): one scatter over (block, offset) pairs."""
        positions = torch.arange(start, start + k.shape[1], device=self.device)
        table = torch.tensor(self.block_tables[seq_id], dtype=torch.long, device=self.device)
        blocks, offsets = table[positions // self.block_size], positions % self.block_size
        # Advanced indices on axes 0 and 2 with a slice between: the indexed view is [T, kv_heads, D].
        self.k[layer][blocks, :, offsets] = k.transpose(0, 1)
        self.v[layer][blocks, :, offsets] = v.transpose(0, 1)

    def gather(self, layer: int, seq_id: Hashable, length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values of positions 0 .. length - 1 of seq_id, contiguous.
        (Your engine: Chapter 25)

        layer: which layer's pool (self.k[layer], self.v[layer], each [num_blocks, kv_heads,
        block_size, head_dim]); seq_id: a sequence in block_tables; length: how many positions
        (default seq_lens[seq_id]; at most its table's blocks * block_size).
        Returns (k, v), each [kv_heads, length, head_dim] in the pool's dtype and device, column
        p holding what write stored for position p of the sequence, wherever its block lies in
        the pool. Reads only; the pool and the tables are unchanged. Trap: the slots of the last
        block past `length` hold another request's leftovers and must not appear in the result.
        """
        length = self.seq_lens[seq_id] if length is None else length
        table = self.block_tables[seq_id][:self.blocks_for(length)]
        index = torch.tensor(table, dtype=torch.long, device=self.device)

        def read(pool: torch.Tensor) -> torch.Tensor:
            blocks = pool.index_select(0, index)                      # [n, Hkv, bs, D]
            heads, dim = blocks.shape[1], blocks.shape[3]
            return blocks.transpose(0, 1).reshape(heads, -1, dim)[:, :length]

        return read(self.k[layer]), read(self.v[layer])

    def view(self, seq_ids: Iterable[Hashable]) -> PagedView:
        """A cache object for one model call over these sequences (see PagedView)."""
        return PagedView(self, list(seq_ids))

    # -- measurements -------------------------------------------------------------------
    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free

    def stored_tokens(self) -> int:
        return sum(self.seq_lens.values())


class PagedView:
    """The cache protocol Qwen3Model expects (length, update, advance) over some sequences.

    update writes each row's new K/V into its sequence's blocks, then gathers every row's
    keys so far; rows of different lengths are right-padded with zeros to the longest.
    The padding is never seen: causal attention only lets a query at slot s read keys at
    slots <= s, and a row's padding lies beyond its own last slot.
    """

    def __init__(self, kv: PagedKVCache, seq_ids: list[Hashable]) -> None:
        self.kv, self.seq_ids = kv, seq_ids
        self._starts = [kv.seq_lens[s] for s in seq_ids]

    @property
    def length(self) -> int | torch.Tensor:
        if len(self.seq_ids) == 1:
            return self._starts[0]
        return torch.tensor(self._starts, dtype=torch.long, device=self.kv.device)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        new = k.shape[2]
        rows_k, rows_v = [], []
        for b, (seq_id, start) in enumerate(zip(self.seq_ids, self._starts)):
            self.kv.write(layer, seq_id, start, k[b], v[b])
            keys, values = self.kv.gather(layer, seq_id, start + new)
            rows_k.append(keys)
            rows_v.append(values)
        if len(rows_k) == 1:
            return rows_k[0][None], rows_v[0][None]
        width = max(t.shape[1] for t in rows_k)
        out_k = k.new_zeros((len(rows_k), k.shape[1], width, k.shape[3]))
        out_v = torch.zeros_like(out_k)
        for b, (keys, values) in enumerate(zip(rows_k, rows_v)):
            out_k[b, :, :keys.shape[1]] = keys
            out_v[b, :, :values.shape[1]] = values
        return out_k, out_v

    def advance(self, num_tokens: int) -> None:
        for seq_id in self.seq_ids:
            self.kv.advance(seq_id, num_tokens)


class PrefixCache:
    """Full blocks published under the whole token prefix that ends with them.

    entries maps key -> block id, where the key of block i of a sequence is
    tuple(tokens[:(i + 1) * block_size]): a block's K/V depend on every token before it,
    so nothing shorter identifies them. The cache holds one reference on each published
    block. entries is kept in LRU order (least recently used first), with every prefix
    at least as recent as its extensions, so eviction removes leaves before their parents.
    """

    def __init__(self, kv: PagedKVCache) -> None:
        self.kv = kv
        self.entries: OrderedDict[tuple[int, ...], int] = OrderedDict()   # token prefix -> block id
        self.queries = self.hits = 0            # blocks looked up / found, by match()

    def __len__(self) -> int:
        return len(self.entries)

    def _key(self, tokens: Sequence[int], i: int) -> tuple[int, ...]:
        return tuple(tokens[:(i + 1) * self.kv.block_size])

    def match(self, tokens: Sequence[int], max_tokens: int | None = None) -> list[int]:
        """The cached blocks that hold the longest cached prefix of tokens.
        (Your engine: Chapter 25)

        tokens: a sequence of ints; max_tokens: consider only tokens[:max_tokens] (default all;
        the engine passes len(prompt) - 1, because the last prompt token must be computed to
        produce logits). Only full blocks count: block i covers tokens[i*bs:(i+1)*bs] and is
        found when its key (self._key(tokens, i), the whole prefix ending with it) is in entries.
        Returns the block ids of blocks 0, 1, ... up to the first one not found, in order (a
        list of ints, possibly empty). No references are taken here.
        Afterwards: self.queries grew by the number of full blocks looked at (the first miss
        included, nothing after it) and self.hits by the number found; the found keys are the
        most recently used entries, ordered so that every prefix is at least as recent as its
        extensions (the first block's key last in entries), which is what lets evict remove
        leaves before their parents.
        """
        limit = len(tokens) if max_tokens is None else min(max_tokens, len(tokens))
        found = []
        for i in range(limit // self.kv.block_size):
            self.queries += 1
            block = self.entries.get(self._key(tokens, i))
            if block is None:
                break
            found.append(block)
        self.hits += len(found)
        for i in reversed(range(len(found))):
            self.entries.move_to_end(self._key(tokens, i))
        return found

    def publish(self, tokens: Sequence[int], blocks: Sequence[int]) -> int:
        """Publish the full blocks of a sequence: blocks[i] holds tokens[i*bs:(i+1)*bs].

        Each newly published block gains the cache's reference. A key already present keeps
        its block (two requests computed the same prefix at once: the first one wins, and
        the duplicate is freed with its request). Returns how many blocks were added."""
        count = min(len(tokens) // self.kv.block_size, len(blocks))
        added = 0
        for i in range(count):
            key = self._key(tokens, i)
            if key not in self.entries:
                self.entries[key] = blocks[i]
                self.kv.incref(blocks[i])
                added += 1
        for i in reversed(range(count)):                 # keep parents at least as recent as children
            self.entries.move_to_end(self._key(tokens, i))
        return added

    def num_evictable(self) -> int:
        """Blocks only the cache still references: evicting them frees them."""
        return sum(1 for block in self.entries.values() if self.kv.ref_count[block] == 1)

    def evict(self, num_blocks: int | None = None) -> int:
        """Free up to num_blocks cached blocks (all that can be freed when None); returns how
        many were freed.  (Your engine: Chapter 25)

        num_blocks: an int >= 0 or None. Returns the number of blocks put back on the free list
        (an int, <= num_blocks).
        Which: the freed blocks are the least recently used of the entries whose block only the
        cache references (ref_count == 1); an entry whose block a sequence still uses stays,
        since removing it would free nothing. A freed block has no entry left (it will be
        reused for other tokens) and ref_count 0. The surviving entries keep their order.
        """
        freed = 0
        for key in list(self.entries):
            if num_blocks is not None and freed >= num_blocks:
                break
            block = self.entries[key]
            if self.kv.ref_count[block] == 1:
                del self.entries[key]
                self.kv.decref(block)
                freed += 1
        return freed


@dataclass(eq=False)
class PagedRequest:
    request_id: str
    prompt_ids: list[int]
    max_new_tokens: int
    stop_token_ids: tuple[int, ...] = ()
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0          # tokens of prompt + output whose K/V are in the cache
    num_published: int = 0         # full blocks already given to the prefix cache
    counted: bool = False          # prompt counted in the hit-rate statistics

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids


class PagedEngine:
    """Chapter 24's engine on a paged cache, with prefix sharing and preemption.

    Same API as ContinuousBatchingEngine: add_request, step, has_unfinished, run, steps,
    forward_calls. A request's work is always "compute tokens[num_computed:]": a fresh
    request prefills its prompt (minus what the prefix cache supplies), a decoding request
    has exactly one such token (its newest), and a preempted request resumes by prefilling
    prompt + output again. At most max_num_seqs requests run at once; when the pool runs
    out of blocks the engine first evicts prefix-cache entries, then preempts the youngest
    running request (frees its blocks; it waits at the head of the queue to recompute).
    """

    def __init__(self, model: Qwen3ForCausalLM, num_blocks: int = 64, block_size: int = 16, max_num_seqs: int = 8,
                 chunk_size: int | None = None, enable_prefix_caching: bool = True,
                 eos_token_id: int | None = None) -> None:
        self.model = model
        self.kv = PagedKVCache.for_model(model, num_blocks, block_size)
        self.prefix_cache = PrefixCache(self.kv) if enable_prefix_caching else None
        self.max_num_seqs, self.chunk_size = max_num_seqs, chunk_size
        self.eos_token_id = eos_token_id if eos_token_id is not None else getattr(model.cfg, "eos_token_id", None)
        self.device = next(model.parameters()).device
        self.limit = getattr(model, "context_limit", 1 << 30)
        self.waiting: deque[PagedRequest] = deque()
        self.running: list[PagedRequest] = []   # admission order: the last is preempted first
        self.steps = self.forward_calls = 0
        self.stats = {"prompt_tokens": 0, "cached_tokens": 0, "computed_tokens": 0, "preemptions": 0}

    @property
    def prefix_hit_rate(self) -> float:
        """Fraction of admitted prompt tokens whose K/V came from the prefix cache."""
        return self.stats["cached_tokens"] / max(1, self.stats["prompt_tokens"])

    def add_request(self, request_id: str, prompt_ids: Iterable[int], max_new_tokens: int,
                    stop_token_ids: Iterable[int] = ()) -> None:
        prompt_ids = [int(t) for t in prompt_ids]
        if not prompt_ids:
            raise ValueError(f"{request_id}: empty prompt")
        if max_new_tokens < 1:
            raise ValueError(f"{request_id}: max_new_tokens must be at least 1")
        need = self.kv.blocks_for(len(prompt_ids) + max_new_tokens - 1)
        if need > self.kv.num_blocks:
            raise ValueError(f"{request_id}: needs {need} blocks but the pool has {self.kv.num_blocks}")
        self.waiting.append(PagedRequest(request_id, prompt_ids, max_new_tokens, tuple(stop_token_ids)))

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def run(self, items: Iterable[WorkItem]) -> dict[str, list[int]]:
        """Serve WorkItems (Chapter 22) to completion; returns {request_id: output token ids}."""
        return run_to_completion(self, items)

    # -- a step -------------------------------------------------------------------------
    def step(self) -> list[tuple[str, list[int], bool]]:
        """Decode every decoding request in one call, then run one prefill chunk per
        prefilling request, admitting waiting requests just before their first chunk (so a
        request sees the blocks the previous prefill call of this very step published).
        Returns [(request_id, new_token_ids, finished)]."""
        decoding = []
        for request in list(self.running):           # oldest first: they get blocks first
            if request in self.running and self._todo(request) == 1 and self._reserve(request, 1):
                decoding.append(request)
        decoding = [r for r in decoding if r in self.running]
        events = []
        if decoding:
            logits = self._forward([[r.tokens[-1]] for r in decoding], decoding)
            for request, token in zip(decoding, logits.argmax(dim=-1).tolist()):
                request.num_computed += 1
                events.append(self._emit(request, token))
        prefilling = [r for r in self.running if self._todo(r) > 1]
        while True:
            if prefilling:
                request = prefilling.pop(0)
                if request not in self.running:         # preempted by an older request's growth
                    continue
            elif self.waiting and len(self.running) < self.max_num_seqs and self._admit():
                request = self.running[-1]
            else:
                break
            n = self._todo(request) if self.chunk_size is None else min(self._todo(request), self.chunk_size)
            if not self._reserve(request, n):
                continue
            start = request.num_computed
            logits = self._forward([request.tokens[start:start + n]], [request])
            request.num_computed += n
            self._publish(request)
            if request.num_computed == len(request.tokens):
                events.append(self._emit(request, int(logits[0].argmax())))
        self.steps += 1
        return events

    @staticmethod
    def _todo(request: PagedRequest) -> int:
        """Tokens of the request whose K/V are not in the cache yet (its newest is always one)."""
        return len(request.tokens) - request.num_computed

    def _admit(self) -> bool:
        """Admit the oldest waiting request if the blocks of its first chunk can be had
        (evicting prefix-cache entries if need be); a prefix-cache hit starts it past its
        cached blocks. Returns whether it was admitted."""
        request = self.waiting[0]
        tokens = request.tokens
        shared = self.prefix_cache.match(tokens, len(tokens) - 1) if self.prefix_cache else []
        self.kv.add_sequence(request.request_id, shared)
        request.num_published = len(shared)
        request.num_computed = len(shared) * self.kv.block_size
        first = len(tokens) - request.num_computed
        if self.chunk_size is not None:
            first = min(first, self.chunk_size)
        if not self._make_room(self.kv.blocks_for(request.num_computed + first) - len(shared)):
            self.kv.free(request.request_id)
            return False
        self.waiting.popleft()
        self.running.append(request)
        if not request.counted:                         # a resumed request was counted already
            request.counted = True
            self.stats["prompt_tokens"] += len(tokens)
            self.stats["cached_tokens"] += request.num_computed
        return True

    def _make_room(self, blocks: int) -> bool:
        """Evict prefix-cache entries until `blocks` blocks are free; False if impossible."""
        if blocks > self.kv.num_free and self.prefix_cache is not None:
            self.prefix_cache.evict(blocks - self.kv.num_free)
        return blocks <= self.kv.num_free

    def _reserve(self, request: PagedRequest, n: int) -> bool:
        """Blocks for n more tokens of request, evicting and then preempting younger requests."""
        while True:
            table = self.kv.block_tables[request.request_id]
            need = self.kv.blocks_for(request.num_computed + n) - len(table)
            if self._make_room(need):
                self.kv.reserve(request.request_id, n)
                return True
            victim = self.running[-1]
            self._preempt(victim)
            if victim is request:
                return False

    def _preempt(self, request: PagedRequest) -> None:
        self.running.remove(request)
        self.kv.free(request.request_id)
        request.num_computed = request.num_published = 0
        self.waiting.appendleft(request)
        self.stats["preemptions"] += 1

    def _forward(self, token_rows: list[list[int]], requests: list[PagedRequest]) -> torch.Tensor:
        self.forward_calls += 1
        self.stats["computed_tokens"] += sum(len(row) for row in token_rows)
        ids = torch.tensor(token_rows, dtype=torch.long, device=self.device)
        with torch.inference_mode():
            logits = self.model(ids, cache=self.kv.view([r.request_id for r in requests]))
        return logits[:, -1]

    def _publish(self, request: PagedRequest) -> None:
        """Give the request's newly completed full blocks to the prefix cache."""
        if self.prefix_cache is None:
            return
        full = request.num_computed // self.kv.block_size
        if full > request.num_published:
            table = self.kv.block_tables[request.request_id]
            self.prefix_cache.publish(request.tokens[:full * self.kv.block_size], table[:full])
            request.num_published = full

    def _emit(self, request: PagedRequest, token: int) -> tuple[str, list[int], bool]:
        request.output_ids.append(int(token))
        self._publish(request)
        finished = (len(request.output_ids) >= request.max_new_tokens or token == self.eos_token_id
                    or token in request.stop_token_ids
                    or len(request.prompt_ids) + len(request.output_ids) >= self.limit)
        if finished:
            self.running.remove(request)
            self.kv.free(request.request_id)
        return request.request_id, [int(token)], finished
