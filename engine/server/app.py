"""Chapter 38: the FastAPI application around one EngineLoop.

    POST /v1/completions       text (or token ids) in, text out; stream: true for SSE
    POST /v1/chat/completions  messages in, the tokenizer's chat template between
    GET  /v1/models            the one model this server serves
    GET  /health               200 while the engine loop runs, 503 once it has died
    GET  /                     a chat page (page.py) that streams replies in the browser
    GET  /metrics              Prometheus text: queue, blocks, prefix hits, TTFT, TPOT

A handler never touches the engine: it checks the body (protocol.py), asks
AdmissionControl for room (429 with Retry-After when there is none), submits to the
EngineLoop and reads its own asyncio.Queue. Whatever way the request ends (done, stop
string, client gone, error), `Job.close` aborts what still runs and gives the room back.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Iterator, Mapping

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from ..serve.request import SamplingParams
from .loop import ACCEPTED, AdmissionControl, Delivery, EngineLoop, QueueFull, Submission
from .page import CHAT_PAGE
from .protocol import (
    ApiError,
    Limits,
    ParsedRequest,
    choice_object,
    echoed_logprobs,
    envelope,
    field_named,
    guide_field,
    logprobs_object,
    parse_json_body,
    parse_request,
    prompt_batch,
    usage_object,
)
from .text import ChatTokenizer, DetokenizerFactory, TextStream

if TYPE_CHECKING:
    from ..serve.engine import EngineCore
    from ..serve.sampler import TokenLogprobs

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 1
SERVER_VERSION = "course-38"        # what GET /version reports (clients probe it, as they do vLLM's)
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@dataclass
class ServedModel:
    """What the server needs besides the engine: the name clients ask for, the tokenizer and
    a way to make a fresh incremental detokenizer per choice. `adapters`: names of LoRA
    adapters loaded in the engine's AdapterBank that clients may ask for as their `model`
    (Chapter 43, as vLLM serves them)."""
    name: str
    tokenizer: ChatTokenizer
    new_detokenizer: DetokenizerFactory
    adapters: tuple[str, ...] = ()


def sse_event(data: dict[str, Any] | str) -> str:
    """One server-sent event carrying `data`.  (Your engine: Chapter 38)

    data: a JSON-serializable dict (a chunk or an error object) or the string "[DONE]".
    Returns exactly "data: " + payload + "\n\n", where payload is "[DONE]" as is, or the
    dict as compact JSON: no spaces after "," and ":", non-ASCII characters written as
    themselves (not \\u escapes; the stream is UTF-8). The payload is one line.
    Trap, as a property: "é" is one character of the frame, not six ("\\u00e9"), and the
    frame has no space outside the strings: any valid JSON is not enough.
    """
    raise NotImplementedError("Your engine: Chapter 38: sse_event")


class ServerMetrics:
    """Prometheus metrics in a registry of their own (two apps in one process never share
    or collide). Engine gauges come from the loop's snapshot at scrape time."""

    def __init__(self, loop: EngineLoop, admission: AdmissionControl) -> None:
        self.registry = CollectorRegistry()
        self.ttft = Histogram("time_to_first_token_seconds", "From the request's arrival to its first token",
                              buckets=LATENCY_BUCKETS, registry=self.registry)
        self.tpot = Histogram("time_per_output_token_seconds", "Mean gap between a choice's later tokens",
                              buckets=LATENCY_BUCKETS, registry=self.registry)
        self.finished = Counter("requests_finished", "Choices finished, by finish reason", ["finish_reason"],
                                registry=self.registry)
        self.rejected = Counter("requests_rejected", "Requests refused by admission control (429)",
                                registry=self.registry)
        self.loop, self.admission = loop, admission
        self.registry.register(self)

    def describe(self) -> list[Metric]:
        return []                          # collected at scrape time only

    def collect(self) -> Iterator[Metric]:
        snap = self.loop.snapshot
        for name, help_text, value in (
                ("engine_requests_running", "Requests the engine is running", snap["running"]),
                ("engine_requests_waiting", "Requests queued in the engine's scheduler", snap["waiting"]),
                ("server_requests_admitted", "Samples inside the server (running, waiting, in transit)",
                 self.admission.inside),
                ("kv_blocks_in_use", "KV-cache blocks held by requests", snap["blocks_in_use"]),
                ("kv_blocks_total", "KV-cache blocks in the pool", snap["blocks_total"]),
                ("prefix_cache_hit_rate", "Share of prompt tokens served from the prefix cache",
                 snap["prefix_hit_rate"])):
            yield GaugeMetricFamily(name, help_text, value=value)
        yield CounterMetricFamily("engine_preemptions", "Requests preempted so far", value=snap["preemptions"])
        yield CounterMetricFamily("engine_steps", "Engine steps so far", value=snap["steps"])


