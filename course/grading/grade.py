"""Grading: run an implementation's milestones chapter by chapter and report.

Each chapter's milestone file runs in its own pytest subprocess, with pytest-timeout
bounding every test and a wall-clock limit bounding the chapter. The subprocess records
each test as it happens (course.grading.recorder), so whatever the engine under test does,
the report survives:

- a test that loops forever fails by its per-test timeout; the chapter goes on;
- a test that kills the interpreter (os._exit, a segfault, running out of memory) fails
  with that reason, and the chapter is run again without the tests already decided, so
  one crash costs one test;
- a chapter that exceeds its limit (a hang the per-test timeout cannot interrupt) is
  killed; the test that was running and every test not yet run fail with that reason.

Nothing here imports the implementation: it is only ever run in the subprocesses.
"""
from __future__ import annotations

import itertools
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from course import impl as impl_module
from course import manifest as manifest_module
from course.grading import progress
from course.manifest import ROOT, Chapter

DEFAULT_TEST_TIMEOUT = 120.0
DEFAULT_CHAPTER_TIMEOUT = 900.0
# A skip whose reason says the test needs a GPU ("needs a CUDA device", "CUDA graphs need
# --device cuda", "no CUDA (or ROCm) device here"): on this machine the criterion can be
# neither passed nor failed, so it is reported as BLOCKED, not as skipped (which reads as
# "does not apply") nor as failed (which would blame the engine).
NEEDS_A_GPU = re.compile(r"\bneeds?\b[^.;:]*\b(GPU|CUDA|ROCm)\b|\bno (GPU|CUDA|ROCm|MPS)\b|--device (cuda|mps)\b",
                         re.IGNORECASE)


@dataclass
class TestResult:
    nodeid: str
    outcome: str                    # "passed", "failed", "skipped" or "blocked" (needs a GPU)
    message: str = ""
    duration: float = 0.0

    @property
    def name(self) -> str:
        return self.nodeid.rpartition("::")[2] or self.nodeid


@dataclass
class ChapterGrade:
    chapter: Chapter
    milestone: str | None           # the file that was run, None when the chapter has none
    stubs_done: int
    stubs_total: int
    tests: list[TestResult] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    duration: float = 0.0
    log_tail: str = ""

    def count(self, outcome: str) -> int:
        return sum(t.outcome == outcome for t in self.tests)

    @property
    def passed(self) -> int:
        return self.count("passed")

    @property
    def failed(self) -> int:
        return self.count("failed")

    @property
    def total(self) -> int:
        """Milestones that count: skipped and blocked ones (a GPU-only test on a CPU) do not."""
        return self.passed + self.failed

    @property
    def blocked(self) -> int:
        """Milestones this machine cannot decide: they need a GPU it does not have."""
        return self.count("blocked")

    @property
    def status(self) -> str:
        if self.milestone is None:
            return "no milestone"
        if self.total == 0:
            return "blocked (needs a GPU)" if self.blocked else "no tests ran"
        if self.failed == 0:
            return "passed" + (f", {self.blocked} blocked (need a GPU)" if self.blocked else "")
        return "failed" if self.passed == 0 else "partial"


@dataclass
class GradeReport:
    spec: str
    source: str
    chapters: list[ChapterGrade]
    test_timeout: float
    chapter_timeout: float
    duration: float = 0.0

    @property
    def all_passed(self) -> bool:
        return all(c.failed == 0 for c in self.chapters if c.milestone)


# --- running one chapter ---------------------------------------------------------------------

def _death(returncode: int) -> str:
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"the test process was killed by {name}"
    return f"the test process exited abruptly with status {returncode} (os._exit?)"


def _read_record(path: Path) -> list[dict]:
    if not path.exists():
        return []
    events = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            break                   # a line cut short by the process dying mid-write
    return events


