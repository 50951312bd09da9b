"""Chapter 11 milestone: loading a Hugging Face Qwen3 checkpoint directory.

Oracle: directories written by transformers' own save_pretrained (one model.safetensors, or
shards with model.safetensors.index.json via max_shard_size), read back with the
safetensors library; the loaded model's logits must match the transformers model that
wrote them (float32: max |diff| <= 1e-5 * max(1, max |logit|), as in Chapter 10). Broken
directories (a tensor removed, one added, a wrong shape, another architecture, a shard
missing) must raise CheckpointError naming the tensor and the file.
"""
import dataclasses
import json

import pytest
import torch

from course.models import fill_deterministic, tiny_config

pytestmark = pytest.mark.chapter(11)

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")
from safetensors import safe_open  # noqa: E402

REL_TOL = 1e-5


def hf_model(impl, seed=0, **overrides):
    """transformers' Qwen3ForCausalLM with the deterministic tiny weights."""
    cfg = tiny_config(impl.package, **overrides)
    hcfg = transformers.Qwen3Config(**dataclasses.asdict(cfg), attn_implementation="eager")
    return fill_deterministic(transformers.Qwen3ForCausalLM(hcfg), seed).eval()


def saved(model, path, **kwargs):
    model.save_pretrained(path, **kwargs)
    return path


