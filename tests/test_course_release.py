"""`python run.py release DIR`: the learner's edition has no solutions/ and still works."""
import pytest

from course import release
from course.manifest import ROOT

from conftest import write_tree


def test_the_edition_leaves_out_the_answers_and_keeps_what_a_learner_needs(tmp_path):
    dest = tmp_path / "edition"
    files = {str(f) for f in release.write_release(dest)}
    assert not (dest / "solutions").exists() and not any(f.startswith("solutions/") for f in files)
    for needed in ("run.py", "book.toml", "README.md", "requirements.txt", "pytest.ini", "pyproject.toml",
                   "engine/__init__.py", "course/__init__.py", "tests/conftest.py"):
        assert (dest / needed).is_file(), f"the edition lacks {needed}"
    assert any(f.startswith("chapters/") and f.endswith(".ipynb") for f in files)
    # The edition's own course/ answers its imports, not this repository's.
    collected = release._pytest(dest, "--collect-only", "-q", "tests/test_ch01_the_engine_you_will_build.py",
                                timeout=120)
    assert collected.returncode == 0, collected.stdout[-2000:]
    assert "tests collected" in collected.stdout or "test_count_matches_transformers" in collected.stdout


def test_refuses_a_folder_that_is_not_empty_or_inside_the_repository(tmp_path):
    (tmp_path / "old.txt").write_text("learner's work")
    with pytest.raises(release.ReleaseError, match="not empty"):
        release.write_release(tmp_path)
    with pytest.raises(release.ReleaseError, match="inside the repository"):
        release.write_release(ROOT / "build" / "edition")


def test_an_unwritten_stub_fails_as_not_implemented_yet(pytester):
    pytester.makepyfile(test_stub="""
        def count():
            raise NotImplementedError("Your engine: Chapter 1: count_parameters")

        def test_count():
            assert count() == 3
    """)
    result = pytester.runpytest("-p", "course.pytest_plugin", "-p", "no:nbval", "-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*not implemented yet: Your engine: Chapter 1: count_parameters"
                                 " (the stub: test_stub.py:2)*"])
    assert "Traceback" not in result.stdout.str() and "raise NotImplementedError" not in result.stdout.str()


def test_without_the_reference_an_oracle_says_so_in_one_line(pytester, monkeypatch, tmp_path):
    from course import impl as impl_module
    monkeypatch.setitem(impl_module.NAMED, "solutions", tmp_path / "no-solutions")
    pytester.makepyfile(test_oracle="""
        import course

        def test_against_the_reference():
            course.reference()
    """)
    result = pytester.runpytest("-p", "course.pytest_plugin", "-p", "no:nbval", "-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["cannot run here: this oracle compares with the reference engine (solutions/)*"])


def test_progress_without_the_reference_reads_the_markers_in_engine(tmp_path, monkeypatch):
    from course import progress
    write_tree(tmp_path, {"engine/__init__.py": "", "engine/ops.py": '''
        def add(a, b):
            """(Your engine: Chapter 1)"""
            return a + b


        def mul(a, b):
            """(Your engine: Chapter 2)"""
            raise NotImplementedError("Your engine: Chapter 2: mul")
    '''})
    monkeypatch.setattr(progress, "ROOT", tmp_path)
    states = {s.qualname: s.done for s in progress.stub_states(tmp_path / "engine")}
    assert states == {"add": True, "mul": False}


def test_a_check_cell_without_the_reference_reports_that_it_ran(monkeypatch, tmp_path):
    from course import impl as impl_module
    from course.notebook import check
    monkeypatch.setitem(impl_module.NAMED, "solutions", tmp_path / "no-solutions")
    result = check(lambda impl: 2 + 3, impl=impl_module.load("engine"), name="add")
    assert result.status == "unchecked" and not result and result.value == 5
    assert repr(result).startswith("[RAN] add: no reference here")
