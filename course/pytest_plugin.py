"""The course's pytest plugin: options, the `chapter` marker, selection and fixtures.

Options
    --impl SPEC     implementation under test (see course.impl). Without it, a test of
                    Chapter N gets `solutions@N`: the default run is the gating proof.
    --chapter N     only milestones (and notebooks) of Chapter N; may repeat
    --upto N        only milestones (and notebooks) of Chapters 1..N
    --device D      cpu or cuda (default: cuda when torch sees one)
    --model PATH    a real Hugging Face Qwen3 directory for the model fixtures
    --stress        the reliability tests' full sweeps instead of their fast subsets

Fixtures: `impl`, `device`, `model_path`, `tiny_model`, `ref_model`, `chapter`. They live
here rather than in tests/conftest.py so that milestone files anywhere (an instructor's
own, the grading tests' fakes) get them by loading this plugin with `-p course.pytest_plugin`.

A test belongs to Chapter N through `pytestmark = pytest.mark.chapter(N)`; a notebook
belongs to the chapter whose folder holds it. Tests of no chapter are the machinery's own:
they run unless a chapter selection is given.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import re
import sys
from pathlib import Path
from typing import Any

import pytest

from . import impl as impl_module
from . import manifest
from .notebook import KERNEL_START_ATTEMPTS

_CHAPTER_DIR = re.compile(r"^(\d+)-")


def pytest_addoption(parser):
    group = parser.getgroup("course", "the inference-engine course")
    group.addoption("--impl", default=None, metavar="SPEC",
                    help=("implementation under test: solutions, engine, a path, optionally @N "
                          "(default: solutions@N for a Chapter N test)") if impl_module.have_reference() else
                         "implementation under test: engine (your engine/, the default) or a checkout's path, "
                         "optionally @N (the state after Chapter N)")
    group.addoption("--chapter", type=int, action="append", default=None, metavar="N",
                    help="run only Chapter N's milestones and notebook (repeatable)")
    group.addoption("--upto", type=int, default=None, metavar="N",
                    help="run only the milestones and notebooks of Chapters 1..N")
    group.addoption("--device", choices=("cpu", "cuda", "mps"), default=None,
                    help="device for models in tests (default: cuda when available)")
    group.addoption("--model", default=None, metavar="PATH",
                    help="a Hugging Face Qwen3 checkpoint directory to use instead of the tiny model")
    group.addoption("--stress", action="store_true", default=False,
                    help="run the full reliability sweeps (random workloads, state machines) instead of "
                         "their fast subsets")


MAX_WORKERS = 8


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:                      # not on Linux
        return os.cpu_count() or 1


@pytest.hookimpl(wrapper=True)
def pytest_cmdline_main(config):
    """A whole-suite run (`pytest` with no paths: milestones, machinery tests and every
    notebook) spreads over the CPU cores with pytest-xdist, one file per worker at a time
    (--dist loadfile keeps a notebook's cells in one kernel and a milestone file's module
    fixtures in one process). Running chosen files, passing -n yourself, or setting
    COURSE_SERIAL=1 keeps the run serial. A wrapper, so it runs before xdist reads -n."""
    if (config.args_source == pytest.Config.ArgsSource.TESTPATHS
            and config.pluginmanager.hasplugin("xdist")
            and getattr(config.option, "numprocesses", 0) is None
            and not hasattr(config, "workerinput")
            and not config.getoption("collectonly")
            and not os.environ.get("COURSE_SERIAL")
            and _cores() > 1):
        config.option.numprocesses = min(_cores(), MAX_WORKERS)
        config.option.dist = "loadfile"
    return (yield)


def pytest_configure(config):
    config.addinivalue_line("markers", "chapter(n): this milestone belongs to Chapter n of book.toml")
    config.addinivalue_line("markers", "edition_stress: a --stress test its chapter promises the learner; the "
                                       "release records its oracles' answers with --stress (course.release)")
    workers = getattr(config, "workerinput", {}).get("workercount")
    if "OMP_NUM_THREADS" not in os.environ and (workers or _device_name(config) == "cpu"):
        # Share the cores among workers (and their notebook kernels) instead of each
        # spawning a thread per core; a serial CPU run gets one thread, because the tiny
        # model's operations take microseconds and extra threads only add waiting.
        threads = max(1, _cores() // workers) if workers else 1
        os.environ["OMP_NUM_THREADS"] = str(threads)
        if "torch" in sys.modules:
            sys.modules["torch"].set_num_threads(threads)
    # Triton decides at import whether its kernels (and its own library functions) are
    # interpreted, and transformers imports triton as a side effect: so the choice must be
    # made before any test runs, not by the Triton chapter's module when it is imported.
    if "TRITON_INTERPRET" not in os.environ and _device_name(config) == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    # Notebook kernels (nbval) start in the chapter's folder; this lets them import course.
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if str(manifest.ROOT) not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([str(manifest.ROOT)] + [p for p in paths if p])
    _derandomize_hypothesis()
    _retry_notebook_kernel_starts(config)
    if not config.getoption("stress"):
        _limit_hypothesis_shrinking(SHRINK_SECONDS)
    known = manifest.load().numbers
    spec = config.getoption("impl")
    if spec is not None:
        try:
            impl_module.parse(spec)
        except impl_module.ImplError as exc:
            raise pytest.UsageError(f"--impl: {exc}") from None
    upto = config.getoption("upto")
    for number in (config.getoption("chapter") or []) + ([upto] if upto is not None else []):
        if number not in known:
            raise pytest.UsageError(f"Chapter {number} is not in book.toml (1-{max(known)})")
    if config.getoption("device") == "cuda":
        import torch
        if not torch.cuda.is_available():
            raise pytest.UsageError("--device cuda: torch sees no CUDA device here")
    model = config.getoption("model")
    if model is not None and not Path(model).is_dir():
        raise pytest.UsageError(f"--model {model}: not a directory")


def _retry_notebook_kernel_starts(config) -> None:
    """nbval starts one kernel per notebook, and under xdist two start side by side; one that
    dies before its first cell (a lost race for a port) is started again instead of failing
    every cell of its notebook."""
    if not config.pluginmanager.hasplugin("nbval"):
        return
    from nbval import kernel
    if not getattr(kernel.start_new_kernel, "retries", False):     # an in-process pytester run configures again
        kernel.start_new_kernel = kernel_start_with_retries(kernel.start_new_kernel)


def kernel_start_with_retries(start):
    """`start` (nbval's start_new_kernel), tried up to course.notebook.KERNEL_START_ATTEMPTS
    times while it raises RuntimeError (jupyter_client's "Kernel died before replying to
    kernel_info", and its start timeout); any other error, and the last try's, propagate."""
    def start_with_retries(*args, **kwargs):
        for _ in range(KERNEL_START_ATTEMPTS - 1):
            try:
                return start(*args, **kwargs)
            except RuntimeError:
                pass
        return start(*args, **kwargs)

    start_with_retries.retries = True       # type: ignore[attr-defined]
    return start_with_retries


def chapter_of(item) -> int | None:
    """The chapter a collected item belongs to: its marker, else its notebook's folder."""
    marker = item.get_closest_marker("chapter")
    if marker is not None:
        return int(marker.args[0])
    path = Path(str(getattr(item, "path", "") or ""))
    if path.suffix == ".ipynb":
        found = _CHAPTER_DIR.match(path.parent.name)
        if found:
            return int(found.group(1))
    return None


# Notebooks whose cells need Triton (its wheels are Linux-only; requirements.txt leaves it out
# elsewhere). Their milestones skip through pytest.importorskip; these notebooks skip here.
TRITON_NOTEBOOKS = ("30-first-triton-kernel.ipynb", "32-fast-kernels.ipynb", "33-cuda-graphs-and-async.ipynb")


def _skip_triton_notebooks(items: list[pytest.Item]) -> None:
    import importlib.util
    if importlib.util.find_spec("triton") is not None:
        return
    reason = "Triton is not installed (it ships Linux wheels only): this notebook's Triton cells cannot run"
    for item in items:
        if item.path.name in TRITON_NOTEBOOKS:
            item.add_marker(pytest.mark.skip(reason=reason))


def _skip_maintainer_tests(items: list[pytest.Item]) -> None:
    """In a learner's edition (no solutions/), the machinery's own tests (no chapter) check the
    course against its reference: they skip, saying so, instead of failing."""
    if impl_module.have_reference():
        return
    reason = ("a maintainer's test of the course machinery: it needs the reference engine, which a "
              "learner's edition leaves out")
    for item in items:
        if chapter_of(item) is None:
            item.add_marker(pytest.mark.skip(reason=reason))


# How long Hypothesis may shrink a failing case in the default run (its own limit, five
# minutes, is kept under --stress): a learner's failure comes back in seconds, not minutes,
# and still shorn of most of the calls that do not matter to it.
SHRINK_SECONDS = 20


def _limit_hypothesis_shrinking(seconds: int) -> None:
    try:
        from hypothesis.internal.conjecture import engine
    except ImportError:
        return
    if not hasattr(engine, "MAX_SHRINKING_SECONDS"):      # pinned in requirements.txt; a new version must keep it
        raise pytest.UsageError("hypothesis no longer has engine.MAX_SHRINKING_SECONDS: update "
                                "course.pytest_plugin._limit_hypothesis_shrinking")
    engine.MAX_SHRINKING_SECONDS = seconds


def _derandomize_hypothesis() -> None:
    """While oracle answers are recorded, and in an edition that replays them, Hypothesis draws
    the same examples every run, so each example's question has a recorded answer."""
    from .testing.oracle_records import RECORD_ENV
    if impl_module.have_reference() and not os.environ.get(RECORD_ENV):
        return
    try:
        from hypothesis import settings
    except ImportError:
        return
    settings.register_profile("course-recorded-oracles", derandomize=True, database=None)
    settings.load_profile("course-recorded-oracles")


def pytest_collection_modifyitems(config, items):
    _skip_triton_notebooks(items)
    _skip_maintainer_tests(items)
    wanted = set(config.getoption("chapter") or [])
    upto = config.getoption("upto")
    if not wanted and upto is None:
        return
    keep: list[pytest.Item] = []
    drop: list[pytest.Item] = []
    for item in items:
        number = chapter_of(item)
        selected = number is not None and (not wanted or number in wanted) and (upto is None or number <= upto)
        (keep if selected else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


class PassedOnAnUnwrittenStub(AssertionError):
    """A milestone that passed although a request inside it failed on an unwritten stub."""


class _StubErrorsLogged(logging.Handler):
    """Collects "Your engine: Chapter N: NAME" of every unwritten stub whose NotImplementedError
    was logged with its traceback: the engine logs each error it turns into one request's
    failure (EngineCore._abort_with_error) before the step goes on for everyone else."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.stubs: set[str] = set()

    def emit(self, record: logging.LogRecord) -> None:
        error = record.exc_info[1] if record.exc_info else None
        found = _unwritten_stub(error, read_message=False) if error is not None else None
        if found is not None:
            self.stubs.add(found[0])


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """A milestone must not pass on the back of an unwritten stub. The engine keeps serving
    when one request's processing raises, so a stub that is not written yet (a later
    chapter's, under solutions@N or in a learner's engine) fails only the requests that reach
    it; a test that looks at the others would pass while it depends on code nobody wrote.
    Such a pass is turned into a failure that names the stub."""
    if chapter_of(item) is None:
        return (yield)
    logged = _StubErrorsLogged()
    root = logging.getLogger()
    root.addHandler(logged)
    try:
        result = yield
    finally:
        root.removeHandler(logged)
    if logged.stubs:
        # (said as "Chapter 34's NAME", not in the stub's own words, which the report would
        # read as this test's own unwritten stub)
        names = "; ".join(sorted(f"{chapter}'s {name}" for stub in logged.stubs
                                 for chapter, name in [stub.removeprefix("Your engine: ").split(": ", 1)]))
        raise PassedOnAnUnwrittenStub(
            f"this test passed, but a request inside it failed on an unwritten stub ({names}): the engine turned "
            "the stub's NotImplementedError into that request's error, so the test depends on code that is not "
            "written yet")
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A failure inside a gated copy (.course_cache/solutions_at_8/...) is reported at the
    file it was generated from (solutions/...), the one to open and edit: the copy is
    read-only, regenerated on every load, and keeps the source's line numbers."""
    report = yield
    _point_at_sources(report.longrepr, item.config.invocation_params.dir)
    # (the indirect signs are read for a chapter's milestones only: a maintainer's test of the
    # machinery may print a stub's words for its own reasons)
    milestone = chapter_of(item) is not None
    # (a skip keeps its own reason, which already says what is missing, and the (path, line,
    # reason) form that -rs lists)
    errored = (call.excinfo is not None and not report.skipped
               and not call.excinfo.errisinstance(PassedOnAnUnwrittenStub))   # its own message says it all
    unwritten = _unwritten_stub(call.excinfo.value, milestone) if errored else None
    if unwritten is None and errored and milestone:
        # `assert cli.main([...]) == 0`, or a server whose engine thread died: the command's
        # one-line error, or the thread's traceback, in the captured output names the stub
        said = next((found for _, text in report.sections if (found := _OUTPUT_SAYS.search(text))), None)
        unwritten = (said.group(1), None) if said else None
    if unwritten is not None:
        # An unwritten stub is the learner's to-do, not a crash: where it is, no traceback;
        # also when it surfaced through something else (a run.py command's exit status, a
        # pytest.raises that caught it as a RuntimeError, Triton's interpreter).
        message, raised = unwritten
        report.sections = [(title, text) for title, text in report.sections if not title.startswith("Captured")]
        if raised is None:
            report.longrepr = f"not implemented yet: {message}"
        else:
            where = _shown_path(raised.filename, item.config.invocation_params.dir)
            report.longrepr = f"not implemented yet: {message} (the stub: {where}:{raised.lineno})"
    elif call.excinfo is not None and call.excinfo.errisinstance(impl_module.ImplError):
        from .testing.oracle_records import RecordMissing
        why = str(call.excinfo.value)
        if call.excinfo.errisinstance(RecordMissing) and item.config.getoption("model"):
            why = (f"{item.nodeid} needs the reference's answer on --model's checkpoint; an edition has them for "
                   "the tiny model only (with --model, the tests whose oracle is transformers run)")
        report.longrepr = f"cannot run here: {why}"    # a setup problem, said in one line
    elif call.excinfo is not None and item.config.getoption("tbstyle") in ("auto", "short"):
        # (a notebook cell, nbval's item, has no fixtures)
        compact = _hypothesis_report(call.excinfo, item.config, set(getattr(item, "fixturenames", ())))
        if compact is None and milestone:
            compact = _library_error_report(call.excinfo, item.config)
        if compact is not None:
            report.longrepr = compact
            # Hypothesis announces the end of our shorter shrinking as "more than five minutes".
            report.sections = [(title, text) for title, text in report.sections
                               if "working to shrink a failing test case" not in text]
    return report


# Hypothesis notes its failing case on the exception, under one of these headings.
_CASE_HEADINGS = ("Falsifying example", "Falsifying explicit example", "Failing test case")


def _hypothesis_report(excinfo, config, fixtures: set[str]) -> str | None:
    """A Hypothesis failure said short: the rule that broke (the test's own message), where
    it was raised, and the failing case as calls to replay, instead of pages of traceback
    and assertion introspection. `--tb=long` still shows everything."""
    notes = [line for note in getattr(excinfo.value, "__notes__", None) or [] for line in note.splitlines()]
    start = next((i for i, line in enumerate(notes) if line.startswith(_CASE_HEADINGS)), None)
    if start is None:
        return None
    heading = notes[start].partition(": ")[2]
    machine = heading == "<state machine>"
    end = next((i for i in range(start + 1, len(notes)) if notes[i].startswith(("Explanation:", "You can reproduce"))),
               len(notes))
    checks = _invariant_checks([line.strip() for line in notes[start + 1:end]])
    case = [] if machine else ["    " + heading]
    for line in notes[start + 1:end]:
        text = line.strip()
        if not text or text in checks or text.startswith("# The test always failed") \
                or text.partition("=")[0] in fixtures:     # a fixture is the same in every case
            continue
        case.append(("    " if machine or line.startswith(")") else "        ") + text)
    message = str(excinfo.value)
    if excinfo.errisinstance(AssertionError):
        message = message.split("\nassert ", 1)[0]       # pytest's introspection repeats what the message says
    lines = [f"{excinfo.type.__name__}: {message}" if message else excinfo.type.__name__]
    frame = next((entry for entry in reversed(excinfo.traceback) if "site-packages" not in str(entry.path)), None)
    if frame is not None:
        where = _shown_path(frame.path, config.invocation_params.dir)
        lines.append(f"  raised at {where}:{frame.lineno + 1} ({frame.name})")
    lines.append("The failing case Hypothesis found, shrunk" + ("" if config.getoption("stress") else
                 f" for at most {SHRINK_SECONDS} s (--stress shrinks it for longer)") + ":")
    lines += case
    lines.append("(pytest --tb=long prints the whole traceback)")
    return "\n".join(lines)


def _library_error_report(excinfo, config) -> str | None:
    """An error raised inside a library (torch's IndexError from an embedding lookup, say)
    said short: the error, then the last calls outside the library (the code under test,
    the test), instead of a hundred lines of the library's source. None for anything else."""
    entries = list(excinfo.traceback)
    if not entries or excinfo.errisinstance((AssertionError, pytest.fail.Exception, pytest.skip.Exception)) \
            or "site-packages" not in str(entries[-1].path):
        return None
    outside = [entry for entry in entries if "site-packages" not in str(entry.path)]
    library = str(entries[-1].path).split("site-packages", 1)[1].strip("/\\").split("/")[0].split("\\")[0]
    lines = [f"E   {excinfo.type.__name__}: {excinfo.value}".rstrip()]     # the line pytest itself starts with E
    for entry in outside[-3:]:
        where = _shown_path(entry.path, config.invocation_params.dir)
        statement = str(entry.statement).strip().splitlines()[0] if entry.statement else ""
        lines.append(f"  at {where}:{entry.lineno + 1} ({entry.name}): {statement}")
    lines.append(f"  (raised inside {library}; pytest --tb=long prints the whole traceback)")
    return "\n".join(lines)


def _invariant_checks(lines: list[str]) -> set[str]:
    """The calls in a state machine's run that are its invariants: argument-free calls that
    follow every other call (the failing last one and teardown aside). They pass each time
    until the failure, so the run reads better without them."""
    calls = [line for line in lines if line.startswith("state.")]
    checks = set()
    for candidate in {call for call in calls if call.endswith("()") and call != "state.teardown()"}:
        others = [i for i, call in enumerate(calls[:-1])
                  if call not in (candidate, "state.teardown()") and calls[i + 1] != "state.teardown()"]
        if others and all(calls[i + 1] == candidate for i in others):
            checks.add(candidate)
    return checks


_STUB_SAYS = re.compile(r"Your engine: Chapter \d+: [\w.<>]+")
_OUTPUT_SAYS = re.compile(r"^(?:run\.py \w+: error: .*?|NotImplementedError: )(Your engine: Chapter \d+: [\w.<>]+)",
                          re.MULTILINE)


def _unwritten_stub(error: BaseException, read_message: bool = True):
    """(the stub's "Your engine: Chapter N: NAME", the frame that raised it or None) when
    `error` comes from an unwritten stub: its NotImplementedError, or one chained behind
    `error`, or (with read_message) its words inside `error`'s message (a command's one-line
    error that a test asserted on). None for any other failure."""
    import traceback
    seen = set()
    causes: list[BaseException] = [error]
    while causes:
        cause = causes.pop(0)
        if id(cause) in seen:
            continue
        seen.add(id(cause))
        if isinstance(cause, NotImplementedError) and _STUB_SAYS.match(str(cause)):
            frames = traceback.extract_tb(cause.__traceback__)
            return str(cause), frames[-1] if frames else None
        # Hypothesis reports several distinct failures as one group: a stub behind any of them
        causes += [*getattr(cause, "exceptions", ()), *(c for c in (cause.__cause__, cause.__context__) if c)]
    said = _STUB_SAYS.search(str(error)) if read_message else None
    return (said.group(0), None) if said else None


def _shown_path(path, invocation_dir: Path) -> Path:
    """Where to tell the reader to look: the source of a gated copy, relative to where
    pytest was started when it lies below it."""
    where = Path(_source_path(str(path), invocation_dir))
    return where.relative_to(invocation_dir) if where.is_relative_to(invocation_dir) else where


def _point_at_sources(longrepr, invocation_dir: Path) -> None:
    for reprtraceback, reprcrash, _ in getattr(longrepr, "chain", None) or []:
        for entry in reprtraceback.reprentries:
            location = getattr(entry, "reprfileloc", None)
            if location is not None:
                location.path = _source_path(location.path, invocation_dir)
            elif hasattr(entry, "lines"):            # --tb=native: the traceback as text
                entry.lines = [_sources_in_text(line) for line in entry.lines]
        if reprcrash is not None:
            reprcrash.path = _source_path(reprcrash.path, invocation_dir)


def _source_path(shown: str, invocation_dir: Path) -> str:
    path = Path(shown)
    source = impl_module.source_of(path if path.is_absolute() else invocation_dir / path)
    if source is None:
        return shown
    return str(source) if path.is_absolute() else os.path.relpath(source, invocation_dir)


def _sources_in_text(text: str) -> str:
    for loaded in impl_module.loaded_gated():
        text = text.replace(str(loaded.root), str(loaded.source))
    return text


def pytest_report_header(config):
    spec = config.getoption("impl")
    # torch is not imported just for this line: machinery-only runs stay quick to start.
    device = config.getoption("device") or "auto (cuda when available)"
    default = "solutions@N per chapter" if impl_module.have_reference() else "engine"
    return [f"course: impl={spec or default}, device={device}"]


def _device_name(config) -> str:
    chosen = config.getoption("device")
    if chosen:
        return chosen
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


# --- fixtures ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def chapter(request) -> int | None:
    """The chapter of the requesting module (its `pytestmark`), or None."""
    marker = request.node.get_closest_marker("chapter")
    return int(marker.args[0]) if marker else None


@pytest.fixture(scope="module")
def impl(request, chapter):
    """The implementation under test: --impl if given, else `solutions@N` for Chapter N (`engine`
    in a learner's edition, which has no solutions/)."""
    spec = request.config.getoption("impl")
    if spec is None and not impl_module.have_reference():
        spec = "engine"                 # a learner's edition: no reference, so the learner's engine
    if spec is None:
        spec = f"solutions@{chapter}" if chapter is not None else "solutions"
    return impl_module.load(spec)


@pytest.fixture(scope="session")
def device(request):
    import torch
    return torch.device(_device_name(request.config))


@pytest.fixture(scope="session")
def model_path(request) -> Path | None:
    path = request.config.getoption("model")
    return Path(path) if path else None


def build_model(package, device, model_path=None):
    """The model a test runs: the tiny Qwen3 of `package`, or, with --model, the real
    checkpoint in `package`'s own Qwen3 class, read by the reference's loader (or, in an
    edition without it, by transformers)."""
    if model_path is None:
        from . import models
        return models.tiny_qwen3(package, device=device)
    loaded: Any
    if impl_module.have_reference():
        reference = impl_module.reference()
        loaded = reference.checkpoint.load_checkpoint(model_path, device=device)
        if package is reference.package:
            return loaded
        cfg = package.qwen3.Qwen3Config(**dataclasses.asdict(loaded.cfg))
    else:
        from .testing.oracles import transformers_checkpoint
        loaded = transformers_checkpoint(model_path, device)
        cfg = package.qwen3.Qwen3Config.from_dict(loaded.config.to_dict())
    # The learner's checkpoint loader may not exist yet at this chapter; their model
    # class does, and parameter names are Hugging Face's in both, so weights carry over.
    model = package.qwen3.Qwen3ForCausalLM(cfg)
    model.load_state_dict(loaded.state_dict())
    return model.to(device=device, dtype=next(loaded.parameters()).dtype).eval()


@pytest.fixture
def tiny_model(impl, device, model_path):
    """The implementation's Qwen3 with the deterministic tiny weights (or --model's)."""
    return build_model(impl.package, device, model_path)


@pytest.fixture
def ref_model(device, model_path):
    """The reference Qwen3 with the same weights as `tiny_model` (in an edition without the
    reference, transformers' Qwen3 with those weights: course.testing.oracles.reference_tiny_qwen3)."""
    if model_path is None:
        from .testing.oracles import reference_tiny_qwen3
        return reference_tiny_qwen3(device)
    if not impl_module.have_reference():
        from .testing.oracles import transformers_checkpoint
        return transformers_checkpoint(model_path, device)
    return build_model(impl_module.reference().package, device, model_path)


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The verified SmolLM2-135M-Instruct GGUF file (course.models.smollm2), fetched on first use.
    Without network and without a cached copy the test is skipped with the one line that
    says how to provide the file, never silently."""
    from .models import smollm2
    try:
        return smollm2.smollm2_gguf_path(quiet=True)
    except smollm2.SmolLM2Unavailable as missing:
        pytest.skip(f"SmolLM2 unavailable: {missing}")
