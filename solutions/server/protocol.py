"""Chapter 38: what crosses the wire, checked before anything reaches the engine.

A request body becomes a `ParsedRequest` (token ids, SamplingParams, stop strings, how to
answer) or an `ApiError`, OpenAI's error object with an HTTP status. Every rule names the
offending field. The policy for fields:

- supported: model, prompt (completions) / messages (chat), max_tokens (chat also
  max_completion_tokens), n, temperature, top_p, top_k, min_p, seed, stop, stream,
  stream_options.include_usage, user (accepted, unused), echo (completions), and vLLM's
  extensions stop_token_ids, ignore_eos, min_tokens, return_token_ids (each choice carries
  its token ids and the prompt's). Messages take any role string the chat template
  renders; keys besides role, content and name are ignored, except tool calls (refused).
  With Chapter 34's full sampler: logprobs (completions: how many top tokens, 0..5; chat:
  true/false with top_logprobs 0..20), typical_p, presence_penalty and frequency_penalty (-2..2),
  logit_bias (token id -> -100..100) and vLLM's repetition_penalty (> 0). An engine with
  Chapter 31's simple sampler refuses those requests itself (a 400 naming the sampler).
- OpenAI fields this engine cannot honour (prompt logprobs, suffix, tools, ...):
  accepted only at their neutral value (null, false, 0); anything else is a 400 that
  names the field and says why. A field silently ignored is a wrong answer nobody notices.
- what one request may ask is bounded by `Limits` (options of `run.py serve`).
- any other field: a 400 naming it (a typo such as "max_token" must not fall back to a
  default).
"""
from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from ..serve.guided import JSON_OBJECT

if TYPE_CHECKING:
    from ..serve.request import SamplingParams
    from ..serve.sampler import TokenLogprobs
    from .text import ChatTokenizer

DEFAULT_MAX_TOKENS = 16         # OpenAI's default for /v1/completions
DEFAULT_CHAT_MAX_TOKENS = 256   # chat default: this many, or what the context has left
# Message keys that carry tool calls: refused unless empty (the rest of a message's extra keys,
# e.g. a client's own bookkeeping, are ignored, as vLLM does).
TOOL_MESSAGE_KEYS = ("tool_calls", "tool_call_id", "function_call")

MAX_LOGPROBS = 5                # OpenAI's limit for /v1/completions' logprobs
MAX_TOP_LOGPROBS = 20           # and for chat's top_logprobs
MAX_INTEGER = 1 << 64           # no integer anywhere in a body is this large or larger (in size)
MAX_INTEGER_DIGITS = 20         # 2**64 has 20 digits: a longer one is refused without converting it


@dataclass(frozen=True)
class Limits:
    """What one request may ask of the server; each is an option of `run.py serve`.
    Breaking one is a 400 naming the field (the body's size: a 413)."""
    max_body_bytes: int = 1 << 20       # the whole request body
    max_json_depth: int = 32            # arrays and objects nested in the body
    max_string_chars: int = 1 << 16     # any one string (the prompt and message contents have their own)
    max_prompt_chars: int = 1 << 19     # a text prompt, or all of a chat's message contents together
    max_messages: int = 512             # entries of a chat's messages
    max_n: int = 16                     # samples per request
    max_output_tokens: int = 8192       # a request's max_tokens (also bounded by what the context has left)
    max_stop_strings: int = 4           # OpenAI's limit
    max_stop_chars: int = 256           # characters of one stop string
    max_stop_token_ids: int = 16
    max_logit_bias: int = 300           # entries of logit_bias
    max_guide_chars: int = 1 << 14      # a guided_regex, or a JSON schema written as compact JSON
    max_prompts: int = 16               # prompts in one completions request (a list of prompts)

COMMON_FIELDS = {"model", "max_tokens", "n", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stream",
                 "stream_options", "user", "stop_token_ids", "ignore_eos", "min_tokens", "return_token_ids", "logprobs",
                 "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "response_format",
                 "guided_regex", "guided_json", "structured_outputs", "typical_p"}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "echo"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens", "top_logprobs"}

