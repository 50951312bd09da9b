"""Chapter 33: the engine core synchronous and asynchronous, unpadded and padded to graph buckets.

Serves Chapter 22's shared-prefix workload (the one `run.py core` uses) with the engine core
in several configurations of one model and prints one JSON line each: engine, output_tokens,
tok_s, steps, ms_per_step; the asynchronous ones add host_ms_per_step (scheduling and
building batches) and wait_ms_per_step (waiting for a launched step's tokens). Then one
summary line with the ratios to the synchronous engine and whether every configuration
produced the same tokens (any difference is an error, exit status 2).

    sync                    Chapter 31's step
    sync, static buckets    decode steps padded to buckets through static buffers
                            (cuda_graphs="static": the CUDA-graph path, run eagerly)
    sync, fused torch       FlatModel.fused = "torch" (the fused add + RMSNorm's fallback)
    async inline            asynchronous scheduling, device part run at once (no overlap:
                            what the bookkeeping costs)
    async thread            asynchronous scheduling, device part on a worker thread (the
                            forward pass overlaps the host's scheduling)
With --compiled one more, opt-in because inductor takes seconds per bucket to compile:
    sync, compiled          the static buckets with EngineConfig.compile_decode (each
                            bucket's step one torch.compile'd graph, attention outside it);
                            one engine, built and warmed on the whole workload once (every
                            bucket it meets compiled), reused for the timed runs with its
                            prefix cache emptied, so compile time is not in its figures
On a GPU three more: "sync triton" (Chapter 32's Triton backend, eager), "cuda graphs"
(the same backend, cuda_graphs="on", the fused Triton add + RMSNorm) and "async cuda graphs".

Engines are timed in turn, --repeat rounds, best run each (see `run.py core`). Torch uses
one thread on a CPU unless --threads says otherwise.
"""
import json
import time
from typing import Any

from course.cli import CommandError, add_device_argument, add_impl_argument, add_threads_argument
from course.models import QWEN3_VOCAB_SIZE


def add_arguments(parser):
    add_impl_argument(parser)
    add_device_argument(parser)
    parser.add_argument("--vocab-size", type=int, default=QWEN3_VOCAB_SIZE,
                        help=f"vocabulary of the tiny model (default {QWEN3_VOCAB_SIZE:,}, Qwen3's)")
    parser.add_argument("--shape", choices=("tiny", "qwen3-0.6b"), default="tiny",
                        help="the tiny test model (default) or Qwen3-0.6B's shape with random weights (bfloat16 "
                             "on CUDA; --vocab-size applies to the tiny model only)")
    parser.add_argument("--requests", type=int, default=16, help="number of requests (default 16)")
    parser.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    parser.add_argument("--max-num-seqs", type=int, default=16, help="most requests per step: the largest bucket")
    parser.add_argument("--repeat", type=int, default=3, help="timed runs per engine; the best is reported")
    parser.add_argument("--compiled", action="store_true",
                        help="add the 'sync, compiled' engine (static buckets + compile_decode); off by default: "
                             "compiling each bucket takes seconds, paid once before the timed runs")
    add_threads_argument(parser)


def _sync(device):
    if device.type == "cuda":
        import torch
        torch.cuda.synchronize()


def reused(build):
    """A builder that returns one engine, made once, emptied of what a previous run left
    (cached prefix blocks, step counters): its compiled buckets stay compiled."""
    made: list[Any] = []

    def again():
        if not made:
            made.append(build())
            return made[0]
        engine = made[0]
        engine.blocks.reset_prefix_cache()
        engine.steps = 0
        engine.runner.graphs.runs = {"replayed": 0, "eager": 0}
        return engine
    return again


def contenders(serve, model, device, max_num_seqs, compiled=False):
    """label -> a function that builds a fresh engine of that configuration."""
    base = dict(num_blocks=2048, block_size=16, max_num_seqs=max_num_seqs)
    eos = getattr(model.cfg, "eos_token_id", None)

    def make(queue=None, fused=False, **config):
        def build():
            flat = serve.flat_model.FlatModel(model)
            flat.fused = fused
            queued = {"device_queue": queue} if queue is not None else {}
            return serve.engine.EngineCore(flat, serve.config.EngineConfig(**{**base, **config, **queued}),
                                           eos_token_id=eos)
        return build

    out = {"sync": make(), "sync, static buckets": make(cuda_graphs="static"), "sync, fused torch": make(fused="torch"),
           "async inline": make(queue="inline", async_scheduling=True),
           "async thread": make(queue="thread", async_scheduling=True)}
    if compiled:
        out["sync, compiled"] = reused(make(cuda_graphs="static", compile_decode=True))
    if device.type == "cuda":
        out["sync triton"] = make(attention_backend="triton")
        out["cuda graphs"] = make(cuda_graphs="on", attention_backend="triton", fused=True)
        out["async cuda graphs"] = make(cuda_graphs="on", attention_backend="triton", fused=True,
                                        async_scheduling=True)
    return out


