"""GitHub Classroom's autograding file is generated from book.toml and kept in step with it."""
import json

from course import manifest
from course.grading import classroom
from course.manifest import ROOT


def test_the_autograding_file_matches_book_toml():
    path = ROOT / classroom.PATH
    assert path.is_file(), f"{classroom.PATH} is missing: run `python run.py classroom`"
    assert path.read_text(encoding="utf-8") == classroom.render(), (
        f"{classroom.PATH} is stale: run `python run.py classroom` after editing book.toml or adding a milestone")


def test_one_test_per_written_chapter_milestone_with_points():
    tests = json.loads((ROOT / classroom.PATH).read_text(encoding="utf-8"))["tests"]
    expected = [c for c in manifest.load().chapters if c.written and (ROOT / c.milestone).is_file()]
    assert [t["name"] for t in tests] == [f"Chapter {c.number}: {c.title}" for c in expected]
    for test, chapter in zip(tests, expected):
        assert test["run"].endswith(f"--impl engine {chapter.milestone}")
        assert test["points"] > 0 and test["timeout"] > 0 and test["comparison"] == "included"
    assert tests[0]["setup"] and not any(t["setup"] for t in tests[1:]), "install once, in the first test"
