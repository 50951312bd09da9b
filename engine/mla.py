"""Chapter 42: multi-head latent attention (MLA, DeepSeek-V2), one small cached vector per token.

Grouped-query attention makes the cache smaller by letting heads share K/V; latent attention
goes further. Each token caches one vector for ALL heads: a compressed "latent" c
(kv_lora_rank numbers, RMS-normalised) and one rotary key shared by the heads, k_rope
(qk_rope_head_dim numbers). The per-head keys and values are linear images of c, through
the two halves of kv_b_proj, W_UK[h] and W_UV[h]:

    k_nope[h] = W_UK[h] c          v[h] = W_UV[h] c

Linear maps can move to the other side of a dot product or a weighted sum, so they are
never applied to the cache at all:

    q_nope[h] . k_nope[h] = (W_UK[h]^T q_nope[h]) . c       (fold W_UK into the query)
    sum_t p_t v_t[h]      = W_UV[h] (sum_t p_t c_t)         (apply W_UV after attending)

What remains is ordinary multi-query attention with ONE key/value head of width
kv_lora_rank + qk_rope_head_dim: query [W_UK^T q_nope | rotated q_rope] per head, key
[c | rotated k_rope] per token, and the same vector as the value (only its first
kv_lora_rank numbers are kept). Both paths below compute it that way: the dense one against
Chapter 16's KVCache, and the engine's, paged_forward, against the block pool through any
attention backend. transformers' DeepseekV2Attention expands k and v for every head
instead, which makes it an oracle that shares none of this arithmetic.

DeepSeek rotates adjacent channel pairs (2i, 2i + 1); Chapter 6's apply_rope rotates
(i, i + D/2). A dot product does not change when both vectors' channels are reordered the
same way, so q_rope and k_rope are reordered evens-first before the rotation and stay in
that order in the cache.

Only the dense-MLP, unscaled-RoPE part of DeepSeek-V2 is built here: a config whose layers
use its mixture of experts, or whose RoPE is scaled, is refused by name.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Self

import torch
from torch import nn

from .attention import causal_attention
from .layers import RMSNorm, apply_rope
from .qwen3 import Qwen3Config, Qwen3ForCausalLM, rope_type

if TYPE_CHECKING:
    from .kv_cache import ModelCache
    from .serve.backends import KVCache as PagedKV
    from .serve.batch import BatchMeta
    from .serve.interfaces import AttentionBackend

# DeepSeek-V2 normalises its two low-rank bottlenecks with a fixed epsilon, not rms_norm_eps.
LATENT_NORM_EPS = 1e-6


@dataclass
class MLAConfig(Qwen3Config):
    """Qwen3Config's fields plus DeepSeek-V2's attention shape. head_dim is the rotary width
    (qk_rope_head_dim), as in transformers, so Chapter 6's tables come out the right size.
    q_lora_rank None: queries come straight from q_proj, else through a low-rank bottleneck."""
    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> Self:
        layers = values.get("num_hidden_layers", 0)
        dense = values.get("first_k_dense_replace", 0)
        if dense < layers and values.get("n_routed_experts"):
            raise ValueError(f"this DeepSeek-V2 config puts its mixture of experts in layers {dense}..{layers - 1}; "
                             "only all-dense configs (first_k_dense_replace >= num_hidden_layers) are built here")
        if rope_type(values) != "default":
            raise ValueError(f"rope_type {rope_type(values)!r} with latent attention is not built here "
                             "(DeepSeek's YaRN also rescales the softmax); use an unscaled config")
        return super().from_dict({**values, "head_dim": values.get("qk_rope_head_dim", cls.qk_rope_head_dim)})


def pairs_to_halves(x: torch.Tensor) -> torch.Tensor:
    """Reorder the last axis from DeepSeek's interleaved pairs (0, 1), (2, 3), ... to
    Chapter 6's halves: channels 0, 2, 4, ... then 1, 3, 5, ..."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


