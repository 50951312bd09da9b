"""The mistakes catalogue (course/testing/mistakes/): every entry still applies to the
reference, every stub of a catalogued chapter has at least three mistakes, and one mistake per
chapter is caught, with its rule named, by the tests that cover it. CI runs the whole
catalogue (`python run.py mistakes`)."""
import subprocess
import sys

import pytest

from course.commands.mistakes import MINIMUM_PER_STUB
from course.impl import have_reference
from course.manifest import ROOT
from course.testing import mistakes

pytestmark = pytest.mark.skipif(not have_reference(), reason="the catalogue edits solutions/")

CATALOGUE = mistakes.catalogue()
ENTRIES = [m for entries in CATALOGUE.values() for m in entries]


@pytest.mark.parametrize("mistake", ENTRIES, ids=lambda m: f"{m.file}::{m.stub}::{m.expect}")
def test_each_mistake_applies_to_the_reference(mistake):
    source = (mistakes.REFERENCE / mistake.file).read_text(encoding="utf-8")
    assert mistakes.apply(mistake, source) != source
    assert mistake.rule.strip() and mistake.expect.strip(), f"{mistake.label}: a rule and an expected phrase"


def test_each_mistake_sits_in_its_own_chapters_module():
    stubs = mistakes.reference_stubs()
    misplaced = [f"{m.label} (Chapter {mistakes.chapter_of(m, stubs)}, listed in ch{chapter:02d})"
                 for chapter, entries in CATALOGUE.items() for m in entries
                 if mistakes.chapter_of(m, stubs) != chapter]
    assert not misplaced, "mistakes listed under another chapter: " + "; ".join(misplaced)


def test_every_stub_of_a_catalogued_chapter_has_enough_mistakes():
    stubs = mistakes.reference_stubs()
    counts = {key: 0 for key, stub in stubs.items() if stub.chapter in CATALOGUE}
    for mistake in ENTRIES:
        counts[(mistake.file, mistake.stub)] += 1
    short = [f"{file}::{name} has {n}" for (file, name), n in counts.items() if n < MINIMUM_PER_STUB]
    assert not short, f"each stub needs at least {MINIMUM_PER_STUB} mistakes: " + "; ".join(short)


def test_applying_refuses_a_stale_entry():
    stale = mistakes.Mistake("layers.py", "rms_norm", before="no such text", after="x", rule="r", expect="e")
    with pytest.raises(mistakes.CatalogueError, match="occurs 0 times"):
        mistakes.apply(stale, (mistakes.REFERENCE / "layers.py").read_text(encoding="utf-8"))
    missing = mistakes.Mistake("layers.py", "no_such_stub", before="x", after="y", rule="r", expect="e")
    with pytest.raises(mistakes.CatalogueError, match="no stub"):
        mistakes.apply(missing, (mistakes.REFERENCE / "layers.py").read_text(encoding="utf-8"))


@pytest.mark.timeout(900)        # 43 mistakes one after another: about 2 minutes on an idle core
def test_one_mistake_per_chapter_is_caught_with_its_rule_named():
    run = subprocess.run([sys.executable, "run.py", "mistakes", "--sample", "--jobs", "1"], cwd=ROOT,
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, f"the sample of the mistakes catalogue:\n{run.stdout[-4000:]}\n{run.stderr[-4000:]}"


def test_an_edit_that_does_not_compile_is_refused_by_name():
    broken = mistakes.Mistake("layers.py", "rms_norm", before="return weight * normed", after="return weight *",
                              rule="r", expect="e")
    with pytest.raises(mistakes.CatalogueError, match="does not compile"):
        mistakes.apply(broken, (mistakes.REFERENCE / "layers.py").read_text(encoding="utf-8"))


@pytest.mark.parametrize("log, verdict", [
    ("E   AssertionError: ties go to the pair that sorts first\n", "caught"),
    ("AssertionError: ties go to the pair that sorts first\n  raised at tests/x.py:3\n", "caught"),  # Hypothesis, short
    ("FAILED tests/x.py::t - AssertionError: ties go to the pair that sorts first\n", "caught"),
    ('>       assert merges[1] == pair, "ties go to the pair that sorts first"\nE   assert 1 == 2\n', "unnamed"),
])
def test_a_mistake_counts_as_caught_only_where_a_failure_line_names_the_rule(log, verdict):
    assert mistakes._verdict(1, log, "ties go")[0] == verdict     # the test's source does not count


def test_passing_hanging_and_unrunnable_tests_are_told_apart():
    assert mistakes._verdict(0, "", "x")[0] == "survived"
    assert mistakes._verdict(None, "", "x")[0] == "hung"
    assert mistakes._verdict(4, "ERROR: file not found", "x")[0] == "error"


DECISIONS = mistakes.decisions()


def test_every_stub_says_what_the_learner_decides_there():
    stubs = mistakes.reference_stubs()
    by_chapter: dict[int, set[str]] = {}
    for stub in stubs.values():
        by_chapter.setdefault(stub.chapter, set()).add(stub.qualname)
    unstated = [f"ch{chapter:02d} {name}" for chapter, names in sorted(by_chapter.items()) for name in sorted(names)
                if not DECISIONS.get(chapter, mistakes.Decisions({}, ())).decides.get(name, "").strip()]
    assert not unstated, "stubs with no DECIDES entry (course/testing/mistakes/chNN.py): " + ", ".join(unstated)
    stray = [f"ch{chapter:02d} {name}" for chapter, found in DECISIONS.items()
             for name in [*found.decides, *found.design] if name not in by_chapter.get(chapter, set())]
    assert not stray, "DECIDES or DESIGN names that are not stubs of their chapter: " + ", ".join(stray)


def test_every_chapter_has_a_design_stub():
    chapters = {stub.chapter for stub in mistakes.reference_stubs().values()}
    without = [chapter for chapter in sorted(chapters) if not DECISIONS.get(chapter, mistakes.Decisions({}, ())).design]
    assert not without, f"chapters with no design stub named in DESIGN: {without}"
