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


@torch.inference_mode()
def peft_greedy(peft_model, adapter, prompt, max_new):
    """Greedy tokens of the base model with `adapter` alone (None: the base model), by full
    recompute, stopping at the tiny model's EOS."""
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

def test_many_adapters_in_one_batch_match_peft_alone(impl, serve, tiny_model, adapters):
    """Base and three adapters, interleaved, in the same steps: each request's greedy tokens
    equal peft's with that adapter alone."""
    peft_model, folder = adapters
    engine = lora_engine(impl, serve, tiny_model, folder)
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
