"""Chapter 13 milestone: the parity harness, and parity with transformers.

Oracles: transformers' Qwen3ForCausalLM with the same weights (its forward for logits, its
generate(do_sample=False) for greedy tokens), and plain list comparisons written in the
test. A planted divergence (one embedding row changed in a copy of the model) must be found
at the step and position where it first can act: a token's embedding is read only once the
token is an input, so everything before is bit-for-bit equal.

Tolerance (float32 logits): 1e-5 * max(1, max |logit|), as in Chapter 10.
"""
import copy
import dataclasses

import pytest
import torch

pytestmark = pytest.mark.chapter(13)

transformers = pytest.importorskip("transformers")

NEW_TOKENS = 12
REL_TOL = 1e-5


def hf_twin(model, device):
    """transformers' Qwen3ForCausalLM with `model`'s config and weights (and dtype); EOS
    never stops it."""
    hcfg = transformers.Qwen3Config(**dataclasses.asdict(model.cfg), attn_implementation="eager")
    twin = transformers.Qwen3ForCausalLM(hcfg).to(next(model.parameters()).dtype)
    twin.load_state_dict(model.state_dict(), strict=True)
    twin.generation_config.eos_token_id = None
    twin.generation_config.pad_token_id = 0
    return twin.to(device).eval()


def hf_greedy(twin, prompt, max_new_tokens):
    ids = torch.tensor([prompt], device=twin.device)
    with torch.no_grad():
        out = twin.generate(ids, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                            do_sample=False, attention_mask=torch.ones_like(ids))
    return out[0, len(prompt):].tolist()


def make_prompts(count, seed, low=3, high=14):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high, (count,), generator=g)
    return [torch.randint(0, 256, (int(n),), generator=g).tolist() for n in lengths]


@pytest.fixture
def model(tiny_model):
    """The model under test in float32 (a no-op for the tiny model; with --model, a real
    bfloat16 checkpoint is compared in float32, where rounding cannot flip its choices)."""
    return tiny_model.float()


