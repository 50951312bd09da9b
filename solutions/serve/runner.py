"""Chapter 31: the model runner (pools, swaps, one forward per step) and pool sizing."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .backends import get_backend, raw_bytes
from .batch import build_batch
from .flat_model import FlatModel

if TYPE_CHECKING:
    from ..qwen3 import Qwen3ForCausalLM
    from .backends import KVCache
    from .batch import Batch
    from .interfaces import AttentionBackend
    from .request import Request


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
    from .request import Request
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
        place = getattr(self.flat, "layer_device", None)           # layers on several devices (Chapter 40)
        make = getattr(self.flat.model, "allocate_kv", None) or self.backend.allocate
        if make is not self.backend.allocate and getattr(self.backend, "quantized", False):
            raise ValueError("this model allocates its own KV pool (latent attention, Chapter 42), which is never "
                             "quantized: use kv_cache_dtype='auto'")
        self.kv_caches: list[KVCache] = [make(shape, self.dtype, place(i) if place else self.device)
                                         for i in range(layers)]
        # request id -> per layer, host copies of its blocks
        self.swapped: dict[str, list[list[torch.Tensor]]] = {}
        self.graphs = None          # Chapter 33
        self.last_hidden: torch.Tensor | None = None     # hidden rows of the last step's logits (Chapter 37's heads)

    @property
    def pool_bytes(self) -> int:
        # A latent pool hands one tensor out as both k_cache and v_cache: count each storage once.
        unique = {t.data_ptr(): t for layer in self.kv_caches for t in layer}
        return sum(t.numel() * t.element_size() for t in unique.values())

    def swap_out(self, request: Request, blocks: list[int]) -> None:
        """Copy a preempted request's blocks to host memory (pinned on CUDA)."""
        index = torch.tensor(blocks, dtype=torch.int64, device=self.device)
        pin = self.device.type == "cuda"
        saved = []
        for layer in self.kv_caches:
            copies = []
            for tensor in layer:
                host = raw_bytes(tensor).index_select(0, index.to(tensor.device)).cpu()
                copies.append(host.pin_memory() if pin else host)
            saved.append(copies)
        self.swapped[request.request_id] = saved

    def swap_in(self, request: Request, blocks: list[int]) -> None:
        """Copy a resumed request's saved K/V into the first of its newly allocated blocks."""
        saved = self.swapped.pop(request.request_id)
        num_saved = len(saved[0][0])                   # the new list may be longer: room for new tokens
        index = torch.tensor(blocks[:num_saved], dtype=torch.int64, device=self.device)
        for layer, copies in zip(self.kv_caches, saved):
            for tensor, host in zip(layer, copies):
                raw_bytes(tensor).index_copy_(0, index.to(tensor.device), host.to(tensor.device, non_blocking=True))

    def prepare(self, scheduled: list[tuple[Request, int]], block_tables: dict[str, list[int]],
                pad_to: int | None = None, previous: object | None = None) -> Batch:
        """The step's Batch. `previous` (the in-flight step of asynchronous scheduling,
        Chapter 33) supplies tokens not yet read back; this engine is synchronous."""
        if previous is not None:
            raise ValueError("asynchronous scheduling arrives in Chapter 33")
        batch = build_batch(scheduled, block_tables, self.block_size, self.device, pad_to)
        self.prepare_features(batch, scheduled)
        return batch

    def prepare_features(self, batch: Batch, scheduled: list[tuple[Request, int]]) -> Batch:
        """Fill batch.extra with per-step inputs of later chapters (adapter slots, image rows,
        M-RoPE positions: Chapter 43). Chapter 31's requests carry none."""
        return batch

    @torch.inference_mode()
    def execute(self, batch: Batch) -> torch.Tensor:
        """One forward pass; logits [L, vocab] (float32) for batch.logits_indices only."""
        hidden = self.flat(batch.input_ids, batch.positions, self.kv_caches, batch.meta, self.backend,
                           **batch.extra)
        if batch.logits_indices.numel() == 0:
            self.last_hidden = None
            return torch.empty((0, self.flat.cfg.vocab_size), device=hidden.device)
        self.last_hidden = hidden.index_select(0, batch.logits_indices)
        return self.flat.compute_logits(self.last_hidden)
