"""Chapter 33: decode steps in a few fixed shapes, replayed as CUDA graphs.

A decode step of the tiny model launches a few hundred small kernels; on a GPU each launch
costs the host several microseconds, which is longer than the kernel itself runs. A CUDA
graph records the whole step's launches once and replays them with one call. The price:
a graph replays the SAME kernels on the SAME memory addresses with the SAME shapes. So

    - decode batches are padded up to a few sizes ("buckets": 1, 2, 4, 8, ... up to
      max_num_seqs), one graph per bucket: 13 requests run in the graph captured for 16;
    - the graph's inputs live in static buffers allocated once; a step copies its batch
      into them (in place: the graph holds their addresses) and replays;
    - padding rows are the batch builder's dummy requests (token 0, position 0, slot -1,
      seq_len 0): they write only the scratch block and attend to nothing;
    - nothing inside the step may read a device value on the host (a sync a graph cannot
      contain) or take a shape from the host lists of the batch (the graph keeps the
      shapes it was captured with).

Off CUDA (EngineConfig.cuda_graphs="static"), the same class runs the same padded,
static-buffer path eagerly, so the bucket choice, the copies and the padding are tested
on any machine.

Which attention backends may be captured: a backend whose decode attention reads only
device tensors (block table, seq_lens) and whose launch shape depends on the bucket alone.
ReferenceBackend loops over the host list seq_lens_cpu and gathers each request's context
by its host length; VectorisedBackend builds its masks and gather width from the same host
lists: both would replay the lengths of the capture batch forever. Chapter 32's Triton
kernel reads seq_lens and the block table on the device and launches one tile per decode
row: it is graph-safe. Every backend declares which it is, in its `graph_safe` attribute
(serve.interfaces.AttentionBackend).
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from .batch import BatchMeta

if TYPE_CHECKING:
    from .batch import Batch
    from .compiled import CompiledDecode
    from .interfaces import AttentionBackend
    from .request import Request
    from .runner import ModelRunner

logger = logging.getLogger(__name__)


def graph_safe(backend: AttentionBackend) -> bool:
    """True when `backend` may be captured in a CUDA graph, as it declares (`graph_safe`)."""
    return bool(backend.graph_safe)


def bucket_sizes(max_batch: int) -> list[int]:
    """The batch sizes that get a graph: powers of two below max_batch, then max_batch.
    Padding wastes at most half of a step's rows, and 256 sequences need only 9 graphs."""
    if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
        raise ValueError(f"graph buckets need a max batch >= 1, got {max_batch!r}")
    sizes, size = [], 1
    while size < max_batch:
        sizes.append(size)
        size *= 2
    return sizes + [max_batch]


