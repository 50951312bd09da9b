"""Chapter 29: FlashAttention's algorithm, written in PyTorch.

Chapter 5's causal_attention builds the whole [Tq, Tk] score matrix, softmaxes it and
multiplies by V. FlashAttention never holds that matrix: it walks over tiles of
block_q queries x block_k keys, keeping for every query row a running maximum m, a running
sum of exponentials l and an unnormalised output accumulator acc. When a new tile raises a
row's maximum, everything accumulated so far is rescaled by exp(m_old - m_new), so the final
acc / l equals the softmax-weighted sum exactly (up to rounding). Tiles that lie entirely in
the causal future of their queries are skipped without being computed.

This file is about the algorithm, not speed: PyTorch runs every tile as separate small
operations. Chapter 32's Triton kernel does the same walk with each tile in on-chip memory.
"""
import math

import torch


def online_softmax_update(m: torch.Tensor, l: torch.Tensor, acc: torch.Tensor, scores: torch.Tensor,
                          v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fold one tile of scores into the running softmax state.  (Your engine: Chapter 29)

    The state of a query row after some tiles: m [..., Tq] the largest score seen so far
    (-inf before any), l [..., Tq] the sum of exp(score - m) over the scores seen, acc
    [..., Tq, D] the sum of exp(score - m) * v over them (0 before any). Inputs:
    scores [..., Tq, Tk] float32, -inf where a key is masked; v [..., Tk, D] the tile's
    values. Returns the state (m, l, acc) of the same shapes and dtypes after this tile
    too, so that at any point acc / l is the softmax-weighted sum of every value seen so
    far, whatever order and size the tiles came in.
    Trap (part of the contract): a row whose scores have all been -inf so far must come
    out with m = -inf, l = 0, acc = 0 and no NaN anywhere, because whole tiles of a row
    are often masked.
    """
    raise NotImplementedError("Your engine: Chapter 29: online_softmax_update")


def tile_is_visible(q_pos: torch.Tensor, k_pos: torch.Tensor) -> bool:
    """Whether any query of a tile may see any key of it under the causal rule
    k_pos <= q_pos: false exactly when the tile's earliest key comes after its latest query.
    q_pos, k_pos: the positions of the tile's queries and keys ([..., n] of any batch shape)."""
    return bool(k_pos.min() <= q_pos.max())


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
                    allowed: torch.Tensor | None = None, scale: float | None = None, block_q: int = 64,
                    block_k: int = 64, stats: dict[str, int] | None = None) -> torch.Tensor:
    """causal_attention computed tile by tile with an online softmax.  (Your engine: Chapter 29)

    Same arguments and result as Chapter 5's causal_attention: q [B, H, Tq, D], k and v
    [B, Hkv, Tk, D] with H a multiple of Hkv (grouped-query), q_pos [Tq] or [B, Tq], k_pos
    [Tk] or [B, Tk], optional bool `allowed` broadcastable to [B, 1, Tq, Tk], scale
    (default 1 / sqrt(D)). Returns [B, H, Tq, D] in q's dtype, equal to causal_attention's
    result to float32 rounding; a query that may see no key gets zeros, not NaN.
    Never materialises more than one [block_q, block_k] tile of scores per head.
    Tiles: queries in blocks of block_q, keys in blocks of block_k (the last of each may
    be shorter). stats: an optional dict of counters, increased (not reset): each tile
    for which tile_is_visible(its q_pos, its k_pos) is false adds 1 to stats["skipped"] and
    costs no arithmetic; every other tile adds 1 to stats["computed"].
    """
    raise NotImplementedError("Your engine: Chapter 29: flash_attention")


def tile_map(q_pos: torch.Tensor, k_pos: torch.Tensor, block_q: int, block_k: int) -> torch.Tensor:
    """[n_q_blocks, n_k_blocks] ints for a picture: 0 skipped, 1 computed and fully visible,
    2 computed and partly masked (the diagonal tiles that need the mask)."""
    nq, nk = -(-q_pos.shape[-1] // block_q), -(-k_pos.shape[-1] // block_k)
    grid = torch.zeros(nq, nk, dtype=torch.int64)
    for i in range(nq):
        qp = q_pos[..., i * block_q:(i + 1) * block_q]
        for j in range(nk):
            kp = k_pos[..., j * block_k:(j + 1) * block_k]
            if tile_is_visible(qp, kp):
                grid[i, j] = 1 if kp.max() <= qp.min() else 2
    return grid