class Job:
    """One admitted HTTP request from submission to its last byte."""

    def __init__(self, state: ServerState, parsed: ParsedRequest, request_id: str, arrival: float) -> None:
        self.state, self.parsed, self.arrival = state, parsed, arrival
        self.queue: asyncio.Queue[Delivery] = asyncio.Queue()
        event_loop = asyncio.get_running_loop()

        def deliver(item: Delivery) -> None:          # runs on the engine thread
            with contextlib.suppress(RuntimeError):          # the event loop already closed
                event_loop.call_soon_threadsafe(self.queue.put_nowait, item)

        adapter = parsed.model if parsed.model in state.served.adapters else None      # Chapter 43
        self.submission = Submission(request_id, parsed.prompt_ids, parsed.params, deliver, lora=adapter)
        n = parsed.params.n
        self.index = {engine_id: i for i, engine_id in enumerate(self.submission.engine_ids)}
        self.streams = [TextStream(state.served.new_detokenizer(), parsed.stops) for _ in range(n)]
        self.token_ids: list[list[int]] = [[] for _ in range(n)]
        self.finish: list[str | None] = [None] * n
        self.token_times: list[list[float]] = [[] for _ in range(n)]
        self.cached_tokens: int | None = None     # prompt tokens the prefix cache supplied (the first sample's)
        self.prompt_logprobs: list[Any] | None = None     # echo with logprobs: the engine's, once known
        self.submitted = self.closed = False

    async def start(self) -> None:
        """Submit, and wait until the engine has taken the request (or refused it: 400)."""
        self.state.loop.submit(self.submission)
        self.submitted = True
        first = await self.queue.get()
        if isinstance(first, Exception):
            self.submitted = False         # the engine holds nothing of it
            if isinstance(first, ValueError):
                raise ApiError(400, str(first), param=field_named(str(first), self.parsed))
            raise ApiError(500, str(first), type="server_error")
        assert first == ACCEPTED, first

    def close(self) -> None:
        """Idempotent: abort whatever still runs, give the admitted room back."""
        if self.closed:
            return
        self.closed = True
        if self.submitted and not all(self.finish):
            self.state.loop.abort(self.submission)
            for i, reason in enumerate(self.finish):
                if reason is None:
                    self._finish(i, "abort")
        self.state.admission.release(self.parsed.params.n)

    async def pieces(self) -> AsyncIterator[tuple[int, str, list[int], str | None, list[TokenLogprobs]]]:
        """(choice index, new text, new token ids, finish reason or None, the new tokens'
        logprobs: Chapter 34), step by step."""
        while not all(self.finish):
            item = await self.queue.get()
            if isinstance(item, Exception):
                raise ApiError(500, str(item), type="server_error")
            assert not isinstance(item, str)           # ACCEPTED came once, before start() returned
            i = self.index[item.request_id]
            if self.finish[i] is not None:             # tokens that raced a stop-string abort
                continue
            now = time.monotonic()
            if i == 0:
                self.cached_tokens = item.num_cached_tokens
            if item.prompt_logprobs is not None:
                self.prompt_logprobs = list(item.prompt_logprobs)
            self.token_times[i] += [now] * len(item.new_token_ids)
            self.token_ids[i] += item.new_token_ids
            stream = self.streams[i]
            try:                           # a detokenizer that breaks fails this request alone
                text = stream.push(item.new_token_ids)
                if item.finished and not stream.stopped:
                    text += stream.flush()
            except Exception as exc:
                logger.exception("detokenizing request %r failed", self.submission.request_id)
                raise ApiError(500, f"request {self.submission.request_id!r}: detokenizing its output failed: "
                                    f"{type(exc).__name__}: {exc}", type="server_error") from None
            if stream.stopped:
                self._finish(i, "stop")
                if not item.finished:
                    self.state.loop.abort(self.submission, item.request_id)
            elif item.finished:
                assert item.finish_reason is not None, "a finished output names why it finished"
                self._finish(i, item.finish_reason)
            new = len(item.new_token_ids)        # RequestOutput.logprobs covers every output token so far
            yield i, text, list(item.new_token_ids), self.finish[i], list(item.logprobs or [])[-new:] if new else []

    def _finish(self, i: int, reason: str) -> None:
        self.finish[i] = reason
        metrics, times = self.state.metrics, self.token_times[i]
        metrics.finished.labels(reason).inc()
        if times:
            metrics.ttft.observe(times[0] - self.arrival)
        if len(times) > 1:
            metrics.tpot.observe((times[-1] - times[0]) / (len(times) - 1))

    def usage(self) -> dict[str, Any]:
        return usage_object(len(self.parsed.prompt_ids), sum(len(ids) for ids in self.token_ids), self.cached_tokens)

    def logprobs(self, entries: list[TokenLogprobs], text_offset: int = 0) -> dict[str, Any] | None:
        """The OpenAI "logprobs" object of these tokens, or None when the request asked for none."""
        if self.parsed.params.logprobs is None:
            return None
        return logprobs_object(self.parsed.chat, entries, self.state.served.tokenizer.decode, text_offset)

    def echoed(self) -> tuple[str, dict[str, Any] | None]:
        """(the prompt's text, its logprobs object or None) that an echo puts first."""
        decode = self.state.served.tokenizer.decode
        prompt = decode(self.parsed.prompt_ids)
        if self.parsed.params.logprobs is None:
            return prompt, None
        return prompt, echoed_logprobs(self.parsed.prompt_ids, self.prompt_logprobs or [None], decode)

    async def collect(self) -> dict[str, Any]:
        texts = [""] * len(self.finish)
        entries: list[list[TokenLogprobs]] = [[] for _ in self.finish]
        async for i, text, _, _, found in self.pieces():
            texts[i] += text
            entries[i] += found
        prefix, prefix_logprobs = self.echoed() if self.parsed.echo else ("", None)
        choices = []
        for i, text in enumerate(texts):
            logprobs = self.logprobs(entries[i], len(prefix))
            if logprobs is not None and prefix_logprobs is not None:
                logprobs = {key: prefix_logprobs[key] + logprobs[key] for key in logprobs}
            choices.append(choice_object(self.parsed, i, prefix + text, self.finish[i], self.token_ids[i],
                                         delta=False, logprobs=logprobs))
        return envelope(self.parsed, self.submission.request_id, int(time.time()), choices, chunk=False,
                        usage=self.usage())

    async def sse(self) -> AsyncIterator[str]:
        parsed, rid, created = self.parsed, self.submission.request_id, int(time.time())

        def chunk(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> str:
            return sse_event(envelope(parsed, rid, created, choices, chunk=True, usage=usage))

        try:
            if parsed.chat:                # OpenAI opens each chat choice with its role
                yield chunk([choice_object(parsed, i, "", None, [], delta=True, first=True)
                             for i in range(len(self.finish))])
            offsets = [0] * len(self.finish)
            if parsed.echo:                # the prompt first (echo with logprobs is refused for streams)
                prompt, _ = self.echoed()
                yield chunk([choice_object(parsed, i, prompt, None, [], delta=True, first=True)
                             for i in range(len(self.finish))])
                offsets = [len(prompt)] * len(self.finish)
            async for i, text, ids, finish, found in self.pieces():
                logprobs = self.logprobs(found, offsets[i])
                if logprobs is not None and not parsed.chat:
                    offsets[i] += sum(len(token) for token in logprobs["tokens"])
                yield chunk([choice_object(parsed, i, text, finish, ids, delta=True, logprobs=logprobs)])
            if parsed.include_usage:
                yield chunk([], usage=self.usage())
        except ApiError as exc:            # headers are gone: the error travels as an event
            yield sse_event(exc.body())
        yield sse_event("[DONE]")


class EngineStream(StreamingResponse):
    """A streaming response that runs `on_close` however it ends: finished, cancelled
    because the client hung up, or failed. (A generator's own `finally` is not enough: a
    stream cancelled between two chunks leaves the generator suspended, unclosed.)"""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None], *, media_type: str | None = None,
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(content, media_type=media_type, headers=headers)
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


