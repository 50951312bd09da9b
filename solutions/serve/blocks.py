"""Chapter 31: the block pool, its reference counts and the prefix cache over it.

Every block is in one of three states:

    in use        ref_count > 0; owned by one or more running requests
    cached-free   ref_count == 0 but it still carries its hash: findable by the prefix
                  cache and adoptable for free, yet also next in line for reuse
    free          ref_count == 0, no hash: plain empty space

Both kinds of free block sit in one LRU queue (front = reused first). A block loses its
hash only when the allocator hands it to someone else, never when it is freed or adopted.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .request import Request

ROOT_PARENT = b"\x00chain-root"


def hash_block(parent: bytes | None, tokens: Sequence[int], extra: Iterable[Hashable] = ()) -> bytes:
    """The prefix-cache key of one full block.  (Your engine: Chapter 31)

    parent: the key of the block before it, or None for a sequence's first block; tokens: the
    block's token ids; extra: anything else that changes its K/V (an adapter, image hashes, a
    tenant's salt). Returns 16 bytes: the BLAKE2b digest (digest_size=16) of, in this order,
    the parent key (ROOT_PARENT when parent is None), the tokens as native signed 64-bit
    integers (array("q", ...)), and, only when extra is non-empty, repr(tuple(extra)) in
    UTF-8. The exact bytes are part of the contract (the notebook checks them against
    the reference's).
    Because the parent is part of the input, equal keys mean equal whole prefixes, not just
    equal blocks. Pure: same inputs, same key, in every process. Never Python's hash() or any
    non-cryptographic hash: a forged collision would let one user read another's K/V.
    """
    digest = hashlib.blake2b(digest_size=16)
    digest.update(ROOT_PARENT if parent is None else parent)
    digest.update(array("q", tokens).tobytes())
    if extra:
        digest.update(repr(tuple(extra)).encode())
    return digest.digest()


class BlockManager:
    """Hands out blocks of `block_size` token slots from a pool of `num_blocks`."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"a pool needs >= 1 block of >= 1 slot, got {num_blocks} x {block_size}")
        self.block_size, self.num_blocks = block_size, num_blocks
        self.enable_prefix_caching = bool(enable_prefix_caching)
        self.block_hash: list[bytes | None] = [None] * num_blocks   # key while published (in use or cached-free)
        self.ref_count = [0] * num_blocks
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))   # LRU, front first out
        self.cached: dict[bytes, int] = {}             # key -> block id
        self.req_blocks: dict[str, list[int]] = {}     # request id -> its blocks, logical order
        self.num_registered: dict[str, int] = {}       # request id -> how many leading blocks are published
        self.stats = {"queries": 0, "hits": 0, "evictions": 0}

    # --- bookkeeping ----------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Blocks allocatable now (free and cached-free)."""
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks

    @property
    def hit_rate(self) -> float:
        """Share of looked-up prompt tokens that the prefix cache supplied."""
        return self.stats["hits"] / self.stats["queries"] if self.stats["queries"] else 0.0

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def state(self, block: int) -> str:
        """"used", "cached" (cached-free) or "free": for pictures and tests."""
        if self.ref_count[block] > 0:
            return "used"
        return "cached" if self.block_hash[block] is not None else "free"

    def update_hashes(self, request: Request) -> list[bytes]:
        """Extend request.block_hashes over every full block of its known tokens (tokens that
        are still placeholders, Chapter 33, are not known yet). Each key chains on the last."""
        keys, size = request.block_hashes, self.block_size
        known = request.num_tokens - request.num_placeholders
        for start in range(len(keys) * size, known - size + 1, size):
            keys.append(hash_block(keys[-1] if keys else None, request.token_ids[start:start + size],
                                   request.cache_key))
        return keys

    def forget_lookup(self, request: Request, cached_blocks: Sequence[int]) -> None:
        """Take back the statistics of a find_cached_prefix whose admission did not happen:
        the lookup is repeated when the request is tried again, and must count once."""
        if self.enable_prefix_caching and request.params.prompt_logprobs is None:
            self.stats["queries"] -= request.num_tokens
            self.stats["hits"] -= len(cached_blocks) * self.block_size

    def _pop_free(self) -> int:
        """Take the least recently freed block for new contents; if it was cached-free, this
        is the moment it leaves the prefix cache."""
        block, _ = self.free_queue.popitem(last=False)
        key = self.block_hash[block]
        if key is not None:
            if self.cached.get(key) == block:
                del self.cached[key]
            self.block_hash[block] = None
            self.stats["evictions"] += 1
        self.ref_count[block] = 1
        return block

    # --- the stubs --------------------------------------------------------------------------

    def find_cached_prefix(self, request: Request) -> list[int]:
        """The blocks of the longest cached run at the start of request.  (Your engine: Chapter 31)

        Returns the block ids (list[int], logical order) whose keys (self.update_hashes(request))
        are published in self.cached for the request's first blocks, stopping at the first block
        that is not. Read-only for the blocks: some may be cached-free (ref_count 0, in the free
        queue); adopting them is allocate_slots' job.
        Trap: the result never covers the request's LAST token, even when every block is cached:
        its logits choose the next token, so at least one token is always computed (a 32-token
        prompt in 16-token blocks reuses at most one block, a 33-token one two). Returns [] with
        prefix caching off or when
        params.prompt_logprobs is set (every prompt position must run then).
        Statistics: every call adds num_tokens to stats["queries"] and the number of tokens found
        (block_size per block) to stats["hits"], even when it finds nothing (the scheduler undoes
        a lookup that did not lead to admission with forget_lookup).
        """
        if not self.enable_prefix_caching or request.params.prompt_logprobs is not None:
            return []
        keys = self.update_hashes(request)
        usable = (request.num_tokens - 1) // self.block_size    # blocks that end before the last token
        run: list[int] = []
        while len(run) < usable and keys[len(run)] in self.cached:
            run.append(self.cached[keys[len(run)]])
        self.stats["hits"] += self.block_size * len(run)
        self.stats["queries"] += request.num_tokens
        return run

    def allocate_slots(self, request: Request, num_new_tokens: int, cached_blocks: Sequence[int] = ()) -> bool:
        """Give request room for num_new_tokens more tokens.  (Your engine: Chapter 31)

        cached_blocks: block ids from find_cached_prefix, adopted before the new tokens. On
        success (returns True) the request owns, in self.req_blocks[id] and in logical order, its
        old blocks, then cached_blocks, then just as many fresh blocks from the free queue
        (self._pop_free) as are still missing to hold num_computed_tokens +
        len(cached_blocks) * block_size + num_new_tokens tokens (none if it holds enough).
        Every adopted block gains one reference, leaves the free queue if it was cached-free,
        and keeps its key; when any were adopted,
        self.num_registered[id] == len(cached_blocks) (they are already published).
        When the free queue cannot cover it, returns False and changes NOTHING (not even an empty
        entry for a request that held no block). Trap: an adopted cached-free block leaves the
        free queue too, so it costs one of the free blocks counted for the fresh ones.
        """
        owned = self.req_blocks.setdefault(request.request_id, [])
        tokens = request.num_computed_tokens + len(cached_blocks) * self.block_size + num_new_tokens
        fresh = max(0, self.blocks_for(tokens) - len(owned) - len(cached_blocks))
        idle_adopted = sum(self.ref_count[b] == 0 for b in cached_blocks) if cached_blocks else 0
        if fresh + idle_adopted > self.num_free:
            if not owned:
                del self.req_blocks[request.request_id]     # leave no trace of a failed first try
            return False
        for block in cached_blocks:
            if self.ref_count[block] == 0:
                self.free_queue.pop(block)
            self.ref_count[block] += 1
            owned.append(block)
        owned.extend(self._pop_free() for _ in range(fresh))
        if cached_blocks:
            self.num_registered[request.request_id] = len(cached_blocks)
        return True

    def cache_full_blocks(self, request: Request, num_tokens: int | None = None) -> None:
        """Publish request's full blocks under their keys.  (Your engine: Chapter 31)

        num_tokens: how many leading tokens count as written (None: num_computed_tokens). The
        blocks considered are the request's full blocks among those tokens (also limited by the
        blocks it owns and the keys it has), after the self.num_registered[id] it already
        published; afterwards num_registered[id] is that full count. A block is published
        (self.block_hash[b] = key, self.cached[key] = b) only if it has no key yet and its key is
        not already taken: the first block published under a key keeps it, and a duplicate
        computed by another request stays private. Idempotent; does nothing with prefix caching
        off.
        Blocks are published as soon as they are allocated, before the forward pass writes them:
        safe, because within one flattened step every layer writes all K/V before any attention
        reads, so a request that adopts such a block in the same step reads it written.
        """
        if not self.enable_prefix_caching:
            return
        rid = request.request_id
        owned = self.req_blocks.get(rid, ())
        keys = self.update_hashes(request)
        upto = request.num_computed_tokens if num_tokens is None else num_tokens
        full = min(upto // self.block_size, len(keys), len(owned))
        done = self.num_registered.get(rid, 0)
        for i in range(done, full):
            block, key = owned[i], keys[i]
            if self.block_hash[block] is None and key not in self.cached:
                self.block_hash[block] = key
                self.cached[key] = block
        if full > done:
            self.num_registered[rid] = full

    def free(self, request: Request) -> None:
        """Drop request's hold on all its blocks.  (Your engine: Chapter 31)

        Afterwards the request has no entry in self.req_blocks or self.num_registered; each of
        its blocks has one reference less, and a block left with none joins the BACK of the free
        queue keeping its key (cached-free, reusable by a later lookup until evicted). Blocks are
        released in reverse logical order, so the request's tail (unique to it) is reused before
        its head (a shared system prompt, the likeliest to be hit again). Freeing a request that
        holds nothing is a no-op. A reference count going below zero is a bug elsewhere: raise
        RuntimeError naming the block.
        """
        for block in reversed(self.req_blocks.pop(request.request_id, [])):
            left = self.ref_count[block] - 1
            if left < 0:
                raise RuntimeError(f"block {block} released more times than it was taken "
                                   f"(request {request.request_id!r})")
            self.ref_count[block] = left
            if left == 0:
                self.free_queue[block] = None
        self.num_registered.pop(request.request_id, None)

    # --- the rest ---------------------------------------------------------------------------

    def trim(self, request: Request, num_tokens: int) -> None:
        """Give back the blocks past the first num_tokens tokens (rejected draft tokens,
        Chapter 37). Their contents are wrong for their keys, so they are unpublished."""
        owned = self.req_blocks.get(request.request_id, [])
        keep = self.blocks_for(num_tokens)
        for block in reversed(owned[keep:]):
            self.ref_count[block] -= 1
            if self.ref_count[block] == 0:
                key = self.block_hash[block]
                if key is not None and self.cached.get(key) == block:
                    del self.cached[key]
                self.block_hash[block] = None
                self.free_queue[block] = None
        del owned[keep:]
        if self.num_registered.get(request.request_id, 0) > keep:
            self.num_registered[request.request_id] = keep

    def prepare_store(self, keys: Sequence[bytes]) -> dict[int, int]:
        """Make room for K/V computed somewhere else (another engine's prefill, Chapter 41)
        under their prefix-cache keys; returns {i: block}, one entry for each keys[i] that
        this call newly cached, with the block now cached under it. Those blocks hold no
        K/V of theirs yet: the caller owes them the contents of their keys before the next
        step. A key that was cached already has no entry (its block keeps its contents).
        Example: keys [a, b, c], a cached already in block 2, blocks 5 and 9 taken for b
        and c -> {1: 5, 2: 9}.

        keys: one sequence's chain of block keys (hash_block's), its first block first.
        Afterwards the longest leading run of keys that fits is cached here: each key k of
        the run has a block b with self.cached[k] == b and self.block_hash[b] == k, so a
        request whose prompt starts with those tokens finds them with find_cached_prefix. A
        key already cached keeps its block (nothing to write); the others get blocks taken
        from the free queue (evicting whatever those held), cached-free (ref_count 0). The
        run's cached-free blocks then sit at the BACK of the free queue, tail first, as
        free() leaves a finished request's: reused last, the head of the chain after its tail.
        Fitting: a lookup stops at the first missing key, so only a leading run is worth
        storing. The run ends before the first key that would need more free blocks than
        the queue holds, counting the run's cached-free blocks too: making room never
        evicts a block of the run itself.
        Raises ValueError, changing nothing, with prefix caching off (no lookup would find
        the blocks), when a key is not bytes, or when a key appears twice (a chain never
        repeats a key). vLLM V1's CPU offloading manager calls this step prepare_store too.
        """
        if not self.enable_prefix_caching:
            raise ValueError("prepare_store: prefix caching is off, so no lookup would ever find stored blocks")
        for i, key in enumerate(keys):
            if not isinstance(key, bytes):
                raise ValueError(f"prepare_store: key {i} is a {type(key).__name__}, not the bytes hash_block gives")
        if len(set(keys)) != len(keys):
            first = next(i for i, key in enumerate(keys) if key in keys[:i])
            raise ValueError(f"prepare_store: key {first} repeats an earlier key; a chain of block keys never does")
        run, room = 0, self.num_free
        for key in keys:
            block = self.cached.get(key)
            if block is None or self.ref_count[block] == 0:    # a new block, or a free one to keep
                if room == 0:
                    break
                room -= 1
            run += 1
        kept = [self.cached[key] for key in keys[:run] if key in self.cached]
        idle = [block for block in kept if self.ref_count[block] == 0]
        for block in idle:                                     # out of reach while new blocks are taken
            del self.free_queue[block]
        stored = {}
        for i, key in enumerate(keys[:run]):
            if key not in self.cached:
                block = self._pop_free()
                self.ref_count[block] = 0
                self.block_hash[block] = key
                self.cached[key] = block
                stored[i] = block
        for key in reversed(keys[:run]):                       # back of the queue, tail first
            block = self.cached[key]
            if self.ref_count[block] == 0:
                self.free_queue[block] = None
        return stored

    def reset_prefix_cache(self) -> None:
        """Forget every cached-free block (new weights make old K/V wrong). Blocks in use keep
        their keys: their owners still rely on them."""
        for block in self.free_queue:
            self.block_hash[block] = None
        self.cached = {key: b for key, b in self.cached.items() if self.ref_count[b] > 0}
