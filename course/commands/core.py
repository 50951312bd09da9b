"""Chapter 31: the engine core against Chapter 24's slot engine on the shared-prefix workload.

Serves Chapter 22's shared-prefix workload (16 requests: one 192-token system prompt, an
8-48-token question each, 8-40 output tokens) three times: with Chapter 24's
ContinuousBatchingEngine (8 slots of 320 tokens), with the Chapter 31 EngineCore and an
ample pool (4,096 blocks of 16 tokens), and with the core squeezed into 24 blocks (384
token slots), where it must preempt. Prints one JSON line per engine: engine, kv_slots,
output_tokens, tok_s, steps, prefix_hit_rate, preemptions; then one summary line with the
speedups. The three engines' outputs are compared request by request: any difference is an
error (exit status 2), never a footnote.

The model is the tiny test model's two layers with Qwen3's vocabulary of 151,936 tokens
(--vocab-size). With the tests' 320-token vocabulary a step does almost no arithmetic: its
time is PyTorch's per-operation overhead, and the comparison would count the small
operations each engine issues instead of the work the core avoids (prompt tokens served
from the prefix cache, logits computed for sampled rows only). `--vocab-size 320` shows
that regime; --model runs a real checkpoint with its own vocabulary.

Each engine is warmed up on the first two requests, then the three are timed in turn,
--repeat rounds, from the first request to the last token (building an engine and its
cache is not timed); each engine's best run is reported: other processes on a small
machine only ever make a run slower, and interleaving spreads a busy moment over all
three. By default torch uses one thread on a CPU (--threads), for steadier timings.

--tp N (Chapter 41) splits the core's model over N processes by tensor parallelism and
prints the single-process core's line beside the split ones (course/commands/_tensor_parallel_core.py).
Started by torchrun, the ranks are torchrun's processes, possibly on several machines:
`torchrun --standalone --nproc-per-node 2 run.py core --tp 2`.
"""
import json
import os
import time
from typing import Any

from course.cli import CommandError, add_device_argument, add_impl_argument, add_model_argument, add_threads_argument
from course.models import QWEN3_VOCAB_SIZE, TINY_VOCAB_SIZE
from course.testing.milestone_helpers import first_difference, token_at


def add_arguments(parser):
    add_impl_argument(parser)
    add_device_argument(parser)
    add_model_argument(parser)
    parser.add_argument("--vocab-size", type=int, default=None,
                        help=f"vocabulary of the tiny model (default {QWEN3_VOCAB_SIZE:,}, Qwen3's; "
                             f"the tests use {TINY_VOCAB_SIZE}); not with --model")
    parser.add_argument("--requests", type=int, default=16, help="number of requests (default 16)")
    parser.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    parser.add_argument("--ample-blocks", type=int, default=4096, help="blocks of the ample pool (default 4096)")
    parser.add_argument("--small-blocks", type=int, default=24, help="blocks of the small pool (default 24)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per block (default 16)")
    parser.add_argument("--backend", default="reference",
                        help="attention backend of the core, by registry name (default: reference; "
                             "Chapter 32 registers faster ones)")
    parser.add_argument("--repeat", type=int, default=3, help="timed runs per engine; the best is reported (default 3)")
    add_threads_argument(parser)
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                        help="weights and KV of all three engines (default auto: the model's); in bfloat16 the "
                             "engines may part at a near tie, which is reported, not an error (Chapter 32)")
    parser.add_argument("--check", action="store_true", help="also compare outputs with solo generate")
    parser.add_argument("--tp", type=int, default=1,
                        help="tensor-parallel ranks, one process each (Chapter 41; default 1: no split)")
    parser.add_argument("--tp-timeout", type=float, default=300.0,
                        help="seconds the ranks of --tp may run before they are stopped (default 300)")


def _sync(device):
    import torch

    from course import reference
    from course.impl import have_reference
    if have_reference():
        reference().devices.synchronize(device)
    elif device.type == "cuda":           # a learner's edition has no reference devices module
        torch.cuda.synchronize(device)


class Contender:
    """One engine configuration of the comparison: how to build it and how to serve the workload."""

    def __init__(self, label, kv_slots, make, serve):
        self.label, self.kv_slots, self.make, self.serve = label, kv_slots, make, serve
        self.best: tuple[float, Any, dict] | None = None   # (seconds, engine, outputs) of the fastest run

    def timed_run(self, device, items):
        engine = self.make()                   # building an engine and its cache is start-up, not serving
        _sync(device)
        start = time.perf_counter()
        outputs = self.serve(engine, items)
        _sync(device)
        elapsed = time.perf_counter() - start
        if self.best is None or elapsed < self.best[0]:
            self.best = (elapsed, engine, outputs)

    def fastest(self) -> tuple[float, Any, dict]:
        if self.best is None:
            raise RuntimeError(f"{self.label}: line() before any timed_run()")
        return self.best

    def line(self):
        elapsed, engine, outputs = self.fastest()
        tokens = sum(len(v) for v in outputs.values())
        blocks = getattr(engine, "blocks", None)
        return {"engine": self.label, "kv_slots": self.kv_slots, "output_tokens": tokens,
                "tok_s": round(tokens / elapsed, 1), "steps": engine.steps,
                "prefix_hit_rate": round(blocks.hit_rate, 3) if blocks is not None else 0.0,
                "preemptions": getattr(engine, "preemptions", 0)}


