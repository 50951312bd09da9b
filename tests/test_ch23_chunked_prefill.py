"""Chapter 23 milestone: chunked prefill for one request.

Oracles: the reference tiny model's one-shot forward over the whole prompt (no cache) for
the logits of every prompt position, and the reference package's solo greedy `generate`
for the tokens. Whatever the chunk size (one token, a size that does not divide the
prompt, the whole prompt, more than the prompt), chunked prefill must give the one-shot
logits to float tolerance and the same greedy tokens; and it must really run in chunks.

The tiny model's greedy choices have wide margins, far above the ~1e-5 logit differences
that splitting the prompt causes. The parity tests were run over 200 seeds once, all passing.
"""
import random

import pytest
import torch

from course.testing.oracles import reference_generate

pytestmark = pytest.mark.chapter(23)

PROMPT_LEN = 29
CHUNKS = [1, 4, 7, PROMPT_LEN, PROMPT_LEN + 10]


def make_prompt(seed, length=PROMPT_LEN):
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(length)]


def new_cache(impl, model, max_len):
    return impl.kv_cache.KVCache.for_model(model, 1, max_len)


@pytest.mark.parametrize("chunk", CHUNKS)
def test_chunked_logits_equal_one_shot(impl, tiny_model, ref_model, device, chunk):
    prompt = make_prompt(chunk)
    cache = new_cache(impl, tiny_model, PROMPT_LEN + 4)
    with torch.inference_mode():
        expected = ref_model(torch.tensor([prompt], device=device))[0]
    got = impl.chunked.prefill_chunked(tiny_model, cache, prompt, chunk, keep_logits=True)
    assert got.shape == expected.shape, f"keep_logits=True must give [prompt, vocab], got {tuple(got.shape)}"
    err = (got.float() - expected).abs().max(dim=-1).values
    worst = int(err.argmax())
    assert err[worst] < 1e-4, (f"chunk size {chunk}: logits at prompt position {worst} differ from the one-shot "
                               f"prefill by {err[worst]:.2e} (first chunk boundary after it: "
                               f"{(worst // chunk + 1) * chunk})")
    assert cache.length == PROMPT_LEN, f"after the prefill the cache must hold {PROMPT_LEN} tokens, not {cache.length}"
    last = impl.chunked.prefill_chunked(tiny_model, new_cache(impl, tiny_model, PROMPT_LEN), prompt, chunk)
    assert last.shape == expected[-1].shape and torch.allclose(last.float(), expected[-1], atol=1e-4), \
        "without keep_logits the result is the last position's logits [vocab]"


@pytest.mark.parametrize("chunk", [1, 3, 8, 40])
def test_calls_are_chunks(impl, tiny_model, chunk):
    prompt = make_prompt(7)
    widths = []

    def record(module, args, kwargs):
        widths.append((args[0] if args else kwargs["input_ids"]).shape[1])

    handle = tiny_model.register_forward_pre_hook(record, with_kwargs=True)
    overflow = ""
    try:
        impl.chunked.prefill_chunked(tiny_model, new_cache(impl, tiny_model, PROMPT_LEN), prompt, chunk)
    except ValueError as error:          # calls that feed more than the prompt overflow its cache
        overflow = f", then {error}"
    finally:
        handle.remove()
    expected = [min(chunk, PROMPT_LEN - start) for start in range(0, PROMPT_LEN, chunk)]
    assert widths == expected and not overflow, (
        f"chunk size {chunk}: expected calls of {expected} tokens, saw {widths}{overflow}")


def test_bad_prompts_and_chunk_sizes_are_refused_before_any_call(impl, tiny_model):
    calls = []
    handle = tiny_model.register_forward_pre_hook(lambda *args: calls.append(1))
    try:
        for prompt, chunk in (([], 4), (make_prompt(1), 0), (make_prompt(2), -3)):
            cache = new_cache(impl, tiny_model, PROMPT_LEN)
            with pytest.raises(ValueError):
                impl.chunked.prefill_chunked(tiny_model, cache, prompt, chunk)
            assert int(torch.as_tensor(cache.length).max()) == 0, \
                f"prompt of {len(prompt)}, chunk {chunk}: the cache must stay empty"
    finally:
        handle.remove()
    assert not calls, "a refused prefill must not call the model"


def test_chunks_continue_a_filled_cache(impl, tiny_model, ref_model, device):
    prompt = make_prompt(11)
    cache = new_cache(impl, tiny_model, PROMPT_LEN)
    with torch.inference_mode():
        tiny_model(torch.tensor([prompt[:10]], device=device), cache=cache)      # a prefix already cached
        expected = ref_model(torch.tensor([prompt], device=device))[0, 10:]
    got = impl.chunked.prefill_chunked(tiny_model, cache, prompt[10:], 6, keep_logits=True)
    err = (got.float() - expected).abs().max()
    assert err < 1e-4, f"chunks after a 10-token cached prefix must continue its positions; logits off by {err:.2e}"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_generate_chunked_equals_generate(impl, tiny_model, ref_model, seed):
    rng = random.Random(seed)
    for n in range(4):
        prompt = make_prompt(100 * seed + n, rng.randint(1, 50))
        chunk = rng.choice([1, 2, 5, 16, 64])
        expected = reference_generate(ref_model, prompt, 10)
        got = impl.chunked.generate_chunked(tiny_model, prompt, 10, chunk)
        if got != expected:
            i = next((i for i, (a, b) in enumerate(zip(expected, got)) if a != b), min(len(got), len(expected)))
            pytest.fail(f"seed {seed}, {len(prompt)}-token prompt in chunks of {chunk}: differs from generate at "
                        f"output token {i}\n  expected {expected}\n  got      {got}")


