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

    num_heads query heads share num_kv_heads KV heads, each KV head read by an equal,
    consecutive group of query heads; the ranks take equal consecutive shares of the query
    heads, rank 0 the first. Returns the range of KV head indices this rank's query heads
    read: every one of them, and no other (never empty; a KV head may be held by several ranks).
    Examples (heads, KV heads, world): (8, 4, 2) -> rank 1 holds range(2, 4);
    (8, 2, 4) -> ranks 0..3 hold range(0, 1), range(0, 1), range(1, 2), range(1, 2).
    Errors: ValueError naming the numbers when world or rank is out of range, when the query
    heads do not split evenly over the ranks (9 heads on 2 ranks), or when the KV heads would
    not be spread evenly: some rank holding more KV heads than another, or some KV head held
    by more ranks than another (12 heads / 3 KV heads on 2 ranks: rank 0 reads KV heads 0-1,
    rank 1 reads 1-2, so KV head 1 would sit on two ranks and the others on one).
    """
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank {rank} of a {world}-rank group does not exist")
    if num_heads % world:
        raise ValueError(f"{num_heads} query heads do not split evenly over {world} ranks")
    if num_kv_heads % world == 0:
        per_rank = num_kv_heads // world
        return range(rank * per_rank, (rank + 1) * per_rank)
    if world % num_kv_heads == 0:
        head = rank // (world // num_kv_heads)
        return range(head, head + 1)
    raise ValueError(f"{num_kv_heads} KV heads neither split over {world} ranks nor replicate onto them "
                     f"(one of the two numbers must divide the other)")


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
    """Row-parallel: this rank holds the columns `cols` of W (its slice of the input
    features) and the whole bias; every rank of the group returns the whole y."""

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
        x_full @ W.T + bias, where x_full is every rank's x side by side. The result holds
        the bias exactly once, whatever world is.
        Example (world 2, W = [[1, 1, 1, 1]], bias [10]): rank 0 given x [[1, 2]] and rank 1
        given x [[3, 4]] both return [[20.]] (1 + 2 + 3 + 4 + 10).
        Communication: one collective per call, over self.group.
        """
        partial = nn.functional.linear(x, self.weight)
        dist.all_reduce(partial, group=self.group)
        return partial if self.bias is None else partial + self.bias


class VocabParallelEmbedding(nn.Module):
    """Vocabulary-parallel: the embedding rows of ids start..stop-1 live on this rank; every
    rank of the group returns the rows of all the ids it is given."""

    def __init__(self, full: nn.Embedding, rows: slice, group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(full.weight.detach()[rows].clone(), requires_grad=False)
        self.start, self.stop = int(rows.start), int(rows.stop)
        self.group = group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids -> their embedding rows, the full table spread over the ranks.  (Your engine: Chapter 41)

        ids [N] int64, any ids of the whole vocabulary (every rank is given the same ids).
        self.weight [stop - start, D] holds the rows of ids start..stop-1 only. Returns
        [N, D] (self.weight's dtype), equal on every rank of self.group to full_table[ids],
        for every id of the vocabulary, whichever rank holds its row.
        Example (vocabulary 10 on 2 ranks: rank 0 holds rows 0-4, rank 1 rows 5-9): given
        ids [7, 2, 7], both ranks return [table[7], table[2], table[7]], no error on either.
        Communication: one collective per call, over self.group.
        """
        mine = (ids >= self.start) & (ids < self.stop)
        local = torch.where(mine, ids - self.start, torch.zeros_like(ids))
        rows = nn.functional.embedding(local, self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)
        dist.all_reduce(rows, group=self.group)
        return rows


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
    """A copy of `model` holding rank's shard of every layer.  (Your engine: Chapter 41)

    model: a loaded Qwen3ForCausalLM with dense MLPs; it is left untouched. rank, world:
    this process's place in `group` (None: the default process group). world == 1 returns
    the model itself.
    Returns a model that FlatModel, the ModelRunner and EngineCore run unchanged, such that
    when every rank of the group runs its shard on the same batch, every rank gets the
    unsplit model's logits (all of the vocabulary). Besides:
    - memory: a rank holds about 1/world of every projection, of the embedding table and
      of the LM head (the norms whole);
    - cfg: a copy that counts this rank's query heads and its KV heads (kv_heads_of_rank),
      so the pool an engine builds from it holds those KV heads only;
    - communication: one forward makes 1 + 2 * num_layers all-reduces and one all-gather;
    - capabilities.agree_num_blocks(count) -> the pool size every rank of the group agrees
      on, the smallest count any rank passes (an engine that sizes its own pool calls it).
    Errors: ValueError naming the size when the heads, the MLP's intermediate features or
    the vocabulary do not split over world, and for a layer without a dense MLP.
    """
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
