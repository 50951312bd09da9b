"""Deliberately broken engines, for proving that grading survives whatever a learner's
engine does.

`broken_engine(dest, fault)` copies the reference package into `dest/engine/` (a learner's
checkout as `python run.py grade --impl dest` expects it) with one fault injected into the
engine core of Chapter 31. The fault is appended to the end of one module as a function that
replaces a method, so every stub still counts as done and the rest of the code is the
reference's: whatever fails in grading fails because of the fault.

    hang    Scheduler.schedule never returns (a busy loop in Python)
    raise   Scheduler.schedule raises RuntimeError
    exit    Scheduler.schedule ends the interpreter with os._exit(EXIT_STATUS)
    leak    BlockManager.free keeps each request's last block (never back in the free queue)
"""
from __future__ import annotations

import shutil
import textwrap
from pathlib import Path

from course.manifest import ROOT

EXIT_STATUS = 13
RAISED = "injected fault: the scheduler lost track of its queues"

FAULTS = {
    "hang": ("serve/scheduler.py", """
        def _schedule_forever(self):
            while True:
                pass


        Scheduler.schedule = _schedule_forever
    """),
    "raise": ("serve/scheduler.py", f"""
        def _schedule_raises(self):
            raise RuntimeError({RAISED!r})


        Scheduler.schedule = _schedule_raises
    """),
    "exit": ("serve/scheduler.py", f"""
        def _schedule_exits(self):
            import os
            os._exit({EXIT_STATUS})


        Scheduler.schedule = _schedule_exits
    """),
    "leak": ("serve/blocks.py", """
        _free_everything = BlockManager.free


        def _free_but_the_last(self, request):
            held = self.req_blocks.get(request.request_id)
            if held:
                held.pop()              # dropped from the table, never released: leaked
            _free_everything(self, request)


        BlockManager.free = _free_but_the_last
    """),
}


def broken_engine(dest: Path, fault: str, source: Path | None = None) -> Path:
    """Write a checkout at `dest` whose engine/ is `source` (default: solutions/) with
    `fault` injected. Returns `dest`."""
    if fault not in FAULTS:
        raise ValueError(f"unknown fault {fault!r}; known: {sorted(FAULTS)}")
    dest = Path(dest)
    package = dest / "engine"
    if package.exists():
        shutil.rmtree(package)
    shutil.copytree(Path(source or ROOT / "solutions"), package,
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    module, code = FAULTS[fault]
    target = package / module
    text = target.read_text(encoding="utf-8").rstrip("\n")
    target.write_text(text + f"\n\n\n# --- fault injected by course.grading.faults: {fault} ---\n"
                      + textwrap.dedent(code).lstrip("\n"), encoding="utf-8")
    return dest
