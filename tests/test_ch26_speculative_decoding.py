"""Chapter 26 milestone: speculative decoding changes how many target forwards a request
costs, never which tokens it gets.

Oracles: the reference's solo greedy `generate` on the target (token for token, whatever the
draft), hand-worked logits for the acceptance rule, the reference's solo `generate` on the
draft for what `propose` must guess, exact counts of target forwards when the draft is the
target itself, and the target's own distribution (estimated from many seeded draws) for
the sampled acceptance rule. Greedy parity is deterministic: the tiny model's greedy
choices have margins far above the ~1e-6 by which a k + 1-token verify differs from
one-token steps.
"""
import inspect
import math

import pytest
import torch

import course
from course.models import tiny_qwen3
from course.pytest_plugin import build_model
from course.testing.milestone_helpers import prompt_ids, step_difference
from course.testing.oracles import reference_generate, reference_tiny_qwen3

pytestmark = pytest.mark.chapter(26)

PROMPT_LENGTHS = (1, 6, 19, 40)


@pytest.fixture(scope="module")
def solo(device, model_path):
    """solo(prompt, new, eos) -> the reference target's greedy generate (memoised)."""
    target = reference_tiny_qwen3(device) if model_path is None else build_model(
        course.reference().package, device, model_path)
    memo = {}

    def run(p, new, eos_token_id=None):
        key = (tuple(p), new, eos_token_id)
        if key not in memo:
            memo[key] = reference_generate(target, p, new, eos_token_id=eos_token_id)
        return memo[key]
    return run


@pytest.fixture
def drafts(impl, tiny_model, device, model_path):
    """Three drafts: the target itself (every guess right), the target's first layer (some
    right), and an unrelated 1-layer model (almost all wrong)."""
    found = {"target itself": tiny_model,
             "first layer of the target": impl.speculative.truncated_draft(tiny_model, 1)}
    if model_path is None:
        found["unrelated model"] = tiny_qwen3(impl.package, device=device, seed=7, num_hidden_layers=1)
    return found


def one_hot_logits(tokens, vocab=10):
    logits = torch.zeros(len(tokens), vocab)
    logits[torch.arange(len(tokens)), torch.tensor(tokens)] = 5.0
    return logits


@pytest.mark.parametrize("target_choices, guesses, expected", [
    ([4, 7, 1, 9], [4, 7, 1], [4, 7, 1, 9]),       # all three accepted, plus the bonus token
    ([4, 7, 1, 9], [5, 7, 1], [4]),                # the first guess is wrong: only the correction
    ([4, 7, 1, 9], [4, 2, 1], [4, 7]),             # a later guess matching by chance does not count
    ([3], [], [3]),                                # no guesses: a plain decode step
])
def test_accept_greedy_keeps_the_matching_prefix_plus_one(impl, target_choices, guesses, expected):
    got = impl.speculative.accept_greedy(one_hot_logits(target_choices), guesses)
    assert list(got) == expected, (
        f"target's choices {target_choices}, guesses {guesses}: expected emitted {expected}, got {list(got)} "
        "(the guesses up to the first mismatch, then the target's own choice there)")


def test_propose_guesses_what_the_draft_would_generate(impl, drafts, device):
    draft = drafts["first layer of the target"]
    for length in PROMPT_LENGTHS:
        p = prompt_ids(length, seed=length)
        expected = reference_generate(draft, p, 5)
        cache = impl.kv_cache.KVCache.for_model(draft, 1, length + 8)
        try:
            tokens, probs = impl.speculative.propose(draft, cache, p, 5)
        except ValueError as error:          # feeding more than each new guess overflows the cache
            pytest.fail(f"prompt of {length} tokens, 5 guesses: {error}; after the prompt, propose feeds the draft "
                        "each guess alone")
        assert list(tokens) == expected, (
            f"prompt of {length} tokens: the guesses must be the draft's greedy continuation: "
            f"{step_difference(expected, list(tokens))}")
        assert probs is None, "greedy proposals carry no probabilities"
        assert cache.length == length + 4, (
            f"after 5 guesses the draft cache should hold the prompt and guesses 1..4 "
            f"({length + 4} slots), it holds {cache.length}")


@pytest.mark.parametrize("k", [1, 3, 6])
def test_greedy_output_equals_target_solo_generate(impl, solo, tiny_model, drafts, k):
    for name, draft in drafts.items():
        for length in PROMPT_LENGTHS:
            p = prompt_ids(length, seed=100 + length)
            for new in ((1, 2, 17) if length == 6 else (2, 17)):
                expected = solo(p, new)
                rule = "the output must equal the target's solo generate whatever the draft guesses"
                try:
                    got = impl.speculative.speculative_generate(tiny_model, draft, p, new, k=k)
                except ValueError as error:          # a cache that keeps rejected guesses overflows
                    pytest.fail(f"draft '{name}', k={k}, prompt of {length} tokens, {new} new tokens: {error} "
                                f"({rule}: rejected guesses leave the caches)")
                assert list(got) == expected, (
                    f"draft '{name}', k={k}, prompt of {length} tokens, {new} new tokens: "
                    f"{step_difference(expected, list(got))} ({rule})")



