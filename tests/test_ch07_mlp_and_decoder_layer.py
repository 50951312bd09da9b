"""Chapter 7 milestone: the SwiGLU MLP and the pre-norm decoder layer.

Oracles: the SwiGLU formula written with F.silu and matrix products in float64,
transformers' Qwen3MLP loaded with the same weights, a decoder layer composed by hand from
those pieces, and transformers' Qwen3DecoderLayer with the same weights. Qwen3's attention is
Chapter 9's work, so the layer is tested with a stand-in attention module (for the
comparison with transformers, transformers' own attention behind our signature): what
matters here is how the two residual branches are wired.
"""
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from course.models import fill_deterministic, tiny_config, tiny_config_values

pytestmark = pytest.mark.chapter(7)


def float64_rms(x, weight, eps):
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.double()


def float64_mlp(x, mlp):
    gate, up, down = (getattr(mlp, name).weight.double() for name in ("gate_proj", "up_proj", "down_proj"))
    x = x.double()
    return (F.silu(x @ gate.T) * (x @ up.T)) @ down.T


@pytest.fixture
def cfg(impl):
    return tiny_config(impl.package)


@pytest.fixture
def mlp(impl, cfg, device):
    return fill_deterministic(impl.qwen3.Qwen3MLP(cfg)).to(device)


@pytest.mark.parametrize("shape", [(2, 5), (7,), ()])
def test_mlp_matches_swiglu_formula(impl, cfg, mlp, device, shape):
    x = torch.randn(*shape, cfg.hidden_size, generator=torch.Generator().manual_seed(0)).to(device)
    with torch.no_grad():
        got = mlp(x)
    expected = float64_mlp(x, mlp)
    assert got.shape == x.shape, (
        f"the MLP maps [..., hidden] to the same shape; got {tuple(got.shape)} for {tuple(x.shape)}")
    err = (got.double() - expected).abs().max().item()
    assert err < 1e-4, (f"MLP on input {tuple(x.shape)} differs from down(silu(gate(x)) * up(x)) by {err:.3g}; "
                        f"SiLU goes on the gate path only")


def test_mlp_matches_transformers(impl, cfg, mlp, device):
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP
    hf_cfg = Qwen3Config(hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size)
    oracle = Qwen3MLP(hf_cfg).to(device)
    oracle.load_state_dict(mlp.state_dict())
    x = torch.randn(3, 4, cfg.hidden_size, generator=torch.Generator().manual_seed(1)).to(device)
    with torch.no_grad():
        torch.testing.assert_close(mlp(x), oracle(x), rtol=1e-5, atol=1e-5,
                                   msg=lambda m: f"MLP differs from transformers' Qwen3MLP with the same weights: {m}")


class StandInAttention(nn.Module):
    """Replaces Qwen3's attention (Chapter 9): a fixed nonlinear map that records its call."""

    def __init__(self, hidden):
        super().__init__()
        self.proj = nn.Linear(hidden, hidden, bias=False)
        self.calls = []

    def forward(self, x, *args, **kwargs):
        self.calls.append((x.detach().clone(), args, kwargs))
        return torch.tanh(self.proj(x))


@pytest.fixture
def layer(impl, cfg, device):
    layer = fill_deterministic(impl.qwen3.Qwen3DecoderLayer(cfg, 0))
    layer.self_attn = StandInAttention(cfg.hidden_size)
    fill_deterministic(layer.self_attn)
    return layer.to(device)


def hand_composed(layer, x, eps):
    attn_in = float64_rms(x, layer.input_layernorm.weight, eps)
    h = x.double() + torch.tanh(attn_in @ layer.self_attn.proj.weight.double().T)
    return h + float64_mlp(float64_rms(h, layer.post_attention_layernorm.weight, eps), layer.mlp)


def test_decoder_layer_matches_hand_composition(impl, cfg, layer, device):
    x = 2.0 * torch.randn(2, 6, cfg.hidden_size, generator=torch.Generator().manual_seed(2)).to(device)
    before = x.clone()
    cos, sin = torch.ones(1, 1, 6, cfg.head_dim, device=device), torch.zeros(1, 1, 6, cfg.head_dim, device=device)
    slots = torch.arange(6, device=device)
    with torch.no_grad():
        got = layer(x, cos, sin, slots)
    assert torch.equal(x, before), "the layer must not modify its input in place (the residual stream is added to)"
    assert got.shape == x.shape, f"a decoder layer keeps the shape [B, T, hidden]; got {tuple(got.shape)}"
    expected = hand_composed(layer, x, cfg.rms_norm_eps)
    err = (got.double() - expected).abs().max().item()
    assert err < 1e-4, (f"decoder layer differs from x + attn(input_layernorm(x)), "
                        f"then h + mlp(post_attention_layernorm(h)) by {err:.3g} (pre-norm: each branch reads a "
                        f"normalised copy, the stream itself is only added to)")
    assert len(layer.self_attn.calls) == 1, (
        f"attention should run once per layer call, ran {len(layer.self_attn.calls)} times")
    seen = layer.self_attn.calls[0][0].double()
    assert (seen - float64_rms(x, layer.input_layernorm.weight, cfg.rms_norm_eps)).abs().max() < 1e-4, (
        "attention must read input_layernorm(x), not the raw stream")