# Known OpenAI fields: the values that mean "off", and why anything else is refused.
UNSUPPORTED_FIELDS = {
    "prompt_logprobs": ((None,), "this server does not return prompt log-probabilities"),
    "echo": ((None, False), "chat completions do not echo the prompt (completions do)"),
    "suffix": ((None, ""), "insertion (suffix) needs a fill-in-the-middle model"),
    "best_of": ((None, 1), "best_of needs per-sample log-probabilities"),
    "tools": ((None,), "tool calls are not implemented"),
    "tool_choice": ((None, "none"), "tool calls are not implemented"),
    "functions": ((None,), "tool calls are not implemented"),
    "function_call": ((None, "none"), "tool calls are not implemented"),
    "parallel_tool_calls": ((None,), "tool calls are not implemented"),
}


class ApiError(Exception):
    """An answer in OpenAI's error format: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(param: str | None, message: str, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def parse_json_body(raw: bytes, limits: Limits) -> dict[str, Any]:
    """Bytes of a request body -> a JSON object, or the ApiError a client can act on.
    Besides JSON itself: the body's size, its nesting depth, every string's length and
    UTF-8-ness (no lone surrogates such as "\\ud800") and every integer's size are checked
    here, so nothing later meets a value it cannot handle."""
    if len(raw) > limits.max_body_bytes:
        raise ApiError(413, f"the request body has {len(raw)} bytes; this server takes at most "
                            f"{limits.max_body_bytes}", code="body_too_large")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise bad(None, f"the request body is not UTF-8 (byte {exc.start} is invalid)") from None
    try:
        body = json.loads(text, parse_int=_read_integer)
    except json.JSONDecodeError as exc:
        raise bad(None, f"the request body is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") \
            from None
    except RecursionError:
        raise bad(None, f"the request body nests arrays or objects too deeply (at most {limits.max_json_depth} "
                        f"levels)") from None
    if not isinstance(body, dict):
        raise bad(None, f"the request body must be a JSON object, got {type(body).__name__}")
    _check_values(body, limits)
    return body


class TooLong(int):
    """An integer written with too many digits to read (Python refuses to convert more than
    4,300): kept as its digit count, so the walk below can name the field that holds it."""


def _read_integer(digits: str) -> int:
    if len(digits.lstrip("-")) > MAX_INTEGER_DIGITS:
        return TooLong(len(digits))
    return int(digits)


def _check_values(body: dict[str, Any], limits: Limits) -> None:
    """Walk the body without recursion; any breach is a 400 naming the top-level field."""
    pending: list[tuple[Any, int, str]] = [(value, 1, name) for name, value in body.items()]
    while pending:
        value, depth, where = pending.pop()
        if isinstance(value, (dict, list)):
            if depth >= limits.max_json_depth:
                raise bad(where, f"{where} nests arrays or objects more than {limits.max_json_depth} levels deep")
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for key, item in items:
                if isinstance(key, str):
                    _check_string(key, where, limits.max_string_chars)
                pending.append((item, depth + 1, where))
        elif isinstance(value, str):
            long_allowed = where in ("prompt", "messages")       # their own limit: max_prompt_chars
            _check_string(value, where, limits.max_prompt_chars if long_allowed else limits.max_string_chars)
        elif isinstance(value, TooLong) or (isinstance(value, int) and abs(value) >= MAX_INTEGER):
            digits = int(value) if isinstance(value, TooLong) else len(str(abs(value)))
            raise bad(where, f"{where} holds an integer of {digits} digits; integers here stay below 2**64")


def _check_string(value: str, where: str, max_chars: int) -> None:
    if len(value) > max_chars:
        raise bad(where, f"{where} holds a string of {len(value)} characters; at most {max_chars} are allowed")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise bad(where, f"{where} holds a lone surrogate (\\u{ord(value[exc.start]):04x}), which is not "
                         f"text") from None


# --- typed fields --------------------------------------------------------------------------------

Default = TypeVar("Default", int, None)


def _integer(body: dict[str, Any], name: str, default: Default, low: int | None = None,
             high: int | None = None) -> int | Default:
    """The body's integer `name` (default when absent or null), checked against the wire's
    own bounds low..high, when given (ranges of SamplingParams' fields are its own)."""
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(name, f"{name} must be an integer, got {_shown(value)}")
    if low is not None and (value < low or (high is not None and value > high)):
        allowed = f">= {low}" if high is None else f"between {low} and {high}"
        raise bad(name, f"{name} must be {allowed}, got {value}")
    return value


def _number(body: dict[str, Any], name: str, default: float) -> float:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad(name, f"{name} must be a number, got {_shown(value)}")
    return float(value)


def _flag(body: dict[str, Any], name: str, default: bool = False) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad(name, f"{name} must be true or false, got {_shown(value)}")
    return value


def _same(value: object, off: object) -> bool:
    """JSON equality without Python's True == 1: false is not 0, 0.0 is 0."""
    if isinstance(value, bool) or isinstance(off, bool) or off is None:
        return value is off
    if isinstance(off, (int, float)):
        return isinstance(value, (int, float)) and value == off
    return value == off


def _check_fields(body: dict[str, Any], allowed: set[str]) -> None:
    for name, value in body.items():
        if name in allowed:
            continue
        if name in UNSUPPORTED_FIELDS:
            neutral, why = UNSUPPORTED_FIELDS[name]
            if any(_same(value, off) for off in neutral):
                continue
            raise bad(name, f"{name}={_shown(value)} is not supported: {why}", code="unsupported_field")
        raise bad(name, f"unknown field {name!r}", code="unknown_field")


def _stop_strings(body: dict[str, Any], limits: Limits) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad("stop", f"stop must be a string or a list of strings, got {_shown(stop)}")
    if len(stops) > limits.max_stop_strings:
        raise bad("stop", f"stop has {len(stops)} strings; at most {limits.max_stop_strings} are allowed")
    for s in stops:
        if not s or len(s) > limits.max_stop_chars:
            raise bad("stop", f"each stop string must have 1 to {limits.max_stop_chars} characters, "
                              f"got {_shown(s)}")
    return tuple(stops)


def _stop_token_ids(body: dict[str, Any], limits: Limits, vocab_size: int | None) -> tuple[int, ...]:
    ids = body.get("stop_token_ids")
    if ids is None:
        return ()
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise bad("stop_token_ids", f"stop_token_ids must be a list of token ids (integers >= 0), "
                                    f"got {_shown(ids)}")
    if len(ids) > limits.max_stop_token_ids:
        raise bad("stop_token_ids", f"stop_token_ids has {len(ids)} ids; at most {limits.max_stop_token_ids} "
                                    f"are allowed")
    if vocab_size is not None and any(t >= vocab_size for t in ids):
        outside = [t for t in ids if t >= vocab_size]
        raise bad("stop_token_ids", f"stop_token_ids {outside} are outside the vocabulary (0..{vocab_size - 1})")
    return tuple(ids)


def _logprobs(body: dict[str, Any], chat: bool) -> int | None:
    """How many top tokens each output position lists, or None for no log-probabilities.
    Completions: logprobs is that number (0..5). Chat: logprobs is true/false and
    top_logprobs (0..20, only with logprobs: true) the number."""
    if not chat:
        return _integer(body, "logprobs", None, 0, MAX_LOGPROBS)
    wanted = _flag(body, "logprobs")
    top = _integer(body, "top_logprobs", None, 0, MAX_TOP_LOGPROBS)
    if top is not None and not wanted:
        raise bad("top_logprobs", "top_logprobs needs logprobs: true")
    return (top or 0) if wanted else None


def _logit_bias(body: dict[str, Any], limits: Limits, vocab_size: int | None) -> dict[int, float] | None:
    """OpenAI's logit_bias: an object from token ids (as decimal strings) to numbers. Every
    bad key is named, not only the first."""
    bias = body.get("logit_bias")
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise bad("logit_bias", f"logit_bias must be an object from token ids to numbers, got {_shown(bias)}")
    if len(bias) > limits.max_logit_bias:
        raise bad("logit_bias", f"logit_bias has {len(bias)} entries; at most {limits.max_logit_bias} are allowed")
    not_ids = [key for key in bias if not _token_id_text(key, vocab_size)]
    if not_ids:
        allowed = "" if vocab_size is None else f" (0..{vocab_size - 1})"
        raise bad("logit_bias", f"logit_bias keys must be token ids{allowed} written in decimal; "
                                f"not: {', '.join(_shown(key) for key in not_ids[:10])}")
    not_numbers = [key for key, value in bias.items() if isinstance(value, bool) or not isinstance(value, (int, float))]
    if not_numbers:             # their range is SamplingParams' rule
        raise bad("logit_bias", f"logit_bias values must be numbers; not: "
                                f"{', '.join(f'{key}: {_shown(bias[key])}' for key in not_numbers[:10])}")
    return {int(key): float(value) for key, value in bias.items()}


def _token_id_text(key: str, vocab_size: int | None) -> bool:
    """Is `key` a token id written in ASCII decimal ("²" and "１" are digits to Python, not here)?"""
    if not (0 < len(key) <= 10 and key.isascii() and key.isdigit()):
        return False
    return vocab_size is None or int(key) < vocab_size


def _shown(value: object, width: int = 80) -> str:
    """A value as JSON, cut to `width` characters, for an error message."""
    text = json.dumps(value)
    return text if len(text) <= width else text[:width] + "..."


def _json_schema_strict(body: dict[str, Any]) -> bool | None:
    """OpenAI's response_format.json_schema.strict: false asks for JSON Schema's own rule
    (a missing additionalProperties allows extra keys); absent or true keeps Chapter 35's
    strict default (no key the schema does not list)."""
    wanted = body.get("response_format")
    inner = wanted.get("json_schema") if isinstance(wanted, dict) else None
    strict = inner.get("strict") if isinstance(inner, dict) else None
    if strict is not None and not isinstance(strict, bool):
        raise bad("response_format", f"response_format json_schema strict must be true or false, got {_shown(strict)}")
    return strict


def _guided(body: dict[str, Any], limits: Limits) -> tuple[str | None, Any]:
    """(guided_regex, guided_json) for Chapter 35's guides, from OpenAI's response_format
    ({"type": "json_schema", "json_schema": {"schema": {...}}}, {"type": "json_object"}, which
    becomes guided_json {"type": "json_object"}, or {"type": "text"}) or from
    vLLM's own fields guided_regex (a pattern) and guided_json (a schema, or its JSON text).
    Whether a pattern or schema can be compiled is the engine's check (a 400 all the same)."""
    regex, schema = body.get("guided_regex"), body.get("guided_json")
    if body.get("structured_outputs") is not None:
        if regex is not None or schema is not None:
            raise bad("structured_outputs", "give the guide once: structured_outputs or guided_regex / guided_json")
        regex, schema = _structured_outputs(body["structured_outputs"])
    if regex is not None and not isinstance(regex, str):
        raise bad("guided_regex", f"guided_regex must be a string (a regular expression), got {_shown(regex)}")
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except (ValueError, RecursionError):
            raise bad("guided_json", "guided_json must be a JSON schema (an object, or its JSON text)") from None
        _check_values({"guided_json": schema}, limits)
    if schema is not None and not isinstance(schema, dict):
        raise bad("guided_json", f"guided_json must be a JSON schema object, got {_shown(schema)}")
    wanted = body.get("response_format")
    if wanted is not None:
        kind = wanted.get("type") if isinstance(wanted, dict) else None
        if kind == "json_schema":
            inner = wanted.get("json_schema")
            if not isinstance(inner, dict) or not isinstance(inner.get("schema"), dict):
                raise bad("response_format", 'response_format json_schema needs {"json_schema": {"schema": {...}}}')
            if schema is not None:
                raise bad("response_format", "give the schema once: response_format or guided_json, not both")
            schema = inner["schema"]
        elif kind == "json_object":          # any JSON object: Chapter 35's pushdown guide
            if schema is not None:
                raise bad("response_format", "give the schema once: response_format or guided_json, not both")
            schema = dict(JSON_OBJECT)
        elif kind != "text":
            raise bad("response_format", f'response_format type must be "text", "json_schema" or "json_object", '
                                         f"got {_shown(wanted)}")
    if regex is not None and schema is not None:
        raise bad("guided_regex", "a request is guided by a regular expression or a JSON schema, not both")
    size = len(regex) if regex is not None else len(json.dumps(schema, separators=(",", ":"))) if schema else 0
    if size > limits.max_guide_chars:
        name = guide_field(body) or "guided_json"
        raise bad(name, f"{name} has {size} characters; a guide may have at most {limits.max_guide_chars}")
    return regex, schema


# vLLM 0.11's structured_outputs keys this server can honour, and what each becomes.
STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "json_object")


