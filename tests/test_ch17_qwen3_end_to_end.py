"""Chapter 17 milestone: a checkpoint directory in, the same tokens as transformers out.

Oracles: transformers' Qwen3ForCausalLM and its `generate` (greedy, its own KV cache),
whose weights are written to a temporary directory with `save_pretrained` and loaded back
by our code; the reference tokenizer for text; hand-written config files for stop tokens.
The tiny weights (course.models.fill_deterministic) give greedy choices wide margins, so
the two implementations agree token for token despite float32 rounding differences.
With --model PATH (a real Qwen3 directory), the same parity runs on it.
"""
import json

import pytest
import torch

import course
from course.models import fill_deterministic, tiny_config_values
from course.testing.milestone_helpers import step_difference
from course.testing.oracle_records import recorded
from course.testing.oracles import reference_generate, reference_tiny_qwen3

pytestmark = pytest.mark.chapter(17)

transformers = pytest.importorskip("transformers")

NEW_TOKENS = 20
PROMPTS = {"one token": [256], "short": [256, 72, 105, 33], "bytes": list(b"The KV cache stores keys"),
           "long": [(37 * i + 11) % 320 for i in range(64)]}


def byte_text(ids):
    """The reference ByteTokenizer's decode of ids (recorded, for an edition without it)."""
    return recorded("ByteTokenizer(320).decode", list(ids),
                    lambda: course.reference().tokenizer.ByteTokenizer(320).decode(list(ids)))


def save_hf_tiny(directory, **overrides):
    """A transformers Qwen3 with the tiny config and weights, saved with save_pretrained."""
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**tiny_config_values(**overrides)))
    fill_deterministic(model)
    model.eval()
    model.save_pretrained(directory)
    return model


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def checkpoint(request, tmp_path_factory):
    """(directory, transformers model) for an untied and a tied-embedding tiny Qwen3."""
    directory = tmp_path_factory.mktemp("hf_tiny")
    model = save_hf_tiny(directory, tie_word_embeddings=request.param)
    return directory, model


def hf_greedy(model, ids, new_tokens, device="cpu", **kwargs):
    """transformers' greedy continuation of `ids` (new tokens only). The attention mask is
    given explicitly: left to itself, generate masks every prompt token equal to the pad id."""
    model = model.to(device)
    prompt = torch.tensor([ids], device=device)
    with torch.inference_mode():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=0, **kwargs)
    return out[0, len(ids):].tolist()


def first_difference(expected, got):
    """Where ours first parts from transformers, in words."""
    return step_difference(expected, got, "transformers", "ours")


def write_configs(directory, config_eos, generation_eos):
    directory.mkdir(parents=True, exist_ok=True)
    config = {"model_type": "qwen3"}
    if config_eos is not None:
        config["eos_token_id"] = config_eos
    (directory / "config.json").write_text(json.dumps(config))
    if generation_eos != "absent":
        generation = {} if generation_eos is None else {"eos_token_id": generation_eos}
        (directory / "generation_config.json").write_text(json.dumps(generation))


@pytest.mark.parametrize("config_eos,generation_eos,expected", [
    (151645, [151645, 151643], (151643, 151645)),           # Qwen3's own two files
    (257, "absent", (257,)),
    ([9, 4], 4, (4, 9)),
    (None, 12, (12,)),
    (None, "absent", ()),
    (7, None, (7,)),
], ids=["qwen3", "no generation config", "config list", "generation only", "none", "generation without eos"])
def test_stop_token_ids_from_both_files(impl, tmp_path, config_eos, generation_eos, expected):
    write_configs(tmp_path, config_eos, generation_eos)
    files = f"config.json eos {config_eos!r}, generation_config.json eos {generation_eos!r}"
    try:
        got = impl.pipeline.stop_token_ids(tmp_path)
    except Exception as error:
        pytest.fail(f"{files}: stop_token_ids raised {type(error).__name__}: {error}; each file's eos_token_id "
                    "may be an int, a list of ints or absent")
    assert tuple(got) == expected, (f"{files}: expected stop ids {expected}, got {got!r} (the union of both "
                                    "files' ids, sorted)")


@pytest.mark.parametrize("name", list(PROMPTS))
def test_greedy_generate_matches_transformers(impl, checkpoint, device, name):
    directory, hf_model = checkpoint
    pipe = impl.pipeline.Pipeline.from_pretrained(directory, device=device)
    ids = PROMPTS[name]
    expected = hf_greedy(hf_model, ids, NEW_TOKENS, device)     # stops at the saved eos, as ours must
    got = pipe.complete(ids, NEW_TOKENS).token_ids
    assert got == expected, f"prompt {name!r} ({len(ids)} tokens): {first_difference(expected, got)}"


