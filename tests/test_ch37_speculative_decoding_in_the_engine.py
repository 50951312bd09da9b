"""Chapter 37 milestone: speculation inside the engine core changes how many tokens a step
yields, never which tokens a request gets (greedy) nor their distribution (sampled).

Oracles:
- greedy: the REFERENCE package's solo `generate` (course.testing.oracles.solo), token for token,
  for every proposer, in both preemption modes, with prefix caching on and a step budget
  small enough to cut drafts; the tiny model's greedy margins (> 1e-3) are far above the
  ~1e-6 by which a verification row differs from a one-token decode, so this is exact;
- sampled: the exact distribution of whole outputs, computed in float64 from the
  reference model's logits with the warping rules written out here; the engine's
  frequencies must pass a chi-square test at significance 0.001 (fixed seeds: the test is
  deterministic; over engine seeds 0..99 it failed for 0 of them, see test docstring);
- hand-worked cases for the n-gram lookup and float64 formulas for the warped rows;
- the engine's own invariants (course.testing.engine_checks) after every step and idle at the end,
  the draft model's pool included;
- Chapter 31's random workloads (tests/test_engine_random_workloads.py) with a drafter
  installed: six by default, 300 behind --stress (all 600 seed-proposer pairs passed once
  by hand).
"""
import math
import random
from collections import Counter

import pytest
import torch
from hypothesis.stateful import run_state_machine_as_test
from test_engine_random_workloads import FAST_SEEDS, run_workload

from course.models import tiny_qwen3
from course.testing.oracles import TINY_EOS, assert_engine_idle, make_engine, reference_tiny_qwen3, solo

pytestmark = pytest.mark.chapter(37)


@pytest.fixture(scope="module")
def spec(impl):
    return impl.load("serve.spec_decode")


@pytest.fixture(scope="module")
def heads(impl, spec):
    """Heads trained for a moment on the tiny model (enough to guess; parity holds anyway)."""
    model = tiny_qwen3(impl.package)
    rng = random.Random(7)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(3, 12))] for _ in range(6)]
    return spec.train_heads(model, prompts, 3, new_tokens=12, steps=8, eos_token_id=TINY_EOS)


def prompts_for(seed, count=6):
    rng = random.Random(seed)
    shared = [rng.randrange(256) for _ in range(9)]
    out = []
    for i in range(count):
        own = [rng.randrange(256) for _ in range(rng.randint(1, 14))]
        # Repeats inside a prompt give the n-gram lookup something to find.
        out.append(shared + own + own[:3] if i % 2 else own + own)
    return out


def proposer(kind, spec, impl, target, heads):
    if kind == "ngram":
        return spec.NgramProposer()
    if kind == "draft model":       # its pool: the engine's size (DraftModelProposer.bind)
        return spec.DraftModelProposer(impl.load("speculative").truncated_draft(target, 1))
    return spec.HeadProposer(heads)


class PerfectProposer:
    """Guesses the reference's own greedy continuation: every draft is accepted."""
    name = "perfect"

    def __init__(self, ref_model, prompts, max_new):
        self.answers = {tuple(p): solo(ref_model, p, max_new) for p in prompts}

    def propose(self, engine, requests, limits, hidden):
        from types import SimpleNamespace
        drafts = []
        for request, limit in zip(requests, limits):
            answer = self.answers.get(tuple(request.prompt_token_ids), [])
            done = request.num_output_tokens
            drafts.append(SimpleNamespace(tokens=answer[done:done + limit], probs=None))
        return drafts

    def release(self, request_id):
        pass

    def bind(self, engine):
        pass


class WrongProposer(PerfectProposer):
    """Guesses one right token, then tokens the target never picks: rejected drafts land
    in blocks that are later published, so their K/V must have been trimmed and rewritten."""
    name = "wrong"

    def propose(self, engine, requests, limits, hidden):
        drafts = super().propose(engine, requests, limits, hidden)
        for draft in drafts:
            draft.tokens = draft.tokens[:1] + [300 + i for i in range(len(draft.tokens) - 1)]
        return drafts


def run_steps(engine, where):
    outputs = {}
    while engine.has_unfinished:
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        assert engine.steps < 2000, f"{where}: still busy after 2000 steps"
    return outputs