def _structured_outputs(value: Any) -> tuple[str | None, Any]:
    """(guided_regex, guided_json) of vLLM 0.11's `structured_outputs` object, which names
    exactly one constraint: "json" (a schema, or its JSON text), "regex", "choice" (a list of
    strings: the answer is one of them, exactly) or "json_object": true (any JSON object).
    Its other constraints (grammar, structural_tag) are refused by name."""
    if not isinstance(value, dict):
        raise bad("structured_outputs", f"structured_outputs must be an object, got {_shown(value)}")
    given = {key: item for key, item in value.items() if item is not None and item is not False}
    unknown = sorted(set(given) - set(STRUCTURED_OUTPUT_KINDS))
    if unknown:
        raise bad("structured_outputs", f"structured_outputs.{unknown[0]} is not supported by this server; it "
                                        f"honours one of {', '.join(STRUCTURED_OUTPUT_KINDS)}",
                  code="unsupported_field")
    if len(given) != 1:
        raise bad("structured_outputs", f"structured_outputs must name exactly one of "
                                        f"{', '.join(STRUCTURED_OUTPUT_KINDS)}, got {sorted(given) or 'none'}")
    kind, item = next(iter(given.items()))
    if kind == "json":
        return None, item
    if kind == "regex":
        return item, None
    if kind == "json_object":
        if item is not True:
            raise bad("structured_outputs", f"structured_outputs.json_object must be true, got {_shown(item)}")
        return None, dict(JSON_OBJECT)
    if not isinstance(item, list) or not item or not all(isinstance(choice, str) and choice for choice in item):
        raise bad("structured_outputs", "structured_outputs.choice must be a non-empty list of non-empty strings, "
                                        f"got {_shown(item)}")
    return "|".join(re.escape(choice) for choice in item), None


