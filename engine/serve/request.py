"""Chapter 31: what the engine knows about one request.

A request is a list of token ids (the prompt, then every token generated so far) and one
counter, `num_computed_tokens`: how many of those tokens already have keys and values in
the pool. Everything the scheduler decides is "compute the next n tokens of this request",
whether that is a prompt chunk, a decode step or a preempted request catching up.
"""
from __future__ import annotations

import enum
import math
import operator
import time
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch

from ..sampling import GREEDY_BELOW_TEMPERATURE

if TYPE_CHECKING:
    from .interfaces import Guide
    from .sampler import TokenLogprobs

# The value a token slot holds while the step that computes it is still running on the
# device (Chapter 33's asynchronous scheduling). Nothing in Chapter 31 produces it.
PLACEHOLDER = -1


class Status(enum.Enum):
    """Where a request is in its life. The three FINISHED_* kinds say why it ended."""
    WAITING = "waiting"                    # queued, never run
    RUNNING = "running"                    # holds blocks, scheduled step after step
    PREEMPTED = "preempted"                # lost its blocks; queued again to resume
    FINISHED_STOPPED = "finished_stopped"  # EOS or a stop token
    FINISHED_LENGTH = "finished_length"    # max_tokens or the model's context limit
    FINISHED_ABORTED = "finished_aborted"  # the client gave up

    @property
    def finished(self) -> bool:
        return self.name.startswith("FINISHED")

    @property
    def finish_reason(self) -> str | None:
        """The OpenAI-style word for a finished status ("stop", "length", "abort"), else None."""
        return {"FINISHED_STOPPED": "stop", "FINISHED_LENGTH": "length",
                "FINISHED_ABORTED": "abort"}.get(self.name)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(f"SamplingParams: {message}")


def _token_ids(name: str, values: Iterable[int]) -> tuple[int, ...]:
    """A tuple of integer token ids; 2.7 or "5" is refused, not rounded or parsed."""
    try:
        ids = tuple(operator.index(t) for t in values)
        _check(not any(isinstance(t, bool) for t in values), f"{name} must be integer token ids, got {values!r}")
        return ids
    except TypeError:
        raise ValueError(f"SamplingParams: {name} must be a sequence of integer token ids, got {values!r}") from None


def _integer(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _token_list(value: tuple[int, ...] | None) -> bool:
    return value is None or all(t >= 0 for t in value)


def _bias_entry(token: object, bias: object) -> bool:
    return _integer(token) and token >= 0 and _number(bias) and -100 <= bias <= 100     # type: ignore[operator]


# The samplers of the engine, by the names their refusals give them: Chapter 31's
# SimpleSampler, its on-device twin of Chapter 33's asynchronous engine, Chapter 34's full
# Sampler, and Chapter 37's verifier (which replaces sampling when the engine has a drafter).
SIMPLE, ON_DEVICE, FULL = "the simple sampler", "the on-device sampler", "the full sampler"
VERIFIER = "speculative decoding's verifier"
SAMPLERS = (SIMPLE, ON_DEVICE, FULL, VERIFIER)
EVERY_SAMPLER = frozenset(SAMPLERS)

# Why a sampler cannot honour a field, unless the field says something more precise.
NOT_HONOURED = {
    SIMPLE: "Chapter 8's sample applies only temperature, top_k, top_p and min_p; EngineConfig(sampler='full') "
            "honours it (Chapter 34)",
    ON_DEVICE: "Chapter 8's sample applies only temperature, top_k, top_p and min_p; EngineConfig(sampler='full') "
               "honours it (Chapter 34)",
    FULL: "the full sampler does not implement it",
    VERIFIER: "the verifier warps only temperature, top_k, top_p and min_p",
}


@dataclass(frozen=True)
class FieldRule:
    """One SamplingParams field, declared once: the values it takes (with the words an error
    says after the field's name), when a value asks anything of a sampler, and which
    samplers honour it. The engine refuses a request whose field asks something of a
    sampler it uses that does not honour it (`refusal`); the HTTP layer maps the error's
    message back to the body's field."""
    valid: Callable[[Any], bool]
    rule: str
    asks: Callable[[Any], bool]
    honoured_by: frozenset[str] = EVERY_SAMPLER
    reasons: Mapping[str, str] = field(default_factory=dict)    # sampler -> why not, where NOT_HONOURED is vague


def _whole(low: int) -> Callable[[Any], bool]:
    return lambda v: _integer(v) and v >= low


def _optional_whole(low: int) -> Callable[[Any], bool]:
    return lambda v: v is None or (_integer(v) and v >= low)


def _within(low: float, high: float, low_open: bool = False) -> Callable[[Any], bool]:
    return lambda v: _number(v) and (low < v if low_open else low <= v) and v <= high


_ALWAYS: Callable[[Any], bool] = lambda v: True   # noqa: E731
_MASKS = "guided decoding (Chapter 35) needs the sampler that applies the guide's masks: EngineConfig(sampler='full')"
_GUIDED = {SIMPLE: _MASKS, ON_DEVICE: _MASKS,
           VERIFIER: "a guide would have to advance over drafts that may be rejected"}
_HISTORY = "it depends on the tokens before each row, and a verification row's history includes unverified drafts"
# Seeds are 64-bit signed integers (torch's and vLLM's range); sample i of an n > 1 request is seeded seed + i.
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 63) - 1