@dataclass
class ServerState:
    served: ServedModel
    loop: EngineLoop
    admission: AdmissionControl
    metrics: ServerMetrics
    limits: Limits


async def _read_body(request: Request, max_bytes: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise ApiError(413, f"the request body has {declared} bytes; this server takes at most {max_bytes}",
                       code="body_too_large")
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > max_bytes:
            break                          # parse_json_body reports it; stop reading more
    return bytes(body)


async def _until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def merge_answers(answers: list[dict[str, Any]], response_id: str) -> dict[str, Any]:
    """One answer for a list of prompts: prompt k's choice i becomes choice k * n + i (as
    OpenAI numbers them), the usages add up."""
    if len(answers) == 1:
        return answers[0]
    merged = {**answers[0], "id": response_id, "choices": []}
    for k, answer in enumerate(answers):
        for choice in answer["choices"]:
            merged["choices"].append({**choice, "index": k * len(answer["choices"]) + choice["index"]})
    usages = [answer["usage"] for answer in answers]
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    merged["usage"] = {key: sum(usage[key] for usage in usages) for key in counts}
    if all("prompt_tokens_details" in usage for usage in usages):
        merged["usage"]["prompt_tokens_details"] = {
            "cached_tokens": sum(usage["prompt_tokens_details"]["cached_tokens"] for usage in usages)}
    return merged


def check_guide(engine: EngineCore, params: SamplingParams, field: str) -> None:
    """Compile the request's guide here, off the engine thread (the caller runs this in a
    worker): a schema or pattern that cannot be compiled (whatever the compiler raises) is
    the client's 400, naming the field, and never reaches the engine loop. The compiled
    index lands in the engine's shared GuideFactory cache, so admitting the request on the
    engine thread finds it there and compiles nothing."""
    if engine.guides is None or (params.guided_regex is None and params.guided_json is None):
        return                             # the engine refuses these itself, with a ValueError
    try:
        engine.guides.prepare(params)
    except NotImplementedError:            # a learner's unwritten compiler: the engine says so itself
        return
    except Exception as exc:               # RecursionError, TypeError, ...: all are about this input
        raise ApiError(400, f"{field} cannot be compiled into a guide: {type(exc).__name__}: {exc}",
                       param=field) from None


def build_app(engine: EngineCore, served: ServedModel, *, max_waiting: int = 64,
              limits: Limits | None = None) -> FastAPI:
    """The server for `engine` (an EngineCore the app will own: start no other thread on it).

    max_waiting: requests (samples) allowed to queue beyond the engine's max_num_seqs
    running slots before new ones get 429. limits: what one request may ask (protocol.Limits,
    whose defaults are the server's). The engine loop starts and stops with the app (its
    lifespan), so run it under an ASGI server that runs lifespans (uvicorn does)."""
    limits = limits or Limits()
    loop = EngineLoop(engine)
    admission = AdmissionControl(engine.config.max_num_seqs, max_waiting)
    state = ServerState(served, loop, admission, ServerMetrics(loop, admission), limits)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loop.start()
        try:
            yield
        finally:
            loop.stop()

    app = FastAPI(title="course engine", lifespan=lifespan)
    app.state.server = state

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        error = ApiError(exc.status_code, str(exc.detail), type="invalid_request_error")
        return JSONResponse(error.body(), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def crash(request: Request, exc: Exception) -> JSONResponse:
        error = ApiError(500, f"internal error: {exc!r}", type="server_error")
        return JSONResponse(error.body(), status_code=500)

    async def generate(request: Request, chat: bool) -> Response:
        arrival = time.monotonic()
        body = parse_json_body(await _read_body(request, limits.max_body_bytes), limits)
        if not loop.alive:
            raise ApiError(503, f"the engine loop is not running: {loop.error!r}", type="server_error")
        asked = body.get("model")                     # an adapter's name selects it (Chapter 43)
        model_name = asked if isinstance(asked, str) and asked in served.adapters else served.name
        batch = None if chat else prompt_batch(body, limits)
        parsed_all = [parse_request(one, chat=chat, model_name=model_name, tokenizer=served.tokenizer,
                                    max_model_len=loop.snapshot["max_model_len"], sampling_params_class=SamplingParams,
                                    limits=limits, vocab_size=engine.vocab_size)
                      for one in ([body] if batch is None else [{**body, "prompt": p} for p in batch])]
        guide = guide_field(body)
        if guide is not None:
            await asyncio.to_thread(check_guide, engine, parsed_all[0].params, guide)
        try:
            admission.try_admit(sum(parsed.params.n for parsed in parsed_all))
        except ValueError as exc:
            raise ApiError(400, str(exc), param="n" if batch is None else "prompt") from None
        except QueueFull as exc:
            state.metrics.rejected.inc()
            raise ApiError(429, f"{exc}; retry in {RETRY_AFTER_S} s", type="rate_limit_error",
                           code="queue_full", headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        response_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        # Each Job gives its own n back when closed, so closing them all returns what was admitted.
        jobs = [Job(state, parsed, response_id if batch is None else f"{response_id}-{k}", arrival)
                for k, parsed in enumerate(parsed_all)]
        try:
            for job in jobs:
                await job.start()
        except BaseException:
            for job in jobs:
                job.close()
            raise
        if parsed_all[0].stream:           # one prompt: prompt_batch refuses streamed lists
            return EngineStream(jobs[0].sse(), jobs[0].close, media_type="text/event-stream",
                                headers={"Cache-Control": "no-cache"})
        collecting = asyncio.ensure_future(asyncio.gather(*(job.collect() for job in jobs)))
        gone = asyncio.ensure_future(_until_disconnect(request))
        try:
            await asyncio.wait({collecting, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not collecting.done():      # the client left: nobody reads an answer
                return Response(status_code=499)
            return JSONResponse(merge_answers(collecting.result(), response_id))
        finally:
            for task in (collecting, gone):
                task.cancel()
            for job in jobs:
                job.close()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate(request, chat=True)

    @app.get("/v1/models", response_model=None)    # send the dict as is: no pydantic model from the annotation
    async def models() -> dict[str, Any]:
        base = {"object": "model", "created": 0, "owned_by": "course", "max_model_len": loop.snapshot["max_model_len"]}
        return {"object": "list", "data": [{"id": served.name, **base}]
                + [{"id": name, **base, "parent": served.name} for name in served.adapters]}

    @app.get("/version", response_model=None)
    async def version() -> dict[str, str]:
        return {"version": SERVER_VERSION}

    @app.get("/health", response_model=None)
    async def health() -> JSONResponse | dict[str, str]:
        if not loop.alive:
            return JSONResponse({"status": "engine loop stopped", "error": repr(loop.error)}, status_code=503)
        return {"status": "ok"}

    @app.get("/")
    async def chat_page() -> HTMLResponse:
        return HTMLResponse(CHAT_PAGE)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


def header_timeout_protocol(timeout_s: float) -> type:
    """uvicorn's HTTP/1.1 protocol that closes a connection whose first request has not
    sent all its headers `timeout_s` seconds after it opened (a half-open or stalled
    client would otherwise hold its socket forever; later requests on a kept-alive
    connection are uvicorn's keep-alive timeout's business)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderTimeoutProtocol(H11Protocol):
        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self.header_timer: asyncio.TimerHandle | None = self.loop.call_later(timeout_s, self.headers_too_slow)

        def handle_events(self) -> None:
            super().handle_events()
            if self.cycle is not None and self.header_timer is not None:      # a request's headers came
                self.header_timer.cancel()
                self.header_timer = None

        def connection_lost(self, exc: Exception | None) -> None:
            if self.header_timer is not None:
                self.header_timer.cancel()
            super().connection_lost(exc)

        def headers_too_slow(self) -> None:
            self.header_timer = None
            if self.cycle is None and not self.transport.is_closing():
                self.transport.close()

    return HeaderTimeoutProtocol


@contextlib.contextmanager
def serve_in_thread(app: FastAPI, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning",
                    header_timeout_s: float = 10.0) -> Iterator[str]:
    """Run `app` under uvicorn on a thread; yields its base URL ("http://127.0.0.1:PORT").
    port 0 takes a free port. A connection that has not sent its first request's headers
    within header_timeout_s is closed. The server stops (and the engine loop with it) on exit."""
    import uvicorn
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, lifespan="on", timeout_graceful_shutdown=2,
                                           http=header_timeout_protocol(header_timeout_s)))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the HTTP server did not start")
        time.sleep(0.01)
    try:
        yield f"http://{host}:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


__all__ = ["ServedModel", "build_app", "serve_in_thread", "sse_event", "EngineStream", "ServerMetrics", "Job"]
