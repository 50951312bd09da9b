"""Chapter 43 milestone: batched LoRA adapters and image inputs in the engine core.

Oracles: `peft` applying ONE adapter at a time to transformers' Qwen3ForCausalLM with the
tiny model's weights (greedy by full recompute), for the engine that serves several adapters
and the base model in one flattened batch; torch's own matmuls, row by row, for the batched
shrink and expand; for image requests, a tiny random Qwen3VLForConditionalGeneration whose
state dict the implementation loads into its vision encoder and Qwen3 (`load_qwen3_vl`):
its patch order, `get_rope_index`, rotary tables and `get_image_features` (same
`pixel_values`, made by transformers' Qwen2-VL image processor), and its whole forward
(logits at every prompt position, greedy tokens of each request alone). The adapters are
random (peft's `init_lora_weights=False`) and saved with `save_pretrained`, so the engine
reads exactly what a learner's trained adapter would look like.
"""
from types import SimpleNamespace

import pytest
import torch

from course import models
from course.testing.oracles import TINY_EOS, assert_engine_idle, make_engine

pytestmark = pytest.mark.chapter(43)

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

BLOCK = 8
ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> (seed, rank, alpha, targets): different ranks, scalings and target sets in one bank.
ADAPTERS = {"sql": (1, 4, 8, ALL_TARGETS), "poet": (2, 2, 16, ["q_proj", "v_proj", "down_proj"]),
            "math": (3, 8, 8, ["k_proj", "o_proj", "gate_proj", "up_proj"])}


def transformers_twin():
    """transformers' Qwen3ForCausalLM with the tiny config and course.models' deterministic
    weights: the tiny Qwen3 every chapter uses, built without the reference package (so a
    learner's edition has this oracle too)."""
    hcfg = transformers.Qwen3Config(**models.tiny_config_values(), attn_implementation="eager")
    return models.fill_deterministic(transformers.Qwen3ForCausalLM(hcfg)).eval()


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """A PeftModel holding the three random adapters, and the folder they were saved to."""
    torch.manual_seed(0)
    base = transformers_twin()
    peft_model = None
    for name, (seed, rank, alpha, targets) in ADAPTERS.items():
        config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, init_lora_weights=False)
        torch.manual_seed(seed)
        if peft_model is None:
            peft_model = peft.get_peft_model(base, config, adapter_name=name)
        else:
            peft_model.add_adapter(name, config)
    folder = tmp_path_factory.mktemp("adapters")
    peft_model.save_pretrained(folder)            # one subfolder per named adapter
    return peft_model.eval(), folder


_PEFT_RUNS: dict = {}


@torch.inference_mode()
def peft_greedy(peft_model, adapter, prompt, max_new):
    """Greedy tokens of the base model with `adapter` alone (None: the base model), by full
    recompute, stopping at the tiny model's EOS. Cached: several tests ask the same question."""
    key = (id(peft_model), adapter, tuple(prompt), max_new)
    if key not in _PEFT_RUNS:
        _PEFT_RUNS[key] = peft_model, _peft_greedy(peft_model, adapter, prompt, max_new)
    return list(_PEFT_RUNS[key][1])


def _peft_greedy(peft_model, adapter, prompt, max_new):
    tokens = list(prompt)
    for _ in range(max_new):
        if adapter is None:
            with peft_model.disable_adapter():
                logits = peft_model(torch.tensor([tokens])).logits[0, -1]
        else:
            peft_model.set_adapter(adapter)
            logits = peft_model(torch.tensor([tokens])).logits[0, -1]
        tokens.append(int(logits.argmax()))
        if tokens[-1] == TINY_EOS:
            break
    return tokens[len(prompt):]


def lora_engine(impl, serve, model, folder, names=tuple(ADAPTERS), **config):
    lora = impl.load("serve.lora")
    adapters = [lora.load_peft_adapter(folder / name) for name in names]
    return make_engine(serve, model, adapters=adapters, **{"block_size": BLOCK, "num_blocks": 96, **config})


# --- the batched kernels --------------------------------------------------------------------

