"""Chapter 34 milestone: the full sampler (penalties, bias, allowed and bad tokens,
min_tokens, per-request top-k/top-p/min-p through Chapter 8's filters, per-request seeds,
logprobs and prompt logprobs).

Oracles: float64 formulas written here; transformers' logits processors where their
semantics equal vLLM's (RepetitionPenaltyLogitsProcessor, NoBadWordsLogitsProcessor,
MinNewTokensLengthLogitsProcessor, the MinP -> TopK -> TopP warpers in vLLM's order, and
TypicalLogitsWarper for typical_p, which vLLM lacks);
the REFERENCE model's own logits for logprobs; a chi-square test with a fixed seed for the
sampled path (significance 0.001; the seed was checked by hand over 200 seeds, see
test_draws_follow_the_filtered_distribution). The engine test of seeded requests was run
by hand for request seeds 0..59 in all three configurations: identical tokens and prompt
logprobs every time (the seeded request is the one preempted: 4 times by recompute, once
by swap, with seed 2024).
"""
import math

import pytest
import torch

from course.testing.oracles import TINY_EOS, assert_engine_idle, make_engine

pytestmark = pytest.mark.chapter(34)

VOCAB = 320          # the tiny model's vocabulary


@pytest.fixture
def sampler(impl):
    return impl.load("serve.sampler")


def make_request(serve, rid, prompt, output=(), **params):
    request = serve.request.Request(rid, list(prompt), serve.request.SamplingParams(**params), eos_token_id=TINY_EOS)
    for token in output:
        request.append(token)
    return request


# --- the rules, one at a time ----------------------------------------------------------------------

def penalised(prompts, outputs, repetition, presence, frequency, logits):
    """vLLM's three penalties, one token at a time in float64: the oracle."""
    expected = logits.double().clone()
    for r in range(len(prompts)):
        for t in set(prompts[r]) | set(outputs[r]):
            x = expected[r, t]
            expected[r, t] = x / repetition[r] if x > 0 else x * repetition[r]
        for t in set(outputs[r]):
            expected[r, t] -= frequency[r] * outputs[r].count(t) + presence[r]
    return expected


def test_penalties_match_vllm_formulas_and_transformers(serve, sampler):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 16, generator=gen) * 3
    logits[0, 3] = logits[2, 5] = float("-inf")             # forbidden tokens that every penalty touches
    prompts = [[1, 2, 3], [4, 4], [5]]
    outputs = [[3, 7, 7, 9], [], [5, 5, 5, 11]]
    prompt_mask = torch.zeros(3, 16, dtype=torch.bool)
    counts = torch.zeros(3, 16)
    for r in range(3):
        prompt_mask[r, prompts[r]] = True
        for t in outputs[r]:
            counts[r, t] += 1
    off = [0.0, 0.0, 0.0]
    # One penalty at a time, so a failure names the rule it broke; then all three together.
    cases = [("repetition", [1.5, 0.7, 1.3], off, off,
              "the repetition penalty touches every token seen in the prompt or the output: a positive logit "
              "is divided by the value, a negative one multiplied (the sign is read before the change)"),
             ("frequency", [1.0] * 3, off, [0.25, 1.0, 0.4],
              "the frequency penalty subtracts its value once per occurrence of the token in the output"),
             ("presence", [1.0] * 3, [0.5, 0.0, -0.3], off,
              "the presence penalty subtracts its value once for a token present in the output, whatever its "
              "count, and never for prompt-only tokens"),
             ("all three", [1.5, 0.7, 1.0], [0.5, 0.0, -0.3], [0.25, 1.0, 0.4],
              "repetition applies first, then frequency and presence subtract from its result")]
    for what, repetition, presence, frequency, rule in cases:
        got = sampler.apply_penalties(logits.clone(), prompt_mask, counts, torch.tensor(repetition),
                                      torch.tensor(presence), torch.tensor(frequency))
        expected = penalised(prompts, outputs, repetition, presence, frequency, logits)
        assert torch.isneginf(got[logits.isneginf()]).all(), \
            f"apply_penalties ({what}): a forbidden token (-inf) stays -inf, never NaN or finite"
        wrong = [(r, t) for r, t in (~torch.isclose(got.double(), expected, atol=1e-5)).nonzero().tolist()]
        assert not wrong, f"apply_penalties ({what}): {rule}; differs at (row, token) {wrong[:4]}"
    transformers = pytest.importorskip("transformers")
    hf = transformers.RepetitionPenaltyLogitsProcessor(1.5)(torch.tensor([prompts[0] + outputs[0]]), logits[:1].clone())
    only_repetition = sampler.apply_penalties(logits[:1].clone(), prompt_mask[:1], counts[:1], torch.tensor([1.5]),
                                              torch.zeros(1), torch.zeros(1))
    assert torch.allclose(only_repetition, hf, atol=1e-6), "repetition penalty differs from transformers'"


