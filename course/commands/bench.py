"""Chapter 32: the engine core beside Chapter 24's engine and transformers' batched generate.

Contenders, all on the same weights and the same torch thread count, served in turn and
interleaved round by round (a busy moment on a shared machine slows every contender alike):
  core/<backend>   Chapter 31's EngineCore with each attention backend of --backends
  ch24 slots       Chapter 24's ContinuousBatchingEngine (one slot per request, up to 64)
  hf default       transformers' generate (its class of the model's family) on the whole batch, left-padded
  hf static        the same with cache_implementation="static" (preallocated KV), the
                   whole batch and, when there are more than 16 requests, batches of 16
  hf generate_batch transformers' continuous batching (paged KV cache, requests joining and
                   leaving the batch every step, each with its own max_tokens)
  hf one at a time transformers' generate on one request after another, as a naive server
                   would: the first 8 requests are timed and their rate stands for the
                   workload's (the line's rate_of_first_requests says so)
transformers' generate runs every request of a batch to the batch's longest max_tokens and
cannot take requests that arrive later, so it is left out of the Poisson workload; its
extra tokens are cut off before comparing and are not counted as throughput.

Workloads (--workloads, comma-separated): seed (`run.py core`'s 16 requests on the tiny
2-layer model, vocabulary --vocab-size), serving (64 requests, prompts 64-512 tokens,
outputs 32-256, 4 layers, hidden 256, vocabulary 151,936), long (4 prompts of 2k-8k
tokens), poisson (the serving requests arriving at --rate per second), chat (16 chat
questions to the real SmolLM2-135M-Instruct, up to 64 tokens each, fetched on first use).
On the chat workload, when llama-cpp-python is installed (it is not a requirement), three
more contenders, greedy, with the same thread count: "llama.cpp batched, F32" (every
request in one llama.cpp context, each a sequence of the shared KV cache, as llama.cpp's
batched bench and server run them, on the GGUF file dequantized to float32 by llama.cpp,
made once beside it: the engine's own weights, so in a float32 run its tokens are held to
the first contender's by agreement, its kernels summing in another order), "llama.cpp
batched, Q4_1" (the file as shipped: other weights, not compared) and "llama.cpp one at
a time, Q4_1" (llama-cpp-python's Llama, one request after another); otherwise one line
says llama.cpp was skipped and how to get it.
--scale shrinks the request counts and lengths; --config qwen3-0.6b runs every synthetic
workload on a model of Qwen3-0.6B's shape with random weights. A workload may carry its own
options after colons, `NAME:vocab=N:config=qwen3-0.6b:scale=X`, which override --vocab-size,
--config and --scale for it alone, so one run measures several shapes (the name with its
options labels its lines).

--dtype bfloat16 runs every contender on bfloat16 weights (and the core's KV pool, through
EngineConfig.dtype): AMX or AVX512-BF16 matmuls on a CPU that has them. Rounding then parts
greedy paths at near ties, so each line is held to transformers' outputs by agreement (the
requests identical, the share of tokens before the first divergence) and by the margin
transformers' logits gave its own token over the other at each first divergence, not by
equality. --threads 1,2 times every workload at each thread count in the same interleaved
rounds. --roofline first measures this machine's matmul rate (float32, bfloat16) and
memory bandwidth at each thread count, and each line says what share of them it reached.

Prints one JSON line per contender and workload (its threads and dtype; tok_s from its
fastest round, tok_s_rounds every round's, the spread a busy machine gives; streaming
engines also TTFT/TPOT percentiles, with Chapter 22's replay), then one summary line per
workload with the ratios, and with --profile the share of a core step spent in each part.
Outputs are compared request by request with the first contender's: a difference is
reported in its line and makes the command exit with status 2. --plot FILE draws the
throughput and latency bars. On CUDA with the triton backend, a last line times Chapter 32's
paged-attention kernel alone on a decode step (64 requests of 2,048 tokens, one layer of the
workload's heads): the bytes it reads and writes per second, and their share of the device's
datasheet bandwidth (4.8 TB/s on an H200).
"""
import json