def test_shrink_and_expand_match_one_matmul_per_row(impl):
    lora = impl.load("serve.lora")
    g = torch.Generator().manual_seed(0)
    rows, d_in, d_out, rank, slots_n = 11, 12, 20, 3, 4
    x = torch.randn(rows, d_in, generator=g)
    lora_a = torch.randn(slots_n, rank, d_in, generator=g)
    lora_b = torch.randn(slots_n, d_out, rank, generator=g)
    lora_a[0], lora_b[0] = 0, 0
    scaling = torch.tensor([0.0, 2.0, 0.5, 4.0])
    slots = torch.tensor([0, 1, 1, 3, 2, 0, 3, 3, 1, 2, 0])
    base = torch.randn(rows, d_out, generator=g)
    before = base.clone()
    shrunk = lora.lora_shrink(x, lora_a, slots)
    assert shrunk.shape == (rows, rank), f"lora_shrink returned shape {tuple(shrunk.shape)}, expected {(rows, rank)}"
    out = lora.lora_expand(base, shrunk, lora_b, scaling, slots)
    torch.testing.assert_close(base, before, msg="lora_expand changed its `base` argument in place")
    for i, slot in enumerate(slots.tolist()):
        t = lora_a[slot] @ x[i]
        torch.testing.assert_close(shrunk[i], t, msg=f"lora_shrink row {i} (slot {slot})")
        torch.testing.assert_close(out[i], base[i] + scaling[slot] * (lora_b[slot] @ t),
                                   msg=f"lora_expand row {i} (slot {slot})")
    assert torch.equal(out[slots == 0], base[slots == 0]), "rows of slot 0 (no adapter) must keep the base output"


# --- adapters through the engine --------------------------------------------------------------

@pytest.mark.parametrize("pool", [96, 8])
def test_many_adapters_in_one_batch_match_peft_alone(impl, serve, tiny_model, adapters, pool):
    """Base and three adapters, interleaved, in the same steps (and, in an 8-block pool,
    preempted and recomputed): each request's greedy tokens equal peft's with that adapter alone."""
    peft_model, folder = adapters
    engine = lora_engine(impl, serve, tiny_model, folder, num_blocks=pool)
    g = torch.Generator().manual_seed(5)
    choices = [None, "sql", "poet", "math", "sql", None, "math", "poet"]
    prompts = [torch.randint(0, 256, (int(n),), generator=g).tolist() for n in torch.randint(3, 30, (8,), generator=g)]
    params = serve.request.SamplingParams(max_tokens=10)
    for i, (prompt, name) in enumerate(zip(prompts, choices)):
        engine.add_request(f"r{i}", prompt, params, lora=name)
    outputs = {}
    steps_with_mix = 0
    while engine.has_unfinished:
        running = {r.lora_slot for r in engine.scheduler.running}
        outputs.update({o.request_id: o for o in engine.step() if o.finished})
        steps_with_mix += len(running) > 2
    assert steps_with_mix, "the requests of different adapters never ran in the same step"
    assert pool > 8 or engine.preemptions, "the 8-block pool was meant to force a preemption"
    for i, (prompt, name) in enumerate(zip(prompts, choices)):
        expected = peft_greedy(peft_model, name, prompt, 10)
        assert outputs[f"r{i}"].output_token_ids == expected, (
            f"request r{i} with adapter {name}: engine {outputs[f'r{i}'].output_token_ids}, peft alone {expected}")
    differ = {name: peft_greedy(peft_model, name, prompts[0], 10) != peft_greedy(peft_model, None, prompts[0], 10)
              for name in ADAPTERS}
    assert all(differ.values()), f"an adapter that changes nothing proves nothing: {differ}"
    assert_engine_idle(engine)


def test_adapter_is_part_of_the_block_hash(impl, serve, tiny_model, adapters):
    _, folder = adapters
    engine = lora_engine(impl, serve, tiny_model, folder)
    prompt = list(range(40, 40 + 4 * BLOCK + 3))
    params = serve.request.SamplingParams(max_tokens=2)
    cached = {}
    for rid, name in (("first", "sql"), ("other", "poet"), ("base", None), ("same", "sql")):
        engine.add_request(rid, prompt, params, lora=name)
        while engine.has_unfinished:
            for out in engine.step():
                if out.finished:
                    cached[rid] = out.num_cached_tokens
    assert cached["other"] == 0, f"adapter 'poet' reused {cached['other']} tokens of adapter 'sql''s K/V"
    assert cached["base"] == 0, f"the base model reused {cached['base']} tokens of adapter 'sql''s K/V"
    assert cached["same"] == 4 * BLOCK, f"the same adapter should reuse 4 full blocks, reused {cached['same']} tokens"