def test_filter_top_k_top_p_after_min_p_matches_transformers_warpers(impl, sampler):
    """The full sampler's chain in vLLM's order, min_p -> top_k -> top_p, through
    filter_top_k_top_p (candidates from one topk where top_k bounds a row, the whole row
    otherwise). Chapter 8's milestone checks each filter alone."""
    transformers = pytest.importorskip("transformers")
    gen = torch.Generator().manual_seed(1)
    settings = [(0, 1.0, 0.0), (5, 1.0, 0.0), (0, 0.8, 0.0), (7, 0.6, 0.0), (0, 1.0, 0.1), (10, 0.9, 0.05),
                (1, 0.5, 0.0), (64, 1e-9, 0.0), (3, 0.9, 0.0), (2, 1.0, 0.0)]
    logits = torch.randn(len(settings), 64, generator=gen) * 2
    logits[1, [3, 9, 20]] = logits[1].max() - 0.5          # ties at the 2nd-4th place, top_k 5
    logits[8, [1, 2, 30, 40, 50, 60]] = logits[8].max() + 1    # six tokens tied at the top, top_k 3: all stay
    logits[9, [4, 5, 6]] = logits[9].max() + 1               # a tie across the k-th place, top_k 2: all stay
    top_k = [k if k else 64 for k, _, _ in settings]
    min_p = torch.tensor([m for _, _, m in settings])
    got = sampler.filter_top_k_top_p(impl.sampling.apply_min_p(logits.clone(), min_p), top_k,
                                     [p for _, p, _ in settings])
    for row, (k, p, m) in enumerate(settings):
        want = logits[row:row + 1].clone()
        if m:
            want = transformers.MinPLogitsWarper(m)(None, want)
        if top_k[row] < 64:
            want = transformers.TopKLogitsWarper(k)(None, want)
        if p < 1:
            want = transformers.TopPLogitsWarper(p)(None, want)
        kept, expected = torch.isfinite(got[row]), torch.isfinite(want[0])
        assert torch.equal(kept, expected), (
            f"row {row} (top_k={k}, top_p={p}, min_p={m}): min_p, then top_k, then top_p on what min_p and top_k "
            f"left, renormalised; kept {kept.nonzero().flatten().tolist()}, transformers keeps "
            f"{expected.nonzero().flatten().tolist()}")
        assert torch.equal(got[row][kept], logits[row][kept]), "surviving logits must be unchanged"


