"""Chapter 4: RMSNorm."""
from . import Mistake

MISTAKES = [
    Mistake("layers.py", "rms_norm",
            before="x.float().pow(2).mean(dim=-1, keepdim=True)",
            after="x.pow(2).mean(dim=-1, keepdim=True).float()",
            rule="the mean of squares is taken in float32, even for 16-bit inputs",
            expect="in float32"),
    Mistake("layers.py", "rms_norm",
            before="torch.rsqrt(variance + eps)",
            after="torch.rsqrt(variance) + eps",
            rule="eps is added to the mean of squares, inside the square root",
            expect="float64 formula"),
    Mistake("layers.py", "rms_norm",
            before="torch.rsqrt(variance + eps)).to(x.dtype)",
            after="torch.rsqrt(variance + eps))",
            rule="the output has the input's dtype",
            expect="bfloat16 output"),
    Mistake("layers.py", "rms_norm",
            before="""    normed = (x.float() * torch.rsqrt(variance + eps)).to(x.dtype)
    return weight * normed""",
            after="""    normed = x.float() * torch.rsqrt(variance + eps)
    return (weight * normed).to(x.dtype)""",
            rule="the normalised x is cast back to the input dtype before the weight multiplies it, as Qwen3 does",
            expect="only then multiply",
            tests=("tests/test_ch04_rmsnorm.py::test_16_bit_rounding_matches_qwen3",)),
    Mistake("layers.py", "rms_norm",
            before="x.float().pow(2).mean(dim=-1, keepdim=True)",
            after="x.float().pow(2).mean(dim=-1, keepdim=True).to(x.dtype)",
            rule="the statistic stays in float32 through the normalisation; only the normalised x is rounded",
            expect="the mean square and the normalisation in float32",
            tests=("tests/test_ch04_rmsnorm.py::test_16_bit_rounding_matches_qwen3",)),
    Mistake("layers.py", "rms_norm",
            before="mean(dim=-1, keepdim=True)",
            after="mean(dim=0, keepdim=True)",
            rule="the statistic is taken over the last axis (each token's channels), not over the tokens",
            expect="differs from torch.nn.RMSNorm"),
]

# What the learner must decide at each stub (one sentence each), and the chapter's design stubs.
DECIDES = {
    "rms_norm": (
        "which steps run in float32 and where the result is rounded back to x's dtype, so that "
        "16-bit inputs neither overflow nor drift and the output matches Qwen3's RMSNorm bit "
        "for bit"
    ),
}
DESIGN = ("rms_norm",)
