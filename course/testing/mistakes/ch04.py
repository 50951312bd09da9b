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
            rule="the output has the input's dtype: the normalised x is cast back before the weight multiplies it",
            expect="output"),
]
