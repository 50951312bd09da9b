"""Chapter 28: the quantized KV cache."""
from . import Mistake

MILESTONE = "tests/test_ch28_quantized_kv_cache.py"
CODES = f"{MILESTONE}::test_int8_codes_and_scales"
PROTOCOL = f"{MILESTONE}::test_cache_protocol_matches_kvcache"
STORAGE = f"{MILESTONE}::test_storage_is_8_bit_codes_and_at_most_4_bytes_a_vector"
K_SCALES = "self.k_scale = [torch.zeros(scale_shape, dtype=torch.float32, device=device) for _ in range(num_layers)]"
V_SCALES = K_SCALES.replace("k_scale", "v_scale")
BOTH_SCALES = f"{K_SCALES}\n        {V_SCALES}"

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
    Mistake("kv_quant.py", "QuantizedKVCache.__init__",
            before=K_SCALES,
            after=K_SCALES.replace(") for _ in range(num_layers)]", ")] * num_layers"),
            rule="each layer has storage of its own: a list of one tensor repeated is one tensor shared by every layer",
            expect="no two layers share storage",
            tests=(PROTOCOL,)),
    Mistake("kv_quant.py", "QuantizedKVCache.__init__",
            before=V_SCALES,
            after="self.v_scale = self.k_scale",
            rule="keys and values each keep their own scales",
            expect="keys and values do not share storage",
            tests=(PROTOCOL,)),
    Mistake("kv_quant.py", "QuantizedKVCache.__init__",
            before="super().__init__(num_layers, batch, kv_heads, head_dim, max_len, qdtype, device)",
            after="super().__init__(num_layers, batch, kv_heads, head_dim, max_len, dtype, device)",
            rule="the cache keeps 8-bit codes, never a float copy of the keys and values",
            expect="stored keys should be",
            tests=(STORAGE,)),
    Mistake("kv_quant.py", "QuantizedKVCache.__init__",
            before=BOTH_SCALES,
            after=BOTH_SCALES.replace("float32", "float64"),
            rule="at most head_dim + 4 bytes per stored vector: a float32 scale, not a float64 one",
            expect="at most head_dim + 4",
            tests=(STORAGE,)),
    Mistake("kv_quant.py", "QuantizedKVCache.__init__",
            before=BOTH_SCALES,
            after=BOTH_SCALES.replace("float32", "bfloat16"),
            rule="a vector decodes as quantize_kv made it: its scale is kept in float32, not rounded to bfloat16",
            expect="what its stored form decodes to",
            tests=(PROTOCOL,)),
    Mistake("kv_quant.py", "QuantizedKVCache.update",
            before="out.append(dequantize_kv(codes[layer][:, :, :end], scales[layer][:, :, :end], self.dtype))",
            after=("out.append(torch.cat([dequantize_kv(codes[layer][:, :, :self.length], "
                   "scales[layer][:, :, :self.length], self.dtype), x.to(self.dtype)], dim=2))"),
            rule="the new tokens come back decoded from what was stored, like every earlier one, not as given",
            expect="keys of the new tokens",
            tests=(PROTOCOL,)),
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
            expect="what its stored form decodes to",
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
    "QuantizedKVCache.__init__": (
        "what the cache keeps for each stored vector, and where, so that every vector decodes within half a "
        "step of its own range in at most head_dim + 4 bytes (codes and float32 scales per token and head, "
        "never a float copy), with nothing shared between layers or between keys and values"),
    "QuantizedKVCache.update": (
        "how to write the new tokens in that stored form and read every slot back through it, the new ones "
        "included, so that this step sees what every later step will"),
}

DESIGN = ("QuantizedKVCache.__init__", "QuantizedKVCache.update")
