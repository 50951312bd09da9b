"""Chapter 28 milestone: an 8-bit KV cache, within a measured bound of the float one.

Oracles: float32 formulas for the rounding error of one vector (at most half a step, the
step being max|x| / 127), torch's scaled_dot_product_attention for what attention over the
dequantized keys and values must give, the reference model with Chapter 16's float cache
for logits and greedy tokens, the reference's quantize_kv round trip for what a stored
vector decodes to, and the bytes of every tensor the cache keeps (at most head_dim + 4 per
vector) for memory. Greedy
choices must agree wherever the float margin (the logit gap between the two best tokens)
exceeds 0.5, more than twice int8's largest logit error on the tiny model (0.21, measured
over 200 random prompts), so the test is deterministic without being blind to a broken cache.
"""
import pytest
import torch
from torch.nn import functional as F

import course
from course.pytest_plugin import build_model
from course.testing.milestone_helpers import prompt_ids
from course.testing.oracle_records import recorded
from course.testing.oracles import reference_tiny_qwen3

pytestmark = pytest.mark.chapter(28)


@pytest.mark.parametrize("shape", [(2, 3, 5, 16), (1, 1, 1, 8), (4, 64)])
def test_int8_codes_and_scales(impl, shape):
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(shape, generator=g) * torch.logspace(-3, 2, shape[-2] if len(shape) > 1 else 1)[..., None]
    codes, scale = impl.kv_quant.quantize_kv(x, "int8")
    assert codes.dtype == torch.int8 and codes.shape == x.shape, f"codes: {codes.dtype} {tuple(codes.shape)}"
    assert scale.dtype == torch.float32 and scale.shape == x.shape[:-1], (
        f"one float32 scale per vector: expected shape {tuple(x.shape[:-1])}, got {tuple(scale.shape)}")
    step = x.abs().amax(-1) / 127
    torch.testing.assert_close(scale, step, msg="scale should be max|x| / 127 over the last axis")
    assert int(codes.abs().amax(-1).min()) == 127, (
        "the largest element of each vector should use code +-127 (126 usually means a cast without "
        "rounding: max|x| / scale can come out as 126.99999 in float32, which a bare cast truncates)")
    error = (codes.float() * scale[..., None] - x).abs()
    assert bool((error <= step[..., None] / 2 * (1 + 1e-5) + 1e-12).all()), (
        f"rounding error {float((error / step[..., None]).max()):.3f} steps: round to the nearest code")


def test_zero_vectors_and_fp8(impl):
    x = torch.zeros(3, 8)
    codes, scale = impl.kv_quant.quantize_kv(x, "int8")
    assert torch.isfinite(scale).all() and (scale > 0).all(), "an all-zero vector needs a small positive scale"
    assert (codes == 0).all()
    y = torch.randn(4, 6, 32, generator=torch.Generator().manual_seed(1))
    codes, scale = impl.kv_quant.quantize_kv(y, "fp8")
    assert codes.dtype == torch.float8_e4m3fn
    back = codes.float() * scale[..., None]
    relative = ((back - y).abs() / y.abs().amax(-1, keepdim=True)).max().item()
    assert relative < 1 / 16, f"fp8 e4m3 error {relative:.3f} of max|x|: 3 mantissa bits allow at most 1/16"


def round_trip(x):
    """What a stored vector must decode to: the reference's int8 quantizer and dequantizer."""
    def compute():
        reference = course.reference().kv_quant
        return reference.dequantize_kv(*reference.quantize_kv(x, "int8"))
    return recorded("int8 round trip", x, compute)


def assert_decodes_as_stored(got, sent, what):
    torch.testing.assert_close(got, round_trip(sent), rtol=0, atol=1e-6, msg=lambda m: (
        f"{what}: every returned vector must be what its stored form decodes to, "
        f"dequantize_kv(*quantize_kv(vector)): {m}"))


def test_cache_protocol_matches_kvcache(impl):
    """update returns the decoded prefix, the new tokens decoded too; advance / truncate /
    length and the ValueError behave as in Chapter 16."""
    cache = impl.kv_quant.QuantizedKVCache(2, 1, 2, 8, max_len=6)
    g = torch.Generator().manual_seed(2)
    k1, v1 = torch.randn(1, 2, 4, 8, generator=g), torch.randn(1, 2, 4, 8, generator=g)
    k, v = cache.update(0, k1, v1)
    assert cache.length == 0, "update must not move length"
    assert k.shape == (1, 2, 4, 8) and k.dtype == torch.float32, (
        f"update returns [batch, kv_heads, length + T, head_dim] in the cache's dtype; got {tuple(k.shape)} {k.dtype}")
    assert_decodes_as_stored(k, k1, "keys of the new tokens")
    assert_decodes_as_stored(v, v1, "values of the new tokens")
    cache.update(1, 10 * k1.flip(2), 0.1 * v1.flip(2))
    cache.advance(4)
    k2, v2 = torch.randn(1, 2, 1, 8, generator=g), torch.randn(1, 2, 1, 8, generator=g)
    k, v = cache.update(0, k2, v2)
    assert k.shape == (1, 2, 5, 8), f"after 4 + 1 tokens update should return 5 slots, got {tuple(k.shape)}"
    assert_decodes_as_stored(k, torch.cat([k1, k2], 2), "layer 0's keys, read after its values and layer 1 were "
                             "written (no two layers share storage, and keys and values do not share storage)")
    assert_decodes_as_stored(v, torch.cat([v1, v2], 2), "layer 0's values (keys and values do not share storage)")
    try:
        cache.update(0, torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 3, 8))
    except ValueError:
        pass
    except Exception as error:
        pytest.fail(f"3 tokens at length 4 of 6 raised {type(error).__name__}: {error}; a write past max_len is "
                    "refused with ValueError before writing")
    else:
        pytest.fail("3 tokens at length 4 of 6 were accepted; a write past max_len is refused with ValueError")
    cache.truncate(2)
    assert cache.length == 2


