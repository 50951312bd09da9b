"""Chapter 12 milestone: measuring floating-point error.

Oracles: torch.nextafter (the next representable number, so the true grid spacing) for
`ulp`; float64 arithmetic written out in the test for `measure_error`; a float64 formula
for RMSNorm with stated bounds derived from the unit roundoff u = eps / 2; and the model
run row by row in the test for `batch_drift`.

Stated bounds (bfloat16 u = 2^-8, float16 u = 2^-11, float32 u = 2^-24):
  - bfloat16 rms_norm (statistics in float32, two bfloat16 roundings: the normalised value
    and the product with the weight): max relative error <= 2u + u^2 + float32 noise,
    checked as <= 2.05 u (measured: 1.94 u).
  - float16 rms_norm: <= 1.5 ulp (relative bounds fail on float16's subnormals; measured 1.44).
  - float32 rms_norm: <= 8 u relative (the 1024-term mean and rsqrt; measured ~4 u).
"""
import pytest
import torch

from course.testing.oracles import reference_tiny_qwen3

pytestmark = pytest.mark.chapter(12)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def sample_values(dtype, seed=0):
    """Magnitudes across the whole range of dtype, exact powers of two, subnormals, zero."""
    g = torch.Generator().manual_seed(seed)
    info = torch.finfo(dtype)
    exponents = torch.randint(int(torch.log2(torch.tensor(info.tiny))) - 4, int(torch.log2(torch.tensor(info.max))) - 1,
                              (400,), generator=g)
    mantissa = 1 + torch.rand(400, generator=g, dtype=torch.float64)
    signs = torch.where(torch.rand(400, generator=g) < 0.5, -1.0, 1.0).double()
    values = signs * mantissa * torch.exp2(exponents.double())
    powers = torch.exp2(torch.arange(-8, 9, dtype=torch.float64))
    extras = torch.tensor([0.0, info.tiny, info.tiny / 8, info.eps, 1.0, 3.0, -2.0], dtype=torch.float64)
    return torch.cat([values, powers, extras]).to(dtype)


def grid_region(value, dtype):
    """Which rule of the grid's spacing applies at `value`, for failure messages."""
    info, magnitude = torch.finfo(dtype), abs(value)
    if magnitude == 0:
        return "at zero the spacing is the smallest one, eps * tiny"
    if magnitude < info.tiny:
        return "below the smallest normal number (a subnormal) the spacing stays eps * tiny"
    return "in [2^k, 2^(k+1)) the spacing is eps * 2^k"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_ulp_is_the_grid_spacing(impl, dtype):
    x = sample_values(dtype)
    got = impl.numerics.ulp(x)
    assert got.dtype == torch.float64 and got.shape == x.shape, f"ulp gave {got.dtype}{tuple(got.shape)}"
    mag = x.abs()
    up = torch.nextafter(mag, torch.full_like(mag, float("inf")))
    want = up.double() - mag.double()
    bad = (got != want).nonzero().flatten()
    assert bad.numel() == 0, (f"{dtype}: ulp({float(x[bad[0]])!r}) = {float(got[bad[0]])!r}, but the next "
                              f"{dtype} number is {float(want[bad[0]])!r} away ({bad.numel()} values wrong; "
                              f"{grid_region(float(x[bad[0]]), dtype)})")
    # The same numbers asked about in another dtype's grid.
    if dtype != torch.bfloat16:
        y = x.double()
        again = impl.numerics.ulp(y, torch.bfloat16)
        bf = y.to(torch.bfloat16).abs()
        exact_bf = (bf.double() == y.abs())
        spacing = torch.nextafter(bf, torch.full_like(bf, float("inf"))).double() - bf.double()
        assert torch.equal(again[exact_bf], spacing[exact_bf]), "ulp(x, dtype) must use dtype's grid"
    assert torch.isnan(impl.numerics.ulp(torch.tensor([float("inf"), float("nan")], dtype=dtype))).all(), (
        "inf and nan have no spacing: ulp gives nan for them")


def test_measure_error_statistics(impl):
    reference = torch.tensor([1.0, -2.0, 0.0, 4.0, 1e-3], dtype=torch.float64)
    approx = torch.tensor([1.0078125, -2.0, 0.5, 3.96875, 1e-3], dtype=torch.float64).to(torch.bfloat16)
    stats = impl.numerics.measure_error(approx, reference)
    a = approx.double()
    err = (a - reference).abs()
    exact = "max_abs and mean_abs are float64 statistics of |approx - reference|, the error itself never rounded"
    assert stats.max_abs == pytest.approx(float(err.max()), rel=1e-12), exact
    assert stats.mean_abs == pytest.approx(float(err.mean()), rel=1e-12), exact
    nz = reference != 0
    assert stats.max_rel == pytest.approx(float((err[nz] / reference[nz].abs()).max()), rel=1e-12), \
        "max_rel must skip zero references (element 2 has reference 0)"
    # ulps of bfloat16 at the reference: 2^-7 at 1, 2^-6 at 2, 2^-5 at 4, and at 0 the smallest spacing.
    assert stats.max_ulp == pytest.approx(0.5 / (2 ** -133), rel=1e-12), \
        "the error 0.5 at reference 0 is measured in bfloat16's smallest spacing, 2^-133"
    small = impl.numerics.measure_error(approx[:2], reference[:2])
    assert small.max_ulp == pytest.approx(1.0, rel=1e-12), "1.0078125 vs 1.0 is one bfloat16 ulp"
    assert all(isinstance(v, float) for v in (stats.max_abs, stats.mean_abs, stats.max_rel, stats.max_ulp)), (
        "ErrorStats holds plain Python floats")
    try:
        at_zero = impl.numerics.measure_error(approx[2:3], reference[2:3])
    except Exception as error:
        pytest.fail(f"measure_error with every reference zero raised {type(error).__name__}: {error}; max_rel is 0.0 "
                    f"when every reference is zero")
    assert at_zero.max_rel == 0.0, f"max_rel is 0.0 when every reference is zero; got {at_zero.max_rel}"