def test_max_loras_caps_the_adapters_of_a_step(impl, serve, tiny_model, adapters):
    _, folder = adapters
    engine = lora_engine(impl, serve, tiny_model, folder, max_loras=2)
    params = serve.request.SamplingParams(max_tokens=4)
    for i, name in enumerate(["sql", "poet", "math", None, "sql"]):
        engine.add_request(f"r{i}", [10 + i] * 5, params, lora=name)
    seen = []
    while engine.has_unfinished:
        engine.step()
        plan = engine.last_plan
        seen.append({r.request_id for r, _ in plan.scheduled})
        slots = {r.lora_slot for r, _ in plan.scheduled} - {0}
        assert len(slots) <= 2, f"step {len(seen)} ran {len(slots)} adapters with max_loras=2: {sorted(seen[-1])}"
    assert "r2" not in seen[0], "the third adapter ('math') was admitted although two adapters were running"
    assert_engine_idle(engine)


def test_bad_adapter_requests_are_refused_and_change_nothing(impl, serve, tiny_model, adapters):
    _, folder = adapters
    engine = lora_engine(impl, serve, tiny_model, folder, names=("sql",))
    with pytest.raises(ValueError, match="poet"):
        engine.add_request("r0", [1, 2, 3], lora="poet")
    plain = make_engine(serve, tiny_model, block_size=BLOCK, num_blocks=16)
    with pytest.raises(ValueError, match="AdapterBank"):
        plain.add_request("r0", [1, 2, 3], lora="sql")
    assert not engine.scheduler.requests and not plain.scheduler.requests, "a refused request was queued"


def test_peft_settings_this_engine_does_not_compute_are_refused(impl, adapters, tmp_path):
    """DoRA, rsLoRA and trained biases change the arithmetic: serving them as plain LoRA
    would be silently wrong, so loading refuses them, naming the setting."""
    import json
    import shutil
    lora = impl.load("serve.lora")
    _, folder = adapters
    for setting, value in (("use_dora", True), ("use_rslora", True), ("bias", "all")):
        copy = tmp_path / setting
        shutil.copytree(folder / "sql", copy)
        config = json.loads((copy / "adapter_config.json").read_text())
        config[setting] = value
        (copy / "adapter_config.json").write_text(json.dumps(config))
        with pytest.raises(ValueError, match=setting):
            lora.load_peft_adapter(copy)
    loaded = lora.load_peft_adapter(folder / "poet")
    assert (loaded.rank, loaded.alpha) == (2, 16) and len(loaded.weights) == 3 * 2, (
        f"adapter 'poet' (rank 2, alpha 16, 3 targets x 2 layers) loaded as rank {loaded.rank}, alpha "
        f"{loaded.alpha}, {len(loaded.weights)} projections")


def test_the_http_server_selects_an_adapter_by_model_name(impl, tiny_model, adapters):
    """As with vLLM, a client names a served adapter as its `model`; the answer is that
    adapter's, and GET /v1/models lists it beside the base model."""
    httpx = pytest.importorskip("httpx")
    peft_model, folder = adapters
    serve = type("serve", (), {"engine": impl.load("serve.engine"), "config": impl.load("serve.config")})
    engine = lora_engine(impl, serve, tiny_model, folder, names=("poet",))
    text, app_module = impl.load("server.text"), impl.load("server.app")
    tokenizer = text.ByteChatTokenizer(impl.tokenizer.ByteTokenizer(tiny_model.cfg.vocab_size))
    served = app_module.ServedModel("tiny", tokenizer, lambda: text.DiffDetokenizer(tokenizer), adapters=("poet",))
    prompt = [72, 101, 108, 108, 111, 33]
    app = app_module.build_app(engine, served)
    with app_module.serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=60) as client:
        listed = [m["id"] for m in client.get("/v1/models").json()["data"]]
        answers = {name: client.post("/v1/completions", json={"model": name, "prompt": prompt, "max_tokens": 6,
                                                             "temperature": 0, "return_token_ids": True}).json()
                   for name in ("tiny", "poet")}
    assert listed == ["tiny", "poet"], f"GET /v1/models lists {listed}"
    for name, adapter in (("tiny", None), ("poet", "poet")):
        got = answers[name]["choices"][0].get("token_ids")
        assert got == peft_greedy(peft_model, adapter, prompt, 6), f"model {name!r}: {answers[name]}"
    assert answers["tiny"]["choices"][0]["token_ids"] != answers["poet"]["choices"][0]["token_ids"], (
        "adapter 'poet' answered like the base model: the test prompt proves nothing")


