"""A class's gradebook: three checkouts (complete, half done, broken) graded at once, one
CSV row per learner and one JSON line per learner and chapter."""
import csv
import json

import pytest

from course import manifest
from course.grading import gradebook

from conftest import write_tree

STUB = 'raise NotImplementedError("Your engine: Chapter {n}: {name}")'


def ops(add: str, mul: str) -> dict[str, str]:
    return {"__init__.py": "", "ops.py": f'''
        def add(a, b):
            """(Your engine: Chapter 1)"""
            {add}


        def mul(a, b):
            """(Your engine: Chapter 2)"""
            {mul}
    '''}


def milestone(number: int, body: str) -> tuple[str, str]:
    name = manifest.load().chapter(number).milestone.split("/")[-1]
    return name, f"""
        import pytest
        pytestmark = pytest.mark.chapter({number})

        def test_it(impl):
            {body}

        def test_again(impl):
            {body}
    """


@pytest.fixture
def classroom(tmp_path):
    reference = write_tree(tmp_path / "reference", ops("return a + b", "return a * b"))
    tests_dir = write_tree(tmp_path / "milestones", dict([milestone(1, "assert impl.ops.add(2, 3) == 5"),
                                                          milestone(2, "assert impl.ops.mul(2, 3) == 6")]))
    submissions = tmp_path / "submissions"
    write_tree(submissions / "ada" / "engine", ops("return a + b", "return a * b"))
    write_tree(submissions / "bob" / "engine", ops("return a + b", STUB.format(n=2, name="mul")))
    write_tree(submissions / "cy" / "engine", {"__init__.py": "", "ops.py": "def add(a, b) return\n"})
    (submissions / "notes").mkdir()                      # not a checkout: ignored
    return reference, tests_dir, submissions


def test_a_folder_of_checkouts_gives_one_gradebook(classroom, tmp_path):
    reference, tests_dir, submissions = classroom
    seen = []
    results = gradebook.grade_checkouts(submissions, on_learner=lambda i, n, name: seen.append((i, n, name)),
                                        upto=2, tests_dir=tests_dir, reference=reference, test_timeout=30,
                                        chapter_timeout=120, jobs=2)
    assert seen == [(0, 3, "ada"), (1, 3, "bob"), (2, 3, "cy")]
    gradebook.write_gradebook(results, tmp_path / "book.csv", tmp_path / "book.jsonl")

    table = list(csv.DictReader((tmp_path / "book.csv").open()))
    by_learner = {row["learner"]: row for row in table}
    assert list(by_learner) == ["ada", "bob", "cy"]
    row = by_learner["ada"]
    assert (row["ch01"], row["ch02"], row["stubs_done"]) == ("2/2", "2/2", "2")
    row = by_learner["bob"]
    assert (row["ch01"], row["ch02"], row["stubs_done"]) == ("2/2", "0/2", "1")
    assert by_learner["cy"]["milestones_passed"] == "0" and by_learner["cy"]["ch01"].startswith("0/")

    lines = [json.loads(line) for line in (tmp_path / "book.jsonl").read_text().splitlines()]
    assert [(r["learner"], r["chapter"]) for r in lines] == [(n, c) for n in ("ada", "bob", "cy") for c in (1, 2)]
    assert {r["status"] for r in lines if r["learner"] == "ada"} == {"passed"}


def test_a_folder_without_checkouts_is_refused(tmp_path):
    with pytest.raises(ValueError, match="holds no checkout"):
        gradebook.learner_checkouts(tmp_path)


def test_criteria_that_need_a_gpu_are_blocked_in_the_gradebook(tmp_path):
    """A milestone skipped for want of a GPU is neither passed nor failed nor merely skipped:
    the gradebook says BLOCKED, in the CSV cell, its own column and the JSON line."""
    from course.grading import grade
    chapter = manifest.load().chapter(14)
    tests = [grade.TestResult("t::test_cpu", "passed"), grade.TestResult("t::test_timeline", "blocked", "needs a GPU"),
             grade.TestResult("t::test_slow", "skipped", "run with --stress")]
    report = grade.GradeReport("engine", "engine", [grade.ChapterGrade(chapter, "t.py", 1, 1, tests)], 60, 600)
    gradebook.write_gradebook([("ada", report)], tmp_path / "book.csv", tmp_path / "book.jsonl")
    row = next(csv.DictReader((tmp_path / "book.csv").open()))
    assert (row["ch14"], row["milestones_total"], row["milestones_blocked"]) == ("1/1 +1 blocked", "1", "1")
    line = json.loads((tmp_path / "book.jsonl").read_text())
    assert (line["passed"], line["blocked"], line["skipped"], line["total"]) == (1, 1, 1, 1)
    assert line["status"] == "passed, 1 blocked (need a GPU)"
