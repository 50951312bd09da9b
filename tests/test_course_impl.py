"""Implementation specs, gated copies, and the pytest plugin's options and gating."""
import os
import re
import sys

import pytest

# Imported here, before any in-process pytester run: pytester restores sys.modules after
# each run, and torch's C extension cannot be imported a second time in one process.
import torch  # noqa: F401

from course import impl as impl_module
from course import skeleton
from course.impl import ImplError
from course.manifest import ROOT
from course.pytest_plugin import chapter_of

from conftest import write_tree


def test_a_package_path_loads_under_a_unique_name(fake_package, isolated_cache):
    loaded = impl_module.load(str(fake_package))
    assert loaded.name.startswith("impl_fakepkg_") and loaded.upto is None
    assert loaded.ops.add(1, 2) == 3 and loaded.ops.doubled_sum(1, 2) == 6
    assert loaded.load("sub.deep").add_three(1, 2, 3) == 6
    assert loaded.package.ops is loaded.ops                   # lazy submodules on the package too
    assert impl_module.load(str(fake_package)) is loaded       # one module per spec per process
    with pytest.raises(AttributeError, match="no module or attribute 'nothing'"):
        _ = loaded.nothing


def test_gated_copy_removes_only_later_chapters(fake_package, isolated_cache):
    full = impl_module.load(str(fake_package))
    gated = impl_module.load(f"{fake_package}@1")
    assert gated.name == f"{full.name}_at_1" and gated.upto == 1
    assert gated.root.parent == isolated_cache and gated.source == fake_package.resolve()
    assert gated.ops.add(2, 2) == 4                           # Chapter 1 kept
    with pytest.raises(NotImplementedError, match="Chapter 2: Box.area"):
        gated.ops.Box().area(1, 1)
    with pytest.raises(NotImplementedError, match="Chapter 2: add_three"):
        gated.load("sub.deep").add_three(1, 2, 3)
    assert full.ops.Box().area(2, 3) == 6                     # the full package is untouched
    assert sys.modules[gated.name] is gated.package
    assert impl_module.load(f"{fake_package}@0").name.endswith("_at_0")


def test_a_checkout_root_means_its_engine(tmp_path, isolated_cache):
    write_tree(tmp_path / "alice" / "engine", {"__init__.py": "", "m.py": "X = 7\n"})
    loaded = impl_module.load(str(tmp_path / "alice"))
    assert loaded.m.X == 7 and loaded.name.startswith("impl_alice_")


def test_named_specs_resolve_in_this_checkout():
    spec = impl_module.parse("solutions@8")
    assert spec.source == (ROOT / "solutions").resolve()
    assert spec.module_name == "solutions_at_8" and spec.upto == 8


@pytest.mark.parametrize("spec, message", [
    ("nonsense", "unknown implementation 'nonsense'"),
    ("solutions@99", "outside book.toml's 0-43"),
    ("/no/such/dir@3", "unknown implementation '/no/such/dir'"),
])
def test_unknown_specs_explain_the_accepted_forms(spec, message):
    with pytest.raises(ImplError, match=message):
        impl_module.parse(spec)


def test_reference_is_the_full_solutions_package():
    import course
    reference = course.reference()
    assert reference.name == "solutions" and reference.upto is None
    assert reference.source == (ROOT / "solutions").resolve()


class FakeItem:
    def __init__(self, path, marker=None):
        self.path, self._marker = path, marker

    def get_closest_marker(self, name):
        return self._marker


def test_notebooks_belong_to_their_folders_chapter(tmp_path):
    assert chapter_of(FakeItem(tmp_path / "chapters/05-attention/05-attention.ipynb")) == 5
    assert chapter_of(FakeItem(tmp_path / "tests/test_course_impl.py")) is None


# --- the plugin, in a pytest run of its own ----------------------------------------------

MILESTONES = {
    "test_ch01_fake.py": """
        import pytest
        pytestmark = pytest.mark.chapter(1)

        def test_add(impl):
            assert impl.ops.add(1, 2) == 3

        def test_chapter_two_is_not_there_yet(impl):
            with pytest.raises(NotImplementedError):
                impl.ops.Box().area(1, 1)

        def test_impl_name(impl):
            print("IMPL", impl.spec.text)
    """,
    "test_ch02_fake.py": """
        import pytest
        pytestmark = pytest.mark.chapter(2)

        def test_area(impl):
            assert impl.ops.Box().area(2, 3) == 6
    """,
    "test_machinery.py": """
        def test_runs_without_a_chapter():
            pass
    """,
}


# The course plugin alone: pytester restores sys.modules after every run, so any other
# plugin (nbval above all) would be imported afresh each time, for seconds.
INNER = ("-p", "course.pytest_plugin", "-p", "no:cacheprovider", "-p", "no:nbval", "-p", "no:xdist",
         "-p", "no:hypothesispytest")


