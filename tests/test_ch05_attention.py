"""Chapter 5 milestone: causal attention driven by positions, with grouped-query heads.

Oracle: torch.nn.functional.scaled_dot_product_attention, given a boolean mask the test
builds element by element from the positions (and enable_gqa for the shared K/V heads).
"""
import math

import pytest
import torch
from torch.nn import functional as F

pytestmark = pytest.mark.chapter(5)


def rand_qkv(device, batch=2, heads=8, kv_heads=2, tq=6, tk=6, dim=16, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, tq, dim, generator=g)
    k = torch.randn(batch, kv_heads, tk, dim, generator=g)
    v = torch.randn(batch, kv_heads, tk, dim, generator=g)
    return [t.to(device=device, dtype=dtype) for t in (q, k, v)]


def visible(q_pos, k_pos, batch):
    """[B, 1, Tq, Tk] bool built one element at a time: key j is visible to query i when
    k_pos[j] <= q_pos[i]."""
    q_pos = q_pos.expand(batch, -1) if q_pos.dim() == 1 else q_pos
    k_pos = k_pos.expand(batch, -1) if k_pos.dim() == 1 else k_pos
    mask = torch.zeros(batch, 1, q_pos.shape[1], k_pos.shape[1], dtype=torch.bool)
    for b in range(batch):
        for i, qp in enumerate(q_pos[b].tolist()):
            for j, kp in enumerate(k_pos[b].tolist()):
                mask[b, 0, i, j] = kp <= qp
    return mask.to(q_pos.device)


def oracle(q, k, v, mask, scale=None):
    """SDPA in float64 on the rows that see at least one key; zeros elsewhere."""
    mask = mask.expand(q.shape[0], 1, q.shape[2], k.shape[2])
    out = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask, scale=scale,
                                         enable_gqa=True)
    seen = mask.any(-1, keepdim=True)                                  # [B, 1, Tq, 1]
    return torch.where(seen, out, torch.zeros_like(out))


def check(got, expected, what, atol=1e-5):
    assert got.shape == expected.shape, (
        f"{what}: output shape should be {tuple(expected.shape)}, got {tuple(got.shape)}")
    err = (got.double() - expected).abs()
    if err.max() > atol or not torch.isfinite(got).all():
        b, h, i, _ = [int(x) for x in torch.nonzero(~(err <= atol))[0]]
        raise AssertionError(f"{what}: batch {b}, head {h}, query {i} differs from scaled_dot_product_attention "
                             f"by {err.max().item():.3g} (tolerance {atol})")


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (6, 1)])
def test_whole_prompt(impl, device, heads, kv_heads):
    q, k, v = rand_qkv(device, heads=heads, kv_heads=kv_heads, tq=7, tk=7)
    pos = torch.arange(7, device=device)
    got = impl.attention.causal_attention(q, k, v, pos, pos)
    check(got, oracle(q, k, v, visible(pos, pos, 2)),
          f"a 7-token prompt (each query sees the keys at its own position and before), {heads} query heads "
          f"sharing {kv_heads} K/V heads (query head h reads K/V head h // {heads // kv_heads})")


def test_matches_is_causal(impl, device):
    q, k, v = rand_qkv(device, tq=9, tk=9, seed=1)
    pos = torch.arange(9, device=device)
    expected = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True, enable_gqa=True)
    check(impl.attention.causal_attention(q, k, v, pos, pos), expected, "a 9-token prompt against is_causal=True")


def test_chunk_in_the_middle(impl, device):
    """Four queries at positions 5..8 against a cache holding positions 0..11 (some are 'future')."""
    q, k, v = rand_qkv(device, tq=4, tk=12, seed=2)
    q_pos, k_pos = torch.arange(5, 9, device=device), torch.arange(12, device=device)
    got = impl.attention.causal_attention(q, k, v, q_pos, k_pos)
    check(got, oracle(q, k, v, visible(q_pos, k_pos, 2)),
          "a chunk of queries at positions 5..8 with keys at 0..11 (positions, not row numbers, decide: "
          "keys 0..p are visible to the query at p, keys 9..11 to none)")


def test_one_decode_step(impl, device):
    q, k, v = rand_qkv(device, tq=1, tk=10, seed=3)
    q_pos, k_pos = torch.tensor([9], device=device), torch.arange(10, device=device)
    got = impl.attention.causal_attention(q, k, v, q_pos, k_pos)
    check(got, oracle(q, k, v, visible(q_pos, k_pos, 2)), "one decode query at position 9 against 10 cached keys")


