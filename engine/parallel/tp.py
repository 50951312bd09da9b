"""Chapter 41: tensor parallelism, every layer split across the ranks of one group.

A Qwen3 layer splits with exactly two all-reduces, and the rest of the engine does not
notice:

    q_proj, k_proj, v_proj   column-parallel: each rank computes its own heads' columns
    attention                local: a rank's query heads read only its own KV heads
    o_proj                   row-parallel: partial sums of the hidden state -> ALL-REDUCE
    gate_proj, up_proj       column-parallel: a slice of the intermediate features
    down_proj                row-parallel -> ALL-REDUCE
    embed_tokens             vocabulary-parallel: each rank owns a range of rows -> ALL-REDUCE
    lm_head                  vocabulary-parallel: each rank scores its range -> ALL-GATHER

`shard_model` returns a copy of a loaded model in which those modules are replaced and the
config counts this rank's heads only, so FlatModel, the ModelRunner (whose pool now holds
this rank's KV heads only) and EngineCore run it unchanged. Every rank runs the same
deterministic scheduler on the same requests; the logits every rank samples from are the
same all-gathered tensor, so the ranks agree on every token without sending a plan.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import nn

if TYPE_CHECKING:
    from ..qwen3 import Qwen3ForCausalLM


def kv_heads_of_rank(num_heads: int, num_kv_heads: int, rank: int, world: int) -> range:
    """Which KV heads rank `rank` of `world` holds in its pool.  (Your engine: Chapter 41)

    num_heads query heads share num_kv_heads KV heads in groups of num_heads // num_kv_heads;
    rank r owns the query heads [r * h, (r + 1) * h) with h = num_heads // world, and must
    hold every KV head those queries read, and no other.
    - num_kv_heads % world == 0: the KV heads are split, num_kv_heads // world per rank,
      consecutive (rank 0 the first ones).
    - world % num_kv_heads == 0 (fewer KV heads than ranks): each KV head is REPLICATED on
      world // num_kv_heads consecutive ranks; every rank holds exactly one.
    Returns a range of KV head indices (never empty).
    Raises ValueError naming the numbers when num_heads % world != 0, or when neither rule
    applies (e.g. 9 heads / 3 KV heads on 2 ranks), or when world or rank is out of range.
    """
    raise NotImplementedError("Your engine: Chapter 41: kv_heads_of_rank")


def even_slice(size: int, rank: int, world: int, what: str) -> slice:
    """Rank's contiguous share of `size` items; ValueError when they do not divide evenly."""
    if size % world:
        raise ValueError(f"{what} ({size}) does not split evenly over {world} ranks")
    share = size // world
    return slice(rank * share, (rank + 1) * share)


