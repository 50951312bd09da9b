"""Chapters 1 and 2: what a model costs, from its config alone.

Every function here reads only config fields with Hugging Face's names (hidden_size,
num_hidden_layers, ...), so it accepts our Qwen3Config, a transformers Qwen3Config or any
object with those attributes. Nothing is allocated: the numbers for a 32B model come out
as fast as those for the tiny test model.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from .qwen3 import Qwen3Config


class ModelShape(Protocol):
    """The config fields the cost model reads, with Hugging Face's names: our Qwen3Config,
    transformers' Qwen3Config, or any object with these attributes (head_dim is optional:
    hidden_size // num_attention_heads when a config leaves it out)."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    tie_word_embeddings: bool
    attention_bias: bool

# Config values of the dense Qwen3 releases, copied from each checkpoint's config.json on the
# Hugging Face hub (Qwen/Qwen3-0.6B ... Qwen/Qwen3-32B). All share vocab_size 151936 and
# head_dim 128; the three smallest tie the LM head to the embedding.
QWEN3_CONFIGS: dict[str, dict[str, Any]] = {
    "Qwen3-0.6B": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, tie_word_embeddings=True),
    "Qwen3-1.7B": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, tie_word_embeddings=True),
    "Qwen3-4B": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True),
    "Qwen3-8B": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False),
    "Qwen3-14B": dict(hidden_size=5120, intermediate_size=17408, num_hidden_layers=40,
                      num_attention_heads=40, num_key_value_heads=8, tie_word_embeddings=False),
    "Qwen3-32B": dict(hidden_size=5120, intermediate_size=25600, num_hidden_layers=64,
                      num_attention_heads=64, num_key_value_heads=8, tie_word_embeddings=False),
}


def qwen3_config(name: str) -> Qwen3Config:
    """Our Qwen3Config for one of the published sizes, e.g. qwen3_config("Qwen3-8B")."""
    from .qwen3 import Qwen3Config
    if name not in QWEN3_CONFIGS:
        raise KeyError(f"unknown Qwen3 size {name!r}; known: {', '.join(QWEN3_CONFIGS)}")
    return Qwen3Config(vocab_size=151936, head_dim=128, rope_theta=1000000.0,
                       max_position_embeddings=40960, **QWEN3_CONFIGS[name])


def head_dim_of(cfg: ModelShape) -> int:
    """cfg.head_dim, or hidden_size / num_attention_heads for configs that leave it out."""
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def count_parameters(cfg: ModelShape, embeddings: bool = True) -> int:
    """The number of parameters of a Qwen3ForCausalLM with this config.  (Your engine: Chapter 1)

    cfg: a Qwen3Config; embeddings: whether to count the embedding table and an untied LM
    head. Returns an int, computed from the config alone (building the model is not allowed:
    Qwen3-32B's would need 130 GB).
    With embeddings=True it equals sum(p.numel() for p in Qwen3ForCausalLM(cfg).parameters()),
    which counts a tied matrix once, for every config: grouped-query attention
    (num_key_value_heads < num_attention_heads), head_dim other than hidden_size /
    num_attention_heads, attention_bias, tied or untied embeddings. With embeddings=False
    it is the "non-embedding" figure model cards quote: the same count without the
    vocab_size x hidden_size embedding table and without an untied LM head.
    """
    hidden, layers, head_dim = cfg.hidden_size, cfg.num_hidden_layers, head_dim_of(cfg)
    q_width = cfg.num_attention_heads * head_dim
    kv_width = cfg.num_key_value_heads * head_dim
    attention = 2 * hidden * q_width + 2 * hidden * kv_width      # q and o; k and v
    if getattr(cfg, "attention_bias", False):
        attention += q_width + 2 * kv_width + hidden               # biases of q, k, v and o
    norms = 2 * head_dim + 2 * hidden                              # q_norm, k_norm; two layer norms
    mlp = 3 * hidden * cfg.intermediate_size
    total = layers * (attention + norms + mlp) + hidden            # + the final norm
    if embeddings:
        tables = 1 if cfg.tie_word_embeddings else 2
        total += tables * cfg.vocab_size * hidden
    return total


def matmul_parameters(cfg: ModelShape) -> int:
    """Parameters that every token is multiplied by: all projection matrices of the layers
    plus the LM head (counted even when it is tied to the embedding, because the lookup of
    an embedding row is a copy, while the LM head is a real matrix product). Norm weights and
    biases are left out; they cost a handful of operations per channel.

    Read off count_parameters rather than counted again: a matrix has two widths and a
    vector one, so doubling every width (hidden_size, head_dim, intermediate_size,
    vocab_size) multiplies the matrices' share of the count by 4 and the vectors' by 2, and
    the two counts separate them."""
    fields = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "tie_word_embeddings")
    shape = {name: getattr(cfg, name) for name in fields}
    shape.update(attention_bias=getattr(cfg, "attention_bias", False), head_dim=head_dim_of(cfg))
    widths = ("vocab_size", "hidden_size", "intermediate_size", "head_dim")
    doubled = dict(shape, **{name: 2 * shape[name] for name in widths})
    once, twice = (count_parameters(SimpleNamespace(**s), embeddings=False) for s in (shape, doubled))
    matrices = (twice - 2 * once) // 2                     # once = matrices + vectors, twice = 4 m + 2 v
    return matrices + cfg.vocab_size * cfg.hidden_size     # the LM head, tied or not