@pytest.fixture
def milestone_run(pytester, fake_package, isolated_cache, monkeypatch):
    """Run the fake milestones in-process with the course plugin, the fake package standing
    in for solutions/ so the default (gated) run can be observed."""
    monkeypatch.setitem(impl_module.NAMED, "solutions", fake_package)
    monkeypatch.setattr(impl_module, "_loaded", {})
    for name in [n for n in sys.modules if n.split(".")[0].split("_at_")[0] == "solutions"]:
        monkeypatch.delitem(sys.modules, name)     # the real reference, if loaded; restored after
    for name, text in MILESTONES.items():
        pytester.makepyfile(**{name[:-3]: text})

    def run(*args):
        return pytester.runpytest_inprocess(*INNER, "-s", *args)
    return run


def test_default_run_gates_each_chapter_at_its_own_number(milestone_run):
    result = milestone_run()
    result.assert_outcomes(passed=5)
    result.stdout.fnmatch_lines(["*IMPL solutions@1*"])


def test_an_explicit_impl_applies_to_every_chapter(milestone_run, fake_package):
    # The full package has Chapter 2 done, so Chapter 1's "not there yet" check fails:
    # exactly what gating exists to catch.
    result = milestone_run("--impl", str(fake_package))
    result.assert_outcomes(passed=4, failed=1)
    result = milestone_run("--impl", f"{fake_package}@1", "--chapter", "2")
    result.assert_outcomes(failed=1, deselected=4)


SWALLOWED = """
    import logging
    import pytest
    pytestmark = pytest.mark.chapter(1)

    def serve_both(impl):
        # as the engine does: one request's error is logged with its traceback, the other is served
        served = []
        for work in (lambda: impl.ops.add(1, 2), lambda: impl.ops.Box().area(2, 3)):
            try:
                served.append(work())
            except Exception:
                logging.getLogger("fake.engine").error("a request failed", exc_info=True)
        return served

    def test_looks_only_at_the_first_request(impl):
        assert serve_both(impl)[0] == 3
"""


def test_a_milestone_that_passes_on_a_swallowed_unwritten_stub_fails(milestone_run, pytester, fake_package):
    pytester.makepyfile(test_ch01_swallowed=SWALLOWED)
    result = milestone_run("test_ch01_swallowed.py")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*this test passed, but a request inside it failed on an unwritten stub "
                                 "(Chapter 2's Box.area)*"])
    milestone_run("test_ch01_swallowed.py", "--impl", str(fake_package)).assert_outcomes(passed=1)


def test_chapter_and_upto_select_milestones_only(milestone_run):
    milestone_run("--chapter", "2").assert_outcomes(passed=1, deselected=4)
    milestone_run("--upto", "1").assert_outcomes(passed=3, deselected=2)


def test_bad_options_are_usage_errors(milestone_run):
    result = milestone_run("--impl", "nonsense")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--impl: unknown implementation 'nonsense'*"])
    assert milestone_run("--chapter", "77").ret == pytest.ExitCode.USAGE_ERROR


def test_device_fixture_follows_the_option(pytester):
    pytester.makepyfile(test_dev="""
        def test_device(device, model_path):
            assert device.type == "cpu" and model_path is None
    """)
    result = pytester.runpytest_inprocess(*INNER, "--device", "cpu")
    result.assert_outcomes(passed=1)


def test_a_whole_suite_run_spreads_over_the_cores(pytester, monkeypatch):
    from course.pytest_plugin import _cores
    if _cores() < 2:
        pytest.skip("one core: the run stays serial")
    monkeypatch.delenv("COURSE_SERIAL", raising=False)      # the inner runs inherit the environment
    pytester.makeini("[pytest]\ntestpaths = .\n")
    pytester.makepyfile(test_a="def test_a(): pass", test_b="def test_b(): pass")
    # Each run starts pytest in one process per worker and one more: no plugin it does not need.
    plugins = ("-p", "course.pytest_plugin", "-p", "no:nbval", "-p", "no:cacheprovider",
               "-p", "no:hypothesispytest", "-p", "no:anyio")
    parallel = pytester.runpytest_subprocess(*plugins)
    parallel.assert_outcomes(passed=2)
    parallel.stdout.fnmatch_lines(["*created: * workers*"])
    serial = pytester.runpytest_subprocess(*plugins, "test_a.py")
    assert "workers" not in serial.stdout.str()


