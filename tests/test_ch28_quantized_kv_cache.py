"""Chapter 28 milestone: an 8-bit KV cache, within a measured bound of the float one.

Oracles: float32 formulas for the rounding error of one vector (at most half a step, the
step being max|x| / 127), torch's scaled_dot_product_attention for what attention over the
dequantized keys and values must give, the reference model with Chapter 16's float cache
for logits and greedy tokens, and the byte count of codes + scales for memory. Greedy
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


def test_cache_protocol_matches_kvcache(impl):
    """update stores codes and returns the dequantized prefix; advance / truncate / length
    behave as in Chapter 16."""
    cache = impl.kv_quant.QuantizedKVCache(2, 1, 2, 8, max_len=6)
    g = torch.Generator().manual_seed(2)
    k1, v1 = torch.randn(1, 2, 4, 8, generator=g), torch.randn(1, 2, 4, 8, generator=g)
    k, v = cache.update(0, k1, v1)
    assert cache.length == 0, "update must not move length"
    assert k.shape == (1, 2, 4, 8) and k.dtype == torch.float32
    codes, scale = impl.kv_quant.quantize_kv(k1)
    torch.testing.assert_close(k, codes.float() * scale[..., None],
                               msg="update must return the dequantized keys, new tokens included")
    assert (k - k1).abs().max() <= k1.abs().max() / 254 + 1e-6
    cache.update(1, k1, v1)
    cache.advance(4)
    k2, v2 = torch.randn(1, 2, 1, 8, generator=g), torch.randn(1, 2, 1, 8, generator=g)
    k, v = cache.update(0, k2, v2)
    assert k.shape == (1, 2, 5, 8), f"after 4 + 1 tokens update should return 5 slots, got {tuple(k.shape)}"
    assert cache.k[0].dtype == torch.int8, f"stored keys should be int8 codes, found {cache.k[0].dtype}"
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


def test_memory_is_codes_plus_scales(impl, tiny_model):
    cfg = tiny_model.cfg
    quantized = impl.kv_quant.QuantizedKVCache.for_model(tiny_model, 2, 100)
    float_cache = impl.kv_cache.KVCache.for_model(tiny_model, 2, 100)
    slots = 2 * cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * 100      # K and V, batch 2
    assert quantized.nbytes == slots * (cfg.head_dim + 4), (
        f"int8 cache: expected {slots * (cfg.head_dim + 4)} bytes (1 per number + a float32 scale per "
        f"head vector), nbytes says {quantized.nbytes}")
    assert float_cache.nbytes / quantized.nbytes == pytest.approx(4 * cfg.head_dim / (cfg.head_dim + 4))


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