def test_pipeline_stops_where_transformers_stops(impl, tmp_path, device):
    hf_model = save_hf_tiny(tmp_path)
    ids = PROMPTS["bytes"]
    free = hf_greedy(hf_model, ids, NEW_TOKENS, device, eos_token_id=None)
    stop = free[7]
    generation = json.loads((tmp_path / "generation_config.json").read_text())
    generation["eos_token_id"] = [257, stop]           # only generation_config.json knows `stop`
    (tmp_path / "generation_config.json").write_text(json.dumps(generation))
    hf_config = transformers.GenerationConfig.from_pretrained(tmp_path)
    expected = hf_greedy(hf_model, ids, NEW_TOKENS, device, generation_config=hf_config)
    assert expected[-1] == stop and len(expected) <= 8
    pipe = impl.pipeline.Pipeline.from_pretrained(tmp_path, device=device)
    done = pipe.complete(ids, NEW_TOKENS)
    assert done.token_ids == expected, (f"with eos {generation['eos_token_id']} in generation_config.json: "
                                        f"{first_difference(expected, done.token_ids)}")
    assert done.finish_reason == "stop", f"the answer ended with a stop token; finish_reason is {done.finish_reason!r}"
    text = byte_text(expected[:-1])
    assert done.text == text, (
        f"text must be the decode of the new tokens alone, without the stop token: expected {text!r}, "
        f"got {done.text!r}")
    last_allowed = pipe.complete(ids, len(expected))
    assert last_allowed.finish_reason == "stop", (
        f"a stop id on the last allowed step (max_new_tokens={len(expected)}) still ends the answer: "
        f"finish_reason must be 'stop', got {last_allowed.finish_reason!r}")


def test_pipeline_text_in_text_out(impl, checkpoint, device):
    directory, hf_model = checkpoint
    pipe = impl.pipeline.Pipeline.from_pretrained(directory, device=device)
    done = pipe.complete("Hello, world", 12)
    ids = recorded("ByteTokenizer(320).encode", "Hello, world",
                   lambda: course.reference().tokenizer.ByteTokenizer(320).encode("Hello, world"))
    assert done.prompt_ids == ids, f"prompt ids: expected {ids}, got {done.prompt_ids}"
    expected = hf_greedy(hf_model, ids, 12, device)          # eos 257 from the saved generation config
    assert done.token_ids == expected, first_difference(expected, done.token_ids)
    reason = "stop" if expected[-1] == 257 else "length"
    assert done.finish_reason == reason, f"expected finish_reason {reason!r}, got {done.finish_reason!r}"
    shown = expected[:-1] if reason == "stop" else expected
    assert done.text == byte_text(shown), f"text: expected {byte_text(shown)!r}, got {done.text!r}"
    assert done.seconds > 0


def test_pipeline_reports_the_context_limit(impl, tmp_path, device):
    save_hf_tiny(tmp_path, max_position_embeddings=24)
    pipe = impl.pipeline.Pipeline.from_pretrained(tmp_path, device=device)
    ids = PROMPTS["long"][:20]
    done = pipe.complete(ids, 10)
    oracle = reference_tiny_qwen3(device, max_position_embeddings=24)     # the weights just saved
    expected = reference_generate(oracle, ids, 10, stop_token_ids=(257,), use_cache=False)
    assert done.token_ids == expected, first_difference(expected, done.token_ids)
    if expected[-1] != 257:
        assert len(expected) == 4
        assert done.finish_reason == "context", (f"20 prompt tokens + 4 new fill the 24-token context; "
                                                 f"finish_reason is {done.finish_reason!r}")


def test_seeded_sampling_is_reproducible(impl, checkpoint, device):
    directory, hf_model = checkpoint
    pipe = impl.pipeline.Pipeline.from_pretrained(directory, device=device)
    options = dict(temperature=0.9, top_k=40, seed=1234)
    first = pipe.complete("seeded", 16, **options)
    second = pipe.complete("seeded", 16, **options)
    assert first.token_ids == second.token_ids, "the same seed must give the same completion"
    expected = recorded("Pipeline.complete (seeded)", (hf_model, "seeded", 16, options), lambda: course.reference(
        ).pipeline.Pipeline.from_pretrained(directory, device=device).complete("seeded", 16, **options).token_ids)
    assert first.token_ids == expected, (
        f"seed 1234: the reference draws {expected}, yours {first.token_ids} "
        f"(seed a torch.Generator on the model's device and pass it to generate)")


def test_a_real_checkpoint_matches_transformers(impl, model_path, device):
    if model_path is None:
        pytest.skip("no --model PATH given (a real Qwen3 checkpoint directory)")
    pipe = impl.pipeline.Pipeline.from_pretrained(model_path, dtype=torch.float32, device=device)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    for text in ("The capital of France is", "def fibonacci(n):"):
        ids = pipe.encode(text)
        expected = hf_greedy(hf_model, ids, 16, device)
        got = pipe.complete(ids, 16).token_ids
        assert got == expected, f"{model_path}, prompt {text!r}: {first_difference(expected, got)}"
