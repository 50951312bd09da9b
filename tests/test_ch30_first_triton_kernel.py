"""Chapter 30 milestone: a vector add and a row softmax written in Triton equal torch's.

Without a GPU the kernels run in Triton's interpreter on the CPU; with one (--device cuda)
the very same tests run the compiled kernels. The interpreter is chosen by the
environment variable TRITON_INTERPRET=1, which Triton reads when it is imported and when a
kernel is defined; the course's pytest plugin sets it before any test runs, and this file
sets it too for runs without the plugin.

Oracles: torch's own `+` and `torch.softmax` (in float64 where exactness matters).
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

pytestmark = pytest.mark.chapter(30)


@pytest.fixture(scope="module")
def kernels(impl):
    return impl.triton_kernels


@pytest.fixture(scope="module")
def where(device, kernels):
    """The device the kernels' tensors live on: the GPU when compiled, the CPU when interpreted."""
    return torch.device("cpu") if kernels.interpreting() else device


@pytest.mark.parametrize("n, block", [(1, 128), (1000, 256), (4096, 1024), (5000, 1024)])
def test_vector_add(kernels, where, n, block):
    g = torch.Generator().manual_seed(n)
    x, y = torch.randn(n, generator=g).to(where), torch.randn(n, generator=g).to(where)
    got = kernels.vector_add(x, y, block_size=block)
    assert got.shape == x.shape and got.device.type == where.type
    assert torch.equal(got, x + y), (
        f"n={n}, BLOCK={block}: {int((got != x + y).sum())} elements differ from x + y "
        f"(the last program covers elements {(n - 1) // block * block}..{n - 1}: mask the rest)")


def test_add_kernel_never_writes_past_n_elements(kernels, where):
    """Launch the kernel by hand on 300-element buffers with n_elements = 250: the last
    program's lanes 250..255 must be masked off, leaving the sentinels behind them alone."""
    x, y = torch.ones(300, device=where), torch.ones(300, device=where)
    out = torch.full((300,), 7.0, device=where)
    kernels.add_kernel[(2,)](x, y, out, 250, BLOCK=128)
    assert torch.equal(out[:250], torch.full((250,), 2.0, device=where)), "elements 0..249 should be 1 + 1"
    past = int((out[250:] != 7.0).sum())
    assert past == 0, f"the kernel wrote {past} elements at or past n_elements: mask the store"


def test_vector_add_2d_and_bfloat16(kernels, where):
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(33, 17, generator=g).to(where), torch.randn(33, 17, generator=g).to(where)
    assert torch.equal(kernels.vector_add(x, y, block_size=64), x + y), "a 2-D tensor is a flat array to the kernel"
    xb, yb = x.bfloat16(), y.bfloat16()
    got = kernels.vector_add(xb, yb, block_size=64)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, xb + yb, atol=0, rtol=2 ** -8)


@pytest.mark.parametrize("rows, cols", [(1, 1), (3, 5), (8, 128), (4, 1000), (2, 3000)])
def test_row_softmax(kernels, where, rows, cols):
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(cols)) * 10
    got = kernels.softmax(x.to(where))
    expected = torch.softmax(x.double(), dim=-1)
    worst = (got.double().cpu() - expected).abs().max().item()
    assert worst < 1e-6, f"[{rows}, {cols}]: softmax off by {worst:.2e} (mask padding lanes with -inf)"
    sums = got.double().sum(-1).cpu()
    assert torch.allclose(sums, torch.ones(rows, dtype=torch.float64), atol=1e-5), f"row sums {sums.tolist()}"


def test_softmax_survives_huge_logits_and_strided_rows(kernels, where):
    x = torch.tensor([[1000.0, 999.0, -1000.0, 0.0], [-5.0, -5.0, -5.0, -5.0]])
    got = kernels.softmax(x.to(where)).cpu()
    assert torch.isfinite(got).all(), f"NaN or inf: subtract the row max before exp; got {got.tolist()}"
    torch.testing.assert_close(got, torch.softmax(x, -1))
    wide = torch.randn(6, 40, generator=torch.Generator().manual_seed(3)).to(where)
    view = wide[:, 5:25]                               # rows 40 apart in memory, 20 long
    torch.testing.assert_close(kernels.softmax(view).cpu(), torch.softmax(view.cpu(), -1),
                               msg="rows of a strided view: use the row stride, not the row length")


def test_softmax_bfloat16(kernels, where):
    x = (torch.randn(5, 77, generator=torch.Generator().manual_seed(4)) * 4).bfloat16().to(where)
    got = kernels.softmax(x)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float().cpu(), torch.softmax(x.float().cpu(), -1), atol=4e-3, rtol=1e-2)
