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

--engine (Chapter 37) serves the same kind of prompts through the engine core instead, as
one batch of --prompts requests: first the plain core, then the core with each drafter
installed (n-gram lookup, the truncated draft model with its own pool, heads trained on
the target's own greedy outputs of other seeded prompts), for each k in --k (default 3).
One JSON line each: drafter, k, acceptance_rate, tokens_per_request_step (tokens a request
gains per step it is verified; plain decoding: 1.0), steps, tok_s (best of --repeat runs),
identical (outputs equal the plain core's); the heads' line also gives train_s.
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
    parser.add_argument("--k", type=int, nargs="+", default=None,
                        help="draft lengths (default 1 2 4 8; with --engine, 3)")
    parser.add_argument("--draft-layers", type=int, default=1, help="layers of the target the draft keeps (default 1)")
    parser.add_argument("--prompts", type=int, default=8, help="seeded prompts (default 8)")
    parser.add_argument("--tokens", type=int, default=32, help="new tokens per prompt (default 32)")
    parser.add_argument("--seed", type=int, default=0, help="prompt seed (default 0)")
    add_threads_argument(parser)
    parser.add_argument("--engine", action="store_true",
                        help="speculate inside the engine core (Chapter 37) with every drafter")
    parser.add_argument("--repeat", type=int, default=2, help="with --engine: timed runs, best kept (default 2)")


def run(args):
    impl, device = prepare(args)
    args.k = args.k or ([3] if args.engine else [1, 2, 4, 8])
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
    if args.engine:
        return run_engine(args, impl, target, draft, prompts, vocab)

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


def run_engine(args, impl, target, draft, prompts, vocab):
    """Chapter 37: the engine core plain, then with each drafter, on the same prompts."""
    serve = impl.load("serve.engine")
    config_module, request, spec_decode = (impl.load(f"serve.{m}") for m in ("config", "request", "spec_decode"))
    if args.repeat < 1:
        raise CommandError("--repeat must be at least 1")
    eos = getattr(target.cfg, "eos_token_id", None)
    params = request.SamplingParams(max_tokens=args.tokens)
    block_size = 16
    blocks = len(prompts) * -(-(40 + args.tokens + max(args.k) + 1) // block_size) + 64

    def serve_once(make_drafter):
        drafter = make_drafter() if make_drafter else None
        engine = serve.EngineCore(target, config_module.EngineConfig(num_blocks=blocks, block_size=block_size),
                                  eos_token_id=eos, drafter=drafter)
        start = time.perf_counter()
        outputs = [o.output_token_ids for o in engine.generate(prompts, params)]
        return time.perf_counter() - start, outputs, engine.steps, drafter

    def best_of(make_drafter):
        runs = [serve_once(make_drafter) for _ in range(args.repeat)]
        return min(runs, key=lambda run: run[0])

    seconds, expected, steps, _ = best_of(None)
    tokens = sum(len(o) for o in expected)
    print(json.dumps({"drafter": "none (plain core)", "output_tokens": tokens, "steps": steps,
                      "tokens_per_request_step": 1.0, "tok_s": round(tokens / seconds, 1)}))
    start = time.perf_counter()
    rng = random.Random(args.seed + 1)              # other prompts than the ones served
    head_prompts = [[rng.randrange(vocab) for _ in range(rng.randint(4, 40))] for _ in range(128)]
    heads = spec_decode.train_heads(target, head_prompts, max(args.k), new_tokens=args.tokens, eos_token_id=eos)
    train_s = time.perf_counter() - start
    proposers = {
        "ngram": lambda: spec_decode.NgramProposer(),
        f"draft model (first {args.draft_layers} layer(s))": lambda: spec_decode.DraftModelProposer(draft),
        "heads": lambda: spec_decode.HeadProposer(heads),
    }
    for name, make in proposers.items():
        for k in args.k:
            def install(make=make, k=k):
                return spec_decode.Speculator(make(), k)
            seconds, outputs, steps, drafter = best_of(install)
            line = {"drafter": name, "k": k, "acceptance_rate": round(drafter.stats.acceptance_rate, 3),
                    "tokens_per_request_step": round(drafter.stats.tokens_per_verification, 3), "steps": steps,
                    "tok_s": round(tokens / seconds, 1), "identical": outputs == expected}
            if name == "heads":
                line["train_s"] = round(train_s, 2)
            print(json.dumps(line))
            if outputs != expected:
                raise CommandError(f"{name}, k={k}: greedy outputs differ from the plain core's")
    return 0