# --- images --------------------------------------------------------------------------------------

IMAGE = 300                  # the placeholder id (the tiny vocabulary's prompts use ids below 256)
SECTIONS = (4, 2, 2)         # frequency pairs of the T, H, W axes (head_dim 16: 8 pairs)
MERGE = 2                    # the encoder merges 2 x 2 patches into one image token
PATCH = 4                    # pixels per patch side: an image token covers 8 x 8 pixels
VISION = {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "patch_size": PATCH,
          "spatial_merge_size": MERGE, "temporal_patch_size": 2, "num_position_embeddings": 16,
          "deepstack_visual_indexes": []}


@pytest.fixture(scope="module")
def qwen3_vl():
    """transformers' Qwen3VLForConditionalGeneration (eager attention, no DeepStack) whose language
    model holds the tiny Qwen3's weights (clear greedy margins) and whose vision tower holds
    deterministic weights of unit-scale activations (transformers' own 0.02 initialisation
    would make every image look alike); and an image processor that patchifies without resizing."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    tiny = transformers_twin()
    cfg = SimpleNamespace(**models.tiny_config_values())
    text = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
                num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps,
                max_position_embeddings=1024, tie_word_embeddings=False,
                rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta,
                                 "mrope_section": list(SECTIONS), "mrope_interleaved": True})
    config = transformers.Qwen3VLConfig(text_config=text, vision_config={**VISION, "out_hidden_size": cfg.hidden_size},
                                        image_token_id=IMAGE, tie_word_embeddings=False)
    config.text_config._attn_implementation = "eager"
    config.vision_config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.Qwen3VLForConditionalGeneration(config).eval()
    weights = {f"model.language_model.{k[len('model.'):]}": v for k, v in tiny.state_dict().items()
               if k.startswith("model.")}
    weights["lm_head.weight"] = tiny.lm_head.weight
    with torch.no_grad():
        for name, param in model.model.visual.named_parameters():
            weights[f"model.visual.{name}"] = models.deterministic_tensor(f"visual.{name}", tuple(param.shape))
    model.load_state_dict(weights)
    processor = Qwen2VLImageProcessorPil(patch_size=PATCH, merge_size=MERGE, temporal_patch_size=2,
                                         do_resize=False, do_rescale=False, do_normalize=False)
    return model, processor


def pixel_values(qwen3_vl, pictures):
    """The image processor's flattened patches [N, C * 2 * 4 * 4] and grids [(1, h, w)] in patches."""
    out = qwen3_vl[1](images=list(pictures), return_tensors="pt", input_data_format="channels_first")
    return out["pixel_values"], out["image_grid_thw"]


def our_vl_model(impl, qwen3_vl, device="cpu"):
    """The implementation's VisionEncoder and Qwen3ForCausalLM, built with other random weights,
    then filled from transformers' state dict by load_qwen3_vl."""
    vision = impl.load("serve.vision")
    hf_model = qwen3_vl[0]
    encoder = vision.VisionEncoder(vision.VisionConfig.from_dict(hf_model.config.vision_config.to_dict()))
    model = models.tiny_qwen3(impl.package, seed=7)
    vision.load_qwen3_vl(hf_model.state_dict(), encoder, model)
    return encoder.eval().to(device), model.to(device)


