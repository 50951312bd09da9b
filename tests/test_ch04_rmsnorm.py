"""Chapter 4 milestone: RMSNorm.

Oracles: the formula evaluated in float64, torch.nn.RMSNorm, and transformers' Qwen3RMSNorm
(the exact rounding order Qwen3 was trained with, for 16-bit inputs).
"""
import pytest
import torch
from torch import nn

pytestmark = pytest.mark.chapter(4)

EPS = 1e-6


def inputs(device, dtype, shape=(3, 5, 64), scale=3.0, seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = scale * torch.randn(shape, generator=generator)
    w = 1.0 + 0.2 * torch.randn(shape[-1], generator=generator)
    return x.to(device=device, dtype=dtype), w.to(device=device, dtype=dtype)


def float64_formula(x, w, eps=EPS):
    x, w = x.double(), w.double()
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(64,), (3, 5, 64), (2, 4, 3, 16)])
def test_matches_torch_rmsnorm(impl, device, dtype, shape):
    x, w = inputs(device, dtype, shape)
    oracle = nn.RMSNorm(shape[-1], eps=EPS, device=device, dtype=dtype)
    oracle.weight.data.copy_(w)
    got = impl.layers.rms_norm(x, w, EPS)
    assert got.shape == x.shape and got.dtype == dtype, (
        f"rms_norm keeps shape and dtype: input {tuple(x.shape)} {dtype}, got {tuple(got.shape)} {got.dtype}")
    torch.testing.assert_close(got, oracle(x), rtol=1e-5, atol=1e-5,
                               msg=lambda m: f"rms_norm on {tuple(shape)} {dtype} differs from torch.nn.RMSNorm: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_matches_the_float64_formula(impl, device, dtype):
    x, w = inputs(device, dtype)
    got = impl.layers.rms_norm(x, w, EPS)
    expected = float64_formula(x, w)
    # One rounding to dtype for the normalised value, one for the product with the weight.
    rel = {torch.float32: 1e-5, torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10}[dtype]
    err = ((got.double() - expected).abs() / expected.abs().clamp_min(1e-3)).max().item()
    assert err <= 2 * rel, (
        f"{dtype}: largest relative error against the float64 formula is {err:.3g} (allowed {2 * rel:.3g})")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_rounding_matches_qwen3(impl, device, dtype):
    """Statistic in float32, normalised value cast back to the input dtype, then times the weight."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm
    x, w = inputs(device, dtype, seed=1)
    oracle = Qwen3RMSNorm(64, eps=EPS).to(device=device, dtype=dtype)
    oracle.weight.data.copy_(w)
    got = impl.layers.rms_norm(x, w, EPS)
    expected = oracle(x)
    assert got.dtype == dtype, f"a {dtype} input gives a {dtype} output; got {got.dtype}"
    mismatched = (got != expected).sum().item()
    assert mismatched == 0, (
        f"{dtype}: {mismatched} of {x.numel()} outputs differ from Qwen3's RMSNorm in the last bit. Compute the mean "
        f"square and the normalisation in float32, cast the normalised x back to {dtype}, and only then multiply "
        f"by the weight")


def test_large_float16_values_do_not_overflow(impl, device):
    x = torch.full((2, 64), 1000.0, device=device, dtype=torch.float16)     # x*x = 1e6 > fp16's 65504
    w = torch.ones(64, device=device, dtype=torch.float16)
    got = impl.layers.rms_norm(x, w, EPS)
    assert torch.isfinite(got).all() and torch.allclose(got.float(), torch.ones_like(got, dtype=torch.float32)), (
        "rms_norm of float16 values of 1000 should be all ones; squaring in float16 overflows to inf. "
        "Compute the statistic in float32")


def test_properties(impl, device):
    x, _ = inputs(device, torch.float32)
    ones = torch.ones(64, device=device)
    y = impl.layers.rms_norm(x, ones, EPS)
    rms = y.pow(2).mean(-1).sqrt()
    torch.testing.assert_close(rms, torch.ones_like(rms), rtol=1e-4, atol=1e-4,
                               msg="with unit weights every output row has root-mean-square 1")
    torch.testing.assert_close(impl.layers.rms_norm(37.0 * x, ones, EPS), y, rtol=1e-4, atol=1e-5,
                               msg="scaling a row by a positive constant does not change its normalised value")
    zeros = impl.layers.rms_norm(torch.zeros(2, 64, device=device), ones, EPS)
    assert torch.equal(zeros, torch.zeros_like(zeros)), "a zero row normalises to zeros (eps keeps it finite)"
    got = impl.layers.rms_norm(x, ones, 0.5)
    torch.testing.assert_close(got.double(), float64_formula(x, ones, 0.5), rtol=1e-5, atol=1e-6,
                               msg="eps is added to the mean square inside the square root")


def test_module(impl, device):
    norm = impl.layers.RMSNorm(64, eps=EPS).to(device)
    assert tuple(norm.weight.shape) == (64,) and torch.equal(norm.weight.detach().cpu(), torch.ones(64)), (
        "RMSNorm(dim) owns a weight of ones, shape [dim]")
    x, w = inputs(device, torch.float32, seed=2)
    with torch.no_grad():
        norm.weight.copy_(w)
    torch.testing.assert_close(norm(x).double(), float64_formula(x, w), rtol=1e-5, atol=1e-5)