def guide_field(body: dict[str, Any]) -> str | None:
    """The field a request's guide came from, to name in its errors."""
    for name in ("guided_regex", "guided_json", "structured_outputs", "response_format"):
        if body.get(name) is not None:
            return name
    return None


def _messages(body: dict[str, Any], limits: Limits) -> list[dict[str, str]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "messages must be a non-empty list of {role, content} objects")
    if len(messages) > limits.max_messages:
        raise bad("messages", f"messages has {len(messages)} entries; at most {limits.max_messages} are allowed")
    cleaned = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad(where, f"{where} must be an object with role and content")
        tools = [key for key in TOOL_MESSAGE_KEYS if message.get(key) not in (None, [], "")]
        if tools:
            raise bad(f"{where}.{tools[0]}", f"{where}.{tools[0]} is not supported: tool calls are not implemented",
                      code="unsupported_field")
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not role:
            raise bad(f"{where}.role", f"{where}.role must be a non-empty string (the chat template decides which "
                                       f"roles it knows), got {_shown(role)}")
        if isinstance(content, list):       # content parts: only text ones
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise bad(f"{where}.content", f"{where}.content parts must be {{\"type\": \"text\", \"text\": ...}}; "
                                              f"images and audio are not supported")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise bad(f"{where}.content", f"{where}.content must be a string, got {_shown(content)}")
        cleaned.append({"role": role, "content": content, **({"name": message["name"]}
                                                              if isinstance(message.get("name"), str) else {})})
    total = sum(len(m["content"]) for m in cleaned)
    if total > limits.max_prompt_chars:
        raise bad("messages", f"the messages' contents have {total} characters; at most {limits.max_prompt_chars} "
                              f"are allowed")
    return cleaned


