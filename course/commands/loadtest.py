"""Chapter 38: load-test an OpenAI-compatible server with streaming clients.

    python run.py loadtest --requests 64 --concurrency 64 --max-tokens 16
    python run.py loadtest --url http://127.0.0.1:8000 --requests 200 --rate 20 --cancel 0.25

Each request streams /v1/completions (random byte-id prompts of --prompt-len tokens,
greedy, exactly --max-tokens tokens unless EOS comes first). Arrivals: all at once up to
--concurrency in flight, or a Poisson process of --rate requests per second (Chapter 22's
poisson_arrivals), still capped by --concurrency. --cancel hangs up that share of the
streams after a random number of tokens, as impatient users do. Without --url the command
starts the tiny model's server in this process (same options as `run.py serve`).

Prints one JSON line: requests completed, refused (429), cancelled and failed; duration,
requests/s and output tokens/s of the completed ones; p50/p99 of end-to-end latency, TTFT
and TPOT in milliseconds (Chapter 22's summarize); and the server's KV blocks in use once
it is idle again (anything but 0 is a leak). A progress line goes to stderr.
"""
import asyncio
import json
import random
import sys
import time

from course.cli import CommandError


def add_arguments(parser):
    from course.commands import serve
    parser.add_argument("--url", default=None, help="server to test (default: start the tiny model's server here)")
    parser.add_argument("--model", default="tiny", help="model name sent in requests (default: tiny)")
    parser.add_argument("--requests", type=int, default=64, help="number of requests (default 64)")
    parser.add_argument("--concurrency", type=int, default=64, help="most requests in flight (default 64)")
    parser.add_argument("--rate", type=float, default=None, help="Poisson arrivals per second (default: all at once)")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens per request (default 16)")
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(8, 48), metavar=("LOW", "HIGH"),
                        help="prompt length range in tokens (default 8 48)")
    parser.add_argument("--cancel", type=float, default=0.0, help="share of streams to hang up early (default 0)")
    parser.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    serve_options = parser.add_argument_group("in-process server (without --url)")
    for flag in ("--impl", "--device", "--num-blocks", "--block-size", "--max-num-seqs", "--max-waiting",
                 "--backend", "--threads"):
        action = next(a for a in _serve_parser(serve)._actions if flag in a.option_strings)
        serve_options.add_argument(flag, default=action.default, type=action.type, choices=action.choices,
                                   help=action.help)


def _serve_parser(serve):
    import argparse
    parser = argparse.ArgumentParser(add_help=False)
    serve.add_arguments(parser)
    return parser


class Outcome:
    """What the client saw of one request (times from time.perf_counter)."""

    def __init__(self, request_id, arrival):
        self.request_id, self.arrival = request_id, arrival
        self.status = None                 # "completed", "refused", "cancelled", "failed"
        self.token_times = []
        self.finish = None
        self.detail = ""


async def _one(http, model, outcome, prompt, max_tokens, hang_up_after):
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "return_token_ids": True}
    try:
        async with http.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code == 429:
                outcome.status = "refused"
                return
            if response.status_code != 200:
                outcome.status, outcome.detail = "failed", (await response.aread()).decode()[:200]
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[len("data: "):])
                if "error" in event:
                    outcome.status, outcome.detail = "failed", event["error"]["message"]
                    return
                now = time.perf_counter()
                for choice in event["choices"]:
                    outcome.token_times += [now] * len(choice.get("token_ids", []))
                if hang_up_after is not None and len(outcome.token_times) >= hang_up_after:
                    outcome.status = "cancelled"
                    return                 # leaving the block closes the connection mid-stream
        outcome.finish = time.perf_counter()
        outcome.status = "completed"
    except Exception as exc:               # a dropped connection is a result, not a crash of the tester
        outcome.status, outcome.detail = "failed", repr(exc)


def _progress(outcomes, total):
    if not sys.stderr.isatty():
        return                             # a log file gets the JSON line, not 64 redraws
    done = sum(o.status is not None for o in outcomes)
    width = 30
    filled = width * done // max(total, 1)
    print(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total}", end="", file=sys.stderr, flush=True)


