"""Every SamplingParams field is honoured or refused by every sampler of the engine.

serve.request.FIELD_RULES declares, for each field, which samplers honour it; the engine
refuses the others from that table alone. This suite holds the table to the engine: for
each (field, sampler) pair, an engine that samples with that sampler either refuses a
request asking for the field, with a ValueError naming the field and the sampler, or
serves it and the field changes what comes out (the tokens drawn under one seed, how many
samples, the logprobs returned). A field the table forgets, or a sampler that ignores a
field it claims to honour, fails here. Adding a field means adding its example below.
"""
import importlib

import pytest

from course.testing.oracles import assert_engine_idle, byte_vocabulary, make_engine

pytestmark = pytest.mark.chapter(37)

PROMPT = [11, 12, 13, 14, 15, 16, 17, 18]
LENGTH = 6


@pytest.fixture
def greedy(serve, tiny_model):
    """The tiny model's greedy continuation of PROMPT; the examples stop on its tokens."""
    engine = make_engine(serve, tiny_model, eos_token_id=None, num_blocks=32, block_size=4)
    tokens = engine.generate([PROMPT], [serve.request.SamplingParams(max_tokens=LENGTH)])[0].output_token_ids
    assert tokens[1] != tokens[0], f"the examples need two different greedy tokens first, got {tokens}"
    return tokens


def examples(greedy):
    """field -> (the parameters of a base request, the fields that make it ask for the field)."""
    sampled = dict(temperature=8.0, seed=7)        # the tiny model is peaked: flatten it
    warm = dict(temperature=2.0, seed=7)           # peaked enough to repeat a token
    first, second = greedy[0], greedy[1]
    other = next(t for t in range(20, 200) if t not in greedy)
    return {
        "n": (sampled, dict(n=2)),
        "max_tokens": ({}, dict(max_tokens=2)),
        "min_tokens": (dict(stop_token_ids=(first,)), dict(min_tokens=3)),
        "temperature": ({}, dict(temperature=8.0, seed=7)),
        "top_k": (sampled, dict(top_k=1)),
        "top_p": (sampled, dict(top_p=1e-6)),
        "min_p": (sampled, dict(min_p=1.0)),
        "typical_p": (sampled, dict(typical_p=1e-6)),
        "seed": (sampled, dict(seed=8)),
        "stop_token_ids": ({}, dict(stop_token_ids=(second,))),
        "ignore_eos": (dict(eos=first), dict(ignore_eos=True)),
        "logprobs": ({}, dict(logprobs=2)),
        "prompt_logprobs": ({}, dict(prompt_logprobs=1)),
        "presence_penalty": (warm, dict(presence_penalty=2.0)),      # it repeats a token: no more
        "frequency_penalty": (warm, dict(frequency_penalty=2.0)),
        "repetition_penalty": (sampled, dict(repetition_penalty=0.05)),
        "logit_bias": ({}, dict(logit_bias={other: 100.0})),
        "allowed_token_ids": ({}, dict(allowed_token_ids=(other,))),
        "bad_words_token_ids": ({}, dict(bad_words_token_ids=((first,),))),
        "guided_regex": ({}, dict(guided_regex="a+")),
        "guided_json": ({}, dict(guided_json={"type": "boolean"})),
        # strict, the one listed key is all an object may hold; JSON Schema's own rule lets others in
        "guided_json_strict": (dict(guided_json={"type": "object", "properties": {"a": {"type": "boolean"}}}),
                               dict(guided_json_strict=False)),
    }


def engine_with(serve, model, sampler, eos):
    """An engine whose tokens come from `sampler` (one of serve.request.SAMPLERS), able to
    guide (it has the byte vocabulary)."""
    request = serve.request
    config = dict(num_blocks=32, block_size=4, sampler="full")
    drafter = None
    if sampler in (request.SIMPLE, request.ON_DEVICE):
        config.update(sampler="simple", async_scheduling=sampler == request.ON_DEVICE)
    if sampler == request.VERIFIER:
        spec = importlib.import_module(f"{serve.engine.__package__}.spec_decode")
        drafter = spec.Speculator(spec.NgramProposer(), k=2)
    engine = serve.engine.EngineCore(model, serve.config.EngineConfig(**config), eos_token_id=eos,
                                     vocab_bytes=byte_vocabulary(model.cfg.vocab_size), drafter=drafter)
    assert engine.sampler_name == sampler, f"the engine built for {sampler} says it samples with {engine.sampler_name}"
    return engine


def outcome(engine, params):
    """What a client sees of one request: each sample's tokens, and whether it has logprobs."""
    result = engine.generate([PROMPT], [params])[0]
    samples = result if isinstance(result, list) else [result]
    return [(s.output_token_ids, bool(s.logprobs), bool(s.prompt_logprobs)) for s in samples]


def test_the_table_covers_every_field_and_sampler(serve):
    request = serve.request
    fields = set(request.SamplingParams.__dataclass_fields__)
    assert set(request.FIELD_RULES) == fields, (
        f"fields without a rule: {sorted(fields - set(request.FIELD_RULES))}; "
        f"rules without a field: {sorted(set(request.FIELD_RULES) - fields)}")
    for name, rule in request.FIELD_RULES.items():
        assert rule.honoured_by <= set(request.SAMPLERS), f"{name} names an unknown sampler"


@pytest.mark.parametrize("sampler", ["the simple sampler", "the on-device sampler", "the full sampler",
                                     "speculative decoding's verifier"])
def test_every_field_is_honoured_or_refused_by_name(serve, tiny_model, greedy, sampler):
    request = serve.request
    assert sampler in request.SAMPLERS
    cases = examples(greedy)
    assert set(cases) == set(request.FIELD_RULES), (
        f"fields with no example here: {sorted(set(request.FIELD_RULES) - set(cases))}")
    for name, (base, change) in cases.items():
        base = dict(max_tokens=LENGTH, **base)
        eos = base.pop("eos", None)
        asked = request.SamplingParams(**{**base, **change})
        if sampler not in request.FIELD_RULES[name].honoured_by:
            engine = engine_with(serve, tiny_model, sampler, eos)
            with pytest.raises(ValueError, match=f"{name} is not honoured by {sampler}"):
                engine.add_request("refused", PROMPT, asked)
            assert_engine_idle(engine, f"after refusing {name}")
            continue
        before = outcome(engine_with(serve, tiny_model, sampler, eos), request.SamplingParams(**base))
        after = outcome(engine_with(serve, tiny_model, sampler, eos), asked)
        assert after != before, (f"{sampler} claims to honour {name}, yet {change} changed nothing: {after}")
