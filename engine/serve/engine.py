"""Chapter 31: EngineCore, the loop that ties requests, blocks, scheduler and model together.

    add_request  validate everything, then queue (n > 1 becomes n requests)
    step         schedule() -> runner.prepare -> execute_model() -> sample_tokens() -> update()
    update       the one place a step's tokens reach its requests (serve.update's hooks)
    generate     a blocking helper: many prompts in, their finished outputs back

A step is these named parts, called in this order by `step`; Chapter 33's asynchronous
engine (serve.overlap) calls the very same parts in another order and copies none of them.
Features of later chapters plug into seams here: parts handed to the constructor (sampler,
drafter, runner), the update's hooks, the stop rule the hooks apply. Asking for a feature
the engine cannot combine with another raises an error that says why.
"""
from __future__ import annotations

import copy
import importlib
import logging
import math
import operator
import os
import time
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

import torch

from .batch import Batch
from .blocks import BlockManager
from .config import EngineConfig
from .flat_model import FlatModel
from .guided import GuideFactory
from .interfaces import AttentionBackend, Drafter, DrafterContext, StopRule, TokenSampler, UpdateHooks
from .overlap import AsyncStepper, InflightStep, drop_placeholders
from .request import (
    FULL,
    ON_DEVICE,
    SIMPLE,
    VERIFIER,
    ImageInputs,
    Request,
    RequestOutput,
    SamplingParams,
    Status,
    refusal,
)
from .runner import ModelRunner, profile_num_blocks
from .sampler import Sampler, SimpleSampler, TokenLogprobs, check_token_ids, token_logprobs
from .scheduler import Scheduler, SchedulerOutput
from .update import SampledTokens, StepUpdate, guided

if TYPE_CHECKING:
    from ..qwen3 import Qwen3ForCausalLM
    from .lora import LoraAdapter
    from .vision import VisionInputs

logger = logging.getLogger(__name__)

# What builds an engine's runner: (flat model, num_blocks, block_size, backend) -> runner.
RunnerFactory = Callable[[FlatModel, int, int, AttentionBackend], ModelRunner]

# EngineCore's default eos_token_id: the one the model's config names (None turns EOS off).
MODEL_EOS: Literal["model"] = "model"

# Setting this environment variable to 1 turns on EngineConfig.debug_checks for every engine.
DEBUG_CHECKS_ENV = "COURSE_ENGINE_DEBUG_CHECKS"


class ModelOutput(NamedTuple):
    """What EngineCore.execute_model gives back for a batch: logits, float32 [L, vocab], of
    its sampling rows (the first batch.num_sample_rows), and prompt_rows, the logits of its
    prompt-logprob rows (Chapter 34; None when it has none)."""
    logits: torch.Tensor
    prompt_rows: torch.Tensor | None


def invariant_checks(config: EngineConfig) -> ModuleType | None:
    """course/testing/engine_checks.py when config.debug_checks (or $COURSE_ENGINE_DEBUG_CHECKS=1)
    asks for them, else None.

    Imported here, on demand, never when this module loads: the checks are the course's
    test machinery (they read any implementation's attributes and import none), the engine
    runs without them, and so this package imports nothing from course/ unless asked to."""
    if not (config.debug_checks or os.environ.get(DEBUG_CHECKS_ENV) == "1"):
        return None
    try:
        return importlib.import_module("course.testing.engine_checks")
    except ImportError as exc:
        raise ValueError(f"EngineConfig.debug_checks needs the course package (course/testing/engine_checks.py) on the "
                         f"path: {exc}") from None


