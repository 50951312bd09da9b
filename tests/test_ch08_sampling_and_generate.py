"""Chapter 8 milestone: sample() and generate by full recompute.

Oracles: the filtered, renormalised softmax computed here in float64 (empirical frequencies
of many seeded draws must match it, and draws must stay inside its support); transformers'
TopKLogitsWarper, TopPLogitsWarper and MinPLogitsWarper, row by row, for the batched filters
apply_top_k_top_p and apply_min_p; for generate, a
plain argmax loop over the reference tiny model, and a scripted model whose next token is
known in advance (stop tokens, the context limit, what each forward call is fed).
"""
import math

import pytest
import torch
from torch import nn

from course.testing.milestone_helpers import OperatorCounter
from course.testing.oracles import reference_tiny_qwen3

pytestmark = pytest.mark.chapter(8)

LOGITS = torch.tensor([2.0, 1.5, 1.2, 0.4, 0.0, -0.3, -1.0, -2.5])
DRAWS = 40_000


def filtered(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    """The distribution sample() must draw from, computed in float64 step by step."""
    z = [float(v) / temperature for v in logits]
    order = sorted(range(len(z)), key=lambda i: -z[i])
    keep = set(order[:top_k]) if top_k else set(order)
    total = sum(math.exp(z[i]) for i in keep)
    p = {i: math.exp(z[i]) / total for i in keep}
    if top_p < 1.0:
        ranked, mass, kept = sorted(p, key=lambda i: -p[i]), 0.0, {}
        for i in ranked:
            kept[i] = p[i]
            mass += p[i]
            if mass >= top_p:
                break
        p = kept
    if min_p > 0.0:
        floor = min_p * max(p.values())
        p = {i: q for i, q in p.items() if q >= floor}
    total = sum(p.values())
    return torch.tensor([p.get(i, 0.0) / total for i in range(len(z))], dtype=torch.float64)


def frequencies(impl, logits, seed=0, **options):
    generator = torch.Generator(device=logits.device).manual_seed(seed)
    draws = impl.sampling.sample(logits.expand(DRAWS, -1), generator=generator, **options)
    assert draws.shape == (DRAWS,), f"sample on [{DRAWS}, V] logits returns [{DRAWS}] ids; got {tuple(draws.shape)}"
    return torch.bincount(draws.cpu(), minlength=logits.shape[-1]).double() / DRAWS


CASES = {
    "temperature 1": dict(temperature=1.0),
    "temperature 0.5": dict(temperature=0.5),
    "temperature 2": dict(temperature=2.0),
    "top_k 3": dict(temperature=1.0, top_k=3),
    "top_p 0.8": dict(temperature=1.0, top_p=0.8),
    "min_p 0.15": dict(temperature=1.0, min_p=0.15),
    "top_k 5, top_p 0.7, temperature 1.5": dict(temperature=1.5, top_k=5, top_p=0.7),
    "top_p 0.9, min_p 0.3, temperature 0.8": dict(temperature=0.8, top_p=0.9, min_p=0.3),
    # min_p before top_p would keep tokens 0-3, not 0-4: the order of the filters shows
    "top_p 0.8, min_p 0.2, temperature 1.5": dict(temperature=1.5, top_p=0.8, min_p=0.2),
}
RULES = {    # what each filter keeps, in the chapter's words, for failure messages
    "temperature": "the draw follows softmax(logits / temperature)",
    "top_k": "top_k keeps the k highest logits",
    "top_p": "top_p keeps the smallest highest-probability set whose mass reaches top_p (with or without top_k)",
    "min_p": "min_p, applied after top_k and top_p to what they kept, keeps the tokens whose probability is at "
             "least min_p times the top one's",
}


def rules_of(options):
    return "; ".join(rule for name, rule in RULES.items() if name in options)


@pytest.mark.parametrize("case", list(CASES))
def test_frequencies_match_the_filtered_softmax(impl, device, case):
    options = CASES[case]
    expected = filtered(LOGITS, **options)
    got = frequencies(impl, LOGITS.to(device), **options)
    outside = [i for i in range(len(LOGITS)) if expected[i] == 0 and got[i] > 0]
    assert not outside, f"{case}: drew token(s) {outside}, which the filters remove (expected support "\
                        f"{[i for i in range(len(LOGITS)) if expected[i] > 0]}; {rules_of(options)})"
    # Five standard deviations of a binomial frequency: a correct sampler essentially never fails.
    bound = 5 * torch.sqrt(expected * (1 - expected) / DRAWS) + 1e-3
    worst = int(((got - expected).abs() - bound).argmax())
    assert ((got - expected).abs() <= bound).all(), (
        f"{case}: token {worst} was drawn with frequency {got[worst]:.4f}, expected {expected[worst]:.4f} "
        f"({rules_of(options)}; expected distribution {[round(float(p), 3) for p in expected]}, "
        f"measured {[round(float(p), 3) for p in got]})")


def test_rows_are_independent(impl, device):
    logits = torch.stack([LOGITS, LOGITS.flip(0)]).to(device)
    generator = torch.Generator(device=device).manual_seed(1)
    draws = impl.sampling.sample(logits.repeat(DRAWS // 2, 1), top_k=2, temperature=1.0, generator=generator).cpu()
    first, second = set(draws[0::2].tolist()), set(draws[1::2].tolist())
    assert first == {0, 1} and second == {6, 7}, (
        f"top_k=2 filters every row by its own logits: row 0 may draw {{0, 1}}, row 1 {{6, 7}}; got {first}, {second}")


def test_greedy(impl, device):
    logits = torch.tensor([[0.1, 3.0, -1.0, 3.0], [5.0, 5.0, 5.0, 5.0], [-2.0, -1.0, -3.0, -1.5]], device=device)
    got = impl.sampling.sample(logits)
    assert got.dtype == torch.int64 and got.shape == (3,), (
        f"sample([3, V]) returns int64 [3]; got {got.dtype} {tuple(got.shape)}")
    assert got.tolist() == [1, 0, 1], (
        f"greedy picks the argmax, the lowest id among ties: expected [1, 0, 1], got {got.tolist()}")
    single = impl.sampling.sample(logits[0], temperature=0.0)
    assert single.dim() == 0 and int(single) == 1, (
        f"sample on a [V] vector returns one id as a 0-d tensor; got {single!r}")
    # Filters never change a greedy choice, and greedy ignores the generator.
    assert impl.sampling.sample(logits, temperature=0.0, top_k=1, top_p=0.1, min_p=0.9).tolist() == [1, 0, 1]


def test_the_most_likely_token_always_survives(impl, device):
    generator = torch.Generator(device=device).manual_seed(2)
    draws = impl.sampling.sample(LOGITS.to(device).expand(2000, -1), temperature=1.0, top_p=0.01, generator=generator)
    assert set(draws.tolist()) == {0}, "top_p smaller than the top token's probability keeps exactly that token"
    draws = impl.sampling.sample(LOGITS.to(device).expand(2000, -1), temperature=1.0, top_k=100, generator=generator)
    assert draws.max() < len(LOGITS), "top_k larger than the vocabulary keeps everything (and must not fail)"


def test_seeded_generator_reproduces_draws(impl, device):
    logits = torch.randn(16, 50, generator=torch.Generator().manual_seed(3)).to(device)

    def draw(seed, global_seed):
        torch.manual_seed(global_seed)                # must not matter: the generator decides
        generator = torch.Generator(device=device).manual_seed(seed)
        return [impl.sampling.sample(logits, temperature=0.9, top_p=0.95, generator=generator).tolist()
                for _ in range(3)]

    first = draw(7, 0)
    assert draw(7, 12345) == first, "the same seeded generator must give the same draws, whatever the global seed"
    assert draw(8, 0) != first, "a different seed should give different draws (is the generator passed to multinomial?)"


def test_the_draw_is_one_multinomial_in_vocabulary_order(impl, device):
    """The draw contract later chapters compare against token for token (Chapters 17 and
    31): one torch.multinomial over the [B, V] probabilities in vocabulary order. Oracle:
    that call, on float64 softmax probabilities, with a generator of the same seed."""
    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(4)).to(device)
    for seed in range(10):
        got = impl.sampling.sample(logits, temperature=0.8,
                                   generator=torch.Generator(device=device).manual_seed(seed))
        probs = torch.softmax(logits.double() / 0.8, dim=-1)
        want = torch.multinomial(probs / probs.sum(dim=-1, keepdim=True), 1,
                                 generator=torch.Generator(device=device).manual_seed(seed))[:, 0]
        differ = (got.cpu() != want.cpu()).nonzero().flatten().tolist()
        assert not differ, (f"seed {seed}: rows {differ[:5]} drew other tokens than one multinomial over the "
                            f"probabilities in vocabulary order (a draw in sorted order breaks the seeded "
                            f"comparisons of Chapters 17 and 31)")


# --- the batched filters: one value per row ------------------------------------------------------

FILTER_VOCAB = 64


def filter_cases():
    """Eleven rows of logits with their own (top_k, top_p, min_p), ties at the k-th place included."""
    settings = [(0, 1.0, 0.0), (5, 1.0, 0.0), (0, 0.8, 0.0), (7, 0.6, 0.0), (0, 1.0, 0.1), (10, 0.9, 0.05),
                (1, 0.5, 0.0), (64, 1e-9, 0.0), (3, 0.9, 0.0), (2, 1.0, 1.0), (0, 1.0, 0.0)]
    logits = torch.randn(len(settings), FILTER_VOCAB, generator=torch.Generator().manual_seed(1)) * 2
    logits[10] *= 15        # a steep row: its least likely tokens weigh less than float32's epsilon
    logits[1, [3, 9, 20]] = logits[1].max() - 0.5          # ties at the 2nd-4th place, top_k 5
    logits[8, [1, 2, 30, 40, 50, 60]] = logits[8].max() + 1    # six tokens tied at the top, top_k 3: all stay
    logits[9, [4, 5, 6]] = logits[9].max() + 1               # a tie across the k-th place, top_k 2: all stay
    top_k = torch.tensor([k if k else FILTER_VOCAB for k, _, _ in settings])
    top_p = torch.tensor([p for _, p, _ in settings])
    min_p = torch.tensor([m for _, _, m in settings])
    return settings, logits, top_k, top_p, min_p


def kept_ids(row):
    return torch.isfinite(row).nonzero().flatten().tolist()


def test_top_k_and_top_p_keep_what_transformers_warpers_keep(impl):
    transformers = pytest.importorskip("transformers")
    settings, logits, top_k, top_p, _ = filter_cases()
    # Each rule alone first (so a failure names it), then both.
    rules = [("top_p alone", torch.full_like(top_k, FILTER_VOCAB), top_p,
              "top_p keeps, from the most likely down, each token while the probability mass strictly before "
              "it is below top_p (the most likely token always; top_p = 1 keeps every token)"),
             ("top_k alone", top_k, torch.ones_like(top_p),
              "top_k keeps every token whose logit is >= the row's k-th highest, ties with the k-th included "
              "(a top_k >= V is off)"),
             ("top_k then top_p", top_k, top_p,
              "top_p is measured on the distribution that top_k left, renormalised")]
    for what, ks, ps, rule in rules:
        start = logits.clone()
        got = impl.sampling.apply_top_k_top_p(start, ks, ps)
        assert got is start, "apply_top_k_top_p works in place and returns the tensor it was given"
        for row in range(len(settings)):
            want = logits[row:row + 1].clone()
            if ks[row] < FILTER_VOCAB:
                want = transformers.TopKLogitsWarper(int(ks[row]))(None, want)
            if ps[row] < 1:
                want = transformers.TopPLogitsWarper(float(ps[row]))(None, want)
            kept, expected = torch.isfinite(got[row]), torch.isfinite(want[0])
            assert torch.equal(kept, expected), (
                f"apply_top_k_top_p, {what}, row {row} (top_k={int(ks[row])}, top_p={float(ps[row])}): {rule}; "
                f"kept {kept_ids(got[row])}, transformers keeps {kept_ids(want[0])}")
            assert torch.equal(got[row][kept], logits[row][kept]), (
                f"apply_top_k_top_p, {what}, row {row}: surviving logits keep their values")


def test_min_p_keeps_what_transformers_warper_keeps(impl):
    transformers = pytest.importorskip("transformers")
    settings, logits, _, _, min_p = filter_cases()
    logits[4, :20] = float("-inf")                   # tokens an earlier filter removed have probability 0
    start = logits.clone()
    got = impl.sampling.apply_min_p(start, min_p)
    assert got is start, "apply_min_p works in place and returns the tensor it was given"
    for row in range(len(settings)):
        want = logits[row:row + 1] if min_p[row] == 0 else \
            transformers.MinPLogitsWarper(float(min_p[row]))(None, logits[row:row + 1].clone())
        kept, expected = torch.isfinite(got[row]), torch.isfinite(want[0])
        assert torch.equal(kept, expected), (
            f"apply_min_p, row {row} (min_p={float(min_p[row])}): a token survives when its probability (softmax "
            f"of the row as given) is at least min_p times the most likely token's (min_p = 0 is off, min_p = 1 "
            f"keeps the tokens tied at the top); kept {kept_ids(got[row])}, transformers keeps {kept_ids(want[0])}")
        assert torch.equal(got[row][kept], logits[row][kept]), (
            f"apply_min_p, row {row}: surviving logits keep their values")


def test_filters_in_float64_at_the_edges(impl):
    """float64 rows, as `sample` and Chapter 37's verifier use them: a top_p below float32's
    smallest normal number keeps exactly one token, min_p = 1 the top one."""
    logits = (torch.randn(4, 300, generator=torch.Generator().manual_seed(6)) * 30).double()
    top = logits.argmax(dim=-1).tolist()
    got = impl.sampling.apply_top_k_top_p(logits.clone(), torch.full((4,), 300), torch.full((4,), 1e-39,
                                                                                              dtype=torch.float64))
    assert got.dtype == torch.float64, "apply_top_k_top_p keeps the logits' dtype"
    assert [kept_ids(row) for row in got] == [[t] for t in top], (
        "top_p = 1e-39 keeps exactly the most likely token of each row (the mass before it is 0 < top_p)")
    got = impl.sampling.apply_min_p(logits.clone(), torch.ones(4, dtype=torch.float64))
    assert [kept_ids(row) for row in got] == [[t] for t in top], "min_p = 1 keeps only the most likely token"


def test_filters_cost_a_fixed_number_of_operations(impl):
    """The engine filters a whole step at once: the number of tensor operations may not grow
    with the number of rows (no Python loop over rows)."""
    counts = {}
    for rows in (2, 40):
        logits = torch.randn(rows, FILTER_VOCAB, generator=torch.Generator().manual_seed(rows))
        calls = {"apply_top_k_top_p": (torch.full((rows,), 5), torch.full((rows,), 0.7)),
                 "apply_min_p": (torch.full((rows,), 0.1),)}
        for name, per_row in calls.items():
            with OperatorCounter() as counter:
                getattr(impl.sampling, name)(logits.clone(), *per_row)
            counts[name, rows] = sum(counter.ops.values())
    for name in ("apply_top_k_top_p", "apply_min_p"):
        assert counts[name, 40] == counts[name, 2], (
            f"{name} ran {counts[name, 2]} tensor operations on 2 rows and {counts[name, 40]} on 40: it must filter "
            f"every row with the same few operations on the whole [R, V] matrix")


class ScriptedModel(nn.Module):
    """Logits that always make (last token + 1) % vocab the argmax; records every input."""

    def __init__(self, vocab=32, context_limit=1 << 20):
        super().__init__()
        self.anchor = nn.Parameter(torch.zeros(1))     # generate reads the device from a parameter
        self.vocab, self.context_limit, self.inputs = vocab, context_limit, []

    def forward(self, input_ids, *args, **kwargs):
        assert kwargs.get("cache") is None, "Chapter 8's generate recomputes: it passes no cache"
        self.inputs.append(input_ids.tolist())
        nxt = (input_ids + 1) % self.vocab
        return 10.0 * nn.functional.one_hot(nxt, self.vocab).float() + self.anchor


@pytest.fixture
def generate(impl):
    def run(model, prompt, max_new_tokens, **options):
        return impl.sampling.generate(model, prompt, max_new_tokens, use_cache=False, **options)
    return run


def test_recompute_feeds_the_whole_sequence(impl, device, generate):
    model = ScriptedModel().to(device)
    out = generate(model, [3, 4], 4)
    assert out == [5, 6, 7, 8], f"the scripted model continues 3, 4 with 5, 6, 7, 8; generate gave {out}"
    assert model.inputs == [[[3, 4]], [[3, 4, 5]], [[3, 4, 5, 6]], [[3, 4, 5, 6, 7]]], (
        f"every step runs the whole sequence so far as one [1, T] batch; the model was fed {model.inputs}")
    assert all(type(t) is int for t in out), "generate returns a list of Python ints"
    direct = impl.sampling.generate_recompute(ScriptedModel().to(device), [3, 4], 4)
    assert direct == out, f"generate_recompute([3, 4], 4) gave {direct}, generate(..., use_cache=False) gave {out}"


def test_stop_tokens(device, generate):
    out = generate(ScriptedModel().to(device), [1], 10, eos_token_id=5)
    assert out == [2, 3, 4, 5], f"EOS (5) ends the output and is part of it: expected [2, 3, 4, 5], got {out}"
    out = generate(ScriptedModel().to(device), [1], 10, stop_token_ids=[9, 4])
    assert out == [2, 3, 4], f"any of stop_token_ids ends the output, included: expected [2, 3, 4], got {out}"
    out = generate(ScriptedModel().to(device), [1], 3, eos_token_id=20)
    assert out == [2, 3, 4], f"max_new_tokens=3 bounds the output: expected [2, 3, 4], got {out}"
    out = generate(ScriptedModel().to(device), [4], 0)
    assert out == [], f"max_new_tokens=0 generates nothing; got {out}"


def test_context_limit(device, generate):
    model = ScriptedModel(context_limit=8).to(device)
    out = generate(model, [0, 1, 2, 3, 4], 10)
    assert out == [5, 6, 7], (f"a 5-token prompt in an 8-position model leaves room for 3 new tokens "
                              f"(the sequence may grow to 8); got {out}")
    assert max(len(x[0]) for x in model.inputs) <= 8, "no forward call may exceed the context limit"
    assert generate(ScriptedModel(context_limit=5).to(device), [0, 1, 2, 3, 4], 3) == [], (
        "a prompt that already fills the context leaves no room for a new token")


@pytest.mark.parametrize("prompt", [[256, 72, 105], [256, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [40]])
def test_greedy_matches_an_argmax_loop(impl, ref_model, device, generate, prompt):
    tokens, expected = list(prompt), []
    with torch.inference_mode():
        for _ in range(12):
            logits = ref_model(torch.tensor([tokens], device=device))
            expected.append(int(logits[0, -1].argmax()))
            tokens.append(expected[-1])
    got = generate(ref_model, prompt, 12)
    first = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), None)
    assert got == expected, (f"prompt {prompt}: greedy generate should repeat the argmax loop (each token from the "
                             f"logits at the last position of the whole sequence so far); first difference at "
                             f"step {first}: expected {expected[first] if first is not None else None}, got "
                             f"{got[first] if first is not None and first < len(got) else 'nothing'} "
                             f"(expected {expected}, got {got})")


def test_sampled_generate_is_reproducible(impl, ref_model, device, generate):
    def run(seed):
        generator = torch.Generator(device=device).manual_seed(seed)
        return generate(ref_model, [256, 65, 66], 10, temperature=1.0, top_k=20, generator=generator)

    first = run(11)
    assert len(first) == 10 and run(11) == first, "sampling with a seeded generator must reproduce the same tokens"
    assert run(12) != first or run(13) != first, "different seeds should give different samples"


def test_greedy_on_the_tiny_model_with_a_context_limit(impl, device, generate):
    # The reference model: Chapter 10 builds the learner's own forward pass.
    model = reference_tiny_qwen3(device, max_position_embeddings=10)
    out = generate(model, [256, 1, 2, 3, 4, 5], 20)
    assert len(out) == 4, (
        f"the tiny model with max_position_embeddings=10 stops a 6-token prompt after 4 tokens; got {len(out)}")


@pytest.mark.parametrize("options", [dict(temperature=1e-39), dict(temperature=1e-30, top_k=3, top_p=0.5),
                                     dict(temperature=9e-6, min_p=0.5)],
                         ids=["temperature 1e-39", "temperature 1e-30 with filters", "temperature 9e-6"])
def test_temperatures_near_zero_are_greedy(impl, device, options):
    """Below 1e-5 (vLLM's threshold) a temperature is greedy: dividing by 1e-39 would turn every
    logit into +-inf and the softmax into NaN, where the distribution meant is the argmax."""
    logits = torch.randn(64, 300, generator=torch.Generator().manual_seed(4)).to(device)
    got = impl.sampling.sample(logits, generator=torch.Generator(device=device).manual_seed(0), **options)
    assert got.tolist() == logits.argmax(-1).tolist(), f"{options}: a temperature below 1e-5 must pick the argmax"


@pytest.mark.parametrize("options", [dict(top_p=1e-39), dict(top_p=1e-300), dict(min_p=1.0), dict(min_p=1e-320),
                                     dict(temperature=1e-4), dict(temperature=1e30)],
                         ids=["top_p 1e-39", "top_p 1e-300", "min_p 1", "min_p 1e-320", "temperature 1e-4",
                              "temperature 1e30"])
def test_sampling_is_numerically_robust(impl, device, options):
    """Valid parameters at the edge of float32's range never give NaN, an empty set or an
    error: a top_p below float32's smallest normal number keeps the top token only."""
    logits = (torch.randn(64, 300, generator=torch.Generator().manual_seed(5)) * 30).to(device)
    options = {"temperature": 1.0, **options}
    got = impl.sampling.sample(logits, generator=torch.Generator(device=device).manual_seed(0), **options)
    assert got.shape == (64,) and bool(((got >= 0) & (got < 300)).all()), f"{options}: ids out of range {got}"
    if options.get("top_p", 1.0) < 1e-30 or options.get("min_p") == 1.0:
        assert got.tolist() == logits.argmax(-1).tolist(), f"{options}: only the most likely token survives"
