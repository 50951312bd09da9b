"""`python run.py release DIR`: the learner's edition has no solutions/ and still works."""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from course import notebook, release
from course.manifest import ROOT
from course.testing import oracle_records

from conftest import write_tree

# Fast milestones whose oracles are recorded answers of the reference (solo generate through
# transformers' twin, recorded generate); the edition in the fixture records just these.
PROOF = ("tests/test_ch16_kv_cache.py::test_greedy_cached_equals_recompute",
         "tests/test_ch31_engine_v2.py::test_five_requests_match_solo_generate")


# A quick notebook whose checks the fixture's edition records, and then runs twice.
NOTEBOOK = ("04-",)


@pytest.fixture(scope="module")
def edition(tmp_path_factory):
    dest = tmp_path_factory.mktemp("release") / "edition"
    return dest, {str(f) for f in release.write_release(dest, record=PROOF, notebooks=NOTEBOOK)}


def test_the_edition_leaves_out_the_answers_and_keeps_what_a_learner_needs(edition):
    dest, files = edition
    assert not (dest / "solutions").exists() and not any(f.startswith("solutions/") for f in files)
    for needed in ("run.py", "book.toml", "README.md", "requirements.txt", "pytest.ini", "pyproject.toml",
                   "engine/__init__.py", "course/__init__.py", "tests/conftest.py"):
        assert (dest / needed).is_file(), f"the edition lacks {needed}"
    assert any(f.startswith("chapters/") and f.endswith(".ipynb") for f in files)
    records = oracle_records.read_stores(dest / oracle_records.RECORDS_DIR)
    assert records and all(entry["test"].startswith(PROOF) for entry in records.values())


def test_an_edition_replays_the_references_answers_without_solutions(edition):
    """The notebook runs to its end on the bare engine (its checks say NOT IMPLEMENTED YET);
    then, with the reference as engine/, the milestones pass and every check line is the
    full course's. The edition's own course/ answers its imports (release._edition_env)."""
    dest, _ = edition
    problems, not_yet = release.verify_bare_notebooks(dest, notebooks=NOTEBOOK)
    assert not problems and not_yet > 0, problems
    results = release.verify_release(dest, selection=PROOF + (
        "tests/test_ch01_the_engine_you_will_build.py::test_count_is_an_int_and_builds_nothing",))
    assert not (dest / "solutions").exists()
    assert set(results) == {1, 16, 31} and all(failed == 0 and passed for passed, failed in results.values()), results
    problems, matched = release.verify_reference_notebooks(dest, notebooks=NOTEBOOK)
    assert not problems and matched > 0, problems


def test_refuses_a_folder_that_is_not_empty_or_inside_the_repository(tmp_path):
    (tmp_path / "old.txt").write_text("learner's work")
    with pytest.raises(release.ReleaseError, match="not empty"):
        release.write_release(tmp_path, record=None)
    with pytest.raises(release.ReleaseError, match="inside the repository"):
        release.write_release(ROOT / "build" / "edition", record=None)


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


def test_a_skip_that_names_an_unwritten_stub_keeps_its_own_reason(pytester):
    """A milestone that skips because its model needs chapters not written yet (SmolLM2 on a
    bare engine) stays a skip with its reason, which -rs can list."""
    pytester.makepyfile(test_skip="""
        import pytest

        pytestmark = pytest.mark.chapter(41)

        def test_needs_smollm2():
            pytest.skip("SmolLM2 runs on your engine once you have done Chapter 39 "
                        "(Your engine: Chapter 39: GGUFFile._read_tables is not written yet)")
    """)
    result = pytester.runpytest("-p", "course.pytest_plugin", "-p", "no:nbval", "-p", "no:cacheprovider", "-rs")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["SKIPPED*SmolLM2 runs on your engine once you have done Chapter 39*"])