def serve_items(serve, engine, items):
    params = [serve.request.SamplingParams(max_tokens=it.max_tokens) for it in items]
    results = engine.generate([it.prompt_ids for it in items], params)
    return {it.request_id: out.output_token_ids for it, out in zip(items, results)}


def run(args):
    from course.commands._setup import load_model, prepare, serve_modules
    impl, device = prepare(args)
    if args.requests < 1 or args.repeat < 1 or args.max_num_seqs < 1:
        raise CommandError("--requests, --repeat and --max-num-seqs must be at least 1")

    serve = serve_modules(impl, "flat_model", "overlap")

    if args.shape == "tiny":
        model = load_model(impl, device, None, args.vocab_size)
    else:
        from course.bench import QWEN3_0_6B_SHAPE, build_model
        model = build_model(impl, device, QWEN3_0_6B_SHAPE)
    items = impl.load("workloads").shared_prefix_workload(num_requests=args.requests, seed=args.seed)
    builders = contenders(serve, model, device, args.max_num_seqs, args.compiled)
    best: dict[str, tuple[float, Any, dict]] = {}
    try:
        for label, build in builders.items():  # warm-up: first calls pay one-off costs (compiles: every bucket)
            serve_items(serve, build(), items if label == "sync, compiled" else items[:2])
        for _ in range(args.repeat):           # interleaved, so a busy moment slows every engine alike
            for label, build in builders.items():
                engine = build()
                _sync(device)
                start = time.perf_counter()
                outputs = serve_items(serve, engine, items)
                _sync(device)
                elapsed = time.perf_counter() - start
                if label not in best or elapsed < best[label][0]:
                    best[label] = (elapsed, engine, outputs)
                if engine.async_steps is not None:
                    engine.async_steps.queue.close()
    except NotImplementedError as exc:
        raise CommandError(f"{impl.name} is not complete yet: {exc}") from None
    except ValueError as exc:
        raise CommandError(str(exc)) from None

    lines = {}
    for label, (elapsed, engine, outputs) in best.items():
        tokens = sum(len(v) for v in outputs.values())
        line = {"engine": label, "output_tokens": tokens, "tok_s": round(tokens / elapsed, 1), "steps": engine.steps,
                "ms_per_step": round(1000 * elapsed / max(1, engine.steps), 3)}
        stepper = engine.async_steps
        if stepper is not None:
            line["host_ms_per_step"] = round(1000 * stepper.host_seconds / max(1, engine.steps), 3)
            line["wait_ms_per_step"] = round(1000 * stepper.wait_seconds / max(1, engine.steps), 3)
        graphs = engine.runner.graphs
        if graphs is not None:
            line["decode_steps_padded"] = graphs.runs["eager"] + graphs.runs["replayed"]
            line["decode_steps_replayed"] = graphs.runs["replayed"]
            if graphs.compiled is not None:
                line["compile_s_per_bucket"] = {size: round(s, 1)
                                               for size, s in sorted(graphs.compiled.compile_seconds.items())}
        lines[label] = line
        print(json.dumps(line), flush=True)

    want = best["sync"][2]
    problems = [f"{label}: request {rid} differs from the synchronous engine"
                for label, (_, _, outputs) in best.items() for rid in want if outputs[rid] != want[rid]]
    sync_rate = lines["sync"]["tok_s"]
    summary = {"outputs_identical": not problems,
               **{f"{label.replace(', ', '_').replace(' ', '_')}_vs_sync": round(line["tok_s"] / sync_rate, 3)
                  for label, line in lines.items() if label != "sync"}}
    print(json.dumps(summary), flush=True)
    if problems:
        raise CommandError("outputs differ between engines: " + "; ".join(problems[:5]))
    return 0