def bytes_per_element(dtype: torch.dtype) -> int:
    """2 for torch.bfloat16, 4 for torch.float32, 1 for torch.int8 or float8 types."""
    return torch.empty((), dtype=dtype).element_size()


def weight_bytes(cfg: ModelShape, dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes the model's parameters occupy in `dtype` (a tied matrix stored once)."""
    return count_parameters(cfg) * bytes_per_element(dtype)


def flops_per_token(cfg: ModelShape, context: int = 0) -> int:
    """Forward FLOPs for one token that attends to `context` keys.  (Your engine: Chapter 2)

    cfg: any ModelShape; context >= 0: the keys the token sees, itself included (a decode
    step at position p has context p + 1). Returns an int: the FLOPs of the matrix products
    in one token's forward pass, a multiply-add counted as 2, so it equals what torch's
    FlopCounterMode counts for a decode step at that context. Counted: every projection and
    MLP matrix, the LM head (tied or not: it is a real product), and attention's scores and
    weighted sum over the visible keys. Left out: norms, RoPE, softmax, SiLU.
    Properties: linear in `context`; the part that grows with `context` depends on the query
    heads, not on the key/value heads.
    """
    attention = 4 * cfg.num_hidden_layers * cfg.num_attention_heads * head_dim_of(cfg) * context
    return 2 * matmul_parameters(cfg) + attention


def kv_bytes_per_token(cfg: ModelShape, dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes of KV cache one token occupies, over all layers.  (Your engine: Chapter 2)

    cfg: any ModelShape; dtype: the cache's element type. Returns an int: what one token
    slot of a KV cache for this model takes in `dtype`, all layers together (the reference
    KVCache's nbytes divided by its slots). Property: it depends on num_key_value_heads and
    not on num_attention_heads. Example: Qwen3-8B in bfloat16 gives 147,456 bytes.
    """
    per_layer = 2 * cfg.num_key_value_heads * head_dim_of(cfg) * bytes_per_element(dtype)
    return cfg.num_hidden_layers * per_layer


@dataclass(frozen=True)
class StepCost:
    """FLOPs done and bytes moved by one forward step (see step_cost)."""
    flops: int
    bytes: int

    @property
    def intensity(self) -> float:
        """Arithmetic intensity: FLOPs per byte moved."""
        return self.flops / self.bytes

    def time(self, hardware: Hardware) -> float:
        """Roofline lower bound in seconds: the slower of computing and moving the bytes."""
        return max(self.flops / hardware.peak_flops, self.bytes / hardware.bandwidth)

    def bound(self, hardware: Hardware) -> str:
        """'compute' when the FLOPs take longer than the bytes on `hardware`, else 'memory'."""
        return "compute" if self.intensity >= hardware.ridge else "memory"


def step_cost(cfg: ModelShape, new_tokens: int, past_tokens: int = 0, batch: int = 1,
              dtype: torch.dtype = torch.bfloat16) -> StepCost:
    """FLOPs and bytes of one forward step of a batch of sequences.  (Your engine: Chapter 2)

    Each of `batch` sequences already has `past_tokens` in its KV cache and feeds
    `new_tokens` new ones: a prefill is (prompt length, 0), a decode step is (1, length so
    far). Returns StepCost(flops, bytes), both ints.
      flops: exactly what feeding the new tokens one at a time would cost under causal
             attention, for every sequence of the batch.
      bytes: the weight matrices (those of matmul_parameters, in `dtype`) read once for the
             whole step, plus, per sequence, the K and V of all its tokens (past ones read,
             new ones written). Activations, norms and the embedding table are left out.
    Property: weight bytes are shared by every token of the step and FLOPs are not, so the
    intensity grows with the tokens in a step.
    """
    weights = 2 * matmul_parameters(cfg)
    attention_per_key = 4 * cfg.num_hidden_layers * cfg.num_attention_heads * head_dim_of(cfg)
    # sum over i = 1..n of (past + i) keys = n * past + n (n + 1) / 2
    keys_seen = new_tokens * past_tokens + new_tokens * (new_tokens + 1) // 2
    flops = batch * (new_tokens * weights + attention_per_key * keys_seen)
    moved = (matmul_parameters(cfg) * bytes_per_element(dtype)
             + batch * (past_tokens + new_tokens) * kv_bytes_per_token(cfg, dtype))
    return StepCost(flops=flops, bytes=moved)


@dataclass(frozen=True)
class Hardware:
    """An accelerator as the roofline sees it: peak dense FLOP/s and memory bytes/s."""
    name: str
    peak_flops: float
    bandwidth: float

    @property
    def ridge(self) -> float:
        """The intensity (FLOPs/byte) where the roofline bends: below it a step is memory bound."""
        return self.peak_flops / self.bandwidth

    def attainable(self, intensity: float) -> float:
        """FLOP/s reachable at a given intensity: min(peak, intensity * bandwidth)."""
        return min(self.peak_flops, intensity * self.bandwidth)


# Dense BF16 tensor-core peaks and HBM bandwidth from NVIDIA's datasheets (SXM parts; the
# datasheets quote sparse FLOPs too, which are twice these).
GPUS = {
    "A100-80GB": Hardware("A100-80GB", 312e12, 2.039e12),
    "H100-SXM": Hardware("H100-SXM", 989e12, 3.35e12),
    "H200": Hardware("H200", 989e12, 4.8e12),
}
