"""Chapter 33: the padded decode step as one torch.compile'd graph per bucket.

EngineConfig.compile_decode=True swaps GraphRunner.forward for a compiled one. Inductor
traces the whole step (embedding, every layer's norms, projections, RoPE, residual adds,
the MLP, the final norm and the LM head) for one bucket's static shapes and fuses the
small elementwise operations between the matmuls into a few generated loops.

Attention stays OUTSIDE the graph, as vLLM does: the backend's `write` and `forward` are
two opaque custom operators. Their Python bodies call the engine's real backend with the
step's BatchMeta, which cannot cross an operator boundary (it carries host lists), so it
travels beside the call: CompiledDecode.forward names the running step's backend and meta
for its thread (`_running`), and the operators read them there. The compiled graph keeps
every shape of the bucket it was traced for, which is why only the padded path, whose
shapes are the buckets', is compiled.

On CUDA with graphs on, capture() records the compiled forward (compiled + graphs). On a
CPU an inductor call costs some 15-25 microseconds of wrapper (guards, argument handling)
before any work, so compiling a small region loses; only a whole step in one graph can
gain. Chapter 33's text gives the measured figures.
"""
from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .batch import BatchMeta
    from .graphs import GraphRunner
    from .interfaces import AttentionBackend

# Dynamo keys its cache on the step function's code, shared by every engine in the process;
# each bucket of each compiling engine is one entry. The default limit (8) would silently
# fall back to eager after a few engines or past 8 buckets.
MIN_RECOMPILE_LIMIT = 256

# The operators are registered once per copy of this module, under a namespace of its import
# name: the course loads several copies of the package (the reference, your engine, gated
# copies), and an operator name can be registered only once per process.
_NAMESPACE = __name__.replace(".", "_")

# The backend and BatchMeta of the compiled step running on this thread. Operators run on the
# thread that called the compiled step, so engines on different threads never see each other's.
_running = threading.local()


def _step_state() -> tuple[AttentionBackend, BatchMeta]:
    state = getattr(_running, "step", None)
    if state is None:
        raise RuntimeError("compiled decode step: attention ran outside CompiledDecode.forward, with no batch meta set")
    return state


@torch.library.custom_op(f"{_NAMESPACE}::kv_write", mutates_args=("cache",))
def _kv_write(cache: list[torch.Tensor], k: torch.Tensor, v: torch.Tensor) -> None:
    backend, meta = _step_state()
    backend.write(tuple(cache), k, v, meta)


@torch.library.custom_op(f"{_NAMESPACE}::attend", mutates_args=())
def _attend(q: torch.Tensor, cache: list[torch.Tensor], scale: float | None, window: int) -> torch.Tensor:
    backend, meta = _step_state()
    out = backend.forward(q, tuple(cache), meta, scale=scale, window=window)
    return out.clone() if out is q else out          # an operator's output may not alias its input


@_attend.register_fake
def _attend_shape(q: torch.Tensor, cache: list[torch.Tensor], scale: float | None, window: int) -> torch.Tensor:
    return torch.empty_like(q)


class OpaqueAttention:
    """What the compiled step sees as its backend: write and forward as the opaque operators
    (the meta argument is not read: the operators take the running step's). Stateless: one
    instance serves every compiled step."""

    def write(self, cache: tuple[torch.Tensor, ...], k: torch.Tensor, v: torch.Tensor, meta: BatchMeta) -> None:
        _kv_write(list(cache), k, v)

    def forward(self, q: torch.Tensor, cache: tuple[torch.Tensor, ...], meta: BatchMeta, scale: float | None = None,
                window: int = 0) -> torch.Tensor:
        return _attend(q, list(cache), scale, window)


class CompiledDecode:
    """GraphRunner.forward compiled with torch.compile (dynamic=False, fullgraph=True).

    Compiled lazily, on a bucket's first step (or on CUDA at capture, which runs each bucket
    before recording it): engines built for tests and single requests pay only for the
    buckets they use, and benchmarks leave the first steps out anyway. compile_seconds
    records each bucket's first call (trace + inductor + the run)."""

    def __init__(self, graphs: GraphRunner) -> None:
        self.graphs = graphs
        self.compile_seconds: dict[int, float] = {}
        dynamo: Any = torch._dynamo.config
        dynamo.recompile_limit = max(dynamo.recompile_limit, MIN_RECOMPILE_LIMIT)
        dynamo.accumulated_recompile_limit = max(dynamo.accumulated_recompile_limit, 4 * MIN_RECOMPILE_LIMIT)
        runner, opaque = graphs.runner, OpaqueAttention()

        def step(input_ids: torch.Tensor, positions: torch.Tensor,
                 kv_caches: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
            hidden = runner.flat(input_ids, positions, kv_caches, None, opaque)   # the meta goes by _running
            return hidden, runner.flat.compute_logits(hidden)

        self.step = torch.compile(step, dynamic=False, fullgraph=True)

    def forward(self, size: int, meta: BatchMeta) -> tuple[torch.Tensor, torch.Tensor]:
        """GraphRunner.forward's contract: hidden [size, D] and logits [size, vocab]."""
        graphs, runner = self.graphs, self.graphs.runner
        _running.step = (runner.backend, meta)
        try:
            if size in self.compile_seconds:
                return self.step(graphs.input_ids[:size], graphs.positions[:size], runner.kv_caches)
            started = time.perf_counter()
            out = self.step(graphs.input_ids[:size], graphs.positions[:size], runner.kv_caches)
            self.compile_seconds[size] = time.perf_counter() - started
            return out
        finally:
            _running.step = None
