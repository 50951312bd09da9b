"""Chapters 7, 9 and 10: the MLP, Qwen3's attention, the decoder layer and the whole model.

Module and parameter names follow Hugging Face's Qwen3 exactly, so a transformers
state_dict loads into this model unchanged and the other way round.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Self

import torch
from torch import nn
from torch.nn import functional as F

from .attention import causal_attention
from .layers import RMSNorm, apply_rope, rope_cos_sin
from .serve.interfaces import ModelCapabilities

if TYPE_CHECKING:
    from .kv_cache import ModelCache


def rope_type(config: dict[str, Any]) -> str:
    """The RoPE variant a config.json dict asks for: rope_scaling's (or, in newer files,
    rope_parameters') "rope_type" or "type"; "default" when it names none."""
    stored = config.get("rope_scaling") or config.get("rope_parameters") or {}
    return str(stored.get("rope_type", stored.get("type", "default")))


@dataclass
class Qwen3Config:
    """The fields of a Hugging Face Qwen3 config.json that the model needs (same names)."""
    vocab_size: int = 151936
    hidden_size: int = 4096
    intermediate_size: int = 12288
    num_hidden_layers: int = 36
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int = 128
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    max_position_embeddings: int = 40960
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> Self:
        """Keep the fields this class knows; config.json carries many more.

        Newer config files may nest rope_theta inside rope_parameters/rope_scaling. A RoPE
        scaling other than "default" is refused (ValueError) by a class without a
        rope_scaling field, rather than dropped."""
        known = {f.name for f in fields(cls)}
        kind = rope_type(values)
        if kind != "default" and "rope_scaling" not in known:
            # Dropping it would build a model that runs and quietly computes something else.
            raise ValueError(f"this config asks for rope_type {kind!r}, which {cls.__name__} does not apply; "
                             "load it with checkpoint.load_model (Chapter 42's families scale RoPE)")
        kept = {k: v for k, v in values.items() if k in known}
        for nested in ("rope_parameters", "rope_scaling"):
            extra = values.get(nested) or {}
            if "rope_theta" not in kept and isinstance(extra, dict) and "rope_theta" in extra:
                kept["rope_theta"] = extra["rope_theta"]
        if "head_dim" not in values and "hidden_size" in values:
            kept["head_dim"] = values["hidden_size"] // values["num_attention_heads"]
        if isinstance(kept.get("eos_token_id"), list):
            kept["eos_token_id"] = kept["eos_token_id"][0]
        return cls(**kept)