def test_typical_p_matches_transformers_warper(serve, sampler):
    """typical_p keeps what transformers' TypicalLogitsWarper keeps, row by row (rows with
    typical_p = 1 untouched), and the full sampler draws only from what it keeps."""
    transformers = pytest.importorskip("transformers")
    masses = [0.2, 0.5, 0.9, 0.99, 1e-6, 0.7, 1.0]
    logits = torch.randn(len(masses), 64, generator=torch.Generator().manual_seed(4)) * 2
    logits[2, :10] = float("-inf")                          # forbidden tokens carry no entropy
    logits[5, [3, 8]] = logits[5, 1].item()                 # tokens as typical as one kept stay with it
    got = sampler.apply_typical_p(logits.clone(), torch.tensor(masses))
    for row, mass in enumerate(masses):
        want = logits[row:row + 1] if mass == 1 else transformers.TypicalLogitsWarper(mass)(None, logits[row:row + 1])
        kept, expected = torch.isfinite(got[row]), torch.isfinite(want[0])
        assert torch.equal(kept, expected), f"row {row} (typical_p={mass}): kept " \
            f"{kept.nonzero().flatten().tolist()}, transformers keeps {expected.nonzero().flatten().tolist()}"
        assert torch.equal(got[row][kept], logits[row][kept]), "surviving logits must be unchanged"
    temperature = 0.7
    requests = [make_request(serve, f"t{i}", [1], temperature=temperature, typical_p=0.5, seed=i) for i in range(40)]
    row = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(5)) * 3
    allowed = torch.isfinite(transformers.TypicalLogitsWarper(0.5)(None, row / temperature))[0]
    tokens, _ = sampler.Sampler()(row.repeat(len(requests), 1), requests,
                                  {r.request_id: torch.Generator().manual_seed(i) for i, r in enumerate(requests)})
    drawn = {t for [t] in tokens}
    assert all(allowed[t] for t in drawn), f"the full sampler drew {sorted(drawn)}, outside typical_p's " \
                                            f"{allowed.nonzero().flatten().tolist()}"
    assert len(drawn) > 1, "typical_p = 0.5 over a spread-out row keeps several tokens; the draws found one"


def test_token_logprobs_rank_ties_and_top_lists(sampler):
    """token_logprobs against float64 log_softmax: the value, the rank with ties, and each
    row's own number of top entries (0 included), from bfloat16 logits."""
    logits = torch.randn(4, 48, generator=torch.Generator().manual_seed(6)) * 2
    logits[1, [5, 9, 17]] = logits[1].max() + 1             # three tokens tied at the top: all rank 1
    logits[2, [4, 8]] = logits[2, 30].item()                # the asked-about token 30 ties two others
    logits = logits.bfloat16()
    token_ids, num_top = torch.tensor([3, 9, 30, 0]), [2, 0, 5, 1]
    entries = sampler.token_logprobs(logits, token_ids, num_top)
    exact = torch.log_softmax(logits.double(), dim=-1)
    assert len(entries) == 4, f"one entry per row: got {len(entries)} for 4 rows"
    for row, (entry, token, k) in enumerate(zip(entries, token_ids.tolist(), num_top)):
        want = exact[row]
        assert entry.token_id == token, f"row {row}: the entry is about token {entry.token_id}, not {token}"
        assert math.isclose(entry.logprob, float(want[token]), abs_tol=1e-5), \
            f"row {row}: logprob {entry.logprob}, but log_softmax of the row, computed in float32, " \
            f"gives {float(want[token])}"
        rank = int((want > want[token]).sum()) + 1
        assert entry.rank == rank, f"row {row}: rank {entry.rank}, not {rank}; the rank is 1 + the number of " \
                                   "tokens with a strictly greater logprob (ties share a rank)"
        assert len(entry.top_token_ids) == len(entry.top_logprobs) == k, \
            f"row {row}: {len(entry.top_token_ids)} top ids and {len(entry.top_logprobs)} top logprobs; " \
            f"each row lists exactly its own num_top = {k}"
        values = [float(want[t]) for t in entry.top_token_ids]
        assert values == sorted(values, reverse=True) and (not k or values[-1] >= float(want.topk(k).values[-1])), \
            f"row {row}: top list {entry.top_token_ids} is not the row's {k} most likely, most likely first"