import torch

from course.cli import CommandError, add_device_argument, add_impl_argument
from course.models import QWEN3_VOCAB_SIZE, TINY_VOCAB_SIZE
from course.models.smollm2 import SmolLM2Unavailable

WORKLOADS = ("seed", "serving", "long", "poisson", "chat")


def add_arguments(parser):
    add_impl_argument(parser)
    add_device_argument(parser)
    parser.add_argument("--workloads", default="seed,serving",
                        help=f"comma-separated, from {', '.join(WORKLOADS)}, each optionally with its own "
                             f":vocab=N, :config=C, :scale=X (default: seed,serving)")
    parser.add_argument("--backends", default=None,
                        help="attention backends of the core, comma-separated (default: the fastest measured: "
                             "vectorised on a CPU, triton then vectorised on CUDA; add reference to see the loop)")
    parser.add_argument("--vocab-size", type=int, default=QWEN3_VOCAB_SIZE,
                        help=f"vocabulary of the seed workload's tiny model (default {QWEN3_VOCAB_SIZE:,}; "
                             f"{TINY_VOCAB_SIZE} shows the overhead-bound regime)")
    parser.add_argument("--config", choices=("default", "qwen3-0.6b"), default="default",
                        help="model shape: each workload's own (default), or Qwen3-0.6B's with random weights")
    parser.add_argument("--scale", type=float, default=1.0,
                        help="multiply request counts and lengths (default 1.0; the seed workload keeps its lengths)")
    parser.add_argument("--rate", type=float, default=1.0,
                        help="Poisson arrivals per second at scale 1 (divided by --scale; default 1.0)")
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                        help="weights and KV of every contender (default auto: bfloat16 on CUDA, float32 on a CPU); "
                             "bfloat16 runs on AMX or AVX512-BF16 where the CPU has them, and outputs are held to "
                             "transformers' by agreement and divergence margins, not equality")
    parser.add_argument("--no-hf", action="store_true", help="leave transformers' generate out")
    parser.add_argument("--no-llama-cpp", action="store_true", help="leave llama.cpp out where it is installed")
    parser.add_argument("--repeat", type=int, default=2, help="timed rounds; each contender's best counts (default 2)")
    parser.add_argument("--threads", default=None,
                        help="torch threads for every contender, or several counts comma-separated (1,2: every "
                             "workload timed at each, interleaved; default: 1 on CPU, torch's choice on CUDA)")
    parser.add_argument("--roofline", action="store_true",
                        help="first measure this machine's matmul peak (float32, bfloat16) and memory bandwidth "
                             "at each thread count; every line then says what share of them it reached")
    parser.add_argument("--profile", action="store_true",
                        help="also profile one run of the core with each backend: share of step time per part")
    parser.add_argument("--plot", default=None, metavar="FILE", help="draw throughput and latency bars into FILE")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def run(args):
    from course import bench
    from course.commands._setup import SMOLLM2_CHAPTERS, needs_chapters, prepare
    thread_counts = _thread_counts(args.threads)
    args.threads = thread_counts[0] if thread_counts else None
    impl, device = prepare(args)
    thread_counts = thread_counts or [torch.get_num_threads()]
    specs = [_workload_spec(text.strip(), args) for text in args.workloads.split(",") if text.strip()]
    if not specs:
        raise CommandError(f"--workloads takes names from {', '.join(WORKLOADS)}; got {args.workloads!r}")
    if args.repeat < 1 or args.rate <= 0:
        raise CommandError("--repeat must be at least 1 and --rate positive")
    # The default is the fastest backend measured on each kind of device (Chapter 32's "Run
    # it": the vectorised one beats the reference loop on every workload on a CPU).
    backends = (args.backends.split(",") if args.backends else
                ["triton", "vectorised"] if device.type == "cuda" else ["vectorised"])
    try:
        workloads = []
        with needs_chapters(f"--workloads {args.workloads}",
                            SMOLLM2_CHAPTERS if any(spec[1] == "chat" for spec in specs) else (), impl):
            for label, name, scale, vocab_size, config in specs:
                shape = bench.QWEN3_0_6B_SHAPE if config == "qwen3-0.6b" else None
                made, = bench.make_workloads(impl, [name], scale, vocab_size, args.rate, shape)
                made.name = label
                workloads.append(made)
        plans = [(w, _contenders(impl, bench, w, device, backends, args)) for w in workloads]
    except (ValueError, SmolLM2Unavailable) as exc:
        raise CommandError(str(exc)) from None
    # One plan per workload and thread count, the same contenders (and weights) in each.
    plans = [(bench.with_threads(w, threads, len(thread_counts) > 1), contenders)
             for w, contenders in plans for threads in thread_counts]
    missing = None if args.no_llama_cpp else bench.llama_cpp_missing()
    if missing:
        print(json.dumps({"skipped": "llama.cpp", "why": missing, "to_run_it": bench.LLAMA_CPP_HOW}), flush=True)
    limits = {}
    if args.roofline:
        for threads in thread_counts:
            torch.set_num_threads(threads)
            limits[threads] = bench.machine_limits(device, [torch.float32, torch.bfloat16])
            print(json.dumps({"roofline": limits[threads]}), flush=True)
    progress = bench.Progress(sum(len(c) for _, c in plans) * (args.repeat + 1), enabled=not args.quiet)
    try:
        for workload, contenders in plans:          # warm-up: first calls pay one-off costs
            torch.set_num_threads(workload.threads)
            for contender in contenders:
                progress.show(f"warm-up {workload.name}: {contender.label}")
                bench.warm_up(contender, workload)
                progress.tick()
        for _ in range(args.repeat):
            for workload, contenders in plans:
                torch.set_num_threads(workload.threads)
                for contender in contenders:
                    progress.show(f"{workload.name}: {contender.label}")
                    bench.timed_run(contender, workload, device)
                    progress.tick()
    except NotImplementedError as exc:
        raise CommandError(f"{impl.name} is not complete yet: {exc}") from None
    except ValueError as exc:
        raise CommandError(str(exc)) from None
    finally:
        progress.close()

    lines, problems = [], []
    # auto keeps each device's own rule (equality, as on CUDA in bfloat16 before the option);
    # an asked-for bfloat16 run is held to transformers by agreement.
    exact = args.dtype != "bfloat16"
    for workload, contenders in plans:
        eos = workload.model.cfg.eos_token_id
        first = held_to = logits_of = None
        if not exact:   # rounding may part greedy paths: held to transformers by agreement, not equality
            held_to = next((c for c in contenders if c.label.startswith("hf")), contenders[0])
            theirs = bench.report(held_to, workload, eos, impl.load("workloads"))[1]
        mine = []
        for contender in contenders:
            compare = exact and contender.same_weights and contender.same_kernels
            line, outputs = bench.report(contender, workload, eos, impl.load("workloads"), first if compare else None)
            if workload.threads in limits:
                line["roofline"] = bench.roofline_share(line, workload, limits[workload.threads])
            reference = None        # (label, outputs) this line is held to by agreement
            if held_to is not None and contender is not held_to and contender.same_weights:
                reference = held_to.label, theirs
            elif exact and contender.same_weights and not contender.same_kernels and first is not None:
                reference = contenders[0].label, first     # another program's sums on the same weights
            if reference is not None:
                logits_of = logits_of or bench.next_token_logits(bench.transformers_model(workload.model))
                line["agreement_with"] = reference[0]
                line["agreement"] = bench.agreement(outputs, {rid: reference[1][rid] for rid in outputs},
                                                    workload.items, logits_of)
            first = first or outputs
            mine.append(line)
            if not line.get("identical", True):
                problems.append(f"{workload.name}: {contender.label} differs from {contenders[0].label} in "
                                f"{', '.join(line['differing_requests'])}")
        for line in mine + [bench.summarise(workload, mine)]:
            print(json.dumps(line), flush=True)
        lines += mine
        if args.profile:
            for backend in backends:
                print(json.dumps(_profile(impl, bench, workload, backend, device)), flush=True)
    if device.type == "cuda" and "triton" in backends:
        # The kernel alone on one decode step of the first workload's shape: its share of the
        # device's memory bandwidth says how far the engine's attention is from the hardware.
        heads_of = next((w.shape for w in workloads if "num_attention_heads" in w.shape), bench.SERVING_SHAPE)
        print(json.dumps(bench.kernel_bandwidth(impl, device, heads_of)), flush=True)
    if args.plot:
        bench.plot(lines, args.plot)
    if problems:
        raise CommandError("outputs differ between contenders: " + "; ".join(problems[:5]))
    return 0