# --- the rules ------------------------------------------------------------------------------------

def test_ngram_lookup_finds_the_latest_repeat_of_the_tail(spec):
    look = spec.propose_ngram
    assert look([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], 2) == [7, 1], (
        "the LATEST earlier occurrence of [1, 2, 3] is followed by 7, 1")
    assert look([5, 6, 7, 5, 6], 4) == [7, 5, 6], "the continuation stops at the end of the sequence"
    assert look([4, 4, 4], 3, max_n=2) == [4], "a run continues itself: tail [4, 4] occurs at 0, followed by 4"
    assert look([1, 2, 9, 3, 2, 7, 1, 2], 2) == [9, 3], (
        "the longest recurring tail decides: [1, 2] (at 0, followed by 9, 3) beats [2] (at 4, followed by 7, 1)")
    assert look([1, 2, 3, 4], 3) == [], "no tail recurs: no guess"
    assert look([1, 2, 1, 2], 0) == [], "k = 0 asks for nothing"
    assert look([8, 1, 9, 3, 1], 2, max_n=3, min_n=1) == [9, 3], (
        "no 3- or 2-token repeat, so the 1-token tail [1] decides")
    assert look([8, 1, 9, 3, 1], 2, max_n=3, min_n=2) == [], "min_n=2 refuses the 1-token match"


def oracle_probs(logits, temperature, top_k, top_p, min_p):
    """float64, written out: temperature, then top-k, then top-p (most likely kept), then min-p."""
    z = logits.double() / temperature
    if top_k:
        z[z < torch.sort(z, descending=True).values[top_k - 1]] = -math.inf
    p = torch.exp(z - z.max())
    p /= p.sum()
    if top_p < 1:
        order = sorted(range(len(p)), key=lambda i: -float(p[i]))
        mass, keep = 0.0, set()
        for i in order:
            if mass >= top_p:
                break
            keep.add(i)
            mass += float(p[i])
        p = torch.tensor([float(p[i]) if i in keep else 0.0 for i in range(len(p))], dtype=torch.float64)
    if min_p:
        p[p < p.max() * min_p] = 0
    return p / p.sum()


@pytest.mark.parametrize("temperature,top_k,top_p,min_p", [(1.0, 0, 1.0, 0.0), (0.7, 5, 1.0, 0.0),
                                                           (1.3, 0, 0.8, 0.0), (0.9, 12, 0.6, 0.1)])
def test_warped_rows_are_the_distribution_chapter_8_draws_from(spec, serve, temperature, top_k, top_p, min_p):
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(5)) * 2
    params = serve.request.SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    got = spec.warped_probs(logits, params)
    assert got.dtype == torch.float64, f"warped rows must be float64, got {got.dtype}"
    for row in range(3):
        want = oracle_probs(logits[row], temperature, top_k, top_p, min_p)
        assert torch.allclose(got[row], want, atol=1e-12), (
            f"row {row} with {params} must be the distribution Chapter 8's sample draws from (divide by the "
            f"temperature, then top-k, top-p, min-p, renormalise): expected {want.tolist()}, got {got[row].tolist()}")


# --- greedy: exactly the non-speculative engine ---------------------------------------------------

@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("kind", ["ngram", "draft model", "heads"])
def test_greedy_output_is_solo_generate_for_every_drafter(serve, spec, impl, tiny_model, ref_model, heads, kind, mode):
    prompts = prompts_for(3)
    drafter = spec.Speculator(proposer(kind, spec, impl, tiny_model, heads), k=3)
    engine = make_engine(serve, tiny_model, num_blocks=22, block_size=4, preemption_mode=mode,
                         max_num_batched_tokens=24, debug_checks=True, drafter=drafter)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, serve.request.SamplingParams(max_tokens=18 + i))
    got = run_steps(engine, f"[{kind}, {mode}]")
    for i, p in enumerate(prompts):
        want = solo(ref_model, p, 18 + i)
        assert got[f"r{i}"] == want, (f"[{kind}, {mode}] request r{i}: the speculative engine must emit the "
                                      f"target's own greedy tokens\n  expected {want}\n  got      {got[f'r{i}']}")
    where = f"[{kind}, {mode}] after the run"
    assert engine.preemptions > 0, f"{where}: the small pool was meant to preempt"
    assert drafter.stats.proposed > 0, f"{where}: no draft was ever verified"
    assert_engine_idle(engine, where)
    if kind == "draft model":
        pool = drafter.proposer.blocks
        assert pool.num_free == pool.num_blocks and not drafter.proposer.shadows, (
            f"{where}: the draft model's pool still holds {pool.num_blocks - pool.num_free} blocks "
            f"for {sorted(drafter.proposer.shadows)}")


