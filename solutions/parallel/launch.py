"""Chapter 41: process groups and a launcher whose processes always exit.

Every rank is a process with one device. `init_group` joins the group with a deadline
(NCCL when the device is a GPU, gloo on a CPU: the same calls either way); `launch` starts
the ranks, waits for them with a deadline, gives the survivors of a failed rank a few
seconds to notice on their own, then kills whatever is left and reports which rank failed
and why. A distributed program that hangs is worse than one that crashes: the crash says
where it broke.

`launch` starts every rank on this host. Past one machine, PyTorch's own launcher starts
them instead (`torchrun --nnodes N --nproc-per-node M ...`, one torchrun per node): it sets
RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT in each process, `torchrun_rank`
reads them, and `init_group(..., port=None)` meets the others through them (the env://
rendezvous) instead of a port on 127.0.0.1.
"""
from __future__ import annotations

import multiprocessing.connection
import os
import runpy
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

RANK_RUN_NAME = "__rank__"          # __name__ of this file when a rank's process runs it


class RankFailure(RuntimeError):
    """A rank died, raised, or ran past the deadline; the message names each one."""


def free_port() -> int:
    """A TCP port nobody listens on right now (the rendezvous of one group)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def backend_for(device: torch.device | str) -> str:
    """NCCL for GPUs, gloo for everything else."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


# What torchrun (torch.distributed.run) puts in every rank's environment.
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def torchrun_rank() -> tuple[int, int] | None:
    """(rank, world_size) when this process was started by torchrun, else None. A process
    with some of torchrun's variables but not all was started by hand half-way: an error."""
    present = [name for name in TORCHRUN_VARIABLES if name in os.environ]
    if not present:
        return None
    if len(present) < len(TORCHRUN_VARIABLES):
        missing = sorted(set(TORCHRUN_VARIABLES) - set(present))
        raise RuntimeError(f"the environment has {', '.join(present)} but not {', '.join(missing)}: "
                           f"start the ranks with torchrun, which sets all of {', '.join(TORCHRUN_VARIABLES)}")
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def init_group(rank: int, world_size: int, port: int | None, device: torch.device | str = "cpu",
               timeout_s: float = 30.0) -> torch.device:
    """Join the process group of `world_size` ranks; returns this rank's device. The ranks
    meet at 127.0.0.1:port (all on this host, started by `launch`) or, with port None, where
    torchrun's MASTER_ADDR and MASTER_PORT say (env://: the ranks may be on several hosts).
    On GPUs a rank takes cuda:<its index on its host> (LOCAL_RANK under torchrun). Every
    collective then fails after timeout_s instead of waiting forever for a peer that will
    never come."""
    device = torch.device(device)
    if device.type == "cuda":
        local_rank = int(os.environ["LOCAL_RANK"]) if port is None else rank
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    meeting_point = "env://" if port is None else f"tcp://127.0.0.1:{port}"
    dist.init_process_group(backend_for(device), init_method=meeting_point, rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=timeout_s))
    return device


def _rank_main(entry: Callable[..., None], rank: int, world_size: int, port: int, errors: str,
               args: tuple[Any, ...]) -> None:
    """Run one rank; an exception is written to errors/<rank> for the launcher, then the
    process exits with status 1."""
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    try:
        entry(rank, world_size, port, *args)
    except BaseException as exc:
        Path(errors, str(rank)).write_text(f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        raise SystemExit(1) from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def launch(entry: Callable[..., None], world_size: int, *args: Any, timeout_s: float = 60.0,
           grace_s: float = 5.0) -> None:
    """Run entry(rank, world_size, port, *args) in world_size fresh processes and wait.

    `entry` must be importable by name (a module-level function): each rank is a new
    interpreter (the spawn start method: CUDA cannot be used in a forked child, and spawn works
    on every platform). Returns when every rank
    exited with status 0. Raises RankFailure when one did not, naming each failed rank with
    its error, when the ranks run past timeout_s (they are killed), or when a rank fails and
    the others have not ended grace_s seconds later (they are killed too)."""
    context = mp.get_context("spawn")
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="ranks-") as errors:
        # A rank runs this very file by path, not this module by name: the package may be
        # loaded under a name only this process knows (a gated copy), the entry may not.
        ranks = [context.Process(target=runpy.run_path, args=(__file__,), daemon=True,
                                 kwargs={"run_name": RANK_RUN_NAME,
                                         "init_globals": {"RANK_CALL": (entry, rank, world_size, port, errors, args)}})
                 for rank in range(world_size)]
        for process in ranks:
            process.start()
        deadline = time.monotonic() + timeout_s
        timed_out = False
        # One liveness check per round: asking twice lets the last rank exit in between, and
        # waiting on no sentinel at all then sleeps until the deadline.
        while alive := [p for p in ranks if p.is_alive()]:
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            multiprocessing.connection.wait([p.sentinel for p in alive], timeout=left)
            if any(p.exitcode not in (None, 0) for p in ranks):
                deadline = min(deadline, time.monotonic() + grace_s)   # survivors get a moment to notice
        for process in ranks:
            if process.is_alive():
                process.kill()
            process.join(timeout=5)
        problems = []
        for rank, process in enumerate(ranks):
            report = Path(errors, str(rank))
            if report.exists():
                problems.append(f"rank {rank}: {report.read_text().splitlines()[0]}")
            elif process.exitcode != 0:
                why = "killed after the deadline" if timed_out or process.exitcode == -9 else \
                    f"exited with status {process.exitcode}"
                problems.append(f"rank {rank}: {why}")
    if timed_out:
        problems.insert(0, f"the ranks ran past the {timeout_s:g} s deadline")
    if problems:
        raise RankFailure("; ".join(problems))


if __name__ == RANK_RUN_NAME:
    _rank_main(*globals()["RANK_CALL"])