def test_decoder_layer_passes_everything_to_attention(impl, cfg, layer, device):
    x = torch.randn(1, 3, cfg.hidden_size, generator=torch.Generator().manual_seed(3)).to(device)
    cos, sin = torch.ones(1, 1, 3, cfg.head_dim, device=device), torch.zeros(1, 1, 3, cfg.head_dim, device=device)
    slots = torch.arange(3, device=device)
    cache, allowed = object(), torch.ones(1, 1, 3, 3, dtype=torch.bool, device=device)
    with torch.no_grad():
        layer(x, cos, sin, slots, cache, allowed)
    _, args, kwargs = layer.self_attn.calls[-1]
    passed = list(args) + list(kwargs.values())
    for name, value in (("cos", cos), ("sin", sin), ("slots", slots), ("cache", cache), ("allowed", allowed)):
        assert any(p is value for p in passed), f"the layer must hand `{name}` to self_attn unchanged"


def test_decoder_layer_on_the_tiny_weights_in_bfloat16(impl, cfg, layer, device):
    layer = layer.to(torch.bfloat16)
    x = torch.randn(2, 4, cfg.hidden_size, generator=torch.Generator().manual_seed(4)).to(device, torch.bfloat16)
    cos, sin = torch.ones(1, 1, 4, cfg.head_dim, device=device), torch.zeros(1, 1, 4, cfg.head_dim, device=device)
    with torch.no_grad():
        got = layer(x, cos.bfloat16(), sin.bfloat16(), torch.arange(4, device=device))
    assert got.dtype == torch.bfloat16, f"a bfloat16 layer keeps the stream in bfloat16; got {got.dtype}"
    expected = hand_composed(layer, x, cfg.rms_norm_eps)
    err = ((got.double() - expected).abs() / (1 + expected.abs())).max().item()
    assert err < 0.05, f"bfloat16 decoder layer is off the float64 composition by {err:.3g} (relative)"


class BorrowedAttention(nn.Module):
    """transformers' attention module behind our self_attn signature, so that our layer and
    transformers' run the very same attention and differ only in how they wire the stream."""

    def __init__(self, attention, position_embeddings):
        super().__init__()
        self.attention, self.position_embeddings = attention, position_embeddings

    def forward(self, x, *args, **kwargs):
        return self.attention(x, self.position_embeddings, None)[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decoder_layer_matches_transformers(impl, cfg, device, dtype):
    """Bit for bit in bfloat16: the stream stays in the model's dtype, each branch's output is
    added to the stream as it stands then, in that order."""
    import transformers
    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3RotaryEmbedding
    hf_cfg = transformers.Qwen3Config(**tiny_config_values(), attn_implementation="eager")
    oracle = fill_deterministic(Qwen3DecoderLayer(hf_cfg, 0)).to(device, dtype)
    layer = fill_deterministic(impl.qwen3.Qwen3DecoderLayer(cfg, 0)).to(device, dtype)
    x = (4.0 * torch.randn(2, 5, cfg.hidden_size, generator=torch.Generator().manual_seed(5))).to(device, dtype)
    positions = torch.arange(5, device=device)[None].expand(2, 5)
    position_embeddings = Qwen3RotaryEmbedding(hf_cfg).to(device)(x, positions)
    layer.self_attn = BorrowedAttention(oracle.self_attn, position_embeddings)
    cos, sin = (t[:, None] for t in position_embeddings)
    with torch.no_grad():
        got = layer(x, cos, sin, positions[0])
        expected = oracle(x, position_embeddings=position_embeddings)
    assert got.dtype == dtype, f"a {dtype} layer keeps the stream in {dtype}; got {got.dtype}"
    rule = ("each branch reading its own norm of the stream as it stands then and adding its output to the stream, "
            "attention first, the stream kept in the model's dtype")
    if dtype == torch.bfloat16:
        mismatched = (got != expected).sum().item()
        assert mismatched == 0, (
            f"{mismatched} of {got.numel()} bfloat16 outputs differ from transformers' Qwen3DecoderLayer with the same "
            f"weights and attention: {rule}")
    else:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5, msg=lambda m: (
            f"differs from transformers' Qwen3DecoderLayer with the same weights and attention: {rule}: {m}"))
