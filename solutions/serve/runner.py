"""Chapter 31: the model runner (pools, swaps, one forward per step) and pool sizing."""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from ..devices import pinned, to_device
from .backends import get_backend, raw_bytes, upload_indices
from .batch import build_batch
from .flat_model import FlatModel
from .request import PLACEHOLDER, Request

if TYPE_CHECKING:
    from ..qwen3 import Qwen3ForCausalLM
    from .backends import KVCache
    from .batch import Batch
    from .graphs import GraphRunner
    from .interfaces import AttentionBackend, StepInFlight


def distinct_pools(layer: KVCache) -> list[torch.Tensor]:
    """One layer's pool tensors, each once: a latent pool (Chapter 42) hands ONE tensor out as
    both k_cache and v_cache, and copying it twice would move its bytes twice."""
    return list({id(tensor): tensor for tensor in layer}.values())


def kv_bytes_per_block(layers: int, kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
                       pools: int = 2) -> int:
    """Bytes one block occupies across every layer: K and V (pools=2; a latent cache, one)."""
    element = torch.empty((), dtype=dtype).element_size()
    return pools * layers * block_size * kv_heads * head_dim * element


def num_blocks_for_memory(free_bytes: int, layers: int, kv_heads: int, head_dim: int, block_size: int,
                          dtype: torch.dtype, pools: int = 2) -> int:
    """How many whole blocks fit in free_bytes."""
    one_block = kv_bytes_per_block(layers, kv_heads, head_dim, block_size, dtype, pools)
    return int(free_bytes // one_block)


@torch.inference_mode()
def profile_num_blocks(flat: FlatModel, backend: AttentionBackend, block_size: int, dtype: torch.dtype,
                       device: torch.device | str, max_tokens: int, utilization: float = 0.9) -> int:
    """CUDA only: size the pool from what the GPU has left.

    With the weights loaded, run the biggest step the scheduler may build (one request of
    max_tokens tokens) against a throwaway pool just large enough for it, read the peak
    memory, and give (utilization * total - peak) to the pool, in whole blocks."""
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"profile_num_blocks measures CUDA memory; on {device} give num_blocks or kv_cache_bytes")
    layers, kv_heads, head_dim = flat.kv_spec()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    probe_blocks = -(-max_tokens // block_size)
    probe = [backend.allocate((probe_blocks + 1, block_size, kv_heads, head_dim), dtype, device)
             for _ in range(layers)]
    dummy = Request("profile", [0] * max_tokens)
    batch = build_batch([(dummy, max_tokens)], {"profile": list(range(probe_blocks))}, block_size, device)
    hidden = flat(batch.input_ids, batch.positions, probe, batch.meta, backend)
    flat.compute_logits(hidden[batch.logits_indices])
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    per_block = sum(t[0].numel() * t.element_size() for t in probe[0]) * layers
    probe_bytes = per_block * (probe_blocks + 1)
    total = torch.cuda.get_device_properties(device).total_memory
    del probe, hidden
    # The probe pool is counted in the peak but is not activation memory: give it back.
    return max(0, int((total * utilization - (peak - probe_bytes)) // per_block))


def placeholder_sources(batch: Batch, scheduled: list[tuple[Request, int]], previous: StepInFlight | None
                        ) -> tuple[list[int], list[int]]:
    """The rows of `batch` whose input is a PLACEHOLDER, and for each the row of
    previous.tokens that holds its value (asynchronous scheduling, Chapter 33). Only a
    request with placeholders (num_placeholders > 0) is looked at. RuntimeError, naming the
    request, when previous is None, has no row for it, or has no tokens yet."""
    rows: list[int] = []
    sources: list[int] = []
    for (request, n), start in zip(scheduled, batch.meta.query_start_loc_cpu):
        if not request.num_placeholders:
            continue
        computed = request.num_computed_tokens
        for offset, token in enumerate(request.token_ids[computed:computed + n]):
            if token != PLACEHOLDER:
                continue
            if previous is None or request.request_id not in previous.row_of or previous.tokens is None:
                raise RuntimeError(f"request {request.request_id!r}: its input at position {computed + offset} is a "
                                   f"placeholder, and no step in flight holds its sampled token")
            rows.append(start + offset)
            sources.append(previous.row_of[request.request_id])
    return rows, sources


def upload(batch: Batch, device: torch.device) -> Batch:
    """A batch built in host memory, on `device`: each tensor moved by devices.to_device,
    so the host does not wait for the work already queued there."""
    meta = replace(batch.meta, query_start_loc=to_device(batch.meta.query_start_loc, device),
                   seq_lens=to_device(batch.meta.seq_lens, device),
                   block_table=to_device(batch.meta.block_table, device),
                   slot_mapping=to_device(batch.meta.slot_mapping, device))
    return replace(batch, input_ids=to_device(batch.input_ids, device), positions=to_device(batch.positions, device),
                   meta=meta, logits_indices=to_device(batch.logits_indices, device))


class ModelRunner:
    """Owns the KV pools and runs one flattened batch per step.

    Each layer's pool holds num_blocks + 1 blocks: the last one is the scratch block that
    padding rows write into and the block manager never hands out."""

    def __init__(self, model: Qwen3ForCausalLM | FlatModel, num_blocks: int, block_size: int,
                 backend: str | AttentionBackend = "reference", device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        self.flat = FlatModel(model) if not isinstance(model, FlatModel) else model
        weight = next(self.flat.parameters())
        self.device = torch.device(device) if device is not None else weight.device
        self.dtype = dtype or weight.dtype
        self.backend = get_backend(backend) if isinstance(backend, str) else backend
        self.num_blocks, self.block_size = num_blocks, block_size
        layers, kv_heads, head_dim = self.flat.kv_spec()
        shape = (num_blocks + 1, block_size, kv_heads, head_dim)
        own = self.flat.capabilities.allocate_kv
        make = own or self.backend.allocate
        # Ask about `own`, not `make`: every access to a bound method makes a new object.
        if own is not None and self.backend.quantized:
            raise ValueError("this model allocates its own KV pool (latent attention, Chapter 42), which is never "
                             "quantized: use kv_cache_dtype='auto'")
        # Layers placed on several devices (Chapter 40) keep their pools beside them.
        self.kv_caches: list[KVCache] = [make(shape, self.dtype, self.flat.layer_device(i) or self.device)
                                         for i in range(layers)]
        # request id -> per layer, host copies of its blocks
        self.swapped: dict[str, list[list[torch.Tensor]]] = {}
        self.graphs: GraphRunner | None = None      # decode steps in static shapes (Chapter 33)
        self.last_hidden: torch.Tensor | None = None     # hidden rows of the last step's logits (Chapter 37's heads)

    @property
    def pool_bytes(self) -> int:
        # A latent pool hands one tensor out as both k_cache and v_cache: count each storage once.
        unique = {t.data_ptr(): t for layer in self.kv_caches for t in layer}
        return sum(t.numel() * t.element_size() for t in unique.values())

    def swap_out(self, request: Request, blocks: list[int]) -> None:
        """Copy a preempted request's blocks to host memory (pinned on CUDA and XPU): per layer,
        one host copy of each distinct pool tensor."""
        index = torch.tensor(blocks, dtype=torch.int64, device=self.device)
        saved = []
        for layer in self.kv_caches:
            copies = []
            for tensor in distinct_pools(layer):
                host = raw_bytes(tensor).index_select(0, index.to(tensor.device)).cpu()
                copies.append(pinned(host, tensor.device))     # page-locked where the device copies faster
            saved.append(copies)
        self.swapped[request.request_id] = saved

    def swap_in(self, request: Request, blocks: list[int]) -> None:
        """Copy a resumed request's saved K/V into the first of its newly allocated blocks."""
        saved = self.swapped.pop(request.request_id)
        num_saved = len(saved[0][0])                   # the new list may be longer: room for new tokens
        index = torch.tensor(blocks[:num_saved], dtype=torch.int64, device=self.device)
        for layer, copies in zip(self.kv_caches, saved):
            for tensor, host in zip(distinct_pools(layer), copies):
                raw_bytes(tensor).index_copy_(0, index.to(tensor.device), host.to(tensor.device, non_blocking=True))

    def prepare(self, scheduled: list[tuple[Request, int]], block_tables: dict[str, list[int]],
                pad_to: int | None = None, previous: StepInFlight | None = None) -> Batch:
        """The step's Batch on the runner's device; decode steps are padded to a graph bucket
        when graphs are on.

        previous: with asynchronous scheduling (Chapter 33), the step in flight. An input of
        this step may then be a PLACEHOLDER whose value exists only in previous.tokens, on
        the device: the batch is built in host memory, moved without making the host wait
        for the device (devices.to_device), and each placeholder row is filled there, on the
        device, from previous.tokens; nothing is read back. RuntimeError, naming the
        request, for a placeholder input that previous cannot fill."""
        if pad_to is None and self.graphs is not None:
            pad_to = self.graphs.pad_size(scheduled)
        if previous is None:
            batch = build_batch(scheduled, block_tables, self.block_size, self.device, pad_to)
        else:
            batch = upload(build_batch(scheduled, block_tables, self.block_size, "cpu", pad_to), self.device)
        rows, sources = placeholder_sources(batch, scheduled, previous)
        if rows:
            assert previous is not None and previous.tokens is not None     # else placeholder_sources raised
            rows_at, sources_at = upload_indices([rows, sources], self.device)
            batch.input_ids.index_copy_(0, rows_at, previous.tokens.index_select(0, sources_at))
        return self.add_step_inputs(batch, scheduled)

    def add_step_inputs(self, batch: Batch, scheduled: list[tuple[Request, int]]) -> Batch:
        """prepare_features for a step some of whose requests carry Chapter 43's inputs, and
        nothing otherwise: the engines of Chapters 31-42 never reach that chapter's stub."""
        if any(request.lora_slot or request.images is not None for request, _ in scheduled):
            self.prepare_features(batch, scheduled)
        return batch

    @torch.inference_mode()
    def prepare_features(self, batch: Batch, scheduled: list[tuple[Request, int]]) -> Batch:
        """Give every row of the step its adapter slot, image embedding and 3-axis position.  (Your engine: Chapter 43)

        scheduled [(request, n)] in batch order: request i's n rows start at row
        batch.meta.query_start_loc_cpu[i] and hold its positions c .. c + n - 1
        (c = request.num_computed_tokens). Rows past the scheduled ones are padding.
        Reads request.lora_slot and request.images (written by add_request) and sets these
        fields of batch, on the batch's device:
        - lora_ids [N] int64: each row's request.lora_slot, 0 for rows of requests without
          an adapter and for padding. Only when some request has a slot.
        - embeds [N, D] in the model's dtype: the rows of
          self.flat.backbone.embed_tokens(batch.input_ids), except that a row at position p
          with p in images.positions ([M] int64) takes the matching row of images.embeds
          ([M, D]). Only when some image row is in this step.
        - mrope_positions [3, N] int64: for a request with images, column p of
          images.mrope_positions ([3, P] over its prompt) for positions p < P and
          p + images.mrope_delta on all three axes after the prompt; every other row its
          batch.positions value on all three axes. Only when some request has images.
        Trap: a prefill chunk can cut through an image, so place exactly the image rows whose
        positions fall in [c, c + n); a request recomputed after preemption gets the same
        rows again from request.images. Returns batch.
        """
        device = batch.input_ids.device
        starts = batch.meta.query_start_loc_cpu
        spans = [(request, start, request.num_computed_tokens, n) for (request, n), start in zip(scheduled, starts)]
        if any(request.lora_slot for request, *_ in spans):
            slots = torch.zeros_like(batch.input_ids, dtype=torch.int64)
            for request, start, _, n in spans:
                slots[start:start + n] = request.lora_slot
            batch.lora_ids = slots
        with_images = [(request.images, start, computed, n) for request, start, computed, n in spans
                       if request.images is not None]
        if with_images:
            axes = batch.positions.to(torch.int64).unsqueeze(0).repeat(3, 1)
            for images, start, computed, n in with_images:
                table = images.mrope_positions
                prompt_rows = max(0, min(n, table.shape[1] - computed))
                axes[:, start:start + prompt_rows] = table[:, computed:computed + prompt_rows].to(device)
                axes[:, start + prompt_rows:start + n] += images.mrope_delta
            batch.mrope_positions = axes
        rows, values = [], []
        for images, start, computed, n in with_images:
            inside = (images.positions >= computed) & (images.positions < computed + n)
            rows.append(images.positions[inside] - computed + start)
            values.append(images.embeds[inside])
        if rows and sum(len(r) for r in rows):
            embeds = self.flat.backbone.embed_tokens(batch.input_ids)
            embeds[torch.cat(rows).to(device)] = torch.cat(values).to(device=device, dtype=embeds.dtype)
            batch.embeds = embeds
        return batch

    @torch.inference_mode()
    def execute(self, batch: Batch) -> torch.Tensor:
        """One forward pass; logits [L, vocab] (float32) for batch.logits_indices only.
        Chapter 43's step inputs: lora_ids select each row's adapter, mrope_positions [3, N]
        replace the positions, embeds the token embeddings."""
        graphs = self.graphs
        if graphs is not None and graphs.can_run(batch):  # a padded decode step, no step inputs (Chapter 33)
            return graphs.run(batch)
        bank = self.flat.adapters
        positions = batch.mrope_positions if batch.mrope_positions is not None else batch.positions
        with bank.activate(batch.lora_ids) if bank is not None else nullcontext():
            hidden = self.flat(batch.input_ids, positions, self.kv_caches, batch.meta, self.backend,
                               embeds=batch.embeds)
        if batch.logits_indices.numel() == 0:
            self.last_hidden = None
            return torch.empty((0, self.flat.cfg.vocab_size), device=hidden.device)
        # the last pipeline stage may sit on another device than the batch (Chapter 40)
        self.last_hidden = hidden.index_select(0, batch.logits_indices.to(hidden.device))
        return self.flat.compute_logits(self.last_hidden)

    def enable_graphs(self, max_batch: int, max_model_len: int, mode: str = "auto", compile: bool = False) -> None:
        """Run decode steps through a GraphRunner (Chapter 33): mode "on" captures CUDA graphs,
        "off" runs the padded static path eagerly, "auto" captures when it can; compile: its
        forward is torch.compile'd per bucket (serve.compiled), and captured when graphs are on."""
        from .graphs import GraphRunner
        capture = {"on": True, "off": False}.get(mode)              # None: the GraphRunner decides
        widest = min(-(-max_model_len // self.block_size), self.num_blocks)    # no request holds more blocks
        self.graphs = GraphRunner(self, max_batch, widest, capture)
        if compile:
            from .compiled import CompiledDecode
            self.graphs.compiled = CompiledDecode(self.graphs)
        self.graphs.capture()
