"""Chapter 27: Qwen3-MoE, a mixture-of-experts Qwen3.

The only new part is the feed-forward block: instead of one SwiGLU MLP, a router picks the
top-k of E small SwiGLU "experts" for every token and mixes their outputs with the router's
(renormalised) probabilities. Attention, norms, RoPE and the model skeleton are Chapter 10's
modules, reused as they are.

The block works on rows: it flattens any [..., hidden] input to [N, hidden], routes and
dispatches the N rows, and restores the shape. That is why Chapter 31's FlatModel, which
feeds every layer [N, hidden] rows, runs Qwen3-MoE without a change.

Parameter names. Checkpoints on disk (and this module) keep one SwiGLU per expert:
    model.layers.{i}.mlp.gate.weight                       [E, hidden]  (the router)
    model.layers.{i}.mlp.experts.{e}.gate_proj.weight      [moe_intermediate, hidden]
    model.layers.{i}.mlp.experts.{e}.up_proj.weight        [moe_intermediate, hidden]
    model.layers.{i}.mlp.experts.{e}.down_proj.weight      [hidden, moe_intermediate]
transformers 5 fuses the experts of a layer into two 3-D tensors:
    model.layers.{i}.mlp.experts.gate_up_proj              [E, 2 * moe_intermediate, hidden]
    model.layers.{i}.mlp.experts.down_proj                 [E, hidden, moe_intermediate]
`fuse_experts` and `split_experts` convert between the two, and the block accepts the fused
form in load_state_dict directly, so `ours.load_state_dict(hf.state_dict())` just works.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Self

import torch
from torch import nn

from .layers import RMSNorm
from .qwen3 import Qwen3Attention, Qwen3Config, Qwen3DecoderLayer, Qwen3ForCausalLM, Qwen3MLP, Qwen3Model
from .serve.interfaces import ModelCapabilities


@dataclass
class Qwen3MoeConfig(Qwen3Config):
    """Qwen3Config plus the fields of a Hugging Face qwen3_moe config.json (same names)."""
    moe_intermediate_size: int = 768
    num_experts: int = 128
    num_experts_per_tok: int = 8
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> Self:
        values = dict(values)
        if "num_experts" not in values and "num_local_experts" in values:
            values["num_experts"] = values["num_local_experts"]
        return super().from_dict(values)

    def is_sparse(self, layer_idx: int) -> bool:
        """Whether layer `layer_idx` gets the MoE block (else a dense MLP of intermediate_size)."""
        return (layer_idx not in self.mlp_only_layers and self.num_experts > 0
                and (layer_idx + 1) % self.decoder_sparse_step == 0)


class Qwen3MoeSparseMoeBlock(nn.Module):
    """Router `gate` ([hidden] -> E logits) and E experts, each a SwiGLU of moe_intermediate_size."""

    def __init__(self, cfg: Qwen3MoeConfig) -> None:
        super().__init__()
        self.num_experts, self.top_k = cfg.num_experts, cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        expert_cfg = replace(cfg, intermediate_size=cfg.moe_intermediate_size)
        self.experts = nn.ModuleList(Qwen3MLP(expert_cfg) for _ in range(cfg.num_experts))
        self.register_load_state_dict_pre_hook(_split_fused_on_load)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Choose top_k experts per row and their mixing weights.  (Your engine: Chapter 27)

        x: [N, hidden] rows. Returns (weights [N, top_k] in x's dtype, experts [N, top_k] int64):
        row n's top_k experts by router probability (softmax of self.gate(x) over the E experts),
        highest weight first, with those probabilities as weights. With self.norm_topk_prob
        each row's weights are rescaled to sum to 1; without it they are the raw probabilities
        (a row then sums to less than 1).
        Trap (part of the contract): the softmax runs in float32 whatever x's dtype; in bfloat16
        close probabilities round together and change which experts win, and the milestone
        compares the chosen experts with transformers'.
        """
        raise NotImplementedError("Your engine: Chapter 27: Qwen3MoeSparseMoeBlock.route")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Sparse MoE on x [..., hidden] -> same shape and dtype.  (Your engine: Chapter 27)

        Each row (a token) gets sum over its top_k experts e of weight_e * expert_e(row), with
        experts and weights from self.route; equal to transformers' Qwen3MoeSparseMoeBlock on
        the same weights within float tolerance.
        Cost contract: every expert chosen by at least one row runs exactly once, on exactly the
        rows that chose it (one batched call per expert, never a loop over tokens); an expert no
        row chose does not run at all. A row that chose two experts receives both contributions.
        """
        raise NotImplementedError("Your engine: Chapter 27: Qwen3MoeSparseMoeBlock.forward")


def _split_fused_on_load(module: nn.Module, state_dict: dict[str, torch.Tensor], prefix: str, *_: Any) -> None:
    """load_state_dict hook: accept transformers 5's fused expert tensors for this block."""
    fused = prefix + "experts.gate_up_proj"
    if fused in state_dict:
        state_dict.update(split_experts({k: state_dict.pop(k) for k in
                                         (fused, prefix + "experts.down_proj")}))