def test_token_rules_match_transformers_processors(serve, sampler):
    transformers = pytest.importorskip("transformers")
    bad_words = ((7,), (3, 4, 9), (8, 12))
    requests = [
        make_request(serve, "bad", [1, 2, 3], [5, 3, 4], bad_words_token_ids=bad_words),
        make_request(serve, "bad-no-tail", [3, 4], [1], bad_words_token_ids=bad_words),
        make_request(serve, "min", [1, 2], [5], min_tokens=3, stop_token_ids=(11, 13)),
        make_request(serve, "min-done", [1, 2], [5, 6, 7], min_tokens=3, stop_token_ids=(11, 13)),
        make_request(serve, "min-ignore-eos", [1, 2], [], min_tokens=2, ignore_eos=True, stop_token_ids=(11,)),
        make_request(serve, "allowed", [1], [], allowed_token_ids=(2, 40, 41)),
        make_request(serve, "bias", [1], [], logit_bias={6: 2.5, 300: -1.25}),
    ]
    logits = torch.randn(len(requests), VOCAB, generator=torch.Generator().manual_seed(2))
    got = sampler.apply_token_rules(logits.clone(), requests)
    no_bad = transformers.NoBadWordsLogitsProcessor([list(w) for w in bad_words], eos_token_id=TINY_EOS)
    for row in (0, 1):           # vLLM matches a bad word's head against the OUTPUT's tail
        want = no_bad(torch.tensor([requests[row].output_token_ids]), logits[row:row + 1].clone())
        assert torch.equal(got[row], want[0]), f"bad words of request {requests[row].request_id!r}"
    for row, stops in ((2, [11, 13, TINY_EOS]), (4, [11])):
        request = requests[row]
        min_new = transformers.MinNewTokensLengthLogitsProcessor(request.num_prompt_tokens, request.params.min_tokens,
                                                                 stops)
        want = min_new(torch.tensor([request.token_ids]), logits[row:row + 1].clone())
        assert torch.equal(got[row], want[0]), f"min_tokens of request {request.request_id!r}: EOS (unless " \
                                               f"ignore_eos) and stop tokens are forbidden until min_tokens outputs"
    assert torch.equal(got[3], logits[3]), "min_tokens reached: nothing is forbidden any more"
    finite = torch.isfinite(got[5]).nonzero().flatten().tolist()
    assert finite == [2, 40, 41] and torch.equal(got[5, finite], logits[5, finite]), "allowed_token_ids"
    want = logits[6].clone()
    want[6] += 2.5
    want[300] -= 1.25
    assert torch.allclose(got[6], want), "logit_bias adds its value to the token's logit"


class FakeGuide:
    """A stand-in for Chapter 35's guide: allows a fixed set of tokens."""
    finished = False

    def __init__(self, allowed):
        self.mask = torch.zeros(VOCAB, dtype=torch.bool)
        self.mask[list(allowed)] = True
        self.calls = 0

    def allowed(self):
        self.calls += 1
        return self.mask.clone()

    def advance(self, token_id):
        pass


def test_guide_mask_comes_before_every_other_rule(serve, sampler):
    guided = make_request(serve, "g", [1, 2], logit_bias={100: 50.0}, temperature=1.0, seed=4)
    guided.guide = FakeGuide({3, 17})
    free = make_request(serve, "free", [1, 2], logit_bias={100: 50.0})
    generators = {"g": torch.Generator().manual_seed(4)}
    logits = torch.zeros(2, VOCAB)
    tokens, _ = sampler.Sampler()(logits, [guided, free], generators)
    assert tokens[0][0] in {3, 17}, f"a guided request drew {tokens[0][0]}, which its guide forbids"
    assert tokens[1] == [100], "the unguided neighbour's logit_bias must still apply"
    forbidding_all = make_request(serve, "dead", [1], allowed_token_ids=(5,))
    forbidding_all.guide = FakeGuide({3})
    with pytest.raises(ValueError, match="dead"):
        sampler.Sampler()(torch.zeros(1, VOCAB), [forbidding_all], {})


# --- draws --------------------------------------------------------------------------------------------

