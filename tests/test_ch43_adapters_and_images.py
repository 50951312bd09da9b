"""Chapter 43 milestone: batched LoRA adapters and image inputs in the engine core.

Oracles: `peft` applying ONE adapter at a time to transformers' Qwen3ForCausalLM with the
tiny model's weights (greedy by full recompute), for the engine that serves several adapters
and the base model in one flattened batch; torch's own matmuls, row by row, for the batched
shrink and expand; transformers' Qwen3-VL (`Qwen3VLModel.get_rope_index` for the three-axis
positions, `Qwen3VLTextModel` given `inputs_embeds` and those positions for the logits) for
image requests. The adapters are random (peft's `init_lora_weights=False`) and saved with
`save_pretrained`, so the engine reads exactly what a learner's trained adapter would look like.
"""
import dataclasses

import pytest
import torch

from course import models
from course.oracles import TINY_EOS, assert_engine_idle, make_engine

pytestmark = pytest.mark.chapter(43)

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

BLOCK = 8
ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> (seed, rank, alpha, targets): different ranks, scalings and target sets in one bank.
ADAPTERS = {"sql": (1, 4, 8, ALL_TARGETS), "poet": (2, 2, 16, ["q_proj", "v_proj", "down_proj"]),
            "math": (3, 8, 8, ["k_proj", "o_proj", "gate_proj", "up_proj"])}


def transformers_twin(model):
    """transformers' Qwen3ForCausalLM with the tiny model's config and weights."""
    hcfg = transformers.Qwen3Config(**dataclasses.asdict(model.cfg), attn_implementation="eager")
    twin = transformers.Qwen3ForCausalLM(hcfg)
    twin.load_state_dict(model.state_dict(), strict=False)
    return twin.eval()


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """A PeftModel holding the three random adapters, and the folder they were saved to."""
    torch.manual_seed(0)
    base = transformers_twin(models.tiny_qwen3(__import__("course").reference().package))
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
    engine = make_engine(serve, model, **{"block_size": BLOCK, "num_blocks": 96, **config})
    bank = lora.AdapterBank(engine.runner.flat)
    for name in names:
        bank.add(lora.load_peft_adapter(folder / name))
    return engine


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
        running = {r.extra.get("lora_slot", 0) for r in engine.scheduler.running}
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
        slots = {r.extra.get("lora_slot", 0) for r, _ in plan.scheduled} - {0}
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


@pytest.fixture(scope="module")
def qwen3_vl():
    """transformers' Qwen3-VL: the whole model for get_rope_index, and its text model with the
    tiny Qwen3's weights (Qwen3-VL's language model is Qwen3 with three-axis RoPE)."""
    model = models.tiny_qwen3(__import__("course").reference().package)
    text = dict(vocab_size=model.cfg.vocab_size, hidden_size=model.cfg.hidden_size,
                intermediate_size=model.cfg.intermediate_size, num_hidden_layers=model.cfg.num_hidden_layers,
                num_attention_heads=model.cfg.num_attention_heads,
                num_key_value_heads=model.cfg.num_key_value_heads, head_dim=model.cfg.head_dim,
                rms_norm_eps=model.cfg.rms_norm_eps, max_position_embeddings=1024,
                rope_parameters={"rope_type": "default", "rope_theta": model.cfg.rope_theta,
                                 "mrope_section": list(SECTIONS), "mrope_interleaved": True})
    vision = {"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "patch_size": 4,
              "out_hidden_size": model.cfg.hidden_size, "spatial_merge_size": MERGE, "temporal_patch_size": 1,
              "num_position_embeddings": 16, "deepstack_visual_indexes": []}
    config = transformers.Qwen3VLConfig(text_config=text, vision_config=vision, image_token_id=IMAGE)
    config.text_config._attn_implementation = "eager"
    whole = transformers.Qwen3VLModel(config).eval()
    weights = {k[len("model."):]: v for k, v in model.state_dict().items() if k.startswith("model.")}
    whole.language_model.load_state_dict(weights)
    return whole, model.lm_head.weight.detach()


def rope_index(whole, prompt, grids):
    """transformers' positions [3, T] and delta for one prompt; grids are in image tokens."""
    ids = torch.tensor([prompt])
    thw = torch.tensor([[1, rows * MERGE, cols * MERGE] for rows, cols in grids])
    positions, delta = whole.get_rope_index(ids, (ids == IMAGE).int(), image_grid_thw=thw)
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
    rotary = qwen3_vl[0].language_model.rotary_emb
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), positions[:, None])
    ours_cos, ours_sin = vision.mrope_cos_sin(positions, 16, 10000.0, SECTIONS, torch.float32)
    torch.testing.assert_close(ours_cos[:, 0], cos[0], msg="M-RoPE cos tables differ from Qwen3-VL's")
    torch.testing.assert_close(ours_sin[:, 0], sin[0], msg="M-RoPE sin tables differ from Qwen3-VL's")