def test_stop_rules_apply_to_accepted_tokens_in_order(serve, spec, tiny_model, ref_model):
    """A perfect drafter lets a step accept several tokens; a stop token among them ends the
    request there and the tokens after it are dropped; max_tokens cuts the same way."""
    prompts = prompts_for(11, 4)
    plain = [solo(ref_model, p, 20) for p in prompts]
    stops = [(plain[0][5],), (), (plain[2][2],), ()]
    drafter = spec.Speculator(PerfectProposer(ref_model, prompts, 20), k=6)
    engine = make_engine(serve, tiny_model, num_blocks=64, block_size=4, debug_checks=True, drafter=drafter)
    for i, (p, stop) in enumerate(zip(prompts, stops)):
        engine.add_request(f"s{i}", p, serve.request.SamplingParams(max_tokens=20 if i != 3 else 9,
                                                                    stop_token_ids=stop))
    got = run_steps(engine, "[perfect drafter]")
    for i, (p, stop) in enumerate(zip(prompts, stops)):
        want = solo(ref_model, p, 20 if i != 3 else 9, stop_token_ids=stop)
        assert got[f"s{i}"] == want, (f"request s{i} (stop tokens {stop}): tokens after a stop or past max_tokens "
                                      f"must be dropped\n  expected {want}\n  got      {got[f's{i}']}")
    assert drafter.stats.accepted / drafter.stats.proposed == 1.0, "the perfect drafter's guesses were rejected"
    assert engine.steps < sum(len(solo(ref_model, p, 20)) for p in prompts), "accepted drafts saved no step"
    assert_engine_idle(engine, "[perfect drafter] after the run")


def test_a_budget_that_cuts_the_drafts_verifies_only_what_ran(serve, spec, tiny_model, ref_model):
    """With a 3-token step budget a request can feed its newest token and at most 2 of its 4
    drafts: only those are verified, the rest are dropped and proposed again."""
    prompts = prompts_for(13, 1)
    drafter = spec.Speculator(PerfectProposer(ref_model, prompts, 16), k=4)
    engine = make_engine(serve, tiny_model, num_blocks=32, block_size=4, max_num_batched_tokens=3,
                         debug_checks=True, drafter=drafter)
    engine.add_request("cut", prompts[0], serve.request.SamplingParams(max_tokens=16))
    got, most = [], 0
    while engine.has_unfinished:
        new = [t for o in engine.step() for t in o.new_token_ids]
        got += new
        most = max(most, len(new))
    assert got == solo(ref_model, prompts[0], 16), f"budget 3: expected {solo(ref_model, prompts[0], 16)}, got {got}"
    assert most <= 3, f"a step emitted {most} tokens: more drafts were accepted than the budget fed"
    assert drafter.stats.accepted == drafter.stats.proposed > 0, f"a perfect drafter's drafts: {drafter.stats}"
    assert engine.steps < 16, f"{engine.steps} steps for 16 tokens: the verified drafts saved none"
    assert_engine_idle(engine, "[budget 3] after the run")


