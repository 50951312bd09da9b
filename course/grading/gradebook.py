"""A class's gradebook: grade a folder of learners' checkouts, one report each.

`grade_checkouts(folder)` grades every checkout (each subfolder holding an engine/) with
course.grading.grade, which runs every chapter of every learner in its own subprocesses, so one
learner's hang or crash costs that learner's tests only. `write_gradebook` writes:
- a CSV with a row per learner and a column per graded chapter ("passed/total", then
  "+N blocked" when N milestones need a GPU the grading machine lacks), plus milestones
  passed, blocked and stubs done over all chapters;
- a JSON Lines file with one line per learner and chapter (passed, failed, skipped, blocked,
  total, stubs done/total, status, notes).
"""
from __future__ import annotations

import csv
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from course.grading import grade as grade_module


def learner_checkouts(folder: Path) -> list[Path]:
    """The learners' checkouts in folder: its subfolders with an engine/ package, by name."""
    found = sorted(p for p in Path(folder).iterdir() if (p / "engine" / "__init__.py").is_file())
    if not found:
        raise ValueError(f"{folder} holds no checkout (a subfolder with engine/__init__.py)")
    return found


def grade_checkouts(folder: Path, on_learner: Callable[[int, int, str], None] | None = None,
                    **grade_options: Any) -> list[tuple[str, grade_module.GradeReport]]:
    """(learner name, GradeReport) for every checkout in folder, in name order.
    grade_options go to course.grading.grade.grade (upto, chapters, tests_dir, timeouts, jobs, ...);
    on_learner(index, count, name) is called before each learner (a progress bar)."""
    checkouts = learner_checkouts(folder)
    results = []
    for index, checkout in enumerate(checkouts):
        if on_learner:
            on_learner(index, len(checkouts), checkout.name)
        results.append((checkout.name, grade_module.grade(str(checkout.resolve()), **grade_options)))
    return results


def progress_bar(index: int, count: int, name: str, width: int = 30) -> None:
    """One line on stderr, redrawn in place: [#####.....] 2/5 alice."""
    filled = width * index // count
    print(f"\r[{'#' * filled}{'.' * (width - filled)}] {index + 1}/{count} {name:<30}", end="",
          file=sys.stderr, flush=True)


def rows(results: list[tuple[str, grade_module.GradeReport]]) -> list[dict[str, Any]]:
    """One dict per learner and chapter, the JSON Lines records."""
    out = []
    for learner, report in results:
        for c in report.chapters:
            if not (c.milestone or c.stubs_total):
                continue
            out.append({"learner": learner, "chapter": c.chapter.number, "slug": c.chapter.slug,
                        "status": c.status, "passed": c.passed, "failed": c.failed,
                        "skipped": c.count("skipped"), "blocked": c.blocked, "total": c.total,
                        "stubs_done": c.stubs_done,
                        "stubs_total": c.stubs_total, "notes": c.notes})
    return out


def write_gradebook(results: list[tuple[str, grade_module.GradeReport]], csv_path: Path,
                    jsonl_path: Path) -> None:
    records = rows(results)
    chapters = sorted({r["chapter"] for r in records})
    with open(csv_path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(["learner", *[f"ch{n:02d}" for n in chapters], "milestones_passed", "milestones_total",
                         "milestones_blocked", "stubs_done", "stubs_total"])
        for learner, _ in results:
            mine = {r["chapter"]: r for r in records if r["learner"] == learner}
            cells = [f"{mine[n]['passed']}/{mine[n]['total']}" + (f" +{mine[n]['blocked']} blocked"
                                                                  if mine[n]["blocked"] else "")
                     if n in mine else "" for n in chapters]
            writer.writerow([learner, *cells, sum(r["passed"] for r in mine.values()),
                             sum(r["total"] for r in mine.values()),
                             sum(r["blocked"] for r in mine.values()),
                             sum(r["stubs_done"] for r in mine.values()),
                             sum(r["stubs_total"] for r in mine.values())])
    with open(jsonl_path, "w", encoding="utf-8") as handle:
        for record in records:
            handle.write(json.dumps(record) + "\n")