def test_positions_per_row(impl, device):
    q, k, v = rand_qkv(device, batch=3, tq=3, tk=8, seed=4)
    q_pos = torch.tensor([[5, 6, 7], [0, 1, 2], [2, 4, 7]], device=device)
    k_pos = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7], [0, 1, 2, 3, 4, 5, 6, 7], [7, 6, 5, 4, 3, 2, 1, 0]], device=device)
    got = impl.attention.causal_attention(q, k, v, q_pos, k_pos)
    check(got, oracle(q, k, v, visible(q_pos, k_pos, 3)), "positions given per batch row ([B, Tq] and [B, Tk])")


def test_key_order_does_not_matter(impl, device):
    """Positions, not row numbers, decide: shuffling the keys with their positions changes nothing."""
    q, k, v = rand_qkv(device, tq=5, tk=9, seed=5)
    q_pos, k_pos = torch.arange(4, 9, device=device), torch.arange(9, device=device)
    perm = torch.randperm(9, generator=torch.Generator().manual_seed(0)).to(device)
    straight = impl.attention.causal_attention(q, k, v, q_pos, k_pos)
    shuffled = impl.attention.causal_attention(q, k[:, :, perm], v[:, :, perm], q_pos, k_pos[perm])
    torch.testing.assert_close(shuffled, straight, rtol=1e-5, atol=1e-5,
                               msg="shuffling keys and values together with their positions changed the output")


def test_allowed_mask(impl, device):
    """`allowed` is intersected with the causal rule: here a sliding window of 3 and a padded key."""
    q, k, v = rand_qkv(device, tq=8, tk=8, seed=6)
    pos = torch.arange(8, device=device)
    allowed = (pos[None, :] > pos[:, None] - 3)[None, None].expand(2, 1, 8, 8).clone()
    allowed[1, :, :, 0] = False                                          # row 1's first key is padding
    got = impl.attention.causal_attention(q, k, v, pos, pos, allowed=allowed)
    check(got, oracle(q, k, v, visible(pos, pos, 2) & allowed),
          "allowed = a 3-key sliding window (and, in batch row 1, a masked padding key), intersected with the "
          "causal rule")


def test_rows_with_no_visible_key_are_zero(impl, device):
    """Left padding: batch row 1's first two queries are padding that may see nothing."""
    q, k, v = rand_qkv(device, tq=5, tk=5, seed=7)
    pos = torch.arange(5, device=device)
    allowed = torch.ones(2, 1, 5, 5, dtype=torch.bool, device=device)
    allowed[1, :, :, :2] = False                                         # padding keys
    allowed[1, :, :2, :] = False                                         # padding queries see nothing
    got = impl.attention.causal_attention(q, k, v, pos, pos, allowed=allowed)
    assert torch.isfinite(got).all(), "a query that may see no key must give zeros, not NaN (softmax of all -inf)"
    assert torch.equal(got[1, :, :2], torch.zeros_like(got[1, :, :2])), "a query with no visible key returns zeros"
    check(got, oracle(q, k, v, visible(pos, pos, 2) & allowed), "left-padded batch row")


def test_scale(impl, device):
    q, k, v = rand_qkv(device, tq=6, tk=6, seed=8)
    pos = torch.arange(6, device=device)
    mask = visible(pos, pos, 2)
    check(impl.attention.causal_attention(q, k, v, pos, pos, scale=0.05), oracle(q, k, v, mask, scale=0.05),
          "an explicit scale=0.05")
    check(impl.attention.causal_attention(q, k, v, pos, pos), oracle(q, k, v, mask, scale=1 / math.sqrt(16)),
          "the default scale 1/sqrt(head_dim)")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_inputs(impl, device, dtype):
    q, k, v = rand_qkv(device, tq=6, tk=10, dtype=dtype, seed=9)
    q_pos, k_pos = torch.arange(4, 10, device=device), torch.arange(10, device=device)
    got = impl.attention.causal_attention(q, k, v, q_pos, k_pos)
    assert got.dtype == dtype, f"{dtype} inputs give a {dtype} output; got {got.dtype}"
    check(got, oracle(q, k, v, visible(q_pos, k_pos, 2)), f"{dtype} inputs (softmax in float32)",
          atol=2e-2 if dtype == torch.bfloat16 else 4e-3)