def prompt_batch(body: dict[str, Any], limits: Limits) -> list[Any] | None:
    """The prompts of a completions request that sends several (a list of strings, or of
    token-id lists), each to be parsed as its own request; None for a single prompt."""
    prompt = body.get("prompt")
    if not isinstance(prompt, list) or not prompt:
        return None
    if not (all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt)):
        return None
    if len(prompt) > limits.max_prompts:
        raise bad("prompt", f"prompt holds {len(prompt)} prompts; at most {limits.max_prompts} are allowed")
    if body.get("stream"):
        raise bad("prompt", "a list of prompts is answered whole: send stream: false, or one prompt per request",
                  code="unsupported_field")
    return prompt


def _completion_prompt(body: dict[str, Any], tokenizer: ChatTokenizer, vocab_size: int | None) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        if not prompt:
            raise bad("prompt", "prompt is empty")
        return tokenizer.encode(prompt)
    if isinstance(prompt, list):
        if not prompt:
            raise bad("prompt", "prompt is empty")
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            outside = [(i, t) for i, t in enumerate(prompt) if t < 0 or (vocab_size is not None and t >= vocab_size)]
            if outside:
                i, t = outside[0]
                allowed = "" if vocab_size is None else f" (0..{vocab_size - 1})"
                raise bad("prompt", f"prompt[{i}] = {t} is not a token id of this model's vocabulary{allowed}; "
                                    f"{len(outside)} such id(s)")
            return list(prompt)
        if all(isinstance(p, str) for p in prompt):
            raise bad("prompt", "a list of prompts is a batch: split it with prompt_batch first")
    if prompt is None:
        raise bad("prompt", "prompt is required")
    raise bad("prompt", f"prompt must be a string or a list of token ids, got {_shown(prompt)}")


