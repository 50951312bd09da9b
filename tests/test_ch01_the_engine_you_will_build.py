"""Chapter 1 milestone: count a Qwen3's parameters from its config alone.

Oracles: the number of elements in a model actually built (ours, and transformers'
Qwen3ForCausalLM on the meta device, which allocates nothing), and the sizes the Qwen3
model cards publish.
"""
import pytest
import torch

pytestmark = pytest.mark.chapter(1)

VOCAB = 151936
# From each checkpoint's config.json on the Hugging Face hub (head_dim 128, vocab 151936),
# with the totals and non-embedding totals the model cards state, in billions.
PUBLISHED = {
    "Qwen3-0.6B": (dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                        num_key_value_heads=8, tie_word_embeddings=True), "0.6", "0.44"),
    "Qwen3-1.7B": (dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                        num_key_value_heads=8, tie_word_embeddings=True), "1.7", "1.4"),
    "Qwen3-4B": (dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                      num_key_value_heads=8, tie_word_embeddings=True), "4.0", "3.6"),
    "Qwen3-8B": (dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                      num_key_value_heads=8, tie_word_embeddings=False), "8.2", "6.95"),
    "Qwen3-14B": (dict(hidden_size=5120, intermediate_size=17408, num_hidden_layers=40, num_attention_heads=40,
                       num_key_value_heads=8, tie_word_embeddings=False), "14.8", "13.2"),
    "Qwen3-32B": (dict(hidden_size=5120, intermediate_size=25600, num_hidden_layers=64, num_attention_heads=64,
                       num_key_value_heads=8, tie_word_embeddings=False), "32.8", "31.2"),
}

SMALL_CONFIGS = {
    "tiny, untied": dict(vocab_size=320, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False),
    "tiny, tied": dict(vocab_size=320, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True),
    "head_dim not hidden/heads": dict(vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=3,
                                      num_attention_heads=6, num_key_value_heads=3, head_dim=32,
                                      tie_word_embeddings=False),
    "no GQA, biases": dict(vocab_size=50, hidden_size=32, intermediate_size=40, num_hidden_layers=1,
                           num_attention_heads=4, num_key_value_heads=4, head_dim=8, tie_word_embeddings=True,
                           attention_bias=True),
    "multi-query, untied, biases": dict(vocab_size=77, hidden_size=40, intermediate_size=24, num_hidden_layers=4,
                                        num_attention_heads=5, num_key_value_heads=1, head_dim=12,
                                        tie_word_embeddings=False, attention_bias=True),
}


def hf_parameter_count(values):
    """transformers' own Qwen3 built on the meta device: shapes only, no memory."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    cfg = Qwen3Config(**values)
    with torch.device("meta"):
        model = Qwen3ForCausalLM(cfg)
    return sum(p.numel() for p in model.parameters())


def which_part(difference, values):
    """The piece of the model a count that is off by `difference` most likely got wrong."""
    layers, hidden = values["num_hidden_layers"], values["hidden_size"]
    head_dim = values.get("head_dim") or hidden // values["num_attention_heads"]
    parts = [
        (values["vocab_size"] * hidden, "the vocab_size x hidden_size matrix: a tied embedding and LM head counts "
                                        "once, an untied one twice"),
        (layers * 2 * head_dim, "q_norm and k_norm: one head_dim vector each per layer, shared by the heads"),
        (layers * 2 * hidden, "the two layer norms of every layer (hidden_size each)"),
        (hidden, "the final norm after the last layer (hidden_size)"),
    ]
    named = [part for size, part in parts if size == abs(difference)]    # sizes can coincide
    return " or ".join(named) or ("the attention projections' widths: q and o are num_attention_heads x head_dim, "
                                  "k and v num_key_value_heads x head_dim (with a bias each when attention_bias)")


@pytest.mark.parametrize("name", list(SMALL_CONFIGS))
def test_count_matches_transformers(impl, name):
    values = SMALL_CONFIGS[name]
    got = impl.cost.count_parameters(impl.qwen3.Qwen3Config(**values))
    expected = hf_parameter_count(values)
    assert got == expected, (f"config {name!r} ({values}): count_parameters gave {got:,}, but transformers' "
                             f"Qwen3ForCausalLM with this config has {expected:,} parameters "
                             f"(difference {got - expected:+,}); check {which_part(got - expected, values)}")


@pytest.mark.parametrize("tied", [False, True])
def test_count_matches_the_tiny_model(impl, device, tied):
    from course.models import tiny_qwen3
    model = tiny_qwen3(impl.package, device=device, tie_word_embeddings=tied)
    expected = sum(p.numel() for p in model.parameters())    # a tied matrix appears once
    got = impl.cost.count_parameters(model.cfg)
    what = "tied" if tied else "untied"
    assert got == expected, (f"the tiny model ({what} embeddings) has {expected:,} parameters; "
                             f"count_parameters(model.cfg) gave {got:,} (difference {got - expected:+,})")


def test_count_without_embeddings(impl):
    for name, values in SMALL_CONFIGS.items():
        cfg = impl.qwen3.Qwen3Config(**values)
        tables = 1 if values["tie_word_embeddings"] else 2
        expected = hf_parameter_count(values) - tables * values["vocab_size"] * values["hidden_size"]
        got = impl.cost.count_parameters(cfg, embeddings=False)
        head = "and the untied LM head" if tables == 2 else "(tied to the LM head)"
        assert got == expected, (f"config {name!r}: count_parameters(cfg, embeddings=False) gave {got:,}, "
                                 f"expected {expected:,}: non-embedding parameters are everything except the "
                                 f"embedding table {head}")


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_published_qwen3_sizes(impl, name):
    values, total, non_embedding = PUBLISHED[name]
    values = dict(values, vocab_size=VOCAB, head_dim=128)
    cfg = impl.qwen3.Qwen3Config(**values)
    got = impl.cost.count_parameters(cfg)
    expected = hf_parameter_count(values)
    assert got == expected, f"{name}: count_parameters gave {got:,}; transformers builds {expected:,}"
    digits = len(total.split(".")[1])
    assert f"{got / 1e9:.{digits}f}" == total, f"{name}: the model card says {total}B parameters, got {got / 1e9:.3f}B"
    bare = impl.cost.count_parameters(cfg, embeddings=False)
    digits = len(non_embedding.split(".")[1])
    assert f"{bare / 1e9:.{digits}f}" == non_embedding, (
        f"{name}: the model card says {non_embedding}B non-embedding parameters, got {bare / 1e9:.3f}B")


def test_count_is_an_int_and_builds_nothing(impl, monkeypatch):
    """A 32B config is counted in a moment: nothing may be allocated or built."""
    values = dict(PUBLISHED["Qwen3-32B"][0], vocab_size=VOCAB, head_dim=128)
    cfg = impl.qwen3.Qwen3Config(**values)

    def refuse(*args, **kwargs):
        raise AssertionError("count_parameters built a model; count from the config's numbers instead")

    monkeypatch.setattr(impl.qwen3.Qwen3ForCausalLM, "__init__", refuse)
    got = impl.cost.count_parameters(cfg)
    assert isinstance(got, int), f"count_parameters should return an int, got {type(got).__name__}"
    assert got == 32_762_123_264, f"Qwen3-32B: expected 32,762,123,264 parameters, got {got:,}"
