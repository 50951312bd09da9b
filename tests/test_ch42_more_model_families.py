"""Chapter 42 milestone: Llama, Qwen2, Mistral, Llama 3 and YaRN RoPE scaling (Llama and
Qwen3) and DeepSeek-V2's latent attention beside Qwen3.

Oracles: transformers' own LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM,
Qwen3ForCausalLM and DeepseekV2ForCausalLM with
the deterministic tiny weights, saved with save_pretrained and loaded back through our
checkpoint.load_model (the family comes from config.json): logits within 1e-5 of
transformers' (relative to the largest logit), greedy tokens equal to a full-recompute
argmax loop over transformers' forward, and the Chapter 31 EngineCore (recompute and swap
preemption) equal to solo generate on the same model. SmolLM2-135M-Instruct (the real
model, fetched by course.models.smollm2): our GGUF loader's tensors equal those transformers
dequantizes from the same file, and greedy answers to chat prompts equal transformers'
generate token for token, through generate and through the EngineCore.

transformers' GGUF loading takes tens of seconds, so what it produced (config and
float32 weights) is kept beside the cached GGUF file, once per transformers version.
The prompts of the real-model test are token ids, rendered once with transformers'
tokenizer from the same GGUF and SmolLM2's chat template (building that tokenizer takes
longer than the whole test).
"""
import dataclasses
import types

import httpx
import pytest
import torch

from course import reference
from course.models import fill_deterministic, tiny_config
from course.testing.oracle_records import recorded

pytestmark = pytest.mark.chapter(42)

transformers = pytest.importorskip("transformers")

REL_TOL = 1e-5
EOS = 257
SCALED = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
# DeepSeek-V2's attention on the tiny shape: every head its own K/V head in transformers'
# bookkeeping, a 32-number latent and an 8-channel rotary key per token, dense MLPs only.
LATENT = {"num_key_value_heads": 4, "kv_lora_rank": 32, "q_lora_rank": None, "qk_nope_head_dim": 16,
          "qk_rope_head_dim": 8, "v_head_dim": 16, "first_k_dense_replace": 2}
# What LatentAttention.paged_forward must keep, said when a latent family's engine run differs.
LATENT_RULES = ("; latent attention in the engine: this step's entry (latent and rotary key, one tensor that is "
                "both key and value) is written to the pool before attention reads it, and the softmax scale is "
                "self.scale, not one derived from the query's width")
# What LatentAttention.absorbed must give, said when a latent family's logits differ from transformers'.
ABSORBED_RULES = ("; LatentAttention.absorbed: a head's query is W_UK^T q_nope beside its rotated q_rope, a token's "
                  "entry is its NORMALISED latent c beside its rotated k_rope, both rotary parts reordered by "
                  "pairs_to_halves before rotation; low-rank queries go through q_a_proj, q_a_layernorm, q_b_proj")
# family label -> (transformers config class, model class, extra config fields)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "mistral (window 6)": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 6}),
    "llama 3 rope scaling": ("LlamaConfig", "LlamaForCausalLM", {"rope_scaling": SCALED}),
    "yarn rope scaling": ("LlamaConfig", "LlamaForCausalLM", {"rope_scaling": YARN}),
    "qwen3 yarn rope scaling": ("Qwen3Config", "Qwen3ForCausalLM", {"rope_scaling": YARN}),
    "deepseek v2 latent attention": ("DeepseekV2Config", "DeepseekV2ForCausalLM", LATENT),
    "deepseek v2 latent, low-rank queries": ("DeepseekV2Config", "DeepseekV2ForCausalLM",
                                             {**LATENT, "q_lora_rank": 24}),
}
OURS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral (window 6)": "MistralForCausalLM",
        "llama 3 rope scaling": "LlamaForCausalLM", "yarn rope scaling": "LlamaForCausalLM",
        "qwen3 yarn rope scaling": "Qwen3ScaledForCausalLM", "deepseek v2 latent attention": "DeepseekV2ForCausalLM",
        "deepseek v2 latent, low-rank queries": "DeepseekV2ForCausalLM"}


def hf_family(impl, label, seed=0):
    config_class, model_class, extra = FAMILIES[label]
    values = dataclasses.asdict(tiny_config(impl.package))
    values.pop("attention_bias")
    hcfg = getattr(transformers, config_class)(**{**values, **extra}, attn_implementation="eager")
    return fill_deterministic(getattr(transformers, model_class)(hcfg), seed).eval()


_LOADED = {}