def _workload_spec(text, args):
    """`NAME[:vocab=N][:config=C][:scale=X]` -> (label, name, scale, vocab size, config): the
    command's --scale, --vocab-size and --config where the spec names none."""
    name, *options = text.split(":")
    settings = {"scale": args.scale, "vocab": args.vocab_size, "config": args.config}
    if name not in WORKLOADS:
        raise CommandError(f"--workloads takes names from {', '.join(WORKLOADS)}; got {name!r} in {text!r}")
    for option in options:
        key, _, value = option.partition("=")
        if key not in settings or not value:
            raise CommandError(f"workload {text!r}: options are vocab=N, config=default|qwen3-0.6b and "
                               f"scale=X; got {option!r}")
        settings[key] = value
    try:
        scale, vocab_size = float(settings["scale"]), int(settings["vocab"])
    except ValueError:
        raise CommandError(f"workload {text!r}: scale takes a number and vocab an integer") from None
    if scale <= 0:
        raise CommandError(f"workload {text!r}: the scale must be positive, got {scale}")
    if vocab_size < TINY_VOCAB_SIZE:
        raise CommandError(f"workload {text!r}: the vocabulary must be at least {TINY_VOCAB_SIZE} "
                           f"(bytes and special ids), got {vocab_size}")
    if settings["config"] not in ("default", "qwen3-0.6b"):
        raise CommandError(f"workload {text!r}: config is default or qwen3-0.6b, got {settings['config']!r}")
    return text, name, scale, vocab_size, settings["config"]