def check_logits(loaded, hf, what, device="cpu"):
    ids = torch.randint(0, hf.config.vocab_size, (2, 13), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        want = hf(ids).logits
        got = loaded(ids.to(device)).float().cpu()
    err = float((got - want).abs().max())
    bound = REL_TOL * max(1.0, float(want.abs().max()))
    assert err <= bound, f"{what}: loaded model's logits are {err:.3g} from transformers' (bound {bound:.3g})"


def loads(impl, path, rule, **options):
    """load_checkpoint(path), with a failure that names the rule a good directory relies on."""
    try:
        return impl.checkpoint.load_checkpoint(path, **options)
    except Exception as error:
        pytest.fail(f"load_checkpoint({path.name}) raised {type(error).__name__}: {error}; {rule}")


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_single_file_checkpoint(impl, tmp_path, device, tied):
    hf = hf_model(impl, tie_word_embeddings=tied)
    path = saved(hf, tmp_path / "ckpt")
    assert (path / "model.safetensors").is_file()
    rule = ("a tied checkpoint stores no lm_head.weight: lm_head must be the embedding tensor itself" if tied
            else "every parameter comes from the file")
    model = loads(impl, path, rule, device=device)
    assert isinstance(model, impl.qwen3.Qwen3ForCausalLM), f"load_checkpoint returned {type(model)}"
    assert not model.training, "load_checkpoint must return the model in eval mode"
    assert model.cfg.tie_word_embeddings == tied
    if tied:
        assert model.lm_head.weight is model.model.embed_tokens.weight, "tied: lm_head must be the embedding"
    assert all(p.device.type == device.type for p in model.parameters()), "parameters not on the requested device"
    check_logits(model, hf, f"model.safetensors ({'tied' if tied else 'untied'})", device)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_sharded_checkpoint(impl, tmp_path, tied):
    hf = hf_model(impl, seed=1, tie_word_embeddings=tied)
    path = saved(hf, tmp_path / "sharded", max_shard_size="60KB")
    shards = sorted(p.name for p in path.glob("model-*.safetensors"))
    assert (path / "model.safetensors.index.json").is_file() and len(shards) > 2, shards
    # tensor_locations against what each shard really holds (read with safetensors).
    truth = {}
    for shard in shards:
        with safe_open(path / shard, framework="pt") as handle:
            truth.update({name: shard for name in handle.keys()})
    try:
        locations = impl.checkpoint.tensor_locations(path)
    except Exception as error:
        pytest.fail(f"tensor_locations on a sharded checkpoint raised {type(error).__name__}: {error}; the index's "
                    f"shard names are files in the checkpoint's directory")
    got = {name: getattr(file, "name", str(file)) for name, file in locations.items()}
    assert got == truth, (
        f"tensor_locations disagrees with the shards' contents: {set(got.items()) ^ set(truth.items())}")
    model = impl.checkpoint.load_checkpoint(path)
    check_logits(model, hf, f"sharded checkpoint, {len(shards)} shards")


def test_a_shard_the_index_does_not_name_is_never_read(impl, tmp_path):
    hf = hf_model(impl, seed=3)
    path = saved(hf, tmp_path / "sharded", max_shard_size="60KB")
    # An earlier save's leftover: same naming scheme, other numbers, and a tensor no parameter has.
    stale = {"model.norm.weight": torch.zeros(hf.config.hidden_size), "model.stale.weight": torch.zeros(2)}
    safetensors_torch.save_file(stale, path / "model-00099-of-00099.safetensors", metadata={"format": "pt"})
    model = loads(impl, path, "a sharded checkpoint is the files its index names, not every *.safetensors "
                              "in the directory")
    check_logits(model, hf, "sharded checkpoint beside a stale shard the index does not name (it must not be read)")


def test_dtype_cast(impl, tmp_path):
    hf = hf_model(impl, seed=2)
    path = saved(hf, tmp_path / "ckpt")
    model = impl.checkpoint.load_checkpoint(path, dtype=torch.bfloat16)
    dtypes = {p.dtype for p in model.parameters()}
    assert dtypes == {torch.bfloat16}, (f"dtype=bfloat16 gave parameters of {dtypes}: every parameter is cast to "
                                        f"the requested dtype")
    theirs = hf.state_dict()
    for name, param in model.state_dict().items():
        assert torch.equal(param, theirs[name].to(torch.bfloat16)), (
            f"{name} is not the bfloat16 cast of the file's tensor")
    ids = torch.arange(10)[None]
    with torch.no_grad():
        logits = model(ids)
    assert logits.dtype == torch.float32
    # A float32 file loaded with dtype=None stays float32 (the config says "dtype": "float32").
    assert {p.dtype for p in impl.checkpoint.load_checkpoint(path).parameters()} == {torch.float32}


def test_checkpoint_without_model_prefix(impl, tmp_path):
    """A checkpoint saved from the bare Qwen3Model has names without "model."."""
    hf = hf_model(impl, seed=3, tie_word_embeddings=True)
    path = saved(hf.model, tmp_path / "bare")
    with safe_open(path / "model.safetensors", framework="pt") as handle:
        assert "embed_tokens.weight" in handle.keys()
    model = impl.checkpoint.load_checkpoint(path)
    check_logits(model, hf, "checkpoint of the bare Qwen3Model (no 'model.' prefix, tied head)")


def test_match_names_rules(impl):
    match = impl.checkpoint.match_names
    ours = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    files = {"model.embed_tokens.weight": "a", "model.norm.weight": "a", "lm_head.weight": "b"}
    CheckpointError = impl.checkpoint.CheckpointError

    def paired(locations, tied, rule):
        try:
            return match(locations, ours, tied=tied)
        except CheckpointError as error:
            pytest.fail(f"match_names({sorted(locations)}, tied={tied}) raised {error}; {rule}")

    rule = "a tensor pairs with the parameter of its own name"
    assert paired(files, False, rule) == {n: n for n in ours}, rule
    rule = "with tied embeddings a stored lm_head.weight is skipped: the embedding is loaded once"
    assert paired(files, True, rule) == {n: n for n in ours[:2]}, rule
    bare = {"embed_tokens.weight": "a", "norm.weight": "a",
            "layers.0.self_attn.rotary_emb.inv_freq": "a"}
    rule = "names saved without the 'model.' prefix get it; names ending in IGNORED_SUFFIXES are skipped"
    assert paired(bare, True, rule) == {"embed_tokens.weight": "model.embed_tokens.weight",
                                        "norm.weight": "model.norm.weight"}, rule
    for locations, named, rule in [
        ({"model.embed_tokens.weight": "a"}, "model.norm.weight",
         "a parameter that no file provides is a CheckpointError naming it"),
        ({**files, "norm.weight": "c"}, "norm.weight",
         "two file tensors that map onto one parameter are a CheckpointError naming the second"),
    ]:
        try:
            match(locations, ours, tied=False)
        except CheckpointError as error:
            assert named in str(error), f"{rule}; the error says: {error}"
            continue
        pytest.fail(f"match_names({sorted(locations)}) returned: {rule}")


# --- errors --------------------------------------------------------------------------------

def rewrite_tensors(path, change):
    file = path / "model.safetensors"
    tensors = safetensors_torch.load_file(file)
    change(tensors)
    safetensors_torch.save_file(tensors, file, metadata={"format": "pt"})


def rewrite_config(path, change):
    file = path / "config.json"
    config = json.loads(file.read_text())
    change(config)
    file.write_text(json.dumps(config))


def expect_error(impl, path, rule, *fragments):
    """load_checkpoint(path) must raise CheckpointError naming every fragment; `rule` says why."""
    try:
        impl.checkpoint.load_checkpoint(path)
    except impl.checkpoint.CheckpointError as error:
        message = str(error)
    except Exception as error:
        pytest.fail(f"{rule}: expected a CheckpointError, got {type(error).__name__}: {error}")
    else:
        pytest.fail(f"{rule}: load_checkpoint raised nothing")
    for fragment in fragments:
        assert fragment in message, f"{rule}: the error should name {fragment!r}; it says: {message}"
    return message


def test_error_missing_tensor(impl, tmp_path):
    path = saved(hf_model(impl), tmp_path / "ckpt")
    rewrite_tensors(path, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    expect_error(impl, path, "a parameter the files lack is an error", "model.layers.1.mlp.up_proj.weight")


def test_error_missing_untied_head(impl, tmp_path):
    path = saved(hf_model(impl), tmp_path / "ckpt")
    rewrite_tensors(path, lambda t: t.pop("lm_head.weight"))
    expect_error(impl, path, "an untied model needs lm_head.weight from the files", "lm_head.weight")


def test_error_unexpected_tensor(impl, tmp_path):
    path = saved(hf_model(impl), tmp_path / "ckpt")
    rewrite_tensors(path, lambda t: t.update({"model.layers.0.self_attn.q_bias": torch.zeros(64)}))
    expect_error(impl, path, "a tensor that matches no parameter is an error", "model.layers.0.self_attn.q_bias",
                 "model.safetensors")


def test_error_shape_mismatch(impl, tmp_path):
    path = saved(hf_model(impl), tmp_path / "ckpt")
    rewrite_config(path, lambda c: c.update(intermediate_size=200))
    message = expect_error(impl, path, "a tensor whose shape differs from the parameter's is an error", "mlp",
                           "model.safetensors")
    assert "192" in message and "200" in message, f"the error should give both shapes; it says: {message}"


def test_error_shape_mismatch_in_a_shard(impl, tmp_path):
    path = saved(hf_model(impl), tmp_path / "sharded", max_shard_size="60KB")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shard = index["weight_map"]["model.norm.weight"]
    tensors = safetensors_torch.load_file(path / shard)
    tensors["model.norm.weight"] = torch.ones(65)
    safetensors_torch.save_file(tensors, path / shard, metadata={"format": "pt"})
    expect_error(impl, path, "a tensor whose shape differs from the parameter's is an error", "model.norm.weight",
                 shard)


@pytest.mark.parametrize("arch, model_type", [("LlamaForCausalLM", "llama"), ("Qwen2ForCausalLM", "qwen2")])
def test_error_unknown_architecture(impl, tmp_path, arch, model_type):
    path = saved(hf_model(impl), tmp_path / "ckpt")
    rewrite_config(path, lambda c: c.update(architectures=[arch], model_type=model_type))
    expect_error(impl, path, "only Qwen3 checkpoints load", arch)


def test_error_missing_shard(impl, tmp_path):
    path = saved(hf_model(impl), tmp_path / "sharded", max_shard_size="60KB")
    victim = sorted(path.glob("model-*.safetensors"))[1]
    victim.unlink()
    expect_error(impl, path, "a shard the index names must be in the directory", victim.name)


def test_error_empty_weight_map(impl, tmp_path):
    path = saved(hf_model(impl), tmp_path / "sharded", max_shard_size="60KB")
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {}}))
    expect_error(impl, path, "an index without a (non-empty) weight_map is an error", "model.safetensors.index.json")