class ColumnParallelLinear(nn.Module):
    """y[:, cols] = x @ W[cols].T: this rank's output features only; no communication."""

    def __init__(self, full: nn.Linear, rows: slice) -> None:
        super().__init__()
        self.weight = nn.Parameter(full.weight.detach()[rows].clone(), requires_grad=False)
        self.bias = None if full.bias is None else nn.Parameter(full.bias.detach()[rows].clone(),
                                                                requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = sum over ranks of x[:, cols_r] @ W[:, cols_r].T, plus the bias once."""

    def __init__(self, full: nn.Linear, cols: slice, group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(full.weight.detach()[:, cols].clone(), requires_grad=False)
        self.bias = None if full.bias is None else nn.Parameter(full.bias.detach().clone(), requires_grad=False)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The full output from this rank's slice of the input features.  (Your engine: Chapter 41)

        x [N, in_features // world]: the slice of the input this rank computed (its heads'
        attention output, or its share of the MLP's intermediate features).
        self.weight [out_features, in_features // world]: the matching columns of W;
        self.bias [out_features] or None: the WHOLE bias.
        Returns y [N, out_features], the same tensor on every rank of self.group:
        x_full @ W.T + bias, where x_full is every rank's x side by side.
        Trap: the bias belongs to the sum, not to each rank's part: added world times it
        would be wrong by (world - 1) * bias. Exactly one collective per call.
        """
        raise NotImplementedError("Your engine: Chapter 41: RowParallelLinear.forward")


class VocabParallelEmbedding(nn.Module):
    """Embedding rows [start, stop) of the vocabulary live on this rank."""

    def __init__(self, full: nn.Embedding, rows: slice, group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(full.weight.detach()[rows].clone(), requires_grad=False)
        self.start, self.stop = int(rows.start), int(rows.stop)
        self.group = group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids -> their embedding rows, the full table spread over the ranks.  (Your engine: Chapter 41)

        ids [N] int64, any ids of the whole vocabulary. self.weight [stop - start, D] holds
        the rows of ids start..stop-1 only. Returns [N, D] (self.weight's dtype), equal on
        every rank of self.group to full_table[ids].
        Traps: an id outside [start, stop) must neither index out of range nor contribute
        anything here (another rank owns it); exactly one collective per call.
        """
        raise NotImplementedError("Your engine: Chapter 41: VocabParallelEmbedding.forward")


class VocabParallelLMHead(nn.Module):
    """Each rank scores its vocabulary range; an all-gather puts the full row together, so
    every rank samples from the same logits (and so makes the same choice)."""

    def __init__(self, full: nn.Linear, rows: slice, world: int, group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(full.weight.detach()[rows].clone(), requires_grad=False)
        self.world, self.group = world, group

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        local = nn.functional.linear(hidden, self.weight).contiguous()
        pieces = [torch.empty_like(local) for _ in range(self.world)]
        dist.all_gather(pieces, local, group=self.group)
        return torch.cat(pieces, dim=-1)


def all_reduces_per_step(num_layers: int) -> int:
    """Collectives in one tensor-parallel forward: the embedding, two per layer (o_proj and
    down_proj); the LM head's all-gather is one more, counted apart."""
    return 1 + 2 * num_layers


def smallest_over_group(count: int, group: dist.ProcessGroup | None = None) -> int:
    """The smallest `count` any rank of `group` passes in, on every rank (one all-reduce).

    The engine sizes its pool from this process's memory, and GPUs of one machine rarely
    report the same free bytes; but every rank runs its own copy of the scheduler on the
    same requests, and two pools of different sizes would preempt at different steps and
    then wait forever in collectives of different shapes. So the ranks agree on the pool
    that fits on all of them (gloo reduces CPU tensors; NCCL, tensors on this rank's GPU)."""
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"
    agreed = torch.tensor([count], dtype=torch.int64, device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=group)
    return int(agreed.item())


def shard_model(model: Qwen3ForCausalLM, rank: int, world: int,
                group: dist.ProcessGroup | None = None) -> Qwen3ForCausalLM:
    """A copy of `model` holding rank's shard of every layer (the original is untouched).

    Its config counts this rank's query and KV heads, so the engine's pool for it holds
    rank's KV heads only; its agree_num_blocks (smallest_over_group) makes an engine that
    sizes its own pool take the size every rank can hold. Raises ValueError when a size
    does not split over `world`."""
    cfg = model.cfg
    if world == 1:
        return model
    kv_heads = kv_heads_of_rank(cfg.num_attention_heads, cfg.num_key_value_heads, rank, world)
    dim = cfg.head_dim
    heads = even_slice(cfg.num_attention_heads * dim, rank, world, "the query heads' features")
    kv_rows = slice(kv_heads.start * dim, kv_heads.stop * dim)
    vocab = even_slice(cfg.vocab_size, rank, world, "the vocabulary")
    sharded: Any = copy.deepcopy(model)          # its modules are replaced by other types below
    for layer in sharded.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if not all(hasattr(mlp, name) for name in ("gate_proj", "up_proj", "down_proj")):
            raise ValueError(f"layer {attn.layer_idx}: only dense MLPs are split here; a mixture of experts "
                             f"is split by experts (expert parallelism), not in this chapter")
        attn.q_proj = ColumnParallelLinear(attn.q_proj, heads)
        attn.k_proj = ColumnParallelLinear(attn.k_proj, kv_rows)
        attn.v_proj = ColumnParallelLinear(attn.v_proj, kv_rows)
        attn.o_proj = RowParallelLinear(attn.o_proj, heads, group)
        features = even_slice(mlp.gate_proj.out_features, rank, world, "the MLP's intermediate features")
        mlp.gate_proj = ColumnParallelLinear(mlp.gate_proj, features)
        mlp.up_proj = ColumnParallelLinear(mlp.up_proj, features)
        mlp.down_proj = RowParallelLinear(mlp.down_proj, features, group)
    sharded.lm_head = VocabParallelLMHead(model.lm_head, vocab, world, group)
    sharded.model.embed_tokens = VocabParallelEmbedding(model.model.embed_tokens, vocab, group)
    sharded.cfg = dataclasses.replace(cfg, num_attention_heads=cfg.num_attention_heads // world,
                                      num_key_value_heads=len(kv_heads))
    sharded.capabilities = dataclasses.replace(sharded.capabilities,
                                               agree_num_blocks=functools.partial(smallest_over_group, group=group))
    return cast("Qwen3ForCausalLM", sharded)
