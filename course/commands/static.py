"""Chapter 21: static batching against one request at a time.

Draws --requests seeded prompts (lengths --min-len..--max-len) and generates --tokens
greedy tokens for each, first one request at a time with Chapter 17's generate, then in
static batches of each --batch size with Chapter 21's generate_batch. Prints one JSON line
per run: mode, batch, output_tokens, tok_s (output tokens per second of wall time),
forward_calls, padding_waste (share of the token slots processed that held no real token,
prefill pads and finished rows together) and, for batches, whether every output equals
the solo one.
"""
import json
import random
import time

from course.cli import CommandError, add_device_argument, add_impl_argument, add_model_argument, add_threads_argument
from course.commands._setup import load_model, prepare


def add_arguments(parser):
    add_impl_argument(parser)
    add_device_argument(parser)
    add_model_argument(parser)
    parser.add_argument("--requests", type=int, default=16, help="number of prompts (default 16)")
    parser.add_argument("--batch", type=int, nargs="+", default=[4, 16], help="static batch sizes (default 4 16)")
    parser.add_argument("--min-len", type=int, default=4, help="shortest prompt (default 4)")
    parser.add_argument("--max-len", type=int, default=64, help="longest prompt (default 64)")
    parser.add_argument("--tokens", type=int, default=24, help="new tokens per request (default 24)")
    parser.add_argument("--eos", type=int, default=None, help="stop token (default: none, every row runs to --tokens)")
    parser.add_argument("--seed", type=int, default=0, help="prompt seed (default 0)")
    add_threads_argument(parser)


class _Counter:
    def __init__(self, model):
        self.calls = 0
        self.handle = model.register_forward_pre_hook(self._hook)

    def _hook(self, module, args):
        self.calls += 1


def run(args):
    import torch

    impl, device = prepare(args)
    if not 1 <= args.min_len <= args.max_len or args.requests < 1 or args.tokens < 1 or min(args.batch) < 1:
        raise CommandError("need 1 <= --min-len <= --max-len, and positive --requests, --tokens, --batch")
    model = load_model(impl, device, args.model)
    rng = random.Random(args.seed)
    vocab = min(model.cfg.vocab_size, 256)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(args.min_len, args.max_len))]
               for _ in range(args.requests)]
    generate = impl.load("sampling").generate
    static = impl.load("static_batch")

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    generate(model, prompts[0], 2, eos_token_id=args.eos)                  # warm-up
    counter = _Counter(model)
    sync()
    start = time.perf_counter()
    solo = [generate(model, p, args.tokens, eos_token_id=args.eos) for p in prompts]
    sync()
    elapsed = time.perf_counter() - start
    tokens = sum(map(len, solo))
    print(json.dumps({"mode": "one at a time", "batch": 1, "output_tokens": tokens,
                      "tok_s": round(tokens / elapsed, 1), "forward_calls": counter.calls, "padding_waste": 0.0}))
    for batch in args.batch:
        counter.calls = 0
        outputs = []
        sync()
        start = time.perf_counter()
        for first in range(0, len(prompts), batch):
            group = prompts[first:first + batch]
            outputs += static.generate_batch(model, group, args.tokens, eos_token_id=args.eos)
        sync()
        elapsed = time.perf_counter() - start
        slots = wasted = 0.0
        for first in range(0, len(prompts), batch):             # each batch's waste, weighted by its size
            group, outs = prompts[first:first + batch], outputs[first:first + batch]
            size = len(group) * (max(map(len, group)) + max(map(len, outs)))
            wasted += static.padding_waste(list(map(len, group)), list(map(len, outs)))["total"] * size
            slots += size
        tokens = sum(map(len, outputs))
        print(json.dumps({"mode": "static batch", "batch": batch, "output_tokens": tokens,
                          "tok_s": round(tokens / elapsed, 1), "forward_calls": counter.calls,
                          "padding_waste": round(wasted / slots, 3), "matches_solo": outputs == solo}))
    counter.handle.remove()
    return 0
