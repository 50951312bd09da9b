"""The mistakes catalogue: plausible learner mistakes, each a small edit of one stub of the
reference, and the machinery that proves the milestones catch every one of them.

A `Mistake` names a stub (its file in the package and its qualified name), a piece of text
of that stub's body and what a learner might have written instead, the rule the edit breaks
(in the chapter's words), the tests that must catch it, and a phrase their failure report
must contain: a mistake counts as caught only when a covering test fails AND says which rule
broke, so "some assertion somewhere" is not enough.

The catalogue lives in one module per chapter, `course/testing/mistakes/chNN.py`, each with
a `MISTAKES` list, a `DECIDES` table ({stub's qualified name: what the learner must decide
there, one sentence}) and `DESIGN` (the chapter's design stubs: those where the learner
chooses a data structure, an algorithm or where state lives, not only a formula).
`python run.py mistakes` runs the catalogue (CI runs all of it); `--table` lists every stub
with what the learner decides there. The suite checks that every entry still applies to the
reference, that every stub states its decision and every chapter has a design stub, and runs
one mistake per chapter (tests/test_course_mistakes.py).

How a mistake is run: the reference package is copied to a temporary directory, the edit is
applied inside the stub's body only, and pytest runs the covering tests with `--impl` pointing
at the copy (not gated: later chapters' code stays, so a later chapter's test may catch an
earlier stub's mistake). The oracles still come from the untouched reference. The runner
imports torch, transformers and pytest once and forks a child per mistake, so a mistake costs
its tests' time, not an interpreter's start-up.
"""
from __future__ import annotations

import importlib
import os
import pkgutil
import re
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from ...manifest import ROOT
from ...skeleton import Stub, find_stubs, split_lines

REFERENCE = ROOT / "solutions"
CHILD_TIMEOUT = 240.0           # seconds one mistake's tests may take before it counts as hung
TEST_TIMEOUT = 120              # pytest-timeout per test inside a child


@dataclass(frozen=True)
class Mistake:
    """One plausible mistake in one stub.

    file:    the stub's module, relative to the package ("bpe.py", "serve/engine.py").
    stub:    its qualified name ("train_bpe", "BlockManager.allocate_slots").
    before:  text that occurs exactly once in the stub's body (docstring excluded).
    after:   what the learner wrote instead (keeps the code runnable: no syntax errors).
    rule:    the rule the mistake breaks, one sentence in the chapter's words.
    expect:  a phrase (case-insensitive) that a failure line of the covering tests (pytest's
             "E   " lines: the assertion and its message) must contain, naming that rule.
    tests:   pytest arguments selecting the covering tests (paths, node ids, "-k", expr);
             empty means the stub's chapter's milestone file.
    """
    file: str
    stub: str
    before: str
    after: str
    rule: str
    expect: str
    tests: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        return f"{self.file}::{self.stub}: {self.rule}"


@dataclass
class Outcome:
    """What running one mistake gave. verdict: caught, survived (the tests passed), unnamed
    (they failed without naming the rule), hung (past CHILD_TIMEOUT) or error (pytest could
    not run them: usage error, nothing collected)."""
    mistake: Mistake
    chapter: int
    verdict: str
    seconds: float
    message: str = ""
    log: str = field(default="", repr=False)

    @property
    def ok(self) -> bool:
        return self.verdict == "caught"


class CatalogueError(ValueError):
    """An entry of the catalogue that no longer applies to the reference."""


# --- the catalogue ---------------------------------------------------------------------------
def catalogue() -> dict[int, list[Mistake]]:
    """{chapter: its mistakes}, from every chNN module of this package."""
    found: dict[int, list[Mistake]] = {}
    for info in pkgutil.iter_modules(__path__):
        match = re.fullmatch(r"ch(\d\d)", info.name)
        if match:
            module = importlib.import_module(f"{__name__}.{info.name}")
            found[int(match.group(1))] = list(module.MISTAKES)
    return dict(sorted(found.items()))


@dataclass(frozen=True)
class Decisions:
    """A chapter's stubs in the learner's terms: DECIDES and DESIGN of its chNN module."""
    decides: dict[str, str]
    design: tuple[str, ...]


