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
    raise NotImplementedError("Your engine: Chapter 5: causal_attention")
