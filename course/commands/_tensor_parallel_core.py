"""`run.py core --tp N` (Chapter 41): the engine core of `run.py core` with its model split
over N ranks (not a command: the dispatcher skips files whose name starts with an
underscore).

Each rank is a process (torch.multiprocessing, spawn) with one device: gloo on a CPU,
NCCL and cuda:<rank> on GPUs. Every rank loads the model, keeps its shard
(parallel.tp.shard_model), builds an EngineCore on it and serves the same workload with
the same deterministic scheduler. Rank 0 reports; the parent then runs the
single-process core on the same workload and prints its line too, and the summary says
whether every output is identical.
"""
from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from course.cli import CommandError, resolve_device


def _contenders(serve: Any, model: Any, args: Any, suffix: str) -> list[Any]:
    from course.commands.core import core_contender
    return [core_contender(serve, model, args.ample_blocks, args.block_size, f"ch31 core, ample pool{suffix}",
                           args.backend),
            core_contender(serve, model, args.small_blocks, args.block_size,
                           f"ch31 core, {args.small_blocks}-block pool{suffix}", args.backend)]


def _serve(impl: Any, model: Any, args: Any, suffix: str, device: Any) -> tuple[list[dict], list[dict]]:
    """Warm up, time --repeat rounds; the contenders' JSON lines and outputs."""
    class Serve:
        engine = impl.load("serve.engine")
        config = impl.load("serve.config")
        request = impl.load("serve.request")

    items = impl.load("workloads").shared_prefix_workload(num_requests=args.requests, seed=args.seed)
    contenders = _contenders(Serve, model, args, suffix)
    for contender in contenders:
        contender.serve(contender.make(), items[:2])
    for _ in range(args.repeat):
        for contender in contenders:
            contender.timed_run(device, items)
    return [c.line() for c in contenders], [c.fastest()[2] for c in contenders]


def core_rank(rank: int, world: int, port: int, args: Any, out_dir: str) -> None:
    """One rank of `run.py core --tp`: its shard, the workload, rank 0 writes the result."""
    from course.commands._setup import load_model
    from course.impl import load
    from course.models import QWEN3_VOCAB_SIZE
    impl = load(args.impl)
    device = impl.load("parallel.launch").init_group(rank, world, port, resolve_device(args.device), timeout_s=60)
    vocab_size = QWEN3_VOCAB_SIZE if args.vocab_size is None and args.model is None else args.vocab_size
    model = impl.load("parallel.tp").shard_model(load_model(impl, device, args.model, vocab_size), rank, world)
    lines, outputs = _serve(impl, model, args, f", tp={world}", device)
    if rank == 0:
        Path(out_dir, "result.json").write_text(json.dumps({"lines": lines, "outputs": outputs}))


def run_tensor_parallel(args: Any) -> int:
    from course.commands._setup import load_model, set_threads
    from course.impl import load
    from course.models import QWEN3_VOCAB_SIZE
    impl = load(args.impl)
    launch = impl.load("parallel.launch")
    with tempfile.TemporaryDirectory(prefix="core-tp-") as out_dir:
        try:
            launch.launch(core_rank, args.tp, args, out_dir, timeout_s=args.tp_timeout)
        except launch.RankFailure as exc:
            raise CommandError(f"tensor-parallel run failed: {exc}") from None
        result = json.loads(Path(out_dir, "result.json").read_text())
    device = resolve_device(args.device)
    set_threads(device, args.threads)
    vocab_size = QWEN3_VOCAB_SIZE if args.vocab_size is None and args.model is None else args.vocab_size
    single_lines, single_outputs = _serve(impl, load_model(impl, device, args.model, vocab_size), args, "", device)
    for line in single_lines[:1] + result["lines"]:
        print(json.dumps(line), flush=True)
    different = [rid for outputs in result["outputs"] for rid, tokens in outputs.items()
                 if tokens != single_outputs[0][rid]]
    print(json.dumps({"outputs_identical": not different,
                      f"speedup_tp{args.tp}": round(result["lines"][0]["tok_s"] / single_lines[0]["tok_s"], 2)}),
          flush=True)
    if different:
        raise CommandError(f"tensor-parallel outputs differ from the single-process engine for {different[:5]}")
    return 0