def decisions() -> dict[int, Decisions]:
    """{chapter: its Decisions}, from every chNN module of this package (empty where absent)."""
    found = {}
    for chapter in catalogue():
        module = importlib.import_module(f"{__name__}.ch{chapter:02d}")
        found[chapter] = Decisions(dict(getattr(module, "DECIDES", {})), tuple(getattr(module, "DESIGN", ())))
    return found


def reference_stubs(root: Path = REFERENCE) -> dict[tuple[str, str], Stub]:
    """{(file, qualified name): stub} of a package tree."""
    stubs = {}
    for path in sorted(root.rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        rel = path.relative_to(root).as_posix()
        for stub in find_stubs(path.read_text(encoding="utf-8"), rel):
            stubs[(rel, stub.qualname)] = stub
    return stubs


def apply(mistake: Mistake, source: str) -> str:
    """`source` (the text of the mistake's file) with the mistake made in its stub's body.
    Raises CatalogueError when the stub is gone or `before` is not exactly once in its body."""
    lines = split_lines(source)
    stubs = {s.qualname: s for s in find_stubs(source, mistake.file)}
    stub = stubs.get(mistake.stub)
    if stub is None:
        raise CatalogueError(f"{mistake.label}: no stub {mistake.stub} in {mistake.file}")
    body = stub.body(lines)
    count = body.count(mistake.before)
    if count != 1:
        raise CatalogueError(f"{mistake.label}: {mistake.before!r} occurs {count} times in the body, not once")
    if mistake.before == mistake.after:
        raise CatalogueError(f"{mistake.label}: 'after' equals 'before'")
    head, tail = "".join(lines[:stub.body_start]), "".join(lines[stub.body_end:])
    mutated = head + body.replace(mistake.before, mistake.after) + tail
    try:
        compile(mutated, mistake.file, "exec")
    except SyntaxError as exc:
        raise CatalogueError(f"{mistake.label}: the edit does not compile: {exc}") from None
    return mutated


def chapter_of(mistake: Mistake, stubs: dict[tuple[str, str], Stub]) -> int:
    stub = stubs.get((mistake.file, mistake.stub))
    if stub is None:
        raise CatalogueError(f"{mistake.label}: no stub {mistake.stub} in {mistake.file}")
    return stub.chapter


def milestone_file(chapter: int) -> str:
    found = sorted((ROOT / "tests").glob(f"test_ch{chapter:02d}_*.py"))
    if not found:
        raise CatalogueError(f"Chapter {chapter} has no milestone file in tests/")
    return found[0].relative_to(ROOT).as_posix()


def test_arguments(mistake: Mistake, chapter: int) -> list[str]:
    return list(mistake.tests) or [milestone_file(chapter)]


def mutant_package(mistake: Mistake, directory: Path, reference: Path = REFERENCE) -> Path:
    """Write the reference with the mistake made into directory/<name>/; return that path."""
    target = directory / "mutant"
    shutil.copytree(reference, target, ignore=shutil.ignore_patterns("__pycache__"))
    path = target / mistake.file
    path.write_text(apply(mistake, path.read_text(encoding="utf-8")), encoding="utf-8")
    return target


# --- running it --------------------------------------------------------------------------------
def _warm_imports() -> None:
    """What every child needs, imported once in the parent (fork shares it)."""
    import torch
    torch.set_num_threads(1)
    # As the pytest plugin does (on the default device): Triton reads this when it is
    # imported, and transformers below imports it, before any child's pytest starts.
    if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"
    import hypothesis  # noqa: F401
    import nbval.plugin  # noqa: F401      pytest loads it in every child (through nbformat: 0.3 s)
    import pytest  # noqa: F401
    import transformers  # noqa: F401
    from transformers.models.qwen3 import modeling_qwen3  # noqa: F401

    from ... import pytest_plugin  # noqa: F401


def _child(arguments: list[str], log: Path) -> None:
    """In the forked child: run pytest with output to `log`, exit with its status."""
    os.setsid()                                     # its own group: a hang is killed whole
    descriptor = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(descriptor, 1)
    os.dup2(descriptor, 2)
    os.chdir(ROOT)
    status = 3
    try:
        import pytest
        status = int(pytest.main(arguments))
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


# The lines of a pytest report that say why a test failed, never the test's source: pytest's
# "E   " lines, the plugin's short Hypothesis report ("AssertionError: ..." at the margin) and
# the summary's "FAILED node - message" lines.
_FAILURE_LINE = re.compile(r"^(E |FAILED |[A-Za-z_.]*(Error|Exception|Failed): )")


def _verdict(status: int | None, log: str, expect: str) -> tuple[str, str]:
    failures = [line.removeprefix("E ").strip() for line in log.splitlines() if _FAILURE_LINE.match(line)]
    named = [line for line in failures if expect.lower() in line.lower()]
    if status is None:
        return "hung", f"no result after {CHILD_TIMEOUT:.0f} s"
    if status == 0:
        return "survived", "every covering test passed"
    if status == 1:
        if named:
            return "caught", named[0][:200]
        return "unnamed", (failures or ["(no assertion line)"])[0][:200]
    return "error", f"pytest exit status {status}: " + (failures or [log.strip()[-200:]])[0][:200]


def run(mistakes: list[Mistake], jobs: int = 2, progress=None) -> list[Outcome]:
    """Run every mistake, `jobs` at a time; outcomes in the order given."""
    stubs = reference_stubs()
    _warm_imports()
    scratch = Path(tempfile.mkdtemp(prefix="mistakes-"))
    pending = list(enumerate(mistakes))
    running: dict[int, tuple[int, float, Path]] = {}      # pid -> (index, started, log)
    outcomes: dict[int, Outcome] = {}
    try:
        while pending or running:
            while pending and len(running) < jobs:
                index, mistake = pending.pop(0)
                directory = scratch / f"m{index:04d}"
                directory.mkdir()
                try:
                    chapter = chapter_of(mistake, stubs)
                    package = mutant_package(mistake, directory)
                except CatalogueError as exc:                     # a broken entry fails alone
                    outcomes[index] = Outcome(mistake, 0, "error", 0.0, f"the entry does not apply: {exc}")
                    if progress is not None:
                        progress(outcomes[index])
                    continue
                log = directory / "pytest.log"
                arguments = [*test_arguments(mistake, chapter), "--impl", str(package), "-x", "-q",
                             "-p", "no:cacheprovider", "-p", "no:xdist", "--timeout", str(TEST_TIMEOUT),
                             "--no-header", "-o", "console_output_style=classic"]
                pid = os.fork()
                if pid == 0:
                    _child(arguments, log)
                running[pid] = (index, time.monotonic(), log)
            finished = _reap(running)
            for pid, status in finished:
                index, started, log = running.pop(pid)
                mistake = mistakes[index]
                text = log.read_text(encoding="utf-8", errors="replace") if log.exists() else ""
                verdict, message = _verdict(status, text, mistake.expect)
                outcome = Outcome(mistake, chapter_of(mistake, stubs), verdict,
                                  time.monotonic() - started, message, text)
                outcomes[index] = outcome
                if progress is not None:
                    progress(outcome)
            if not finished:
                time.sleep(0.05)
    finally:
        for pid in running:
            _kill(pid)
        shutil.rmtree(scratch, ignore_errors=True)
    return [outcomes[i] for i in range(len(mistakes))]


def _reap(running: dict[int, tuple[int, float, Path]]) -> list[tuple[int, int | None]]:
    """Children that ended (pid, exit status) or ran past CHILD_TIMEOUT (pid, None: killed)."""
    done: list[tuple[int, int | None]] = []
    for pid, (_, started, _) in list(running.items()):
        waited, status = os.waitpid(pid, os.WNOHANG)
        if waited == pid:
            done.append((pid, os.waitstatus_to_exitcode(status)))
        elif time.monotonic() - started > CHILD_TIMEOUT:
            _kill(pid)
            done.append((pid, None))
    return done


def _kill(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass


def sample() -> list[Mistake]:
    """One mistake per catalogued chapter (its first): what the README's suite runs."""
    return [mistakes[0] for mistakes in catalogue().values() if mistakes]
