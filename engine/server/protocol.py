"""Chapter 38: what crosses the wire, checked before anything reaches the engine.

A request body becomes a `ParsedRequest` (token ids, SamplingParams, stop strings, how to
answer) or an `ApiError`, OpenAI's error object with an HTTP status. Every rule names the
offending field. The policy for fields:

- supported: model, prompt (completions) / messages (chat), max_tokens (chat also
  max_completion_tokens), n, temperature, top_p, top_k, min_p, seed, stop, stream,
  stream_options.include_usage, user (accepted, unused), and three extensions vLLM also
  has: stop_token_ids, ignore_eos, return_token_ids (each choice carries its token ids).
  With Chapter 34's full sampler: logprobs (completions: how many top tokens, 0..5; chat:
  true/false with top_logprobs 0..20), presence_penalty and frequency_penalty (-2..2),
  logit_bias (token id -> -100..100) and vLLM's repetition_penalty (> 0). An engine with
  Chapter 31's simple sampler refuses those requests itself (a 400 naming the sampler).
- OpenAI fields this engine cannot honour (prompt logprobs, echo, tools, ...):
  accepted only at their neutral value (null, false, 0); anything else is a 400 that
  names the field and says why. A field silently ignored is a wrong answer nobody notices.
- any other field: a 400 naming it (a typo such as "max_token" must not fall back to a
  default).
"""
from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from ..serve.request import SamplingParams
    from ..serve.sampler import TokenLogprobs
    from .text import TextTokenizer

MAX_N = 16
MAX_STOP_STRINGS = 4            # OpenAI's limit
MAX_STOP_TOKEN_IDS = 16
MAX_STOP_CHARS = 256
DEFAULT_MAX_TOKENS = 16         # OpenAI's default for /v1/completions
DEFAULT_CHAT_MAX_TOKENS = 256   # chat default: this many, or what the context has left
CHAT_ROLES = ("system", "user", "assistant")

MAX_LOGPROBS = 5                # OpenAI's limit for /v1/completions' logprobs
MAX_TOP_LOGPROBS = 20           # and for chat's top_logprobs
MAX_LOGIT_BIAS = 100.0          # OpenAI's range for a logit_bias value: -100..100

COMMON_FIELDS = {"model", "max_tokens", "n", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stream",
                 "stream_options", "user", "stop_token_ids", "ignore_eos", "return_token_ids", "logprobs",
                 "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "response_format",
                 "guided_regex", "guided_json"}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens", "top_logprobs"}