def test_gated_copies_are_read_only_keep_line_numbers_and_name_their_source(fake_package, isolated_cache):
    gated = impl_module.load(f"{fake_package}@1")
    copies = [p for p in gated.root.rglob("*.py") if "__pycache__" not in p.parts]
    assert copies and all(p.stat().st_mode & 0o222 == 0 for p in copies), "gated copies must be read-only"
    source_lines = (fake_package / "ops.py").read_text().splitlines()
    copy_lines = (gated.root / "ops.py").read_text().splitlines()
    for text in ("    def name(self):", "def outer():", "def only_doc():"):   # (a docstring-only stub adds a line)
        assert copy_lines.index(text) == source_lines.index(text), f"{text!r} moved in the gated copy"
    assert copy_lines[source_lines.index("        return w * h")].strip().startswith("raise NotImplementedError")
    assert str(fake_package.resolve() / "ops.py") in copy_lines[-1] and "edit that file" in copy_lines[-1]
    assert impl_module.source_of(gated.root / "sub" / "deep.py") == fake_package.resolve() / "sub" / "deep.py"
    assert impl_module.source_of(fake_package / "ops.py") is None


def test_a_read_only_copy_is_still_rewritten_when_its_source_changes(tmp_path):
    target = tmp_path / "copy"
    skeleton.materialize({"m.py": b"X = 1\n"}, target, read_only=True)
    skeleton.materialize({"m.py": b"X = 2\n"}, target, read_only=True)
    assert (target / "m.py").read_bytes() == b"X = 2\n" and not (target / "m.py").stat().st_mode & 0o222


def test_a_failure_in_a_gated_copy_is_reported_at_its_source(milestone_run, fake_package):
    result = milestone_run("--impl", f"{fake_package}@1", "--chapter", "2")
    result.assert_outcomes(failed=1, deselected=4)
    line = (fake_package / "ops.py").read_text().splitlines().index("        return w * h") + 1
    output = result.stdout.str()
    # An unwritten stub is reported in one line, at the source file (not the gated copy).
    assert re.search(rf"not implemented yet: .*fakepkg[/\\]ops\.py:{line}\b", output), output
    assert "_at_1" + os.sep + "ops.py" not in output


HYPOTHESIS_FAILURES = """
    import pytest
    from hypothesis import given, settings, strategies as st
    from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

    @pytest.fixture
    def limit():
        return 10

    @settings(database=None, derandomize=True)
    @given(n=st.integers(0, 100))
    def test_numbers(limit, n):
        assert n < limit, f"the rule: {n} must stay below {limit}"

    class Counter(RuleBasedStateMachine):
        count = 0

        @rule(by=st.integers(1, 3))
        def add(self, by):
            self.count += by

        @invariant()
        def small(self):
            assert self.count < 5, f"the count reached {self.count}"

    def test_machine():
        run_state_machine_as_test(Counter, settings=settings(database=None, derandomize=True))
"""


def test_a_hypothesis_failure_is_its_rule_and_its_case_not_pages_of_trace(pytester):
    pytester.makepyfile(test_props=HYPOTHESIS_FAILURES)
    short = pytester.runpytest_inprocess(*INNER)
    short.assert_outcomes(failed=2)
    output = short.stdout.str()
    short.stdout.fnmatch_lines([
        "AssertionError: the rule: 10 must stay below 10",          # shrunk to the smallest failing n
        "  raised at test_props.py:* (test_numbers)",
        "The failing case Hypothesis found, shrunk for at most 20 s (--stress shrinks it for longer):",
        "    test_numbers(", "        n=10,", "    )",
        "AssertionError: the count reached *",
        "The failing case Hypothesis found, shrunk for at most 20 s (--stress shrinks it for longer):",
        "    state = Counter()", "    state.add(by=*)", "    state.add(by=*)", "    state.teardown()",
    ])
    assert "limit=" not in output, "a fixture is not part of the case"
    assert "+  where" not in output and "state.small()" not in output and "def test_numbers" not in output
    full = pytester.runpytest_inprocess(*INNER, "--tb=long")
    assert "def test_numbers" in full.stdout.str(), "--tb=long keeps the whole traceback"


def test_a_notebook_hears_of_edits_its_kernel_has_not_imported(fake_package, isolated_cache, monkeypatch, capsys):
    from course import notebook
    loaded = notebook.load_impl(str(fake_package))
    assert loaded.ops.add(1, 2) == 3 and capsys.readouterr().out == ""
    ops = fake_package / "ops.py"
    ops.write_text(ops.read_text().replace("total = a + b", "total = a + b + 100"))
    os.utime(ops, (loaded.loaded_at + 5, loaded.loaded_at + 5))
    assert notebook.load_impl(str(fake_package)).ops.add(1, 2) == 3        # the old code still runs
    assert "ops.py changed after this kernel imported fakepkg/" in capsys.readouterr().out
    assert notebook.reload_impl(str(fake_package)).ops.add(1, 2) == 103