def test_a_full_draft_pool_means_no_drafts_not_a_stall(serve, spec, impl, tiny_model, ref_model):
    """The draft model's own pool holds 2 blocks of 4 tokens: longer requests get no drafts
    from it, and decode as if no drafter were installed."""
    prompts = prompts_for(17, 3)
    draft = spec.DraftModelProposer(impl.load("speculative").truncated_draft(tiny_model, 1), 2, 4)
    engine = make_engine(serve, tiny_model, num_blocks=48, block_size=4, debug_checks=True,
                         drafter=spec.Speculator(draft, k=3))
    for i, p in enumerate(prompts):
        engine.add_request(f"f{i}", p, serve.request.SamplingParams(max_tokens=10))
    got = run_steps(engine, "[tiny draft pool]")
    for i, p in enumerate(prompts):
        assert got[f"f{i}"] == solo(ref_model, p, 10), f"request f{i} changed when its draft pool was full"
    assert draft.blocks.num_free == 2 and not draft.shadows, "the draft pool kept blocks after the run"
    assert_engine_idle(engine, "[tiny draft pool] after the run")


def test_rejected_drafts_are_trimmed_and_never_published(serve, spec, tiny_model, ref_model):
    """Rejected drafts write K/V into blocks. After every step: no request holds blocks past
    its computed tokens' needs plus what the next step asks, and every published key is the
    hash chain of ACCEPTED tokens. Then a request whose prompt is a finished request's
    whole sequence reuses those published blocks and must still decode exactly."""
    block_size = 4
    first = prompts_for(5, 1)[0]
    full = first + solo(ref_model, first, 23)
    drafter = spec.Speculator(WrongProposer(ref_model, [first, full], 23), k=3)
    engine = make_engine(serve, tiny_model, num_blocks=40, block_size=block_size, debug_checks=True, drafter=drafter)
    engine.add_request("a", first, serve.request.SamplingParams(max_tokens=23))
    hash_block = serve.blocks.hash_block
    while engine.has_unfinished:
        engine.step()
        for request in engine.scheduler.running:
            held = len(engine.blocks.req_blocks[request.request_id])
            assert held <= -(-request.num_computed_tokens // block_size), (
                f"step {engine.steps}: request {request.request_id!r} keeps {held} blocks for "
                f"{request.num_computed_tokens} computed tokens: rejected drafts' blocks were not trimmed")
        chain, accepted_keys = None, set()
        for start in range(0, len(full) - block_size + 1, block_size):
            chain = hash_block(chain, full[start:start + block_size])
            accepted_keys.add(chain)
        stray = [b for key, b in engine.blocks.cached.items() if key not in accepted_keys]
        assert not stray, f"step {engine.steps}: blocks {stray} are published under keys of rejected drafts"
    assert drafter.stats.accepted < drafter.stats.proposed, "the wrong drafter was meant to be rejected"
    reuse = full[:len(full) // block_size * block_size]
    engine.add_request("b", reuse, serve.request.SamplingParams(max_tokens=6))
    got = run_steps(engine, "[reuse]")["b"]
    assert engine.blocks.stats["hits"] > 0, "request b found no cached block"
    want = solo(ref_model, reuse, 6)
    assert got == want, (f"request b reuses blocks request a published after rejected drafts: expected {want}, "
                         f"got {got} (a published block held a rejected draft's K/V)")
    assert_engine_idle(engine, "[wrong drafter] after the run")


# --- sampled: exactly the non-speculative distribution --------------------------------------------

TINY_VOCAB, OUT_TOKENS, SAMPLES, ALPHA = 3, 4, 1000, 1e-3
SAMPLING = dict(temperature=5.0, top_k=0, top_p=0.97, min_p=0.0)


def exact_distribution(ref, prompt):
    """P(output) for every sequence of OUT_TOKENS tokens, from the reference model's logits."""
    probs = {(): 1.0}
    for _ in range(OUT_TOKENS):
        grown = {}
        for seq, mass in probs.items():
            with torch.inference_mode():
                logits = ref(torch.tensor([prompt + list(seq)]))[0, -1]
            row = oracle_probs(logits, SAMPLING["temperature"], SAMPLING["top_k"], SAMPLING["top_p"],
                               SAMPLING["min_p"])
            for token in range(TINY_VOCAB):
                if row[token] > 0:
                    grown[seq + (token,)] = mass * float(row[token])
        probs = grown
    return probs


def chi_square_p_value(counts, probs, total):
    """Pearson's test, cells with an expected count below 5 pooled; p from the chi-square
    survival function (regularised upper incomplete gamma)."""
    cells, pooled_obs, pooled_exp = [], 0, 0.0
    for seq, p in sorted(probs.items(), key=lambda kv: -kv[1]):
        if p * total >= 5:
            cells.append((counts.get(seq, 0), p * total))
        else:
            pooled_obs, pooled_exp = pooled_obs + counts.get(seq, 0), pooled_exp + p * total
    if pooled_exp > 0:
        cells.append((pooled_obs, pooled_exp))
    stat = sum((o - e) ** 2 / e for o, e in cells)
    dof = len(cells) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64))), stat, dof


