"""Chapter 2 milestone: FLOPs, KV bytes and the cost of a whole step, from a config.

Oracles: known figures (Qwen3-8B in bfloat16 keeps 147,456 KV bytes per token; a token
costs about 2 FLOPs per weight), torch's FlopCounterMode counting the matrix products the
reference model really runs, and the bytes the reference KV cache really allocates.
"""
import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import course
from course.models import tiny_config, tiny_qwen3
from course.testing.oracle_records import recorded
from course.testing.oracles import reference_tiny_qwen3

pytestmark = pytest.mark.chapter(2)

QWEN3_8B = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False)
QWEN3_06B = dict(QWEN3_8B, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                 num_attention_heads=16, tie_word_embeddings=True)


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def tiny_cfg(request, impl):
    """The tiny Qwen3's config (untied and tied); the reference model with it runs on the CPU."""
    return tiny_config(impl.package, tie_word_embeddings=request.param)


def measured_flops(cfg, prompt_len, new_tokens, batch=1):
    """FLOPs torch counts for the reference tiny model feeding `new_tokens` after a cached
    prompt of `prompt_len` (recorded, for an edition without the reference)."""
    def count():
        reference = course.reference()
        model = tiny_qwen3(reference.package, tie_word_embeddings=cfg.tie_word_embeddings)
        cache = reference.kv_cache.KVCache.for_model(model, batch, prompt_len + new_tokens)
        ids = torch.arange(1, prompt_len + new_tokens + 1).remainder(250).repeat(batch, 1)
        with torch.inference_mode():
            if prompt_len:
                model(ids[:, :prompt_len], cache=cache)
            with FlopCounterMode(display=False) as counter:
                model(ids[:, prompt_len:], cache=cache)
        return counter.get_total_flops()
    return recorded("FLOPs of a cached step of the tiny model", (cfg, prompt_len, new_tokens, batch), count)


def reference_kv_bytes(cfg, slots, dtype):
    """Bytes the reference KV cache allocates for `slots` tokens of one sequence."""
    return recorded("KVCache.nbytes", (cfg, slots, dtype), lambda: course.reference().kv_cache.KVCache(
        cfg.num_hidden_layers, 1, cfg.num_key_value_heads, cfg.head_dim, slots, dtype).nbytes)


@pytest.mark.parametrize("dtype,expected", [(torch.bfloat16, 147_456), (torch.float16, 147_456),
                                            (torch.float32, 294_912), (torch.int8, 73_728)])
def test_kv_bytes_qwen3_8b(impl, dtype, expected):
    got = impl.cost.kv_bytes_per_token(impl.qwen3.Qwen3Config(**QWEN3_8B), dtype)
    assert got == expected, (f"Qwen3-8B in {dtype}: a token's K and V over 36 layers x 8 KV heads x 128 "
                             f"channels take {expected:,} bytes; kv_bytes_per_token gave {got!r}")


def test_kv_bytes_match_a_real_cache(impl, tiny_cfg):
    cfg, slots = tiny_cfg, 37
    for dtype in (torch.float32, torch.bfloat16):
        expected = reference_kv_bytes(cfg, slots, dtype) // slots
        got = impl.cost.kv_bytes_per_token(cfg, dtype)
        assert got == expected, (f"the reference KV cache of the tiny model in {dtype} holds {expected} bytes "
                                 f"per token slot; kv_bytes_per_token gave {got}")


def test_kv_bytes_depend_on_kv_heads_not_query_heads(impl):
    cfg = impl.qwen3.Qwen3Config(**QWEN3_8B)
    more_queries = impl.qwen3.Qwen3Config(**dict(QWEN3_8B, num_attention_heads=64))
    assert impl.cost.kv_bytes_per_token(more_queries) == impl.cost.kv_bytes_per_token(cfg) == 147_456, (
        "doubling the query heads must not change the KV bytes per token (only key/value heads store anything); "
        "and the default dtype is bfloat16")


@pytest.mark.parametrize("context", [2, 9, 40])
def test_flops_per_token_match_a_decode_step(impl, tiny_cfg, context):
    measured = measured_flops(tiny_cfg, context - 1, 1)
    got = impl.cost.flops_per_token(tiny_cfg, context)
    tied = "tied" if tiny_cfg.tie_word_embeddings else "untied"
    assert got == measured, (f"tiny model ({tied}): one decode step whose token sees {context} keys runs "
                             f"{measured:,} FLOPs of matrix products (torch's FlopCounterMode); "
                             f"flops_per_token(cfg, {context}) gave {got:,}")