def rope_index(hf_model, prompt, grids):
    """transformers' positions [3, T] and delta for one prompt; grids are in image tokens."""
    ids = torch.tensor([prompt])
    thw = torch.tensor([[1, rows * MERGE, cols * MERGE] for rows, cols in grids])
    positions, delta = hf_model.model.get_rope_index(ids, (ids == IMAGE).int(), image_grid_thw=thw)
    return positions[:, 0], int(delta)


PROMPTS = {      # name -> (prompt, grids of image tokens)
    "image first": ([IMAGE] * 6 + [5, 6, 7], [(2, 3)]),
    "image in the middle": ([5, 6, 7] + [IMAGE] * 6 + [8, 9], [(3, 2)]),
    "two images": ([4] + [IMAGE] * 4 + [7] + [IMAGE] + [9, 9], [(2, 2), (1, 1)]),
    "wide image, text last": ([1, 2] + [IMAGE] * 8 + [3, 4, 5, 6], [(2, 4)]),
    "no image": ([3, 1, 4, 1, 5], []),
}


@pytest.mark.parametrize("case", list(PROMPTS))
def test_mrope_positions_match_qwen3_vl(impl, qwen3_vl, case):
    vision = impl.load("serve.vision")
    prompt, grids = PROMPTS[case]
    expected, expected_delta = rope_index(qwen3_vl[0], prompt, grids)
    table, delta = vision.mrope_positions(prompt, IMAGE, grids)
    assert torch.equal(table, expected), f"{case}: positions\n{table}\nexpected (transformers)\n{expected}"
    assert delta == expected_delta, f"{case}: delta {delta}, transformers says {expected_delta}"


def test_mrope_tables_match_qwen3_vl_rotary(impl, qwen3_vl):
    vision = impl.load("serve.vision")
    positions, _ = rope_index(qwen3_vl[0], *PROMPTS["wide image, text last"])
    rotary = qwen3_vl[0].model.language_model.rotary_emb
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), positions[:, None])
    ours_cos, ours_sin = vision.mrope_cos_sin(positions, 16, 10000.0, SECTIONS, torch.float32)
    torch.testing.assert_close(ours_cos[:, 0], cos[0], msg="M-RoPE cos tables differ from Qwen3-VL's")
    torch.testing.assert_close(ours_sin[:, 0], sin[0], msg="M-RoPE sin tables differ from Qwen3-VL's")


def images(seed, *sizes):
    g = torch.Generator().manual_seed(seed)
    return [torch.rand(3, h, w, generator=g) for h, w in sizes]


@pytest.mark.parametrize("rows, cols", [(2, 2), (4, 6), (6, 2), (8, 8)])
def test_patch_order_matches_transformers(impl, rows, cols):
    """The patches of a rows x cols grid come square by square, as Qwen-VL's processor lays them out."""
    from transformers.vision_utils import get_vision_position_ids
    vision = impl.load("serve.vision")
    got = vision.patch_positions(rows, cols, MERGE)
    expected = get_vision_position_ids(torch.tensor([[1, rows, cols]]), MERGE)
    assert torch.equal(got, expected), (f"patch_positions({rows}, {cols}, {MERGE}) starts {got[:6].tolist()}, "
                                        f"transformers' order starts {expected[:6].tolist()}")


def test_encoder_matches_qwen3_vl_image_features(impl, qwen3_vl):
    """Same weights, same pixel_values: our encoder's image tokens equal transformers'
    get_image_features, for grids smaller than, equal to and larger than the 4 x 4 position table."""
    encoder, _ = our_vl_model(impl, qwen3_vl)
    pictures = images(4, (16, 16), (32, 32), (16, 48), (40, 24))
    values, grids = pixel_values(qwen3_vl, pictures)
    with torch.inference_mode():
        expected = qwen3_vl[0].model.get_image_features(values, grids).pooler_output
    start = 0
    for picture, (_, rows, cols), want in zip(pictures, grids.tolist(), expected):
        patches = values[start:start + rows * cols]
        start += rows * cols
        assert torch.equal(encoder.patchify(picture), patches), (
            f"patchify of a {tuple(picture.shape)} image differs from the image processor's pixel_values")
        got = encoder(patches, rows, cols)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5,
                                   msg=lambda m, r=rows, c=cols: f"image tokens of a {r} x {c} patch grid: {m}")