def first_diff(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def test_identical_models_report_parity(impl, model):
    twin = copy.deepcopy(model)
    prompts = make_prompts(3, seed=1)
    report = impl.parity.compare_logits(model, twin, prompts)
    assert report.max_abs == 0.0 and report.mean_abs == 0.0, f"identical models: {report}"
    assert report.argmax_agreement == 1.0
    assert [len(row) for row in report.per_position] == [len(p) for p in prompts], \
        "per_position needs one entry per position of each prompt"
    assert impl.parity.greedy_parity(model, twin, prompts, 6) == []


def test_logits_match_transformers(impl, model, device):
    twin = hf_twin(model, device)
    prompts = make_prompts(4, seed=2)
    report = impl.parity.compare_logits(model, twin, prompts)
    with torch.no_grad():
        scale = max(float(twin(torch.tensor([p], device=device)).logits.abs().max()) for p in prompts)
        direct = max(float((model(torch.tensor([p], device=device)) - twin(torch.tensor([p], device=device)).logits)
                           .abs().max()) for p in prompts)
    assert report.max_abs == pytest.approx(direct, rel=1e-6, abs=1e-9), \
        f"compare_logits says max |diff| {report.max_abs:.6g}; running both models here gives {direct:.6g}"
    assert report.max_abs <= REL_TOL * max(1.0, scale), f"ours vs transformers: {report}"
    assert report.argmax_agreement == 1.0, f"ours vs transformers: {report}"


def test_greedy_generate_matches_transformers_generate(impl, model, device):
    """Our Chapter 8 generate (full recompute) against transformers' generate, token for token."""
    twin = hf_twin(model, device)
    for i, prompt in enumerate(make_prompts(5, seed=3)):
        ours = impl.sampling.generate(model, prompt, NEW_TOKENS, use_cache=False)
        theirs = hf_greedy(twin, prompt, NEW_TOKENS)
        step = first_diff(ours, theirs)
        assert ours == theirs, (f"prompt {i} {prompt}: greedy tokens part at step {step}: "
                                f"transformers {theirs}, ours {ours}")


def test_harness_agrees_with_transformers_generate(impl, model, device):
    """greedy_parity with transformers' own generate on one side finds no divergence."""
    twin = hf_twin(model, device)
    prompts = make_prompts(3, seed=4)
    found = impl.parity.greedy_parity(model, twin, prompts, 8, generate_b=hf_greedy)
    assert found == [], "ours vs transformers: " + "; ".join(map(str, found))


def plant(model, token, seed=5):
    """A copy of `model` whose embedding row `token` is replaced by a random vector."""
    broken = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        row = broken.model.embed_tokens.weight[token]
        row.copy_(3 * torch.randn(row.shape, generator=g).to(row))
    return broken


def test_planted_divergence_found_at_the_right_token(impl, model, device):
    prompt = [72, 101, 108, 108, 111, 44, 32, 119]
    good = hf_greedy(hf_twin(model, device), prompt, NEW_TOKENS)
    # The first generated token that the prompt does not contain: its embedding is first
    # read one step after it is generated, so that is where the copies can first part.
    step, token = next((s, t) for s, t in enumerate(good) if t not in prompt and t not in good[:s])
    broken = plant(model, token)
    bad = hf_greedy(hf_twin(broken, device), prompt, NEW_TOKENS)
    where = first_diff(good, bad)
    assert where == step + 1, f"test setup: the planted change should act at step {step + 1}, acted at {where}"
    found = impl.parity.greedy_parity(model, broken, [[9, 9, 9], prompt], NEW_TOKENS)
    assert len(found) == 1, f"expected one divergence (prompt 1), got {[str(d) for d in found]}"
    d = found[0]
    assert (d.prompt_index, d.step, d.expected, d.got) == (1, where, good[where], bad[where]), (
        f"harness reports prompt {d.prompt_index}, step {d.step}, expected {d.expected}, got {d.got}; "
        f"transformers' generate parts at prompt 1, step {where}: {good[where]} vs {bad[where]}")
    assert d.context == prompt + good[:where], (f"context {d.context}, expected {prompt + good[:where]}: the prompt "
                                                f"plus the tokens both agreed on, before the step where they part")
    assert d.margin_a > 0 and d.margin_b > 0, (f"each model prefers its own token: margin_a = a's logit of expected "
                                               f"minus got, margin_b = b's logit of got minus expected; got margins "
                                               f"{d.margin_a}, {d.margin_b}")


def test_an_output_that_stops_early_is_an_error(impl, model):
    """A shorter output is a different stopping rule, not a numerical divergence."""
    try:
        impl.parity.greedy_parity(model, model, [[1, 2, 3]], 4, generate_a=lambda *_: [7, 8, 9, 10],
                                  generate_b=lambda *_: [7, 8])
    except ValueError as error:
        assert "prompt 0" in str(error), f"the ValueError should name the prompt ('prompt 0'); it says: {error}"
        return
    except Exception as error:
        pytest.fail(f"one output stopping before the other must raise ValueError naming the prompt (a different "
                    f"stopping rule is not a divergence); got {type(error).__name__}: {error}")
    pytest.fail("one output stopping before the other must raise ValueError naming the prompt (a different "
                "stopping rule is not a divergence); greedy_parity returned")


def test_planted_divergence_in_the_logits(impl, model):
    token = 200
    broken = plant(model, token)
    prompts = [[5, 6, 7, 8, token, 9, 10], [1, 2, 3], [token, 4, 4]]
    report = impl.parity.compare_logits(model, broken, prompts)
    assert report.per_position[1] == [0.0, 0.0, 0.0], "a prompt without the token must match exactly"
    assert report.per_position[0][:4] == [0.0] * 4, "positions before the token must match exactly"
    assert min(report.per_position[0][4:]) > 1e-3, "positions from the token on must differ"
    assert report.first_position_over(1e-6) == [4, None, 0]
    worst_prompt, worst_pos = report.worst
    assert worst_prompt < len(prompts) and worst_pos < len(prompts[worst_prompt]), (
        f"worst is (prompt index, position) of the largest difference; got {report.worst}")
    assert report.per_position[worst_prompt][worst_pos] == report.max_abs, (
        f"worst is (prompt index, position) of the largest difference; got {report.worst}")
    device = next(model.parameters()).device
    with torch.no_grad():
        pairs = [(model(torch.tensor([p], device=device))[0].double().cpu(),
                  broken(torch.tensor([p], device=device))[0].double().cpu()) for p in prompts]
    differences = torch.cat([(a - b).abs().flatten() for a, b in pairs])
    assert report.mean_abs == pytest.approx(float(differences.mean()), rel=1e-9), (
        f"mean_abs weighs every logit of every prompt equally (a long prompt counts more): expected "
        f"{float(differences.mean()):.6g}, got {report.mean_abs:.6g}")
    agree = sum(int((a.argmax(-1) == b.argmax(-1)).sum()) for a, b in pairs) / sum(len(p) for p in prompts)
    assert report.argmax_agreement == pytest.approx(agree), (
        f"argmax_agreement is the fraction of all positions, over all prompts, whose argmaxes agree: expected "
        f"{agree:.4g}, got {report.argmax_agreement:.4g}")