def sampled_outputs(serve, spec, impl, model, kind, seed):
    if kind == "draft model":
        draft = spec.DraftModelProposer(impl.load("speculative").truncated_draft(model, 1))
    else:
        draft = spec.NgramProposer(max_n=2)
    drafter = spec.Speculator(draft, k=3)
    engine = make_engine(serve, model, eos_token_id=None, num_blocks=2048, block_size=4, max_num_seqs=512,
                         max_num_batched_tokens=4096, seed=seed, drafter=drafter)
    params = serve.request.SamplingParams(max_tokens=OUT_TOKENS, n=SAMPLES, seed=seed * SAMPLES, **SAMPLING)
    finals = engine.generate([[0, 1, 2, 0, 1, 2, 0]], params)[0]
    assert_engine_idle(engine, f"[sampled, {kind}]")
    return Counter(tuple(f.output_token_ids) for f in finals), drafter.stats


@pytest.mark.parametrize("kind", ["ngram", "draft model"])
def test_sampled_outputs_follow_the_target_distribution(serve, spec, impl, kind):
    """1,000 seeded samples of 4 tokens from a 3-token vocabulary (81 outcomes) against the
    exact distribution: chi-square at significance 0.001. Engine seed 1 is fixed, so the
    test is deterministic; run by hand over engine seeds 0..99 it passed for every seed of
    both proposers (p-values spread over (0, 1) as they should)."""
    model = tiny_qwen3(impl.package, vocab_size=TINY_VOCAB)
    ref = reference_tiny_qwen3(vocab_size=TINY_VOCAB)
    counts, stats = sampled_outputs(serve, spec, impl, model, kind, seed=1)
    assert sum(counts.values()) == SAMPLES
    assert stats.proposed > 300 and 0 < stats.accepted < stats.proposed, (
        f"[{kind}] the test needs drafts that are sometimes accepted and sometimes not: {stats}")
    p_value, stat, dof = chi_square_p_value(counts, exact_distribution(ref, [0, 1, 2, 0, 1, 2, 0]), SAMPLES)
    assert p_value > ALPHA, (f"[{kind}] speculative sampling changed the output distribution: chi-square "
                             f"{stat:.1f} on {dof} degrees of freedom, p = {p_value:.2g} < {ALPHA}")


def test_seeded_requests_reproduce(serve, spec, impl, tiny_model):
    def run():
        draft = spec.DraftModelProposer(impl.load("speculative").truncated_draft(tiny_model, 1))
        engine = make_engine(serve, tiny_model, num_blocks=64, block_size=4, drafter=spec.Speculator(draft, k=3))
        params = serve.request.SamplingParams(max_tokens=12, temperature=0.8, top_k=20, seed=42)
        return [o.output_token_ids for o in engine.generate(prompts_for(2, 3), params)]
    first = run()
    assert run() == first, "a seeded request drew different tokens on a second identical run"


# --- what speculation refuses ---------------------------------------------------------------------

@pytest.mark.parametrize("field,value", [("repetition_penalty", 1.2), ("logit_bias", {3: 1.0}),
                                         ("min_tokens", 2), ("logprobs", 2)])
def test_requests_the_verifier_cannot_honour_are_refused(serve, spec, tiny_model, field, value):
    engine = make_engine(serve, tiny_model, num_blocks=16, block_size=4,
                         drafter=spec.Speculator(spec.NgramProposer(), k=2))
    with pytest.raises(ValueError, match="speculative decoding"):
        engine.add_request("x", [1, 2, 3], serve.request.SamplingParams(**{field: value}))
    with pytest.raises(ValueError, match="Chapter 43"):
        engine.add_request("y", [1, 2, 3], lora="adapter")
    assert not engine.has_unfinished, "a refused request was queued"


