"""Chapter 28: the quantized KV cache."""
from . import Mistake

MILESTONE = "tests/test_ch28_quantized_kv_cache.py"
CODES = f"{MILESTONE}::test_int8_codes_and_scales"
PROTOCOL = f"{MILESTONE}::test_cache_protocol_matches_kvcache"

MISTAKES = [
    Mistake("kv_quant.py", "quantize_kv",
            before="scaled.round().clamp(-qmax, qmax)",
            after="scaled.clamp(-qmax, qmax)",
            rule="int8 codes are rounded to the nearest code, not truncated by the cast",
            expect="cast without rounding",
            tests=(CODES,)),
    Mistake("kv_quant.py", "quantize_kv",
            before="x.abs().amax(dim=-1) / qmax",
            after="x.abs().amax() / qmax",
            rule="one scale per vector (the last axis), not one for the whole tensor",
            expect="one float32 scale per vector",
            tests=(CODES,)),
    Mistake("kv_quant.py", "quantize_kv",
            before="x.abs().amax(dim=-1) / qmax",
            after="x.abs().amax(dim=-1) / (qmax + 1)",
            rule="the scale maps each vector's largest magnitude to the largest code, 127",
            expect="max|x| / 127",
            tests=(CODES,)),
    Mistake("kv_quant.py", "quantize_kv",
            before="    scale = scale.clamp_min(torch.finfo(torch.float32).tiny)\n",
            after="",
            rule="an all-zero vector gets a small positive scale, never 0 (no division by zero)",
            expect="small positive scale",
            tests=(f"{MILESTONE}::test_zero_vectors_and_fp8",)),
    Mistake("kv_quant.py", "QuantizedKVCache.update",
            before="dequantize_kv(codes[layer][:, :, :end], scales[layer][:, :, :end],",
            after="dequantize_kv(codes[layer][:, :, self.length:end], scales[layer][:, :, self.length:end],",
            rule="update returns every slot so far, dequantized, not only the new ones",
            expect="should return 5 slots",
            tests=(PROTOCOL,)),
    Mistake("kv_quant.py", "QuantizedKVCache.update",
            before="            scales[layer][:, :, self.length:end] = s\n",
            after="",
            rule="each vector's scale is stored beside its codes",
            expect="dequantized keys",
            tests=(PROTOCOL,)),
    Mistake("kv_quant.py", "QuantizedKVCache.update",
            before="if end > self.max_len:",
            after="if self.length > self.max_len:",
            rule="a write past max_len is refused with ValueError before anything is written",
            expect="refused with ValueError",
            tests=(PROTOCOL,)),
]

DECIDES = {
    "quantize_kv": (
        "what one scale covers (one vector per token and head), and how to keep an all-zero vector and the "
        "format's range from producing NaN or overflow"),
    "QuantizedKVCache.update": (
        "what the cache stores (codes and their scales, never the floats) and why the new tokens must come "
        "back dequantized like every earlier one"),
}

DESIGN = ("QuantizedKVCache.update",)