FIELD_RULES: dict[str, FieldRule] = {
    "n": FieldRule(_whole(1), "must be an integer >= 1", lambda v: v > 1),
    "max_tokens": FieldRule(_whole(1), "must be an integer >= 1", _ALWAYS),
    "min_tokens": FieldRule(_whole(0), "must be an integer >= 0", lambda v: v > 0, frozenset({FULL}),
                            {VERIFIER: "it masks EOS row by row, and the verifier does not"}),
    "temperature": FieldRule(lambda v: _number(v) and v >= 0, "must be >= 0 (a finite number)", _ALWAYS),
    "top_k": FieldRule(_whole(0), "must be an integer >= 0", lambda v: v > 0),
    "top_p": FieldRule(_within(0, 1, low_open=True), "must be in (0, 1]", lambda v: v < 1),
    "min_p": FieldRule(_within(0, 1), "must be in [0, 1]", lambda v: v > 0),
    "typical_p": FieldRule(_within(0, 1, low_open=True), "must be in (0, 1]", lambda v: v < 1, frozenset({FULL})),
    "seed": FieldRule(lambda v: v is None or (_integer(v) and SEED_MIN <= v <= SEED_MAX),
                      f"must be an integer in [{SEED_MIN}, {SEED_MAX}] (64 bits, signed)", lambda v: v is not None),
    "stop_token_ids": FieldRule(_token_list, "must be token ids >= 0", bool),
    "ignore_eos": FieldRule(lambda v: isinstance(v, bool), "must be True or False", bool),
    "logprobs": FieldRule(_optional_whole(0), "must be an integer >= 0 or None", lambda v: v is not None,
                          frozenset({FULL}), {VERIFIER: "the verifier reports no logprobs"}),
    "prompt_logprobs": FieldRule(_optional_whole(0), "must be an integer >= 0 or None", lambda v: v is not None,
                                 frozenset({FULL}), {VERIFIER: "the verifier reports no logprobs"}),
    # vLLM's ranges for the three penalties.
    "presence_penalty": FieldRule(_within(-2, 2), "must be in [-2, 2]", lambda v: v != 0, frozenset({FULL}),
                                  {VERIFIER: _HISTORY}),
    "frequency_penalty": FieldRule(_within(-2, 2), "must be in [-2, 2]", lambda v: v != 0, frozenset({FULL}),
                                   {VERIFIER: _HISTORY}),
    "repetition_penalty": FieldRule(lambda v: _number(v) and v > 0, "must be a finite number > 0", lambda v: v != 1,
                                    frozenset({FULL}), {VERIFIER: _HISTORY}),
    "logit_bias": FieldRule(lambda v: v is None or all(_bias_entry(t, b) for t, b in v.items()),
                            "must map token ids (integers >= 0) to numbers in [-100, 100] (OpenAI's range)", bool,
                            frozenset({FULL})),
    "allowed_token_ids": FieldRule(_token_list, "must be token ids >= 0", lambda v: v is not None, frozenset({FULL})),
    "bad_words_token_ids": FieldRule(lambda v: all(v), "must be non-empty token sequences", bool, frozenset({FULL})),
    "guided_regex": FieldRule(lambda v: v is None or isinstance(v, str), "must be a regular expression (a string)",
                              lambda v: v is not None, frozenset({FULL}), _GUIDED),
    # Before guided_json, so a request that asks for JSON Schema's open objects is refused by that name.
    "guided_json_strict": FieldRule(lambda v: isinstance(v, bool), "must be True or False", lambda v: not v,
                                    frozenset({FULL}), _GUIDED),
    "guided_json": FieldRule(_ALWAYS, "", lambda v: v is not None, frozenset({FULL}), _GUIDED),
}


