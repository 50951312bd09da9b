"""Chapter 29 milestone: tiled attention with an online softmax equals Chapter 5's attention.

Oracles: torch's scaled_dot_product_attention (float64 for the exact comparisons), a
float64 softmax for the running-state update, and counts of tiles that the causal rule
makes invisible, worked out from positions by hand.
"""
import math

import pytest
import torch
from torch.nn import functional as F

pytestmark = pytest.mark.chapter(29)


def sdpa(q, k, v, q_pos, k_pos, allowed=None):
    """The oracle: torch's attention in float64 with the position rule as a boolean mask."""
    group = q.shape[1] // k.shape[1]
    mask = (k_pos[..., None, :] <= q_pos[..., :, None])
    mask = mask.reshape(-1, 1, *mask.shape[-2:])
    if allowed is not None:
        mask = mask & allowed
    out = F.scaled_dot_product_attention(q.double(), k.double().repeat_interleave(group, 1),
                                         v.double().repeat_interleave(group, 1), attn_mask=mask)
    return out.nan_to_num(0.0)


def tensors(b, h, hkv, tq, tk, d, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, h, tq, d, generator=g) * 2, torch.randn(b, hkv, tk, d, generator=g),
            torch.randn(b, hkv, tk, d, generator=g))


def test_online_update_equals_softmax_in_one_go(impl):
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(3, 40, generator=g, dtype=torch.float64) * 5
    scores[1, :25] = float("-inf")                    # a row whose first tiles are all masked
    v = torch.randn(40, 6, generator=g, dtype=torch.float64)
    m = torch.full((3,), float("-inf"), dtype=torch.float64)
    l = torch.zeros(3, dtype=torch.float64)
    acc = torch.zeros(3, 6, dtype=torch.float64)
    for start in range(0, 40, 8):
        m, l, acc = impl.flash.online_softmax_update(m, l, acc, scores[:, start:start + 8], v[start:start + 8])
        assert not torch.isnan(m).any() and not torch.isnan(l).any() and not torch.isnan(acc).any(), (
            f"NaN after the tile starting at key {start}: a row that has seen only -inf scores must keep "
            f"l = 0 and acc = 0")
    torch.testing.assert_close(m, scores.max(-1).values, msg="running max after all tiles")
    torch.testing.assert_close(l, torch.exp(scores - m[:, None]).sum(-1), msg="running sum after all tiles")
    torch.testing.assert_close(acc / l[:, None], torch.softmax(scores, -1) @ v, msg="acc / l is softmax @ v")


CASES = {
    # name: (B, H, Hkv, Tq, Tk, D, block_q, block_k)
    "prompt, blocks divide T": (2, 4, 2, 32, 32, 16, 8, 8),
    "prompt, ragged last blocks": (1, 4, 1, 37, 37, 8, 16, 8),
    "one decode query, long cache": (2, 8, 2, 1, 70, 16, 16, 16),
    "chunk in the middle": (1, 2, 2, 10, 50, 8, 4, 16),
    "one tile bigger than T": (1, 2, 1, 5, 5, 8, 64, 64),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_equals_attention(impl, case, device):
    b, h, hkv, tq, tk, d, bq, bk = CASES[case]
    q, k, v = (t.to(device) for t in tensors(b, h, hkv, tq, tk, d, seed=tq + tk))
    q_pos, k_pos = torch.arange(tk - tq, tk, device=device), torch.arange(tk, device=device)
    got = impl.flash.flash_attention(q, k, v, q_pos, k_pos, block_q=bq, block_k=bk)
    assert got.shape == q.shape and got.dtype == q.dtype, f"{case}: got {tuple(got.shape)} {got.dtype}"
    expected = sdpa(q, k, v, q_pos, k_pos)
    worst = (got.double() - expected).abs().max().item()
    assert worst < 1e-5, (f"{case}: tiled attention differs from torch's by {worst:.2e} (each query attends to "
                          "every key at or before its position)")


def test_per_row_positions_padding_and_empty_rows(impl):
    """[B, T] positions, an `allowed` padding mask broadcast over queries, and a query that
    may see no key at all (its output must be zeros, as in Chapter 5)."""
    q, k, v = tensors(2, 4, 2, 6, 20, 8, seed=5)
    q_pos = torch.stack([torch.arange(14, 20), torch.arange(10, 16)])
    k_pos = torch.stack([torch.arange(20), torch.arange(-4, 16)])
    allowed = torch.ones(2, 1, 1, 20, dtype=torch.bool)
    allowed[1, ..., :13] = False                      # row 1: left padding
    allowed[0, ..., :] = False
    allowed[0, ..., 16:] = True                       # row 0: only keys 16.. allowed
    got = impl.flash.flash_attention(q, k, v, q_pos, k_pos, allowed, block_q=4, block_k=4)
    expected = sdpa(q, k, v, q_pos, k_pos, allowed)
    worst = (got.double() - expected).abs().max().item()
    assert worst < 1e-5, (f"with per-row positions and an allowed mask: off by {worst:.2e} (a query that sees "
                          "no key outputs zeros)")
    assert (got[0, :, :2] == 0).all(), "queries at positions 14, 15 of row 0 see no allowed key: expect zeros"


def test_causal_tiles_are_skipped(impl):
    """A 64-token prompt in 16x16 tiles: 4 x 4 tiles, of which the 6 above the diagonal
    hold only future keys. A decode step (one query at the end) skips nothing."""
    q, k, v = tensors(1, 2, 2, 64, 64, 8, seed=9)
    pos = torch.arange(64)
    stats = {}
    impl.flash.flash_attention(q, k, v, pos, pos, block_q=16, block_k=16, stats=stats)
    assert stats.get("skipped", 0) == 6 and stats.get("computed", 0) == 10, (
        f"expected 10 tiles computed and 6 skipped, stats say {stats}")
    stats = {}
    impl.flash.flash_attention(q[:, :, -1:], k, v, pos[-1:], pos, block_q=16, block_k=16, stats=stats)
    assert stats.get("computed", 0) == 4 and stats.get("skipped", 0) == 0, f"decode step: {stats}"


def test_bfloat16_inputs(impl):
    q, k, v = (t.bfloat16() for t in tensors(1, 4, 2, 33, 33, 16, seed=2))
    pos = torch.arange(33)
    got = impl.flash.flash_attention(q, k, v, pos, pos, block_q=8, block_k=16)
    assert got.dtype == torch.bfloat16, f"bfloat16 inputs gave {got.dtype}: the output has the inputs' dtype"
    expected = sdpa(q, k, v, pos, pos)
    worst = (got.double() - expected).abs().max().item()
    assert worst < 2 ** -7 * 4, f"bfloat16: off by {worst:.3e}; accumulate in float32 and round once at the end"


def test_matches_chapter5_attention_as_a_drop_in(impl):
    q, k, v = tensors(2, 4, 2, 12, 12, 16, seed=4)
    pos = torch.arange(12)
    scale = 1 / math.sqrt(32)
    got = impl.flash.flash_attention(q, k, v, pos, pos, None, scale, block_q=4, block_k=4)
    expected = impl.attention.causal_attention(q, k, v, pos, pos, None, scale)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5,
                               msg="same arguments, same result as Chapter 5's causal_attention (custom scale)")