def chi_square_p_value(counts, probs):
    """P(X >= statistic) for X ~ chi-square with (cells - 1) degrees of freedom."""
    expected = probs * counts.sum()
    statistic = ((counts - expected) ** 2 / expected).sum()
    dof = torch.tensor((len(probs) - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(dof, statistic / 2))


def filtered_distribution(logits, temperature, top_k, top_p, min_p):
    """float64: the distribution vLLM's rules leave (temperature, min_p, top_k, top_p)."""
    probs = torch.softmax(logits.double() / temperature, -1)
    keep = probs >= min_p * probs.max()
    order = torch.argsort(probs, descending=True)
    kth = probs[order[top_k - 1]]
    keep &= probs >= kth
    probs = torch.where(keep, probs, 0.0)
    probs /= probs.sum()
    mass = 0.0
    for token in torch.argsort(probs, descending=True).tolist():
        if mass >= top_p:
            probs[token] = 0.0
        mass += float(probs[token]) if probs[token] > 0 else 0.0
    return probs / probs.sum()


def test_draws_follow_the_filtered_distribution(serve, sampler):
    """4,000 draws in one batched call against the float64 distribution, significance 0.001.
    Seed 0 gives p = 0.83. Checked by hand over seeds 0..199: no p-value fell below 0.001
    (the smallest was 0.0075) and 10 fell below 0.05, as p-values of a correct sampler
    should (uniform)."""
    logits = torch.tensor([2.0, 1.5, 1.2, 1.0, 0.3, 0.0, -0.5, -3.0, 0.9, 1.1])
    draws = 4000
    params = dict(temperature=0.8, top_k=7, top_p=0.95, min_p=0.05)
    requests = [make_request(serve, f"r{i}", [1], **params) for i in range(draws)]
    chosen, _ = sampler.Sampler(torch.Generator().manual_seed(0))(logits.repeat(draws, 1), requests, {})
    counts = torch.bincount(torch.tensor([c[0] for c in chosen]), minlength=10).double()
    probs = filtered_distribution(logits, **{k: v for k, v in params.items()})
    assert counts[probs == 0].sum() == 0, f"tokens the filters remove were drawn: {counts.tolist()}"
    p_value = chi_square_p_value(counts[probs > 0], probs[probs > 0])
    assert p_value > 1e-3, f"draws {counts.tolist()} do not follow {probs.tolist()} (chi-square p = {p_value:.2g})"


def test_a_seeded_request_ignores_its_neighbours(serve, sampler):
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(3))
    mine = make_request(serve, "mine", [1], temperature=1.0, seed=11)

    def draw(rows, requests):
        generators = {r.request_id: torch.Generator().manual_seed(r.params.seed) for r in requests
                      if r.params.seed is not None}
        return sampler.Sampler(torch.Generator().manual_seed(99))(rows, requests, generators)[0]

    alone = draw(logits[:1], [mine])
    crowd = [make_request(serve, "a", [1], temperature=0.5), make_request(serve, "b", [1], temperature=1.0, seed=1),
             make_request(serve, "c", [1])]
    together = draw(torch.cat([logits[1:], logits[:1]]), crowd + [mine])
    assert together[-1] == alone[0], "a seeded request drew differently because of its batch neighbours"


# --- the engine ---------------------------------------------------------------------------------------

def full_engine(serve, model, **config):
    return make_engine(serve, model, **{"num_blocks": 64, "block_size": 4, "sampler": "full", **config})


def params(serve, max_tokens, **fields):
    return serve.request.SamplingParams(max_tokens=max_tokens, **fields)


def test_engine_accepts_every_parameter_with_the_full_sampler(serve, tiny_model):
    engine = full_engine(serve, tiny_model)
    fancy = params(serve, 8, temperature=0.9, top_k=40, top_p=0.9, min_p=0.02, repetition_penalty=1.2,
                   presence_penalty=0.3, frequency_penalty=0.2, logit_bias={9: 1.0}, bad_words_token_ids=((5,), (6, 7)),
                   min_tokens=4, seed=5, logprobs=3, prompt_logprobs=2, n=2)
    outs = engine.generate([[1, 2, 3, 4, 5, 6], [9, 8, 7]], [fancy, params(serve, 5)])
    for sample in outs[0]:
        assert len(sample.output_token_ids) >= 4, "min_tokens: the request stopped too early"
        assert 5 not in sample.output_token_ids, "bad word (5,) was drawn"
        assert len(sample.logprobs) == len(sample.output_token_ids), "one logprobs entry per output token"
        assert len(sample.prompt_logprobs) == 6 and sample.prompt_logprobs[0] is None
    assert outs[0][0].output_token_ids != outs[0][1].output_token_ids, \
        "the two samples of an n=2 request (seeds 5 and 6) drew the same tokens"
    assert_engine_idle(engine)
    simple = make_engine(serve, tiny_model, num_blocks=64, block_size=4)
    with pytest.raises(ValueError, match="sampler='full'"):
        simple.add_request("lp", [1, 2], params(serve, 2, logprobs=1))
    with pytest.raises(ValueError, match="logit_bias names token 999"):
        engine.add_request("far", [1, 2], params(serve, 2, logit_bias={999: 1.0}))
    assert_engine_idle(engine)