def _pytest_command(spec: str, milestone: Path, test_timeout: float, skip: list[str]) -> list[str]:
    return [sys.executable, "-m", "pytest", str(milestone),
            "-c", str(ROOT / "pytest.ini"), "--rootdir", str(ROOT),
            "-o", "addopts=",               # no notebooks, no xdist: just this file
            "-p", "course.pytest_plugin", "-p", "course.grading.recorder",
            # Plugins no milestone needs, whose imports cost more than pytest's own start-up:
            # nbval (seconds), hypothesis's (its whole package, at the end of every run: @given
            # works without it) and anyio's (trio).
            "-p", "no:cacheprovider", "-p", "no:nbval", "-p", "no:hypothesispytest", "-p", "no:anyio",
            "-q", "--impl", spec, f"--timeout={test_timeout:g}",
            *[f"--deselect={nodeid}" for nodeid in skip]]


def run_milestone(spec: str, milestone: Path, test_timeout: float = DEFAULT_TEST_TIMEOUT,
                  chapter_timeout: float = DEFAULT_CHAPTER_TIMEOUT) -> tuple[list[TestResult], list[str], str]:
    """Run one milestone file against `spec`. Returns (tests, notes, log tail); never raises
    for anything the code under test does."""
    deadline = time.monotonic() + chapter_timeout
    results: dict[str, TestResult] = {}
    order: list[str] = []
    notes: list[str] = []
    log_tail = ""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    with tempfile.TemporaryDirectory(prefix="course-grade-") as scratch:
        for attempt in itertools.count(1):   # ends: each rerun decides at least one test
            record, log = Path(scratch) / f"record{attempt}.jsonl", Path(scratch) / f"log{attempt}.txt"
            env["COURSE_GRADE_RECORD"] = str(record)
            with open(log, "wb") as log_handle:
                process = subprocess.Popen(_pytest_command(spec, milestone, test_timeout, list(results)),
                                           cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=log_handle,
                                           stderr=subprocess.STDOUT, start_new_session=True)
                timed_out = False
                try:
                    process.wait(timeout=max(deadline - time.monotonic(), 0.1))
                except subprocess.TimeoutExpired:
                    timed_out = True
                _end_session(process.pid)
                process.wait()
            events = _read_record(record)
            running = None
            for event in events:
                kind = event["event"]
                if kind == "collected" and not order:
                    order = event["nodeids"]
                elif kind == "collect_error":
                    results[event["nodeid"] or str(milestone)] = TestResult(
                        event["nodeid"] or str(milestone), "failed", f"collection failed: {event['message']}")
                elif kind == "start":
                    running = event["nodeid"]
                elif kind == "phase":
                    _merge_phase(results, event)
            if any(e["event"] == "finished" for e in events):
                break
            log_tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:])
            if timed_out:
                reason = f"the chapter's time limit ({chapter_timeout:g}s) ran out"
            else:
                reason = _death(process.returncode)
            if running is None:
                notes.append(f"{reason} before any test ran")
                break
            results[running] = TestResult(running, "failed", f"{reason} during this test")
            notes.append(f"{reason} during {running.rpartition('::')[2]}")
            if timed_out or not set(order) - results.keys():
                break
    for nodeid in order:                    # anything never reached fails, saying why
        if nodeid not in results:
            results[nodeid] = TestResult(nodeid, "failed", f"not run: {notes[-1] if notes else 'unknown'}")
    if not results and notes:
        results[str(milestone)] = TestResult(str(milestone), "failed", notes[-1])
    ordered = [results.pop(n) for n in order if n in results] + list(results.values())
    return ordered, notes, log_tail


def _end_session(group: int) -> None:
    """Kill every process left in pytest's session, pytest included if it still runs.

    The code under test may start children (an engine's workers, a command a test runs);
    one stuck in a hung engine would outlive the test that started it, and the grading run.
    """
    try:
        os.killpg(group, signal.SIGKILL)
    except ProcessLookupError:               # pytest ended and left nothing behind
        pass


