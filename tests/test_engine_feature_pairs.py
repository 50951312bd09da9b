"""Engine core (issue 24): the features of Chapters 33-43 taken two at a time.

Every pair is either run together or refused by name (TABLE holds every pair of FEATURES).
A pair run together must give the outputs of the engine with only its "content" features
(penalties change the tokens, a guide restricts them, an adapter or a picture changes the
model) and none of its "mechanics" (padded static shapes, asynchronous scheduling,
speculation change how a step runs, never what it outputs); that baseline is the plain
engine, which Chapter 31's milestone holds to solo `generate`, the full sampler with or
without a guide, which Chapters 34 and 35 hold to their oracles, or the adapter and image
engines, which Chapter 43 holds to peft and transformers' Qwen3-VL. Each feature must also
be seen at work (drafts verified, the pattern spelt, the static path used, an adapter's
tokens unlike the base model's, a request's tokens changing with its picture).

A pair of two content features has no such baseline: its engine is held to an oracle that
applies both (peft or transformers' Qwen3-VL, greedy by full recompute, with transformers'
RepetitionPenaltyLogitsProcessor and the pattern's allowed bytes as a mask), and the
oracle without either feature must give other tokens, so agreeing cannot happen by luck.

A refused pair raises a ValueError whose message says which feature cannot go with which,
and why.
"""
import copy
import itertools
import re

import pytest
import torch

from course.testing.adapters_and_images import (
    BLOCK,
    IMAGE,
    SECTIONS,
    greedy,
    image_requests,
    images,
    our_vl_model,
    peft_adapters,
    peft_logits,
    qwen3_vl_logits,
    qwen3_vl_model,
    transformers_twin,
)
from course.testing.oracles import assert_engine_idle, byte_vocabulary

# The last chapter whose features it pairs (an implementation at Chapter 37 has no adapters or images).
pytestmark = pytest.mark.chapter(43)

PATTERN = "[a-d]{4}"
ALLOWED = [range(ord("a"), ord("d") + 1)] * 4     # the byte tokens PATTERN lets each step pick
PROMPTS = [[5, 6, 7, 8, 5, 6, 7], list(range(20, 31)), [9, 9, 9, 9, 9, 9]]
MAX_TOKENS = 8
ADAPTER = "sql"                                    # every adapter request's; its twin "<id>-base" has none
OTHER_PICTURES = 3                                 # the seed of the pictures of image requests' twins

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
    ("static shapes", "adapters"): "together",
    ("static shapes", "images"): "together",
    ("async scheduling", "penalties"): "together",
    ("async scheduling", "guided"): "together",
    ("async scheduling", "speculation"): r"speculative decoding needs synchronous scheduling",
    ("async scheduling", "adapters"): "together",
    ("async scheduling", "images"): "together",
    ("penalties", "guided"): "together",
    ("penalties", "speculation"): r"repetition_penalty is not honoured by speculative decoding's verifier",
    ("penalties", "adapters"): "together",
    ("penalties", "images"): "together",
    ("guided", "speculation"): r"guided_regex is not honoured by speculative decoding's verifier",
    ("guided", "adapters"): "together",
    ("guided", "images"): "together",
    ("speculation", "adapters"): r"speculative decoding does not take adapter or image requests",
    ("speculation", "images"): r"speculative decoding does not take adapter or image requests",
    ("adapters", "images"): "together",
}


def test_every_pair_is_run_or_refused():
    missing = set(itertools.combinations(FEATURES, 2)) - set(TABLE)
    assert not missing, f"pairs of features neither run together nor refused: {sorted(missing)}"


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """peft's model with Chapter 43's random adapters, and the folder they were saved to."""
    pytest.importorskip("peft")
    folder = tmp_path_factory.mktemp("adapters")
    return peft_adapters(folder), folder


@pytest.fixture(scope="module")
def twin():
    """transformers' Qwen3ForCausalLM with the tiny model's weights."""
    pytest.importorskip("transformers")
    return transformers_twin()


@pytest.fixture(scope="module")
def qwen3_vl():
    pytest.importorskip("transformers")
    return qwen3_vl_model()


class Parts:
    """Fixtures by attribute (impl, twin, adapters, qwen3_vl), looked up only when a pair asks for
    them: pairs without Chapter 43's features never build peft's model or Qwen3-VL."""

    def __init__(self, request):
        self.request = request

    def __getattr__(self, name):
        return self.request.getfixturevalue(name)


@pytest.fixture
def parts(request):
    return Parts(request)