def test_measure_error_does_not_round_the_error(impl):
    """Subtracting in float16 would round the difference itself; the result must be exact."""
    reference = torch.tensor([1000.0 + 1 / 3], dtype=torch.float64)
    approx = reference.to(torch.float16)
    stats = impl.numerics.measure_error(approx, reference)
    assert stats.max_abs == float((approx.double() - reference).abs()), \
        f"max_abs {stats.max_abs!r}: compute errors in float64"


def rms_norm_float64(x, weight, eps):
    x, weight = x.double(), weight.double()
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


@pytest.mark.parametrize("dtype, bound", [(torch.bfloat16, ("rel", 2.05)), (torch.float16, ("ulp", 1.5)),
                                          (torch.float32, ("rel", 8.0))], ids=["bfloat16", "float16", "float32"])
def test_rms_norm_error_within_stated_bound(impl, dtype, bound):
    g = torch.Generator().manual_seed(3)
    x = (3 * torch.randn(256, 1024, generator=g)).to(dtype)
    weight = (1 + 0.1 * torch.randn(1024, generator=g)).to(dtype)
    got = impl.layers.rms_norm(x, weight, 1e-6)
    stats = impl.numerics.measure_error(got, rms_norm_float64(x, weight, 1e-6))
    kind, limit = bound
    u = torch.finfo(dtype).eps / 2
    if kind == "rel":
        assert stats.max_rel <= limit * u, f"{dtype} rms_norm: max relative error {stats.max_rel / u:.3g} u > {limit} u"
    else:
        assert stats.max_ulp <= limit, f"{dtype} rms_norm: {stats.max_ulp:.3g} ulp > {limit} ulp"


def independent_drift(model, prompts):
    ids = torch.tensor(prompts, device=next(model.parameters()).device)
    with torch.no_grad():
        batched = model(ids)
        rows = []
        for i in range(len(prompts)):
            solo = model(ids[i:i + 1])[0]
            diff = (solo.double() - batched[i].double()).abs()
            rows.append((float(diff.max()), int((solo != batched[i]).sum()),
                         int((solo.argmax(-1) != batched[i].argmax(-1)).sum())))
    return rows


@pytest.fixture
def tiny(device):
    """The reference's tiny model (float32) even under --model: its margins are the claim."""
    return reference_tiny_qwen3(device)


@pytest.mark.parametrize("length", [1, 3, 16])
def test_batch_drift_matches_an_independent_run(impl, tiny, length):
    prompts = torch.randint(0, 320, (6, length), generator=torch.Generator().manual_seed(length)).tolist()
    report = impl.numerics.batch_drift(tiny, prompts)
    assert len(report) == len(prompts)
    for i, (got, want) in enumerate(zip(report, independent_drift(tiny, prompts))):
        assert (got.max_abs, got.differing, got.argmax_flips) == want, (
            f"prompt {i} (length {length}): batch_drift says {got}, running it here gives {want} (solo = the prompt "
            f"alone, batched = its row of the one batch of all prompts; max_abs = largest |solo - batched|, "
            f"differing = logits whose bits differ, argmax_flips = positions whose argmax differs)")
        assert got.argmax_flips == 0, f"prompt {i}: batching flipped a greedy choice of the tiny model"


def test_batch_shape_changes_bits_on_this_machine(impl, tiny):
    """The demonstration of the chapter: one decode step (T = 1) for 8 sequences, each
    alone and all together. On CPUs with MKL/oneDNN (and on GPUs) the one-row and the
    many-row matrix products add in different orders, so bits differ; the tiny model's
    greedy margins keep every choice the same."""
    prompts = [[t] for t in range(10, 90, 10)]
    report = impl.numerics.batch_drift(tiny, prompts)
    if sum(r.differing for r in report) == 0:
        pytest.skip("this machine's matrix kernels add a row the same way alone and in a batch")
    assert max(r.max_abs for r in report) < 1e-3, "differences should be rounding-sized"
    assert all(r.argmax_flips == 0 for r in report)


def test_tolerance_for_orders_the_formats(impl):
    tol = {d: impl.numerics.tolerance_for(d) for d in DTYPES}
    assert tol[torch.float32].rtol < tol[torch.float16].rtol < tol[torch.bfloat16].rtol
    exact = torch.linspace(-3, 3, 101, dtype=torch.float64)
    for dtype in DTYPES:
        assert tol[dtype].allows(exact.to(dtype), exact), f"one rounding to {dtype} must be within tolerance_for"
        assert not tol[dtype].allows(exact.to(dtype) * (1 + 64 * torch.finfo(dtype).eps), exact)
