"""Chapter 9 milestone: Qwen3's attention sublayer (grouped-query attention with QK-norm).

Oracle: transformers' own Qwen3Attention and Qwen3DecoderLayer, built from the same config
and loaded with the same weights (the norm weights are not all ones, so QK-norm and the
order "norm, then rotate" are visible). Both sides receive the very same cos/sin tables
(transformers' rotary embedding), so this file tests Chapter 9's code, not Chapter 6's.

Tolerance (float32): max |ours - transformers| <= 1e-5 on outputs of size ~1; the two
differ only in the order of float32 additions (measured: ~4e-7).
"""
import dataclasses

import pytest
import torch

from course.models import fill_deterministic, tiny_config

pytestmark = pytest.mark.chapter(9)

hf_qwen3 = pytest.importorskip("transformers.models.qwen3.modeling_qwen3")
HFConfig = pytest.importorskip("transformers").Qwen3Config

ATOL = 1e-5

# (name, config overrides): the tiny model's shape (4 query heads share 2 K/V heads),
# plain multi-head, multi-query, more groups, and the attention_bias option of the config.
CASES = [
    ("gqa 4q/2kv", {}),
    ("mha 4q/4kv", dict(num_key_value_heads=4)),
    ("mqa 4q/1kv", dict(num_key_value_heads=1)),
    ("gqa 8q/2kv, head_dim 8", dict(num_attention_heads=8, head_dim=8)),
    ("gqa with attention_bias", dict(attention_bias=True)),
]


def hf_config(cfg):
    return HFConfig(**dataclasses.asdict(cfg), attn_implementation="eager")


def causal_bias(length, device):
    """transformers' eager attention takes an additive mask: 0 where allowed, -inf above."""
    return torch.full((length, length), float("-inf"), device=device).triu(1)[None, None]


def rotary(hf_cfg, x, positions):
    """transformers' cos/sin [B, T, D] for positions [B, T]."""
    rope = hf_qwen3.Qwen3RotaryEmbedding(hf_cfg).to(x.device)
    return rope(x, positions)


def make_pair(impl, overrides, kind, device, seed=0):
    """(ours, theirs): the impl's module and transformers' with identical weights."""
    cfg = tiny_config(impl.package, **overrides)
    hcfg = hf_config(cfg)
    if kind == "attention":
        ours, theirs = impl.qwen3.Qwen3Attention(cfg, 0), hf_qwen3.Qwen3Attention(hcfg, 0)
    else:
        ours, theirs = impl.qwen3.Qwen3DecoderLayer(cfg, 0), hf_qwen3.Qwen3DecoderLayer(hcfg, 0)
    fill_deterministic(ours, seed)
    theirs.load_state_dict(ours.state_dict(), strict=True)
    return cfg, hcfg, ours.to(device).eval(), theirs.to(device).eval()


def run_both(kind, cfg, hcfg, ours, theirs, x, positions):
    batch, length, _ = x.shape
    pos = positions.expand(batch, length)
    cos, sin = rotary(hcfg, x, pos)
    slots = torch.arange(length, device=x.device)
    with torch.no_grad():
        got = ours(x, cos[:, None], sin[:, None], slots)
        if kind == "attention":
            want, _ = theirs(x, (cos, sin), causal_bias(length, x.device))
        else:
            want = theirs(x, attention_mask=causal_bias(length, x.device), position_embeddings=(cos, sin))
    return got, want


def assert_close(got, want, what):
    assert got.shape == want.shape, f"{what}: output shape {tuple(got.shape)}, transformers gives {tuple(want.shape)}"
    err = (got.float() - want.float()).abs()
    worst = divmod(int(err.flatten().argmax()), err.shape[-1])
    assert float(err.max()) <= ATOL, (
        f"{what}: max |ours - transformers| = {float(err.max()):.3g} > {ATOL} "
        f"(worst at flat row {worst[0]}, channel {worst[1]}); check: q_norm/k_norm come before RoPE; q and k "
        f"are rotated, v is not; query head h reads K/V head h // (H // Hkv); the heads are merged back per "
        f"token before o_proj")


