"""Chapter 19 milestone: FastDecoder, one request with static buffers.

Oracle: the reference package's solo greedy `generate` (Chapter 17) on the reference tiny
model with the same weights. Beside parity, the tests pin down what makes the decoder
static: the cache writes where its device-side length says and hands attention the whole
buffer; every decode call gets the same input tensor and the same cache storage (nothing
is allocated for the model's inputs per step); a decoder serves one request after another
without leaking the previous one's keys. On a CUDA device the decode step must be a
captured CUDA graph.

Greedy parity is deterministic: the tiny model's greedy choices have wide margins, far
above the ~1e-6 differences between attending over max_len masked slots and over the
filled ones. The parity tests were run over 200 prompt seeds once, all passing.
"""
import functools
import random

import pytest
import torch

from course.testing import oracles
from course.testing.milestone_helpers import assert_same_tokens

pytestmark = pytest.mark.chapter(19)



def prompts_for(seed, count, low=1, high=40):
    rng = random.Random(seed)
    lengths = [1] + [rng.randint(low, high) for _ in range(count - 1)]
    return [[rng.randrange(256) for _ in range(n)] for n in lengths]


# These chapters' outputs run on past EOS unless a test names one.
solo = functools.partial(oracles.solo, eos_token_id=None)


def test_static_cache_update_writes_at_device_length(impl, device):
    cache = impl.fast_decoder.StaticKVCache(2, 2, 3, 4, 10, torch.float32, device)
    assert torch.is_tensor(cache.length) and cache.length.shape == (2,), "length must be a device tensor [batch]"
    cache.length.copy_(torch.tensor([3, 5], device=device))
    k = torch.randn(2, 3, 2, 4, device=device)
    v = torch.randn(2, 3, 2, 4, device=device)
    k_all, v_all = cache.update(1, k, v)
    assert k_all.shape == (2, 3, 10, 4) and v_all.shape == (2, 3, 10, 4), \
        f"update must return the whole [batch, kv_heads, max_len, head_dim] buffers, got {tuple(k_all.shape)}"
    expected_k = torch.zeros(2, 3, 10, 4, device=device)
    expected_v = torch.zeros(2, 3, 10, 4, device=device)
    expected_k[0, :, 3:5], expected_k[1, :, 5:7] = k[0], k[1]
    expected_v[0, :, 3:5], expected_v[1, :, 5:7] = v[0], v[1]
    assert torch.equal(k_all, expected_k), "row 0 must get slots 3-4 and row 1 slots 5-6 (their own lengths)"
    assert torch.equal(v_all, expected_v), "values must go to the same slots as keys"
    assert torch.equal(cache.k[0], torch.zeros_like(cache.k[0])), "update(1, ...) wrote into layer 0"
    assert cache.length.tolist() == [3, 5], "update must not move length; the model calls advance()"
    cache.advance(2)
    assert cache.length.tolist() == [5, 7]


def test_prefill_matches_one_shot_logits(impl, tiny_model, ref_model, device):
    prompt = prompts_for(1, 2)[1]
    decoder = impl.fast_decoder.FastDecoder(tiny_model, 64)
    with torch.inference_mode():
        expected = ref_model(torch.tensor([prompt], device=device))[0, -1]
        got = decoder.prefill(prompt).clone()
    assert torch.allclose(got, expected, atol=1e-4, rtol=1e-4), \
        f"prefill logits differ from a one-shot forward by {(got - expected).abs().max():.2e}"
    assert decoder.filled == len(prompt)
    assert decoder.cache.length.tolist() == [len(prompt)], "the cache's device length must count the prompt"


@pytest.mark.parametrize("seed", [0, 1])
def test_greedy_equals_generate(impl, tiny_model, ref_model, seed):
    decoder = impl.fast_decoder.FastDecoder(tiny_model, 64)      # one decoder for every request
    for n, prompt in enumerate(prompts_for(seed, 5)):
        expected = solo(ref_model, prompt, 14)
        got = decoder.generate(prompt, 14)
        assert_same_tokens(f"seed {seed}, request {n} ({len(prompt)}-token prompt, reused decoder)", expected, got)


def test_eos_and_stop_tokens(impl, tiny_model, ref_model):
    prompt = prompts_for(2, 2)[1]
    free = solo(ref_model, prompt, 12)
    decoder = impl.fast_decoder.FastDecoder(tiny_model, 64)
    eos = free[4]
    expected = solo(ref_model, prompt, 12, eos_token_id=eos)
    assert_same_tokens(f"eos_token_id={eos} (the EOS token ends the output, included)", expected,
                       decoder.generate(prompt, 12, eos_token_id=eos))
    assert decoder.generate(prompt, 12, eos_token_id=eos)[-1] == eos, "the EOS token is part of the output"
    stop = free[2]
    expected = solo(ref_model, prompt, 12, stop_token_ids=[stop])
    assert_same_tokens(f"stop_token_ids=[{stop}]", expected, decoder.generate(prompt, 12, stop_token_ids=[stop]))