def loaded(impl, label, tmp_path_factory):
    """(transformers' model, ours loaded from its save_pretrained directory), once per family."""
    key = (impl.name, label)
    if key not in _LOADED:
        hf = hf_family(impl, label)
        path = tmp_path_factory.mktemp(label.split()[0])
        hf.save_pretrained(path)
        _LOADED[key] = hf, impl.checkpoint.load_model(path)
    return _LOADED[key]


@pytest.mark.parametrize("label", list(FAMILIES))
def test_family_logits_match_transformers(impl, label, tmp_path_factory):
    hf, ours = loaded(impl, label, tmp_path_factory)
    assert type(ours).__name__ == OURS[label], f"{label}: load_model built {type(ours).__name__}"
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = hf(ids).logits
        got = ours(ids).float()
    err = float((got - want).abs().max())
    bound = REL_TOL * max(1.0, float(want.abs().max()))
    worst = int((got - want).abs().amax(dim=(0, 2)).argmax())
    assert err <= bound, (f"{label}: logits {err:.3g} from transformers' (bound {bound:.3g}); worst at position "
                          f"{worst} of 40" + (" (past the window: is the sliding window applied?)"
                                              if "mistral" in label and worst >= 6 else "")
                          + (" (does Qwen3Model.forward take its rotary tables from self.rope_tables?)"
                             if "scaling" in label else "")
                          + (ABSORBED_RULES if "latent" in label else ""))


@pytest.mark.parametrize("label", list(FAMILIES))
def test_family_greedy_generate_matches_transformers(impl, label, tmp_path_factory):
    hf, ours = loaded(impl, label, tmp_path_factory)
    prompt = [5, 77, 190, 3, 42, 250, 18, 9]
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(20):                          # transformers' forward, full recompute, argmax
            tokens.append(int(hf(torch.tensor([tokens])).logits[0, -1].argmax()))
    want = tokens[len(prompt):]
    got = impl.sampling.generate(ours, prompt, 20)
    assert got == want, f"{label}: generate gave {got}, transformers' greedy loop {want}"


@pytest.mark.parametrize("label", list(FAMILIES))
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_family_engine_core_matches_solo_generate(impl, serve, label, mode, tmp_path_factory):
    hf, ours = loaded(impl, label, tmp_path_factory)
    generator = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 256, (n,), generator=generator).tolist() for n in (5, 19, 33, 12)]
    max_tokens = [24, 30, 20, 28]
    engine = serve.engine.EngineCore(
        ours, serve.config.EngineConfig(num_blocks=7, block_size=8, preemption_mode=mode), eos_token_id=EOS)
    results = engine.generate(prompts, [serve.request.SamplingParams(max_tokens=n) for n in max_tokens])
    assert engine.preemptions > 0, f"{label}, {mode}: no request was preempted; the test lost its point"
    for i, (prompt, n, result) in enumerate(zip(prompts, max_tokens, results)):
        # The families share weights: the label tells the recorded oracle which architecture ran.
        want = recorded("generate", (label, ours, prompt, n, EOS),
                        lambda: reference().sampling.generate(ours, prompt, n, eos_token_id=EOS))  # noqa: B023
        assert result.output_token_ids == want, (
            f"{label}, {mode} preemption: request {i} ({len(prompt)}-token prompt) gave "
            f"{result.output_token_ids}, solo generate {want}" + (LATENT_RULES if "latent" in label else ""))


def test_unknown_architecture_names_the_known_ones(impl, tmp_path):
    hf = hf_family(impl, "llama")
    hf.save_pretrained(tmp_path)
    config = (tmp_path / "config.json").read_text()
    (tmp_path / "config.json").write_text(config.replace("LlamaForCausalLM", "GPTNeoXForCausalLM"))
    with pytest.raises(ValueError) as error:
        impl.checkpoint.load_model(tmp_path)
    message = str(error.value)
    assert "GPTNeoXForCausalLM" in message and "LlamaForCausalLM" in message and "Qwen3ForCausalLM" in message, (
        f"an unknown architecture must be named along with the known ones: {message}")


def test_qwen3_config_refuses_a_rope_scaling_it_cannot_apply(impl):
    values = {**dataclasses.asdict(tiny_config(impl.package)), "rope_scaling": YARN}
    with pytest.raises(ValueError, match="yarn"):
        impl.qwen3.Qwen3Config.from_dict(values)
    values.pop("rope_theta")
    plain = impl.qwen3.Qwen3Config.from_dict({**values, "rope_scaling": {"rope_type": "default", "rope_theta": 5.0}})
    assert plain.rope_theta == 5.0, "a 'default' rope_scaling only carries rope_theta and must be accepted"


