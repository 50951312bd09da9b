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

    parent: the previous block's key (bytes) or None for a sequence's first block;
    tokens: the block's token ids; extra: anything else that changes its K/V (adapter,
    image hashes, a tenant's salt). Returns a 16-byte digest: BLAKE2b with digest_size=16,
    fed the parent key (or a fixed root marker), the tokens packed as 64-bit integers
    (array("q", tokens).tobytes()) and, when extra is non-empty, repr(tuple(extra)).
    Because the parent key is hashed in, equal keys mean equal WHOLE prefixes.
    Never Python's hash(): a user who can forge a collision could read another user's K/V.
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

        Returns a list of block ids (possibly cached-free: do not touch their state here).
        Walk request's block keys (self.update_hashes) from the first and stop at the first
        key missing from self.cached. Trap: never match the block holding the LAST token:
        its logits choose the first output token, so at least one token must be computed.
        Only keys of blocks that end before the last token count: (num_tokens - 1) //
        block_size of them (a 32-token prompt with 16-token blocks reuses at most one).
        Returns [] with prefix caching off, or when params.prompt_logprobs is set (every prompt
        position must then run). Statistics: stats["queries"] += num_tokens,
        stats["hits"] += tokens found.
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

        The request will then hold num_computed_tokens + len(cached_blocks) * block_size +
        num_new_tokens tokens: first adopt cached_blocks (from find_cached_prefix, appended
        to self.req_blocks[id] in order, ref_count + 1, taken out of the free queue if they
        were cached-free, KEEPING their hash), then pop fresh blocks (self._pop_free) for
        whatever is still missing. Returns True, or False with NOTHING changed when the free
        blocks do not suffice. Trap: an adopted cached-free block leaves the free queue too,
        so it uses up one of the free blocks you counted. When blocks were adopted, record
        that they are published: self.num_registered[id] = len(cached_blocks).
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

        Covers the full blocks among its first num_tokens tokens (default:
        num_computed_tokens), also limited by how many blocks and keys it has. Start after the
        self.num_registered[id] blocks already published, and record the new count. Publish
        block b under key k (self.block_hash[b] = k, self.cached[k] = b) only when b has no
        key yet and k is not taken: the FIRST block published under a key wins, and a
        duplicate computed by another request stays private (no key).
        Publishing happens at allocation time, before the forward pass computes the block:
        safe, because in one flattened step every layer writes all K/V before any attention
        reads them, so a request adopting the block in the same step reads it written.
        Does nothing with prefix caching off.
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

        Pop its list from self.req_blocks and its self.num_registered entry; decrement each
        block's ref_count, and a block that reaches 0 goes to the BACK of the free queue
        keeping its hash (cached-free). Order matters: release the blocks in REVERSE logical
        order, so the request's tail (unique to it) is reused before its head (a shared
        system prompt, most likely to be hit again). A count below 0 is a bug: raise
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

    def reset_prefix_cache(self) -> None:
        """Forget every cached-free block (new weights make old K/V wrong). Blocks in use keep
        their keys: their owners still rely on them."""
        for block in self.free_queue:
            self.block_hash[block] = None
        self.cached = {key: b for key, b in self.cached.items() if self.ref_count[b] > 0}