# Known OpenAI fields: the values that mean "off", and why anything else is refused.
UNSUPPORTED_FIELDS = {
    "prompt_logprobs": ((None,), "this server does not return prompt log-probabilities"),
    "echo": ((None, False), "echoing the prompt is not implemented"),
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


def parse_json_body(raw: bytes, max_bytes: int) -> dict[str, Any]:
    """Bytes of a request body -> a JSON object, or the ApiError a client can act on."""
    if len(raw) > max_bytes:
        raise ApiError(413, f"the request body has {len(raw)} bytes; this server takes at most {max_bytes}",
                       code="body_too_large")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise bad(None, f"the request body is not UTF-8 (byte {exc.start} is invalid)") from None
    try:
        body = json.loads(text)
    except json.JSONDecodeError as exc:
        raise bad(None, f"the request body is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") \
            from None
    if not isinstance(body, dict):
        raise bad(None, f"the request body must be a JSON object, got {type(body).__name__}")
    return body


# --- typed fields --------------------------------------------------------------------------------

Default = TypeVar("Default", int, None)


def _integer(body: dict[str, Any], name: str, default: Default, low: int, high: int | None = None) -> int | Default:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(name, f"{name} must be an integer, got {json.dumps(value)}")
    if value < low or (high is not None and value > high):
        allowed = f">= {low}" if high is None else f"between {low} and {high}"
        raise bad(name, f"{name} must be {allowed}, got {value}")
    return value


def _number(body: dict[str, Any], name: str, default: float) -> float:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad(name, f"{name} must be a number, got {json.dumps(value)}")
    return float(value)


def _flag(body: dict[str, Any], name: str, default: bool = False) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad(name, f"{name} must be true or false, got {json.dumps(value)}")
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
            raise bad(name, f"{name}={json.dumps(value)} is not supported: {why}", code="unsupported_field")
        raise bad(name, f"unknown field {name!r}", code="unknown_field")


def _stop_strings(body: dict[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad("stop", f"stop must be a string or a list of strings, got {json.dumps(stop)}")
    if len(stops) > MAX_STOP_STRINGS:
        raise bad("stop", f"stop has {len(stops)} strings; at most {MAX_STOP_STRINGS} are allowed")
    for s in stops:
        if not s or len(s) > MAX_STOP_CHARS:
            raise bad("stop", f"each stop string must have 1 to {MAX_STOP_CHARS} characters, got {json.dumps(s)}")
    return tuple(stops)


def _stop_token_ids(body: dict[str, Any]) -> tuple[int, ...]:
    ids = body.get("stop_token_ids")
    if ids is None:
        return ()
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise bad("stop_token_ids", f"stop_token_ids must be a list of token ids (integers >= 0), "
                                    f"got {json.dumps(ids)}")
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise bad("stop_token_ids", f"stop_token_ids has {len(ids)} ids; at most {MAX_STOP_TOKEN_IDS} are allowed")
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


def _logit_bias(body: dict[str, Any]) -> dict[int, float] | None:
    """OpenAI's logit_bias: an object from token ids (as strings) to numbers in -100..100."""
    bias = body.get("logit_bias")
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise bad("logit_bias", f"logit_bias must be an object from token ids to numbers, got {json.dumps(bias)}")
    cleaned = {}
    for key, value in bias.items():
        if not key.isdigit():
            raise bad("logit_bias", f"logit_bias keys must be token ids, got {json.dumps(key)}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                or abs(value) > MAX_LOGIT_BIAS:
            raise bad("logit_bias", f"logit_bias[{key}] must be a number between -{MAX_LOGIT_BIAS:g} and "
                                    f"{MAX_LOGIT_BIAS:g}, got {json.dumps(value)}")
        cleaned[int(key)] = float(value)
    return cleaned


def _guided(body: dict[str, Any]) -> tuple[str | None, Any]:
    """(guided_regex, guided_json) for Chapter 35's guides, from OpenAI's response_format
    ({"type": "json_schema", "json_schema": {"schema": {...}}} or {"type": "text"}) or from
    vLLM's own fields guided_regex (a pattern) and guided_json (a schema, or its JSON text).
    Whether a pattern or schema can be compiled is the engine's check (a 400 all the same)."""
    regex, schema = body.get("guided_regex"), body.get("guided_json")
    if regex is not None and not isinstance(regex, str):
        raise bad("guided_regex", f"guided_regex must be a string (a regular expression), got {json.dumps(regex)}")
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError:
            raise bad("guided_json", "guided_json must be a JSON schema (an object, or its JSON text)") from None
    if schema is not None and not isinstance(schema, dict):
        raise bad("guided_json", f"guided_json must be a JSON schema object, got {json.dumps(schema)[:80]}")
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
        elif kind == "json_object":
            raise bad("response_format", 'response_format {"type": "json_object"} (any JSON) needs a grammar that '
                                         'nests without limit; give a json_schema instead', code="unsupported_field")
        elif kind != "text":
            raise bad("response_format", f'response_format type must be "text" or "json_schema", '
                                         f"got {json.dumps(wanted)[:80]}")
    if regex is not None and schema is not None:
        raise bad("guided_regex", "a request is guided by a regular expression or a JSON schema, not both")
    return regex, schema


def _penalty(body: dict[str, Any], name: str) -> float:
    value = _number(body, name, 0.0)
    if not -2 <= value <= 2:
        raise bad(name, f"{name} must be between -2 and 2, got {value}")
    return value


def _messages(body: dict[str, Any]) -> list[dict[str, str]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "messages must be a non-empty list of {role, content} objects")
    cleaned = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad(where, f"{where} must be an object with role and content")
        extra = set(message) - {"role", "content", "name"}
        if extra:
            raise bad(where, f"{where} has unsupported key(s) {sorted(extra)}")
        role, content = message.get("role"), message.get("content")
        if role not in CHAT_ROLES:
            raise bad(f"{where}.role", f"{where}.role must be one of {list(CHAT_ROLES)}, got {json.dumps(role)}")
        if isinstance(content, list):       # content parts: only text ones
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise bad(f"{where}.content", f"{where}.content parts must be {{\"type\": \"text\", \"text\": ...}}; "
                                              f"images and audio are not supported")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise bad(f"{where}.content", f"{where}.content must be a string, got {json.dumps(content)}")
        cleaned.append({"role": role, "content": content})
    return cleaned


def _completion_prompt(body: dict[str, Any], tokenizer: TextTokenizer) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        if not prompt:
            raise bad("prompt", "prompt is empty")
        return tokenizer.encode(prompt)
    if isinstance(prompt, list):
        if not prompt:
            raise bad("prompt", "prompt is empty")
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return list(prompt)              # token ids; the engine checks them against the vocabulary
        if all(isinstance(p, str) for p in prompt):
            raise bad("prompt", "send one prompt per request (a list of strings is a batch; use n for samples)")
    if prompt is None:
        raise bad("prompt", "prompt is required")
    raise bad("prompt", f"prompt must be a string or a list of token ids, got {json.dumps(prompt)[:80]}")


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
    extra: dict[str, Any] = field(default_factory=dict)


def parse_request(body: dict[str, Any], *, chat: bool, model_name: str, tokenizer: TextTokenizer,
                  max_model_len: int, sampling_params_class: type[SamplingParams]) -> ParsedRequest:
    """A JSON object of /v1/completions (chat=False) or /v1/chat/completions (chat=True) ->
    a ParsedRequest, or ApiError naming the first field that breaks a rule."""
    _check_fields(body, CHAT_FIELDS if chat else COMPLETION_FIELDS)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("model", "model is required: a string naming a model of GET /v1/models")
    if model != model_name:
        raise ApiError(404, f"model {model!r} does not exist; this server serves {model_name!r}", param="model",
                       code="model_not_found")
    if chat:
        prompt_ids = tokenizer.encode_chat(_messages(body), add_generation_prompt=True)
    else:
        prompt_ids = _completion_prompt(body, tokenizer)
    where = "messages" if chat else "prompt"
    if len(prompt_ids) >= max_model_len:
        raise bad(where, f"the prompt has {len(prompt_ids)} tokens; the model's context holds {max_model_len}, "
                         f"leaving no room for a reply", code="context_length_exceeded")
    room = max_model_len - len(prompt_ids)
    length_field = "max_tokens"
    if chat and body.get("max_completion_tokens") is not None:
        length_field = "max_completion_tokens"
    default = min(DEFAULT_CHAT_MAX_TOKENS if chat else DEFAULT_MAX_TOKENS, room)
    max_tokens = _integer(body, length_field, default, 1)
    if max_tokens > room:
        raise bad(length_field, f"the prompt's {len(prompt_ids)} tokens + {length_field}={max_tokens} exceed the "
                                f"model's context of {max_model_len} tokens", code="context_length_exceeded")
    top_k = _integer(body, "top_k", 0, -1)
    temperature = _number(body, "temperature", 1.0)
    if not 0 <= temperature <= 2:
        raise bad("temperature", f"temperature must be between 0 and 2, got {temperature}")
    top_p = _number(body, "top_p", 1.0)
    if not 0 < top_p <= 1:
        raise bad("top_p", f"top_p must be in (0, 1], got {top_p}")
    min_p = _number(body, "min_p", 0.0)
    if not 0 <= min_p <= 1:
        raise bad("min_p", f"min_p must be in [0, 1], got {min_p}")
    stream = _flag(body, "stream")
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or set(options) - {"include_usage"}):
        raise bad("stream_options", "stream_options must be an object with only include_usage")
    if options is not None and not stream:
        raise bad("stream_options", "stream_options is only allowed with stream: true")
    include_usage = _flag(options or {}, "include_usage")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise bad("user", f"user must be a string, got {json.dumps(user)}")
    repetition = _number(body, "repetition_penalty", 1.0)
    if repetition <= 0:
        raise bad("repetition_penalty", f"repetition_penalty must be > 0, got {repetition}")
    regex, schema = _guided(body)
    params = sampling_params_class(
        n=_integer(body, "n", 1, 1, MAX_N), max_tokens=max_tokens, temperature=temperature, top_p=top_p,
        top_k=max(top_k, 0), min_p=min_p, seed=_integer(body, "seed", None, 0),
        stop_token_ids=_stop_token_ids(body), ignore_eos=_flag(body, "ignore_eos"),
        logprobs=_logprobs(body, chat), presence_penalty=_penalty(body, "presence_penalty"),
        frequency_penalty=_penalty(body, "frequency_penalty"), repetition_penalty=repetition,
        logit_bias=_logit_bias(body), guided_regex=regex, guided_json=schema)
    return ParsedRequest(chat, model, list(prompt_ids), params, _stop_strings(body), stream, include_usage,
                         _flag(body, "return_token_ids"))


# --- answers ---------------------------------------------------------------------------------------

def logprobs_object(chat: bool, entries: Sequence[TokenLogprobs], decode: Callable[[Sequence[int]], str],
                    text_offset: int = 0) -> dict[str, Any]:
    """OpenAI's "logprobs" of a choice (or of one streamed piece) from the engine's
    per-token entries (Chapter 34's TokenLogprobs): chat's {"content": [{token, logprob,
    bytes, top_logprobs}]}, or completions' {tokens, token_logprobs, top_logprobs,
    text_offset}. Token strings are each token decoded alone; a token that is part of a
    multi-byte character decodes to U+FFFD, which is what "bytes" is for in chat. The
    completions' top_logprobs dicts are keyed by token string, so a token whose string is
    empty, unreadable or already a key there is keyed "token_id:<id>" (vLLM's spelling)
    rather than silently overwriting another."""
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
        for token_id, logprob in zip(entry.top_token_ids, entry.top_logprobs):
            key = piece(token_id)
            if not key or "\ufffd" in key or key in found:
                key = f"token_id:{token_id}"
            found[key] = logprob
        return found

    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [top(e) for e in entries], "text_offset": offsets}


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
    return choice


def envelope(parsed: ParsedRequest, response_id: str, created: int, choices: list[dict[str, Any]], *,
             chunk: bool, usage: dict[str, int] | None = None) -> dict[str, Any]:
    if parsed.chat:
        kind = "chat.completion.chunk" if chunk else "chat.completion"
    else:
        kind = "text_completion"
    body = {"id": response_id, "object": kind, "created": created, "model": parsed.model, "choices": choices}
    if usage is not None or not chunk:
        body["usage"] = usage
    return body


def usage_object(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


__all__ = ["ApiError", "ParsedRequest", "parse_json_body", "parse_request", "choice_object", "logprobs_object",
           "envelope", "usage_object", "MAX_N", "UNSUPPORTED_FIELDS"]