def test_bad_drafters_are_refused(serve, spec, impl, tiny_model):
    """k below 1 is refused; so is a draft model whose vocabulary is not the target's, when
    the engine is built with it (its guesses would be other tokens)."""
    with pytest.raises(ValueError, match="k"):
        spec.Speculator(spec.NgramProposer(), k=0)
    stranger = spec.DraftModelProposer(tiny_qwen3(impl.package, vocab_size=300))
    with pytest.raises(ValueError, match="vocabulary"):
        make_engine(serve, tiny_model, num_blocks=16, block_size=4, drafter=spec.Speculator(stranger, k=2))


# --- the engine's random workloads, speculating ---------------------------------------------------

STRESS_WORKLOADS = 300


def pytest_generate_tests(metafunc):
    if "workload_seed" in metafunc.fixturenames:
        stress = metafunc.config.getoption("stress")
        metafunc.parametrize("workload_seed", list(range(STRESS_WORKLOADS)) if stress else FAST_SEEDS[:6])


def test_random_workloads_match_solo_generate_while_speculating(serve, spec, impl, tiny_model, ref_model,
                                                                workload_seed):
    """Chapter 31's random workloads (preemption in both modes, aborts, stop tokens, n > 1,
    priorities, chunking, small budgets) with a drafter installed (n-gram or draft model,
    k = 1..4 by seed): same tokens as solo generate, idle-clean. `--stress` runs seeds
    0..299; run by hand with BOTH proposers on each of those seeds, all 600 passed."""
    kind = ["ngram", "draft model"][workload_seed % 2]

    drafter = spec.Speculator(proposer(kind, spec, impl, tiny_model, None), k=1 + workload_seed % 4)
    run_workload(serve, tiny_model, ref_model, workload_seed, drafter)


# --- the engine's state machine, speculating ---------------------------------------------------------

def test_engine_state_machine_while_speculating(serve, spec, tiny_model, request):
    """Chapter 31's engine state machine (scripted model, arrivals, aborts, preemption in both
    modes, chunking, prefix caching, every scheduler invariant checked each step, the fake
    pool checking what each request attends to and what each published block holds) with an
    n-gram drafter installed: every accepted token is the scripted model's next token, and
    the rejected drafts' K/V is never read or published."""
    import test_engine_state_machines as machines

    class DraftingMachine(machines.EngineMachine):
        def build_engine(self, config, **parts):
            return super().build_engine(config, drafter=spec.Speculator(spec.NgramProposer(), k=3), **parts)

        def check_output(self, request, out):
            tokens = list(request.token_ids)
            first = len(tokens) - len(out.new_token_ids)
            for i, token in enumerate(out.new_token_ids):
                assert token == machines.next_token(tokens[:first + i]), (
                    f"{self.where()}: {out.request_id}'s token {first + i} is {token}, the scripted model says "
                    f"{machines.next_token(tokens[:first + i])}")
            if out.finished:
                params = request.params
                assert out.output_token_ids[-1] in params.stop_token_ids or \
                    len(out.output_token_ids) == params.max_tokens, (
                        f"{self.where()}: {out.request_id} finished after {len(out.output_token_ids)} of "
                        f"{params.max_tokens} tokens without a stop token")

    DraftingMachine.serve, DraftingMachine.model = serve, tiny_model
    run_state_machine_as_test(DraftingMachine, settings=machines.machine_settings(
        request, 40, 40, stress_examples=1000, stress_steps=80))


def test_asynchronous_scheduling_with_a_drafter_is_refused_at_construction(serve, spec, tiny_model):
    """Chapter 33's asynchronous engine plans step t + 1 before it reads step t's tokens, so
    it cannot guess drafts from them, and a rejected draft would roll back rows the step in
    flight was planned on. The pair is refused when the engine is built,
    with a message that says so."""
    config = serve.config.EngineConfig(num_blocks=32, block_size=4, async_scheduling=True)
    words = r"speculative decoding needs synchronous scheduling .* has not read"
    with pytest.raises(ValueError, match=words):
        serve.engine.EngineCore(tiny_model, config, drafter=spec.Speculator(spec.NgramProposer(), k=3))
