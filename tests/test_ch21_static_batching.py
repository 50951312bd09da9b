"""Chapter 21 milestone: static batching with left padding.

Oracle: the reference package's solo greedy `generate` on the reference tiny model, one
prompt at a time. Every row of a padded batch must produce exactly its solo tokens, for
prompts of very different lengths (including a one-token prompt beside a long one) and
with rows stopping at different steps. The helpers are checked against hand-built tensors,
and the pad token's value must not matter (it is masked, never seen).

The tiny model's greedy choices have wide margins, so the bit-level differences of a
batched forward never flip a token. The parity tests were run over 200 seeds once, all
passing.
"""
import functools
import random

import pytest
import torch

from course.testing import oracles
from course.testing.milestone_helpers import assert_same_tokens

pytestmark = pytest.mark.chapter(21)



def prompt_batch(seed, lengths):
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(n)] for n in lengths]


# These chapters' outputs run on past EOS unless a test names one.
solo = functools.partial(oracles.solo, eos_token_id=None)


def assert_rows_match(label, prompts, expected, got):
    assert len(got) == len(prompts), f"{label}: {len(prompts)} prompts but {len(got)} outputs"
    for row, (want, have) in enumerate(zip(expected, got)):
        if want != have:
            assert_same_tokens(f"{label}: row {row} ({len(prompts[row])}-token prompt)", want, have)


def test_left_pad(impl, device):
    ids, positions, pad_lens = impl.static_batch.left_pad([[5, 6, 7], [8], [1, 2]], pad_id=0, device=device)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8], [0, 1, 2]], "prompts must be padded on the LEFT"
    assert pad_lens.tolist() == [0, 2, 1]
    real = ids != 0
    assert positions[real].tolist() == [0, 1, 2, 0, 0, 1], "each row's real tokens must get positions 0, 1, 2, ..."
    assert positions[~real].tolist() == [0, 0, 0], "pad columns get position 0 (the contract's fixed value)"
    assert {ids.device.type, positions.device.type, pad_lens.device.type} == {device.type}
    try:
        impl.static_batch.left_pad([[1], []])
    except ValueError:
        pass
    else:
        pytest.fail("left_pad([[1], []]) returned: an empty prompt is refused with ValueError")


def test_padding_mask(impl):
    mask = impl.static_batch.padding_mask(torch.tensor([0, 2, 1]), 4)
    assert mask.dtype == torch.bool and mask.shape == (3, 1, 1, 4), \
        f"expected a bool [B, 1, 1, slots] mask, got {mask.dtype} {tuple(mask.shape)}"
    assert mask[:, 0, 0].tolist() == [[True] * 4, [False, False, True, True], [False, True, True, True]], (
        f"pad_lens [0, 2, 1] over 4 slots gave {mask[:, 0, 0].tolist()}: slot j of row b is allowed exactly "
        "when j >= pad_lens[b]")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_row_equals_solo_generate(impl, tiny_model, ref_model, seed):
    prompts = prompt_batch(seed, [1, 45, 7, 2, 23])
    expected = [solo(ref_model, p, 10) for p in prompts]
    got = impl.static_batch.generate_batch(tiny_model, prompts, 10)
    assert_rows_match(f"seed {seed}", prompts, expected, got)


def test_rows_stop_at_their_own_eos(impl, tiny_model, ref_model):
    prompts = prompt_batch(3, [30, 1, 12, 4])
    free = [solo(ref_model, p, 12) for p in prompts]
    eos = free[0][2]                     # row 0 stops after 3 tokens; the others go on (or stop where they meet it)
    expected = [solo(ref_model, p, 12, eos_token_id=eos) for p in prompts]
    assert len(expected[0]) == 3 and max(len(e) for e in expected) == 12
    got = impl.static_batch.generate_batch(tiny_model, prompts, 12, eos_token_id=eos)
    assert_rows_match(f"eos_token_id={eos}", prompts, expected, got)


def test_pad_value_is_invisible(impl, tiny_model, ref_model):
    prompts = prompt_batch(4, [3, 19, 1])
    expected = [solo(ref_model, p, 8) for p in prompts]
    for pad_id in (0, 123, 255):
        got = impl.static_batch.generate_batch(tiny_model, prompts, 8, pad_id=pad_id)
        assert_rows_match(f"pad_id={pad_id} (padding must be masked out)", prompts, expected, got)


def test_one_prefill_call_then_one_call_per_step(impl, tiny_model):
    prompts = prompt_batch(5, [6, 2, 11])
    calls = []

    def record(module, args, kwargs):
        ids = args[0] if args else kwargs["input_ids"]
        positions = args[1] if len(args) > 1 else kwargs.get("positions")
        calls.append((tuple(ids.shape), None if positions is None else positions.tolist()))

    handle = tiny_model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        out = impl.static_batch.generate_batch(tiny_model, prompts, 5)
    finally:
        handle.remove()
    assert [len(o) for o in out] == [5, 5, 5]
    shapes = [shape for shape, _ in calls]
    assert shapes[0] == (3, 11), f"the prefill must be one [3, 11] call over the padded batch, got {shapes[0]}"
    assert shapes[1:] == [(3, 1)] * 4, f"then one [3, 1] call per decode step for all rows, got {shapes[1:]}"
    # RoPE only sees position differences, so shifted positions would still give the solo
    # tokens here (to rounding); the positions must be right all the same.
    prefill = calls[0][1]
    assert prefill is not None, "the prefill must pass each row's own positions"
    for row, prompt in enumerate(prompts):
        real = prefill[row][11 - len(prompt):]
        assert real == list(range(len(prompt))), f"row {row}: real tokens must sit at positions 0.., got {real}"
    for step, (_, positions) in enumerate(calls[1:]):
        expected = [[len(p) + step] for p in prompts]
        assert positions == expected, f"decode step {step}: positions must be {expected}, got {positions}"
