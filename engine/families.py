"""Chapter 42: more model families, and the registry that picks one from a checkpoint.

Llama, Qwen2, Mistral and Qwen3 are one decoder with small differences, so each family
here is Qwen3's classes with one or two changes, never a copy:

    family    QK-norm   q/k/v bias   attention window                          RoPE
    Qwen3     yes       no           full                                      plain, Llama 3 or YaRN scaled
    Llama     no        no           full                                      plain, Llama 3 or YaRN scaled
    Qwen2     no        yes          full                                      plain
    Mistral   no        no           sliding (the last `sliding_window` keys)  plain

Module and parameter names stay Hugging Face's, so a transformers state_dict of any family
loads unchanged, and Chapter 31's FlatModel runs every family: it calls q_norm / k_norm
(an identity where a family has none), the projections (with or without bias), and passes
the attention module's `sliding_window` to the backend.

The registry is keyed by the Hugging Face class name in config.json's "architectures"
(GGUF files are translated to the same key by gguf.hf_config).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .mla import DeepseekV2ForCausalLM, MLAConfig
from .qwen3 import Qwen3Attention, Qwen3Config, Qwen3ForCausalLM, rope_type

if TYPE_CHECKING:
    from .kv_cache import ModelCache


ROPE_TYPES = ("default", "llama3", "yarn")


@dataclass
class LlamaConfig(Qwen3Config):
    """Qwen3Config's fields plus the window of Mistral-style attention (0: none) and RoPE
    scaling: None, or a dict with rope_type "llama3" (factor, low_freq_factor,
    high_freq_factor, original_max_position_embeddings) or "yarn" (factor,
    original_max_position_embeddings, optionally beta_fast, beta_slow, attention_factor,
    mscale, mscale_all_dim, truncate)."""
    sliding_window: int = 0
    rope_scaling: dict[str, Any] | None = None

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "LlamaConfig":
        """Newer config files put the scaling in rope_parameters, older ones in rope_scaling;
        HF writes None for "no window". An unknown rope_type is refused, not ignored: the
        model would run and quietly compute something else."""
        stored = values.get("rope_scaling") or values.get("rope_parameters") or {}
        kind = rope_type(values)
        if kind not in ROPE_TYPES:
            raise ValueError(f"rope_type {kind!r} is not supported; known: {', '.join(ROPE_TYPES)}")
        scaling = None if kind == "default" else {**{k: v for k, v in stored.items() if k != "rope_theta"},
                                                  "rope_type": kind}
        return super().from_dict({**values, "sliding_window": values.get("sliding_window") or 0,
                                  "rope_scaling": scaling})


def llama3_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3's rescaled rotary frequencies.  (Your engine: Chapter 42)

    scaling is config.json's rope_scaling: "factor", "low_freq_factor" (low),
    "high_freq_factor" (high > low) and "original_max_position_embeddings" (L). Returns
    float32 [head_dim / 2], one frequency per channel i. Chapter 6 gives the channel
    f_i = theta ** (-2i / head_dim), a wavelength of w_i = 2 pi / f_i positions; then:
    - a channel that turns at least `high` times over L (w_i <= L / high) keeps f_i;
    - one that turns at most `low` times (w_i >= L / low) gets f_i / factor;
    - one in between gets a value between those two, made of f_i / factor and f_i, with
      the share of f_i growing linearly in L / w_i, so the result is continuous at both edges.
    Example: head_dim 8, theta 10000, L 1000, factor 8, low 1, high 4 (edges at w = 250
    and 1000):   f_i 1, 0.1, 0.01, 0.001 (w_i 6.28, 62.8, 628, 6283)
                 ->  1, 0.1, 0.00298, 0.000125
    """
    raise NotImplementedError("Your engine: Chapter 42: llama3_inv_freq")