def vision_engine(impl, serve, model, **config):
    vision = impl.load("serve.vision")
    engine = make_engine(serve, model, **{"block_size": BLOCK, "num_blocks": 96, **config})
    torch.manual_seed(0)
    encoder = vision.VisionEncoder(vision.VisionConfig(out_hidden_size=model.cfg.hidden_size, merge_size=MERGE))
    vision.attach_vision(engine.runner.flat, encoder.eval(), IMAGE, SECTIONS)
    return engine, encoder


def images(seed, *sizes):
    g = torch.Generator().manual_seed(seed)
    return [torch.rand(3, h, w, generator=g) for h, w in sizes]


@torch.inference_mode()
def qwen3_vl_greedy(qwen3_vl, encoder, prompt, grids, pictures, max_new):
    """Greedy tokens by full recompute in transformers' text model: embeddings with the image
    rows put in, positions from get_rope_index, generated tokens at q + delta on all axes."""
    whole, lm_head = qwen3_vl
    table, delta = rope_index(whole, prompt, grids)
    rows = torch.cat([encoder(p) for p in pictures]) if pictures else None
    tokens = list(prompt)
    text = whole.language_model
    for _ in range(max_new):
        embeds = text.embed_tokens(torch.tensor([tokens]))
        if rows is not None:
            embeds[0, torch.tensor(tokens) == IMAGE] = rows
        later = (torch.arange(len(prompt), len(tokens)) + delta).expand(3, -1)
        positions = torch.cat([table, later], dim=1)[:, None]
        hidden = text(inputs_embeds=embeds, position_ids=positions).last_hidden_state[0, -1]
        tokens.append(int((hidden @ lm_head.T).argmax()))
        if tokens[-1] == TINY_EOS:
            break
    return tokens[len(prompt):]


@pytest.mark.parametrize("squeeze", ["chunks through images", "preempted, recomputed", "preempted, swapped"])
def test_image_and_text_requests_in_one_batch_match_qwen3_vl(impl, serve, tiny_model, qwen3_vl, squeeze):
    """Image and text requests share steps; a small token budget makes prefill chunks cut
    through images, a small pool preempts requests (their image rows must come back). Every
    request's greedy tokens equal transformers' run alone."""
    config = {"chunks through images": {"max_num_batched_tokens": 7},
              "preempted, recomputed": {"num_blocks": 7},
              "preempted, swapped": {"num_blocks": 7, "preemption_mode": "swap"}}[squeeze]
    engine, encoder = vision_engine(impl, serve, tiny_model, **config)
    requests = {
        "middle": (PROMPTS["image in the middle"], images(1, (24, 16))),
        "text": (PROMPTS["no image"], []),
        "two": (PROMPTS["two images"], images(2, (16, 16), (8, 8))),
        "wide": (PROMPTS["wide image, text last"], images(3, (16, 32))),
    }
    params = serve.request.SamplingParams(max_tokens=8)
    for rid, ((prompt, _), pictures) in requests.items():
        engine.add_request(rid, prompt, params, features={"images": pictures} if pictures else None)
    outputs = {}
    while engine.has_unfinished:
        outputs.update({o.request_id: o.output_token_ids for o in engine.step() if o.finished})
    if "preempted" in squeeze:
        assert engine.preemptions, f"{squeeze}: the 7-block pool was meant to force a preemption"
    for rid, ((prompt, grids), pictures) in requests.items():
        expected = qwen3_vl_greedy(qwen3_vl, encoder, prompt, grids, pictures, 8)
        assert outputs[rid] == expected, f"request {rid!r}: engine {outputs[rid]}, Qwen3-VL alone {expected}"
    assert_engine_idle(engine)


def test_images_are_part_of_the_block_hash(impl, serve, tiny_model):
    engine, _ = vision_engine(impl, serve, tiny_model)
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


def test_bad_image_requests_are_refused_and_change_nothing(impl, serve, tiny_model):
    engine, _ = vision_engine(impl, serve, tiny_model)
    cases = {"too few placeholders": ([IMAGE] * 3 + [1], images(0, (16, 16)), "runs"),
             "side not a multiple of 8": ([IMAGE] * 4, images(0, (16, 12)), "multiple"),
             "no images": ([1, 2], [], "empty")}
    for name, (prompt, pictures, words) in cases.items():
        with pytest.raises(ValueError, match=words):
            engine.add_request(name, prompt, features={"images": pictures})
    assert not engine.scheduler.requests, "a refused image request was queued"
