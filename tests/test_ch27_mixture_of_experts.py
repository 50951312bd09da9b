"""Chapter 27 milestone: Qwen3-MoE matches transformers' Qwen3MoeForCausalLM on the same weights.

Oracles: transformers 5's own Qwen3-MoE (its router module, its sparse block, the whole
model's logits and its greedy `generate`), which stores each layer's experts fused into
3-D tensors; this file converts our per-expert weights to that layout with its own few
lines, so the oracle never depends on the code under test. Router margins of the test
inputs are far above float rounding (the tiny MoE's router weights are scaled up for that),
so both implementations pick the same experts and greedy parity is deterministic.
"""
import pytest
import torch

from course.models.moe import hf_config_values, tiny_moe_config, tiny_qwen3_moe
from course.testing.milestone_helpers import prompt_ids

transformers = pytest.importorskip("transformers")
from transformers import Qwen3MoeConfig as HFConfig  # noqa: E402
from transformers import Qwen3MoeForCausalLM as HFModel  # noqa: E402
from transformers.models.qwen3_moe import modeling_qwen3_moe as hf_moe  # noqa: E402

pytestmark = pytest.mark.chapter(27)

VARIANTS = {
    "top-2 of 8, renormalised": {},
    "top-3 of 8, not renormalised": dict(num_experts_per_tok=3, norm_topk_prob=False),
    "dense first layer, 3 layers": dict(num_hidden_layers=3, mlp_only_layers=[0]),
    "every second layer sparse": dict(num_hidden_layers=4, decoder_sparse_step=2),
}


def to_transformers(state_dict):
    """Our per-expert names -> transformers 5's fused experts, written independently here."""
    out, experts = {}, {}
    for name, tensor in state_dict.items():
        if ".mlp.experts." in name:
            layer_prefix, rest = name.split(".mlp.experts.")
            index, proj, _ = rest.split(".")
            experts.setdefault(layer_prefix, {})[(int(index), proj)] = tensor
        else:
            out[name] = tensor
    for layer_prefix, parts in experts.items():
        count = 1 + max(i for i, _ in parts)
        out[f"{layer_prefix}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([parts[(e, "gate_proj")], parts[(e, "up_proj")]], dim=0) for e in range(count)])
        out[f"{layer_prefix}.mlp.experts.down_proj"] = torch.stack([parts[(e, "down_proj")] for e in range(count)])
    return out


def hf_twin(model, device):
    hf = HFModel(HFConfig(**hf_config_values(model.cfg)))
    hf.load_state_dict(to_transformers(model.state_dict()), strict=True)
    return hf.to(device).eval()


@pytest.fixture(params=sorted(VARIANTS))
def pair(request, impl, device):
    name = request.param
    ours = tiny_qwen3_moe(impl.package, device=device, **VARIANTS[name])
    return name, ours, hf_twin(ours, device)


def test_config_reads_hugging_face_fields(impl):
    values = dict(hf_config_values(tiny_moe_config(impl.package)))
    values.pop("num_experts")
    values["num_local_experts"] = 6                  # the name some configs and older code use
    cfg = impl.moe.Qwen3MoeConfig.from_dict({**values, "model_type": "qwen3_moe", "router_aux_loss_coef": 0.001})
    assert cfg.num_experts == 6 and cfg.moe_intermediate_size == 32 and cfg.num_experts_per_tok == 2
    assert cfg.rope_theta == 10000.0, "rope_theta nested in rope_parameters should be read"


@pytest.mark.parametrize("top_k, renormalise", [(2, True), (3, False)])
def test_router_matches_transformers(impl, device, top_k, renormalise):
    ours = tiny_qwen3_moe(impl.package, device=device, num_experts_per_tok=top_k,
                          norm_topk_prob=renormalise).model.layers[0].mlp
    router = hf_moe.Qwen3MoeTopKRouter(HFConfig(**hf_config_values(
        tiny_moe_config(impl.package, num_experts_per_tok=top_k, norm_topk_prob=renormalise))))
    router.weight.data.copy_(ours.gate.weight.detach().cpu())
    x = torch.randn(40, 64, generator=torch.Generator().manual_seed(0))
    _, hf_weights, hf_experts = router(x)
    weights, experts = ours.route(x.to(device))
    assert tuple(experts.shape) == (40, top_k), f"route should return [N, top_k] experts, got {tuple(experts.shape)}"
    assert torch.equal(experts.cpu(), hf_experts), "rows routed to different experts than transformers' router"
    torch.testing.assert_close(weights.cpu(), hf_weights, msg="routing weights differ from transformers'")
    if renormalise:
        torch.testing.assert_close(weights.sum(-1).cpu(), torch.ones(40), msg="renormalised weights sum to 1")


def test_sparse_block_matches_transformers_on_any_shape(impl, pair, device):
    name, ours, hf = pair
    for i, layer in enumerate(ours.model.layers):
        if not isinstance(layer.mlp, impl.moe.Qwen3MoeSparseMoeBlock):
            continue
        x = torch.randn(3, 7, 64, generator=torch.Generator().manual_seed(i)).to(device)
        with torch.no_grad():
            expected = hf.model.layers[i].mlp(x)
            got = layer.mlp(x)
            flat = layer.mlp(x.reshape(21, 64))
        assert got.shape == x.shape, f"{name}, layer {i}: output shape {tuple(got.shape)}, input {tuple(x.shape)}"
        rule = "each row's output is the routing-weighted sum of its chosen experts' outputs"
        torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4,
                                   msg=f"{name}, layer {i}: [B, T, D] input: {rule}")
        assert flat.shape == (21, 64), "flat [N, D] rows (Chapter 31's layout) must come back as [N, D]"
        torch.testing.assert_close(flat, got.reshape(21, 64), atol=1e-6, rtol=1e-5,
                                   msg=f"{name}, layer {i}: [N, D] rows must give the same result")


