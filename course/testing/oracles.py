"""Test oracles shared by the milestones: one place for what every engine test compares with.

- `TINY_EOS`: the tiny model's end-of-sequence id (its prompts use ids below 256).
- `solo(ref_model, prompt, max_new, ...)`: the REFERENCE package's solo `generate`
  (`course.reference()`, never the implementation under test), cached, so many tests can
  ask for the same expected output at the price of one.
- `make_engine(serve, model, **config)`: an `EngineCore` of the implementation under test
  (`serve` is the milestone fixture with Chapter 31's modules) stopping at `TINY_EOS`.
- `assert_engine_idle(engine, where)`: the engine holds nothing (course.testing.engine_checks).
- `ScriptedRunner`: a stand-in for the model runner, so the real `EngineCore.step` runs on
  scripted logits.

Nothing here imports an implementation: the engine's modules come in through `serve`.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from course import models, reference
from course.impl import have_reference
from course.testing.engine_checks import check_engine_idle
from course.testing.oracle_records import recorded

TINY_EOS = 257          # the tiny model's eos_token_id (course.models.tiny_config)


def byte_vocabulary(vocab_size: int) -> list[bytes]:
    """The vocab_bytes of Chapter 3's ByteTokenizer (constrained decoding, Chapter 35): ids
    0-255 are their byte, the special ids above have none."""
    return [bytes([i]) if i < 256 else b"" for i in range(vocab_size)]

# key -> (the model, its output): holding the model keeps its id from being reused by another.
_SOLO: dict[tuple, tuple[object, list[int]]] = {}


def solo(ref_model: nn.Module, prompt: list[int], max_new: int, eos_token_id: int | None = TINY_EOS,
         **options) -> list[int]:
    """Solo `generate` of the reference package on `ref_model`: the new tokens only.

    Greedy unless options say otherwise; results of calls without a generator are cached
    per (model, prompt, max_new, eos, options), so the same question costs one run."""
    question = (ref_model, list(prompt), max_new, eos_token_id, options)
    generator = options.get("generator")
    if generator is not None:          # a generator's state changes: never cache, and replay its state too
        def sampled():
            tokens = reference().sampling.generate(ref_model, list(prompt), max_new, eos_token_id=eos_token_id,
                                                   **options)
            return tokens, generator.get_state()
        tokens, state = recorded("solo generate (sampled)", question, sampled)
        generator.set_state(state)
        return tokens
    key = (id(ref_model), tuple(prompt), max_new, eos_token_id,
           tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in options.items())))
    if key not in _SOLO:
        _SOLO[key] = ref_model, recorded("solo generate", question, lambda: reference().sampling.generate(
            ref_model, list(prompt), max_new, eos_token_id=eos_token_id, **options))
    return list(_SOLO[key][1])


def reference_generate(model: nn.Module, prompt: list[int], max_new: int, **options: Any) -> list[int]:
    """The reference package's `sampling.generate(model, prompt, max_new, **options)` (no
    defaults added, no cache; `solo` is the cached, engine-flavoured form), recorded for an
    edition without the reference. Seeded sampling goes through `solo`."""
    if options.get("generator") is not None:
        raise ValueError("reference_generate: a generator's state must be replayed too; use solo(...) for sampling")
    return reference_call("sampling.generate", model, list(prompt), max_new, **options)


def reference_call(dotted: str, *args: Any, **kwargs: Any) -> Any:
    """`course.reference().<dotted>(*args, **kwargs)` for a reference function whose answer is
    data (numbers, lists, tensors, a dataclass, which comes back as a SimpleNamespace in an
    edition): computed by the reference, recorded for an edition without it."""
    def compute() -> Any:
        target: Any = reference()
        for name in dotted.split("."):
            target = getattr(target, name)
        return target(*args, **kwargs)
    return recorded(dotted, (args, kwargs), compute)


def reference_tiny_qwen3(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                         **overrides: Any) -> nn.Module:
    """The oracle's tiny Qwen3 (course.models' weights, `overrides` to its config): the
    reference package's, or in an edition without the reference, transformers' Qwen3 with the
    same weights (`transformers_tiny_qwen3`), never the implementation under test."""
    if have_reference():
        return models.tiny_qwen3(reference().package, device=device, dtype=dtype, **overrides)
    return transformers_tiny_qwen3(device, dtype, **overrides)


def transformers_tiny_qwen3(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                            **overrides: Any) -> nn.Module:
    """transformers' Qwen3ForCausalLM with the tiny config and course.models' deterministic
    weights (the names are the same), called like ours: model(input_ids) -> logits
    [batch, seq, vocab]."""
    import transformers

    torch.manual_seed(models.TINY_SEED)
    config = transformers.Qwen3Config(**models.tiny_config_values(**overrides), attn_implementation="eager")
    model = models.fill_deterministic(_logits_qwen3()(config))
    return model.to(device=device, dtype=dtype).eval()


def transformers_checkpoint(model_path: str | Path, device: torch.device | str = "cpu") -> nn.Module:
    """transformers' Qwen3ForCausalLM loaded from a Hugging Face Qwen3 directory in the dtype
    its config names (as Chapter 11's loader does), called like ours: model(input_ids) ->
    logits. The oracle for --model where the reference's loader is absent (an edition)."""
    model = _logits_qwen3().from_pretrained(model_path, dtype="auto", attn_implementation="eager")
    return model.to(device).eval()


def _logits_qwen3() -> Any:
    """transformers' Qwen3ForCausalLM, answering model(input_ids) with the logits tensor and
    exposing context_limit, as the course's models do (made once, on first use)."""
    global _LogitsQwen3
    if _LogitsQwen3 is None:
        import transformers

        class LogitsQwen3(transformers.Qwen3ForCausalLM):
            def forward(self, input_ids: torch.Tensor, **kwargs: Any) -> torch.Tensor:
                return super().forward(input_ids, use_cache=False, **kwargs).logits

            @property
            def context_limit(self) -> int:
                return self.config.max_position_embeddings
        _LogitsQwen3 = LogitsQwen3
    return _LogitsQwen3


_LogitsQwen3: Any = None


def unwritten_server_stubs(impl: Any) -> list[str]:
    """The names of Chapter 38's stubs (the HTTP server's) that still raise "not implemented
    yet" in `impl`, each probed with the smallest call that reaches its body. A test that
    serves HTTP needs all four: with any unwritten it is skipped, naming them, since its
    failures would only repeat the stubs' own tests."""
    loop, text = impl.load("server.loop"), impl.load("server.text")
    idle = SimpleNamespace(scheduler=SimpleNamespace(running=[], waiting=[]), preemptions=0, steps=0,
                           blocks=SimpleNamespace(num_blocks=1, num_free=1, hit_rate=0.0), max_model_len=8,
                           has_unfinished=False)
    tokenizer = text.ByteChatTokenizer(impl.tokenizer.ByteTokenizer())
    probes = {"EngineLoop.run_once": lambda: loop.EngineLoop(idle).run_once(),
              "sse_event": lambda: impl.load("server.app").sse_event("[DONE]"),
              "AdmissionControl.try_admit": lambda: loop.AdmissionControl(1, 0).try_admit(1),
              "TextStream.push": lambda: text.TextStream(text.DiffDetokenizer(tokenizer)).push([65])}
    missing = []
    for name, probe in probes.items():
        try:
            probe()
        except NotImplementedError:
            missing.append(name)
    return missing


def make_engine(serve: SimpleNamespace, model: nn.Module, eos_token_id: int | None = TINY_EOS, drafter: Any = None,
                runner: Any = None, adapters: Any = None, vision: Any = None, **config) -> Any:
    """An EngineCore of the implementation under test with EngineConfig(**config) and the
    parts given (EngineCore's drafter, runner, adapters, vision; runner may be
    ScriptedRunner.factory(...))."""
    return serve.engine.EngineCore(model, serve.config.EngineConfig(**config), eos_token_id=eos_token_id,
                                   drafter=drafter, runner=runner, adapters=adapters, vision=vision)


def assert_engine_idle(engine: Any, where: str = "") -> None:
    """Every block free, no request registered, no host copies of swapped K/V left."""
    check_engine_idle(engine, where)


class ScriptedRunner:
    """A stand-in for Chapter 31's ModelRunner: the real `build_batch` makes the step's
    Batch, and `execute` returns scripted logits instead of running a model, so the REAL
    `EngineCore.step` (scheduling, swaps, sampling, stop rules, freeing) runs around it in
    microseconds. Hand it to the engine when it is built:
    `EngineCore(..., runner=ScriptedRunner.factory(serve, next_token))` (or make_engine's
    `runner`); the engine's own runner is then never built, so no pool is allocated.

    next_token(token_ids) -> int: the token the "model" predicts after a sequence; its logit
    row is a one-hot of height 10, so greedy sampling picks it. Hooks for tests:
    `on_swap_out(request, blocks)`, `on_swap_in(request, blocks)` and
    `on_execute(batch, requests)` (requests in batch order) run before the default action.
    """

    def __init__(self, serve: SimpleNamespace, next_token: Callable[[list[int]], int], vocab_size: int,
                 block_size: int) -> None:
        self.serve, self.next_token = serve, next_token
        self.vocab_size, self.block_size = vocab_size, block_size
        self.prepared: dict[str, Any] = {}      # request id -> Request, for the batch prepare made last
        self.swapped: dict[str, list[int]] = {}
        self.on_swap_out = self.on_swap_in = self.on_execute = None
        self.executed = 0
        self.last_hidden = None          # no hidden states: draft heads (Chapter 37) guess nothing

    @classmethod
    def factory(cls, serve: SimpleNamespace, next_token: Callable[[list[int]], int]) -> Callable[..., ScriptedRunner]:
        """What EngineCore's `runner` takes: called as (flat model, num_blocks, block_size,
        backend), it builds a ScriptedRunner for the engine's vocabulary and block size."""
        return lambda flat, num_blocks, block_size, backend: cls(serve, next_token, flat.cfg.vocab_size, block_size)

    def swap_out(self, request: Any, blocks: list[int]) -> None:
        if self.on_swap_out is not None:
            self.on_swap_out(request, blocks)
        self.swapped[request.request_id] = list(blocks)

    def swap_in(self, request: Any, blocks: list[int]) -> None:
        if self.on_swap_in is not None:
            self.on_swap_in(request, blocks)
        saved = self.swapped.pop(request.request_id)
        if len(blocks) < len(saved):
            raise AssertionError(f"request {request.request_id!r}: {len(saved)} blocks swapped out, "
                                 f"only {len(blocks)} to swap into")

    def prepare(self, scheduled: list[tuple[Any, int]], block_tables: dict[str, list[int]], pad_to: int | None = None,
                previous: object = None) -> Any:
        self.prepared = {request.request_id: request for request, _ in scheduled}
        return self.serve.batch.build_batch(scheduled, block_tables, self.block_size, "cpu", pad_to)

    def execute(self, batch: Any) -> torch.Tensor:
        requests = [self.prepared[rid] for rid in batch.request_ids]
        if self.on_execute is not None:
            self.on_execute(batch, requests)
        self.executed += 1
        rows = []
        for request, count in zip(requests, batch.sample_counts):
            tokens = list(request.token_ids)
            for _ in range(count):
                rows.append(self.next_token(tokens))
                tokens.append(rows[-1])
        logits = torch.zeros(len(rows), self.vocab_size)
        logits[range(len(rows)), rows] = 10.0
        return logits
