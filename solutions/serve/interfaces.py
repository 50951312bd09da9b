"""Chapter 31: the seams later chapters plug into, stated as typing.Protocols.

Nothing here runs: these classes say what an object must provide to take the place of
Chapter 31's own (a faster attention backend in Chapter 32, the full sampler in Chapter 34,
a constrained-decoding guide in Chapter 35, a drafter in Chapter 37). The engine keeps
calling them exactly as it calls its defaults; `isinstance(x, AttentionBackend)` checks
that the names exist (runtime_checkable), the docstrings state the rest of the contract.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:                       # annotations only: no import cycle at run time
    from .batch import BatchMeta
    from .engine import EngineCore
    from .request import Request, RequestOutput
    from .scheduler import SchedulerOutput


@runtime_checkable
class AttentionBackend(Protocol):
    """Attention over the block pool (serve.backends.ReferenceBackend is the model answer).

    Contract:
    - `allocate(shape, dtype, device)` returns one layer's pool as a tuple: k_cache and
      v_cache of `shape` = [num_blocks + 1, block_size, Hkv, D] first (the last block is the
      scratch block padding rows write to), then anything else the backend needs (a
      quantized pool's scales). Fresh pools hold zeros.
    - `write(cache, k, v, meta)` stores this step's k, v [N, Hkv, D] at meta.slot_mapping
      (slot -1: the scratch block), in place, before any `forward` of the same step.
    - `forward(q, cache, meta, scale=None, window=0)` returns [N, H, D] in q's dtype: row i
      attends causally to its request's context (positions 0 .. its own, read through
      meta.block_table), only to the last `window` positions when window > 0; rows of a
      padding request (seq_len 0) come back as zeros. It must match ReferenceBackend to
      float tolerance and may not read device values on the host (CUDA graphs, Chapter 33).
    - `name` is the name it is registered under (serve.backends.register_backend).
    """
    name: str

    def allocate(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str
                 ) -> tuple[torch.Tensor, ...]: ...

    def write(self, cache: tuple[torch.Tensor, ...], k: torch.Tensor, v: torch.Tensor, meta: BatchMeta) -> None: ...

    def forward(self, q: torch.Tensor, cache: tuple[torch.Tensor, ...], meta: BatchMeta, scale: float | None = None,
                window: int = 0) -> torch.Tensor: ...


@runtime_checkable
class Sampler(Protocol):
    """Turns a step's sampling rows into tokens (serve.sampler.SimpleSampler, Chapter 34's
    full sampler).

    Contract of `sampler(logits, requests, generators) -> (tokens, logprobs)`:
    - logits: float32 [L, vocab], the rows of batch.logits_indices that sample, in request
      order (one row per request in Chapter 31; verification rows add more, Chapter 37);
    - requests: the requests those rows belong to, in the same order;
    - generators: request id -> its own seeded torch.Generator (seeded requests only);
      the others draw from the sampler's own generator, so a seeded request's draws never
      depend on who else is in the batch;
    - tokens: one list of new token ids per request; logprobs: None, or one entry per request.
    - A request whose parameters say greedy (SamplingParams.greedy) gets the argmax. A
      failure may raise: the engine then samples each request alone and aborts only the
      ones that still fail, so a sampler need not isolate requests itself, but it must not
      change any state before raising except generator draws.
    """

    def __call__(self, logits: torch.Tensor, requests: Sequence[Request],
                 generators: Mapping[str, torch.Generator]) -> tuple[list[list[int]], list[Any] | None]: ...


@runtime_checkable
class Guide(Protocol):
    """The constrained-decoding state of one request (Chapter 35), kept in
    request.extra["guide"].

    Contract:
    - `allowed()` returns a bool tensor [vocab_size] on the CPU: True for every token whose
      bytes keep the pattern matchable from the guide's current state, and for EOS exactly
      when the text so far is a complete match. It does not change the guide.
    - The full sampler (Chapter 34) sets the logits of every token `allowed()` forbids to
      -inf before it applies any other rule, so a guided request can only draw allowed tokens.
    - `advance(token_id)` moves the guide past one accepted token; the engine calls it after
      appending the token and before check_stop. A forbidden token raises ValueError naming it.
    - `finished` is True once the pattern admits no further byte; EngineCore.check_stop then
      ends the request as FINISHED_STOPPED with stop_reason "guided".
    A guide that raises fails only its own request.
    """

    @property
    def finished(self) -> bool: ...

    def allowed(self) -> torch.Tensor: ...

    def advance(self, token_id: int) -> None: ...


@runtime_checkable
class Drafter(Protocol):
    """Speculative decoding inside the engine (Chapter 37), installed as engine.drafter.

    Contract: `step(engine, plan)` replaces the sample-and-update half of EngineCore.step for
    a scheduled plan (the swaps are done): it proposes draft tokens, runs the verification
    rows, appends each request's accepted tokens, gives back the blocks of rejected drafts
    (BlockManager.trim), applies the stop rules and returns one RequestOutput per request
    that gained tokens or finished, exactly as EngineCore.step would have.
    """

    def step(self, engine: EngineCore, plan: SchedulerOutput) -> list[RequestOutput]: ...


__all__ = ["AttentionBackend", "Sampler", "Guide", "Drafter"]