def test_loading_refuses_weights_that_do_not_fit(impl, qwen3_vl):
    vision = impl.load("serve.vision")
    encoder, model = our_vl_model(impl, qwen3_vl)
    weights = dict(qwen3_vl[0].state_dict())
    del weights["model.visual.merger.linear_fc1.bias"]
    with pytest.raises(ValueError, match="merger.linear_fc1.bias"):
        vision.load_qwen3_vl(weights, encoder, model)
    with pytest.raises(ValueError, match="deepstack"):
        vision.VisionConfig.from_dict({**VISION, "out_hidden_size": 64, "deepstack_visual_indexes": [0]})


def vision_engine(impl, serve, qwen3_vl, device="cpu", **config):
    vision = impl.load("serve.vision")
    encoder, model = our_vl_model(impl, qwen3_vl, device)
    return make_engine(serve, model, vision=vision.VisionInputs(encoder, IMAGE, SECTIONS),
                       **{"block_size": BLOCK, "num_blocks": 96, **config})


@torch.inference_mode()
def qwen3_vl_logits(qwen3_vl, tokens, pictures):
    """Qwen3VLForConditionalGeneration's logits [T, vocab] for a sequence with its images."""
    ids = torch.tensor([tokens])
    inputs = {"mm_token_type_ids": (ids == IMAGE).int()}
    if pictures:
        inputs["pixel_values"], inputs["image_grid_thw"] = pixel_values(qwen3_vl, pictures)
    return qwen3_vl[0](input_ids=ids, **inputs).logits[0]


_QWEN3_VL_RUNS: dict = {}


def qwen3_vl_greedy(qwen3_vl, prompt, pictures, max_new):
    """Greedy tokens by full recompute through transformers' whole model (positions from its
    own get_rope_index), stopping at the tiny model's EOS. Cached: three tests ask the same.
    transformers cannot continue a sequence whose generated token is the placeholder id (it
    takes it for an image token): these weights never generate it, but about one vision seed
    in nine does, so keep the seed when changing the vision weights."""
    key = (id(qwen3_vl[0]), tuple(prompt), tuple(image_key(p) for p in pictures), max_new)
    if key not in _QWEN3_VL_RUNS:
        _QWEN3_VL_RUNS[key] = qwen3_vl[0], _qwen3_vl_greedy(qwen3_vl, prompt, pictures, max_new)
    return list(_QWEN3_VL_RUNS[key][1])


def image_key(picture):
    return tuple(picture.shape), picture.numpy().tobytes()


def _qwen3_vl_greedy(qwen3_vl, prompt, pictures, max_new):
    tokens = list(prompt)
    for _ in range(max_new):
        tokens.append(int(qwen3_vl_logits(qwen3_vl, tokens, pictures)[-1].argmax()))
        if tokens[-1] == TINY_EOS:
            break
    return tokens[len(prompt):]


REQUESTS = {    # request id -> (prompt case, images); two shapes beyond the 4 x 4 position table
    "middle": ("image in the middle", ((24, 16),)),
    "text": ("no image", ()),
    "two": ("two images", ((16, 16), (8, 8))),
    "wide": ("wide image, text last", ((16, 32),)),
}


def add_image_requests(serve, engine, **params):
    for seed, (rid, (case, sizes)) in enumerate(REQUESTS.items()):
        pictures = images(seed, *sizes)
        engine.add_request(rid, PROMPTS[case][0], serve.request.SamplingParams(**params),
                           features={"images": pictures} if pictures else None)