def _spy_on_forward(monkeypatch, model, on_call):
    """Replace `model`'s forward (this instance only) by one that reports (input ids of row 0,
    the cache passed) before running the real forward; arguments are bound by signature, so a
    cache passed by position is seen too."""
    original = model.forward
    signature = inspect.signature(original)

    def forward(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        on_call(bound.arguments["input_ids"][0].tolist(), bound.arguments.get("cache"))
        return original(*args, **kwargs)
    monkeypatch.setattr(model, "forward", forward)


def test_the_drafts_cache_never_holds_a_rejected_guess(impl, solo, tiny_model, drafts, model_path, monkeypatch):
    """White-box: output tests cannot see a stale draft (the target's verify hides it: a bad
    guess is only rejected more often), so this test watches what the draft's cache holds.
    Each draft call is replayed onto a list of the tokens at each cache position (a call
    with the cache at length L keeps positions 0 .. L-1 and appends what it feeds). When a
    round begins (the first draft call after a target call), every position the cache holds
    and every token fed must be the committed token there (the oracle: the target's solo
    greedy output)."""
    draft = drafts["unrelated model" if model_path is None else "first layer of the target"]
    rule = "the draft's cache never holds a rejected guess"
    for length, new, k in ((6, 17, 3), (19, 12, 4)):
        p = prompt_ids(length, seed=300 + length)
        committed = list(p) + solo(p, new)
        held: list[int] = []
        state = {"round": 0, "target_called": False, "broken": None}

        def on_target(ids, cache, state=state):
            state["target_called"] = True

        def on_draft(ids, cache, held=held, state=state, committed=committed):
            if cache is None:
                state["broken"] = state["broken"] or "the draft was called without its KVCache"
                return
            start = cache.length
            round_starts, state["target_called"] = state["target_called"], False
            if round_starts:
                state["round"] += 1
            if start > len(held):
                state["broken"] = state["broken"] or (
                    f"round {state['round']}: the draft's cache claims {start} tokens, but only {len(held)} were "
                    "ever fed to it (a position it never saw)")
            del held[start:]
            held.extend(ids)
            if round_starts and state["broken"] is None and held != committed[:len(held)]:
                where = next(i for i, (a, b) in enumerate(zip(held, committed)) if a != b) \
                    if any(a != b for a, b in zip(held, committed)) else len(committed)
                got = held[where] if where < len(held) else None
                want = committed[where] if where < len(committed) else "nothing (past the output)"
                state["broken"] = (
                    f"round {state['round']}: when the round began the draft's cache (with what it was fed) held "
                    f"{len(held)} tokens; position {where} is {got}, but the committed token there is {want}")

        with monkeypatch.context() as patch:
            _spy_on_forward(patch, tiny_model, on_target)
            _spy_on_forward(patch, draft, on_draft)
            stats = impl.speculative.SpecStats()
            try:
                impl.speculative.speculative_generate(tiny_model, draft, p, new, k=k, stats=stats)
            except Exception:
                if state["broken"] is None:
                    raise
        assert state["broken"] is None, (
            f"prompt of {length} tokens, k={k}: {state['broken']} ({rule}, and it sees every committed token "
            "before it guesses: when a round begins it holds committed tokens only, in their positions)")
        assert stats.accepted < stats.proposed, (
            f"prompt of {length} tokens: the test needs a round with a rejected guess, and every guess was accepted")


@pytest.mark.parametrize("k", [1, 4])
def test_perfect_draft_counts(impl, tiny_model, k):
    """With the target as its own draft every guess is accepted: one prefill, then one
    verify per k + 1 tokens (fewer guesses near the end, never past max_new_tokens)."""
    stats = impl.speculative.SpecStats()
    new = 20
    out = impl.speculative.speculative_generate(tiny_model, tiny_model, prompt_ids(9, 1), new, k=k, stats=stats)
    assert len(out) == new
    verifies = math.ceil((new - 1) / (k + 1))
    assert stats.target_forwards == 1 + verifies, (
        f"k={k}, {new} tokens, perfect draft: expected 1 prefill + {verifies} verify forwards, "
        f"counted {stats.target_forwards}")
    assert stats.proposed == stats.accepted == new - 1 - verifies, (
        f"k={k}: expected {new - 1 - verifies} guesses proposed and all accepted; "
        f"proposed {stats.proposed}, accepted {stats.accepted}")
    assert stats.acceptance_rate == 1.0
    assert stats.emitted == new


def test_acceptance_rate_reflects_the_draft(impl, tiny_model, drafts, model_path):
    rates = {}
    for name, draft in drafts.items():
        stats = impl.speculative.SpecStats()
        for length in PROMPT_LENGTHS:
            impl.speculative.speculative_generate(tiny_model, draft, prompt_ids(length, 7), 16, k=3, stats=stats)
        assert 0 <= stats.accepted <= stats.proposed, f"draft '{name}': accepted more guesses than proposed"
        assert stats.emitted == 16 * len(PROMPT_LENGTHS)
        rates[name] = stats.acceptance_rate
    assert rates["target itself"] == 1.0
    assert rates["first layer of the target"] < 1.0
    if model_path is None:
        assert rates["unrelated model"] < rates["first layer of the target"], (
            f"an unrelated draft should be accepted less often than the target's own first layer: {rates}")


def test_stops_at_a_stop_token_like_generate(impl, solo, tiny_model, drafts):
    p = prompt_ids(12, 3)
    stop = solo(p, 20)[6]                               # a token the target emits at step 6 (or earlier)
    expected = solo(p, 20, eos_token_id=stop)
    for name in ("target itself", "first layer of the target"):
        got = impl.speculative.speculative_generate(tiny_model, drafts[name], p, 20, k=4, eos_token_id=stop)
        assert list(got) == expected, (
            f"draft '{name}', stop token {stop}: {step_difference(expected, list(got))} "
            f"(the stop token is the last token returned; accepted guesses after it are dropped)")


CASES = {
    # target rows (k + 1 = 3 of them) and draft rows (k = 2) over a 5-token vocabulary
    "draft always guesses 4": ([[0.6, 0.1, 0.1, 0.1, 0.1], [0.5, 0.1, 0.1, 0.2, 0.1], [0.2] * 5],
                               [[0.0, 0.0, 0.0, 0.0, 1.0], [0.2] * 5]),
    "draft too confident": ([[0.1, 0.2, 0.3, 0.4, 0.0], [0.5, 0.1, 0.1, 0.2, 0.1], [0.2] * 5],
                            [[0.0, 0.0, 0.1, 0.1, 0.8], [0.2] * 5]),
    "draft spread out": ([[0.6, 0.1, 0.1, 0.1, 0.1], [0.0, 0.0, 1.0, 0.0, 0.0], [0.1, 0.1, 0.1, 0.1, 0.6]],
                         [[0.2] * 5, [0.3, 0.3, 0.2, 0.1, 0.1]]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_sampled_acceptance_keeps_the_target_distribution(impl, case):
    """Speculative sampling's promise: the first emitted token is distributed as the
    target's first row, whatever the draft proposes (draws: seeded, so the test is fixed).
    Bounds: four standard deviations of a frequency over `draws` draws; the usual mistakes
    (accepting every guess, or redrawing a rejected one from p instead of max(p - q, 0))
    miss p's frequencies by 0.09 or more in these cases."""
    p_rows, q_rows = (torch.tensor(rows) for rows in CASES[case])
    g = torch.Generator().manual_seed(0)
    draws = 3000
    first = torch.zeros(5)
    lengths = torch.zeros(4)
    all_guesses = torch.stack([torch.multinomial(q, draws, replacement=True, generator=g) for q in q_rows], 1)
    for guesses in all_guesses.tolist():
        out = impl.speculative.accept_sampled(p_rows, q_rows, guesses, generator=g)
        assert 1 <= len(out) <= 3, f"accept_sampled emitted {len(out)} tokens for 2 guesses"
        assert list(out[:-1]) == guesses[:len(out) - 1], "tokens before the last must be accepted guesses"
        first[out[0]] += 1
        lengths[len(out)] += 1
    freq = first / draws
    p0 = p_rows[0]
    bound = 4 * (p0 * (1 - p0) / draws).sqrt() + 0.005
    assert bool(((freq - p0).abs() <= bound).all()), (
        f"{case}: the first emitted token should follow the target row {p0.tolist()}, "
        f"measured {[round(x, 3) for x in freq.tolist()]}")
    # Expected acceptance of the first guess: sum over x of min(p(x), q(x)).
    accept_first = torch.minimum(p_rows[0], q_rows[0]).sum().item()
    measured = (lengths[2:].sum() / draws).item()
    assert abs(measured - accept_first) < 4 * (0.25 / draws) ** 0.5 + 0.005, (
        f"{case}: the first guess should be accepted with probability {accept_first:.3f}, measured {measured:.3f}")


def test_sampled_generation_is_seeded(impl, tiny_model, drafts):
    draft = drafts["first layer of the target"]
    runs = []
    for _ in range(2):
        g = torch.Generator(device=next(tiny_model.parameters()).device).manual_seed(11)
        runs.append(impl.speculative.speculative_generate(tiny_model, draft, prompt_ids(8, 2), 12, k=3,
                                                          temperature=0.8, generator=g))
    assert len(runs[0]) == 12
    assert runs[0] == runs[1], f"same seed, different samples: {runs[0]} vs {runs[1]}"