def refusal(params: SamplingParams, sampler: str) -> str | None:
    """Why `sampler` (one of SAMPLERS) cannot serve a request with these parameters, naming
    the first field that asks for what it does not honour; None when it can."""
    for name, rule in FIELD_RULES.items():
        if sampler not in rule.honoured_by and rule.asks(getattr(params, name)):
            return f"{name} is not honoured by {sampler}: {rule.reasons.get(sampler, NOT_HONOURED[sampler])}"
    return None


@dataclass
class SamplingParams:
    """How to pick a request's tokens and when to stop.

    What each field accepts and which samplers honour it is declared once, in FIELD_RULES:
    Chapter 31's SimpleSampler honours temperature, top_k, top_p, min_p and seed; the stop
    rules (max_tokens, min_tokens, stop_token_ids, ignore_eos) live in EngineCore.check_stop.
    The penalty, bias, allowed/bad token, min_tokens and logprob fields need Chapter 34's
    full sampler (EngineConfig(sampler="full"), serve/sampler.py states their semantics);
    the engine refuses them with the simple one. The guided fields wait for Chapter 35.
    """
    n: int = 1
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    typical_p: float = 1.0                 # locally typical sampling; 1: off (Chapter 34)
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None            # top-k logprobs per output token (Chapter 34)
    prompt_logprobs: int | None = None     # logprobs of the prompt's own tokens (Chapter 34)
    presence_penalty: float = 0.0          # Chapter 34
    frequency_penalty: float = 0.0         # Chapter 34
    repetition_penalty: float = 1.0        # Chapter 34
    logit_bias: dict[int, float] | None = None         # token id -> added logit (Chapter 34)
    allowed_token_ids: tuple[int, ...] | None = None  # Chapter 34
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()   # token sequences never to complete (Chapter 34)
    guided_regex: str | None = None        # Chapter 35
    guided_json: object = None             # Chapter 35
    guided_json_strict: bool = True        # a missing additionalProperties forbids extra keys (Chapter 35)

    def __post_init__(self) -> None:
        self.stop_token_ids = _token_ids("stop_token_ids", self.stop_token_ids)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _token_ids("allowed_token_ids", self.allowed_token_ids)
        self.bad_words_token_ids = tuple(_token_ids("bad_words_token_ids", word) for word in self.bad_words_token_ids)
        self.validate()

    def validate(self) -> SamplingParams:
        """Raise ValueError naming the first field whose value makes no sense."""
        for name, rule in FIELD_RULES.items():
            value = getattr(self, name)
            _check(rule.valid(value), f"{name} {rule.rule}, got {value!r}")
        _check(self.min_tokens <= self.max_tokens,
               f"min_tokens ({self.min_tokens}) exceeds max_tokens ({self.max_tokens})")
        _check(self.seed is None or self.seed + self.n - 1 <= SEED_MAX,
               f"seed + n - 1 must stay within 64 bits, signed (<= {SEED_MAX}), got seed {self.seed} with n {self.n}")
        _check(self.guided_regex is None or self.guided_json is None,
               "give guided_regex or guided_json, not both")
        return self

    @property
    def greedy(self) -> bool:
        """Chapter 8's rule: temperatures this close to 0 are argmax, whatever the filters say."""
        return self.temperature < GREEDY_BELOW_TEMPERATURE

    @property
    def needs_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    def child(self, index: int) -> SamplingParams:
        """The parameters of sample `index` of an n > 1 request: n = 1, and a seed of its own
        (seed + index) so the samples differ yet reproduce."""
        seed = None if self.seed is None else self.seed + index
        return replace(self, n=1, seed=seed)


