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
reads exactly what a learner's trained adapter would look like. The models and oracles live in
course/testing/adapters_and_images.py (the feature-pair tests use them too).
"""
import pytest
import torch

from course.testing.adapters_and_images import (
    ADAPTERS,
    BLOCK,
    IMAGE,
    MERGE,
    PROMPTS,
    REQUESTS,
    SECTIONS,
    VISION,
    add_image_requests,
    images,
    lora_engine,
    our_vl_model,
    peft_adapters,
    peft_greedy,
    pixel_values,
    qwen3_vl_greedy,
    qwen3_vl_logits,
    qwen3_vl_model,
    vision_engine,
)
from course.testing.oracles import assert_engine_idle, make_engine

pytestmark = pytest.mark.chapter(43)

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """A PeftModel holding the three random adapters, and the folder they were saved to."""
    folder = tmp_path_factory.mktemp("adapters")
    return peft_adapters(folder), folder


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
        torch.testing.assert_close(shrunk[i], t,
                                   msg=f"lora_shrink row {i} (slot {slot}): t[i] = lora_a[slots[i]] @ x[i]")
        torch.testing.assert_close(out[i], base[i] + scaling[slot] * (lora_b[slot] @ t),
                                   msg=f"lora_expand row {i} (slot {slot}): out[i] = base[i] + scaling[slots[i]] * "
                                       f"(lora_b[slots[i]] @ shrunk[i])")
    assert torch.equal(out[slots == 0], base[slots == 0]), "rows of slot 0 (no adapter) must keep the base output"
    try:                            # the bank stays float32; a bfloat16 model's rows come and go in bfloat16
        half = lora.lora_shrink(x.bfloat16(), lora_a, slots)
        assert half.dtype == torch.bfloat16, f"lora_shrink returns t in x's dtype: bfloat16, got {half.dtype}"
        mixed = lora.lora_expand(base.bfloat16(), half, lora_b, scaling, slots)
        assert mixed.dtype == torch.bfloat16, f"lora_expand returns base's dtype: bfloat16, got {mixed.dtype}"
    except RuntimeError as error:
        pytest.fail(f"bfloat16 rows with a float32 bank raised {error}: the results are in x's (shrink) and base's "
                    f"(expand) dtype, the bank's matrices cast to it")


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
            f"request r{i} with adapter {name}: engine {outputs[f'r{i}'].output_token_ids}, peft alone {expected}: "
            f"every row of a request (each of its n rows in the step) carries its request's adapter slot")
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

@pytest.fixture(scope="module")
def qwen3_vl():
    """transformers' tiny Qwen3-VL and its image processor (course.testing.adapters_and_images)."""
    return qwen3_vl_model()


def rope_index(hf_model, prompt, grids):
    """transformers' positions [3, T] and delta for one prompt; grids are in image tokens."""
    ids = torch.tensor([prompt])
    thw = torch.tensor([[1, rows * MERGE, cols * MERGE] for rows, cols in grids])
    positions, delta = hf_model.model.get_rope_index(ids, (ids == IMAGE).int(), image_grid_thw=thw)
    return positions[:, 0], int(delta)


@pytest.mark.parametrize("case", list(PROMPTS))
def test_mrope_positions_match_qwen3_vl(impl, qwen3_vl, case):
    vision = impl.load("serve.vision")
    prompt, grids = PROMPTS[case]
    expected, expected_delta = rope_index(qwen3_vl[0], prompt, grids)
    table, delta = vision.mrope_positions(prompt, IMAGE, grids)
    assert torch.equal(table, expected), (
        f"{case}: positions\n{table}\nexpected (transformers)\n{expected}\ntext tokens get (p, p, p); image k, "
        f"starting when the counter is s, gives its token (row, col), in row-major order, (s, s + row, s + col), "
        f"and afterwards the counter is s + max(rows, cols)")
    assert delta == expected_delta, \
        f"{case}: delta {delta}, transformers says {expected_delta}: delta = table.max() + 1 - len(prompt)"


def test_mrope_tables_match_qwen3_vl_rotary(impl, qwen3_vl):
    vision = impl.load("serve.vision")
    positions, _ = rope_index(qwen3_vl[0], *PROMPTS["wide image, text last"])
    rotary = qwen3_vl[0].model.language_model.rotary_emb
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), positions[:, None])
    ours_cos, ours_sin = vision.mrope_cos_sin(positions, 16, 10000.0, SECTIONS, torch.float32)
    torch.testing.assert_close(ours_cos[:, 0], cos[0], msg="M-RoPE cos tables differ from Qwen3-VL's")
    torch.testing.assert_close(ours_sin[:, 0], sin[0], msg="M-RoPE sin tables differ from Qwen3-VL's")


@pytest.mark.parametrize("rows, cols", [(2, 2), (4, 6), (6, 2), (8, 8)])
def test_patch_order_matches_transformers(impl, rows, cols):
    """The patches of a rows x cols grid come square by square, as Qwen-VL's processor lays them out."""
    from transformers.vision_utils import get_vision_position_ids
    vision = impl.load("serve.vision")
    got = vision.patch_positions(rows, cols, MERGE)
    expected = get_vision_position_ids(torch.tensor([[1, rows, cols]]), MERGE)
    assert torch.equal(got, expected), (f"patch_positions({rows}, {cols}, {MERGE}) starts {got[:6].tolist()}, "
                                        f"transformers' order starts {expected[:6].tolist()}: (row, col) pairs, "
                                        f"merge x merge squares in row-major order of the squares, each square's "
                                        f"patches in row-major order")


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


IMAGE_ROWS_RULE = ("prepare_features places exactly the image rows whose positions fall in this step's [c, c + n), "
                   "and after the prompt the positions are p + mrope_delta on all three axes")


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
    try:
        while engine.has_unfinished:
            outputs.update({o.request_id: o.output_token_ids for o in engine.step() if o.finished})
    except (IndexError, RuntimeError) as error:
        pytest.fail(f"{squeeze}: a step raised {type(error).__name__} ({error}): {IMAGE_ROWS_RULE}")
    if "preempted" in squeeze:
        assert engine.preemptions, f"{squeeze}: the 7-block pool was meant to force a preemption"
    for seed, (rid, (case, sizes)) in enumerate(REQUESTS.items()):
        expected = qwen3_vl_greedy(qwen3_vl, PROMPTS[case][0], images(seed, *sizes), 8)
        assert outputs.get(rid) == expected, \
            f"request {rid!r}, {squeeze}: engine {outputs.get(rid)}, Qwen3-VL alone {expected}: {IMAGE_ROWS_RULE}"
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