def _contenders(impl, bench, workload, device, backends, args):
    """Every contender of one workload, on one model built for it (same weights for all)."""
    dtype = _dtype(args, device)
    if workload.checkpoint:
        workload.model = model = impl.checkpoint.load_model(workload.checkpoint, dtype=dtype, device=device)
    else:
        workload.model = model = bench.build_model(impl, device, workload.shape, dtype)
    name = str(dtype).removeprefix("torch.")
    contenders = ([bench.core_contender(impl, model, b, dtype=name) for b in backends]
                  + [bench.slots_contender(impl, model)])
    if not args.no_hf:
        contenders += bench.hf_contenders(model, workload)
    if (not args.no_llama_cpp and workload.checkpoint and workload.checkpoint.endswith(".gguf")
            and bench.llama_cpp_missing() is None):
        contenders += bench.llama_cpp_contenders(workload.checkpoint, model.cfg.eos_token_id,
                                                 float32_engine=dtype == torch.float32)
    return contenders


def _thread_counts(text):
    """--threads "1,2" -> [1, 2]; None -> [] (the device's default)."""
    if text is None:
        return []
    try:
        counts = [int(part) for part in str(text).split(",") if part.strip()]
    except ValueError:
        raise CommandError(f"--threads takes whole numbers, comma-separated; got {text!r}") from None
    if not counts or min(counts) < 1:
        raise CommandError(f"--threads counts must be at least 1; got {text!r}")
    return counts


def _dtype(args, device):
    """--dtype as a torch dtype; auto: bfloat16 on CUDA, float32 elsewhere."""
    if args.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, args.dtype)


def _profile(impl, bench, workload, backend, device):
    contender = bench.core_contender(impl, workload.model, backend)
    engine = contender.make(workload)
    spent = bench.profile_core(engine.engine.core, device)
    contender.serve(engine, workload.items)
    return {"workload": workload.name, "profile": f"core/{backend}",
            "percent_of_step_time": bench.profile_shares(spent)}
