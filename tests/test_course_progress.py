"""Progress: stubs done per chapter judged from files alone, and the next step named."""
import pytest

from course import manifest, skeleton
from course.grading import progress


@pytest.fixture
def learner(fake_package, tmp_path):
    engine = tmp_path / "learner" / "engine"
    skeleton.write_skeleton(fake_package, engine, known_chapters={1, 2, 3})
    return engine


def rows_for(engine, reference, tmp_path):
    return {r.chapter.number: r for r in progress.chapter_progress(
        str(engine), reference=reference, tests_dir=tmp_path / "no-tests")}


def test_counts_follow_the_bodies(learner, fake_package, tmp_path):
    rows = rows_for(learner, fake_package, tmp_path)
    assert [(rows[n].done, rows[n].total) for n in (1, 2, 3)] == [(0, 1), (0, 3), (0, 2)]
    ops = learner / "ops.py"
    ops.write_text(ops.read_text().replace(
        'raise NotImplementedError("Your engine: Chapter 1: add")', "return a + b"))
    rows = rows_for(learner, fake_package, tmp_path)
    assert (rows[1].done, rows[1].total) == (1, 1) and rows[1].complete
    assert progress.next_chapter(list(rows.values())).chapter.number == 2
    report = progress.format_report("engine", list(rows.values()))
    assert "Next: Chapter 2, The cost of a token. Stubs left:" in report
    assert "  ops.py: Box.area" in report and "  sub/deep.py: add_three" in report
    assert "1/6 stubs done." in report


def test_the_reference_is_complete(fake_package, tmp_path):
    rows = rows_for(fake_package, fake_package, tmp_path)
    assert all(r.complete for r in rows.values())
    assert "Every stub is done" in progress.format_report("x", list(rows.values()))


def test_a_broken_file_counts_as_not_done_with_a_note(learner, fake_package, tmp_path):
    (learner / "ops.py").write_text("def add(a, b:\n")
    (learner / "sub" / "deep.py").unlink()
    states = progress.stub_states(learner, fake_package)
    notes = {s.qualname: s.note for s in states}
    assert not any(s.done for s in states)
    assert notes["add"].startswith("file does not parse") and notes["add_three"] == "file missing"


def test_milestone_command_names_the_chapter_file():
    chapter = manifest.load().chapter(5)
    assert progress.milestone_command("engine", chapter) == "pytest --impl engine tests/test_ch05_attention.py"


def test_a_gated_implementation_counts_later_stubs_as_not_done():
    """solutions@4 is a learner who finished Chapter 4: chapters after it have nothing done."""
    rows = {row.chapter.number: row for row in progress.chapter_progress("solutions@4")}
    assert all(rows[n].complete for n in range(1, 5))
    assert rows[5].total and rows[5].done == 0, "Chapter 5's stubs are removed by @4"
    assert all(row.done == 0 for n, row in rows.items() if n > 4)
