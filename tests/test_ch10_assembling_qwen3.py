"""Chapter 10 milestone: the whole Qwen3 (Qwen3Model, Qwen3ForCausalLM).

Oracle: transformers' Qwen3ForCausalLM with the same config and the same weights, on three
configs: the tiny model (untied LM head), a tied-embedding variant, and a deeper untied one
with plain multi-head attention. Weights move by state_dict in both directions with
strict=True, which also proves that every parameter name equals Hugging Face's.

Tolerance (float32): max |ours - transformers| <= 1e-5 * max(1, max |logit|). The logits of
these models reach ~30 and the measured gap is ~1e-5 (order of float32 additions only).
"""
import dataclasses

import pytest
import torch

from course.models import fill_deterministic, tiny_config

pytestmark = pytest.mark.chapter(10)

transformers = pytest.importorskip("transformers")

CONFIGS = [
    ("tiny (untied)", {}),
    ("tied embeddings", dict(tie_word_embeddings=True)),
    ("3 layers, 4q/4kv, untied", dict(num_hidden_layers=3, num_key_value_heads=4, intermediate_size=96)),
]
REL_TOL = 1e-5


def build_pair(impl, overrides, device, seed=0):
    cfg = tiny_config(impl.package, **overrides)
    ours = fill_deterministic(impl.qwen3.Qwen3ForCausalLM(cfg), seed).to(device).eval()
    hcfg = transformers.Qwen3Config(**dataclasses.asdict(cfg), attn_implementation="eager")
    theirs = transformers.Qwen3ForCausalLM(hcfg)
    theirs.load_state_dict(ours.state_dict(), strict=True)
    return cfg, ours, theirs.to(device).eval()


def prompts(cfg, batch, length, seed, device):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (batch, length), generator=generator).to(device)


def assert_logits_close(got, want, what):
    assert got.dtype == torch.float32, f"{what}: logits must be float32, got {got.dtype}"
    assert got.shape == want.shape, (f"{what}: logits {tuple(got.shape)}, transformers {tuple(want.shape)} (logits "
                                     f"for every position)")
    err = (got - want.float()).abs()
    bound = REL_TOL * max(1.0, float(want.abs().max()))
    b, t, v = (int(i) for i in torch.unravel_index(err.argmax(), err.shape))
    assert float(err.max()) <= bound, (
        f"{what}: max |ours - transformers| = {float(err.max()):.3g} > {bound:.3g} at sequence {b}, "
        f"position {t}, token {v} (ours {float(got[b, t, v]):.5f}, transformers {float(want[b, t, v]):.5f}); "
        f"check: the layers run in order on one stream, all with the same rotary tables, then the final norm; the "
        f"LM head is lm_head (the embedding's matrix only when tied)")


