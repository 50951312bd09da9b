"""Engine core (issue 24): the features of Chapters 33-43 taken two at a time.

Every pair is either run together or refused by name. A pair run together must give the
outputs of the engine with only its "content" features (penalties change the tokens, a
guide restricts them) and none of its "mechanics" (padded static shapes, asynchronous
scheduling, speculation change how a step runs, never what it outputs); that baseline is
the plain engine, which Chapter 31's milestone holds to solo `generate`, or the full
sampler with or without a guide, which Chapters 34 and 35 hold to their oracles. Each
feature must also be seen at work (drafts verified, the pattern spelt). A refused pair
raises a ValueError whose message says which feature cannot go with which, and why.

Pairs not in TABLE are listed in UNCOVERED: a test below fails when a pair is in neither.
"""
import itertools
import re

import pytest

from course.testing.oracles import assert_engine_idle, byte_vocabulary

pytestmark = pytest.mark.chapter(37)

PATTERN = "[a-d]{4}"
PROMPTS = [[5, 6, 7, 8, 5, 6, 7], list(range(20, 31)), [9, 9, 9, 9, 9, 9]]
MAX_TOKENS = 8

# feature -> the chapter that builds it
FEATURES = {"static shapes": 33, "async scheduling": 33, "penalties": 34, "guided": 35, "speculation": 37,
            "adapters": 43, "images": 43}
MECHANICS = {"static shapes", "async scheduling", "speculation"}

# (feature, feature) -> "together", or the words the refusal must contain
TABLE = {
    ("static shapes", "async scheduling"): "together",
    ("static shapes", "penalties"): "together",
    ("static shapes", "guided"): "together",
    ("static shapes", "speculation"): "together",
    ("async scheduling", "penalties"): "together",
    ("async scheduling", "guided"): r"guided decoding \(Chapter 35\) needs .* synchronous scheduling",
    ("async scheduling", "speculation"): r"speculative decoding needs synchronous scheduling",
    ("penalties", "guided"): "together",
    ("penalties", "speculation"): r"penalties cannot be used with speculative decoding",
    ("guided", "speculation"): r"guided decoding cannot be used with speculative decoding",
    ("speculation", "adapters"): r"speculative decoding does not take adapter or image requests",
    ("speculation", "images"): r"speculative decoding does not take adapter or image requests",
}

# Pairs this file does not run: the Chapter 43 features need an adapter bank or a vision
# model the tiny model lacks (test_ch43_adapters_and_images.py runs them with the full
# sampler and chunked prefill).
UNCOVERED = {
    ("static shapes", "adapters"), ("static shapes", "images"), ("async scheduling", "adapters"),
    ("async scheduling", "images"), ("penalties", "adapters"), ("penalties", "images"),
    ("guided", "adapters"), ("guided", "images"), ("adapters", "images"),
}


def test_every_pair_is_run_refused_or_listed():
    pairs = set(itertools.combinations(FEATURES, 2))
    missing = pairs - set(TABLE) - UNCOVERED
    assert not missing, f"pairs of features neither run together nor refused: {sorted(missing)}"


def build(serve, spec, model, features):
    config = dict(num_blocks=64, block_size=4, max_num_seqs=4)
    if "static shapes" in features:
        config["cuda_graphs"] = "static"
    if "async scheduling" in features:
        config["async_scheduling"] = True
    if {"penalties", "guided"} & features:
        config["sampler"] = "full"
    vocab = byte_vocabulary(model.cfg.vocab_size) if "guided" in features else None
    drafter = spec.Speculator(spec.NgramProposer(), k=3) if "speculation" in features else None
    return serve.engine.EngineCore(model, serve.config.EngineConfig(**config), eos_token_id=None,
                                   vocab_bytes=vocab, drafter=drafter)


def params(serve, features):
    fields = dict(max_tokens=MAX_TOKENS)
    if "penalties" in features:
        fields["repetition_penalty"] = 1.5
    if "guided" in features:
        fields["guided_regex"] = PATTERN
    return serve.request.SamplingParams(**fields)


def run(serve, spec, model, features):
    engine = build(serve, spec, model, features)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, params(serve, features))
    finals = {}
    for _ in range(200):
        if not engine.has_unfinished:
            break
        finals.update((out.request_id, out.output_token_ids) for out in engine.step() if out.finished)
    assert_engine_idle(engine, f"{sorted(features)} after the run")
    return engine, [finals[f"r{i}"] for i in range(len(PROMPTS))]


def refusal(serve, spec, model, features):
    """The first ValueError met building the engine and adding one request of each feature."""
    engine = build(serve, spec, model, features)
    extra = {}
    if "adapters" in features:
        extra["lora"] = "any-adapter"
    if "images" in features:
        extra["features"] = [object()]
    engine.add_request("r", PROMPTS[0], params(serve, features), **extra)


@pytest.mark.parametrize("pair", list(TABLE), ids=" + ".join)
def test_a_pair_of_features_runs_together_or_is_refused_by_name(serve, spec, tiny_model, pair):
    features = set(pair)
    rule = TABLE[pair]
    if rule != "together":
        with pytest.raises(ValueError, match=rule):
            refusal(serve, spec, tiny_model, features)
        return
    engine, got = run(serve, spec, tiny_model, features)
    _, want = run(serve, spec, tiny_model, features - MECHANICS)
    assert got == want, (f"{' + '.join(pair)}: outputs {got} differ from the engine's without "
                         f"{sorted(features & MECHANICS)}: {want}")
    if "static shapes" in features:
        assert engine.runner.graphs is not None, f"{' + '.join(pair)}: the padded static path is off"
    if "speculation" in features:
        assert engine.drafter.stats.proposed > 0, f"{' + '.join(pair)}: no draft was ever verified"
    if "guided" in features:
        spelt = [bytes(tokens).decode("latin-1") for tokens in got]
        assert all(re.fullmatch(PATTERN, text) for text in spelt), f"{' + '.join(pair)}: {spelt} break {PATTERN}"


@pytest.fixture
def spec(impl):
    return impl.load("serve.spec_decode")