def test_error_no_weights_or_config(impl, tmp_path):
    path = saved(hf_model(impl), tmp_path / "ckpt")
    (path / "model.safetensors").unlink()
    expect_error(impl, path, "a directory without weights is an error naming the file it looked for",
                 "model.safetensors")
    (path / "config.json").unlink()
    expect_error(impl, path, "a directory without config.json is an error", "config.json")


def test_saved_checkpoint_loads_in_transformers(impl, tmp_path):
    """save_checkpoint (a helper of the chapter) writes what transformers reads."""
    hf = hf_model(impl, seed=4, tie_word_embeddings=True)
    model = impl.checkpoint.load_checkpoint(saved(hf, tmp_path / "a"))
    impl.checkpoint.save_checkpoint(model, tmp_path / "b", max_shard_bytes=50_000)
    back = transformers.Qwen3ForCausalLM.from_pretrained(tmp_path / "b", attn_implementation="eager").eval()
    check_logits(model, back, "our save_checkpoint read by transformers' from_pretrained")


def test_real_checkpoint(impl, model_path, device):
    """With --model PATH: our loader against transformers' from_pretrained, in float32."""
    if model_path is None:
        pytest.skip("no --model PATH given (the tiny checkpoints above cover the loader)")
    model = impl.checkpoint.load_checkpoint(model_path, dtype=torch.float32, device=device)
    hf = transformers.Qwen3ForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(device).eval()
    ids = torch.tensor([[9707, 11, 847, 829, 374, 1207, 16948, 13]], device=device) % model.cfg.vocab_size
    with torch.no_grad():
        got, want = model(ids), hf(ids).logits.float()
    err = float((got - want).abs().max())
    assert err <= 1e-3 * max(1.0, float(want.abs().max())), f"{model_path}: logits differ by {err:.3g}"
    assert torch.equal(got.argmax(-1), want.argmax(-1))
