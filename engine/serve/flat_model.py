"""Chapter 31: the already-loaded Qwen3 run on flat [N, D] rows against the block pool.

No new weights and no renamed modules: FlatModel holds the Qwen3ForCausalLM (or Chapter
27's Qwen3Moe) you loaded and calls its submodules in a different arrangement. Every
parity test that covered those modules still covers the engine. The differences from
Qwen3Model.forward are only these: rows instead of [B, T], heads on the middle axis of
[N, H, D], RoPE tables for the N positions computed once per step, and attention that
writes and reads the pool through a backend.

The small methods project_qkv, add_norm and mlp are seams: Chapter 33 fuses add + norm,
Chapter 43 adds LoRA to the projections (through forward hooks) and M-RoPE through the
rope seam, without touching the forward loop.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from ..layers import apply_rope, rope_cos_sin

if TYPE_CHECKING:
    from ..qwen3 import Qwen3Attention, Qwen3DecoderLayer, Qwen3ForCausalLM
    from .backends import KVCache
    from .batch import BatchMeta
    from .interfaces import AttentionBackend

RopeTables = tuple[torch.Tensor, torch.Tensor]


class FlatModel(nn.Module):
    """A loaded causal LM (its modules and weights, untouched) run on flat rows."""

    def __init__(self, model: Qwen3ForCausalLM) -> None:
        super().__init__()
        self.cfg = model.cfg
        self.backbone = model.model                  # embed_tokens, layers, norm
        self.layers = self.backbone.layers
        self.model = model.eval()
        own_tables = getattr(model, "rope_tables", None)   # models with scaled RoPE bring their own
        self.rope = self.default_rope if own_tables is None else own_tables
        self.fused: bool | str = False               # Chapter 33: fused add + norm (serve/fused.py)

    def default_rope(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeTables:
        """cos, sin for N positions, shaped [N, 1, head_dim] to broadcast over [N, H, head_dim]."""
        cos, sin = rope_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta, dtype)
        return cos[0, 0].unsqueeze(1), sin[0, 0].unsqueeze(1)

    def kv_spec(self) -> tuple[int, int, int]:
        """(layers, kv_heads, head_dim) of the pool every attention layer writes."""
        own = getattr(self.model, "kv_spec", None)    # a model with another cache shape (Chapter 42)
        if own is not None:
            return own()
        return self.cfg.num_hidden_layers, self.cfg.num_key_value_heads, self.cfg.head_dim

    # --- seams --------------------------------------------------------------------------

    def project_qkv(self, attn: Qwen3Attention, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """h [N, D] -> q [N, H*Dh], k [N, Hkv*Dh], v [N, Hkv*Dh]."""
        return attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)

    def add_norm(self, norm: nn.Module, x: torch.Tensor,
                 delta: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Add a sublayer's output to the residual stream, then normalise a copy for the next
        sublayer: returns (norm(x + delta), x + delta). delta None: the first layer's input.
        With self.fused set, one fused add + RMSNorm (Chapter 33) does both."""
        if self.fused and delta is not None:
            from .fused import fused_add_norm
            both = fused_add_norm(norm, x, delta, self.fused)
            if both is not None:
                return both
        if delta is not None:
            x = x + delta
        return norm(x), x

    def mlp(self, module: nn.Module, h: torch.Tensor) -> torch.Tensor:
        """The feed-forward block on [N, D] rows: SwiGLU, or a sparse MoE (Chapter 27)."""
        out = module(h)
        return out[0] if isinstance(out, tuple) else out     # some MoE blocks also return router logits

    # --- the two stubs ------------------------------------------------------------------

    def attention(self, layer: int, attn: Qwen3Attention, h: torch.Tensor, positions: torch.Tensor,
                  rope: RopeTables, kv: KVCache, meta: BatchMeta, backend: AttentionBackend) -> torch.Tensor:
        """One attention sublayer on flat rows.  (Your engine: Chapter 31)

        h [N, D] (already normalised) -> [N, D]. The same steps as Qwen3Attention.forward in
        another layout: project (self.project_qkv), view as q [N, H, Dh], k and v
        [N, Hkv, Dh]; QK-norm each head (attn.q_norm / attn.k_norm: RMSNorm over the last
        axis works on any layout) BEFORE rotating; rotate q and k with rope = (cos, sin) of
        shape [N, 1, Dh]; store k, v with backend.write(kv, k, v, meta) BEFORE attending, so
        this step's queries see their own keys; attend with backend.forward(q, kv, meta,
        window=getattr(attn, "sliding_window", 0)); o_proj the [N, H * Dh] result.
        `layer` is the layer index (unused here; backends with per-layer state use it).
        A module with its own `paged_forward` (latent attention, Chapter 42) is called instead.
        """
        raise NotImplementedError("Your engine: Chapter 31: FlatModel.attention")

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache], meta: BatchMeta,
                backend: AttentionBackend, embeds: torch.Tensor | None = None, **features: Any) -> torch.Tensor:
        """Token ids [N] -> final hidden states [N, D] (before the LM head).  (Your engine: Chapter 31)

        The residual stream starts as the token embeddings (self.backbone.embed_tokens), or
        as `embeds` when given (image rows, Chapter 43). Build the RoPE tables ONCE per step,
        self.rope(positions, dtype), and hand the same pair to every layer. Each decoder
        layer has two residual branches, attention (behind input_layernorm) and the MLP
        (behind post_attention_layernorm); write both through the seams: add_norm adds the
        previous branch's output to the stream and normalises a copy for the next branch
        (the very first call has nothing to add), self.attention(i, ...) gets layer i's
        pool kv_caches[i], self.mlp runs the feed-forward block. The backbone's final norm
        closes the stream, again through add_norm. `features` are per-step inputs of later
        chapters (LoRA ids, M-RoPE positions): Chapter 31 receives none, so refuse any.
        """
        raise NotImplementedError("Your engine: Chapter 31: FlatModel.forward")

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits for the selected rows only ([L, D] -> [L, vocab], float32): the LM head is the
        largest matmul of the model, and a 2,000-token prefill needs just one of its rows."""
        return self.model.lm_head(hidden).float()