def slot_contender(continuous, model):
    return Contender("ch24 slots", 8 * 320,
                     lambda: continuous.ContinuousBatchingEngine(model, num_slots=8, slot_len=320),
                     lambda engine, items: engine.run(items))


def core_contender(serve, model, num_blocks, block_size, label, backend="reference", dtype="auto"):
    config = serve.config.EngineConfig(num_blocks=num_blocks, block_size=block_size, attention_backend=backend,
                                       dtype=dtype)
    eos = getattr(model.cfg, "eos_token_id", None)

    def run_all(engine, items):
        params = [serve.request.SamplingParams(max_tokens=it.max_tokens) for it in items]
        results = engine.generate([it.prompt_ids for it in items], params)
        return {it.request_id: out.output_token_ids for it, out in zip(items, results)}

    return Contender(label, num_blocks * block_size,
                     lambda: serve.engine.EngineCore(model, config, eos_token_id=eos), run_all)


def vocab_size_of(args):
    """The tiny model's vocabulary for --vocab-size: Qwen3's unless told (a checkpoint brings its own)."""
    return QWEN3_VOCAB_SIZE if args.vocab_size is None and args.model is None else args.vocab_size


def run(args):
    from course.commands._setup import load_model, prepare, serve_modules
    impl, device = prepare(args)
    if args.requests < 1 or args.repeat < 1:
        raise CommandError("--requests and --repeat must be at least 1")
    if args.tp > 1 or int(os.environ.get("WORLD_SIZE", "1")) > 1:   # Chapter 41: split over processes
        from course.commands._tensor_parallel_core import run_tensor_parallel
        return run_tensor_parallel(args)

    serve = serve_modules(impl)
    continuous = impl.load("continuous")
    workloads = impl.load("workloads")
    model = load_model(impl, device, args.model, vocab_size_of(args))
    if args.dtype != "auto":                  # every engine on the same weights, cast once
        import torch
        model.to(getattr(torch, args.dtype))
    items = workloads.shared_prefix_workload(num_requests=args.requests, seed=args.seed)

    contenders = [slot_contender(continuous, model),
                  core_contender(serve, model, args.ample_blocks, args.block_size, "ch31 core, ample pool",
                                 args.backend, args.dtype),
                  core_contender(serve, model, args.small_blocks, args.block_size,
                                 f"ch31 core, {args.small_blocks}-block pool", args.backend, args.dtype)]
    try:
        for contender in contenders:           # warm-up: first calls pay one-off costs
            contender.serve(contender.make(), items[:2])
        for _ in range(args.repeat):           # interleaved, so a busy moment slows every engine alike
            for contender in contenders:
                contender.timed_run(device, items)
    except NotImplementedError as exc:
        raise CommandError(f"{impl.name} is not complete yet: {exc}") from None
    except ValueError as exc:                  # a configuration the engine refuses (say, an unknown backend)
        raise CommandError(str(exc)) from None
    lines = [c.line() for c in contenders]
    for line in lines:
        print(json.dumps(line), flush=True)
    slots_line, ample_line, small_line = lines
    slots_out, ample_out, small_out = (c.fastest()[2] for c in contenders)

    problems = []
    for it in items:
        want = slots_out[it.request_id]
        for label, outputs in (("ample pool", ample_out), (f"{args.small_blocks}-block pool", small_out)):
            got = outputs[it.request_id]
            if got != want:
                i = first_difference(want, got)
                problems.append(f"{it.request_id} ({label}): output token {i} is {token_at(got, i)}, "
                                f"Chapter 24's engine gave {token_at(want, i)}")
    if args.check and not problems:
        from course.testing.oracles import reference_generate
        eos = getattr(model.cfg, "eos_token_id", None)
        for it in items:
            if reference_generate(model, it.prompt_ids, it.max_tokens, eos_token_id=eos) != slots_out[it.request_id]:
                problems.append(f"{it.request_id}: all three engines differ from solo generate")
    summary = {"dtype": str(next(model.parameters()).dtype).removeprefix("torch."), "outputs_identical": not problems,
               "speedup_ample": round(ample_line["tok_s"] / slots_line["tok_s"], 2),
               f"speedup_{args.small_blocks}_blocks": round(small_line["tok_s"] / slots_line["tok_s"], 2)}
    print(json.dumps(summary), flush=True)
    if problems and args.dtype == "bfloat16":     # rounding parts greedy paths at near ties: say so, not fail
        print(json.dumps({"differences_in_bfloat16": problems[:5]}), flush=True)
    elif problems:
        raise CommandError("outputs differ between engines: " + "; ".join(problems[:5])
                           + (f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""))
    return 0
