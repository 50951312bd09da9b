"""`run.py core --tp N` (Chapter 41): the engine core of `run.py core` with its model split
over N ranks (not a command: the dispatcher skips files whose name starts with an
underscore).

Each rank is a process (torch.multiprocessing, spawn) with one device: gloo on a CPU,
NCCL and cuda:<rank> on GPUs. Every rank loads the model, keeps its shard
(parallel.tp.shard_model), builds an EngineCore on it and serves the same workload with
the same deterministic scheduler. Rank 0 reports; the parent then runs the
single-process core on the same workload and prints its line too, and the summary says
whether every output is identical.

Under torchrun (`torchrun --nproc-per-node 2 run.py core --tp 2`, or --nnodes N with a
rendezvous host for several machines) the processes already exist: each one is a rank,
joins the group through torchrun's environment (env://), and rank 0 runs the
single-process core itself and prints everything; --tp must equal torchrun's world size.
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
    from course.commands._setup import serve_modules
    items = impl.load("workloads").shared_prefix_workload(num_requests=args.requests, seed=args.seed)
    contenders = _contenders(serve_modules(impl), model, args, suffix)
    for contender in contenders:
        contender.serve(contender.make(), items[:2])
    for _ in range(args.repeat):
        for contender in contenders:
            contender.timed_run(device, items)
    return [c.line() for c in contenders], [c.fastest()[2] for c in contenders]


def _tp_lines(rank: int, world: int, port: int | None, args: Any) -> tuple[list[dict], list[dict]]:
    """Join the group (port None: through torchrun's environment), shard, serve."""
    from course.commands._setup import load_model
    from course.commands.core import vocab_size_of
    from course.impl import load
    impl = load(args.impl)
    device = impl.load("parallel.launch").init_group(rank, world, port, resolve_device(args.device), timeout_s=60)
    model = impl.load("parallel.tp").shard_model(load_model(impl, device, args.model, vocab_size_of(args)), rank, world)
    return _serve(impl, model, args, f", tp={world}", device)


def core_rank(rank: int, world: int, port: int, args: Any, out_dir: str) -> None:
    """One rank of `run.py core --tp` started by `launch`: rank 0 writes the result."""
    lines, outputs = _tp_lines(rank, world, port, args)
    if rank == 0:
        Path(out_dir, "result.json").write_text(json.dumps({"lines": lines, "outputs": outputs}))


def run_tensor_parallel(args: Any) -> int:
    from course.impl import load
    impl = load(args.impl)
    launch = impl.load("parallel.launch")
    try:
        started_by_torchrun = launch.torchrun_rank()
    except RuntimeError as exc:
        raise CommandError(str(exc)) from None
    if started_by_torchrun is not None:
        return _run_under_torchrun(impl, args, *started_by_torchrun)
    with tempfile.TemporaryDirectory(prefix="core-tp-") as out_dir:
        try:
            launch.launch(core_rank, args.tp, args, out_dir, timeout_s=args.tp_timeout)
        except launch.RankFailure as exc:
            raise CommandError(f"tensor-parallel run failed: {exc}") from None
        result = json.loads(Path(out_dir, "result.json").read_text())
    return _compare_with_one_process(impl, args, result)


def _run_under_torchrun(impl: Any, args: Any, rank: int, world: int) -> int:
    """This process is one of torchrun's ranks: serve our shard; rank 0 then compares with
    the single-process core and prints, the others print nothing."""
    import torch.distributed as dist

    from course.commands._setup import prepare_device
    if world != args.tp:
        raise CommandError(f"--tp {args.tp} but torchrun started {world} ranks (--nnodes x --nproc-per-node): "
                           f"they must be equal")
    prepare_device(args)
    try:
        lines, outputs = _tp_lines(rank, world, None, args)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if rank != 0:
        return 0
    return _compare_with_one_process(impl, args, {"lines": lines, "outputs": outputs})


def _compare_with_one_process(impl: Any, args: Any, result: dict) -> int:
    """Serve the same workload with the single-process core, print its line beside the
    ranks', and fail when any output token differs."""
    from course.commands._setup import load_model, prepare_device
    from course.commands.core import vocab_size_of
    device = prepare_device(args)
    single_lines, single_outputs = _serve(impl, load_model(impl, device, args.model, vocab_size_of(args)), args, "",
                                          device)
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