def test_a_stub_behind_another_failure_is_reported_in_one_line_too(pytester):
    """A milestone run on an engine whose stubs are unwritten shows one line per test, not a
    page of dependent failures, however the stub's NotImplementedError reaches the test:
    caught by pytest.raises(RuntimeError), chained behind another error, one of Hypothesis's
    grouped failures, a command's one-line error, an engine thread's traceback."""
    pytester.makepyfile(test_stubs="""
        import sys
        import pytest

        pytestmark = pytest.mark.chapter(33)

        def settle():
            raise NotImplementedError("Your engine: Chapter 33: settle_token")

        def test_caught_as_a_runtime_error():
            with pytest.raises(RuntimeError, match="placeholder"):
                settle()

        def test_chained():
            try:
                settle()
            except NotImplementedError as exc:
                raise RuntimeError("the interpreter failed") from exc

        def test_grouped():
            try:
                settle()
            except NotImplementedError as exc:
                raise ExceptionGroup("2 distinct failures", [ValueError("later"), exc])

        def test_a_command():
            print("run.py core: error: engine is not complete yet: Your engine: Chapter 31: EngineCore.step",
                  file=sys.stderr)
            assert 2 == 0

        def test_a_dead_thread():
            print("Traceback ...\\nNotImplementedError: Your engine: Chapter 38: EngineLoop.run_once", file=sys.stderr)
            {}["choices"]
    """)
    result = pytester.runpytest("-p", "course.pytest_plugin", "-p", "no:nbval", "-p", "no:cacheprovider")
    result.assert_outcomes(failed=5)
    settle = "*not implemented yet: Your engine: Chapter 33: settle_token (the stub: test_stubs.py:7)"
    result.stdout.fnmatch_lines([settle] * 3 + ["*not implemented yet: Your engine: Chapter 31: EngineCore.step",
                                                "*not implemented yet: Your engine: Chapter 38: EngineLoop.run_once"])
    shown = result.stdout.str()
    assert "Traceback" not in shown and "AssertionError" not in shown and "Captured" not in shown, shown


def test_without_the_reference_an_oracle_says_so_in_one_line(pytester, monkeypatch, tmp_path):
    from course import impl as impl_module
    monkeypatch.setitem(impl_module.NAMED, "solutions", tmp_path / "no-solutions")
    pytester.makepyfile(test_oracle="""
        import course
        import pytest

        pytestmark = pytest.mark.chapter(1)

        def test_against_the_reference():
            course.reference()
    """)
    result = pytester.runpytest("-p", "course.pytest_plugin", "-p", "no:nbval", "-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["cannot run here: this oracle compares with the course's reference engine, "
                                 "which a learner's edition leaves out*"])


def test_progress_without_the_reference_reads_the_markers_in_engine(tmp_path, monkeypatch):
    from course.grading import progress
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


def _without_reference(monkeypatch, tmp_path, answers):
    from course import impl as impl_module
    monkeypatch.setitem(impl_module.NAMED, "solutions", tmp_path / "no-solutions")
    monkeypatch.setattr(notebook, "_answers", answers)
    monkeypatch.chdir(tmp_path)
    return impl_module.load("engine")


def test_a_check_without_a_recorded_answer_reports_that_it_ran(monkeypatch, tmp_path):
    from course.notebook import check
    engine = _without_reference(monkeypatch, tmp_path, {})
    result = check(lambda impl: 2 + 3, impl=engine, name="add")
    assert result.status == "unchecked" and not result and result.value == 5
    assert repr(result).startswith("[RAN] add: this edition has no recorded answer")


