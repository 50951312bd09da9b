"""The tiny Qwen3-MoE test model (Chapter 27), built like course.models' tiny Qwen3.

Weights come from course.models.deterministic_tensor, a pure function of (seed, parameter
name, shape), so the reference package, a learner's package and transformers all get the
same tensors. Router weights are drawn larger than other projections so that the routing
choices of the test prompts have clear margins: a float-rounding difference between two
implementations must never swap which experts a token goes to.
"""
import importlib

import torch

from course.models import TINY_SEED, deterministic_tensor, tiny_config

# Attention and dense parts are the tiny Qwen3's; the MoE fields are scaled down from
# Qwen3-30B-A3B (128 experts, 8 per token, norm_topk_prob true).
MOE_FIELDS = dict(moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                  decoder_sparse_step=1, mlp_only_layers=[])
ROUTER_GAIN = 4.0


def _moe(package):
    return importlib.import_module(package.__name__ + ".moe")


def tiny_moe_config(package, **overrides):
    """A 2-layer Qwen3-MoE config of `package` (8 experts, top-2)."""
    base = vars(tiny_config(package)).copy()
    base.update(MOE_FIELDS)
    base.update(overrides)
    return _moe(package).Qwen3MoeConfig(**base)


def fill_moe_deterministic(model, seed=TINY_SEED):
    """Every parameter from deterministic_tensor; router rows scaled by ROUTER_GAIN."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            value = deterministic_tensor(name, tuple(param.shape), seed)
            if name.endswith("mlp.gate.weight"):
                value = value * ROUTER_GAIN
            param.copy_(value)
    return model


def tiny_qwen3_moe(package, device="cpu", dtype=torch.float32, seed=TINY_SEED, **overrides):
    """package.moe.Qwen3MoeForCausalLM with the tiny MoE config and deterministic weights, in eval mode."""
    torch.manual_seed(seed)
    model = _moe(package).Qwen3MoeForCausalLM(tiny_moe_config(package, **overrides))
    fill_moe_deterministic(model, seed)
    return model.to(device=device, dtype=dtype).eval()


def hf_config_values(cfg):
    """The keyword arguments of transformers.Qwen3MoeConfig for one of our configs."""
    names = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings",
             "tie_word_embeddings", "attention_bias", "moe_intermediate_size", "num_experts",
             "num_experts_per_tok", "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers")
    values = {name: getattr(cfg, name) for name in names}
    values["rope_parameters"] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    return values