class Qwen3MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: Qwen3Config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """SwiGLU feed-forward on [..., hidden].  (Your engine: Chapter 7)

        Returns [..., hidden], equal to transformers' Qwen3MLP with the same gate, up and
        down weights (SwiGLU: the nonlinearity is SiLU, and it acts on the gate path only).
        Any leading shape works, which lets Chapter 31 feed it flat [N, hidden] rows.
        """
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Qwen3Attention(nn.Module):
    """Grouped-query attention with RMSNorm on each query and key head (QK-norm)."""

    def __init__(self, cfg: Qwen3Config, layer_idx: int) -> None:
        super().__init__()
        self.cfg, self.layer_idx = cfg, layer_idx
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=bias)
        # nn.Module, not RMSNorm: families without QK-norm (Chapter 42) put an identity here.
        self.q_norm: nn.Module = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm: nn.Module = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor,
                cache: ModelCache | None = None, allowed: torch.Tensor | None = None) -> torch.Tensor:
        """Attention sublayer on x [B, T, hidden] -> [B, T, hidden].  (Your engine: Chapter 9)

        cos, sin: [B or 1, 1, T, D], the rotary tables of these tokens' RoPE positions; slots:
        int64 [T] (or [B, T]), these tokens' places in the sequence's cache (0..T-1 without a
        cache); allowed: an optional bool mask, as for causal_attention (padding, Chapter 21).
        Equal (to float rounding) to transformers' Qwen3Attention with the same weights, in x's
        dtype: H query heads over Hkv key/value heads (grouped-query), each query seeing the
        keys whose slot is not after its own.
        Traps (part of the contract): every query and key head vector is RMS-normalised
        (q_norm, k_norm) and THEN rotated; the other order gives other numbers. The slots, not
        the RoPE positions, decide who sees whom (the milestone feeds positions with gaps).
        Interface (Chapter 16): with a cache, `cache.update(self.layer_idx, k, v)` stores these
        tokens' rotated keys and values ([B, Hkv, T, D]) and returns every key and value so far
        ([B, Hkv, S, D], slots 0 .. S - 1), which the queries attend over.
        """
        batch, length, _ = x.shape
        q = self.q_proj(x).view(batch, length, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(batch, length, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(batch, length, self.num_kv_heads, self.head_dim)
        q = apply_rope(self.q_norm(q).transpose(1, 2), cos, sin)
        k = apply_rope(self.k_norm(k).transpose(1, 2), cos, sin)
        v = v.transpose(1, 2)
        k_slots = slots
        if cache is not None:
            k, v = cache.update(self.layer_idx, k, v)
            k_slots = torch.arange(k.shape[2], device=x.device)
        y = causal_attention(q, k, v, slots, k_slots, allowed)
        return self.o_proj(y.transpose(1, 2).reshape(batch, length, -1))


class Qwen3DecoderLayer(nn.Module):
    """One Qwen3 decoder layer: an attention and an MLP sublayer on the residual stream,
    each with its RMSNorm (Chapter 7)."""

    def __init__(self, cfg: Qwen3Config, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Qwen3Attention(cfg, layer_idx)
        self.mlp: nn.Module = Qwen3MLP(cfg)         # Chapter 27 puts a sparse MoE block here
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor,
                cache: ModelCache | None = None, allowed: torch.Tensor | None = None) -> torch.Tensor:
        """One decoder layer on the residual stream x [B, T, hidden].  (Your engine: Chapter 7)

        Returns the new stream, same shape and dtype, equal to transformers'
        Qwen3DecoderLayer with the same weights: two pre-norm residual branches, attention
        then MLP. Properties: with both sublayers returning zeros the result equals x;
        self_attn is called once, on input_layernorm of x, with cos, sin, slots, cache and
        allowed unchanged; the MLP's norm (post_attention_layernorm) sees the stream with
        attention's contribution already in it; the stream itself is never normalised;
        the caller's x holds the same values afterwards.
        """
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, slots, cache, allowed)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3Model(nn.Module):
    """Embedding, the decoder layers and the final norm: token ids -> hidden states."""

    def __init__(self, cfg: Qwen3Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Qwen3DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def rope_tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B or 1, 1, T, head_dim] for `positions` (Chapter 6's rope_cos_sin)."""
        return rope_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta, dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                cache: ModelCache | None = None, allowed: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids [B, T] -> final hidden states [B, T, hidden].  (Your engine: Chapter 10)

        input_ids: int64 [B, T]; positions: optional [T] or [B, T] RoPE positions (a padded
        batch, Chapter 21, passes its own); cache: optional ModelCache (Chapter 16) whose
        `length` is an int or a [B] tensor of per-row lengths (Chapter 24); allowed: optional
        bool mask passed to every layer's attention.
        The T tokens occupy cache slots start .. start + T - 1 with start = cache.length (0
        without a cache; per row for a [B] length); positions default to those slots.
        Returns the final-norm output [B, T, hidden] in the model's dtype.
        Afterwards, with a cache: every layer has stored its keys and values at those slots and
        the cache has advanced by exactly T, once (after the last layer, so that every layer
        writes at the same slots).
        Interface for later chapters: the rotary tables come from self.rope_tables(positions,
        dtype) (families with scaled RoPE, Chapter 42, replace it) and are shared by all layers.
        """
        start = cache.length if cache is not None else 0
        slots = torch.arange(input_ids.shape[1], device=input_ids.device)
        if isinstance(start, int):
            slots = slots + start
        else:                                   # per-row lengths [B] (Chapter 24's slot cache)
            slots = start.to(input_ids.device)[:, None] + slots
        positions = slots if positions is None else positions
        x = self.embed_tokens(input_ids)
        cos, sin = self.rope_tables(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, slots, cache, allowed)
        if cache is not None:
            cache.advance(input_ids.shape[1])
        return self.norm(x)


class Qwen3ForCausalLM(nn.Module):
    """Qwen3Model plus the LM head (tied to the embedding when the config says so)."""

    def __init__(self, cfg: Qwen3Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = Qwen3Model(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # What it declares to Chapter 31's engine core beyond its modules: a family that
        # changes one (latent attention's pool, scaled rotary tables) sets a replaced copy.
        self.capabilities = ModelCapabilities(context_limit=cfg.max_position_embeddings)

    @property
    def context_limit(self) -> int:
        """The most positions this model was trained for; engines stop requests there."""
        return self.cfg.max_position_embeddings

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                cache: ModelCache | None = None, allowed: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids [B, T] -> logits [B, T, vocab] in float32.  (Your engine: Chapter 10)

        Arguments as for Qwen3Model.forward (the cache advances there, once). Logit v at a
        position scores that position's final hidden state against row v of lm_head.weight
        (the embedding table itself when tied), for every position, not only the last;
        float32 whatever the model's dtype, with the product itself in the model's dtype.
        """
        hidden = self.model(input_ids, positions, cache, allowed)
        return self.lm_head(hidden).float()


Qwen3 = Qwen3ForCausalLM