def test_latent_pool_holds_one_small_vector_per_token(impl, serve, tmp_path_factory):
    _, ours = loaded(impl, "deepseek v2 latent attention", tmp_path_factory)
    width = LATENT["kv_lora_rank"] + LATENT["qk_rope_head_dim"]
    budget = 1 << 20
    engine = serve.engine.EngineCore(ours, serve.config.EngineConfig(kv_cache_bytes=budget, block_size=8),
                                     eos_token_id=EOS)
    layers = len(engine.runner.kv_caches)
    k_cache, v_cache = engine.runner.kv_caches[0][:2]
    assert k_cache is v_cache, "the latent pool is ONE tensor per layer, handed out as both k_cache and v_cache"
    assert tuple(k_cache.shape[2:]) == (1, width), (
        f"a block row holds one entry of latent + rotary key ({width} numbers), got {tuple(k_cache.shape[2:])}")
    per_block = layers * 8 * width * 4
    assert engine.blocks.num_blocks == budget // per_block, (
        f"{budget} bytes hold {budget // per_block} latent blocks (one pool, not K and V); the engine made "
        f"{engine.blocks.num_blocks}")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        serve.engine.EngineCore(ours, serve.config.EngineConfig(num_blocks=8, block_size=8, kv_cache_dtype="int8"),
                                eos_token_id=EOS)


def test_latent_pool_swaps_through_one_host_copy(impl, serve, tmp_path_factory):
    """Swapping a request out copies each layer's latent pool to the host ONCE (it is one
    tensor, handed out twice), and swapping in puts the same numbers in the new blocks."""
    _, ours = loaded(impl, "deepseek v2 latent attention", tmp_path_factory)
    runner = serve.runner.ModelRunner(ours, 6, 8)
    generator = torch.Generator().manual_seed(42)
    for layer in runner.kv_caches:
        layer[0].copy_(torch.randn(layer[0].shape, generator=generator))
    old_blocks = [[layer[0][b].clone() for b in (1, 4)] for layer in runner.kv_caches]
    victim = types.SimpleNamespace(request_id="victim")
    runner.swap_out(victim, [1, 4])
    one_block = runner.kv_caches[0][0][0].numel() * runner.kv_caches[0][0].element_size()
    for index, copies in enumerate(runner.swapped["victim"]):
        held = sum(t.numel() * t.element_size() for t in copies)
        assert held == 2 * one_block, (f"layer {index}: two latent blocks take {2 * one_block} bytes on the host, "
                                       f"the swap holds {held} (the one pool tensor copied as both K and V?)")
    for layer in runner.kv_caches:
        layer[0].zero_()
    runner.swap_in(victim, [2, 5])
    for index, (layer, saved) in enumerate(zip(runner.kv_caches, old_blocks)):
        assert torch.equal(layer[0][2], saved[0]) and torch.equal(layer[0][5], saved[1]), \
            f"layer {index}: swapped-in blocks 2 and 5 do not hold what blocks 1 and 4 held"


def test_latent_attention_refuses_what_it_does_not_build(impl):
    values = {**dataclasses.asdict(tiny_config(impl.package)), **LATENT}
    with pytest.raises(ValueError, match="experts"):
        impl.mla.MLAConfig.from_dict({**values, "first_k_dense_replace": 0, "n_routed_experts": 4})
    with pytest.raises(ValueError, match="yarn"):
        impl.mla.MLAConfig.from_dict({**values, "rope_scaling": YARN})


def test_sliding_window_mask_rule(impl):
    slots = torch.tensor([3, 4, 5])
    allowed = impl.families.sliding_window_allowed(slots, 3)
    assert allowed.shape == (1, 1, 3, 6), \
        f"shape {tuple(allowed.shape)}, expected (1, 1, 3, 6): the keys are slots 0 .. the largest query slot"
    want = torch.tensor([[k > q - 3 for k in range(6)] for q in (3, 4, 5)])
    assert torch.equal(allowed[0, 0], want), (f"window 3: got\n{allowed[0, 0].int()}\nexpected\n{want.int()}\n"
                                              f"each query sees itself and the window - 1 slots before it")
    batched = impl.families.sliding_window_allowed(torch.tensor([[3, 4, 5], [0, 1, 2]]), 3)
    assert batched.shape == (2, 1, 3, 6), \
        f"query slots [B, Tq] give one mask per sequence, [B, 1, Tq, K]: got shape {tuple(batched.shape)}"