def test_each_chosen_expert_runs_once_per_call(impl, device):
    model = tiny_qwen3_moe(impl.package, device=device)
    block = model.model.layers[0].mlp
    calls = [0] * len(block.experts)
    hooks = [expert.register_forward_hook(lambda m, a, o, e=e: calls.__setitem__(e, calls[e] + 1))
             for e, expert in enumerate(block.experts)]
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(3)).to(device)
    try:
        with torch.no_grad():
            _, experts = block.route(x)
            block(x)
    finally:
        for h in hooks:
            h.remove()
    chosen = set(experts.flatten().tolist())
    expected = [1 if e in chosen else 0 for e in range(len(calls))]
    assert calls == expected, (f"expert calls per forward {calls}, expected {expected}: run each chosen expert "
                               f"once on all its rows, and never an expert no row chose")


def test_state_dict_loads_both_ways(impl, pair):
    name, ours, hf = pair
    theirs = hf.state_dict()
    fresh = impl.moe.Qwen3MoeForCausalLM(ours.cfg)
    fresh.load_state_dict(theirs, strict=True)         # fused expert tensors accepted directly
    for key, value in ours.state_dict().items():
        assert torch.equal(fresh.state_dict()[key].cpu(), value.cpu()), f"{name}: {key} changed on the round trip"
    fused = impl.moe.fuse_experts(ours.state_dict())
    assert set(fused) == set(theirs), f"{name}: fuse_experts names differ: {sorted(set(fused) ^ set(theirs))[:6]}"
    for key in theirs:
        assert torch.equal(fused[key].cpu(), theirs[key].cpu()), f"{name}: fuse_experts gives a different {key}"
    split = impl.moe.split_experts(theirs)
    assert set(split) == set(ours.state_dict()), f"{name}: split_experts names differ"


def test_logits_match_transformers(pair, device):
    name, ours, hf = pair
    ids = torch.tensor([prompt_ids(23, 1), prompt_ids(23, 2)], device=device)
    with torch.no_grad():
        expected = hf(ids).logits.float()
        got = ours(ids)
    worst = (got - expected).abs().max().item()
    assert worst < 1e-3, f"{name}: logits differ from transformers' by up to {worst:.2e}"


def test_greedy_generate_matches_transformers(impl, pair, device):
    name, ours, hf = pair
    for length in (1, 9, 30):
        p = prompt_ids(length, seed=length + 50)
        ids = torch.tensor([p], device=device)
        expected = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                               eos_token_id=None, pad_token_id=0)[0, length:].tolist()
        got = impl.sampling.generate(ours, p, 12)
        assert got == expected, f"{name}, prompt of {length} tokens: ours {got}, transformers {expected}"


def test_expert_load_counts_every_choice(impl, device):
    model = tiny_qwen3_moe(impl.package, device=device)
    ids = torch.tensor([prompt_ids(30, 4), prompt_ids(30, 5)], device=device)
    load = impl.moe.expert_load(model, ids)
    hf = hf_twin(model, device)
    with torch.no_grad():
        router_logits = hf(ids, output_router_logits=True).router_logits
    assert sorted(load) == list(range(len(router_logits))), f"load reported for layers {sorted(load)}"
    for i, logits in enumerate(router_logits):
        chosen = logits.float().softmax(-1).topk(2, dim=-1).indices
        expected = torch.bincount(chosen.flatten().cpu(), minlength=8)
        assert torch.equal(load[i].cpu(), expected), (
            f"layer {i}: expert load {load[i].tolist()}, expected {expected.tolist()}")
        assert int(load[i].sum()) == 60 * 2
    again = impl.moe.expert_load(model, ids)
    assert all(torch.equal(again[i], load[i]) for i in load), "measuring must not change the model"
