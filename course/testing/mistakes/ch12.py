"""Chapter 12: the number grid (ulp), error statistics and batch drift."""
from . import Mistake

MILESTONE = "tests/test_ch12_numbers_that_drift.py"
ULP = f"{MILESTONE}::test_ulp_is_the_grid_spacing"
STATISTICS = f"{MILESTONE}::test_measure_error_statistics"
DRIFT = f"{MILESTONE}::test_batch_drift_matches_an_independent_run"

MISTAKES = [
    Mistake("numerics.py", "ulp",
            before="torch.exp2(exponent.double() - 1)",
            after="torch.exp2(exponent.double())",
            rule="in [2^k, 2^(k+1)) the spacing is eps * 2^k (frexp's exponent is k + 1)",
            expect="the spacing is eps * 2^k", tests=(ULP,)),
    Mistake("numerics.py", "ulp",
            before="spacing = spacing.clamp(min=info.eps * info.tiny).masked_fill(",
            after="spacing = spacing.masked_fill(",
            rule="below the smallest normal number the spacing stays eps * tiny (subnormals)",
            expect="the spacing stays eps * tiny", tests=(ULP,)),
    Mistake("numerics.py", "ulp",
            before=".masked_fill(magnitude == 0, info.eps * info.tiny)",
            after="",
            rule="at zero the spacing is the smallest one, eps * tiny",
            expect="at zero the spacing", tests=(ULP,)),
    Mistake("numerics.py", "ulp",
            before='return spacing.masked_fill(~torch.isfinite(magnitude), float("nan"))',
            after="return spacing",
            rule="inf and nan have no spacing: ulp gives nan",
            expect="ulp gives nan", tests=(ULP,)),
    Mistake("numerics.py", "measure_error",
            before="rel = err[nonzero] / r[nonzero].abs()",
            after="rel = err / r.abs()",
            rule="relative error skips zero references",
            expect="skip zero references", tests=(STATISTICS,)),
    Mistake("numerics.py", "measure_error",
            before="ulps = err / ulp(r, approx.dtype)",
            after="ulps = err / ulp(approx)",
            rule="ulp error counts the approximation's grid spacing at the reference",
            expect="measured in bfloat16's smallest spacing", tests=(STATISTICS,)),
    Mistake("numerics.py", "measure_error",
            before="a, r = approx.double(), reference.double()",
            after="a, r = approx, reference.to(approx.dtype)",
            rule="the statistics are exact to float64: the error itself is never rounded",
            expect="never rounded", tests=(STATISTICS,)),
    Mistake("numerics.py", "measure_error",
            before="float(rel.max()) if rel.numel() else 0.0",
            after="float(rel.max())",
            rule="max_rel is 0.0 when every reference is zero",
            expect="max_rel is 0.0 when every reference is zero", tests=(STATISTICS,)),
    Mistake("numerics.py", "batch_drift",
            before="row = batched[i]",
            after="row = batched[0]",
            rule="prompt i's solo run is compared with row i of the batch",
            expect="its row of the one batch", tests=(DRIFT,)),
    Mistake("numerics.py", "batch_drift",
            before="differing=bits_differ(solo, row)",
            after="differing=int(((solo - row).abs() > 1e-6).sum())",
            rule="differing counts logits whose bits differ, however small the difference",
            expect="logits whose bits differ", tests=(DRIFT,)),
    Mistake("numerics.py", "batch_drift",
            before="solo = model(ids[i:i + 1])[0]",
            after="solo = model(ids)[i]",
            rule="solo means the prompt alone, a batch of one",
            expect="the prompt alone", tests=(DRIFT,)),
]

# What the learner must decide at each stub (one sentence each), and the chapter's design stubs.
DECIDES = {
    "ulp": (
        "how to find a format's grid spacing at any value from its exponent, exactly, when x is "
        "stored in another format, and what the spacing is at zero, below the normal range and "
        "at inf or nan"
    ),
    "measure_error": (
        "in which precision the differences are taken, on which elements a relative error means "
        "something, and on which grid an error is counted in ulps"
    ),
    "batch_drift": (
        "which two forward calls stand for 'the same sequence alone' and 'inside a batch', and "
        "how to compare them: size of the difference, bits that differ, greedy choices that "
        "flip"
    ),
}
DESIGN = ("ulp",)