def test_an_edition_check_judges_by_the_recorded_answer(monkeypatch, tmp_path):
    """Same name and inputs: the recorded answer decides, whatever `expected` the cell computes
    (in an edition that is often the learner's own engine), even one that fails."""
    import torch
    x = torch.arange(4.0)
    key = notebook._check_key("double", (x,), {})
    answers = {"": {key: {"label": "double", "line": "", "value": oracle_records.encode(x * 2)}}}
    engine = _without_reference(monkeypatch, tmp_path, answers)
    assert repr(notebook.check(lambda impl, t: t * 2, x, impl=engine, name="double")) == "[PASS] double"
    wrong = notebook.check(lambda impl, t: t * 3, x, impl=engine, name="double", expected=x * 3)
    assert repr(wrong).startswith("[FAIL] double: max abs difference 3 at (3,)")
    for lazy in (lambda: x * 5, lambda: engine.layers.rms_norm(x, x, 1e-6)):   # wrong, or not written yet
        assert notebook.check(lambda impl, t: t * 2, x, impl=engine, name="double", expected=lazy).status == "pass"

    def unwritten(impl, t):
        raise NotImplementedError("Your engine: Chapter 4: rms_norm")
    assert repr(notebook.check(unwritten, x, impl=engine, name="double")) == \
        "[NOT IMPLEMENTED YET] double: fill in rms_norm (Chapter 4)"


def test_a_checks_key_follows_the_data_its_function_reads():
    """A lambda's inputs often live in the notebook's globals: new random numbers there (a
    re-run cell) must not meet the answer recorded for the old ones."""
    import torch

    from course import notebook
    namespace = {"torch": torch, "xs": torch.zeros(3)}
    target = eval("lambda impl: impl.f(xs, torch.ones(2))", namespace)
    first = notebook._check_key("f", (), {}, target)
    namespace["xs"] = torch.ones(3)
    assert notebook._check_key("f", (), {}, target) != first
    namespace["xs"] = torch.zeros(3)
    assert notebook._check_key("f", (), {}, target) == first


def test_in_an_edition_a_cell_that_needs_an_unwritten_stub_says_so_and_the_notebook_goes_on(capsys):
    """EditionGuard: NotImplementedError (then any error of a later cell) becomes one line and
    the cell counts as run, from the statement after the install on; before a stub stopped a
    cell, other errors stay errors; the last expression is still displayed."""
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    try:
        assert not shell.run_cell("1 / 0").success            # no guard yet
        install = ("from course.notebook import EditionGuard\nEditionGuard.install()\n"
                   "def f():\n    raise NotImplementedError('Your engine: Chapter 3: f')\n"
                   "assert not EditionGuard.cut_short\nmade = f()\nprint('after')")
        assert shell.run_cell(install).success
        assert shell.run_cell("a = 1\na + 1").result == 2
        assert shell.run_cell("made + 1").success
        shown = capsys.readouterr().out
        assert "[NOT IMPLEMENTED YET] this cell stopped: fill in f (Chapter 3)" in shown and "after" not in shown
        assert "NameError: name 'made' is not defined, likely because an earlier cell stopped (fill in f" in shown
    finally:
        from course.notebook import EditionGuard
        EditionGuard.cut_short = ""
        InteractiveShell.clear_instance()


def test_commands_default_to_the_engine_where_there_is_no_reference(monkeypatch):
    import argparse

    from course import cli
    from course import impl as impl_module
    monkeypatch.setattr(impl_module, "have_reference", lambda: False)
    parser = argparse.ArgumentParser()
    cli.add_impl_argument(parser)
    assert parser.parse_args([]).impl == "engine" and "solutions" not in parser.format_help()


def test_the_editions_text_points_at_engine_not_solutions():
    text = ('ref = load_impl("solutions")            # the reference engine\n'
            "This chapter builds `solutions/bpe.py` and `solutions/server/`.\nref = course.reference()\n")
    edited = release.edition_text(text)
    assert "solutions" not in edited
    assert 'ref = load_impl("engine")\n' in edited and "`engine/bpe.py` and `engine/server/`" in edited


def test_a_missing_record_says_so_in_one_line(monkeypatch, tmp_path):
    from course import impl as impl_module
    monkeypatch.setitem(impl_module.NAMED, "solutions", tmp_path / "no-solutions")
    monkeypatch.setattr(oracle_records, "_replay", {})
    with pytest.raises(oracle_records.RecordMissing, match=r"needs the reference's sampling.generate, and this "
                                                           r"edition has no record of it .*released again"):
        oracle_records.recorded("sampling.generate", ([1, 2], 3), lambda: pytest.fail("computed without solutions/"))