@dataclass
class ParsedRequest:
    """A checked request: what the engine gets and how the server answers."""
    chat: bool
    model: str
    prompt_ids: list[int]
    params: SamplingParams
    stops: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False
    sent: tuple[str, ...] = ()          # the body's fields, to name in errors found later
    echo: bool = False                  # completions: the answer's text (and logprobs) start with the prompt


def parse_request(body: dict[str, Any], *, chat: bool, model_name: str, tokenizer: ChatTokenizer,
                  max_model_len: int, sampling_params_class: type[SamplingParams], limits: Limits = Limits(),
                  vocab_size: int | None = None) -> ParsedRequest:
    """A JSON object of /v1/completions (chat=False) or /v1/chat/completions (chat=True) ->
    a ParsedRequest, or ApiError naming the first field that breaks a rule. vocab_size:
    the model's, so token ids the client names (prompt, stop_token_ids, logit_bias) are
    checked here and their errors name the field."""
    _check_fields(body, CHAT_FIELDS if chat else COMPLETION_FIELDS)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("model", "model is required: a string naming a model of GET /v1/models")
    if model != model_name:
        raise ApiError(404, f"model {model!r} does not exist; this server serves {model_name!r}", param="model",
                       code="model_not_found")
    if chat:
        messages = _messages(body, limits)
        try:
            prompt_ids = tokenizer.encode_chat(messages, add_generation_prompt=True)
        except ValueError as exc:          # e.g. a role this model's template refuses
            raise bad("messages", f"the chat template cannot render these messages: {exc}") from None
        except Exception as exc:           # a Jinja template's own exception (raise_exception)
            raise bad("messages", f"the chat template refused these messages: {type(exc).__name__}: {exc}") \
                from None
    else:
        prompt_ids = _completion_prompt(body, tokenizer, vocab_size)
    where = "messages" if chat else "prompt"
    if len(prompt_ids) >= max_model_len:
        raise bad(where, f"the prompt has {len(prompt_ids)} tokens; the model's context holds {max_model_len}, "
                         f"leaving no room for a reply", code="context_length_exceeded")
    room = max_model_len - len(prompt_ids)
    length_field = "max_tokens"
    if chat and body.get("max_completion_tokens") is not None:
        length_field = "max_completion_tokens"
    default = min(DEFAULT_CHAT_MAX_TOKENS if chat else DEFAULT_MAX_TOKENS, room, limits.max_output_tokens)
    max_tokens = _integer(body, length_field, default, 1, limits.max_output_tokens)
    if max_tokens > room:
        raise bad(length_field, f"the prompt's {len(prompt_ids)} tokens + {length_field}={max_tokens} exceed the "
                                f"model's context of {max_model_len} tokens", code="context_length_exceeded")
    top_k = _integer(body, "top_k", 0, -1, vocab_size or MAX_INTEGER)
    temperature = _number(body, "temperature", 1.0)
    if not 0 <= temperature <= 2:
        raise bad("temperature", f"temperature must be between 0 and 2, got {temperature}")
    stream = _flag(body, "stream")
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or set(options) - {"include_usage"}):
        raise bad("stream_options", "stream_options must be an object with only include_usage")
    if options is not None and not stream:
        raise bad("stream_options", "stream_options is only allowed with stream: true")
    include_usage = _flag(options or {}, "include_usage")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise bad("user", f"user must be a string, got {_shown(user)}")
    regex, schema = _guided(body, limits)
    n = _integer(body, "n", 1, 1, limits.max_n)
    min_tokens = _integer(body, "min_tokens", 0)
    echo = not chat and _flag(body, "echo")
    logprobs = _logprobs(body, chat)
    if echo and logprobs is not None and stream:
        raise bad("echo", "echo with logprobs is not streamed by this server; ask without stream",
                  code="unsupported_field")
    try:        # SamplingParams holds the ranges (serve.request.FIELD_RULES); its message names the field
        params = sampling_params_class(
            n=n, max_tokens=max_tokens, temperature=temperature, top_p=_number(body, "top_p", 1.0),
            top_k=max(top_k, 0), min_p=_number(body, "min_p", 0.0), typical_p=_number(body, "typical_p", 1.0),
            seed=_integer(body, "seed", None),
            stop_token_ids=_stop_token_ids(body, limits, vocab_size), ignore_eos=_flag(body, "ignore_eos"),
            min_tokens=min_tokens,
            logprobs=logprobs, prompt_logprobs=logprobs if echo else None,
            presence_penalty=_number(body, "presence_penalty", 0.0),
            frequency_penalty=_number(body, "frequency_penalty", 0.0),
            repetition_penalty=_number(body, "repetition_penalty", 1.0),
            logit_bias=_logit_bias(body, limits, vocab_size), guided_regex=regex, guided_json=schema,
            guided_json_strict=_json_schema_strict(body) is not False)
    except ValueError as exc:
        raise bad(_field_in(str(exc), tuple(body)), str(exc)) from None
    return ParsedRequest(chat, model, list(prompt_ids), params, _stop_strings(body, limits), stream, include_usage,
                         _flag(body, "return_token_ids"), sent=tuple(body), echo=echo)