def _merge_phase(results: dict[str, TestResult], event: dict) -> None:
    """Fold one phase (setup, call, teardown) into the test's result: a failure anywhere
    fails the test, a skip skips it unless something failed."""
    nodeid, outcome = event["nodeid"], event["outcome"]
    current = results.get(nodeid)
    message = event["message"]
    if outcome == "skipped":
        message = message.removeprefix("Skipped: ")
        if NEEDS_A_GPU.search(message):
            outcome = "blocked"
    elif event["when"] != "call":
        message = f"{event['when']}: {message}"        # the fixture, not the test body, failed
    if current is None:
        results[nodeid] = TestResult(nodeid, outcome, message if outcome != "passed" else "",
                                     event["duration"])
    elif outcome in ("failed", "blocked") and current.outcome != "failed":
        results[nodeid] = TestResult(nodeid, "failed", message, current.duration + event["duration"])
    else:
        current.duration += event["duration"]


# --- the whole grade -------------------------------------------------------------------------

def grade(spec: str, upto: int | None = None, chapters: list[int] | None = None,
          tests_dir: Path | None = None, reference: Path | None = None,
          test_timeout: float = DEFAULT_TEST_TIMEOUT, chapter_timeout: float = DEFAULT_CHAPTER_TIMEOUT,
          jobs: int = 1, manifest=None, on_chapter=None) -> GradeReport:
    """Grade `spec` on every chapter that has a milestone file (optionally only chapters
    <= upto, or only `chapters`). `on_chapter(ChapterGrade)` is called as each finishes."""
    started = time.monotonic()
    manifest = manifest or manifest_module.load()
    parsed = impl_module.parse(spec)
    # The subprocesses may run elsewhere in the tree: hand them an absolute path.
    run_spec = spec if parsed.source in {p.resolve() for p in impl_module.NAMED.values()} else (
        str(parsed.source) + (f"@{parsed.upto}" if parsed.upto is not None else ""))
    tests_dir = Path(tests_dir or ROOT / "tests")
    stub_rows = {row.chapter.number: row for row in
                 progress.chapter_progress(spec, manifest=manifest, reference=reference, tests_dir=tests_dir)}
    selected = [c for c in manifest.chapters
                if (upto is None or c.number <= upto) and (not chapters or c.number in chapters)]

    def one(chapter: Chapter) -> ChapterGrade:
        row = stub_rows[chapter.number]
        milestone = tests_dir / Path(chapter.milestone).name
        result = ChapterGrade(chapter, milestone=str(milestone) if milestone.is_file() else None,
                              stubs_done=row.done, stubs_total=row.total)
        if result.milestone:
            began = time.monotonic()
            result.tests, result.notes, result.log_tail = run_milestone(
                run_spec, milestone, test_timeout, chapter_timeout)
            result.duration = time.monotonic() - began
        if on_chapter:
            on_chapter(result)
        return result

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        graded = list(pool.map(one, selected))
    return GradeReport(spec=spec, source=str(parsed.source), chapters=graded, test_timeout=test_timeout,
                       chapter_timeout=chapter_timeout, duration=time.monotonic() - started)


# --- reports ---------------------------------------------------------------------------------

def format_table(report: GradeReport, failures: int = 5) -> str:
    """The per-chapter table, then up to `failures` failed tests per chapter."""
    rows = [c for c in report.chapters if c.milestone or c.stubs_total]
    title_width = max((len(c.chapter.title) for c in rows), default=5)
    out = [f"Grade of {report.spec} ({report.source})",
           f"per-test limit {report.test_timeout:g}s, per-chapter limit {report.chapter_timeout:g}s", "",
           f"{'ch':>3}  {'title':<{title_width}}  {'milestones':>10}  {'stubs':>7}  status"]
    for c in rows:
        milestones = (f"{c.passed}/{c.total}" + (f"+{c.blocked}b" if c.blocked else "")) if c.milestone else "-"
        stubs = f"{c.stubs_done}/{c.stubs_total}" if c.stubs_total else "-"
        status = c.status + (f" ({'; '.join(c.notes)})" if c.notes else "")
        out.append(f"{c.chapter.number:>3}  {c.chapter.title:<{title_width}}  {milestones:>10}  {stubs:>7}  {status}")
    graded = [c for c in report.chapters if c.milestone]
    passed = sum(c.passed for c in graded)
    total = sum(c.total for c in graded)
    blocked = sum(c.blocked for c in graded)
    out += ["", f"{passed}/{total} milestones passed in {len(graded)} chapter(s); "
                f"{sum(c.stubs_done for c in report.chapters)}/{sum(c.stubs_total for c in report.chapters)} "
                f"stubs done; {report.duration:.1f}s"]
    if blocked:
        out.append(f"{blocked} milestone(s) blocked (+Nb above): they need a GPU this machine does not have; "
                   f"they count neither as passed nor as failed")
    if failures:
        lines = []
        for c in graded:
            failed = [t for t in c.tests if t.outcome == "failed"]
            lines += [f"  ch{c.chapter.number:02d} {t.name}: {t.message[:200]}" for t in failed[:failures]]
            if len(failed) > failures:
                lines.append(f"  ch{c.chapter.number:02d} ... and {len(failed) - failures} more")
        if lines:
            out += ["", "Failed milestones (first few per chapter; --json has all):"] + lines
    return "\n".join(out)