def test_prompt_logits_match_qwen3_vl(impl, serve, qwen3_vl, device):
    """Image and text prompts prefilled together in 5-token chunks: the log-probabilities the
    engine reports at every prompt position equal Qwen3VLForConditionalGeneration's forward
    with the same pixels."""
    engine = vision_engine(impl, serve, qwen3_vl, device, max_num_batched_tokens=5, sampler="full")
    add_image_requests(serve, engine, max_tokens=1, prompt_logprobs=3)
    outputs = {}
    while engine.has_unfinished:
        outputs.update({o.request_id: o for o in engine.step() if o.finished})
    for seed, (rid, (case, sizes)) in enumerate(REQUESTS.items()):
        prompt = PROMPTS[case][0]
        expected = torch.log_softmax(qwen3_vl_logits(qwen3_vl, prompt, images(seed, *sizes)), dim=-1)
        for position, got in enumerate(outputs[rid].prompt_logprobs[1:], start=1):
            ids = [got.token_id, *got.top_token_ids]
            want = expected[position - 1, ids]
            mine = torch.tensor([got.logprob, *got.top_logprobs])
            assert torch.allclose(mine, want, atol=1e-4), (
                f"request {rid!r}, prompt position {position}: engine logprobs {mine.tolist()} of tokens {ids}, "
                f"Qwen3-VL {want.tolist()}")
    case, sizes = REQUESTS["middle"]
    other = qwen3_vl_logits(qwen3_vl, PROMPTS[case][0], images(99, *sizes))[-1]
    same = qwen3_vl_logits(qwen3_vl, PROMPTS[case][0], images(0, *sizes))[-1]
    assert (other - same).abs().max() > 0.1, "another picture hardly changes the logits: the test proves little"
    assert_engine_idle(engine)


@pytest.mark.parametrize("squeeze", ["chunks through images", "preempted, recomputed", "preempted, swapped"])
def test_image_and_text_requests_in_one_batch_match_qwen3_vl(impl, serve, qwen3_vl, device, squeeze):
    """Image and text requests share steps; a small token budget makes prefill chunks cut
    through images, a small pool preempts requests (their image rows must come back). Every
    request's greedy tokens equal transformers' whole Qwen3-VL run alone."""
    config = {"chunks through images": {"max_num_batched_tokens": 7},
              "preempted, recomputed": {"num_blocks": 7},
              "preempted, swapped": {"num_blocks": 7, "preemption_mode": "swap"}}[squeeze]
    engine = vision_engine(impl, serve, qwen3_vl, device, **config)
    add_image_requests(serve, engine, max_tokens=8)
    outputs = {}
    while engine.has_unfinished:
        outputs.update({o.request_id: o.output_token_ids for o in engine.step() if o.finished})
    if "preempted" in squeeze:
        assert engine.preemptions, f"{squeeze}: the 7-block pool was meant to force a preemption"
    for seed, (rid, (case, sizes)) in enumerate(REQUESTS.items()):
        expected = qwen3_vl_greedy(qwen3_vl, PROMPTS[case][0], images(seed, *sizes), 8)
        assert outputs[rid] == expected, f"request {rid!r}: engine {outputs[rid]}, Qwen3-VL alone {expected}"
    assert_engine_idle(engine)


def test_images_are_part_of_the_block_hash(impl, serve, qwen3_vl):
    engine = vision_engine(impl, serve, qwen3_vl)
    prompt = [IMAGE] * 4 + list(range(20, 20 + 3 * BLOCK))
    params = serve.request.SamplingParams(max_tokens=2)
    cached = {}
    for rid, seed in (("cat", 1), ("dog", 2), ("cat again", 1)):
        engine.add_request(rid, prompt, params, features={"images": images(seed, (16, 16))})
        while engine.has_unfinished:
            cached.update({o.request_id: o.num_cached_tokens for o in engine.step() if o.finished})
    assert cached["dog"] == 0, f"a different image reused {cached['dog']} tokens of K/V computed for another image"
    full = (len(prompt) // BLOCK) * BLOCK
    assert cached["cat again"] == full, f"the same image should reuse {full} tokens, reused {cached['cat again']}"


def test_bad_image_requests_are_refused_and_change_nothing(impl, serve, qwen3_vl):
    engine = vision_engine(impl, serve, qwen3_vl)
    cases = {"too few placeholders": ([IMAGE] * 3 + [1], images(0, (16, 16)), "runs"),
             "side not a multiple of 8": ([IMAGE] * 4, images(0, (16, 12)), "multiple"),
             "no images": ([1, 2], [], "empty")}
    for name, (prompt, pictures, words) in cases.items():
        with pytest.raises(ValueError, match=words):
            engine.add_request(name, prompt, features={"images": pictures})
    assert not engine.scheduler.requests, "a refused image request was queued"
