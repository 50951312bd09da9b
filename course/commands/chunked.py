"""Chapter 23: one-shot against chunked prefill of a long prompt.

Request A is decoding when request B arrives with a --prompt-len token prompt (the tiny
model, greedy). For one-shot prefill and each --chunk size, prints one JSON line:
chunk, b_ttft_ms (B's time to first token), a_max_gap_ms (the longest A waited between two
tokens: its stall), a_median_gap_ms, b_prefill_steps, and same_tokens (B's greedy output
through generate_chunked equals Chapter 17's generate). Times are the best of --repeat runs.
"""
import json
import random
import statistics

from course.cli import CommandError, add_device_argument, add_impl_argument, add_model_argument, add_threads_argument
from course.commands._setup import load_model, prepare


def add_arguments(parser):
    add_impl_argument(parser)
    add_device_argument(parser)
    add_model_argument(parser)
    parser.add_argument("--prompt-len", type=int, default=768, help="B's prompt length (default 768)")
    parser.add_argument("--chunk", type=int, nargs="+", default=[64, 256], help="chunk sizes (default 64 256)")
    parser.add_argument("--repeat", type=int, default=3, help="runs per setting; the best is kept (default 3)")
    add_threads_argument(parser)


def run(args):
    impl, device = prepare(args)
    if args.prompt_len < 1 or min(args.chunk) < 1 or args.repeat < 1:
        raise CommandError("--prompt-len, --chunk and --repeat must be at least 1")
    model = load_model(impl, device, args.model)
    if args.prompt_len + 2 > model.context_limit:
        raise CommandError(f"--prompt-len must leave room in the model's {model.context_limit}-token context")
    chunked = impl.load("chunked")
    generate = impl.load("sampling").generate
    rng = random.Random(0)
    vocab = min(model.cfg.vocab_size, 256)
    running = [rng.randrange(vocab) for _ in range(16)]
    long_prompt = [rng.randrange(vocab) for _ in range(args.prompt_len)]
    expected = generate(model, long_prompt, 8)
    for chunk in [None] + list(args.chunk):
        steps = -(-args.prompt_len // chunk) + 4 if chunk else 5
        runs = [chunked.serve_two(model, running, long_prompt, chunk, steps) for _ in range(args.repeat)]
        best = min(runs, key=lambda r: r["b_first_token"])
        same = chunked.generate_chunked(model, long_prompt, 8, chunk or args.prompt_len) == expected
        print(json.dumps({"chunk": chunk or "one-shot", "b_ttft_ms": round(best["b_first_token"] * 1e3, 2),
                          "a_max_gap_ms": round(best["a_max_gap"] * 1e3, 2),
                          "a_median_gap_ms": round(statistics.median(best["a_gaps"]) * 1e3, 2),
                          "b_prefill_steps": best["b_steps"], "same_tokens": same}))
    return 0
