"""Chapter 41: pipeline parallelism, the layers cut into consecutive stages.

Stage s (rank s of the group) holds layers stage_layers(...)[s] and their KV pools only.
The first stage embeds the tokens; every other stage receives the residual stream of the
stage before it ([N, D] per micro-batch) and sends its own on; the last stage applies the
final norm and the LM head. A step's flattened batch is cut into micro-batches of whole
requests, so stage 0 can compute micro-batch 2 while stage 1 computes micro-batch 1.

Every stage runs the same deterministic scheduler; the last stage's logits are broadcast
so all of them sample the same tokens (a real engine broadcasts the sampled token ids
instead: 4 bytes a request rather than a vocabulary row).
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, cast

import torch
import torch.distributed as dist

from ..serve.batch import build_batch
from ..serve.engine import EngineCore
from ..serve.flat_model import FlatModel
from ..serve.runner import ModelRunner, num_blocks_for_memory
from .tp import smallest_over_group

if TYPE_CHECKING:
    from ..qwen3 import Qwen3DecoderLayer, Qwen3ForCausalLM
    from ..serve.backends import KVCache
    from ..serve.batch import Batch, BatchMeta
    from ..serve.config import EngineConfig
    from ..serve.interfaces import AttentionBackend, StepInFlight
    from ..serve.request import Request


def stage_layers(num_layers: int, stages: int) -> list[range]:
    """Consecutive layer ranges, one per stage, sizes differing by at most one (earlier
    stages take the extra layers: the last stage also runs the LM head)."""
    if not 1 <= stages <= num_layers:
        raise ValueError(f"{num_layers} layers cannot make {stages} pipeline stages (each needs a layer)")
    base, extra = divmod(num_layers, stages)
    bounds = [0]
    for stage in range(stages):
        bounds.append(bounds[-1] + base + (1 if stage < extra else 0))
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def split_micro_batches(scheduled: list[tuple[Request, int]], count: int) -> list[list[tuple[Request, int]]]:
    """Cut a step's plan into at most `count` runs of whole requests, in the plan's order,
    balanced by tokens. The order matters: a request may read prefix blocks that an
    earlier request of the same step writes."""
    total = sum(n for _, n in scheduled)
    target = total / max(1, min(count, len(scheduled)))
    parts: list[list[tuple[Request, int]]] = [[]]
    filled = 0
    for entry in scheduled:
        if parts[-1] and filled >= target * len(parts) and len(parts) < count:
            parts.append([])
        parts[-1].append(entry)
        filled += entry[1]
    return parts


class StageModel(FlatModel):
    """The layers of one pipeline stage, run on flat rows; forward returns None except on
    the last stage, whose result is the final hidden states."""

    def __init__(self, model: Qwen3ForCausalLM, stage: int, stages: int) -> None:
        super().__init__(model)
        self.stage, self.stages = stage, stages
        self.own = stage_layers(self.cfg.num_hidden_layers, stages)[stage]
        self.sends: list[tuple[dist.Work | None, torch.Tensor]] = []   # in flight, with their tensors

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.stages - 1

    def kv_spec(self) -> tuple[int, int, int]:
        _, kv_heads, head_dim = super().kv_spec()
        return len(self.own), kv_heads, head_dim

    # None on every stage but the last: the seam Chapter 31's runner leaves for pipelines.
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,  # type: ignore[override]
                kv_caches: list[KVCache], meta: BatchMeta, backend: AttentionBackend,
                embeds: torch.Tensor | None = None) -> torch.Tensor | None:
        if self.is_first:
            stream = embeds if embeds is not None else self.backbone.embed_tokens(input_ids)
        else:
            weight = next(self.parameters())
            stream = torch.empty(input_ids.shape[0], self.cfg.hidden_size, dtype=weight.dtype, device=weight.device)
            dist.recv(stream, src=self.stage - 1)
        tables = self.rope(positions, stream.dtype)
        branch = None
        layers = cast("list[Qwen3DecoderLayer]", self.layers)
        for local, index in enumerate(self.own):
            block = layers[index]
            normed, stream = self.add_norm(block.input_layernorm, stream, branch)
            branch = self.attention(index, block.self_attn, normed, positions, tables, kv_caches[local], meta,
                                    backend)
            normed, stream = self.add_norm(block.post_attention_layernorm, stream, branch)
            branch = self.mlp(block.mlp, normed)
        if self.is_last:
            return self.add_norm(self.backbone.norm, stream, branch)[0]
        # The next stage's first add_norm would add `branch`: add it here and send one tensor.
        outgoing = (stream + branch).contiguous() if branch is not None else stream.contiguous()
        self.sends.append((dist.isend(outgoing, dst=self.stage + 1), outgoing))
        return None

    def wait_sends(self) -> None:
        for work, _ in self.sends:
            if work is not None:
                work.wait()
        self.sends.clear()


class PipelineRunner(ModelRunner):
    """A ModelRunner for one stage: pools for the stage's layers, a step run as micro-batches
    through the stages, logits broadcast from the last stage to all."""

    flat: StageModel

    def __init__(self, stage: StageModel, num_blocks: int, block_size: int,
                 backend: str | AttentionBackend = "reference", micro_batches: int = 2) -> None:
        super().__init__(stage, num_blocks, block_size, backend)
        if micro_batches < 1:
            raise ValueError(f"micro_batches must be at least 1, got {micro_batches}")
        self.micro_batches = micro_batches
        self.pieces: list[Batch] = []

    def prepare(self, scheduled: list[tuple[Request, int]], block_tables: dict[str, list[int]],
                pad_to: int | None = None, previous: StepInFlight | None = None) -> Batch:
        if previous is not None:      # the micro-batches are built from the requests' token lists
            raise ValueError("a pipeline stage runs synchronously: turn async_scheduling off")
        batch = super().prepare(scheduled, block_tables, pad_to)
        self.pieces = [build_batch(part, block_tables, self.block_size, self.device)
                       for part in split_micro_batches(scheduled, self.micro_batches)]
        return batch

    @torch.inference_mode()
    def execute(self, batch: Batch) -> torch.Tensor:
        stage, parts = self.flat, []
        for piece in self.pieces:
            hidden = stage(piece.input_ids, piece.positions, self.kv_caches, piece.meta, self.backend)
            if hidden is not None and piece.logits_indices.numel():
                parts.append(stage.compute_logits(hidden.index_select(0, piece.logits_indices)))
        stage.wait_sends()
        rows, vocab = batch.logits_indices.numel(), stage.cfg.vocab_size
        if rows == 0:                                  # every stage knows: same plan everywhere
            return torch.empty((0, vocab), device=self.device)
        logits = torch.cat(parts) if stage.is_last else torch.empty((rows, vocab), device=self.device)
        dist.broadcast(logits, src=stage.stages - 1)
        return logits


def pipeline_engine(model: Qwen3ForCausalLM, config: EngineConfig, stage: int, stages: int,
                    eos_token_id: int | None = None, micro_batches: int = 2) -> EngineCore:
    """An EngineCore running pipeline stage `stage` of `stages` (this process's rank in the
    default group). Every stage gets the same number of blocks (the smallest any stage can
    hold), or their schedulers would disagree."""
    flat = StageModel(model, stage, stages)
    layers, kv_heads, head_dim = flat.kv_spec()
    weight = next(flat.parameters())
    mine = config.num_blocks if config.num_blocks is not None else \
        num_blocks_for_memory(config.kv_cache_bytes, layers, kv_heads, head_dim, config.block_size, weight.dtype)
    config = dataclasses.replace(config, num_blocks=smallest_over_group(mine))
    def stage_runner(model: FlatModel, num_blocks: int, block_size: int, backend: AttentionBackend) -> PipelineRunner:
        return PipelineRunner(cast(StageModel, model), num_blocks, block_size, backend, micro_batches)

    return EngineCore(flat, config, eos_token_id=eos_token_id, runner=stage_runner)
