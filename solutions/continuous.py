"""Chapter 24: continuous batching over a static cache of fixed-size rows ("slots").

Static batching (Chapter 21) starts a batch together and ends it together: a request that
finishes early leaves its row idle until the longest one is done, and a request that arrives
late waits for the whole batch. Continuous batching decides again at every step. Each
request owns one row (a slot) of a preallocated cache for as long as it runs; the moment it
finishes, its slot is handed to the next waiting request, while the others keep decoding.

Per step the engine makes
  * one forward call per request that is still prefilling (one chunk of its prompt, on a
    view of its own row), and
  * ONE forward call for every request that is decoding: their newest tokens form a
    [num_decoding, 1] batch over their rows of the cache, each row at its own length.

The second point is what the model's per-row cache lengths are for: with `cache.length` a
tensor [B], Qwen3Model gives row b the slot cache.length[b] and RoPE position
cache.length[b], and causal attention hides the keys beyond each row's own length, so rows
of different lengths share one call without padding the queries.

The price of this design is memory: every slot reserves slot_len tokens of K/V whether its
request uses 20 of them or 300. Chapter 25 removes that waste with a paged cache.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from .workloads import WorkItem, run_to_completion

if TYPE_CHECKING:
    from .qwen3 import Qwen3ForCausalLM


class SlotKVCache:
    """K/V of `num_slots` sequences of at most `slot_len` tokens, one row each.

    Per layer: k[layer], v[layer] of shape [num_slots, kv_heads, slot_len, head_dim].
    lengths[s] (host ints) counts the filled positions of slot s. The model never sees this
    object directly: `rows(slot_ids)` returns a view over some rows that speaks the cache
    protocol Qwen3Model expects (length, update, advance).
    """

    def __init__(self, num_layers: int, num_slots: int, kv_heads: int, head_dim: int, slot_len: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        shape = (num_slots, kv_heads, slot_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.num_slots, self.slot_len = num_slots, slot_len
        self.device = torch.device(device)
        self.lengths = [0] * num_slots

    @classmethod
    def for_model(cls, model: Qwen3ForCausalLM, num_slots: int, slot_len: int) -> SlotKVCache:
        cfg, weight = model.cfg, next(model.parameters())
        return cls(cfg.num_hidden_layers, num_slots, cfg.num_key_value_heads, cfg.head_dim, slot_len,
                   weight.dtype, weight.device)

    def rows(self, slot_ids: Iterable[int]) -> SlotRows:
        return SlotRows(self, list(slot_ids))

    def reset(self, slot: int) -> None:
        """Forget slot's contents (its stale keys stay in memory but lie beyond length 0)."""
        self.lengths[slot] = 0

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


class SlotRows:
    """A view of some rows of a SlotKVCache, in the order given, as one batch for the model.

    With one row, `length` is a plain int and the view is that row's slice of the cache (a
    prefill chunk, or a lone decoder). With several, `length` is a long tensor [B] of the
    rows' own lengths, which makes the model place every row's tokens at that row's end.
    """

    def __init__(self, cache: SlotKVCache, slot_ids: list[int]) -> None:
        self.cache, self.slot_ids = cache, slot_ids
        self._index = torch.tensor(slot_ids, dtype=torch.long, device=cache.device)
        self._starts = [cache.lengths[s] for s in slot_ids]

    @property
    def length(self) -> int | torch.Tensor:
        if len(self.slot_ids) == 1:
            return self._starts[0]
        return torch.tensor(self._starts, dtype=torch.long, device=self.cache.device)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store each row's new keys/values at that row's own length and return every row's
        keys/values so far.  (Your engine: Chapter 24)

        layer: the layer index; k, v: [B, kv_heads, T, head_dim] in the cache's dtype, row b
        belonging to slot slot_ids[b], whose filled length before this step is self._starts[b].
        Afterwards: in layer `layer` of cache.k / cache.v, slot slot_ids[b] holds row b's T new
        entries at positions starts[b] .. starts[b] + T - 1; nothing else in the cache changed;
        cache.lengths are NOT moved (advance() does that once every layer has written).
        Returns (keys, values), each [B, kv_heads, Tk, head_dim] with Tk = max(starts) + T: row b
        holds slot slot_ids[b]'s positions 0 .. Tk - 1. Positions past a row's own end hold
        stale data from earlier requests; that is allowed, because causal attention hides every
        key whose slot lies beyond the query's slot.
        Errors: ValueError naming the slot when a row would overflow slot_len, raised before
        anything is written.
        Cost: a single-row call (the usual prefill) should not copy the slot's history.
        """
        length = k.shape[2]
        end = max(self._starts) + length
        for slot, start in zip(self.slot_ids, self._starts):
            if start + length > self.cache.slot_len:
                raise ValueError(f"slot {slot} holds {self.cache.slot_len} tokens; "
                                 f"{start + length} requested")
        keys, values = self.cache.k[layer], self.cache.v[layer]
        if len(self.slot_ids) == 1:
            slot, start = self.slot_ids[0], self._starts[0]
            keys[slot:slot + 1, :, start:end] = k
            values[slot:slot + 1, :, start:end] = v
            return keys[slot:slot + 1, :, :end], values[slot:slot + 1, :, :end]
        starts = torch.tensor(self._starts, dtype=torch.long, device=keys.device)
        positions = starts[:, None] + torch.arange(length, device=keys.device)   # [B, T]
        slots = self._index[:, None]                                             # [B, 1]
        # Two advanced indices around a slice: the result axes are [B, T, kv_heads, D].
        keys[slots, :, positions] = k.transpose(1, 2)
        values[slots, :, positions] = v.transpose(1, 2)
        return keys[:, :, :end].index_select(0, self._index), values[:, :, :end].index_select(0, self._index)

    def advance(self, num_tokens: int) -> None:
        for slot in self.slot_ids:
            self.cache.lengths[slot] += num_tokens


PREFILL, DECODE = "prefill", "decode"


@dataclass(eq=False)
class SlotRequest:
    """A request's state inside the engine."""
    request_id: str
    prompt_ids: list[int]
    max_new_tokens: int
    stop_token_ids: tuple[int, ...] = ()
    slot: int = -1                         # its row of the cache, from admission on
    num_prefilled: int = 0                 # prompt tokens whose K/V are in the slot
    output_ids: list[int] = field(default_factory=list)

    @property
    def phase(self) -> str:
        return PREFILL if self.num_prefilled < len(self.prompt_ids) else DECODE