def split_experts(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Fused expert tensors (transformers 5) -> one gate/up/down weight per expert. Other
    entries pass through unchanged. Returns a new dict."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        if name.endswith("experts.gate_up_proj"):
            base = name[: -len("gate_up_proj")]
            gate, up = tensor.chunk(2, dim=1)            # [E, 2I, D]: gate rows first, then up
            for e in range(tensor.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = gate[e].clone()
                out[f"{base}{e}.up_proj.weight"] = up[e].clone()
        elif name.endswith("experts.down_proj") and tensor.dim() == 3:
            base = name[: -len("down_proj")]
            for e in range(tensor.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = tensor[e].clone()
        else:
            out[name] = tensor
    return out


def fuse_experts(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One weight per expert -> transformers 5's fused [E, 2I, D] and [E, D, I] tensors.
    The inverse of split_experts. Returns a new dict."""
    out: dict[str, torch.Tensor] = {}
    groups: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for name, tensor in state_dict.items():
        head, sep, tail = name.rpartition("experts.")
        parts = tail.split(".")
        if sep and len(parts) == 3 and parts[0].isdigit() and parts[2] == "weight":
            groups.setdefault(head + sep, {}).setdefault(int(parts[0]), {})[parts[1]] = tensor
        else:
            out[name] = tensor
    for base, experts in groups.items():
        order = [experts[e] for e in range(len(experts))]
        out[base + "gate_up_proj"] = torch.stack([torch.cat([w["gate_proj"], w["up_proj"]]) for w in order])
        out[base + "down_proj"] = torch.stack([w["down_proj"] for w in order])
    return out


class Qwen3MoeDecoderLayer(Qwen3DecoderLayer):
    """Qwen3's decoder layer with the MLP replaced by the sparse block where the config says.
    The forward pass is Qwen3DecoderLayer's, unchanged."""

    def __init__(self, cfg: Qwen3MoeConfig, layer_idx: int) -> None:
        nn.Module.__init__(self)                  # build our own parts: no dense MLP to throw away
        self.self_attn = Qwen3Attention(cfg, layer_idx)
        self.mlp = Qwen3MoeSparseMoeBlock(cfg) if cfg.is_sparse(layer_idx) else Qwen3MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Qwen3MoeModel(Qwen3Model):
    def __init__(self, cfg: Qwen3MoeConfig) -> None:
        nn.Module.__init__(self)
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Qwen3MoeDecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    """Qwen3-MoE: same interface as Qwen3ForCausalLM (forward, cache, context_limit)."""

    def __init__(self, cfg: Qwen3MoeConfig) -> None:
        nn.Module.__init__(self)
        self.cfg = cfg
        self.model = Qwen3MoeModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.capabilities = ModelCapabilities(context_limit=cfg.max_position_embeddings)


Qwen3Moe = Qwen3MoeForCausalLM


def sparse_blocks(model: Qwen3ForCausalLM) -> list[tuple[int, Qwen3MoeSparseMoeBlock]]:
    """(layer index, block) for every MoE block of a model."""
    return [(i, layer.mlp) for i, layer in enumerate(model.model.layers)
            if isinstance(layer.mlp, Qwen3MoeSparseMoeBlock)]


@torch.inference_mode()
def expert_load(model: Qwen3ForCausalLM, input_ids: torch.Tensor) -> dict[int, torch.Tensor]:
    """How many rows each expert received in one forward pass over input_ids [B, T].

    Returns {layer index: int64 tensor [E]}; each layer's counts sum to B * T * top_k.
    Measured by watching each block's `route` (a temporary wrapper), so the model itself
    keeps no statistics and pays nothing when nobody asks.
    """
    counts: dict[int, torch.Tensor] = {}
    originals = []
    for i, block in sparse_blocks(model):
        def watched(x: torch.Tensor, block: Qwen3MoeSparseMoeBlock = block, i: int = i,
                    route: Any = block.route) -> tuple[torch.Tensor, torch.Tensor]:
            weights, experts = route(x)
            counts[i] = counts.get(i, 0) + torch.bincount(experts.flatten().cpu(), minlength=block.num_experts)
            return weights, experts
        originals.append(block)
        block.route = watched                        # type: ignore[method-assign]
    try:
        model(input_ids)
    finally:
        for block in originals:
            del block.route                          # back to the class's method
    return counts


def active_parameters(cfg: Qwen3MoeConfig) -> tuple[int, int]:
    """(total, active per token) parameter counts of the MoE layers' feed-forward parts: what
    a token actually multiplies against is top_k experts plus the router, not all E."""
    expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size
    router = cfg.hidden_size * cfg.num_experts
    sparse = sum(cfg.is_sparse(i) for i in range(cfg.num_hidden_layers))
    return sparse * (cfg.num_experts * expert + router), sparse * (cfg.num_experts_per_tok * expert + router)
