"""Grading survives a deliberately broken engine: a hang costs one test, a dead
interpreter costs one test, a hang nothing can interrupt costs the chapter, a process a
test leaves behind ends with its chapter; the report, the JSON and the JUnit file always
come out."""
import json
import os
import time
import xml.etree.ElementTree as ET

import pytest

from course import manifest
from course.grading import grade

from conftest import write_tree

# The reference the stub counts compare against, and an engine that fills every stub in
# the worst ways an engine can.
REFERENCE = {
    "__init__.py": "",
    "ops.py": '''
        def add(a, b):
            """(Your engine: Chapter 1)"""
            return a + b


        def spin():
            """(Your engine: Chapter 1)"""
            return 0


        def die():
            """(Your engine: Chapter 2)"""
            return 0


        def crash():
            """(Your engine: Chapter 3)"""
            return 0


        def stuck():
            """(Your engine: Chapter 3)"""
            return 0
    ''',
}

BROKEN = {
    "__init__.py": "",
    "ops.py": '''
        def add(a, b):
            """(Your engine: Chapter 1)"""
            return a + b


        def spin():
            """(Your engine: Chapter 1)"""
            while True:                          # an infinite loop in Python code
                pass


        def die():
            """(Your engine: Chapter 2)"""
            import os
            os._exit(3)                          # the interpreter vanishes, no report written


        def crash():
            """(Your engine: Chapter 3)"""
            import ctypes
            return ctypes.string_at(0)           # a segfault


        def stuck():
            """(Your engine: Chapter 3)"""
            import signal
            import time
            # pytest-timeout's SIGALRM can't interrupt this. Blocking it in this thread alone is
            # not enough: a process-directed signal goes to any thread that does not block it
            # (torch, imported at start-up on a CUDA machine, starts threads), and Python then
            # runs the handler here all the same. Ignoring it holds whatever threads exist.
            signal.signal(signal.SIGALRM, signal.SIG_IGN)
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
            while True:
                time.sleep(0.05)
    ''',
}

# The per-test limit: a passing test here takes milliseconds, so a busy machine stays far
# below it; the hanging one (spin) hits it whatever the machine, and holds a core that long.
TEST_TIMEOUT = 2

CHAPTERS = {number: manifest.load().chapter(number) for number in (1, 2, 3)}


def milestone_name(number):
    return CHAPTERS[number].milestone.split("/")[-1]


MILESTONES = {
    milestone_name(1): """
        import pytest
        pytestmark = pytest.mark.chapter(1)

        def test_add(impl):
            assert impl.ops.add(2, 3) == 5

        def test_spin(impl):
            assert impl.ops.spin() == 0

        def test_add_again(impl):
            assert impl.ops.add(1, 1) == 2
    """,
    milestone_name(2): """
        import pytest
        pytestmark = pytest.mark.chapter(2)

        def test_before(impl):
            assert impl.ops.add(0, 0) == 0

        def test_die(impl):
            assert impl.ops.die() == 0

        def test_after(impl):
            assert impl.ops.add(4, 4) == 8

        @pytest.mark.skip(reason="needs a GPU")
        def test_gpu_only(impl):
            pass

        @pytest.mark.skip(reason="no CUDA (or ROCm) device here")
        def test_cuda_only(impl):
            pass

        @pytest.mark.skip(reason="slow: run with --stress")
        def test_stress_only(impl):
            pass
    """,
    milestone_name(3): """
        import pytest
        pytestmark = pytest.mark.chapter(3)

        def test_crash(impl):
            assert impl.ops.crash() == 0

        def test_fine(impl):
            assert impl.ops.add(1, 2) == 4, "1 + 2 should be 3"
    """,
}


@pytest.fixture
def setup(tmp_path):
    reference = write_tree(tmp_path / "reference", REFERENCE)
    engine = write_tree(tmp_path / "learner" / "engine", BROKEN)
    tests_dir = write_tree(tmp_path / "milestones", MILESTONES)
    return reference, engine, tests_dir