class LatentAttention(nn.Module):
    """DeepSeek-V2's attention with Hugging Face's module names, so its state_dict loads as is."""

    def __init__(self, cfg: MLAConfig, layer_idx: int) -> None:
        super().__init__()
        self.cfg, self.layer_idx = cfg, layer_idx
        self.num_heads = cfg.num_attention_heads
        self.nope, self.rope, self.latent = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
        self.v_dim = cfg.v_head_dim
        query_width = self.num_heads * (self.nope + self.rope)
        bias = cfg.attention_bias
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(cfg.hidden_size, query_width, bias=False)
        else:
            self.q_a_proj = nn.Linear(cfg.hidden_size, cfg.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, query_width, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(cfg.hidden_size, self.latent + self.rope, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.latent, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(self.latent, self.num_heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.v_dim, cfg.hidden_size, bias=bias)
        # The softmax scale belongs to the dot product the model was trained with (nope + rope
        # channels), not to the wider absorbed vectors the cache holds.
        self.scale = 1.0 / math.sqrt(self.nope + self.rope)

    def up_projections(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [H, nope, latent] and W_UV [H, v_dim, latent], views of kv_b_proj's weight."""
        weight = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, self.latent)
        return weight[:, :self.nope], weight[:, self.nope:]

    def absorbed(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Normalised rows -> absorbed queries and cache entries of latent attention.  (Your engine: Chapter 42)

        h: [..., hidden] (the layer's normalised input); cos, sin: Chapter 6's rotary
        tables of the rows' positions, broadcastable to [..., H, rope]. Returns (q, entry)
        in h's dtype, q [..., H, latent + rope] and entry [..., 1, latent + rope], with
        latent = kv_lora_rank, rope = qk_rope_head_dim, such that:
          - scores: self.scale * (q of row s, head h) . (entry of row t) equals the score
            DeepSeek-V2's attention (transformers') gives query s, head h and key t, whose
            per-head key holds the no-rotary key W_UK c_t (self.up_projections(), c_t the
            token's normalised latent) and the token's rotated shared rotary key;
          - values: entry's first `latent` numbers are c_t, so attention weights applied
            to entries, through self.output, give the module's output;
          - entry depends on its own token alone and is the same for every head: it is
            what the pool keeps, one per token and layer.
        Queries come from q_proj, or from q_a_proj, q_a_layernorm and q_b_proj when
        cfg.q_lora_rank is set. Both rotary parts keep the order pairs_to_halves gives
        (DeepSeek rotates adjacent channel pairs; the cache never leaves this layer).
        Trap, as a property: no per-head key or value of width nope or v_head_dim exists
        for a cached token: the work per cached token does not grow with H.
        """
        raise NotImplementedError("Your engine: Chapter 42: LatentAttention.absorbed")

    def output(self, attended: torch.Tensor) -> torch.Tensor:
        """Attention results [..., H, latent + rope] -> [..., hidden]: keep the latent part,
        expand it per head with W_UV, then o_proj."""
        _, w_uv = self.up_projections()
        values = torch.einsum("...hl,hvl->...hv", attended[..., :self.latent], w_uv)
        return self.o_proj(values.reshape(*values.shape[:-2], -1))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor,
                cache: ModelCache | None = None, allowed: torch.Tensor | None = None) -> torch.Tensor:
        """The dense path, same contract as Qwen3Attention.forward (x [B, T, hidden]). The
        cache holds each entry as both "key" and "value": Chapter 16's KVCache keeps two
        tensors of one shape, so this path stores the latent twice; the engine's pool, one
        tensor, stores it once."""
        q, entry = self.absorbed(x, cos.transpose(1, 2), sin.transpose(1, 2))   # [B, T, 1, R] tables
        q, entry = q.transpose(1, 2), entry.transpose(1, 2)                  # heads on axis 1
        keys, k_slots = entry, slots
        if cache is not None:
            keys, _ = cache.update(self.layer_idx, entry, entry)
            k_slots = torch.arange(keys.shape[2], device=x.device)
        attended = causal_attention(q, keys, keys, slots, k_slots, allowed, scale=self.scale)
        return self.output(attended.transpose(1, 2))

    def paged_forward(self, h: torch.Tensor, positions: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                      kv: PagedKV, meta: BatchMeta, backend: AttentionBackend) -> torch.Tensor:
        """Latent attention on the engine's flat rows.  (Your engine: Chapter 42)

        h: [N, hidden], already normalised; rope = (cos, sin), each [N, 1, qk_rope_head_dim];
        kv: this layer's pool from DeepseekV2ForCausalLM.allocate_kv, a pair whose two
        entries are ONE tensor [blocks + 1, block_size, 1, kv_lora_rank + qk_rope_head_dim].
        Returns [N, hidden], equal (to float tolerance) to forward() on the same tokens.
        Contract: this step's cache entries are in the pool (backend.write) before
        backend.forward reads it; attention runs as one shared key/value head with
        softmax scale self.scale; `positions` is unused (the tables already hold them).
        """
        raise NotImplementedError("Your engine: Chapter 42: LatentAttention.paged_forward")


class DeepseekV2ForCausalLM(Qwen3ForCausalLM):
    """Qwen3's decoder stack (dense SwiGLU MLPs, RMSNorms, LM head) with latent attention."""

    def __init__(self, cfg: MLAConfig) -> None:
        super().__init__(cfg)
        for index, layer in enumerate(self.model.layers):
            layer.self_attn = LatentAttention(cfg, index)
        # Its own pool shape and layout; the sizing rule counts one tensor per layer, not K and V.
        self.capabilities = replace(self.capabilities, kv_spec=self.kv_spec, allocate_kv=self.allocate_kv, kv_pools=1)

    def kv_spec(self) -> tuple[int, int, int]:
        """(layers, kv_heads, width) of the cache: one "head" holding latent + rotary key."""
        cfg = self.cfg
        assert isinstance(cfg, MLAConfig)
        return cfg.num_hidden_layers, 1, cfg.kv_lora_rank + cfg.qk_rope_head_dim

    def allocate_kv(self, shape: tuple[int, ...], dtype: torch.dtype,
                    device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's pool: a single zeroed tensor handed out as both k_cache and v_cache,
        so a backend's write stores each entry once and its reads see keys and values alike."""
        pool = torch.zeros(shape, dtype=dtype, device=device)
        return pool, pool
