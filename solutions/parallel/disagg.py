"""Chapter 41: disaggregated prefill, a prefill engine and a decode engine in two processes.

The prefill engine computes each prompt and its first token (max_tokens = 1). The moment
a request finishes there, the scheduler's on_finish hook runs (its blocks are still
valid) and ships the request to the decode process: a header (id, tokens, the block
hashes, how many tokens it still wants), then the contents of its full blocks, layer by
layer. The decode engine adopts the blocks into its own pool as cached-free blocks under
those hashes (BlockManager.prepare_store makes room for them), then queues the
request: its prefix-cache lookup finds them, and only the tokens of the last, partly
filled block are computed again (fewer than a block).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..serve.backends import raw_bytes
from ..serve.engine import EngineCore
from ..serve.request import Request, SamplingParams, Status
from ..serve.runner import distinct_pools


def full_blocks_computed(engine: EngineCore, request: Request) -> int:
    """How many of request's leading blocks hold computed K/V for every one of their slots."""
    return min(request.num_computed_tokens // engine.blocks.block_size, len(engine.scheduler.block_table(request)))


def send_request(engine: EngineCore, request: Request, max_tokens: int, dst: int) -> int:
    """Ship a request that just finished prefill: header, then each layer's block contents.
    Returns the number of blocks sent."""
    count = full_blocks_computed(engine, request)
    keys = engine.blocks.update_hashes(request)[:count]
    header = {"request_id": request.request_id, "token_ids": list(request.token_ids),
              "num_prompt_tokens": request.num_prompt_tokens, "max_tokens": max_tokens,
              "finished_here": request.status == Status.FINISHED_STOPPED or max_tokens <= 1,
              "keys": keys}
    dist.send_object_list([header], dst=dst)
    if keys:
        index = torch.tensor(engine.scheduler.block_table(request)[:count], dtype=torch.int64,
                             device=engine.runner.device)
        for layer in engine.runner.kv_caches:
            for pool in distinct_pools(layer):          # a latent pool is one tensor: sent once
                dist.send(raw_bytes(pool).index_select(0, index.to(pool.device)).contiguous(), dst=dst)
    return count


def receive_blocks(engine: EngineCore, count: int, src: int) -> list[list[torch.Tensor]]:
    """The contents `send_request` sends for `count` blocks: per layer, per distinct pool
    tensor, [count, *one block's shape] in the pool's storage dtype."""
    contents = []
    for layer in engine.runner.kv_caches:
        tensors = []
        for pool in distinct_pools(layer):
            store = raw_bytes(pool)
            tensors.append(torch.empty((count, *store.shape[1:]), dtype=store.dtype, device=store.device))
            dist.recv(tensors[-1], src=src)
        contents.append(tensors)
    return contents


def adopt_blocks(engine: EngineCore, keys: Sequence[bytes], contents: list[list[torch.Tensor]]) -> int:
    """Put shipped blocks into this engine's pool as cached-free blocks.  (Your engine: Chapter 41)

    keys[i] (bytes): the prefix-cache key of shipped block i, keys[0] the sequence's first
    block; contents[layer][j][i]: block i's data for the j-th distinct pool tensor of that
    layer (distinct_pools(engine.runner.kv_caches[layer]): K and V, a quantized pool's
    scales too, a latent pool's one tensor), in the storage dtype raw_bytes gives.
    Afterwards the leading run of keys that fits in the pool is cached here as cached-free
    blocks (engine.blocks.prepare_store publishes them), and every block that was not cached
    here before holds, in every pool tensor of every layer, exactly the data shipped for its
    key: a request whose prompt starts with those tokens finds them (find_cached_prefix) and
    reads the shipped K/V. Blocks cached here before keep their own data.
    Returns how many blocks were filled (0 when every key was cached already).
    Example: keys [a, b, c] where a was cached here before: afterwards the blocks cached
    under b and c hold, in every pool tensor of every layer, the data shipped for b and for c
    (not the first two shipped blocks'), a's block still holds its own data; returns 2.
    Errors: prepare_store's ValueError, pool untouched (prefix caching off: the message says
    "prefix caching"; a key not bytes; a key repeated).
    Property: each block's data lands in the pool row the block manager gave that block,
    and the data is the one shipped for that block's own key.
    """
    targets = engine.blocks.prepare_store(keys)
    if not targets:
        return 0
    shipped_rows = torch.tensor(list(targets), dtype=torch.int64)
    pool_rows = torch.tensor(list(targets.values()), dtype=torch.int64)
    for layer, shipped in zip(engine.runner.kv_caches, contents):
        for pool, data in zip(distinct_pools(layer), shipped):
            store = raw_bytes(pool)
            store.index_copy_(0, pool_rows.to(pool.device),
                              data.index_select(0, shipped_rows.to(data.device)).to(pool.device))
    return len(targets)


def run_prefill(engine: EngineCore, requests: Sequence[tuple[str, list[int], int]], decode_rank: int) -> int:
    """Prefill every (request id, prompt, max_tokens) and ship each to decode_rank as it
    finishes; then tell the decode side no more will come. Returns the blocks shipped."""
    if not engine.config.enable_prefix_caching:
        raise ValueError("disaggregated prefill ships blocks under their prefix-cache keys: turn prefix caching on")
    wanted = {rid: max_tokens for rid, _, max_tokens in requests}
    shipped = [0]

    def ship(request: Request) -> None:
        shipped[0] += send_request(engine, request, wanted[request.request_id], decode_rank)

    engine.scheduler.on_finish = ship
    try:
        for rid, prompt, _ in requests:
            engine.add_request(rid, prompt, SamplingParams(max_tokens=1))
        while engine.has_unfinished:
            engine.step()
    finally:
        engine.scheduler.on_finish = None
    dist.send_object_list([None], dst=decode_rank)       # end of the stream
    return shipped[0]


def run_decode(engine: EngineCore, prefill_rank: int) -> tuple[dict[str, list[int]], int]:
    """Receive requests from prefill_rank until it says it is done, adopting their blocks
    and stepping this engine between arrivals; returns ({request id: every output token},
    blocks adopted)."""
    if not engine.config.enable_prefix_caching:
        raise ValueError("the decode engine adopts shipped blocks through its prefix cache: turn prefix caching on")
    results: dict[str, list[int]] = {}
    first: dict[str, list[int]] = {}
    adopted = 0
    while True:
        message: list[Any] = [None]
        dist.recv_object_list(message, src=prefill_rank)
        header = message[0]
        if header is None:
            break
        contents = receive_blocks(engine, len(header["keys"]), prefill_rank) if header["keys"] else []
        adopted += adopt_blocks(engine, header["keys"], contents)
        rid, tokens = header["request_id"], header["token_ids"]
        produced = tokens[header["num_prompt_tokens"]:]
        if header["finished_here"]:
            results[rid] = produced
        else:
            first[rid] = produced
            engine.add_request(rid, tokens, SamplingParams(max_tokens=header["max_tokens"] - len(produced)))
        if engine.has_unfinished:
            _collect(engine.step(), first, results)
    while engine.has_unfinished:
        _collect(engine.step(), first, results)
    return results, adopted


def _collect(outputs: list[Any], first: dict[str, list[int]], results: dict[str, list[int]]) -> None:
    for out in outputs:
        if out.finished:
            results[out.request_id] = first.pop(out.request_id) + list(out.output_token_ids)
