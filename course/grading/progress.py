"""How far an implementation has come: stubs done per chapter, and what to run next.

The reference (solutions/) says which stubs exist; the implementation's own files say
which are done. A stub is done when its body in the implementation is anything other
than the generated raise. Reading files, never importing them, keeps this safe on any
learner's code: a file that no longer parses counts its stubs as not done, with a note.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from course import impl as impl_module
from course import manifest as manifest_module
from course import skeleton
from course.manifest import ROOT, Chapter


@dataclass(frozen=True)
class StubState:
    path: str            # relative to the package root, e.g. "serve/engine.py"
    qualname: str
    chapter: int
    done: bool
    note: str = ""       # why a stub cannot be judged (missing, file does not parse)


@dataclass
class ChapterProgress:
    chapter: Chapter
    stubs: list[StubState] = field(default_factory=list)
    milestone_exists: bool = False

    @property
    def done(self) -> int:
        return sum(s.done for s in self.stubs)

    @property
    def total(self) -> int:
        return len(self.stubs)

    @property
    def complete(self) -> bool:
        return self.done == self.total


def stub_states(source: Path, reference: Path | None = None) -> list[StubState]:
    """The state of every stub of `reference` (default solutions/) in the package at `source`.
    Without solutions/ (a learner's edition) the stub markers in engine/'s docstrings, which
    stay when a stub is filled, say which stubs exist."""
    if reference is None:
        reference = ROOT / "solutions" if (ROOT / "solutions").is_dir() else ROOT / "engine"
    reference = Path(reference)
    source = Path(source)
    states = []
    for rel, stubs in skeleton.stubs_of_tree(reference).items():
        if not stubs:
            continue
        mine, problem = {}, ""
        try:
            text = (source / rel).read_text(encoding="utf-8")
            lines = skeleton.split_lines(text)
            mine = {s.qualname: s.is_filled(lines) for s in skeleton.find_stubs(text, rel)}
        except FileNotFoundError:
            problem = "file missing"
        except (skeleton.SkeletonError, UnicodeDecodeError) as exc:
            problem = f"file does not parse: {str(exc).splitlines()[0]}"
        for stub in stubs:
            note = problem or ("" if stub.qualname in mine else "stub missing")
            states.append(StubState(rel, stub.qualname, stub.chapter, bool(mine.get(stub.qualname)), note))
    return states


def chapters_to_do(source: Path, chapters, upto: int | None = None) -> list[int]:
    """Those of `chapters` with a stub not yet written in the package at `source` (read, not
    imported), in order; with `upto` (NAME@N), every chapter after N counts as not written."""
    open_chapters = {state.chapter for state in stub_states(source)
                     if not state.done or (upto is not None and state.chapter > upto)}
    return [number for number in chapters if number in open_chapters]


def chapters_still_needed(impl, chapters, raised: int | None = None) -> str:
    """"Chapter 42" or "Chapters 39 and 42": those of `chapters` whose stubs the implementation
    `impl` (loaded or parsed) has not all written, with `raised` (the chapter of a stub that
    said it is not written yet); all of `chapters` where nothing else is known."""
    left = sorted({*chapters_to_do(impl.source, chapters, impl.upto), *([raised] if raised else [])}) \
        or list(chapters)
    if len(left) == 1:
        return f"Chapter {left[0]}"
    return "Chapters " + ", ".join(str(n) for n in left[:-1]) + f" and {left[-1]}"


def chapter_progress(spec: str = "engine", manifest=None, reference: Path | None = None,
                     tests_dir: Path | None = None) -> list[ChapterProgress]:
    """One entry per chapter of book.toml, in order."""
    manifest = manifest or manifest_module.load()
    parsed = impl_module.parse(spec)
    tests_dir = Path(tests_dir or ROOT / "tests")
    by_chapter = {c.number: ChapterProgress(c, milestone_exists=(tests_dir / Path(c.milestone).name).is_file())
                  for c in manifest.chapters}
    for state in stub_states(parsed.source, reference):
        if parsed.upto is not None and state.chapter > parsed.upto:      # NAME@N removes these stubs
            state = replace(state, done=False, note=f"removed by @{parsed.upto}")
        by_chapter[state.chapter].stubs.append(state)
    return list(by_chapter.values())


def milestone_command(spec: str, chapter: Chapter) -> str:
    return f"pytest --impl {spec} {chapter.milestone}"


def next_chapter(rows: list[ChapterProgress]) -> ChapterProgress | None:
    """The first chapter, in order, with a stub left to do."""
    return next((row for row in rows if not row.complete), None)


def format_report(spec: str, rows: list[ChapterProgress], show_all: bool = False) -> str:
    """The table `python run.py progress` prints: written chapters and chapters with stubs
    (every chapter with show_all), then what to do next."""
    shown = [r for r in rows if show_all or r.chapter.written or r.total]
    title_width = max((len(r.chapter.title) for r in shown), default=5)
    out = [f"Progress of {spec}", "",
           f"{'ch':>3}  {'title':<{title_width}}  {'status':<8}  {'stubs':>7}  milestone"]
    for row in shown:
        stubs = f"{row.done}/{row.total}" if row.total else "-"
        mark = "done" if row.total and row.complete else ""
        milestone = row.chapter.milestone if row.milestone_exists else "(none yet)"
        out.append(f"{row.chapter.number:>3}  {row.chapter.title:<{title_width}}  {row.chapter.status:<8}  "
                   f"{stubs:>7}  {milestone}  {mark}".rstrip())
    hidden = len(rows) - len(shown)
    if hidden:
        out.append(f"     ... and {hidden} planned chapter(s) with no stubs yet (--all lists them)")
    done = sum(r.done for r in rows)
    total = sum(r.total for r in rows)
    out += ["", f"{done}/{total} stubs done."]
    upcoming = next_chapter(rows)
    if upcoming is None:
        out.append("Every stub is done: run the whole suite with `pytest --impl " + spec + "`.")
        return "\n".join(out)
    chapter = upcoming.chapter
    out.append(f"Next: Chapter {chapter.number}, {chapter.title}. Stubs left:")
    for stub in upcoming.stubs:
        if not stub.done:
            note = f"  ({stub.note})" if stub.note else ""
            out.append(f"  {stub.path}: {stub.qualname}{note}")
    if upcoming.milestone_exists:
        out.append(f"Then run its milestone: {milestone_command(spec, chapter)}")
    return "\n".join(out)
