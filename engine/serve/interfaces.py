"""Chapter 31: the seams later chapters plug into, stated as typing.Protocols.

Nothing here runs: these classes say what an object must provide to take the place of
Chapter 31's own (a faster attention backend in Chapter 32, the full sampler in Chapter 34,
a constrained-decoding guide in Chapter 35, a drafter in Chapter 37) or to extend the
update after sampling (its hooks). The engine keeps calling them exactly as it calls its
defaults; `isinstance(x, AttentionBackend)` checks
that the names exist (runtime_checkable), the docstrings state the rest of the contract.

This module is a leaf: it imports no other module of the package when it runs, and never
the engine, so the engine, its plug-ins and their tests all depend on it and it on none of
them. What a hook or a drafter may use of the engine is handed to it (a stop rule, a
DrafterContext), never the engine itself.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields, is_dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:                       # the data types the contracts name, for annotations only
    from .batch import Batch, BatchMeta
    from .request import Request, RequestOutput, SamplingParams, Status
    from .scheduler import SchedulerOutput

# The engine's stop rules for the token at `index` of a request's list (EngineCore.check_stop,
# with guides advanced first when the engine has them, Chapter 35): a finish status or None.
StopRule = Callable[["Request", int], "Status | None"]


@dataclass
class SampledTokens:
    """A step's results by request id, before EngineCore.update applies them.

    tokens: the new tokens of each request that sampled (one; with speculation, its accepted
    drafts then one token of the target's); logprobs: what the sampler reported for them
    (Chapter 34); failed: the error of each request whose sampling or verification failed,
    and `doing`, the words its error message uses for that work."""
    tokens: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, Any] = field(default_factory=dict)
    failed: dict[str, Exception] = field(default_factory=dict)
    doing: str = "sampling"


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
    - `quantized`: True when its pools store codes and scales (kv_cache_dtype, Chapter 32);
      a model that allocates its own pool (latent attention) refuses such a backend.
    - `graph_safe`: True when its decode attention reads only device tensors and its launch
      shape depends on the batch size alone, so a CUDA graph may capture it (Chapter 33).
    """
    name: str

    @property
    def quantized(self) -> bool: ...

    @property
    def graph_safe(self) -> bool: ...

    def allocate(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str
                 ) -> tuple[torch.Tensor, ...]: ...

    def write(self, cache: tuple[torch.Tensor, ...], k: torch.Tensor, v: torch.Tensor, meta: BatchMeta) -> None: ...

    def forward(self, q: torch.Tensor, cache: tuple[torch.Tensor, ...], meta: BatchMeta, scale: float | None = None,
                window: int = 0) -> torch.Tensor: ...


@runtime_checkable
class TokenSampler(Protocol):
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
    """The constrained-decoding state of one request (Chapter 35), kept in request.guide.

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
class UpdateHooks(Protocol):
    """What EngineCore.update asks of the way a step runs (serve.update.StepUpdate is
    Chapter 31's; Chapters 33 and 37 extend it). Each method sees one request and what the
    step decided for it, never the engine.

    Contract:
    - `advance(request, n)`: the step computed the request's next n tokens (Chapter 31:
      num_computed_tokens grows by n; the asynchronous engine counted them at launch).
    - `commit(request, tokens, stop)` puts the step's new tokens in the request and applies
      `stop` (the engine's StopRule) to each; returns (the tokens kept, a finish status or
      None). It does not finish the request (update does, after reporting). It may raise:
      update then aborts that request alone, its error saying `doing`.
    - `report(request, output)` -> the request's RequestOutput for the step, given the one
      EngineCore.make_output made for the tokens kept (returned as is, or changed).
    - `after_update(plan, advanced)` runs once per step after every request is updated;
      advanced: (request, tokens kept) for those that gained tokens and still run.
    """
    doing: str

    def advance(self, request: Request, n: int) -> None: ...

    def commit(self, request: Request, tokens: list[int], stop: StopRule) -> tuple[list[int], Status | None]: ...

    def report(self, request: Request, output: RequestOutput) -> RequestOutput: ...

    def after_update(self, plan: SchedulerOutput, advanced: list[tuple[Request, list[int]]]) -> None: ...


class StepInFlight(Protocol):
    """The asynchronous engine's launched step as ModelRunner.prepare reads it (Chapter 33;
    serve.overlap.InflightStep is one): the next step's placeholder inputs are its tokens.

    tokens: int64 [rows] on the runner's device, the step's sampled tokens, never read on
    the host by prepare (None: not sampled yet); row_of: request id -> its row in tokens.
    """

    @property
    def tokens(self) -> torch.Tensor | None: ...

    @property
    def row_of(self) -> Mapping[str, int]: ...


@dataclass(frozen=True)
class DrafterContext:
    """What a drafter learns of the engine it is built into, once (Drafter.bind).

    vocab_size, max_model_len, num_blocks, block_size, attention_backend: the target
    engine's (a draft model's pool is sized from them); async_scheduling: whether the
    engine plans step t + 1 before reading step t's tokens; generators: the engine's map of
    seeded requests' own generators (live: it follows add_request and finish); default_generator:
    the one every other request draws from; trim(request, n): give back the request's
    blocks past its first n tokens (Scheduler.trim); last_hidden(): the target's hidden
    rows of the latest forward pass' sampling rows (ModelRunner.last_hidden), or None.
    """
    vocab_size: int
    max_model_len: int
    num_blocks: int
    block_size: int
    attention_backend: str
    async_scheduling: bool
    generators: Mapping[str, torch.Generator]
    default_generator: torch.Generator
    trim: Callable[[Request, int], None]
    last_hidden: Callable[[], torch.Tensor | None]

    def generator_for(self, request_id: str) -> torch.Generator:
        """The generator a request draws from: its own when seeded, else the engine's."""
        return self.generators.get(request_id, self.default_generator)