def build(serve, spec, model, features, parts=None):
    config = dict(num_blocks=64, block_size=4, max_num_seqs=4)
    if "static shapes" in features:
        config["cuda_graphs"] = "static"
    if "async scheduling" in features:
        config["async_scheduling"] = True
    if {"penalties", "guided"} & features:
        config["sampler"] = "full"
    vocab = byte_vocabulary(model.cfg.vocab_size) if "guided" in features else None
    drafter = spec.Speculator(spec.NgramProposer(), k=3) if "speculation" in features else None
    bank = vision = None
    if "adapters" in features:
        lora = parts.impl.load("serve.lora")
        bank = [lora.load_peft_adapter(parts.adapters[1] / ADAPTER)]
    if "images" in features:
        encoder, model = our_vl_model(parts.impl, parts.qwen3_vl)    # fresh: the engine wires its vision seam
        vision = parts.impl.load("serve.vision").VisionInputs(encoder, IMAGE, SECTIONS)
        config["block_size"] = BLOCK
    return serve.engine.EngineCore(model, serve.config.EngineConfig(**config), eos_token_id=None,
                                   vocab_bytes=vocab, drafter=drafter, adapters=bank, vision=vision)


def params(serve, features):
    fields = dict(max_tokens=MAX_TOKENS)
    if "penalties" in features:
        fields["repetition_penalty"] = 1.5
    if "guided" in features:
        fields["guided_regex"] = PATTERN
    return serve.request.SamplingParams(**fields)


def workload(features):
    """request id -> (prompt, adapter name or None, pictures): the text prompts, or Chapter
    43's image requests, each with a twin "<id>-other" whose pictures are others of the same
    sizes; with adapters, each request uses ADAPTER and has a twin "<id>-base" without one."""
    if "images" in features:
        requests = {rid: (prompt, None, pictures) for rid, (prompt, pictures) in image_requests().items()}
        for rid, (prompt, pictures) in image_requests().items():
            if pictures:
                sizes = [tuple(picture.shape[1:]) for picture in pictures]
                requests[f"{rid}-other"] = (prompt, None, images(OTHER_PICTURES, *sizes))
    else:
        requests = {f"r{i}": (prompt, None, []) for i, prompt in enumerate(PROMPTS)}
    if "adapters" in features:
        requests = {**{rid: (prompt, ADAPTER, pictures) for rid, (prompt, _, pictures) in requests.items()},
                    **{f"{rid}-base": request for rid, request in requests.items()}}
    return requests


def run(serve, spec, model, features, parts=None):
    engine = build(serve, spec, model, features, parts)
    requests = workload(features)
    for rid, (prompt, lora, pictures) in requests.items():
        engine.add_request(rid, prompt, params(serve, features), lora=lora,
                           features={"images": pictures} if pictures else None)
    finals = {}
    for _ in range(200):
        if not engine.has_unfinished:
            break
        finals.update((out.request_id, out.output_token_ids) for out in engine.step() if out.finished)
    assert_engine_idle(engine, f"{sorted(features)} after the run")
    return engine, {rid: finals[rid] for rid in requests}


def oracle(parts, features, prompt, lora, pictures):
    """Greedy tokens of a request with its content `features` applied by the oracles:
    transformers' Qwen3 (text), peft's model (an adapter), transformers' Qwen3-VL (images;
    with an adapter, its language model holds peft's merged weights), transformers'
    repetition penalty, the pattern's allowed bytes as a mask."""
    if "images" in features:
        vl = merged_qwen3_vl(parts, lora)

        def last_logits(tokens):
            return qwen3_vl_logits(parts.qwen3_vl, tokens, pictures, vl)[-1]
    elif lora is not None:
        last_logits = peft_logits(parts.adapters[0], lora)
    else:
        def last_logits(tokens):
            return parts.twin(torch.tensor([tokens])).logits[0, -1]
    return greedy(last_logits, prompt, MAX_TOKENS, eos_token_id=None,
                  repetition_penalty=1.5 if "penalties" in features else 1.0,
                  allowed=ALLOWED if "guided" in features else None)


_MERGED: dict = {}


def merged_qwen3_vl(parts, lora):
    """transformers' Qwen3-VL whose language model holds the base weights plus adapter `lora`'s
    B @ A * alpha / r, merged by peft (None: the model itself)."""
    if lora is None:
        return parts.qwen3_vl[0]
    if lora not in _MERGED:
        twin = copy.deepcopy(parts.adapters[0])
        merged = twin.merge_and_unload(adapter_names=[lora])
        model = copy.deepcopy(parts.qwen3_vl[0])
        weights = {f"model.language_model.{k[len('model.'):]}": v for k, v in merged.state_dict().items()
                   if k.startswith("model.")}
        missing, unexpected = model.load_state_dict(weights, strict=False)
        assert not unexpected, f"merged weights the Qwen3-VL lacks: {unexpected[:3]}"
        _MERGED[lora] = model
    return _MERGED[lora]


def refusal(serve, spec, model, features):
    """The first ValueError met building the engine (without Chapter 43's parts: the refusals
    come first) and adding one request of each feature."""
    engine = build(serve, spec, model, features - {"adapters", "images"})
    extra = {}
    if "adapters" in features:
        extra["lora"] = ADAPTER
    if "images" in features:
        extra["features"] = {"images": images(0, (16, 16))}
    engine.add_request("r", PROMPTS[0], params(serve, features), **extra)