class ContinuousBatchingEngine:
    """Serve many requests at once, each in its own slot of a static cache.

    model: a Qwen3ForCausalLM (or anything with the same forward and cache protocol).
    num_slots: how many requests run at once; slot_len: tokens per slot (prompt plus output
    must fit). chunk_size: prompt tokens per prefill call (None: the whole prompt at once).
    eos_token_id: ends any request that emits it (defaults to the model config's).
    Greedy decoding: every request's output equals solo `generate` on its prompt.
    """

    def __init__(self, model: Qwen3ForCausalLM, num_slots: int = 8, slot_len: int = 320,
                 chunk_size: int | None = None, eos_token_id: int | None = None) -> None:
        if chunk_size is not None and chunk_size < 1:
            raise ValueError(f"chunk_size must be positive, got {chunk_size}")
        self.model = model
        from .devices import prepack_linears
        prepack_linears(model)              # on a CPU: weights laid out once for oneDNN (Chapter 32)
        self.num_slots, self.slot_len, self.chunk_size = num_slots, slot_len, chunk_size
        self.eos_token_id = eos_token_id if eos_token_id is not None else getattr(model.cfg, "eos_token_id", None)
        self.device = next(model.parameters()).device
        self.cache = SlotKVCache.for_model(model, num_slots, slot_len)
        self.limit = getattr(model, "context_limit", 1 << 30)
        self.waiting: deque[SlotRequest] = deque()
        self.slots: list[SlotRequest | None] = [None] * num_slots   # slot -> SlotRequest running in it
        self.steps = 0
        self.forward_calls = 0

    # -- the public API -----------------------------------------------------------------
    def add_request(self, request_id: str, prompt_ids: Iterable[int], max_new_tokens: int,
                    stop_token_ids: Iterable[int] = ()) -> None:
        """Queue a request. It is admitted at a step when a slot is free (first come, first served)."""
        prompt_ids = [int(t) for t in prompt_ids]
        if not prompt_ids:
            raise ValueError(f"{request_id}: empty prompt")
        if max_new_tokens < 1:
            raise ValueError(f"{request_id}: max_new_tokens must be at least 1")
        # The last output token is never fed back, so prompt + max_new - 1 positions are stored.
        need = len(prompt_ids) + max_new_tokens - 1
        if need > self.slot_len:
            raise ValueError(f"{request_id}: needs {need} cache positions "
                             f"({len(prompt_ids)} prompt + {max_new_tokens} new - 1) but a slot holds {self.slot_len}")
        self.waiting.append(SlotRequest(request_id, prompt_ids, max_new_tokens, tuple(stop_token_ids)))

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting) or any(r is not None for r in self.slots)

    @property
    def running(self) -> list[SlotRequest]:
        return [r for r in self.slots if r is not None]

    def step(self) -> list[tuple[str, list[int], bool]]:
        """One engine step: admit waiting requests, give every running request one piece of
        work, retire the finished ones.  (Your engine: Chapter 24)

        Admission, first: each free slot (self.slots[s] is None) takes a waiting request, the
        oldest first (self.waiting is in arrival order), as many as there are free slots and
        waiting requests, never more; a running request keeps its slot. An admitted request
        records its slot (request.slot) and starts on an empty slot (cache length 0).
        Work: each running request gets exactly one piece of work, decided by its phase once
        admission is done: every DECODE request one token, all of them through ONE call of
        self._decode; every PREFILL request one chunk (self._prefill_chunk), which yields a
        token only when it completes the prompt. A request therefore gets at most one token
        per step, and a mid-prompt chunk none.
        Retirement: every new token goes through self._emit; a request it reports finished
        gives its slot back in this same step (self.slots[its slot] = None), so the slot is
        admitted at the next step and the finished request is never run again.
        Returns one (request_id, [token], finished) per request that got a token, in any
        order; [] when nothing ran. Afterwards self.steps is one more, and every request is
        in exactly one place: waiting (arrival order kept), running in the slot it names
        (that slot's cache length = the request's tokens in the cache), or finished (reported
        finished exactly once, in no slot).
        """
        for slot in range(self.num_slots):
            if self.slots[slot] is None and self.waiting:
                request = self.waiting.popleft()
                request.slot = slot
                self.cache.reset(slot)
                self.slots[slot] = request
        decoding = [r for r in self.running if r.phase == DECODE]
        prefilling = [r for r in self.running if r.phase == PREFILL]
        new_tokens = list(zip(decoding, self._decode(decoding))) if decoding else []
        for request in prefilling:
            first = self._prefill_chunk(request)
            if first is not None:
                new_tokens.append((request, first))
        events: list[tuple[str, list[int], bool]] = []
        for request, token in new_tokens:
            event = self._emit(request, token)
            if event[2]:
                self.slots[request.slot] = None
            events.append(event)
        self.steps += 1
        return events

    def run(self, items: Iterable[WorkItem]) -> dict[str, list[int]]:
        """Serve WorkItems (Chapter 22) to completion; returns {request_id: output token ids}."""
        return run_to_completion(self, items)

    # -- the parts of a step --------------------------------------------------------------
    def _forward(self, token_rows: list[list[int]], slot_ids: list[int]) -> torch.Tensor:
        """One model call on token_rows [B, T] over the given slots; logits of the last position [B, V]."""
        self.forward_calls += 1
        ids = torch.tensor(token_rows, dtype=torch.long, device=self.device)
        with torch.inference_mode():
            logits = self.model(ids, cache=self.cache.rows(slot_ids))
        return logits[:, -1]

    @staticmethod
    def _pick(logits: torch.Tensor) -> list[int]:
        """Greedy choice per row: argmax, lowest id on ties (as sampling.sample does)."""
        return [int(t) for t in logits.argmax(dim=-1)]

    def _prefill_chunk(self, request: SlotRequest) -> int | None:
        """Run the next chunk of one request's prompt through the model on its own slot.
        (Your engine: Chapter 24)

        request: a SlotRequest holding a slot, with num_prefilled < len(prompt_ids) prompt tokens
        already in that slot's cache. The chunk is the next min(chunk_size, rest) prompt tokens
        (the whole rest when chunk_size is None), run in one model call through
        self._forward on the request's slot.
        Afterwards: the slot's cache holds the chunk's keys and values after the earlier ones
        (its length grew by the chunk's length) and request.num_prefilled grew by the same.
        Returns the request's first output token (an int, the greedy choice self._pick makes)
        when this chunk completes the prompt, else None (a mid-prompt chunk's logits predict a
        token the prompt already contains, so they are not used).
        """
        start = request.num_prefilled
        end = len(request.prompt_ids) if self.chunk_size is None else min(len(request.prompt_ids),
                                                                           start + self.chunk_size)
        logits = self._forward([request.prompt_ids[start:end]], [request.slot])
        request.num_prefilled = end
        if end < len(request.prompt_ids):
            return None
        return self._pick(logits)[0]

    def _decode(self, requests: list[SlotRequest]) -> list[int]:
        """One forward call for all decoding requests: each feeds its newest output token (not
        yet in its slot) on its own slot; returns their greedy next tokens, in order."""
        logits = self._forward([[r.output_ids[-1]] for r in requests], [r.slot for r in requests])
        return self._pick(logits)

    def _emit(self, request: SlotRequest, token: int) -> tuple[str, list[int], bool]:
        """Append a new token to the request's output and say whether the request is done
        (max_new_tokens reached, EOS, one of its stop tokens, or the model's context full).
        Frees nothing: retiring the request is the step's job."""
        request.output_ids.append(token)
        finished = (len(request.output_ids) >= request.max_new_tokens or token == self.eos_token_id
                    or token in request.stop_token_ids
                    or len(request.prompt_ids) + len(request.output_ids) >= self.limit)
        return request.request_id, [token], finished