async def _run_load(url, args):
    import httpx

    from course import reference
    from course.impl import have_reference, load
    # Arrival times from Chapter 22's workloads: the reference's, or in a learner's edition theirs.
    workloads = (reference() if have_reference() else load("engine")).workloads
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(*args.prompt_len))] for _ in range(args.requests)]
    hang_ups = [rng.randint(1, max(1, args.max_tokens - 1)) if rng.random() < args.cancel else None
                for _ in range(args.requests)]
    arrivals = (workloads.poisson_arrivals(args.rate, args.requests, seed=args.seed) if args.rate
                else [0.0] * args.requests)
    gate = asyncio.Semaphore(args.concurrency)
    limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=args.concurrency)
    outcomes = []
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        start = time.perf_counter()

        async def launch(i):
            await asyncio.sleep(max(0.0, start + arrivals[i] - time.perf_counter()))
            async with gate:
                outcome = Outcome(f"load-{i}", time.perf_counter())
                outcomes.append(outcome)
                await _one(http, args.model, outcome, prompts[i], args.max_tokens, hang_ups[i])
                _progress(outcomes, args.requests)

        await asyncio.gather(*(launch(i) for i in range(args.requests)))
        if sys.stderr.isatty():
            print(file=sys.stderr)
        blocks_after = await _blocks_when_idle(http)
    completed = [o for o in outcomes if o.status == "completed"]
    line = {"requests": args.requests, "concurrency": args.concurrency, "rate": args.rate,
            "max_tokens": args.max_tokens, "completed": len(completed),
            "refused_429": sum(o.status == "refused" for o in outcomes),
            "cancelled": sum(o.status == "cancelled" for o in outcomes),
            "failed": sum(o.status == "failed" for o in outcomes), "kv_blocks_in_use_after": blocks_after}
    records = [workloads.RequestRecord(o.request_id, o.arrival, o.token_times[0], o.finish, len(o.token_times),
                                       o.token_times) for o in completed if o.token_times]
    if records:
        summary = workloads.summarize(records)
        line.update({"duration_s": round(summary["duration_s"], 3),
                     "requests_per_s": round(summary["requests_per_s"], 2),
                     "output_tok_s": round(summary["throughput_tok_s"], 1)})
        for name in ("e2e", "ttft", "tpot"):
            for q in (50, 99):
                value = summary[f"{name}_p{q}"]
                line[f"{name}_p{q}_ms"] = None if value is None else round(1000 * value, 2)
    failures = [o.detail for o in outcomes if o.status == "failed"]
    return line, failures


async def _blocks_when_idle(http, timeout=10.0):
    """kv_blocks_in_use from /metrics once the engine runs and queues nothing (None if the
    server exports no such metric)."""
    deadline = time.monotonic() + timeout
    while True:
        values = {}
        for text_line in (await http.get("/metrics")).text.splitlines():
            if text_line and not text_line.startswith("#") and "{" not in text_line:
                name, value = text_line.rsplit(" ", 1)
                values[name] = float(value)
        idle = values.get("engine_requests_running", 0) == 0 and values.get("engine_requests_waiting", 0) == 0
        if idle or time.monotonic() > deadline:
            blocks = values.get("kv_blocks_in_use")
            return None if blocks is None else int(blocks)
        await asyncio.sleep(0.02)


def run_load(url, args):
    """Run the load against `url`; returns (the JSON line as a dict, failure details)."""
    return asyncio.run(_run_load(url, args))


def run(args):
    if args.requests < 1 or args.concurrency < 1 or args.max_tokens < 1:
        raise CommandError("--requests, --concurrency and --max-tokens must be at least 1")
    if not 0 <= args.cancel <= 1 or (args.rate is not None and args.rate <= 0):
        raise CommandError("--cancel must be in [0, 1] and --rate positive")
    if args.url is not None:
        line, failures = run_load(args.url.rstrip("/"), args)
    else:
        from course.commands import serve
        if args.model not in serve.MODELS:
            raise CommandError(f"without --url the model must be one of {sorted(serve.MODELS)}, got {args.model!r}")
        args.host, args.port = "127.0.0.1", 0
        app, impl = serve.build(args)
        with impl.load("server.app").serve_in_thread(app) as url:
            line, failures = run_load(url, args)
    print(json.dumps(line), flush=True)
    if failures:
        raise CommandError(f"{len(failures)} request(s) failed, first: {failures[0]}")
    return 0