def test_keys_hash_content_and_values_come_back_whole():
    import torch
    a, b = torch.arange(6.0).view(2, 3), torch.arange(6.0).view(2, 3)
    assert oracle_records.key_of("x", (a, [1, 2])) == oracle_records.key_of("x", (b, [1, 2]))
    assert oracle_records.key_of("x", (a, [1, 2])) != oracle_records.key_of("x", (a.T.contiguous(), [1, 2]))
    value = (a.bfloat16(), [3, 4], {"bytes": b"\x00"}, None, 1.5, frozenset({(1, 2), 3}), {("a", "b"): 2})
    back = oracle_records.decode(json.loads(json.dumps(oracle_records.encode(value))))
    assert torch.equal(back[0], a.bfloat16()) and back[1:] == value[1:]
    assert isinstance(back[5], frozenset)


def test_notebook_cells_that_call_a_stub_lose_their_outputs():
    stubs = {"layers": {"rms_norm"}, "tokenizer": {"ByteTokenizer"}}
    cells = [("ref = course.reference()\nB = course.reference().layers", "setup"),
             ("y = ref.layers.rms_norm(x, w)\nprint(y)", "tensor([1.6036, ...])"),
             ("B.rms_norm(x, w)", "tensor([1.6036, ...])"),
             ("plot(course.diagrams.blocks())", "<Figure>"),
             ("ref.layers.helper_that_is_given(x)", "given"),
             ('layers = ref.load("layers")\nlayers.rms_norm(x, w)', "tensor([1.6036, ...])")]
    outputs = [{"output_type": "stream", "name": "stdout", "text": text} for _, text in cells]
    notebook = {"cells": [{"cell_type": "code", "source": source, "outputs": [output]}
                          for (source, _), output in zip(cells, outputs)],
                "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    edited = json.loads(release.edition_notebook(".ipynb", json.dumps(notebook), stubs))["cells"]
    shown = ["".join(o["text"]) for cell in edited for o in cell["outputs"]]
    assert shown[0] == "setup" and shown[3] == "<Figure>" and shown[4] == "given"
    assert shown[1] == shown[2] == shown[5] == release.LEFT_OUT
    assert "course.notebook.reference_or_engine()" in "".join(edited[0]["source"])
    assert "course.reference()" not in release.edition_notebook(".md", "ref = course.reference()\n", stubs)


def test_model_option_in_an_edition_reads_the_checkpoint_with_transformers(tmp_path, monkeypatch):
    """--model PATH where solutions/ is absent: the learner's model gets its weights through
    transformers (not the reference's loader, not the learner's own), in the checkpoint's
    dtype, and the oracle model is transformers' itself, so the tests that compare with it
    run in an edition."""
    import torch

    from course import impl as impl_module
    from course import pytest_plugin
    from course.testing.oracles import transformers_checkpoint, transformers_tiny_qwen3

    package = impl_module.reference().package
    monkeypatch.setattr(impl_module, "have_reference", lambda: False)
    for dtype, name in ((torch.float32, "float32"), (torch.bfloat16, "bfloat16")):
        checkpoint = tmp_path / name
        saved = transformers_tiny_qwen3("cpu", dtype)
        saved.config.architectures, saved.config.dtype = ["Qwen3ForCausalLM"], name
        saved.save_pretrained(checkpoint)
        ours = pytest_plugin.build_model(package, "cpu", checkpoint)
        theirs = transformers_checkpoint(checkpoint, "cpu")
        assert isinstance(ours, package.qwen3.Qwen3ForCausalLM)
        mine = ours.state_dict()
        for key, tensor in theirs.state_dict().items():
            assert mine[key].dtype == dtype and torch.equal(mine[key], tensor), f"{name}: {key} differs"
    ids = torch.tensor([[3, 14, 15, 92, 65]])
    with torch.inference_mode():     # the same weights, so the same logits once both compute in float32
        assert torch.allclose(ours.float()(ids), theirs.float()(ids), atol=1e-4)


def test_a_command_that_needs_smollm2_names_only_the_chapters_still_to_do():
    """`run.py chat/serve/generate/bench --model smollm2` on an engine without Chapter 36's or
    39's stubs names the chapters whose stubs are still unwritten there (read from its
    files), not both to a learner who has done one."""
    from course import impl as impl_module
    from course.cli import CommandError
    from course.commands._setup import SMOLLM2_CHAPTERS, needs_chapters

    def refusal(spec: str, stub: str) -> str:
        with pytest.raises(CommandError) as refused:
            with needs_chapters("--model smollm2", SMOLLM2_CHAPTERS, impl_module.parse(spec)):
                raise NotImplementedError(f"Your engine: {stub}")
        return str(refused.value)

    assert refusal("engine", "Chapter 36: BPETokenizer.from_gguf_metadata").startswith(
        "--model smollm2 needs Chapters 36 and 39 done in your engine: Your engine: Chapter 36:")
    assert "needs Chapter 39 done" in refusal("solutions@38", "Chapter 39: read_value")
    assert "needs Chapters 36 and 39 done" in refusal("solutions@35", "Chapter 36: BPETokenizer.encode_word")
    # A stub of another chapter that says it is not written is named too.
    assert "needs Chapters 31, 36 and 39 done" in refusal("solutions@30", "Chapter 31: EngineCore.step")


# Where a written edition may still say "solutions": code and configuration (course/, tests/,
# pyproject.toml, pytest.ini, .gitignore), the license's list of what is code, and English.
ENGLISH_SOLUTIONS = re.compile(r"existing solutions\b")
# Every command's help, the pytest option's, and what --impl solutions and an oracle that needs
# the reference answer there; run inside the edition with only the edition importable.
EDITION_TEXTS = """
import argparse, importlib, subprocess, sys
from course import cli, impl
print(cli._usage(cli.available()))
for name in cli.available():
    parser = argparse.ArgumentParser(prog=name, description=importlib.import_module(f"course.commands.{name}").__doc__)
    importlib.import_module(f"course.commands.{name}").add_arguments(parser)
    print(parser.format_help())
for attempt in (lambda: impl.load("solutions"), impl.reference):
    try:
        attempt()
    except impl.ImplError as error:
        print(error)
print(subprocess.run([sys.executable, "-m", "pytest", "--help", "-p", "no:nbval"], capture_output=True,
                     text=True).stdout)
"""


def test_a_learner_in_the_edition_meets_engine_never_solutions(tmp_path):
    """The edition's chapters (text, code and saved outputs), README, engine/, command help
    and messages name engine/, the learner's files, and never solutions/, which it lacks."""
    dest = tmp_path / "edition"
    release.write_release(dest, record=None)
    read = [dest / "README.md", *(dest / "engine").rglob("*.py"), *sorted((dest / "chapters").rglob("*.md")),
            *sorted((dest / "chapters").rglob("*.ipynb"))]
    named = [f"{path.relative_to(dest)}:{number}: {line.strip()[:100]}"
             for path in read for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
             if re.search(r"\bsolutions\b", ENGLISH_SOLUTIONS.sub("", line)) or "<!-- full-course" in line
             or "<!-- edition" in line]
    assert not named, "the learner's edition still shows solutions/ (or an unresolved edition marker):\n" + \
        "\n".join(named[:20])
    assert not (dest / "course" / "commands" / "skeleton.py").exists(), "maintainer's commands are in the edition"
    shown = subprocess.run([sys.executable, "-c", EDITION_TEXTS], cwd=dest, env=release._edition_env(dest),
                           capture_output=True, text=True, timeout=300)
    assert shown.returncode == 0 and "--impl" in shown.stdout, shown.stderr[-2000:]
    lines = [line for line in shown.stdout.splitlines() if re.search(r"\bsolutions\b", line)]
    assert not lines, "help or messages of the edition name solutions:\n" + "\n".join(lines)
    assert "--impl engine runs your engine/" in shown.stdout


def test_edition_prose_keeps_each_editions_passages():
    text = ("Intro.\n<!-- full-course -->\n`solutions/` is the reference.\n<!-- /full-course -->\n"
            "<!-- edition\nYour engine/ is all you have.\n-->\nThe stub is in engine<!-- full-course --> "
            "(made from `solutions/`)<!-- /full-course -->.\n")
    assert release.edition_prose(text) == "Intro.\nYour engine/ is all you have.\nThe stub is in engine.\n"


def test_a_notebook_whose_kernel_never_started_is_run_again(monkeypatch, tmp_path, capsys):
    """A kernel that loses a port race dies before its first cell; that is retried, while a
    notebook that fails in a cell is reported at once."""
    for name in ("01-alpha", "02-beta"):
        (tmp_path / "chapters" / name).mkdir(parents=True)
        (tmp_path / "chapters" / name / f"{name}.ipynb").write_text("{}")
    runs: list[str] = []

    def fake_run(command, cwd, **_):
        runs.append(Path(cwd).name)
        if Path(cwd).name == "02-beta":
            return subprocess.CompletedProcess(command, 1, "", "Traceback\nAssertionError: a cell failed")
        died = runs.count("01-alpha") == 1
        return subprocess.CompletedProcess(command, 1 if died else 0, "",
                                           "RuntimeError: Kernel died before replying to kernel_info" if died else "")

    monkeypatch.setattr(release.subprocess, "run", fake_run)
    failed = release.execute_notebooks(tmp_path, {}, jobs=1)
    assert runs.count("01-alpha") == 2, "a kernel that died before starting is started again, once is enough here"
    assert runs.count("02-beta") == 1, "a notebook that fails in a cell is not run again"
    assert list(failed) == ["02-beta"] and "a cell failed" in failed["02-beta"]
    assert "01-alpha: its kernel died before its first cell; starting it again" in capsys.readouterr().err


def test_a_kernel_that_never_starts_is_reported_after_its_tries(monkeypatch, tmp_path):
    (tmp_path / "chapters" / "01-alpha").mkdir(parents=True)
    (tmp_path / "chapters" / "01-alpha" / "01-alpha.ipynb").write_text("{}")
    runs = []

    def dies(command, cwd, **_):
        runs.append(1)
        return subprocess.CompletedProcess(command, 1, "", "RuntimeError: Kernel didn't respond in 60 seconds")

    monkeypatch.setattr(release.subprocess, "run", dies)
    failed = release.execute_notebooks(tmp_path, {}, jobs=1)
    assert len(runs) == notebook.KERNEL_START_ATTEMPTS
    assert f"its kernel did not start in {notebook.KERNEL_START_ATTEMPTS} tries" in failed["01-alpha"]


def test_nbval_kernels_that_die_at_start_are_started_again():
    """The README's pytest runs notebooks under xdist, two kernels starting side by side."""
    from nbval import kernel

    from course import pytest_plugin
    assert getattr(kernel.start_new_kernel, "retries", False), "the course plugin wraps nbval's kernel start"
    calls = []

    def dies_twice():
        calls.append(1)
        if len(calls) < 3:
            raise RuntimeError("Kernel died before replying to kernel_info")
        return "manager", "client"

    assert pytest_plugin.kernel_start_with_retries(dies_twice)() == ("manager", "client")

    def always_dies():
        raise RuntimeError("Kernel died before replying to kernel_info")

    with pytest.raises(RuntimeError, match="Kernel died"):
        pytest_plugin.kernel_start_with_retries(always_dies)()