def test_attention_over_quantized_cache_within_bound(impl):
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 4, 9, 16, generator=g)
    k = torch.randn(1, 2, 64, 16, generator=g) * 2
    v = torch.randn(1, 2, 64, 16, generator=g)
    cache = impl.kv_quant.QuantizedKVCache(1, 1, 2, 16, max_len=64)
    kd, vd = cache.update(0, k, v)
    mask = torch.ones(9, 64, dtype=torch.bool).tril(64 - 9)
    exact = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=mask)
    approx = F.scaled_dot_product_attention(q, kd.repeat_interleave(2, 1), vd.repeat_interleave(2, 1),
                                            attn_mask=mask)
    error = (approx - exact).abs().max().item()
    assert error < 0.03, f"attention over int8 K/V differs from float by {error:.4f} (bound 0.03)"
    assert error > 0, "a quantized cache that returns exact values is not storing codes"


def bytes_held(cache):
    """Every tensor the cache keeps, counted here without the cache's own nbytes."""
    total = 0
    for value in vars(cache).values():
        for item in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(item, torch.Tensor):
                total += item.numel() * item.element_size()
    return total


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_storage_is_8_bit_codes_and_at_most_4_bytes_a_vector(impl, tiny_model, fmt):
    """What __init__ allocates: codes in the format's dtype in KVCache's layout, and at most
    head_dim + 4 bytes per stored vector in all; nbytes says so."""
    cfg = tiny_model.cfg
    cache = impl.kv_quant.QuantizedKVCache.for_model(tiny_model, 2, 100, fmt=fmt)
    code_dtype = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}[fmt]
    shape = (2, cfg.num_key_value_heads, 100, cfg.head_dim)
    for name, codes in (("keys", cache.k), ("values", cache.v)):
        assert len(codes) == cfg.num_hidden_layers and all(
            tuple(t.shape) == shape and t.dtype == code_dtype for t in codes), (
            f"stored {name} should be {code_dtype} codes, one tensor {shape} per layer; found "
            f"{[(tuple(t.shape), t.dtype) for t in codes]}")
    assert cache.length == 0 and cache.max_len == 100, "a new cache is empty: length 0, max_len as asked"
    vectors = 2 * cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * 100      # K and V, batch 2
    held = bytes_held(cache)
    assert held <= vectors * (cfg.head_dim + 4), (
        f"{fmt} cache keeps {held} bytes, {held / vectors:.1f} per stored vector: at most head_dim + 4 = "
        f"{cfg.head_dim + 4} (the codes and what decodes them, never a float copy)")
    assert cache.nbytes == held, f"nbytes says {cache.nbytes}; the tensors the cache keeps hold {held} bytes"
    float_cache = impl.kv_cache.KVCache.for_model(tiny_model, 2, 100)
    assert float_cache.nbytes / cache.nbytes >= 4 * cfg.head_dim / (cfg.head_dim + 4) - 1e-9, (
        "against a float32 cache the 8-bit one should save at least 4 * head_dim / (head_dim + 4)")


def test_logits_and_greedy_tokens_close_to_float_cache(impl, tiny_model, device, model_path):
    """Both caches see the same tokens (the float run's, fed back: teacher forcing), so
    every step compares like with like. Where the float margin exceeds 0.5 the int8 cache
    must choose the same token; overall it must agree on at least 90% of steps."""
    ref = reference_tiny_qwen3(device) if model_path is None else build_model(course.reference().package, device,
                                                                               model_path)
    steps, agree, worst = 0, 0, 0.0
    for seed in range(12):
        p = prompt_ids(4 + 3 * seed, seed)

        def float_run(p=p):
            reference = course.reference()
            return reference.kv_quant.greedy_with_cache(ref, p, 16, reference.kv_cache.KVCache.for_model(
                ref, 1, len(p) + 16))
        float_tokens, float_logits = recorded("greedy_with_cache (float cache)", (ref, p, 16), float_run)
        float_logits = float_logits.to(device)
        cache = impl.kv_quant.QuantizedKVCache.for_model(tiny_model, 1, len(p) + 16)
        # The driver loop is given code (not a stub): the learner's cache is what is tested.
        tokens, logits = impl.kv_quant.greedy_with_cache(tiny_model, p, 16, cache, forced=float_tokens)
        worst = max(worst, (logits - float_logits).abs().max().item())
        top = float_logits.topk(2, dim=-1).values
        for step, margin in enumerate((top[:, 0] - top[:, 1]).tolist()):
            steps += 1
            agree += tokens[step] == float_tokens[step]
            if margin > 0.5:
                assert tokens[step] == float_tokens[step], (
                    f"prompt {seed}, step {step}: the float cache's choice {float_tokens[step]} leads by "
                    f"{margin:.2f}, yet the int8 cache chose {tokens[step]}")
    assert agree >= 0.9 * steps, f"int8 and float caches agree on only {agree} of {steps} greedy steps"
    if model_path is None:
        assert 0 < worst < 0.5, f"int8 KV cache moved the tiny model's logits by up to {worst:.3f} (bound 0.5)"