def test_llama3_frequencies_match_transformers(impl):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    hcfg = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=16,
                                    rope_scaling={**SCALED, "rope_theta": 10000.0})
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](hcfg, "cpu")
    got = impl.families.llama3_inv_freq(16, 10000.0, SCALED)
    assert torch.allclose(got, want.float(), rtol=1e-6, atol=0), (
        f"Llama 3 frequencies {got} != transformers' {want}: a channel whose wavelength 2 pi / f is below L / high "
        f"keeps f, one above L / low gets f / factor, and in between the two are blended with the weight "
        f"s = (L / w - low) / (high - low) on f")


# --- the real model ---------------------------------------------------------------------------

# SmolLM2's chat template around three questions (rendered with transformers' tokenizer).
SYSTEM = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407,
          19712, 8182, 2, 198]
CHAT_PROMPTS = {
    "What is the capital of France?": SYSTEM + [1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198,
                                                 1, 520, 9531, 198],
    "Name three colors of the rainbow.": SYSTEM + [1, 4093, 198, 5820, 1296, 4683, 282, 260, 24594, 30, 2, 198,
                                                    1, 520, 9531, 198],
    "What is 2 + 2?": SYSTEM + [1, 4093, 198, 1780, 314, 216, 34, 1232, 216, 34, 47, 2, 198, 1, 520, 9531, 198],
}
SMOLLM2_EOS = 2
NEW_TOKENS = 12


def transformers_smollm2(gguf_path):
    """transformers' own model from the GGUF file, float32. Its GGUF loader takes tens of
    seconds (it parses all 98,000 tokenizer strings), so the config and weights it produced
    are kept beside the file (one copy per transformers version, written with safetensors)
    and later runs rebuild the same model from them in a second."""
    import os
    import shutil
    import tempfile

    from safetensors.torch import load_model, save_model
    saved = gguf_path.parent / f"smollm2-transformers-{transformers.__version__}"
    if not (saved / "model.safetensors").is_file():
        hf = transformers.AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                                               dtype=torch.float32)
        scratch = tempfile.mkdtemp(dir=gguf_path.parent)
        hf.config.to_json_file(os.path.join(scratch, "config.json"))
        save_model(hf, os.path.join(scratch, "model.safetensors"))       # tied weights stored once
        try:
            os.replace(scratch, saved)                  # atomic: a parallel run never sees half of it
        except OSError:                                 # another run got there first
            shutil.rmtree(scratch, ignore_errors=True)
    config = transformers.AutoConfig.from_pretrained(saved)
    config.quantization_config = None
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    load_model(hf, saved / "model.safetensors")
    return hf.eval()


@pytest.fixture(scope="module")
def smollm2_pair(impl, smollm2_path):
    """(transformers' model from the GGUF, ours from load_model), float32 on the CPU."""
    return transformers_smollm2(smollm2_path), impl.checkpoint.load_model(smollm2_path)


def test_smollm2_tensors_equal_transformers(smollm2_pair):
    hf, ours = smollm2_pair
    theirs, mine = hf.state_dict(), ours.state_dict()
    assert set(mine) == set(theirs), f"parameter names differ: {sorted(set(mine) ^ set(theirs))[:6]}"
    for name, tensor in theirs.items():
        assert torch.equal(mine[name], tensor), (
            f"{name}: max |diff| {float((mine[name] - tensor).abs().max()):.3g} from transformers' dequantized "
            f"tensor" + (" (q/k rows: is the rotary permutation undone?)" if "q_proj" in name or "k_proj" in name
                         else ""))


def test_smollm2_greedy_chat_matches_transformers(impl, serve, smollm2_pair):
    hf, ours = smollm2_pair
    wants = {}
    for question, ids in CHAT_PROMPTS.items():
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                              eos_token_id=SMOLLM2_EOS, pad_token_id=SMOLLM2_EOS)
        wants[question] = out[0, len(ids):].tolist()
        got = impl.sampling.generate(ours, ids, NEW_TOKENS, eos_token_id=SMOLLM2_EOS)
        assert got == wants[question], f"{question!r}: generate gave {got}, transformers {wants[question]}"
    engine = serve.engine.EngineCore(ours, serve.config.EngineConfig(num_blocks=64, block_size=16),
                                     eos_token_id=SMOLLM2_EOS)
    results = engine.generate(list(CHAT_PROMPTS.values()),
                              [serve.request.SamplingParams(max_tokens=NEW_TOKENS) for _ in CHAT_PROMPTS])
    for (question, want), result in zip(wants.items(), results):
        assert result.output_token_ids == want, f"{question!r}: EngineCore gave {result.output_token_ids}, want {want}"