def to_json(report: GradeReport) -> dict:
    return {
        "impl": report.spec, "source": report.source, "duration_s": round(report.duration, 3),
        "test_timeout_s": report.test_timeout, "chapter_timeout_s": report.chapter_timeout,
        "totals": {"passed": sum(c.passed for c in report.chapters),
                   "failed": sum(c.failed for c in report.chapters),
                   "skipped": sum(c.count("skipped") for c in report.chapters),
                   "blocked": sum(c.blocked for c in report.chapters),
                   "stubs_done": sum(c.stubs_done for c in report.chapters),
                   "stubs_total": sum(c.stubs_total for c in report.chapters)},
        "chapters": [{
            "number": c.chapter.number, "slug": c.chapter.slug, "title": c.chapter.title,
            "part": c.chapter.part, "book_status": c.chapter.status, "milestone": c.milestone,
            "status": c.status, "passed": c.passed, "failed": c.failed, "skipped": c.count("skipped"),
            "blocked": c.blocked, "total": c.total, "stubs_done": c.stubs_done, "stubs_total": c.stubs_total,
            "duration_s": round(c.duration, 3), "notes": c.notes, "log_tail": c.log_tail,
            "tests": [asdict(t) for t in c.tests],
        } for c in report.chapters],
    }


def to_junit(report: GradeReport) -> ET.ElementTree:
    """One <testsuite> per graded chapter, one <testcase> per milestone test."""
    graded = [c for c in report.chapters if c.milestone]
    suites = ET.Element("testsuites", name=f"course grade: {report.spec}",
                        tests=str(sum(len(c.tests) for c in graded)),
                        failures=str(sum(c.failed for c in graded)), time=f"{report.duration:.3f}")
    for c in graded:
        suite = ET.SubElement(suites, "testsuite", name=f"ch{c.chapter.number:02d} {c.chapter.title}",
                              tests=str(len(c.tests)), failures=str(c.failed),
                              skipped=str(c.count("skipped") + c.blocked), errors="0", time=f"{c.duration:.3f}")
        properties = ET.SubElement(suite, "properties")
        ET.SubElement(properties, "property", name="stubs", value=f"{c.stubs_done}/{c.stubs_total}")
        for test in c.tests:
            module, _, name = test.nodeid.rpartition("::")
            case = ET.SubElement(suite, "testcase", classname=Path(module.split("::")[0]).stem or "milestone",
                                 name=name or test.nodeid, time=f"{test.duration:.3f}")
            if test.outcome == "failed":
                ET.SubElement(case, "failure", message=test.message[:500]).text = test.message
            elif test.outcome == "skipped":
                ET.SubElement(case, "skipped", message=test.message[:500])
            elif test.outcome == "blocked":             # JUnit has no such outcome: a skip that says so
                ET.SubElement(case, "skipped", type="blocked", message=f"blocked: {test.message}"[:500])
    ET.indent(suites)
    return ET.ElementTree(suites)