def test_greedy_full_sampler_equals_simple_sampler(serve, tiny_model):
    prompts = [[1, 2, 3, 4, 5], list(range(20, 41)), [7, 8]]
    full = full_engine(serve, tiny_model).generate(prompts, params(serve, 10))
    simple = make_engine(serve, tiny_model, num_blocks=64, block_size=4).generate(prompts, params(serve, 10))
    assert [o.output_token_ids for o in full] == [o.output_token_ids for o in simple], \
        "greedy requests must give the same tokens with either sampler"


def test_logprobs_are_the_raw_model_distribution(serve, tiny_model, ref_model):
    prompt = [3, 14, 15, 92, 65, 35]
    engine = full_engine(serve, tiny_model, max_num_batched_tokens=4)      # the prompt runs in two chunks
    out = engine.generate([prompt], params(serve, 4, logprobs=5, prompt_logprobs=3, repetition_penalty=1.5,
                                           temperature=0.7, seed=1))[0]
    sequence = prompt + out.output_token_ids
    with torch.no_grad():
        logits = ref_model(torch.tensor([sequence], device=next(ref_model.parameters()).device))[0].double().cpu()
    expected = torch.log_softmax(logits, -1)
    checks = [(f"prompt token {p}", out.prompt_logprobs[p], p - 1, 3) for p in range(1, len(prompt))]
    checks += [(f"output token {i}", out.logprobs[i], len(prompt) - 1 + i, 5) for i in range(len(out.logprobs))]
    for where, entry, row, k in checks:
        token = sequence[row + 1]
        want = expected[row]
        assert entry.token_id == token, f"{where}: logprobs are about token {entry.token_id}, not {token}"
        assert math.isclose(entry.logprob, float(want[token]), abs_tol=1e-4), \
            f"{where}: logprob {entry.logprob} but the raw model says {float(want[token])} (penalties must not show)"
        assert entry.rank == int((want > want[token] + 1e-6).sum()) + 1, f"{where}: rank {entry.rank}"
        top = torch.topk(want, k)
        assert entry.top_token_ids == top.indices.tolist(), f"{where}: top-{k} tokens"
        assert torch.allclose(torch.tensor(entry.top_logprobs, dtype=torch.float64), top.values, atol=1e-4)


def test_seeded_output_survives_chunking_preemption_and_neighbours(serve, tiny_model):
    prompt = list(range(30, 52))
    wanted = params(serve, 12, temperature=1.0, top_p=0.95, seed=2024, repetition_penalty=1.1, prompt_logprobs=2)
    alone_output = full_engine(serve, tiny_model).generate([prompt], wanted)[0]
    alone = alone_output.output_token_ids
    crowd = [list(range(60, 90)), [5, 6, 7], list(range(100, 124))]
    others = [params(serve, 14, temperature=1.0), params(serve, 9, temperature=0.7, seed=3), params(serve, 12)]
    for config in (dict(max_num_batched_tokens=8), dict(num_blocks=14, max_num_batched_tokens=16),
                   dict(num_blocks=14, preemption_mode="swap")):
        engine = full_engine(serve, tiny_model, **config)
        outs = engine.generate(crowd + [prompt], others + [wanted])
        assert outs[-1].output_token_ids == alone, f"with {config} (preemptions: {engine.preemptions}) the seeded " \
                                                  f"request drew {outs[-1].output_token_ids}, alone {alone}"
        got = outs[-1].prompt_logprobs
        assert len(got) == len(prompt) and got[0] is None, \
            f"with {config}: {len(got)} prompt logprobs for {len(prompt)} prompt tokens (a recomputed prompt " \
            f"counts once)"
        for position, (mine, lone) in enumerate(zip(got[1:], alone_output.prompt_logprobs[1:]), start=1):
            assert (mine.token_id, mine.top_token_ids) == (lone.token_id, lone.top_token_ids) and \
                math.isclose(mine.logprob, lone.logprob, abs_tol=1e-4), f"with {config}: prompt position {position}"
        assert_engine_idle(engine)


