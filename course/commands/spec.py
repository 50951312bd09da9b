"""Chapter 26: speculative decoding of one request at a time, against plain greedy decoding.

The draft is the target's first --draft-layers layers (sharing its embedding, final norm
and LM head). For each k in --k, runs --prompts seeded prompts through
speculative_generate and prints one JSON line: k, acceptance_rate (accepted guesses /
proposed), tokens_per_target_forward (plain decoding: 1.0), target_forwards,
draft_forwards, seconds (wall time of the whole batch of prompts), and identical (whether
every output equals the target's own greedy generate, which the command always checks).
A first line times plain greedy generate on the same prompts. On a CPU with the tiny model
a draft forward costs almost as much as a target forward, so speculation is not faster
here; the counts show what it would save where the target is the expensive one.
"""
import json
import random
import time

from course.cli import CommandError, add_device_argument, add_impl_argument, add_model_argument, resolve_device
from course.commands._setup import load_model, set_threads


def add_arguments(parser):
    add_impl_argument(parser)
    add_device_argument(parser)
    add_model_argument(parser)
    parser.add_argument("--k", type=int, nargs="+", default=[1, 2, 4, 8], help="draft lengths (default 1 2 4 8)")
    parser.add_argument("--draft-layers", type=int, default=1, help="layers of the target the draft keeps (default 1)")
    parser.add_argument("--prompts", type=int, default=8, help="seeded prompts (default 8)")
    parser.add_argument("--tokens", type=int, default=32, help="new tokens per prompt (default 32)")
    parser.add_argument("--seed", type=int, default=0, help="prompt seed (default 0)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: 1 on CPU, torch's choice on CUDA)")


def run(args):
    from course.impl import load
    impl = load(args.impl)
    device = resolve_device(args.device)
    set_threads(device, args.threads)
    if args.prompts < 1 or args.tokens < 1 or min(args.k) < 1:
        raise CommandError("--prompts, --tokens and every --k must be at least 1")
    target = load_model(impl, device, args.model)
    if not 1 <= args.draft_layers <= target.cfg.num_hidden_layers:
        raise CommandError(f"--draft-layers must be 1..{target.cfg.num_hidden_layers}")
    spec = impl.load("speculative")
    draft = spec.truncated_draft(target, args.draft_layers)
    generate = impl.load("sampling").generate
    rng = random.Random(args.seed)
    vocab = min(target.cfg.vocab_size, 256)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(4, 40))] for _ in range(args.prompts)]

    start = time.perf_counter()
    expected = [generate(target, p, args.tokens) for p in prompts]
    plain = time.perf_counter() - start
    print(json.dumps({"decoder": "plain greedy", "target_forwards": sum(len(e) for e in expected),
                      "tokens_per_target_forward": 1.0, "seconds": round(plain, 3)}))
    for k in args.k:
        stats = spec.SpecStats()
        start = time.perf_counter()
        outputs = [spec.speculative_generate(target, draft, p, args.tokens, k=k, stats=stats) for p in prompts]
        seconds = time.perf_counter() - start
        print(json.dumps({"decoder": f"speculative, draft = first {args.draft_layers} layer(s)", "k": k,
                          "acceptance_rate": round(stats.acceptance_rate, 3),
                          "tokens_per_target_forward": round(stats.tokens_per_target_forward, 3),
                          "target_forwards": stats.target_forwards, "draft_forwards": stats.draft_forwards,
                          "seconds": round(seconds, 3), "identical": outputs == expected}))
    return 0