# Words of the engine's messages that stand for a field of the body.
_GUIDE_FIELDS = ("guided_regex", "guided_json", "structured_outputs", "response_format")
_FIELD_WORDS = {"penalties": ("presence_penalty", "frequency_penalty", "repetition_penalty"),
                "guided": _GUIDE_FIELDS, "guided_regex": _GUIDE_FIELDS, "guided_json": _GUIDE_FIELDS,
                "logprobs": ("logprobs", "top_logprobs"), "prompt_logprobs": ("echo", "logprobs"),
                "token": ("prompt", "messages"), "prompt": ("prompt", "messages")}


def field_named(message: str, parsed: ParsedRequest) -> str | None:
    """The body field an engine refusal (a ValueError's message) is about: of the fields the
    client sent, the one the message names first; None when it names none. The engine
    speaks of SamplingParams' fields, which carry the API's names."""
    return _field_in(message, parsed.sent)


def _field_in(message: str, fields: Sequence[str]) -> str | None:
    """field_named for a body whose fields are `fields`."""
    best: tuple[int, str] | None = None
    for word in re.finditer(r"[a-z_]+", message):
        candidates = _FIELD_WORDS.get(word.group(), (word.group(),))
        sent = [name for name in candidates if name in fields]
        if sent and (best is None or word.start() < best[0]):
            best = (word.start(), sent[0])
    return best[1] if best else None


# --- answers ---------------------------------------------------------------------------------------

