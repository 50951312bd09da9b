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

from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from ..layers import apply_rope, rope_cos_sin
from .interfaces import ModelCapabilities, PagedAttention, WindowedAttention

if TYPE_CHECKING:
    from ..qwen3 import Qwen3Attention, Qwen3DecoderLayer, Qwen3ForCausalLM
    from .backends import KVCache
    from .batch import BatchMeta
    from .interfaces import AttentionBackend
    from .lora import AdapterBank
    from .vision import VisionInputs

RopeTables = tuple[torch.Tensor, torch.Tensor]


class FlatModel(nn.Module):
    """A loaded causal LM (its modules and weights, untouched) run on flat rows."""

    def __init__(self, model: Qwen3ForCausalLM) -> None:
        super().__init__()
        self.cfg = model.cfg
        self.backbone = model.model                  # embed_tokens, layers, norm
        self.layers = self.backbone.layers
        self.model = model.eval()
        self.capabilities = ModelCapabilities.of(model)     # what the model declares, read once
        own_tables = self.capabilities.rope_tables          # models with scaled RoPE bring their own
        self.rope = self.default_rope if own_tables is None else own_tables
        # What each layer's attention module declares, read once rather than every step: a
        # path of its own on the pool (latent attention, Chapter 42) and its window.
        modules = [layer.self_attn for layer in self.layers]
        self.paged_attention: list[PagedAttention | None] = [
            m if isinstance(m, PagedAttention) else None for m in modules]
        self.attention_windows: list[int] = [
            (m.sliding_window or 0) if isinstance(m, WindowedAttention) else 0 for m in modules]
        self.fused: bool | str = False               # Chapter 33: fused add + norm (serve/fused.py)
        self.adapters: AdapterBank | None = None     # Chapter 43: set by AdapterBank(flat)
        self.vision: VisionInputs | None = None      # Chapter 43: set by serve.vision.attach_vision

    def default_rope(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeTables:
        """cos, sin for N positions, shaped [N, 1, head_dim] to broadcast over [N, H, head_dim]."""
        cos, sin = rope_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta, dtype)
        return cos[0, 0].unsqueeze(1), sin[0, 0].unsqueeze(1)

    def kv_spec(self) -> tuple[int, int, int]:
        """(layers, kv_heads, head_dim) of the pool every attention layer writes."""
        own = self.capabilities.kv_spec                # a model with another cache shape (Chapter 42)
        if own is not None:
            return own()
        return self.cfg.num_hidden_layers, self.cfg.num_key_value_heads, self.cfg.head_dim

    def layer_device(self, index: int) -> torch.device | None:
        """Where layer `index` and its pool live; None: the model's one device (Chapter 40's
        PlacedFlatModel spreads layers over several)."""
        return None

    def pool_blocks(self, block_bytes: int, cpu_pool_bytes: int, utilization: float) -> int | None:
        """Blocks of `block_bytes` (one layer) that fit on every device the layers use, or
        None when the layers share one device and the engine sizes the pool (Chapter 40)."""
        return None

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

        layer: the layer index (for backends with per-layer state); attn: the layer's
        Qwen3Attention (q/k/v/o projections, q_norm, k_norm, optional sliding_window); h: [N, D]
        rows, already normalised; positions: int64 [N]; rope: (cos, sin), each [N, 1, Dh], from
        self.rope; kv: this layer's pool tuple; meta: the step's BatchMeta; backend: an
        AttentionBackend with write(kv, k, v, meta) -> None and forward(q, kv, meta, window=...)
        -> [N, H, Dh]. Returns [N, D] in h's dtype.
        Computes what Qwen3Attention.forward computes, row for row: projections
        (self.project_qkv), per-head QK-norm applied before RoPE, GQA attention, o_proj. Trap:
        this step's K/V must be in the pool before attention reads it, so each row sees its own
        key. The window passed on is self.attention_windows[layer] (0: no window).
        When self.paged_attention[layer] is not None (a module with a path of its own on the
        pool, latent attention, Chapter 42), its paged_forward(h, positions, rope, kv, meta,
        backend) -> [N, D] is called instead.
        """
        raise NotImplementedError("Your engine: Chapter 31: FlatModel.attention")

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache], meta: BatchMeta,
                backend: AttentionBackend, embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids [N] -> final hidden states [N, D] (before the LM head).  (Your engine: Chapter 31)

        input_ids, positions: int64 [N]; kv_caches: one pool tuple per layer; meta: the step's
        BatchMeta; backend: the AttentionBackend; embeds: [N, D] rows to use instead of the token
        embeddings (image rows, Chapter 43). Returns [N, D] in the model's dtype, equal (to
        float tolerance) to the reference model's final-norm output at those positions;
        afterwards every layer's pool holds these rows' keys and values.
        Seams: every piece of a layer goes through the method a later chapter overrides,
        never around it. self.attention and self.mlp run the sublayers; self.add_norm owns
        every residual add and every norm, the backbone's final norm included (Chapter 33
        fuses the add into the norm there). So a model of L layers makes L attention calls,
        L mlp calls and 2L + 1 add_norm calls per forward.
        Cost contract: the RoPE tables (self.rope(positions, dtype)) are built once per step
        and shared by every layer.
        """
        raise NotImplementedError("Your engine: Chapter 31: FlatModel.forward")

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits for the selected rows only ([L, D] -> [L, vocab], float32): the LM head is the
        largest matmul of the model, and a 2,000-token prefill needs just one of its rows."""
        return self.model.lm_head(hidden).float()
