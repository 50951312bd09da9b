"""Rank programs for Chapter 41's tests and notebook: each runs in its own process under
`parallel.launch.launch`, loads the implementation under test by its spec (a fresh
interpreter has nothing loaded), serves prompts on the tiny model and writes what it saw
to <out_dir>/rank<r>.json. Nothing here decides whether a result is right: the callers
compare it with solo generate.

Starting a process that imports torch costs seconds on a small machine, so one launch
runs a whole session: tensor parallel, then pipeline parallel, then disaggregated
prefill on the same two ranks, and last (if asked) rank 1 dies while rank 0 waits for it
in an all-reduce, which must end in an error, not a hang.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from course.impl import Impl, load
from course.models import tiny_qwen3
from course.testing.oracles import TINY_EOS

PARTS = ("tp", "pp", "disagg", "death")
TP_POOL_BYTES = "tp_kv_cache_bytes"     # a session config's per-rank pool budgets, for the "tp" part only


def read_results(out_dir: str | Path, world: int) -> list[dict[str, Any]]:
    """What each rank wrote ({} for a rank that wrote nothing)."""
    found = []
    for rank in range(world):
        path = Path(out_dir, f"rank{rank}.json")
        found.append(json.loads(path.read_text()) if path.exists() else {})
    return found


class CollectiveCounter:
    """Counts torch.distributed.all_reduce and all_gather calls while installed (the
    parallel modules look them up on torch.distributed at call time)."""

    def __init__(self) -> None:
        self.counts = {"all_reduce": 0, "all_gather": 0}
        self.originals = {name: getattr(dist, name) for name in self.counts}
        for name, original in self.originals.items():
            setattr(dist, name, self._counting(name, original))

    def _counting(self, name: str, original: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            self.counts[name] += 1
            return original(*args, **kwargs)
        return call

    def remove(self) -> None:
        for name, original in self.originals.items():
            setattr(dist, name, original)


def _engine(impl: Impl, model: Any, config: dict[str, Any]) -> Any:
    return impl.load("serve.engine").EngineCore(model, impl.load("serve.config").EngineConfig(**config),
                                                eos_token_id=TINY_EOS)


def tensor_parallel(impl: Impl, rank: int, world: int, device: torch.device, prompts: list[list[int]],
                    max_new: int, config: dict[str, Any], note: Any = None) -> dict[str, Any]:
    """Every rank serves the same prompts with its shard of the model. With
    config[TP_POOL_BYTES] (one budget per rank) each rank sizes its own pool from its entry
    instead of num_blocks, as GPUs with different free memory would. `note` (if given) is
    called with the pool's size before serving starts, so a rank that dies in a collective
    has left it behind (ranks whose pools differ in size part ways and die that way)."""
    config = dict(config)
    budgets = config.pop(TP_POOL_BYTES, None)
    if budgets is not None:
        config.pop("num_blocks", None)
        config["kv_cache_bytes"] = budgets[rank]
    model = impl.load("parallel.tp").shard_model(tiny_qwen3(impl.package, device=device), rank, world)
    engine = _engine(impl, model, config)
    if note is not None:
        note({"num_blocks": engine.blocks.num_blocks})
    counter = CollectiveCounter()
    try:
        outputs = engine.generate(prompts, impl.load("serve.request").SamplingParams(max_tokens=max_new))
    finally:
        counter.remove()
    return {"outputs": [o.output_token_ids for o in outputs], "steps": engine.steps,
            "collectives": counter.counts, "pool_shape": list(engine.runner.kv_caches[0][0].shape),
            "num_blocks": engine.blocks.num_blocks}


def pipeline_parallel(impl: Impl, rank: int, world: int, device: torch.device, prompts: list[list[int]],
                      max_new: int, config: dict[str, Any]) -> dict[str, Any]:
    """Rank r is pipeline stage r."""
    engine = impl.load("parallel.pp").pipeline_engine(
        tiny_qwen3(impl.package, device=device), impl.load("serve.config").EngineConfig(**config), rank, world,
        eos_token_id=TINY_EOS, micro_batches=2)
    outputs = engine.generate(prompts, impl.load("serve.request").SamplingParams(max_tokens=max_new))
    return {"outputs": [o.output_token_ids for o in outputs], "steps": engine.steps,
            "layers_held": len(engine.runner.kv_caches)}


def disaggregated(impl: Impl, rank: int, world: int, device: torch.device, prompts: list[list[int]],
                  max_new: int, config: dict[str, Any]) -> dict[str, Any]:
    """Rank 0 prefills and ships, rank 1 adopts and decodes."""
    disagg = impl.load("parallel.disagg")
    engine = _engine(impl, tiny_qwen3(impl.package, device=device), config)
    ids = [f"r{i}" for i in range(len(prompts))]
    if rank == 0:
        shipped = disagg.run_prefill(engine, [(rid, list(p), max_new) for rid, p in zip(ids, prompts)], 1)
        return {"shipped": shipped, "steps": engine.steps, "free_after": engine.blocks.num_free}
    results, adopted = disagg.run_decode(engine, 0)
    return {"outputs": [results.get(rid) for rid in ids], "adopted": adopted, "steps": engine.steps,
            "prefix_hits": engine.blocks.stats["hits"], "free_after": engine.blocks.num_free,
            "num_blocks": engine.blocks.num_blocks}


def _note(path: Path, results: dict[str, Any], part: str, seen: dict[str, Any]) -> None:
    results[part] = {"unfinished": True, **seen}
    path.write_text(json.dumps(results))


def session_rank(rank: int, world: int, port: int, impl_spec: str, prompts: list[list[int]], max_new: int,
                 config: dict[str, Any], out_dir: str, parts: tuple[str, ...] = PARTS,
                 device: str = "cpu") -> None:
    """Run `parts` in order on this rank, writing the results after each one. A part that
    raises is recorded as {"error": ...} and the next part still runs (a learner may finish
    the disaggregation stub before the tensor-parallel ones); the rank then fails at the end."""
    impl = load(impl_spec)
    place = impl.load("parallel.launch").init_group(rank, world, port, device, timeout_s=20)
    results: dict[str, Any] = {}
    path = Path(out_dir, f"rank{rank}.json")
    runs = {"tp": tensor_parallel, "pp": pipeline_parallel, "disagg": disaggregated}
    failed = []
    for part in parts:
        if part == "death":
            dist.barrier()              # every earlier result is written before anyone dies
            if rank == 1:
                os._exit(3)
            try:
                dist.all_reduce(torch.ones(4, device=place))
                if place.type == "cuda":            # NCCL returns at once: the wait is here
                    torch.cuda.synchronize(place)
                results["death"] = {"error": None}
            except Exception as exc:
                results["death"] = {"error": f"{type(exc).__name__}: {exc}"}
                path.write_text(json.dumps(results))
                raise
        else:
            try:
                own = config if part == "tp" else {k: v for k, v in config.items() if k != TP_POOL_BYTES}
                results[part] = {"unfinished": True}        # what a rank that dies here leaves behind
                path.write_text(json.dumps(results))
                if part == "tp":
                    results[part] = tensor_parallel(impl, rank, world, place, prompts, max_new, own,
                                                    note=lambda seen: _note(path, results, "tp", seen))
                else:
                    results[part] = runs[part](impl, rank, world, place, prompts, max_new, own)
            except Exception as exc:
                noted = {k: v for k, v in results.get(part, {}).items() if k != "unfinished"}
                results[part] = {**noted, "error": f"{type(exc).__name__}: {exc}"}
                failed.append(part)
        path.write_text(json.dumps(results))
    if failed:
        raise RuntimeError(f"rank {rank}: {', '.join(failed)} failed: {results[failed[0]]['error']}")



def smollm2_tensor_parallel_rank(rank: int, world: int, port: int, impl_spec: str, prompt: list[int], max_new: int,
                                 eos_token_id: int, out_dir: str) -> None:
    """SmolLM2-135M (loaded as course.models.real loads it: by the reference, or in a
    learner's edition by their engine) split over `world` ranks by the implementation under
    test, served by its engine; writes the greedy tokens."""
    from course.models.real import smollm2
    impl = load(impl_spec)
    impl.load("parallel.launch").init_group(rank, world, port, timeout_s=120)
    sharded = impl.load("parallel.tp").shard_model(smollm2()[0], rank, world)
    smollm2.cache_clear()               # the whole model's 540 MB: each of the ranks keeps its shard only
    engine = impl.load("serve.engine").EngineCore(
        sharded, impl.load("serve.config").EngineConfig(num_blocks=32, block_size=16), eos_token_id=eos_token_id)
    out = engine.generate([prompt], impl.load("serve.request").SamplingParams(max_tokens=max_new))[0]
    found = {"outputs": [out.output_token_ids], "kv_heads": engine.runner.kv_caches[0][0].shape[2]}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"tp": found}))