def test_flops_per_token_is_about_twice_the_parameters(impl):
    cfg = impl.qwen3.Qwen3Config(**QWEN3_8B)
    # Qwen3-8B: 6,946,075,648 non-embedding parameters plus a 151936 x 4096 LM head.
    two_per_weight = 2 * (6_946_075_648 + 151936 * 4096)
    got = impl.cost.flops_per_token(cfg, 0)
    assert abs(got - two_per_weight) / two_per_weight < 1e-4, (
        f"Qwen3-8B with no context: about 2 FLOPs per multiplied weight, the LM head included "
        f"({two_per_weight:,}); got {got:,}")
    # The attention term: 4 * layers * heads * head_dim FLOPs per key seen.
    per_key = 4 * 36 * 32 * 128
    assert impl.cost.flops_per_token(cfg, 4096) - got == 4096 * per_key, (
        "each key a token sees adds 4 * layers * query_heads * head_dim FLOPs (Q.K and A.V)")


def test_weight_bytes_of_qwen3_8b(impl):
    got = impl.cost.weight_bytes(impl.qwen3.Qwen3Config(**QWEN3_8B), torch.bfloat16)
    assert got == 16_381_470_720, f"Qwen3-8B holds 8,190,735,360 parameters, 2 bytes each in bf16; got {got:,}"


@pytest.mark.parametrize("batch,past,new", [(1, 4, 1), (3, 11, 1), (2, 5, 4)])
def test_step_flops_match_the_model(impl, tiny_cfg, batch, past, new):
    """A step of `new` tokens costs what feeding them one at a time does (causal attention)."""
    one_at_a_time = sum(measured_flops(tiny_cfg, past + i, 1) for i in range(new))
    got = impl.cost.step_cost(tiny_cfg, new, past, batch=batch).flops
    assert got == batch * one_at_a_time, (
        f"batch={batch}, past_tokens={past}, new_tokens={new}: the tiny model runs {batch * one_at_a_time:,} FLOPs "
        f"(FlopCounterMode, one token at a time: token i sees past + i keys, and every sequence of the batch "
        f"pays its own); step_cost gave {got:,}")
    if new == 1:
        assert got == measured_flops(tiny_cfg, past, 1, batch=batch)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_step_bytes(impl, tiny_cfg, dtype):
    model = reference_tiny_qwen3(tie_word_embeddings=tiny_cfg.tie_word_embeddings)
    matrices = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    width = torch.empty((), dtype=dtype).element_size()
    kv = reference_kv_bytes(tiny_cfg, 1, dtype)
    for batch, past, new in [(1, 0, 16), (4, 30, 1), (2, 7, 3)]:
        expected = matrices * width + batch * (past + new) * kv
        got = impl.cost.step_cost(tiny_cfg, new, past, batch=batch, dtype=dtype).bytes
        assert got == expected, (
            f"{dtype}, batch={batch}, past_tokens={past}, new_tokens={new}: the step reads every weight matrix once "
            f"({matrices:,} numbers, the LM head included, norms and embedding table left out) and the K/V of "
            f"past + new tokens per sequence: "
            f"{expected:,} bytes; step_cost gave {got:,}")


def test_prefill_is_compute_bound_and_decode_is_memory_bound(impl):
    cfg = impl.qwen3.Qwen3Config(**QWEN3_8B)
    ridge = 989e12 / 3.35e12            # H100 SXM: dense BF16 FLOP/s over HBM bytes/s, about 295
    decode = impl.cost.step_cost(cfg, 1, 1000)
    assert 0.8 < decode.intensity < 1.05, (
        f"Qwen3-8B decoding one token in bf16 does about 1 FLOP per byte of weights read; got {decode.intensity:.2f}")
    prefill = impl.cost.step_cost(cfg, 2048, 0)
    assert prefill.intensity > 5 * ridge, (
        f"a 2048-token prefill shares each weight among 2048 tokens: intensity should be far above the H100's "
        f"ridge point ({ridge:.0f} FLOPs/byte); got {prefill.intensity:.0f}")
    batched = impl.cost.step_cost(cfg, 1, 1000, batch=64)
    assert 10 * decode.intensity < batched.intensity < 64 * decode.intensity, (
        f"64 sequences decoding together share the weights but each reads its own 1000-token KV cache: "
        f"intensity {batched.intensity:.1f} should lie between 10x and 64x that of one ({decode.intensity:.2f})")