def test_max_len_bounds_prompt_plus_output(impl, tiny_model, ref_model):
    prompt = prompts_for(3, 2)[1]
    free = solo(ref_model, prompt, 20)
    decoder = impl.fast_decoder.FastDecoder(tiny_model, len(prompt) + 5)
    got = decoder.generate(prompt, 20)
    assert got == free[:5], (f"a decoder of max_len = prompt + 5 must stop after 5 tokens (sequence = max_len), "
                             f"as generate stops at the context limit; expected {free[:5]}, got {got}")
    assert decoder.generate(prompt + free[:5], 3) == [], "a prompt that fills max_len leaves no room for output"


def test_step_takes_an_int_or_a_tensor_and_refuses_a_full_decoder(impl, tiny_model, ref_model, device):
    prompt = [5, 6, 7, 8]
    decoder = impl.fast_decoder.FastDecoder(tiny_model, len(prompt) + 2)
    decoder.prefill(prompt)
    from_int = decoder.step(9).clone()
    from_tensor = decoder.step(torch.tensor([10], device=device)).clone()
    with torch.inference_mode():
        expected = ref_model(torch.tensor([prompt + [9, 10]], device=device))[0, -2:]
    for name, got, want in (("step(9)", from_int, expected[0]), ("step(tensor([10]))", from_tensor, expected[1])):
        assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), \
            f"{name}: logits differ from a one-shot forward by {(got - want).abs().max():.2e}"
    assert decoder.filled == len(prompt) + 2, (
        f"filled is {decoder.filled} after a {len(prompt)}-token prefill and 2 steps: "
        "each step counts the token it fed")
    try:
        decoder.step(11)          # all max_len slots are used: refuse before writing past the cache
    except ValueError:
        pass
    except Exception as error:
        pytest.fail(f"a step on a full decoder raised {type(error).__name__}: {error}; a full decoder refuses "
                    "a step with ValueError before writing")
    else:
        pytest.fail("a step on a full decoder returned; a full decoder refuses a step with ValueError before writing")
    assert decoder.filled == len(prompt) + 2, "a refused step must not count a token"
    assert torch.equal(decoder.logits, from_tensor), "a refused step must leave the logits as they were"


def test_no_allocation_for_step_inputs(impl, tiny_model):
    decoder = impl.fast_decoder.FastDecoder(tiny_model, 64)
    seen = []

    def record(module, args, kwargs):
        ids = args[0] if args else kwargs["input_ids"]
        cache = kwargs.get("cache", args[2] if len(args) > 2 else None)
        seen.append((tuple(ids.shape), ids.data_ptr(), id(cache), cache.k[0].data_ptr(), cache.v[-1].data_ptr()))

    storage = (decoder.input_ids.data_ptr(), decoder.cache.k[0].data_ptr(), decoder.cache.v[-1].data_ptr())
    handle = tiny_model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        first = decoder.generate([5, 6, 7], 8)
        second = decoder.generate([9, 10, 11, 12], 8)
    finally:
        handle.remove()
    if decoder.graph is not None:
        pytest.skip("CUDA graph replay calls no Python forward; the graph test covers this device")
    steps = [call for call in seen if call[0] == (1, 1)]
    assert len(steps) == len(first) - 1 + len(second) - 1, \
        f"expected one [1, 1] decode call per fed token, saw shapes {[c[0] for c in seen]}"
    assert {call[1] for call in steps} == {storage[0]}, "every decode step must read the preallocated input_ids buffer"
    assert {call[2] for call in seen} == {id(decoder.cache)}, "every call must use the decoder's one static cache"
    assert {(call[3], call[4]) for call in seen} == {storage[1:]}, "the cache's K/V storage must never be reallocated"
    assert decoder.input_ids.data_ptr() == storage[0], "input_ids was rebound to a new tensor"


def test_cuda_graph_is_captured_on_gpu(impl, tiny_model, ref_model, device):
    if device.type != "cuda":
        pytest.skip("CUDA graphs need --device cuda")
    decoder = impl.fast_decoder.FastDecoder(tiny_model, 64)
    assert isinstance(decoder.graph, torch.cuda.CUDAGraph), "on CUDA the decode step must be a captured graph"
    for n, prompt in enumerate(prompts_for(4, 4)):
        assert_same_tokens(f"graph replay, request {n}", solo(ref_model, prompt, 12), decoder.generate(prompt, 12))