def test_a_broken_engine_costs_tests_never_the_report(setup, tmp_path):
    reference, engine, tests_dir = setup
    report = grade.grade(str(tmp_path / "learner"), upto=3, tests_dir=tests_dir, reference=reference,
                         test_timeout=TEST_TIMEOUT, chapter_timeout=120, jobs=3)
    by_number = {c.chapter.number: c for c in report.chapters}
    outcomes = {n: {t.name: (t.outcome, t.message) for t in c.tests} for n, c in by_number.items()}

    one = outcomes[1]
    assert one["test_add"][0] == one["test_add_again"][0] == "passed"
    assert one["test_spin"][0] == "failed" and "Timeout" in one["test_spin"][1]

    two = outcomes[2]
    assert two["test_before"][0] == two["test_after"][0] == "passed"     # run again after the death
    assert two["test_die"] == ("failed", "the test process exited abruptly with status 3 (os._exit?) "
                                         "during this test")
    # A criterion that needs a GPU is BLOCKED on this machine (neither passed nor failed); a
    # skip for any other reason stays a skip.
    assert two["test_gpu_only"] == ("blocked", "needs a GPU")
    assert two["test_cuda_only"] == ("blocked", "no CUDA (or ROCm) device here")
    assert two["test_stress_only"] == ("skipped", "slow: run with --stress")
    assert (by_number[2].passed, by_number[2].total, by_number[2].blocked) == (2, 3, 2)

    three = outcomes[3]
    assert three["test_crash"] == ("failed", "the test process was killed by SIGSEGV during this test")
    assert three["test_fine"][0] == "failed" and "1 + 2 should be 3" in three["test_fine"][1]
    assert by_number[3].status == "failed"

    assert [c.status for c in report.chapters] == ["partial", "partial", "failed"]
    assert all((c.stubs_done, c.stubs_total) == ((2, 2) if c.chapter.number != 2 else (1, 1))
               for c in report.chapters)

    table = grade.format_table(report)
    assert "2/3+2b" in table and "SIGSEGV" in table and "status 3" in table
    assert "2 milestone(s) blocked" in table and "need a GPU" in table

    data = grade.to_json(report)
    json.dumps(data)
    assert data["totals"]["passed"] == 4 and data["totals"]["failed"] == 4
    assert (data["totals"]["blocked"], data["totals"]["skipped"], data["chapters"][1]["blocked"]) == (2, 1, 2)
    assert data["chapters"][1]["notes"] == ["the test process exited abruptly with status 3 (os._exit?) "
                                            "during test_die"]
    junit = tmp_path / "grade.xml"
    grade.to_junit(report).write(junit)
    suites = ET.parse(junit).getroot()
    assert suites.get("failures") == "4" and len(suites.findall("testsuite")) == 3
    assert len(suites.findall(".//testcase/failure")) == 4 and len(suites.findall(".//skipped")) == 3
    assert len(suites.findall(".//skipped[@type='blocked']")) == 2


def test_a_hang_no_timeout_can_interrupt_costs_the_chapter(setup, tmp_path):
    reference, engine, tests_dir = setup
    milestone = write_tree(tmp_path / "stuck", {milestone_name(3): """
        import pytest
        pytestmark = pytest.mark.chapter(3)

        def test_stuck(impl):
            impl.ops.stuck()

        def test_never_reached(impl):
            pass
    """}) / milestone_name(3)
    # The per-test limit must not fire in test_stuck's setup (then test_never_reached would
    # run and pass); the chapter limit is the one that has to end the hang, and it is all the
    # hang costs, so it leaves pytest's start-up and the per-test limit a margin and no more.
    tests, notes, _ = grade.run_milestone(str(engine), milestone, test_timeout=2, chapter_timeout=5)
    assert tests and all(t.outcome == "failed" for t in tests)
    assert notes and "time limit (5s) ran out" in notes[0]


def test_processes_a_test_leaves_behind_end_with_its_chapter(setup, tmp_path):
    """A milestone that starts a child and passes (think of an engine's worker stuck in a hung
    step): the child must not outlive the grading of its chapter."""
    reference, engine, tests_dir = setup
    pid_file = tmp_path / "child.pid"
    milestone = write_tree(tmp_path / "spawns", {milestone_name(1): f"""
        import subprocess, sys
        import pytest
        pytestmark = pytest.mark.chapter(1)

        def test_starts_a_worker(impl):
            worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
            open({str(pid_file)!r}, "w").write(str(worker.pid))
    """}) / milestone_name(1)
    tests, notes, _ = grade.run_milestone(str(engine), milestone, test_timeout=TEST_TIMEOUT, chapter_timeout=120)
    assert [t.outcome for t in tests] == ["passed"] and not notes
    child = int(pid_file.read_text())
    for _ in range(100):                     # SIGKILL is sent; give the kernel a moment to act on it
        if not _running(child):
            break
        time.sleep(0.05)
    assert not _running(child), "the test's child outlived the grading of its chapter"


def _running(pid):
    """Whether pid names a live process (a zombie waiting to be reaped has ended)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = f"/proc/{pid}/stat"
    if os.path.exists(stat):
        with open(stat) as handle:
            return handle.read().rpartition(")")[2].split()[0] != "Z"
    return True


def test_grade_command_writes_json_and_junit(setup, tmp_path):
    import subprocess
    import sys

    from course.manifest import ROOT
    reference, engine, tests_dir = setup
    # A Chapter 1 milestone that fails without hanging: the command costs its start-up only.
    # The fake reference is irrelevant to the exit code.
    quick = write_tree(tmp_path / "quick", {milestone_name(1): """
        import pytest
        pytestmark = pytest.mark.chapter(1)

        def test_add(impl):
            assert impl.ops.add(2, 3) == 5

        def test_add_wrong(impl):
            assert impl.ops.add(1, 1) == 3

        def test_add_again(impl):
            assert impl.ops.add(1, 1) == 2
    """})
    out = subprocess.run([sys.executable, str(ROOT / "run.py"), "grade", "--impl", str(engine),
                          "--chapter", "1", "--tests-dir", str(quick), "--test-timeout", str(TEST_TIMEOUT),
                          "--json", str(tmp_path / "g.json"), "--junit", str(tmp_path / "g.xml")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 1, out.stderr
    assert "The engine you will build" in out.stdout
    data = json.loads((tmp_path / "g.json").read_text())
    assert [(c["number"], c["passed"], c["total"]) for c in data["chapters"]] == [(1, 2, 3)]
    suites = ET.parse(tmp_path / "g.xml").getroot()
    assert (suites.get("tests"), suites.get("failures")) == ("3", "1")