@pytest.mark.parametrize("pair", list(TABLE), ids=" + ".join)
def test_a_pair_of_features_runs_together_or_is_refused_by_name(serve, spec, tiny_model, parts, pair):
    features = set(pair)
    rule = TABLE[pair]
    name = " + ".join(pair)
    if rule != "together":
        with pytest.raises(ValueError, match=rule):
            refusal(serve, spec, tiny_model, features)
        return
    engine, got = run(serve, spec, tiny_model, features, parts)
    if features & MECHANICS:
        _, want = run(serve, spec, tiny_model, features - MECHANICS, parts)
        assert got == want, (f"{name}: outputs {got} differ from the engine's without "
                             f"{sorted(features & MECHANICS)}: {want}")
    else:
        check_against_the_oracles(parts, features, got, name)
    if "static shapes" in features:
        assert engine.runner.graphs is not None, f"{name}: the padded static path is off"
    if "speculation" in features:
        assert engine.drafter.stats.proposed > 0, f"{name}: no draft was ever verified"
    if "guided" in features:
        spelt = {rid: bytes(tokens).decode("latin-1") for rid, tokens in got.items()}
        assert all(re.fullmatch(PATTERN, text) for text in spelt.values()), f"{name}: {spelt} break {PATTERN}"
    # A guide leaves few choices: a feature at work must change some request's tokens, not each one's.
    if "adapters" in features:
        twins = [rid for rid in got if rid.endswith("-base")]
        assert any(got[rid] != got[rid[:-len("-base")]] for rid in twins), (
            f"{name}: adapter {ADAPTER!r} changed no request's tokens: {got}")
    if "images" in features:
        twins = [rid for rid in got if rid.endswith("-other")]
        assert any(got[rid] != got[rid[:-len("-other")]] for rid in twins), (
            f"{name}: other pictures changed no request's tokens: {got}")


def test_asynchronous_guided_sampling_draws_what_the_synchronous_engine_draws(serve, tiny_model):
    """Asynchronous scheduling with guides beyond the pair above: the worker-thread queue,
    seeded sampling, a repetition penalty, and an unguided request that runs on after the
    guides end theirs (a step planned for a request its guide has just finished). Each
    request's tokens are the synchronous engine's, so each guided step was sampled from a
    guide that had seen the step before it."""
    pattern = "([a-d][e-h]){2}[a-d]"          # each position its own letters: a stale guide shows
    vocab = byte_vocabulary(tiny_model.cfg.vocab_size)

    def run_engine(asynchronous):
        config = dict(num_blocks=64, block_size=4, max_num_seqs=4, sampler="full")
        if asynchronous:
            config.update(async_scheduling=True, device_queue="thread")
        engine = serve.engine.EngineCore(tiny_model, serve.config.EngineConfig(**config), eos_token_id=None,
                                         vocab_bytes=vocab)
        for i, prompt in enumerate(PROMPTS + [[3, 1, 4, 1, 5]]):
            guide = {"guided_regex": pattern} if i < len(PROMPTS) else {}
            engine.add_request(f"r{i}", prompt, serve.request.SamplingParams(
                max_tokens=MAX_TOKENS, temperature=1.0, seed=i, repetition_penalty=1.3, **guide))
        finals = {}
        while engine.has_unfinished:
            finals.update((out.request_id, out.output_token_ids) for out in engine.step() if out.finished)
        if asynchronous:
            engine.async_steps.queue.close()
        assert_engine_idle(engine, f"guided sampling, async={asynchronous}")
        return finals

    want, got = run_engine(False), run_engine(True)
    assert got == want, f"asynchronous {got} != synchronous {want}"
    spelt = {rid: bytes(tokens).decode("latin-1") for rid, tokens in got.items() if rid != f"r{len(PROMPTS)}"}
    assert all(re.fullmatch(pattern, text) for text in spelt.values()), f"{spelt} break {pattern}"
    assert len(got[f"r{len(PROMPTS)}"]) == MAX_TOKENS > 5, "the unguided request must outlive the guided ones"


def check_against_the_oracles(parts, features, got, name):
    """Two content features: the engine's tokens equal the oracle applying both. That each
    one acts is checked on the engine's side (the pattern spelt, the adapter's twin, the
    other picture); penalties must change the oracle's tokens of some request."""
    requests = workload(features)
    want = {rid: oracle(parts, features, *request) for rid, request in requests.items()}
    assert got == want, f"{name}: engine {got}, oracle with both features {want}"
    if "penalties" in features:
        free = {rid: oracle(parts, features - {"penalties"}, *request) for rid, request in requests.items()}
        assert free != want, f"{name}: the repetition penalty changes no request's tokens: the test proves nothing"


@pytest.fixture
def spec(impl):
    return impl.load("serve.spec_decode")