@pytest.mark.parametrize("name, overrides", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_logits_match_transformers(impl, device, name, overrides):
    cfg, ours, theirs = build_pair(impl, overrides, device)
    ids = prompts(cfg, 3, 17, seed=10, device=device)
    with torch.no_grad():
        got, want = ours(ids), theirs(ids).logits
    assert_logits_close(got, want, f"Qwen3ForCausalLM [{name}] on 3 prompts of 17 tokens")
    assert torch.equal(got.argmax(-1), want.argmax(-1)), f"[{name}]: greedy choices differ from transformers'"


@pytest.mark.parametrize("name, overrides", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_state_dict_names_are_huggingface_names(impl, name, overrides):
    cfg, ours, theirs = build_pair(impl, overrides, "cpu")
    ours_keys, hf_keys = set(ours.state_dict()), set(theirs.state_dict())
    assert ours_keys == hf_keys, (f"[{name}] names only ours has: {sorted(ours_keys - hf_keys)[:5]}; "
                                  f"only transformers has: {sorted(hf_keys - ours_keys)[:5]}")
    # The other direction: a transformers state_dict loads into our class unchanged, and
    # the model it gives computes transformers' logits.
    fresh = impl.qwen3.Qwen3ForCausalLM(cfg)
    fresh.load_state_dict(theirs.state_dict(), strict=True)
    ids = prompts(cfg, 1, 6, seed=14, device="cpu")
    with torch.no_grad():
        assert_logits_close(fresh.eval()(ids), theirs(ids).logits,
                            f"[{name}] our class loaded from transformers' state_dict")
    ours_count = sum(p.numel() for p in ours.parameters())
    hf_count = sum(p.numel() for p in theirs.parameters())
    assert ours_count == hf_count, f"[{name}] ours has {ours_count} parameters, transformers {hf_count}"


def test_tied_head_is_the_embedding(impl):
    cfg = tiny_config(impl.package, tie_word_embeddings=True)
    model = fill_deterministic(impl.qwen3.Qwen3ForCausalLM(cfg)).eval()
    assert model.lm_head.weight is model.model.embed_tokens.weight, \
        "with tie_word_embeddings the LM head must be the embedding Parameter itself, not a copy"
    untied = impl.qwen3.Qwen3ForCausalLM(tiny_config(impl.package))
    assert untied.lm_head.weight is not untied.model.embed_tokens.weight
    # The logits are the final hidden states scored against the embedding rows.
    ids = prompts(cfg, 2, 5, seed=15, device="cpu")
    with torch.no_grad():
        want = model.model(ids) @ model.model.embed_tokens.weight.T
        assert_logits_close(model(ids), want, "tied model: logits vs hidden states @ embedding.T")


def test_positions_argument_matches_position_ids(impl, device):
    """positions= feeds RoPE exactly like transformers' position_ids. The positions have
    gaps: a constant shift would prove nothing, since RoPE only sees differences."""
    cfg, ours, theirs = build_pair(impl, {}, device)
    ids = prompts(cfg, 2, 9, seed=11, device=device)
    positions = torch.tensor([0, 1, 2, 5, 9, 10, 40, 41, 100], device=device)
    with torch.no_grad():
        got = ours(ids, positions=positions)
        want = theirs(ids, position_ids=positions[None].expand(2, 9)).logits
        plain = ours(ids)
    assert float((plain - got).abs().max()) > 1e-3, (
        "the positions argument had no effect on the logits: positions= must reach RoPE (they default to the "
        "cache slots only when left out)")
    assert_logits_close(got, want, f"Qwen3ForCausalLM with positions {positions.tolist()}")


def test_hidden_states_are_transformers_last_hidden_state(impl, device):
    cfg, ours, theirs = build_pair(impl, {}, device)
    ids = prompts(cfg, 2, 9, seed=13, device=device)
    with torch.no_grad():
        got, want = ours.model(ids), theirs.model(ids).last_hidden_state
    err = float((got - want).abs().max())
    assert err <= REL_TOL * max(1.0, float(want.abs().max())), (
        f"Qwen3Model's output is {err:.3g} from transformers' last_hidden_state, the stream after the last layer "
        f"and the final norm")


def test_rows_of_a_batch_are_independent(impl, device):
    """A sequence's logits do not depend on what else is in the batch (to rounding)."""
    cfg, ours, _ = build_pair(impl, {}, device)
    ids = prompts(cfg, 4, 12, seed=12, device=device)
    with torch.no_grad():
        batched = ours(ids)
        alone = torch.cat([ours(ids[i:i + 1]) for i in range(4)])
    assert_logits_close(alone, batched, "each sequence alone vs the batch of 4")


def test_bfloat16_model_returns_float32_logits(impl, device):
    cfg, ours, theirs = build_pair(impl, {}, device)
    ids = prompts(cfg, 1, 8, seed=13, device=device)
    with torch.no_grad():
        exact = theirs(ids).logits
        got = ours.to(torch.bfloat16)(ids)
    assert got.dtype == torch.float32, f"a bfloat16 model must still return float32 logits, got {got.dtype}"
    # bfloat16 keeps 8 significant bits: each of ~10 roundings on the way costs up to 2^-8.
    err = float((got - exact).abs().max())
    assert err < 0.1 * float(exact.abs().max()), f"bfloat16 logits are {err:.3g} from float32's"