def test_async_scheduling_with_the_full_sampler_equals_the_synchronous_engine(serve, impl, tiny_model):
    """Chapter 33's asynchronous engine runs the full sampler once the step before is
    applied, on requests that hold what the synchronous engine shows: penalties, bad
    words, min_tokens, seeds, logprobs and prompt logprobs must come out exactly as the
    synchronous engine's."""
    prompts = [list(range(30, 52)), [5, 6, 7], list(range(60, 80)), [9, 8, 7, 6]]
    every = [params(serve, 12, temperature=1.0, top_p=0.95, seed=7, repetition_penalty=1.3, prompt_logprobs=2,
                    logprobs=2),
             params(serve, 9, frequency_penalty=0.8, presence_penalty=0.5, bad_words_token_ids=((5,), (6, 7)),
                    min_tokens=6, logprobs=1),
             params(serve, 10, temperature=0.8, top_k=30, seed=3, logit_bias={11: 2.0}),
             params(serve, 8, repetition_penalty=2.0, stop_token_ids=[40, 41])]

    def serve_with(**config):
        queue = {"device_queue": "thread"} if config else {}
        engine = full_engine(serve, tiny_model, num_blocks=14, max_num_batched_tokens=16, **config, **queue)
        outs = engine.generate(prompts, every)
        if config:
            engine.async_steps.queue.close()
        assert_engine_idle(engine)
        return engine, outs

    sync_engine, want = serve_with()
    async_engine, got = serve_with(async_scheduling=True)
    assert sync_engine.preemptions > 0 and async_engine.preemptions > 0, "nothing was preempted: grow the prompts"
    for i, (mine, theirs) in enumerate(zip(got, want)):
        assert mine.output_token_ids == theirs.output_token_ids, \
            f"request {i}: async {mine.output_token_ids} != synchronous {theirs.output_token_ids}"
        for what in ("logprobs", "prompt_logprobs"):
            a, b = getattr(mine, what) or [], getattr(theirs, what) or []
            assert [e and (e.token_id, e.rank, e.top_token_ids) for e in a] == \
                   [e and (e.token_id, e.rank, e.top_token_ids) for e in b], f"request {i}: {what} differ"
            assert all(x is None or math.isclose(x.logprob, y.logprob, abs_tol=1e-5) for x, y in zip(a, b))


def test_extreme_parameters_stay_numbers_or_are_refused(serve, sampler):
    """A repetition penalty far below 1 overflows a positive logit to +inf in float32; the
    draw must still pick a real token. Out-of-range penalties and biases are refused."""
    logits = torch.full((1, VOCAB), -1.0)
    logits[0, 7] = 30.0
    tiny = make_request(serve, "tiny-penalty", [7], temperature=0.5, repetition_penalty=1e-38, seed=1)
    tokens, _ = sampler.Sampler()(logits, [tiny], {"tiny-penalty": torch.Generator().manual_seed(1)})
    assert tokens == [[7]], f"an overflowing logit must stay the favourite, got {tokens}"
    refused = ((dict(presence_penalty=2.5), "presence_penalty"), (dict(frequency_penalty=-3), "frequency"),
               (dict(logit_bias={3: 1e9}), r"logit_bias must map .* \[-100, 100\]"),
               (dict(bad_words_token_ids=((),)), "bad_words"))
    for fields, words in refused:
        with pytest.raises(ValueError, match=words):
            serve.request.SamplingParams(**fields)