def logprobs_object(chat: bool, entries: Sequence[TokenLogprobs], decode: Callable[[Sequence[int]], str],
                    text_offset: int = 0) -> dict[str, Any]:
    """OpenAI's "logprobs" of a choice (or of one streamed piece) from the engine's
    per-token entries (Chapter 34's TokenLogprobs): chat's {"content": [{token, logprob,
    bytes, top_logprobs}]}, or completions' {tokens, token_logprobs, top_logprobs,
    text_offset}. Token strings are each token decoded alone; a token that is part of a
    multi-byte character decodes to U+FFFD, which is what "bytes" is for in chat. The
    completions' top_logprobs dicts hold the chosen token first, then the top ones (as
    vLLM's do: logprobs=0 lists the chosen token alone), keyed by token string, so a token
    whose string is empty, unreadable or already a key there is keyed "token_id:<id>"
    (vLLM's spelling) rather than silently overwriting another."""
    def piece(token_id: int) -> str:
        return decode([token_id])

    if chat:
        def item(token_id: int, logprob: float) -> dict[str, Any]:
            token = piece(token_id)
            return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

        return {"content": [{**item(e.token_id, e.logprob),
                             "top_logprobs": [item(t, lp) for t, lp in zip(e.top_token_ids, e.top_logprobs)]}
                            for e in entries]}
    tokens = [piece(e.token_id) for e in entries]
    offsets, at = [], text_offset
    for token in tokens:
        offsets.append(at)
        at += len(token)

    def top(entry: TokenLogprobs) -> dict[str, float]:
        found: dict[str, float] = {}
        listed = [(entry.token_id, entry.logprob)] + [(t, lp) for t, lp in zip(entry.top_token_ids, entry.top_logprobs)
                                                      if t != entry.token_id]
        for token_id, logprob in listed:
            key = piece(token_id)
            if not key or "\ufffd" in key or key in found:
                key = f"token_id:{token_id}"
            found[key] = logprob
        return found

    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [top(e) for e in entries], "text_offset": offsets}


def echoed_logprobs(prompt_ids: Sequence[int], entries: Sequence[TokenLogprobs | None],
                    decode: Callable[[Sequence[int]], str]) -> dict[str, Any]:
    """The completions "logprobs" of an echoed prompt: the engine's prompt_logprobs, one per
    prompt token, the first None (nothing predicts it), as OpenAI writes them: None in
    token_logprobs and top_logprobs there."""
    known = logprobs_object(False, [e for e in entries[1:] if e is not None], decode, len(decode(prompt_ids[:1])))
    first = decode(prompt_ids[:1])
    return {"tokens": [first] + known["tokens"], "token_logprobs": [None] + known["token_logprobs"],
            "top_logprobs": [None] + known["top_logprobs"], "text_offset": [0] + known["text_offset"]}


def choice_object(parsed: ParsedRequest, index: int, text: str | None, finish_reason: str | None,
                  token_ids: list[int] | None, *, delta: bool, first: bool = False,
                  logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    """One entry of "choices": a whole answer, or (delta=True) one streamed piece of it;
    `logprobs` is logprobs_object's answer for its tokens (None: not asked for)."""
    if parsed.chat:
        if delta:
            content = {"role": "assistant", "content": text or ""} if first else (
                {"content": text} if text else {})
            choice = {"index": index, "delta": content, "logprobs": logprobs, "finish_reason": finish_reason}
        else:
            choice = {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                      "finish_reason": finish_reason}
    else:
        choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
    if parsed.return_token_ids:
        choice["token_ids"] = list(token_ids or [])
        if not delta or first:             # the prompt's ids once per choice (vLLM's field)
            choice["prompt_token_ids"] = list(parsed.prompt_ids)
    return choice


def envelope(parsed: ParsedRequest, response_id: str, created: int, choices: list[dict[str, Any]], *,
             chunk: bool, usage: dict[str, Any] | None = None) -> dict[str, Any]:
    if parsed.chat:
        kind = "chat.completion.chunk" if chunk else "chat.completion"
    else:
        kind = "text_completion"
    body = {"id": response_id, "object": kind, "created": created, "model": parsed.model, "choices": choices}
    if usage is not None or not chunk:
        body["usage"] = usage
    return body


def usage_object(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict[str, Any]:
    """OpenAI's usage; prompt_tokens_details.cached_tokens when the prefix cache's share is known."""
    usage: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                             "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return usage


__all__ = ["ApiError", "Limits", "ParsedRequest", "parse_json_body", "parse_request", "prompt_batch", "field_named",
           "guide_field",
           "choice_object", "logprobs_object", "envelope", "usage_object", "echoed_logprobs", "UNSUPPORTED_FIELDS"]