def test_run_py_chat_answers(impl, smollm2_path, capsys):
    """`python run.py chat --model smollm2 --prompt ...` on the implementation under test:
    the reply streams through the EngineCore and names the capital."""
    from course import cli
    status = cli.main(["chat", "--impl", impl.spec.text, "--device", "cpu", "--prompt",
                       "What is the capital of France?", "--max-tokens", "12"])
    out, err = capsys.readouterr()
    assert status == 0, f"run.py chat failed:\n{out}{err}"
    assert out.strip() == "The capital of France is Paris.", f"run.py chat printed {out!r}"


def test_run_py_bench_chat_workload(impl, smollm2_path, capsys):
    """`run.py bench --workloads chat` shrunk to two questions of 8 tokens, on the real model:
    the EngineCore and Chapter 24's engine give the same tokens (the command exits 2
    otherwise) and each reports its rate. (transformers joins them without --no-hf; its
    conversion of a Llama-family model is checked on the tiny one below.)"""
    import json

    from course import cli
    status = cli.main(["bench", "--impl", impl.spec.text, "--device", "cpu", "--workloads", "chat", "--scale", "0.125",
                       "--backends", "reference", "--repeat", "1", "--no-hf", "--no-llama-cpp", "--quiet"])
    out, err = capsys.readouterr()
    assert status == 0, f"run.py bench --workloads chat failed:\n{out}{err}"
    runs = {line["contender"]: line for line in map(json.loads, out.splitlines()) if "contender" in line}
    assert {"core/reference", "ch24 slots"} <= set(runs), out
    assert all(line["requests"] == 2 and line["tok_s"] > 0 and line.get("identical", True)
               for line in runs.values()), out


@pytest.mark.parametrize("label", ["llama", "mistral (window 6)"])
def test_bench_builds_transformers_of_the_same_family(impl, label, tmp_path_factory):
    """The bench's transformers contender is transformers' class of the model's own family
    with our weights: same logits (a Llama's "no window", 0 for us, must not become a window of 0)."""
    from course import bench
    hf, ours = loaded(impl, label, tmp_path_factory)
    theirs = bench.transformers_model(ours)
    assert type(theirs).__name__ == type(hf).__name__, f"{label}: the bench built {type(theirs).__name__}"
    ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        err = float((theirs(ids).logits - hf(ids).logits).abs().max())
    assert err < 1e-4, f"{label}: the bench's transformers model is {err:.3g} from transformers' own"


def test_smollm2_answers_a_chat_over_http(impl, device, smollm2_path):
    """SmolLM2 behind Chapter 38's server: the reply's ids are the reference's solo greedy
    `generate` on the chat template's ids, and its text is those ids decoded. (Here, not in
    Chapter 38's milestone, because it needs Chapters 39 and 42 to load the model.)"""
    messages = [{"role": "user", "content": "What is the capital of France?"}]

    def reference_reply():
        ref_package = reference()
        ref_model = ref_package.checkpoint.load_model(smollm2_path, device=device).eval()
        ref_tokenizer = ref_package.bpe.BPETokenizer.from_gguf_metadata(
            ref_package.gguf.GGUFFile(smollm2_path).metadata)
        prompt = ref_tokenizer.encode_chat(messages)
        ids = ref_package.sampling.generate(ref_model, prompt, 12, eos_token_id=ref_tokenizer.eos_token_id)
        return ids, ref_tokenizer.decode(ids, skip_special_tokens=True)
    expected, expected_text = recorded("SmolLM2's solo greedy chat reply", (messages, 12), reference_reply)

    model = impl.checkpoint.load_model(smollm2_path, device=device).eval()
    tokenizer = impl.bpe.BPETokenizer.from_gguf_metadata(impl.gguf.GGUFFile(smollm2_path).metadata)
    engine = impl.load("serve.engine").EngineCore(model, impl.load("serve.config").EngineConfig(num_blocks=64),
                                                  eos_token_id=tokenizer.eos_token_id)
    app_module = impl.load("server.app")
    served = app_module.ServedModel(
        "smollm2", tokenizer, lambda: impl.bpe.IncrementalDetokenizer(tokenizer, skip_special_tokens=True))
    with app_module.serve_in_thread(app_module.build_app(engine, served)) as url, \
            httpx.Client(base_url=url, timeout=120) as c:
        body = {"model": "smollm2", "messages": messages, "max_tokens": 12, "temperature": 0,
                "return_token_ids": True}
        r = c.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["token_ids"] == expected, "SmolLM2's greedy reply over HTTP must equal solo generate"
    assert choice["message"]["content"] == expected_text
    assert "Paris" in choice["message"]["content"]