def yarn_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """YaRN's frequencies (float32 [head_dim / 2]) and its attention factor.

    Channel i turns L * f_i / (2 pi) times over the original context L. Channels that turn
    more than beta_fast times keep f_i; those that turn fewer than beta_slow times are
    divided by the factor; the channel indices in between blend the two linearly. The
    factor also sharpens attention: cos and sin are multiplied by 0.1 ln(factor) + 1 (or
    the config's attention_factor / mscale ratio), which scales every q.k score by its square."""
    half = head_dim // 2
    f = theta ** (-torch.arange(0, half, dtype=torch.float32) * 2 / head_dim)
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]

    def channel_turning(times: float) -> float:             # the (fractional) channel index that turns `times` times
        return head_dim * math.log(original / (times * 2 * math.pi)) / (2 * math.log(theta))

    low, high = channel_turning(scaling.get("beta_fast") or 32), channel_turning(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    ramp = ((torch.arange(half, dtype=torch.float32) - low) / max(high - low, 1e-3)).clamp(0.0, 1.0)
    inv_freq = f / factor * ramp + f * (1 - ramp)

    def sharpening(m: float = 1.0) -> float:
        return 0.1 * m * math.log(factor) + 1.0 if factor > 1 else 1.0

    attention = scaling.get("attention_factor")
    if attention is None:
        mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = sharpening(mscale) / sharpening(mscale_all) if mscale and mscale_all else sharpening()
    return inv_freq, float(attention)


def scaled_rope_tables(cfg: LlamaConfig, positions: torch.Tensor,
                       dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [B or 1, 1, T, head_dim] like rope_cos_sin, with Llama 3's or YaRN's
    frequencies (recomputed per call: 64 numbers, and a model built on "meta" must not
    keep them). ValueError for a config without rope_scaling (plain RoPE is rope_cos_sin's)."""
    scaling = cfg.rope_scaling
    if scaling is None:
        raise ValueError("scaled_rope_tables needs a config with rope_scaling (rope_type llama3 or yarn)")
    if scaling["rope_type"] == "yarn":
        inv_freq, attention = yarn_inv_freq(cfg.head_dim, cfg.rope_theta, scaling)
    else:
        inv_freq, attention = llama3_inv_freq(cfg.head_dim, cfg.rope_theta, scaling), 1.0
    angles = positions.float()[..., None] * inv_freq.to(positions.device)
    angles = torch.cat([angles, angles], dim=-1)
    angles = (angles[None] if angles.dim() == 2 else angles)[:, None]
    return (angles.cos() * attention).to(dtype), (angles.sin() * attention).to(dtype)


class LlamaAttention(Qwen3Attention):
    """Qwen3's attention without QK-norm: the norms become identities (no parameters)."""

    def __init__(self, cfg: LlamaConfig, layer_idx: int):
        super().__init__(cfg, layer_idx)
        self.q_norm = nn.Identity()
        self.k_norm = nn.Identity()


class Qwen2Attention(LlamaAttention):
    """Llama's attention with a bias on the q, k and v projections (not on o_proj)."""

    def __init__(self, cfg: LlamaConfig, layer_idx: int):
        super().__init__(cfg, layer_idx)
        for name in ("q_proj", "k_proj", "v_proj"):
            old = getattr(self, name)
            setattr(self, name, nn.Linear(old.in_features, old.out_features, bias=True))


def sliding_window_allowed(q_slots: torch.Tensor, window: int) -> torch.Tensor:
    """Which keys a sliding-window query may see.  (Your engine: Chapter 42)

    q_slots: int [Tq] or [B, Tq], the cache slots of the queries; the keys are slots
    0 .. K - 1 with K = the largest query slot + 1 (what Qwen3Attention attends to, with or
    without a cache). Returns bool [1 or B, 1, Tq, K]: True where key slot j > query slot
    - window, i.e. each query sees itself and the window - 1 slots before it (causality
    is applied separately). window >= 1.
    """
    raise NotImplementedError("Your engine: Chapter 42: sliding_window_allowed")


class MistralAttention(LlamaAttention):
    """Llama's attention in which each query sees only the last `sliding_window` positions."""

    def __init__(self, cfg: LlamaConfig, layer_idx: int):
        super().__init__(cfg, layer_idx)
        self.sliding_window = cfg.sliding_window      # FlatModel hands it to the attention backend

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor,
                cache: ModelCache | None = None, allowed: torch.Tensor | None = None) -> torch.Tensor:
        if self.sliding_window:
            window = sliding_window_allowed(slots, self.sliding_window)
            allowed = window if allowed is None else allowed & window
        return super().forward(x, cos, sin, slots, cache, allowed)


class LlamaForCausalLM(Qwen3ForCausalLM):
    """Qwen3ForCausalLM whose layers use the family's attention module."""
    attention_class: type[Qwen3Attention] = LlamaAttention

    def __init__(self, cfg: LlamaConfig):
        super().__init__(cfg)
        if self.attention_class is not Qwen3Attention:
            for index, layer in enumerate(self.model.layers):
                layer.self_attn = self.attention_class(cfg, index)
        if cfg.rope_scaling:
            # An instance attribute shadows Qwen3Model's method on purpose (its forward calls
            # self.rope_tables); mypy refuses any assignment to a method, hence the ignore.
            self.model.rope_tables = partial(scaled_rope_tables, cfg)  # type: ignore[method-assign]
        self.capabilities = replace(self.capabilities, rope_tables=self.rope_tables)

    def rope_tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [N, 1, head_dim] for Chapter 31's FlatModel (flat positions [N])."""
        cos, sin = self.model.rope_tables(positions, dtype)
        return cos[0, 0].unsqueeze(1), sin[0, 0].unsqueeze(1)


class Qwen2ForCausalLM(LlamaForCausalLM):
    attention_class = Qwen2Attention


class Qwen3ScaledForCausalLM(LlamaForCausalLM):
    """Qwen3 itself (QK-norm kept) with the RoPE scaling its config asks for: Qwen3's
    checkpoints reach past their native 32,768 positions with YaRN (factor 4)."""
    attention_class = Qwen3Attention


class MistralForCausalLM(LlamaForCausalLM):
    attention_class = MistralAttention


@dataclass(frozen=True)
class Family:
    """One model family: its config class and model class, and the names that select it."""
    name: str
    config_class: type[Qwen3Config]
    model_class: type[Qwen3ForCausalLM]
    architectures: tuple[str, ...]


FAMILIES = {family.name: family for family in (
    Family("qwen3", Qwen3Config, Qwen3ForCausalLM, ("Qwen3ForCausalLM", "Qwen3Model")),
    Family("llama", LlamaConfig, LlamaForCausalLM, ("LlamaForCausalLM", "LlamaModel")),
    Family("qwen2", LlamaConfig, Qwen2ForCausalLM, ("Qwen2ForCausalLM", "Qwen2Model")),
    Family("mistral", LlamaConfig, MistralForCausalLM, ("MistralForCausalLM", "MistralModel")),
    Family("deepseek_v2", MLAConfig, DeepseekV2ForCausalLM, ("DeepseekV2ForCausalLM", "DeepseekV2Model")),
    # Qwen3's architectures again: family_for picks this one when rope_scaling is not "default".
    Family("qwen3-scaled-rope", LlamaConfig, Qwen3ScaledForCausalLM, ("Qwen3ForCausalLM", "Qwen3Model")),
)}


def family_for(config: dict[str, Any]) -> Family:
    """The family of a config.json dict, by its "architectures" (else its "model_type").
    ValueError naming the architecture and every known one when none matches."""
    names = config.get("architectures") or []
    for family in FAMILIES.values():
        if set(names) & set(family.architectures) or (not names and config.get("model_type") == family.name):
            if family.name == "qwen3" and rope_type(config) != "default":
                return FAMILIES["qwen3-scaled-rope"]
            return family
    known = sorted({a for family in FAMILIES.values() for a in family.architectures if a.endswith("ForCausalLM")})
    raise ValueError(f"unknown architecture {names or None} (model_type {config.get('model_type')!r}); "
                     f"known architectures: {', '.join(known)}")


def build_model(config: dict[str, Any]) -> Qwen3ForCausalLM:
    """The family's model for a config.json dict, with freshly initialised weights
    (build it under torch.device("meta") to get shapes only)."""
    family = family_for(config)
    return family.model_class(family.config_class.from_dict(config))
