"""Chapter 19: a decoder for one request whose decode step never changes shape.

Chapter 17's `generate` builds a fresh input tensor every step and lets the cache hand
attention a slice that grows by one key per step. Every step is therefore a little
different, which is fine for eager PyTorch and fatal for CUDA graphs: a graph replays the
exact kernels it recorded, with the exact pointers and shapes it recorded.

FastDecoder makes the step static:
  * the KV cache is allocated once for `max_len` tokens and attention always reads all of
    it; the causal rule (key slot <= query position) hides the slots not written yet;
  * how full the cache is lives on the device (`StaticKVCache.length`, a tensor), so the
    slot a step writes and the RoPE position it uses are computed by kernels, not baked
    into the recording as Python numbers;
  * the token to feed is copied into a preallocated `input_ids` buffer and the logits come
    out in a preallocated `logits` buffer.
On a GPU the decode step is then captured once as a torch.cuda.CUDAGraph and replayed:
hundreds of kernel launches become one. On a CPU the same static step runs eagerly.
"""
from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from .kv_cache import KVCache
from .sampling import sample

if TYPE_CHECKING:
    from .qwen3 import Qwen3ForCausalLM


class StaticKVCache(KVCache):
    """A KVCache whose fill level is a device tensor: `length` is int64 [batch].

    The buffers are KVCache's ([batch, kv_heads, max_len, head_dim] per layer, allocated
    once). Because `length` is a tensor, Qwen3Model gives each row the slots
    length[b] .. length[b] + T - 1 and the RoPE positions to match, all computed on the
    device, so a recorded step stays correct as the sequence grows.
    """
    length: torch.Tensor                    # type: ignore[assignment]  # KVCache keeps an int

    def __init__(self, num_layers: int, batch: int, kv_heads: int, head_dim: int, max_len: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        super().__init__(num_layers, batch, kv_heads, head_dim, max_len, dtype, device)
        self.length = torch.zeros(batch, dtype=torch.long, device=device)
        self.offsets = torch.arange(max_len, device=device)       # 0 .. max_len - 1, made once

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v [batch, kv_heads, T, head_dim] at each row's slots length[b] .. length[b] + T - 1
        and return the WHOLE buffers k[layer], v[layer] ([batch, kv_heads, max_len, head_dim]).
        (Your engine: Chapter 19)

        layer: the layer index; k, v in the cache's dtype and device. Afterwards row b of layer
        `layer` holds the new entries at slots length[b] .. length[b] + T - 1; nothing else
        changed; `length` has NOT moved (the model calls advance() after the last layer).
        Returns the full max_len buffers (static shapes); the slots not written yet are never
        seen, because the model's causal mask allows key slot j only when j <= the query's slot.
        Traps that are the contract (a CUDA graph records this function): everything stays on
        the device: no int(self.length), no .item(), no Python slice whose bounds depend on the
        length (a slice bakes one length into the recorded graph, and reading the tensor on the
        host forces a synchronisation). Bounds are the caller's job (FastDecoder keeps a
        host-side count).
        """
        new = k.shape[2]
        slots = self.length[:, None] + self.offsets[:new]             # [batch, T]
        index = slots[:, None, :, None].expand_as(k)                  # [batch, kv_heads, T, head_dim]
        self.k[layer].scatter_(2, index, k)
        self.v[layer].scatter_(2, index, v)
        return self.k[layer], self.v[layer]

    def advance(self, num_tokens: int) -> None:
        self.length.add_(num_tokens)            # in place: a recorded graph keeps this tensor

    def truncate(self, length: int) -> None:
        """Set every row's length (in place). No bounds check against the old length: that
        would read the device tensor; callers know how full they made the cache."""
        if not 0 <= length <= self.max_len:
            raise ValueError(f"cannot set a {self.max_len}-slot cache to length {length}")
        self.length.fill_(length)


class FastDecoder:
    """Greedy (or sampled) generation for ONE request with static buffers and, on a GPU, a
    CUDA graph of the decode step.

    max_len bounds prompt plus output (capped at the model's context limit). One decoder
    serves any number of requests in turn: `generate` resets the cache each time, and the
    recorded graph is reused, since it reads whatever the buffers hold when it replays.
    use_cuda_graph: default True on CUDA, False elsewhere (a CPU has no graphs to replay).
    """

    def __init__(self, model: Qwen3ForCausalLM, max_len: int, use_cuda_graph: bool | None = None) -> None:
        weight = next(model.parameters())
        cfg = model.cfg
        self.model = model
        self.device = weight.device
        self.max_len = min(max_len, getattr(model, "context_limit", max_len))
        if self.max_len < 2:
            raise ValueError("FastDecoder needs room for at least two tokens")
        with torch.inference_mode():
            self.cache = StaticKVCache(cfg.num_hidden_layers, 1, cfg.num_key_value_heads, cfg.head_dim,
                                       self.max_len, weight.dtype, self.device)
            self.input_ids = torch.zeros(1, 1, dtype=torch.long, device=self.device)
            self.logits = torch.zeros(cfg.vocab_size, dtype=torch.float32, device=self.device)
        self.filled = 0                         # host-side copy of cache.length (never read back)
        if use_cuda_graph is None:
            use_cuda_graph = self.device.type == "cuda"
        self.graph: torch.cuda.CUDAGraph | None = None
        if use_cuda_graph:
            self.capture()

    def _decode_forward(self) -> None:
        """The step body: the only code a CUDA graph records. Reads input_ids and the cache,
        writes one K/V slot per layer, advances cache.length, fills self.logits."""
        self.logits.copy_(self.model(self.input_ids, cache=self.cache)[0, -1])

    @torch.inference_mode()
    def capture(self) -> None:
        """Record one decode step into self.graph (CUDA only).

        Warm-up runs go first, on a side stream as PyTorch requires: the first calls of a
        kernel may allocate workspaces or pick algorithms, which must not happen while
        recording. Warm-ups write real K/V at slot 0 and advance the length, so the length
        is reset afterwards; the next prefill overwrites the slot. Recording itself runs
        nothing: it only notes what the kernels would do.
        """
        if self.device.type != "cuda":
            raise RuntimeError("CUDA graphs need a CUDA device")
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(3):
                self.cache.truncate(0)
                self._decode_forward()
        torch.cuda.current_stream(self.device).wait_stream(side)
        self.cache.truncate(0)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self._decode_forward()
        self.filled = 0

    @torch.inference_mode()
    def prefill(self, prompt_ids: Sequence[int]) -> torch.Tensor:
        """Start a request: empty the cache, run the whole prompt (list of ints) in one
        eager forward call, and return the logits of its last position (self.logits, [V]).

        The prompt's length changes from request to request, so prefill is not recorded;
        it runs through the same static cache (model(ids [1, P], cache=self.cache) writes
        slots 0 .. P - 1). Keep self.filled in step with the cache. Raise ValueError for an
        empty prompt or one that does not fit in max_len.
        """
        if not 0 < len(prompt_ids) <= self.max_len:
            raise ValueError(f"a {len(prompt_ids)}-token prompt does not fit a {self.max_len}-token FastDecoder")
        self.cache.truncate(0)
        ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=self.device)
        self.logits.copy_(self.model(ids, cache=self.cache)[0, -1])
        self.filled = len(prompt_ids)
        return self.logits

    @torch.inference_mode()
    def step(self, token: int | torch.Tensor) -> torch.Tensor:
        """Feed one token at the next position; return the logits that follow it (self.logits, [V]).
        (Your engine: Chapter 19)

        token: a Python int or a one-element tensor on the decoder's device (what sample()
        returns: feeding it must not need a trip through the host).
        Interfaces: `self._decode_forward() -> None` runs the model on self.input_ids [1, 1]
        at the cache's position and writes self.logits; `self.graph` (a CUDAGraph or None) is
        that same call captured, replayed with `self.graph.replay()`.
        Afterwards self.filled is one more, and self.input_ids and self.logits are the same
        tensor objects as before (a captured graph reads and writes exactly those storages).
        Raises ValueError, changing nothing, when all max_len slots are already used.
        """
        if self.filled >= self.max_len:
            raise ValueError(f"FastDecoder is full: all {self.max_len} slots are used")
        if isinstance(token, torch.Tensor):
            self.input_ids.copy_(token.reshape(1, 1))
        else:
            self.input_ids.fill_(int(token))
        if self.graph is not None:
            self.graph.replay()
        else:
            self._decode_forward()
        self.filled += 1
        return self.logits

    @torch.inference_mode()
    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, eos_token_id: int | None = None,
                 stop_token_ids: Iterable[int] = (), **sampling: Any) -> list[int]:
        """Continue prompt_ids by up to max_new_tokens; return the new tokens (list of ints).
        (Your engine: Chapter 19)

        Same contract as Chapter 17's generate and the same output token for token (sampling
        options as Chapter 8's sample, greedy by default), computed with this decoder's
        prefill and step only, so a captured graph serves every decode. Stops after
        max_new_tokens, after eos_token_id or a stop token (which is part of the output), or
        once prompt plus output reach max_len (that last token is returned but never fed, as
        in generate). A prompt of max_len tokens or more yields no tokens.
        """
        stops = set(stop_token_ids)
        if eos_token_id is not None:
            stops.add(eos_token_id)
        out: list[int] = []
        if max_new_tokens <= 0 or len(prompt_ids) >= self.max_len:
            return out
        logits = self.prefill(prompt_ids)
        while True:
            token = sample(logits, **sampling)
            out.append(int(token))
            if len(out) >= max_new_tokens or out[-1] in stops or self.filled + 1 >= self.max_len:
                return out
            logits = self.step(token)


@torch.inference_mode()
def step_latencies(model: Qwen3ForCausalLM, prompt_ids: Sequence[int], num_steps: int,
                   decoder: FastDecoder | None = None) -> list[float]:
    """Seconds taken by each of num_steps greedy decode steps after prefilling prompt_ids.

    decoder=None times Chapter 17's way of decoding: a fresh [1, 1] input tensor per step
    and a KVCache whose attention slice grows by one key per step. With a FastDecoder,
    its prefill and step. Each sample covers feeding one token and getting its logits,
    synchronised on CUDA, so the two paths are timed alike.
    """
    device = next(model.parameters()).device
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    if decoder is None:
        cache = KVCache.for_model(model, 1, len(prompt_ids) + num_steps)
        logits = model(torch.tensor([list(prompt_ids)], device=device), cache=cache)[0, -1]

        def feed_eager(token: int | torch.Tensor) -> torch.Tensor:
            return model(torch.tensor([[int(token)]], device=device), cache=cache)[0, -1]
        feed = feed_eager
    else:
        logits, feed = decoder.prefill(prompt_ids), decoder.step
    times: list[float] = []
    for _ in range(num_steps):
        token = sample(logits)
        sync()
        start = time.perf_counter()
        logits = feed(token)
        sync()
        times.append(time.perf_counter() - start)
    return times