@dataclass
class ImageInputs:
    """Chapter 43: what a request with images brings to every step that computes its prompt.

    embeds [M, D]: the image rows, which replace the token embeddings at prompt positions
    `positions` [M] int64; mrope_positions [3, P] int64: the three rotary axes of each
    prompt position; mrope_delta: what positions after the prompt add on all three axes."""
    embeds: torch.Tensor
    positions: torch.Tensor
    mrope_positions: torch.Tensor
    mrope_delta: int


@dataclass(eq=False)
class Request:
    """One sequence inside the engine.

    `token_ids` holds the prompt followed by the output; `num_computed_tokens` of them have
    K/V in the pool. Invariant once a request runs: the newest token is never computed yet
    (the step that samples it only appends it), so a decode step feeds exactly one token.
    """
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    eos_token_id: int | None = None
    priority: int = 0                  # "priority" policy: smaller runs first (vLLM's convention)
    arrival_time: float = field(default_factory=time.monotonic)
    cache_key: tuple[Hashable, ...] = ()              # whatever else changes the activations: adapter, images, salt
    status: Status = Status.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0         # statistic: prompt tokens found in the prefix cache at admission
    spec_token_ids: list[int] = field(default_factory=list)   # draft tokens to verify (Chapter 37)
    swapped_out: bool = False          # True while its K/V are parked on the host
    stop_reason: int | str | None = None   # the stop token (or rule) that ended it
    num_preemptions: int = 0
    first_token_time: float | None = None
    finish_time: float | None = None
    error: str | None = None           # why the engine aborted it, when its own processing failed
    # The state of later chapters' features, each in its own typed field:
    logprobs: list[TokenLogprobs] = field(default_factory=list)         # one per output token (Chapter 34)
    prompt_logprobs: list[TokenLogprobs | None] = field(default_factory=list)  # per prompt token (Chapter 34)
    guide: Guide | None = None         # its constrained-decoding guide (Chapter 35)
    lora_slot: int = 0                 # its adapter's slot in the AdapterBank; 0: none (Chapter 43)
    images: ImageInputs | None = None  # its images' rows and 3-axis positions (Chapter 43)

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id!r}: the prompt is empty")
        self.token_ids = [int(t) for t in self.prompt_token_ids]
        self.num_prompt_tokens = len(self.token_ids)
        self.block_hashes: list[bytes] = []   # one per full block, appended by the block manager
        self.num_placeholders = 0      # trailing PLACEHOLDER tokens (Chapter 33)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self.token_ids) + len(self.spec_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append(self, token_id: int) -> None:
        self.token_ids.append(int(token_id))

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.name}, prompt={self.num_prompt_tokens}, "
                f"output={self.num_output_tokens}, computed={self.num_computed_tokens})")


@dataclass
class RequestOutput:
    """What one step reports for one request: the tokens it gained this step and, once it
    has finished, why."""
    request_id: str
    new_token_ids: list[int]
    output_token_ids: list[int]
    finished: bool = False
    status: Status = Status.RUNNING
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    logprobs: list[Any] | None = None          # Chapter 34: one entry per output token so far
    prompt_logprobs: list[Any] | None = None   # Chapter 34: one per prompt token (the first is None)
    error: str | None = None           # set when the engine aborted the request because its processing failed

    @property
    def finish_reason(self) -> str | None:
        return self.status.finish_reason if self.finished else None


__all__ = ["PLACEHOLDER", "Status", "SamplingParams", "Request", "RequestOutput", "FieldRule", "FIELD_RULES",
           "SAMPLERS", "SIMPLE", "ON_DEVICE", "FULL", "VERIFIER", "refusal"]
