""".ci/gpu-checks, the GPU machine's one command (issue 28), cannot rot where CI has no GPU:
its --dry-run checks every step's command on the CPU (options parsed, test files collected,
inline Python compiled) and its time limits add up to less than the lease's 9 minutes; the
bench's kernel-bandwidth line, which only a GPU prints, is computed here interpreted."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from course import bench
from course.impl import load

ROOT = Path(__file__).resolve().parents[1]
LEASE_S = 9 * 60
# What the GPU run must cover (issue 28, item 4), by step name.
REQUIRED_STEPS = {"ch32", "ch33", "ch33-overlap", "ch19-ch30", "ch40", "ch40-devices", "bench-0.6b"}


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None,
                    reason="the GPU script is bash with coreutils' timeout")
def test_gpu_checks_dry_run_checks_every_step_on_the_cpu(tmp_path):
    done = subprocess.run(["bash", str(ROOT / ".ci" / "gpu-checks"), "--dry-run"], capture_output=True, text=True,
                          timeout=180, env={**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable})
    assert done.returncode == 0, f".ci/gpu-checks --dry-run failed: a step's command no longer works\n" \
                                 f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    planned = dict(line.split("\t", 1) for line in (tmp_path / "planned-steps.txt").read_text().splitlines())
    missing = REQUIRED_STEPS - planned.keys()
    assert not missing, f"the GPU run no longer covers {sorted(missing)}"
    assert all("--device cuda" in planned[name] for name in REQUIRED_STEPS - {"ch40-devices"}), \
        "every GPU step runs on cuda"
    limits = next(line for line in done.stdout.splitlines() if line.startswith("dry run:") and "limits" in line)
    total = int(limits.split("limits ")[1].split("s")[0])
    assert total < LEASE_S, f"the steps' limits add up to {total}s: one lease runs at most {LEASE_S}s"


def test_kernel_bandwidth_counts_every_key_and_value_read():
    pytest.importorskip("triton")
    shape = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, hidden_size=64)
    line = bench.kernel_bandwidth(load("solutions"), torch.device("cpu"), shape, requests=2, context=20, rounds=1)
    moved = (2 * 2 * 20 * 2 + 2 * 2 * 4) * 16 * 4            # K and V of every context, q in, out
    assert line["bytes_moved"] == moved, "a decode step's attention reads every key and value once"
    assert line["median_us"] > 0