class GraphRunner:
    """Static buffers and one captured step per bucket for decode-only batches.

    runner: the ModelRunner whose model, pools and backend the steps use.
    max_batch: the largest bucket (EngineConfig.max_num_seqs).
    max_blocks: block-table columns of the static buffer (the most blocks one request holds).
    use_graphs: True capture CUDA graphs (CUDA and a graph-safe backend required), False
    run the static path eagerly, None choose (graphs when both hold).
    """

    def __init__(self, runner: ModelRunner, max_batch: int, max_blocks: int, use_graphs: bool | None = None) -> None:
        device = runner.device
        possible = device.type == "cuda" and graph_safe(runner.backend)
        if use_graphs and device.type != "cuda":
            raise ValueError(f"cuda_graphs='on' captures CUDA graphs and needs a CUDA device, not {device}; "
                             f"'static' runs the same padded path eagerly")
        if use_graphs and not possible:
            raise ValueError(f"attention backend {runner.backend.name!r} is not graph-safe (it reads the batch's "
                             f"host lists): CUDA graph capture needs one that declares graph_safe, such as "
                             f"Chapter 32's 'triton'")
        if use_graphs is None and device.type == "cuda" and not possible:
            logger.info("attention backend %r is not graph-safe: decode steps run the padded path eagerly",
                        runner.backend.name)
        self.runner = runner
        self.use_graphs = possible if use_graphs is None else use_graphs
        self.buckets = bucket_sizes(max_batch)
        self.max_blocks = max(1, max_blocks)
        largest = self.buckets[-1]
        # The graph's inputs: written in place every step, never reallocated.
        self.input_ids = torch.zeros(largest, dtype=torch.int64, device=device)
        self.positions = torch.zeros(largest, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((largest,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(largest, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(largest + 1, dtype=torch.int32, device=device)   # one row per request
        self.block_table = torch.zeros(largest, self.max_blocks, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}    # bucket -> (hidden, logits)
        self.runs = {"replayed": 0, "eager": 0}
        self.compiled: CompiledDecode | None = None     # EngineConfig.compile_decode (serve.compiled)

    # --- which steps ---------------------------------------------------------------------

    def bucket_for(self, num_reqs: int) -> int | None:
        """The smallest bucket holding num_reqs requests, or None when none does."""
        return next((size for size in self.buckets if size >= num_reqs), None)

    def pad_size(self, scheduled: list[tuple[Request, int]]) -> int | None:
        """pad_to for build_batch: the bucket when every scheduled request decodes one token
        and samples it; None (no padding) for any other step."""
        for request, n in scheduled:
            if n != 1 or request.spec_token_ids or request.num_computed_tokens != request.num_tokens - 1:
                return None
        return self.bucket_for(len(scheduled)) if scheduled else None

    def can_run(self, batch: Batch) -> bool:
        """A padded decode batch of a bucket's size whose sampled rows are its real rows, in order."""
        meta = batch.meta
        real = len(batch.sample_counts)
        return (not batch.has_step_inputs and not batch.prompt_spans and meta.decode_only
                and meta.num_reqs in self.buckets and sum(batch.sample_counts) == real == batch.logits_indices.numel()
                and meta.block_table.shape[1] <= self.max_blocks)

    # --- the static path -------------------------------------------------------------------

    def load_inputs(self, batch: Batch) -> int:
        """Put a padded decode batch where the graphs read it; returns its bucket size b.  (Your engine: Chapter 33)

        batch: a decode-only Batch that build_batch padded to b requests (can_run(batch) is
        True): input_ids, positions, slot_mapping [b] int64, meta.seq_lens [b] int32,
        meta.block_table [b, w] int32 with w <= self.max_blocks.
        Afterwards the first b entries of self.input_ids, self.positions, self.slot_mapping
        and self.seq_lens hold the batch's values, and the first b rows of self.block_table
        hold its table followed by zeros, never an earlier, wider table's block ids.
        self.query_start_loc is not touched (0, 1, 2, ... fits every decode batch).
        Invariant: each of these buffers is the same tensor, at the same address, before and
        after; a captured graph reads those addresses, so a buffer replaced by a new tensor
        leaves it replaying stale inputs.
        Example, self.max_blocks 4: after a step whose row 0 was [3, 8, 2, 9], a batch whose
        row 0 is [5, 1] leaves self.block_table[0] as [5, 1, 0, 0].
        Cost contract: copies on the device only, no host read of a device value.
        """
        meta = batch.meta
        size, width = meta.num_reqs, meta.block_table.shape[1]
        self.input_ids[:size].copy_(batch.input_ids)
        self.positions[:size].copy_(batch.positions)
        self.slot_mapping[:size].copy_(meta.slot_mapping)
        self.seq_lens[:size].copy_(meta.seq_lens)
        self.block_table[:size, :width].copy_(meta.block_table)
        self.block_table[:size, width:].fill_(0)
        return size

    def static_meta(self, size: int, seq_lens_cpu: list[int]) -> BatchMeta:
        """A BatchMeta over the first `size` rows of the static buffers. Its host lists are
        the ones given: the true ones on the eager path; on the captured path, the capture
        batch's, which a graph-safe backend never reads for anything that changes."""
        return BatchMeta(self.query_start_loc[:size + 1], self.seq_lens[:size], self.block_table[:size],
                         self.slot_mapping[:size], self.runner.block_size, list(range(size + 1)), list(seq_lens_cpu),
                         max_query_len=1, max_seq_len=max(seq_lens_cpu, default=0))

    def forward(self, size: int, meta: BatchMeta) -> tuple[torch.Tensor, torch.Tensor]:
        """The step on the static buffers: hidden [size, D] and logits [size, vocab] of every row."""
        if self.compiled is not None:
            return self.compiled.forward(size, meta)
        runner = self.runner
        hidden = runner.flat(self.input_ids[:size], self.positions[:size], runner.kv_caches, meta, runner.backend)
        return hidden, runner.flat.compute_logits(hidden)

    @torch.inference_mode()
    def run(self, batch: Batch) -> torch.Tensor:
        """Logits [real rows, vocab] of a batch that can_run: replayed when captured, else eager."""
        size = self.load_inputs(batch)
        if size in self.graphs:
            self.graphs[size].replay()
            hidden, logits = self.outputs[size]
            self.runs["replayed"] += 1
        else:
            hidden, logits = self.forward(size, self.static_meta(size, batch.meta.seq_lens_cpu))
            self.runs["eager"] += 1
        real = len(batch.sample_counts)
        self.runner.last_hidden = hidden[:real]
        return logits[:real]

    @torch.inference_mode()
    def capture(self) -> None:
        """Record one CUDA graph per bucket, largest first, all sharing one memory pool.

        Each bucket's step runs twice first on a side stream (kernels compile, the backend
        caches what it keys on the meta object, allocators settle), then is recorded. The
        dummy batch decodes token 0 at position 0 with slot -1 for every row: it writes
        only the scratch block. Does nothing when use_graphs is False."""
        if not self.use_graphs:
            return
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.buckets):
            self.input_ids[:size].zero_()
            self.positions[:size].zero_()
            self.slot_mapping[:size].fill_(-1)
            self.seq_lens[:size].fill_(1)          # a real row for the capture: one tile per row
            self.block_table[:size].zero_()
            meta = self.static_meta(size, [1] * size)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    self.forward(size, meta)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self.forward(size, meta)
            self.graphs[size] = graph
        self.seq_lens.zero_()
        torch.cuda.synchronize()
