"""Chapter 6 milestone: rotary position embeddings.

Oracle: a rotation written with complex numbers in float64. Channel pair (c, c + D/2) of a
head vector is the complex number x[c] + i x[c + D/2]; position p multiplies it by
exp(i p theta^(-2c/D)) (torch.polar), and the real and imaginary parts go back to c and c + D/2.
"""
import pytest
import torch

pytestmark = pytest.mark.chapter(6)

THETA = 10000.0


def complex_rotation(x, positions, theta=THETA):
    """x [..., T, D] (positions [T]) rotated in float64 via complex multiplication."""
    d = x.shape[-1]
    half = d // 2
    freqs = theta ** (-torch.arange(half, dtype=torch.float64) * 2 / d)
    angles = positions.double().cpu()[:, None] * freqs                    # [T, D/2]
    rotor = torch.polar(torch.ones_like(angles), angles)                   # e^{i angle}
    z = torch.complex(x.double().cpu()[..., :half], x.double().cpu()[..., half:])
    z = z * rotor
    return torch.cat([z.real, z.imag], dim=-1)


def test_table_shapes(impl, device):
    pos = torch.arange(7, device=device)
    cos, sin = impl.layers.rope_cos_sin(pos, 16, THETA, torch.float32)
    assert cos.shape == sin.shape == (1, 1, 7, 16), (
        f"positions [7], head_dim 16: cos and sin are [1, 1, 7, 16] (they broadcast over batch and heads); "
        f"got {tuple(cos.shape)} and {tuple(sin.shape)}")
    rows = torch.tensor([[0, 1, 2], [5, 6, 7]], device=device)
    cos, sin = impl.layers.rope_cos_sin(rows, 16, THETA, torch.bfloat16)
    assert cos.shape == (2, 1, 3, 16) and cos.dtype == sin.dtype == torch.bfloat16, (
        f"positions [2, 3] give [2, 1, 3, 16] tables in the requested dtype; got {tuple(cos.shape)} {cos.dtype}")


def test_table_values(impl, device):
    pos = torch.tensor([0, 1, 7, 100, 4095], device=device)
    d = 32
    cos, sin = impl.layers.rope_cos_sin(pos, d, THETA, torch.float32)
    freqs = THETA ** (-torch.arange(d // 2, dtype=torch.float64) * 2 / d)
    angles = pos.double().cpu()[:, None] * torch.cat([freqs, freqs])          # channel c and c + D/2 share an angle
    torch.testing.assert_close(cos[0, 0].double().cpu(), angles.cos(), rtol=0, atol=2e-4,
                               msg=lambda m: f"cos table: column c and c + D/2 hold cos(p * theta^(-2c/D)): {m}")
    torch.testing.assert_close(sin[0, 0].double().cpu(), angles.sin(), rtol=0, atol=2e-4,
                               msg=lambda m: f"sin table: {m}")


def test_large_positions_in_bfloat16(impl, device):
    """Angles come from exact integer positions: bf16 cannot even represent 30001."""
    pos = torch.tensor([30001, 31999, 40000], device=device)
    d = 128
    cos, sin = impl.layers.rope_cos_sin(pos, d, 1e6, torch.bfloat16)
    freqs = 1e6 ** (-torch.arange(d // 2, dtype=torch.float64) * 2 / d)
    angles = pos.double().cpu()[:, None] * torch.cat([freqs, freqs])
    for name, got, want in (("cos", cos, angles.cos()), ("sin", sin, angles.sin())):
        err = (got[0, 0].double().cpu() - want).abs().max().item()
        assert err < 1e-2, (f"{name} at positions {pos.tolist()} in bfloat16 is off by {err:.3g}: compute the angles "
                            f"in float32 from the integer positions and cast only the final table")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_apply_matches_complex_rotation(impl, device, dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 9, 16, generator=g).to(device=device, dtype=dtype)
    pos = torch.arange(20, 29, device=device)
    cos, sin = impl.layers.rope_cos_sin(pos, 16, THETA, dtype)
    got = impl.layers.apply_rope(x, cos, sin)
    expected = complex_rotation(x, pos)
    assert got.shape == x.shape and got.dtype == dtype, (
        f"apply_rope keeps x's shape and dtype: {tuple(x.shape)} {dtype} in, got {tuple(got.shape)} {got.dtype}")
    torch.testing.assert_close(got.double().cpu(), expected, rtol=1e-5, atol=2e-5,
                               msg=lambda m: f"apply_rope on [2, 3, 9, 16] at positions 20..28 vs the complex "
                                             f"rotation of pairs (c, c + 8): x[c] + i x[c + 8] multiplied by "
                                             f"e^(i angle): {m}")


def test_flat_rows(impl, device):
    """The [N, H, D] layout of Chapter 31: one row per token, cos/sin as [N, 1, D]."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 4, 16, generator=g).to(device)
    pos = torch.tensor([3, 0, 17, 17, 250], device=device)
    cos, sin = impl.layers.rope_cos_sin(pos, 16, THETA, torch.float32)
    got = impl.layers.apply_rope(x, cos[0, 0][:, None, :], sin[0, 0][:, None, :])
    expected = complex_rotation(x.transpose(0, 1), pos).transpose(0, 1)
    torch.testing.assert_close(got.double().cpu(), expected, rtol=1e-5, atol=2e-5,
                               msg=lambda m: f"apply_rope on flat rows [5, 4, 16] with cos/sin [5, 1, 16]: {m}")


def test_rotation_properties(impl, device):
    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, 1, 1, 64, generator=g, dtype=torch.float64).to(device)
    k = torch.randn(1, 1, 1, 64, generator=g, dtype=torch.float64).to(device)

    def at(x, p):
        cos, sin = impl.layers.rope_cos_sin(torch.tensor([p], device=device), 64, THETA, torch.float64)
        return impl.layers.apply_rope(x, cos, sin)

    torch.testing.assert_close(at(q, 0), q, msg="position 0 is the identity rotation")
    torch.testing.assert_close(at(q, 123).norm(), q.norm(), msg="a rotation keeps the vector's length")
    near, far = (at(q, 7) * at(k, 3)).sum(), (at(q, 57) * at(k, 53)).sum()
    torch.testing.assert_close(near, far, rtol=0, atol=1e-3,
                               msg="q.k after RoPE depends only on the distance between the positions "
                                   "(7 vs 3 and 57 vs 53 must give the same score; the angles are float32)")