@pytest.mark.parametrize("name, overrides", CASES, ids=[c[0] for c in CASES])
def test_attention_matches_transformers(impl, device, name, overrides):
    torch.manual_seed(1)
    cfg, hcfg, ours, theirs = make_pair(impl, overrides, "attention", device)
    x = torch.randn(2, 11, cfg.hidden_size, device=device)
    positions = torch.arange(11, device=device)[None]
    got, want = run_both("attention", cfg, hcfg, ours, theirs, x, positions)
    assert_close(got, want, f"Qwen3Attention [{name}], 2 sequences of 11 tokens")


def test_rope_positions_are_not_slots(impl, device):
    """Positions with gaps, slots 0..12: RoPE uses the positions, the causal mask the slots.
    (A constant shift of every position would prove nothing: RoPE only sees differences.)"""
    torch.manual_seed(2)
    cfg, hcfg, ours, theirs = make_pair(impl, {}, "attention", device)
    x = torch.randn(1, 13, cfg.hidden_size, device=device)
    positions = torch.tensor([[3, 4, 5, 9, 10, 11, 20, 21, 22, 23, 40, 41, 90]], device=device)
    got, want = run_both("attention", cfg, hcfg, ours, theirs, x, positions)
    assert_close(got, want, f"Qwen3Attention with RoPE positions {positions[0].tolist()} and slots 0..12")


def test_qk_norm_is_per_head(impl, device):
    """Scaling the input by 1000 leaves q and k unchanged after QK-norm, so the
    attention pattern must not change; only v (and so the output) scales by 1000."""
    torch.manual_seed(3)
    cfg, hcfg, ours, theirs = make_pair(impl, {}, "attention", device)
    x = torch.randn(1, 9, cfg.hidden_size, device=device)
    positions = torch.arange(9, device=device)[None]
    small, _ = run_both("attention", cfg, hcfg, ours, theirs, x, positions)
    big, want = run_both("attention", cfg, hcfg, ours, theirs, 1000 * x, positions)
    assert_close(big / 1000, want / 1000, "Qwen3Attention on an input scaled by 1000")
    rel = float((big / 1000 - small).abs().max() / small.abs().max())
    assert rel < 1e-4, (f"scaling the input by 1000 changed the attention output by {rel:.3g} (relative) "
                        "beyond the factor 1000: q_norm/k_norm must normalise each head vector of q and k")


def test_decoder_layer_matches_transformers(impl, device):
    torch.manual_seed(4)
    cfg, hcfg, ours, theirs = make_pair(impl, {}, "layer", device, seed=5)
    x = torch.randn(3, 7, cfg.hidden_size, device=device)
    positions = torch.arange(7, device=device)[None]
    got, want = run_both("layer", cfg, hcfg, ours, theirs, x, positions)
    assert_close(got, want, "Qwen3DecoderLayer (attention + MLP), 3 sequences of 7 tokens")


def test_bfloat16_is_no_worse_than_transformers(impl, device):
    """In bfloat16 both sides round; ours may not drift further from the float32 answer
    than transformers' own bfloat16 run does (plus half a bfloat16 step of slack)."""
    torch.manual_seed(6)
    cfg, hcfg, ours, theirs = make_pair(impl, {}, "attention", device)
    x = torch.randn(2, 10, cfg.hidden_size, device=device)
    positions = torch.arange(10, device=device)[None]
    _, exact = run_both("attention", cfg, hcfg, ours, theirs, x, positions)
    got, want = run_both("attention", cfg, hcfg, ours.bfloat16(), theirs.bfloat16(), x.bfloat16(), positions)
    assert got.dtype == torch.bfloat16, f"bfloat16 input gave a {got.dtype} output"
    ours_err = float((got.float() - exact).abs().max())
    hf_err = float((want.float() - exact).abs().max())
    scale = float(exact.abs().max())
    assert ours_err <= hf_err + 2 ** -8 * scale, (
        f"bfloat16 attention is {ours_err:.3g} from the float32 answer; transformers' is {hf_err:.3g}")
