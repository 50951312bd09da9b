"""Chapter 5: causal attention driven by positions."""
import math

import torch


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
                     allowed: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
    """Scaled dot-product attention with a mask built from positions.  (Your engine: Chapter 5)

    q: [B, H, Tq, D]; k, v: [B, Hkv, Tk, D] with H a multiple of Hkv (grouped-query
    attention: consecutive query heads share a key/value head; H=8, Hkv=2: query heads 0-3
    read key/value head 0, heads 4-7 head 1); otherwise ValueError.
    q_pos: [Tq] or [B, Tq]; k_pos: [Tk] or [B, Tk]. Query i may attend to key j exactly when
    k_pos[j] <= q_pos[i]; positions, not row numbers, decide, so the same function serves a
    whole prompt, one decode step against a cache, or a chunk in the middle of a sequence.
    allowed: optional bool tensor broadcastable to [B, 1, Tq, Tk], intersected with that
    rule (padding, sliding windows).
    scale defaults to 1 / sqrt(D). Scores and softmax run in float32; the result has q's
    dtype and shape [B, H, Tq, D]. A query that may see no key at all returns zeros, not NaN.
    """
    batch, heads, q_len, dim = q.shape
    kv_heads, k_len = k.shape[1], k.shape[2]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads cannot share {kv_heads} key/value heads evenly")
    group = heads // kv_heads
    scale = 1.0 / math.sqrt(dim) if scale is None else scale
    # Grouped queries: the `group` query heads of one K/V head become extra query rows, so
    # each K/V head is read once by a single matmul: [B, Hkv, group * Tq, D] @ [B, Hkv, D, Tk].
    grouped = q.float().reshape(batch, kv_heads, group * q_len, dim)
    scores = torch.matmul(grouped, k.float().transpose(-1, -2)).mul_(scale)
    scores = scores.view(batch, kv_heads, group, q_len, k_len)
    mask = k_pos[..., None, :] <= q_pos[..., :, None]            # [Tq, Tk] or [B, Tq, Tk]
    mask = mask.reshape(-1, 1, q_len, k_len)                      # [B or 1, 1, Tq, Tk]
    if allowed is not None:
        mask = mask & allowed
    scores.masked_fill_(~mask.unsqueeze(2), float("-inf"))       # broadcast over the group axis
    weights = torch.softmax(scores, dim=-1).nan_to_num_(0.0)     # fully masked rows -> zeros
    out = torch.matmul(weights.view(batch, kv_heads, group * q_len, k_len), v.float())
    return out.view(batch, heads, q_len, dim).to(q.dtype)