class EngineCore:
    """The engine: one pool, one scheduler, one forward pass per step.

    model: a loaded Qwen3ForCausalLM (or Qwen3Moe), or a FlatModel around one.
    eos_token_id: the token that ends a request; MODEL_EOS (the default) takes the model
             config's eos_token_id, None turns EOS off (only the other stop rules apply).
    sampler: anything with the sampler interface of serve.sampler (default: SimpleSampler, or
             Chapter 34's full Sampler with EngineConfig(sampler="full")).
    vocab_bytes: each token's bytes, for constrained decoding (Chapter 35).
    drafter: speculative decoding (Chapter 37): a serve.spec_decode.Speculator (it may
             refuse the engine when bound to it: asynchronous scheduling, for one).
    runner: what builds the ModelRunner, called as runner(flat, num_blocks, block_size,
            backend) (default ModelRunner; a pipeline stage's runner in Chapter 41).
    adapters: LoRA adapters to serve (Chapter 43), stacked into a serve.lora.AdapterBank on
            the model before its runner is built; requests name them with `lora`.
    vision: a serve.vision.VisionInputs (encoder, image token id, M-RoPE sections): the
            model becomes a vision-language model before its runner is built (Chapter 43).
    """

    def __init__(self, model: Qwen3ForCausalLM | FlatModel, config: EngineConfig | None = None,
                 eos_token_id: int | None | Literal["model"] = MODEL_EOS,
                 sampler: TokenSampler | None = None, vocab_bytes: list[bytes] | None = None,
                 drafter: Drafter | None = None, runner: RunnerFactory | None = None,
                 adapters: Sequence[LoraAdapter] | None = None, vision: VisionInputs | None = None) -> None:
        if config is None:
            config = EngineConfig()
        self.config = config.validate()
        flat = FlatModel(model) if not isinstance(model, FlatModel) else model
        if config.dtype != "auto":               # before anything reads the weights' dtype (Chapter 32)
            flat.to(getattr(torch, config.dtype))
        from ..devices import prepack_linears
        prepack_linears(flat)                    # on a CPU: weights laid out once for oneDNN (Chapter 32)
        if vision is not None:                   # Chapter 43: checked and wired before anything is built on it
            from .vision import attach_vision
            attach_vision(flat, vision.encoder, vision.image_token_id, vision.sections)
        if adapters is not None:
            from .lora import AdapterBank
            bank = AdapterBank(flat)
            for adapter in adapters:
                bank.add(adapter)
        weight = next(flat.parameters())
        self.device, self.dtype = weight.device, weight.dtype
        self.vocab_size = flat.cfg.vocab_size
        self.eos_token_id = self._check_eos(flat, eos_token_id)
        self.max_model_len = self._check_max_model_len(flat, config.max_model_len)
        options = {"kv_cache_dtype": config.kv_cache_dtype} if config.kv_cache_dtype != "auto" else {}
        from .backends import get_backend
        backend = get_backend(config.attention_backend, **options)
        pool_blocks = config.num_blocks if config.num_blocks is not None else self._size_pool(flat, backend)
        self.blocks = BlockManager(pool_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler_config(), self.blocks)
        self.runner = (runner or ModelRunner)(flat, pool_blocks, config.block_size, backend)
        self.engine_generator = torch.Generator(device=self.device).manual_seed(config.seed)
        if sampler is None:
            sampler = (Sampler if config.sampler == "full" else SimpleSampler)(self.engine_generator)
        self.sampler = sampler
        self.vocab_bytes = vocab_bytes
        self.guides = GuideFactory(vocab_bytes, self.eos_token_id, self.vocab_size) if vocab_bytes is not None else None
        self.generators: dict[str, torch.Generator] = {}   # request id -> its own seeded generator
        self.groups: dict[str, list[Request]] = {}       # id given to add_request with n > 1 -> its samples
        self.steps = 0
        self.preemptions = 0
        self.last_plan: SchedulerOutput | None = None   # the SchedulerOutput of the latest step (for tools and widgets)
        self.drafter = drafter                  # Chapter 37 (serve.spec_decode.Speculator)
        if drafter is not None:
            drafter.bind(DrafterContext(
                self.vocab_size, self.max_model_len, pool_blocks, config.block_size, config.attention_backend,
                config.async_scheduling, self.generators, self.engine_generator, self.scheduler.trim,
                lambda: self.runner.last_hidden))
            # What it keeps for a request goes when the request does.
            self.scheduler.on_finish = lambda request: drafter.forget(request.request_id)
        self.checks = invariant_checks(config)    # course.testing.engine_checks when debug checks are on
        self._generate_calls = 0
        # cuda_graphs -> the GraphRunner's mode ("static" is the padded path without capture);
        # "auto" off CUDA means no GraphRunner at all.
        on_cuda = self.device.type == "cuda"
        graph_mode = {"off": None, "static": "off", "on": "on", "auto": "auto" if on_cuda else None}[config.cuda_graphs]
        if graph_mode is None and config.compile_decode:
            graph_mode = "off"      # compile_decode with "auto" off CUDA: the padded path, compiled, no capture
        if graph_mode is not None:
            self.runner.enable_graphs(config.max_num_seqs, self.max_model_len, graph_mode, config.compile_decode)
        # The stop rule update() hands its hooks: Chapter 31's, guides first when they can exist (Chapter 35).
        self.stop_rule: StopRule = guided(self.check_stop) if self.guides is not None else self.check_stop
        self.plain_update = StepUpdate()
        queue = None if config.device_queue == "auto" else config.device_queue
        self.async_steps = AsyncStepper(self, queue) if config.async_scheduling else None   # Chapter 33

    @staticmethod
    def _check_eos(flat: FlatModel, given: int | None | Literal["model"]) -> int | None:
        """The engine's EOS id: the model config's for MODEL_EOS, else `given` (None: no EOS)."""
        eos = flat.cfg.eos_token_id if given == MODEL_EOS else given
        vocab = flat.cfg.vocab_size
        if eos is not None and (isinstance(eos, bool) or not isinstance(eos, int) or not 0 <= eos < vocab):
            raise ValueError(f"eos_token_id must be a token id in 0..{vocab - 1}, None (no EOS) or {MODEL_EOS!r} "
                             f"(the model config's), got {eos!r}")
        return eos

    @staticmethod
    def _check_max_model_len(flat: FlatModel, wanted: int | None) -> int:
        """config.max_model_len, or the model's context limit when it is None. A length past
        the positions the model was trained for is refused, not silently accepted: its
        rotary angles there were never seen, so the outputs would be quietly wrong."""
        limit = flat.capabilities.context_limit
        if wanted is None:
            return limit or (1 << 30)
        if limit is not None and wanted > limit:
            raise ValueError(f"EngineConfig.max_model_len={wanted} exceeds the model's {limit} positions "
                             f"(its max_position_embeddings); give at most {limit}, or None to use the model's")
        return wanted

    def _size_pool(self, flat: FlatModel, backend: AttentionBackend) -> int:
        """Blocks for the pool when the config gives no number: measured on CUDA, else from
        kv_cache_bytes and the bytes one block of THIS pool takes (a quantized pool stores
        one-byte codes and per-token scales, not the model's dtype). Layers placed on several
        devices (Chapter 40) take what fits on every device; the ranks of a split model
        (Chapter 41) agree on the smallest count, or their schedulers would part ways."""
        cfg = self.config
        layers, kv_heads, head_dim = flat.kv_spec()
        shape = (1, cfg.block_size, kv_heads, head_dim)          # one block, on "meta": sizes without memory
        own = flat.capabilities.allocate_kv                       # a model with its own cache layout
        if own is not None:                                       # a latent pool is one tensor, handed out twice
            unique = {id(t): t for t in own(shape, self.dtype, "meta")}.values()
            layer_bytes = sum(t.numel() * t.element_size() for t in unique)
        else:                                                     # K and V (codes and scales when quantized)
            pair = backend.allocate(shape, self.dtype, "meta")
            pools = flat.capabilities.kv_pools                    # a latent cache keeps one pool, not two
            layer_bytes = sum(t.numel() * t.element_size() for t in pair) * pools // 2
        placed = flat.pool_blocks(layer_bytes, cfg.kv_cache_bytes, cfg.gpu_memory_utilization)
        if placed is not None:                                    # layers on several devices
            found = placed
        elif self.device.type == "cuda":
            found = profile_num_blocks(flat, backend, cfg.block_size, self.dtype, self.device,
                                       cfg.max_num_batched_tokens, cfg.gpu_memory_utilization)
        else:
            found = cfg.kv_cache_bytes // (layers * layer_bytes)
        agree = flat.capabilities.agree_num_blocks                # every rank must hold the same pool
        if agree is not None:
            found = agree(found)
        if found < 1:
            raise ValueError("the KV pool would hold no block: give more memory or set EngineConfig.num_blocks")
        return found

    # --- requests in and out ------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int] | torch.Tensor,
                    params: SamplingParams | None = None, priority: int = 0,
                    cache_key: Iterable[str | bytes | int] = (), arrival_time: float | None = None, lora: object = None,
                    features: object = None) -> Request | list[Request]:
        """Queue a request; returns its Request (a list of n Requests when params.n > 1).

        Everything is checked before anything changes: a ValueError (naming the request and
        the rule) leaves the engine exactly as it was. The engine keeps its own copy of
        `params` and of the prompt, so the caller may reuse or change them afterwards. With
        n > 1 the samples are requests "<id>:0" .. "<id>:<n-1>" with seeds seed + i; they
        share the prompt's blocks through the prefix cache."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"request {request_id!r}: params must be a SamplingParams, got {type(params).__name__}")
        params = copy.deepcopy(params).validate()      # the caller may mutate theirs after this call
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request ids are non-empty strings, got {request_id!r}")
        prompt = self._check_prompt(request_id, prompt_token_ids)
        self._check_features(request_id, params, lora, features)
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"request {request_id!r}: priority must be an integer, got {priority!r}")
        salts = self._check_cache_key(request_id, cache_key)
        lora_slot, images, keys = self._request_inputs(request_id, prompt, lora, features)
        salts += keys                           # an adapter or an image changes every block's K/V
        if arrival_time is not None and (isinstance(arrival_time, bool) or not isinstance(arrival_time, (int, float))
                                         or not math.isfinite(arrival_time)):
            raise ValueError(f"request {request_id!r}: arrival_time must be a finite number of seconds, "
                             f"got {arrival_time!r}")
        if len(prompt) + params.max_tokens > self.max_model_len:
            raise ValueError(f"request {request_id!r}: prompt ({len(prompt)}) + max_tokens ({params.max_tokens}) "
                             f"exceed the model's {self.max_model_len} positions")
        # One id names one thing (abort_request takes either kind): a live request, or a group
        # with a live sample. A group whose samples all finished frees its id.
        if params.n > 1:
            ids = [f"{request_id}:{i}" for i in range(params.n)]
            each = [params.child(i) for i in range(params.n)]
        else:
            ids, each = [request_id], [params]
        # A sample's id may not be a live group's id either, or aborting that group would
        # reach this sample (and aborting this sample would reach the group).
        taken = [rid for rid in dict.fromkeys([request_id, *ids]) if self._id_taken(rid)]
        if taken:
            raise ValueError(f"request {taken[0]!r} is already in the engine")
        now = time.monotonic() if arrival_time is None else arrival_time
        requests = [Request(rid, list(prompt), p, self.eos_token_id, priority, now, salts)
                    for rid, p in zip(ids, each)]
        if self.guides is not None and (params.guided_regex is not None or params.guided_json is not None):
            try:                                  # one guide per sample: each walks its own text
                for request in requests:
                    request.guide = self.guides(request.params)
            except ValueError as exc:
                raise ValueError(f"request {request_id!r}: {exc}") from None
        for request in requests:
            request.lora_slot, request.images = lora_slot, images
            self.scheduler.check(request)          # pool capacity, budget, duplicate id
        # Generators are made here, before the engine changes: torch may still refuse a seed.
        generators = {r.request_id: self._make_generator(r) for r in requests if r.params.seed is not None}
        # Nothing below can fail: the engine changes only now.
        # Forget groups whose samples have all finished (their ids become free again), so the
        # map holds live groups only, however many requests a long-running engine serves.
        self.groups = {gid: samples for gid, samples in self.groups.items() if self._live_samples(gid)}
        for request in requests:
            self.scheduler.add(request)
        self.generators.update(generators)
        if params.n > 1:
            self.groups[request_id] = requests
            return requests
        return requests[0]

    @staticmethod
    def _check_cache_key(request_id: str, cache_key: Iterable[object]) -> tuple[Hashable, ...]:
        """The salts as a tuple of str, bytes and int only: block keys hash their printed form,
        which is exact and stable for those three types alone (two different tensors, or two
        objects of a class with its own __repr__, may print alike and would then share K/V)."""
        try:
            salts = tuple(cache_key)
        except TypeError:
            raise ValueError(f"request {request_id!r}: cache_key must be an iterable of salts, "
                             f"got {cache_key!r}") from None
        for salt in salts:          # subclasses excluded: they may print themselves as they like
            if type(salt) not in (str, bytes, int):
                raise ValueError(f"request {request_id!r}: cache_key salts must be str, bytes or int (hashed by "
                                 f"their exact printed form), got {type(salt).__name__} {salt!r}")
        return salts

    def _id_taken(self, request_id: str) -> bool:
        return request_id in self.scheduler.requests or bool(self._live_samples(request_id))

    def _live_samples(self, group_id: str) -> list[Request]:
        """The samples of group `group_id` that are still in the engine: the very Request
        objects it queued, so a later request that reuses a finished sample's id is not one."""
        live = self.scheduler.requests
        return [r for r in self.groups.get(group_id, []) if live.get(r.request_id) is r]

    def _make_generator(self, request: Request) -> torch.Generator:
        try:
            return torch.Generator(device=self.device).manual_seed(int(request.params.seed or 0))
        except (RuntimeError, ValueError, OverflowError) as exc:
            raise ValueError(f"request {request.request_id!r}: seed {request.params.seed} is refused by torch: "
                             f"{exc}") from None

    def _check_prompt(self, request_id: str, prompt_token_ids: Sequence[int] | torch.Tensor) -> list[int]:
        if isinstance(prompt_token_ids, (str, bytes)):
            raise ValueError(f"request {request_id!r}: give token ids, not text")
        dims = getattr(prompt_token_ids, "ndim", 1)
        if dims != 1:                       # a [1, T] batch is not flattened: that would hide a caller's bug
            raise ValueError(f"request {request_id!r}: the prompt must be one sequence of token ids (1-D), "
                             f"got an array with {dims} dimensions")
        if isinstance(prompt_token_ids, torch.Tensor):
            if prompt_token_ids.is_floating_point() or prompt_token_ids.is_complex():
                raise ValueError(f"request {request_id!r}: the prompt must be a sequence of integer token ids")
            prompt_token_ids = prompt_token_ids.tolist()
        try:
            prompt = [operator.index(t) for t in prompt_token_ids]
            if any(isinstance(t, bool) for t in prompt_token_ids):
                raise TypeError("True and False are not token ids")
        except TypeError:
            raise ValueError(f"request {request_id!r}: the prompt must be a sequence of integer token ids") from None
        if not prompt:
            raise ValueError(f"request {request_id!r}: the prompt is empty")
        bad = [(i, t) for i, t in enumerate(prompt) if not 0 <= t < self.vocab_size]
        if bad:
            i, t = bad[0]
            raise ValueError(f"request {request_id!r}: token {t} at prompt position {i} is outside the "
                             f"vocabulary (0..{self.vocab_size - 1}); {len(bad)} such token(s)")
        return prompt

    def _request_inputs(self, request_id: str, prompt: list[int], lora: object,
                        features: object) -> tuple[int, ImageInputs | None, tuple[Hashable, ...]]:
        """Chapter 43: a request's adapter slot (lora: a loaded adapter's name; 0 for none),
        its images (features: see serve.vision.image_inputs) and their block-hash keys."""
        slot, images = 0, None
        keys: tuple[Hashable, ...] = ()
        if lora is not None:
            from .lora import adapter_inputs
            slot, adapter_keys = adapter_inputs(self.runner.flat, request_id, lora)
            keys += adapter_keys
        if features:
            from .vision import image_inputs
            images, image_keys = image_inputs(self.runner.flat, request_id, prompt, features)
            keys += image_keys
        return slot, images, keys

    @property
    def sampler_name(self) -> str:
        """Which of serve.request.SAMPLERS picks this engine's tokens: the verifier with a
        drafter (Chapter 37), else the configured sampler, run on the device when the simple
        one schedules asynchronously (Chapter 33)."""
        if self.drafter is not None:
            return VERIFIER
        if self.config.sampler == "full":
            return FULL
        return ON_DEVICE if self.config.async_scheduling else SIMPLE

    def _check_features(self, request_id: str, params: SamplingParams, lora: object, features: object) -> None:
        if self.drafter is not None:                       # Chapter 37: what speculation cannot verify
            self.drafter.check_request(request_id, params, lora, features)
        why = refusal(params, self.sampler_name)         # serve.request.FIELD_RULES says who honours what
        if why is not None:
            raise ValueError(f"request {request_id!r}: {why}")
        if (params.guided_regex is not None or params.guided_json is not None) and self.guides is None:
            raise ValueError(f"request {request_id!r}: guided decoding (Chapter 35) needs the engine's vocab_bytes")
        check_token_ids(request_id, params, self.vocab_size)

    def abort_request(self, request_id: str) -> Request | list[Request | None] | None:
        """Stop a request wherever it is (waiting, running, preempted, swapped) and give back
        everything it holds. An n > 1 group id aborts all its samples. Returns the Request
        (a list for a group), or None for an unknown or already finished id."""
        if not isinstance(request_id, str):
            raise ValueError(f"request ids are non-empty strings, got {request_id!r}")
        if request_id in self.groups:
            live = self._live_samples(request_id)
            return [self._release(r.request_id) if r in live else None for r in self.groups.pop(request_id)]
        return self._release(request_id)

    def _release(self, request_id: str) -> Request | None:
        """Abort one request (never a group) and drop everything the engine keeps for it."""
        self.runner.swapped.pop(request_id, None)        # host copies of a swapped request
        self.generators.pop(request_id, None)
        request = self.scheduler.abort(request_id)
        if request is not None:
            drop_placeholders(request)                   # tokens still in flight are nobody's now
        return request

    @property
    def inflight(self) -> InflightStep | None:
        """The launched step whose tokens are not read yet (Chapter 33; None when synchronous)."""
        return self.async_steps.inflight if self.async_steps is not None else None

    @property
    def has_unfinished(self) -> bool:
        """True while any request waits or runs, or a launched step is unread."""
        return bool(self.scheduler.has_unfinished) or self.inflight is not None

    # --- the stubs and the parts of a step ---------------------------------------------------------

    def check_stop(self, request: Request, index: int = -1) -> Status | None:
        """Why the request ends after its token at `index` (the newest by default), or None.  (Your engine: Chapter 31)

        index: a position in request.token_ids (negative counts from the end). Let produced be
        the number of output tokens up to and including that token. Returns:
          Status.FINISHED_STOPPED, with request.stop_reason = the token, when it is in
            params.stop_token_ids; FINISHED_STOPPED when it is the request's eos_token_id and
            params.ignore_eos is off; neither applies while produced < params.min_tokens;
          Status.FINISHED_LENGTH when produced >= params.max_tokens, or when the prompt plus
            produced reaches self.max_model_len (no position left);
          None otherwise.
        When a stop token and the length rule both hold, the stop token wins. Changes nothing
        but stop_reason.
        """
        raise NotImplementedError("Your engine: Chapter 31: EngineCore.check_stop")

    def step(self) -> list[RequestOutput]:
        """One engine iteration; returns a RequestOutput per request that gained a token or
        finished this step, in plan order.  (Your engine: Chapter 31)

        A step goes through the engine's named parts, never around them: later chapters
        change what happens inside a part (Chapter 33 calls the same parts in another order),
        and self.scheduler called directly skips the plan's checks and preemption count.
          schedule() -> the plan; runner.prepare(plan.scheduled, plan.block_tables) -> Batch;
          execute_model(plan, batch or None) -> ModelOutput (None without a batch);
          record_prompt_logprobs(batch, prompt_rows) (Chapter 34; None is allowed);
          sample_tokens(plan, batch, logits) -> SampledTokens; update(plan, sampled) -> outputs.
        Invariants: each part runs at most once per step. A plan that schedules nobody builds
        no batch, samples and applies nothing and returns [], yet its block copies still
        happen. With self.async_steps set (Chapter 33) the step is self.async_steps.step().
        Example: a plan scheduling a (a decode) and b (a mid-prompt chunk) returns [a's
        output] only: b gained no token.
        """
        raise NotImplementedError("Your engine: Chapter 31: EngineCore.step")

    def schedule(self) -> SchedulerOutput:
        """The next step's plan (self.scheduler.schedule()), kept as self.last_plan, its
        preemptions counted in self.preemptions and, with self.checks set
        (EngineConfig.debug_checks), checked by checks.check_plan before anything carries it out."""
        plan = self.last_plan = self.scheduler.schedule()
        if self.checks is not None:
            self.checks.check_plan(plan, self.scheduler, f"engine step {self.steps}, the plan")
        self.preemptions += len(plan.preempted)
        return plan

    def execute_model(self, plan: SchedulerOutput, batch: Batch | None) -> ModelOutput | None:
        """Carry out a plan's block copies, then run its batch.  (Your engine: Chapter 31)

        plan: the step's SchedulerOutput; batch: its Batch (self.runner.prepare), or None
        when nothing is scheduled. Every (request, blocks) pair of plan.swap_out goes to
        self.runner.swap_out before any pair of plan.swap_in goes to self.runner.swap_in (a
        block one frees may be the block the other fills), and both before the forward pass.
        Returns None without a batch; else a ModelOutput of self.runner.execute(batch)'s
        float32 logits [L, vocab] (one row per batch.logits_indices): `logits` its first
        batch.num_sample_rows rows, `prompt_rows` the rest when batch.prompt_spans is not
        empty (Chapter 34's prompt-logprob rows), else None.
        It changes no request and no counter of the engine: the asynchronous engine (Chapter
        33) runs it on its device queue, possibly on another thread.
        """
        raise NotImplementedError("Your engine: Chapter 31: EngineCore.execute_model")

    def sample_tokens(self, plan: SchedulerOutput, batch: Batch, logits: torch.Tensor) -> SampledTokens:
        """The step's new tokens from its sampling rows (logits: ModelOutput.logits): the
        drafter's verification when there is one (Chapter 37), else the sampler's draws for
        every request with sampled rows (batch.sample_counts). A request that finished since
        the plan was made (the asynchronous engine samples a step after applying the one
        before it) is not sampled, as the synchronous engine would not sample it; its rows
        are left out. One request's failure is its own (see _sample)."""
        if self.drafter is not None:                      # Chapter 37: verify the drafts instead
            return self.drafter.verify(plan, batch, logits)
        live: list[Request] = []
        rows: dict[str, int] = {}
        keep: list[int] = []                              # the rows of live requests
        start = 0
        for (request, _), count in zip(plan.scheduled, batch.sample_counts):
            if count and not request.status.finished:
                live.append(request)
                rows[request.request_id] = count
                keep.extend(range(start, start + count))
            start += count
        if len(keep) < start:
            logits = logits[torch.tensor(keep, dtype=torch.int64, device=logits.device)]
        return self._sample(logits, live, rows)

    @property
    def update_hooks(self) -> UpdateHooks:
        """How update() applies tokens: the drafter's (Chapter 37), the asynchronous
        stepper's (Chapter 33), or Chapter 31's own."""
        return self.drafter or self.async_steps or self.plain_update

    def update(self, plan: SchedulerOutput, sampled: SampledTokens) -> list[RequestOutput]:
        """Apply a step's results to its scheduled requests; returns their outputs.  (Your engine: Chapter 31)

        plan: the step's SchedulerOutput; sampled: the sampler's tokens and logprobs by
        request id, and the error of each request whose sampling failed (sampled.failed,
        sampled.doing). Outputs follow plan order.
        Seam: a step's results reach a request only through hooks = self.update_hooks
        (advance, commit, report, after_update; serve.interfaces.UpdateHooks), which Chapters
        33 and 37 replace: a rule written around them would hold for Chapter 31's steps only.
        Afterwards, every scheduled request that was not already finished (one aborted while
        its step ran is left untouched) has had its rows counted and is in exactly one state:
          - an error (in sampled.failed, or raised by hooks.commit): finished alone, as
            aborted, its blocks freed, its output carrying an error that names what failed
            (sampled.doing or hooks.doing; "advancing its guide or ..." for a request with a
            guide, Chapter 35). self._abort_with_error makes that output;
          - no tokens (a mid-prompt chunk): running, its full blocks published (through
            self.scheduler.publish_computed), no output;
          - tokens, no stop: running, the kept tokens appended, its full blocks published,
            first_token_time set at its first token and never moved after;
          - tokens that stop it: finished with the status the stop rule gave, its blocks
            free for the next step's schedule, its generator dropped.
        An output is hooks.report's version of make_output(request, kept, its logprobs).
        Then after_update has seen the (request, kept) pairs still running, self.steps is one
        higher, and with self.checks set the scheduler passed checks.check_scheduler.
        Isolation: one request's failure is never the step's; the others end as if it had
        not been there.
        """
        raise NotImplementedError("Your engine: Chapter 31: EngineCore.update")

    def _sample(self, logits: torch.Tensor, requests: list[Request], rows: dict[str, int]) -> SampledTokens:
        """New tokens and logprobs by request id, and the error of each request whose sampling
        failed. One request must not cost the others their step: when the batched call fails,
        each request is sampled alone, from the generator states the step started with, so
        every other request draws exactly what it would have drawn."""
        if not requests:
            return SampledTokens()
        own: Mapping[str, torch.Generator] = self.generators
        ids = [r.request_id for r in requests]
        generators = [self.engine_generator] + [own[i] for i in ids if i in own]
        states = [g.get_state() for g in generators]
        try:
            tokens, logprobs = self.sampler(logits, requests, own)
            if len(tokens) != len(requests) or (logprobs and len(logprobs) != len(requests)):
                raise ValueError(f"the sampler returned {len(tokens)} token lists for {len(requests)} requests")
            return SampledTokens(dict(zip(ids, tokens)), dict(zip(ids, logprobs)) if logprobs else {})
        except Exception:
            for generator, state in zip(generators, states):
                generator.set_state(state)
        alone: dict[str, list[int]] = {}
        alone_logprobs: dict[str, object] = {}
        failed: dict[str, Exception] = {}
        start = 0
        for request in requests:
            count = rows[request.request_id]
            try:
                got, lp = self.sampler(logits[start:start + count], [request], own)
                alone[request.request_id] = got[0]
                if lp:
                    alone_logprobs[request.request_id] = lp[0]
            except Exception as exc:
                failed[request.request_id] = exc
            start += count
        return SampledTokens(alone, alone_logprobs, failed)

    def _keep_logprobs(self, request: Request, found: dict[str, Any]) -> list[TokenLogprobs] | None:
        """Chapter 34: append this step's logprobs of a request to request.logprobs (one
        entry per output token); returns a copy of them all, or None if it asked for none."""
        if request.params.logprobs is None:
            return None
        request.logprobs += found.get(request.request_id) or []
        return list(request.logprobs)

    def record_prompt_logprobs(self, batch: Batch, rows: torch.Tensor | None) -> None:
        """Chapter 34: the log-probabilities of prompt tokens from a batch's prompt-logprob
        rows (ModelOutput.prompt_rows; None: the batch has none, nothing to do), one row per
        prompt position that predicts a prompt token, kept in request.prompt_logprobs: entry
        p belongs to prompt token p (entry 0 is None: nothing predicts the first token). A
        position already recorded (a prompt computed again after preemption) is kept."""
        if rows is None:
            return
        targets = [token for _, _, tokens in batch.prompt_spans for token in tokens]
        widths = [request.params.prompt_logprobs or 0 for request, _, tokens in batch.prompt_spans for _ in tokens]
        found = token_logprobs(rows, torch.tensor(targets, dtype=torch.int64, device=rows.device), widths)
        offset = 0
        for request, start, tokens in batch.prompt_spans:
            recorded = request.prompt_logprobs
            if not recorded:
                recorded.append(None)
            for position, entry in enumerate(found[offset:offset + len(tokens)], start=start + 1):
                if position == len(recorded):
                    recorded.append(entry)
            offset += len(tokens)

    def _abort_with_error(self, request: Request, exc: Exception, doing: str) -> RequestOutput:
        """Finish one request whose own processing failed inside a step, as aborted, with the
        error on its output; the step goes on for everyone else."""
        request.error = f"request {request.request_id!r}: {doing} failed: {type(exc).__name__}: {exc}"
        logger.error(request.error, exc_info=exc)
        self._release(request.request_id)
        return self.make_output(request, [])

    # --- helpers ----------------------------------------------------------------------------------

    def make_output(self, request: Request, new_tokens: list[int], logprobs: Any = None) -> RequestOutput:
        prompt_logprobs = request.prompt_logprobs                   # Chapter 34, once the prompt is computed
        return RequestOutput(request.request_id, new_tokens, request.output_token_ids, request.status.finished,
                             request.status, request.stop_reason, request.num_cached_tokens, logprobs,
                             list(prompt_logprobs) if prompt_logprobs else None, error=request.error)

    def stats(self) -> dict[str, float]:
        """Counters for benchmarks and plots."""
        return {"steps": self.steps, "preemptions": self.preemptions, "prefix_hit_rate": self.blocks.hit_rate,
                "blocks_free": self.blocks.num_free, "num_blocks": self.blocks.num_blocks,
                "waiting": len(self.scheduler.waiting), "running": len(self.scheduler.running),
                **{f"prefix_{k}": v for k, v in self.blocks.stats.items()}}

    def generate(self, prompts: Iterable[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 priorities: Sequence[int] | None = None) -> list[RequestOutput | list[RequestOutput]]:
        """Run prompts (lists of token ids) to completion; returns one final RequestOutput per
        prompt, in order (a list of n of them when that prompt's params.n > 1).

        params: one SamplingParams for all prompts or one per prompt. Every prompt is
        validated before any is queued. An engine that already holds requests is refused
        (ValueError, nothing changed): generate would run them too, and their outputs would
        reach no step() their owner sees."""
        if self.has_unfinished:
            held = sorted(self.scheduler.requests)[:4]
            raise ValueError(f"generate: the engine already holds requests {held} (or an unread step); they would "
                             f"run to their end inside generate and their outputs reach no caller. Drive them "
                             f"with step(), or abort them, before calling generate")
        prompts = list(prompts)
        per_prompt: list[Any] = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(per_prompt) != len(prompts):
            raise ValueError(f"generate: {len(per_prompt)} SamplingParams for {len(prompts)} prompts")
        priorities = list(priorities) if priorities is not None else [0] * len(prompts)
        if len(priorities) != len(prompts):
            raise ValueError(f"generate: {len(priorities)} priorities for {len(prompts)} prompts")
        # The engine holds nothing, so any ids are free; numbered per call, they are unique.
        self._generate_calls += 1
        ids = [f"generate{self._generate_calls}-{i}" for i in range(len(prompts))]
        added = []
        try:
            for rid, prompt, p, priority in zip(ids, prompts, per_prompt, priorities):
                added.append(self.add_request(rid, prompt, p, priority))
            return self._run_to_completion(added)
        except BaseException:
            # Whatever went wrong (a bad prompt, a failing step, Ctrl-C), these requests must
            # not stay behind to fail every later call.
            for rid in ids[:len(added)]:
                self.abort_request(rid)
            raise

    def _run_to_completion(self, added: list[Request | list[Request]]) -> list[RequestOutput | list[RequestOutput]]:
        final: dict[str, RequestOutput] = {}
        wanted = {r.request_id for x in added for r in (x if isinstance(x, list) else [x])}
        while wanted - final.keys():
            outputs = self.step()
            if not outputs and self.last_plan is not None and self.last_plan.empty:
                raise RuntimeError(f"the scheduler planned nothing while {len(wanted - final.keys())} "
                                   f"request(s) are unfinished: {sorted(wanted - final.keys())[:4]}")
            for out in outputs:
                if out.finished and out.request_id in wanted:
                    final[out.request_id] = out
        return [[final[r.request_id] for r in x] if isinstance(x, list) else final[x.request_id] for x in added]