@runtime_checkable
class Drafter(UpdateHooks, Protocol):
    """Speculative decoding inside the engine (Chapter 37), the engine's `drafter`.

    Contract: `verify(plan, batch, logits)` takes the place of sampling in
    EngineCore.sample_tokens: logits are the batch's sampling rows (1 + the drafts fed, per
    request); it returns, per request, the accepted drafts then one token of the target's
    (SampledTokens). Its update hooks then commit those tokens, give back the blocks of
    rejected drafts (DrafterContext.trim), and after the update propose the next drafts.
    `check_request(request_id, params, lora, features)` raises ValueError, naming the
    request and the rule, for what the drafter cannot verify (EngineCore.add_request asks it);
    `forget(request_id)` drops what it keeps for a request that finished or was aborted;
    `bind(context)` is called once by the engine being built with it, before any request,
    and may refuse that engine (ValueError).
    """

    def verify(self, plan: SchedulerOutput, batch: Batch, logits: torch.Tensor) -> SampledTokens: ...

    def check_request(self, request_id: str, params: SamplingParams, lora: object, features: object) -> None: ...

    def forget(self, request_id: str) -> None: ...

    def bind(self, context: DrafterContext) -> None: ...


@runtime_checkable
class PagedAttention(Protocol):
    """An attention module with a path of its own on the engine's pool (latent attention,
    Chapter 42): FlatModel runs `paged_forward(h, positions, rope, kv, meta, backend)` ->
    [N, D] in place of its Qwen3 attention, h [N, D] normalised rows, kv the layer's pool."""

    def paged_forward(self, h: torch.Tensor, positions: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                      kv: Any, meta: BatchMeta, backend: AttentionBackend) -> torch.Tensor: ...


@runtime_checkable
class WindowedAttention(Protocol):
    """An attention module whose queries see only the last `sliding_window` positions
    (Mistral, Chapter 42; 0 or None: every earlier position)."""
    sliding_window: int | None


@dataclass(frozen=True)
class ModelCapabilities:
    """What a loaded model declares beyond Qwen3ForCausalLM's modules, in one typed
    attribute, `model.capabilities` (Qwen3ForCausalLM sets its own; a family that changes
    one sets a copy with that field replaced, dataclasses.replace). FlatModel reads it once
    (`of`), so nothing else in the engine asks a model what it can do, and a misspelt field
    is a TypeError where the model is built, never a silent default.

    context_limit: the positions it was trained for (Chapter 17; None: no limit known).
    kv_spec() -> (layers, kv_heads, head_dim): a pool shape other than its config's
      (latent attention, Chapter 42; a pipeline stage's layers, Chapter 41).
    allocate_kv(shape, dtype, device) -> one layer's pool tuple: a cache layout of its own
      (latent attention), used instead of the backend's.
    kv_pools: tensors per layer the pool sizing counts (2: K and V; 1: one latent pool).
    agree_num_blocks(n) -> the pool size every rank of a split model agrees on (Chapter 41).
    rope_tables(positions, dtype) -> (cos, sin) [N, 1, head_dim]: scaled rotary
      frequencies (Chapter 42).
    """
    context_limit: int | None = None
    kv_spec: Callable[[], tuple[int, int, int]] | None = None
    allocate_kv: Callable[[tuple[int, ...], torch.dtype, torch.device | str], tuple[torch.Tensor, ...]] | None = None
    kv_pools: int = 2
    agree_num_blocks: Callable[[int], int] | None = None
    rope_tables: Callable[[torch.Tensor, torch.dtype], tuple[torch.Tensor, torch.Tensor]] | None = None

    @classmethod
    def of(cls, model: Any) -> ModelCapabilities:
        """The capabilities `model` declares; a TypeError names a model that declares none."""
        try:
            declared = model.capabilities
        except AttributeError:
            declared = None
        if isinstance(declared, cls):
            return declared
        if is_dataclass(declared) and type(declared).__name__ == cls.__name__:
            # The same declaration from another copy of this package (the reference's model
            # in a learner's engine): every field is read, so a missing one still raises.
            return cls(**{f.name: getattr(declared, f.name) for f in fields(cls)})
        raise TypeError(f"{type(model).__name__} declares no ModelCapabilities: the engine core takes a model "
                        f"whose `capabilities` attribute holds one (Qwen3ForCausalLM sets its own)")


__all__ = ["AttentionBackend", "TokenSampler", "Guide", "StopRule", "SampledTokens", "UpdateHooks",
           "StepInFlight", "DrafterContext", "Drafter", "PagedAttention", "WindowedAttention", "ModelCapabilities"]