def test_generate_chunked_stops(impl, tiny_model, ref_model):
    prompt = make_prompt(5, 17)
    free = reference_generate(ref_model, prompt, 10)
    eos = free[3]
    expected = reference_generate(ref_model, prompt, 10, eos_token_id=eos)
    got = impl.chunked.generate_chunked(tiny_model, prompt, 10, 4, eos_token_id=eos)
    assert got == expected, f"eos_token_id={eos}: expected {expected}, got {got} (the EOS token ends the output)"


def test_generate_chunked_calls(impl, tiny_model):
    """Cost contract: a 10-token prompt in chunks of 4 and 3 new tokens take calls of 4, 4, 2,
    then 1 and 1 tokens (the last new token is never fed)."""
    widths = []

    def record(module, args, kwargs):
        widths.append((args[0] if args else kwargs["input_ids"]).shape[1])

    handle = tiny_model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        impl.chunked.generate_chunked(tiny_model, make_prompt(6, 10), 3, 4)
    finally:
        handle.remove()
    assert widths == [4, 4, 2, 1, 1], (
        f"calls of {widths} tokens; expected [4, 4, 2, 1, 1]: the prompt goes in chunks of chunk_size, then one "
        "call per new token")


def record_serve_two(impl, model, running, long_prompt, chunk, steps):
    """serve_two's result and the model calls it made, as (width, token ids) pairs."""
    calls = []

    def record(module, args, kwargs):
        ids = args[0] if args else kwargs["input_ids"]
        calls.append((ids.shape[1], ids[0].tolist()))

    handle = model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        result = impl.chunked.serve_two(model, running, long_prompt, chunk, steps)
    finally:
        handle.remove()
    return result, calls


def check_times(result, steps):
    times, gaps = result["a_token_times"], result["a_gaps"]
    assert len(times) == steps and all(b > a for a, b in zip(times, times[1:])), \
        f"a_token_times must hold one increasing time per step ({steps}), got {times}"
    sums = [sum(gaps[:i + 1]) for i in range(len(gaps))]
    assert len(gaps) == steps and all(abs(s - t) < 1e-9 for s, t in zip(sums, times)), (
        "a_gaps are the waits before each of A's tokens (the first from B's arrival): their running "
        f"sums must be a_token_times; got gaps {gaps} for times {times}")
    assert result["a_max_gap"] == max(gaps), "a_max_gap is the longest of A's waits, max(a_gaps)"


def test_serve_two_interleaves_b_chunks_with_a_decodes(impl, tiny_model, ref_model):
    """Each step runs B's next chunk, then A's decode token; A's tokens are solo generate's."""
    running, long_prompt, steps = make_prompt(21, 5), make_prompt(22, 20), 6
    result, calls = record_serve_two(impl, tiny_model, running, long_prompt, 8, steps)
    widths = [width for width, _ in calls]
    expected = [5, 8, 1, 8, 1, 4, 1, 1, 1, 1]
    assert widths == expected, (
        f"serve_two, A's 5-token prompt, B's 20 tokens in chunks of 8, {steps} steps: expected calls of {expected} "
        f"tokens, saw {widths} (A's prompt first; then each step runs B's next chunk before A's one decode token)")
    fed = [ids[0] for width, ids in calls[1:] if width == 1]
    assert fed == reference_generate(ref_model, running, steps), \
        f"A's decode calls must feed A's greedy tokens (solo generate's), fed {fed}"
    check_times(result, steps)
    times = result["a_token_times"]
    assert result["b_steps"] == 3, f"B's 20 tokens in chunks of 8 take 3 steps; b_steps = {result['b_steps']}"
    first = result["b_first_token"]
    assert first is not None and times[1] < first < times[2], (
        f"B's first token comes out in step 3, after A's token of step 2 ({times[1]:.6f}) and before A's "
        f"token of step 3 ({times[2]:.6f}); b_first_token = {first}")


def test_serve_two_one_shot_and_an_unfinished_prefill(impl, tiny_model):
    running, long_prompt = make_prompt(23, 4), make_prompt(24, 12)
    result, calls = record_serve_two(impl, tiny_model, running, long_prompt, None, 3)
    assert [width for width, _ in calls] == [4, 12, 1, 1, 1], \
        f"chunk_size=None runs B's whole prompt in the first step; calls of {[w for w, _ in calls]}"
    assert result["b_steps"] == 1 and result["b_first_token"] is not None, \
        f"a one-shot prefill takes one step (b_steps {result['b_steps']}, b_first_token {result['b_first_token']})"
    check_times(result, 3)
    result, _ = record_serve_two(impl, tiny_model, running, long_prompt, 2, 4)
    assert result["b_first_token"] is None and result["b_steps"] == 4, (
        "12 tokens in chunks of 2 need 6 steps: after 4 steps b_first_token is None and b_steps is 4; got "
        f"{result['b_first_token']} and {result['b_steps']}")
    with pytest.raises(ValueError):
        impl.chunked.serve_two(tiny_model, running, long_prompt, 0, 2)
