"""The learner's edition: the repository without the reference answers.

`write_release(dest)` copies every tracked file a learner needs (engine/'s skeleton, the
chapters, the tests, course/, run.py, requirements, README, book.toml, the Classroom
configuration) and leaves out solutions/ and the maintainer's own tooling. It also
- records the reference's answers: it runs the milestones here in record mode
  (course.testing.oracle_records), and again with --stress those marked `edition_stress`
  (the --stress runs a chapter promises), and writes what the reference answered into the
  edition's tests/oracle_records/, from which the edition's oracles replay;
- keeps the notebooks from giving stubs away (`edition_notebook`): the setup line
  `course.reference()` becomes `course.notebook.reference_or_engine()` (the learner's engine
  where there is no reference), and a code cell that calls a stub of the reference by name
  (`ref.layers.rms_norm(...)`, `ref.tokenizer.ByteTokenizer(...)`: a function or a class
  with stub methods) shows one line instead of its saved output, because that output is
  what the stub computes. Figures and tables made by other code keep their outputs.
  `load_impl("solutions")` becomes `load_impl("engine")`, and text that points at a file of
  `solutions/` points at the same file of `engine/`, the learner's;
- records every notebook check's answer: it executes each chapter's notebook here with the
  reference as the engine (`record_checks`), and keeps each check's answer and line in
  tests/oracle_records/ (course.notebook.CHECK_ANSWERS), from which the edition's checks
  say PASS or FAIL.
`check_release(dest)` then proves, in a subprocess that imports only the edition, that the
tests collect and that Chapter 1's milestone fails with "not implemented yet" for the
stubs rather than with an import or collection error, and that `run.py progress` counts
the stubs from engine/'s markers. `verify_release(dest)` is the full proof: with the
reference copied into the edition's engine/, every written chapter's milestone passes with
`--impl engine` (the `edition_stress` tests with --stress), and every notebook runs there with
each check line the full course's; and before that, with the bare skeleton, every notebook
runs to its end (minutes; CI runs it after the book).
"""
from __future__ import annotations

import gzip
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from . import manifest, notebook, skeleton
from .manifest import ROOT
from .testing import oracle_records

# Top-level entries a learner's edition leaves out: the reference answers, the
# maintainer's guide and CI script (both drive solutions/), and local caches.
EXCLUDED = ("solutions", "CONTRIBUTING.md", ".ci", ".course_cache", ".git")
# The maintainer's commands, which work on solutions/: writing engine/ from it, writing an
# edition, regenerating README's chapter list.
MAINTAINER_COMMANDS = ("course/commands/skeleton.py", "course/commands/release.py", "course/commands/readme.py",
                       "course/commands/mistakes.py")
# The mistakes catalogue is made of edits to the reference's code (the answers, in pieces), and
# its test runs them: both stay with the maintainers.
MAINTAINER_PATHS = ("course/testing/mistakes/", "tests/test_course_mistakes.py")
NOT_IMPLEMENTED = "not implemented yet"
NO_TESTS_COLLECTED = 5      # pytest's exit status when a selection picks no test
NOTEBOOK_TIMEOUT = 600.0        # seconds one notebook may take to run top to bottom
# How a notebook's kernel that never started shows in nbconvert's output.
KERNEL_START_FAILURES = ("Kernel died before replying to kernel_info", "Kernel didn't respond in")


class ReleaseError(RuntimeError):
    """The edition could not be written, or does not work as a learner's checkout."""


def release_files(root: Path = ROOT) -> list[Path]:
    """The files of the edition, relative to root: git's tracked files when root is a
    checkout (nothing ignored or untracked leaks in), else every file, minus EXCLUDED."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True)
    if listed.returncode == 0 and listed.stdout:
        names = [Path(n) for n in listed.stdout.decode().split("\0") if n]
    else:
        names = [p.relative_to(root) for p in root.rglob("*") if p.is_file()]
    return sorted(n for n in names if n.parts[0] not in EXCLUDED and n.as_posix() not in MAINTAINER_COMMANDS
                  and not n.as_posix().startswith(MAINTAINER_PATHS)
                  and "__pycache__" not in n.parts and (root / n).is_file())


# What the recording run selects by default: every milestone (tests of a chapter).
ALL_MILESTONES = ("tests", "--upto", str(max(manifest.load().numbers)))
# The marker of a --stress test that a chapter promises its learner (Chapter 41's SmolLM2 over
# three ranks, Chapter 36's whole book against the tokenizers library): the release runs the
# marked tests of its selection once more, with --stress, to record their oracles' answers,
# and --verify runs them so in the edition.
STRESS_MARK = "edition_stress"
RECORDS_FILE = oracle_records.RECORDS_DIR / "records.json.gz"
LEFT_OUT = ("[left out of the learner's edition: this cell calls a stub of the reference, so its saved output "
            "is what the stub computes; run the cell once your engine has it]\n")


def write_release(dest: Path, root: Path = ROOT, record: tuple[str, ...] | None = ALL_MILESTONES,
                  timeout: float = 3600.0, notebooks: tuple[str, ...] = ("",)) -> list[Path]:
    """Copy the edition into dest (which must not exist or be empty), with its notebooks made
    answer-free and, unless `record` is None, the reference's answers to the milestones that
    `record` selects (pytest arguments, run here) and to the checks of the chapter notebooks
    whose folder names start with one of `notebooks` (all by default) in tests/oracle_records/.
    Returns the files."""
    dest = Path(dest)
    if dest.exists() and any(dest.iterdir()):
        raise ReleaseError(f"{dest} is not empty: the edition is written into a new folder")
    if dest.resolve() == root.resolve() or root.resolve() in dest.resolve().parents:
        raise ReleaseError(f"{dest} lies inside the repository; choose a folder outside it")
    files = release_files(root)
    stubs = stub_names(root / "solutions") if (root / "solutions").is_dir() else {}
    for rel in files:
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        if rel.parts[0] == "chapters" and rel.suffix in (".ipynb", ".md"):
            target.write_text(edition_notebook(rel.suffix, (root / rel).read_text(encoding="utf-8"), stubs),
                              encoding="utf-8")
        elif rel == Path("README.md"):      # its layout table's row for solutions/, which the edition lacks
            kept = [line for line in (root / rel).read_text(encoding="utf-8").splitlines(keepends=True)
                    if not line.startswith("| `solutions/`")]
            target.write_text(edition_prose("".join(kept)), encoding="utf-8")
        else:
            shutil.copy2(root / rel, target)
    if record is not None:
        (dest / RECORDS_FILE).parent.mkdir(parents=True, exist_ok=True)
        answers, asked = record_checks(root, notebooks=notebooks)
        oracle_records.write_store(dest / RECORDS_FILE, {**asked, **record_oracles(root, record, timeout),
                                                         **record_oracles(root, stress_runs(record), timeout)})
        files.append(RECORDS_FILE)
        notebook.write_check_answers(dest / notebook.CHECK_ANSWERS, answers)
        files.append(notebook.CHECK_ANSWERS)
    return files


def stress_runs(selection: tuple[str, ...]) -> tuple[str, ...]:
    """The pytest arguments that run the `edition_stress` tests of `selection`, with --stress."""
    return (*selection, "--stress", "-m", STRESS_MARK)


def record_oracles(root: Path, selection: tuple[str, ...], timeout: float) -> dict[str, dict]:
    """Run the milestones `selection` picks against the reference in root, in record mode, and
    return every answer the reference gave (none when it picks no test). Raises ReleaseError
    when a milestone fails there (an edition recorded from a red reference would replay wrong
    answers)."""
    with tempfile.TemporaryDirectory(prefix="oracle-records-") as folder:
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "COURSE_IMPL")}
        env.update(PYTHONPATH=str(root), **{oracle_records.RECORD_ENV: folder})
        ran = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:nbval",
                              "-o", "addopts=-p course.pytest_plugin", "--impl", "solutions", *_workers(selection),
                              *selection],
                             cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
        if ran.returncode not in (0, NO_TESTS_COLLECTED):
            raise ReleaseError("recording the reference's answers: the milestones fail against solutions/:\n"
                               + "\n".join(ran.stdout.splitlines()[-15:]) + ran.stderr[-1000:])
        return oracle_records.read_stores(Path(folder))


def chapter_notebooks(root: Path, chapters: tuple[str, ...] = ("",)) -> list[Path]:
    """The chapter notebooks (.ipynb) under root/chapters whose folder names start with one of
    `chapters` (all by default), in chapter order."""
    return sorted(path for path in (root / "chapters").glob("[0-9][0-9]-*/[0-9][0-9]-*.ipynb")
                  if path.parent.name.startswith(chapters))


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def execute_notebooks(root: Path, env: dict[str, str], timeout: float = NOTEBOOK_TIMEOUT,
                      jobs: int | None = None, chapters: tuple[str, ...] = ("",)) -> dict[str, str]:
    """Execute every chapter notebook of root (a checkout or an edition) top to bottom, `jobs`
    at a time (default: one per core), each in a fresh kernel started in its folder with
    `env`, into a scratch copy (the files stay as they are). Returns {chapter folder: why it
    did not run to its end}, empty when every one did; a notebook gets `timeout` seconds."""
    def execute(path: Path) -> tuple[str, str]:
        with tempfile.TemporaryDirectory(prefix="edition-notebook-") as scratch:
            # Cells nbval skips in CI (nbval-skip: a slow session the milestone runs) are left out here too.
            # Every kernel starts from the same seeds (course.notebook.seed_generators, as an edition's
            # kernel does when it sets up), so unseeded random inputs are the same in every run.
            seeding = "--InteractiveShellApp.exec_lines=['import course.notebook; course.notebook.seed_generators()']"
            command = [sys.executable, "-m", "jupyter", "nbconvert", "--to", "notebook", "--execute",
                       f"--ExecutePreprocessor.timeout={int(timeout)}", "--TagRemovePreprocessor.enabled=True",
                       f'--ExecutePreprocessor.extra_arguments=["{seeding}"]',
                       "--TagRemovePreprocessor.remove_cell_tags=nbval-skip", "--output-dir", scratch, path.name]
            # A kernel that died before its first cell (notebook.KERNEL_START_ATTEMPTS) is started again.
            for attempt in range(1, notebook.KERNEL_START_ATTEMPTS + 1):
                try:
                    ran = subprocess.run(command, cwd=path.parent, env=env, capture_output=True, text=True,
                                         timeout=timeout + 60)
                except subprocess.TimeoutExpired:
                    return path.parent.name, f"did not finish in {timeout:.0f}s"
                never_started = ran.returncode != 0 and any(sign in ran.stderr for sign in KERNEL_START_FAILURES)
                if not never_started or attempt == notebook.KERNEL_START_ATTEMPTS:
                    break
                print(f"{path.parent.name}: its kernel died before its first cell; starting it again",
                      file=sys.stderr, flush=True)
        if ran.returncode == 0:
            return path.parent.name, ""
        lines = [line for line in ran.stderr.splitlines() if line.strip()]
        if never_started:
            lines.append(f"(its kernel did not start in {notebook.KERNEL_START_ATTEMPTS} tries)")
        return path.parent.name, "\n".join(lines[-12:])
    notebooks = chapter_notebooks(root, chapters)
    with ThreadPoolExecutor(max_workers=jobs or _cores()) as pool:
        return {name: why for name, why in pool.map(execute, notebooks) if why}


def _notebook_env(root: Path, log: Path, impl: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "COURSE_IMPL")}
    env.update(PYTHONPATH=str(root), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
               **{notebook.CHECK_LOG_ENV: str(log)})
    if impl is not None:
        env["COURSE_IMPL"] = impl
    return env


def record_checks(root: Path = ROOT, timeout: float = NOTEBOOK_TIMEOUT,
                  notebooks: tuple[str, ...] = ("",)) -> tuple[dict[str, dict[str, dict]], dict[str, dict]]:
    """Execute every chapter notebook of root with the reference as the learner's engine and
    return each check's answer and line, {chapter folder: {key: {"label", "line", "value"}}},
    and the oracle records (course.testing.oracle_records) the notebooks' code asked for.
    Raises ReleaseError when a notebook does not run to its end, when an answer cannot be
    recorded, or when two checks of a notebook share a name and inputs but not an answer
    (the edition could not tell them apart: give them different names)."""
    with tempfile.TemporaryDirectory(prefix="notebook-checks-") as folder:
        env = _notebook_env(root, Path(folder), "solutions")
        env[oracle_records.RECORD_ENV] = folder
        failed = execute_notebooks(root, env, timeout, chapters=notebooks)
        if failed:
            raise ReleaseError("recording the notebooks' checks: these notebooks fail with the reference as "
                               "engine:\n" + "\n".join(f"{name}: {why}" for name, why in failed.items()))
        entries = notebook.read_check_log(Path(folder))
        asked = oracle_records.read_stores(Path(folder))
    answers: dict[str, dict[str, dict]] = {}
    problems = []
    for entry in entries:
        if "unrecordable" in entry:
            problems.append(f"{entry['chapter']}: check {entry['label']!r}: {entry['unrecordable']}")
            continue
        if entry.get("measured"):
            continue
        kept = answers.setdefault(entry["chapter"], {}).setdefault(entry["key"], dict(entry))
        if kept.get("value") != entry.get("value"):
            problems.append(f"{entry['chapter']}: two checks named {entry['label']!r} with the same inputs "
                            f"have different answers; name them apart")
    if problems:
        raise ReleaseError("recording the notebooks' checks:\n" + "\n".join(problems))
    return answers, asked


def _workers(selection: tuple[str, ...]) -> list[str]:
    """pytest-xdist workers for a run of every milestone; a few chosen tests run serially
    (starting workers would cost more than it saves)."""
    import importlib.util
    if selection != ALL_MILESTONES:
        return []
    cores = _cores()
    if cores < 2 or importlib.util.find_spec("xdist") is None:
        return []
    return ["-n", str(min(cores, 8)), "--dist", "loadfile"]


def stub_names(package: Path) -> dict[str, set[str]]:
    """{module path (dotted, as `ref.<module>` names it): names that are stubs there or classes
    with stub methods} for the reference package."""
    names: dict[str, set[str]] = {}
    for rel, stubs in skeleton.stubs_of_tree(package).items():
        module = rel.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
        for stub in stubs:
            names.setdefault(module, set()).add(stub.qualname.split(".")[0])
    return names


# `course.reference()` and its comment (`# the complete reference engine (solutions/)`), which
# would misname what the edition's setup line loads.
_REFERENCE_CALL = re.compile(r"""\bcourse\.reference\(\)(?:[ \t]*#[^\n"]*)?""")
# `ref = course.reference()`, `ref = load_impl("solutions")`, `B = course.reference().bpe`: the names a
# notebook gives the reference;
# then `cost = ref.cost`, `engine = ref.load("serve.engine")`: names of its modules.
_ALIAS = re.compile(r"""^\s*(\w+)\s*=\s*(?:course\.reference\(\)|load_impl\(["']solutions["']\))"""
                    r"((?:\.\w+)*)\s*(?:#.*)?$", re.MULTILINE)
_MODULE_ALIAS = re.compile(r"^\s*(\w+)\s*=\s*(\w+)(?:\.load\([\"']([\w.]+)[\"']\)|((?:\.\w+)+))\s*(?:#.*)?$",
                           re.MULTILINE)


def _aliases(sources: list[str]) -> dict[str, str]:
    """{name: the dotted path inside the reference it stands for} over a notebook's code."""
    aliases = {name: path for source in sources for name, path in _ALIAS.findall(source)}
    for source in sources:
        for name, base, loaded, attributes in _MODULE_ALIAS.findall(source):
            if base in aliases and name not in aliases:
                aliases[name] = aliases[base] + "." + (loaded or attributes.strip("."))
    return aliases


def reveals_a_stub(source: str, stubs: dict[str, set[str]], aliases: dict[str, str]) -> bool:
    """Whether a code cell names a stub of the reference through one of its names (`aliases`:
    name -> the dotted path it stands for, `ref` -> ""), so that its output is what the stub
    computes."""
    names = "|".join(re.escape(name) for name in aliases)
    pattern = rf"\b({names}|course\.reference\(\))((?:\.\w+)+)" if names else r"\b(course\.reference\(\))((?:\.\w+)+)"
    for name, chain in re.findall(pattern, source):
        parts = (aliases.get(name, "") + chain).strip(".").split(".")
        for cut in range(1, len(parts)):
            if parts[cut] in stubs.get(".".join(parts[:cut]), ()):
                return True
    return False


# `ref = load_impl("solutions")  # the reference engine`: the learner's engine in an edition.
_LOAD_REFERENCE = re.compile(r"""load_impl\((["'])solutions\1\)([ \t]*#[^\n"]*)?""")
# `solutions/bpe.py`, `solutions/server/`, `ROOT / "solutions"`, `--impl solutions`: the learner's copy is engine/.
_REFERENCE_PATH = re.compile(r"\bsolutions/")
_REFERENCE_NAME = re.compile(r"""(["'])solutions\1""")


# Prose for one edition only, in HTML comments (which the book and JupyterLab do not show): a
# passage between `<!-- full-course -->` and `<!-- /full-course -->` is left out of the
# learner's edition, and the text of a comment `<!-- edition ... -->` is shown there instead.
_FULL_COURSE_ONLY = re.compile(r"<!-- full-course -->\n?.*?<!-- /full-course -->\n?", re.DOTALL)
_EDITION_ONLY = re.compile(r"<!-- edition\n(.*?)-->\n?", re.DOTALL)


def edition_prose(text: str) -> str:
    """Markdown (a chapter, README.md) with its full-course-only passages left out and its
    edition-only passages shown."""
    return _EDITION_ONLY.sub(r"\1", _FULL_COURSE_ONLY.sub("", text))


def edition_text(text: str) -> str:
    """A notebook's source (or a string of its JSON) as the edition has it: its prose for the
    edition (`edition_prose`), the reference's setup lines and the name "solutions" name the
    learner's engine, and paths into solutions/ point into engine/."""
    text = edition_prose(text)
    text = _REFERENCE_CALL.sub("course.notebook.reference_or_engine()", text)
    text = _LOAD_REFERENCE.sub('load_impl("engine")', text)
    text = _REFERENCE_NAME.sub(r"\1engine\1", text)
    return _REFERENCE_PATH.sub("engine/", text)


def edition_notebook(suffix: str, text: str, stubs: dict[str, set[str]]) -> str:
    """A chapter's notebook (.ipynb) or its paired MyST text (.md) as the edition has it
    (`edition_text`), and in .ipynb the outputs of cells that call a stub of the reference
    replaced by one line (LEFT_OUT)."""
    if suffix == ".md":
        return edition_text(text)
    document = json.loads(text)
    cells = [cell for cell in document.get("cells", []) if cell.get("cell_type") == "code"]
    aliases = _aliases(["".join(cell.get("source", [])) for cell in cells])
    for cell in cells:
        source = "".join(cell.get("source", []))
        if cell.get("outputs") and reveals_a_stub(source, stubs, aliases):
            cell["outputs"] = [{"name": "stdout", "output_type": "stream", "text": [LEFT_OUT]}]
    for cell in document.get("cells", []):
        cell["source"] = edition_text("".join(cell.get("source", []))).splitlines(keepends=True)
        for output in cell.get("outputs", []):
            if output.get("output_type") == "stream":
                output["text"] = edition_text("".join(output["text"])).splitlines(keepends=True)
    return json.dumps(document, indent=1, ensure_ascii=False) + "\n"


def _edition_env(dest: Path) -> dict[str, str]:
    # Only the edition on the path: the maintainer's editable install must not answer
    # `import course` or `import solutions` for it.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "COURSE_IMPL")}
    env["PYTHONPATH"] = str(dest)
    return env


def _pytest(dest: Path, *args: str, timeout: float) -> subprocess.CompletedProcess:
    env = _edition_env(dest)
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:nbval",
                           "-o", "addopts=-p course.pytest_plugin", *args],
                          cwd=dest, env=env, capture_output=True, text=True, timeout=timeout)


def check_release(dest: Path, timeout: float = 300.0) -> list[str]:
    """Problems of the edition in dest as a learner's checkout (empty: it works)."""
    dest = Path(dest)
    problems = []
    if (dest / "solutions").exists():
        problems.append("solutions/ is in the edition")
    if not (dest / "engine" / "__init__.py").is_file():
        problems.append("engine/ is missing")
    collected = _pytest(dest, "--collect-only", "-q", "tests", timeout=timeout)
    if collected.returncode != 0:
        problems.append("the tests do not collect:\n" + "\n".join(collected.stdout.splitlines()[-15:]))
    shown = subprocess.run([sys.executable, "run.py", "progress", "--impl", "engine"], cwd=dest,
                           env=_edition_env(dest), capture_output=True, text=True, timeout=timeout)
    if shown.returncode != 0 or not re.search(r"\s0/\d+\s", shown.stdout):
        problems.append("`run.py progress` does not count engine/'s stubs:\n"
                        + shown.stdout[-1500:] + shown.stderr[-500:])
    milestones = sorted(str(p.relative_to(dest)) for p in (dest / "tests").glob("test_ch01_*.py"))
    if not milestones:
        problems.append("no Chapter 1 milestone in tests/")
        return problems
    first = _pytest(dest, "-q", "--impl", "engine", *milestones, timeout=timeout)
    text = first.stdout + first.stderr
    summary = text.strip().splitlines()[-1] if text.strip() else ""
    if first.returncode not in (0, 1) or " error" in summary:
        problems.append("Chapter 1's milestone errors instead of failing:\n" + "\n".join(text.splitlines()[-15:]))
    elif first.returncode == 1 and NOT_IMPLEMENTED not in text:
        problems.append("Chapter 1's milestone fails without saying the stubs are not implemented yet:\n"
                        + "\n".join(text.splitlines()[-15:]))
    return problems


def verify_release(dest: Path, root: Path = ROOT, timeout: float = 3600.0,
                   selection: tuple[str, ...] = ALL_MILESTONES) -> dict[int, tuple[int, int]]:
    """The proof that the edition in dest works for a learner who never opens solutions/: the
    reference (root's solutions/) copied into the edition's engine/, the milestones run there
    with `--impl engine`, then their `edition_stress` tests with --stress. Returns {chapter:
    (passed, failed)}, failures including errors; a skipped test counts in neither."""
    dest = Path(dest)
    if (dest / "solutions").exists():
        raise ReleaseError(f"{dest} has solutions/: the proof runs without the reference")
    shutil.rmtree(dest / "engine")
    shutil.copytree(root / "solutions", dest / "engine", ignore=shutil.ignore_patterns("__pycache__"))
    chapters = {path.stem: _chapter_of_file(path) for path in (dest / "tests").glob("test_*.py")}
    results: dict[int, tuple[int, int]] = {}
    for arguments in ((*_workers(selection), *selection), stress_runs(selection)):
        report = dest / ".verify.xml"
        ran = _pytest(dest, "-q", "--impl", "engine", f"--junitxml={report}", *arguments, timeout=timeout)
        if not report.is_file():
            raise ReleaseError("the milestones did not run in the edition:\n" + (ran.stdout + ran.stderr)[-2000:])
        for case in ElementTree.parse(report).getroot().iter("testcase"):
            chapter = next((chapters[part] for part in case.get("classname", "").split(".") if part in chapters),
                           None)
            if chapter is None or case.find("skipped") is not None:     # a stress test skips in the first run
                continue
            failed = case.find("failure") is not None or case.find("error") is not None
            passed, failures = results.get(chapter, (0, 0))
            results[chapter] = (passed + (not failed), failures + failed)
        report.unlink()
    return dict(sorted(results.items()))


def verify_bare_notebooks(dest: Path, timeout: float = NOTEBOOK_TIMEOUT,
                          notebooks: tuple[str, ...] = ("",)) -> tuple[list[str], int]:
    """Every notebook of the edition in dest, run on its engine/ as released (the bare
    skeleton), must reach its end. Returns (problems, how many NOT IMPLEMENTED YET lines the
    checks printed)."""
    dest = Path(dest)
    with tempfile.TemporaryDirectory(prefix="bare-notebooks-") as folder:
        failed = execute_notebooks(dest, _notebook_env(dest, Path(folder), None), timeout, chapters=notebooks)
        entries = notebook.read_check_log(Path(folder))
    problems = [f"{name} stops with the bare engine/:\n{why}" for name, why in failed.items()]
    return problems, sum("[NOT IMPLEMENTED YET]" in entry["line"] for entry in entries)


def verify_reference_notebooks(dest: Path, timeout: float = NOTEBOOK_TIMEOUT,
                               notebooks: tuple[str, ...] = ("",)) -> tuple[list[str], int]:
    """With the reference as the edition's engine/ (after verify_release), every notebook must
    run to its end and every check line must be the one the full course printed when the
    edition was released. Returns (problems, how many check lines matched)."""
    dest = Path(dest)
    with tempfile.TemporaryDirectory(prefix="reference-notebooks-") as folder:
        failed = execute_notebooks(dest, _notebook_env(dest, Path(folder), None), timeout, chapters=notebooks)
        entries = notebook.read_check_log(Path(folder))
    problems = [f"{name} stops with the reference as engine/:\n{why}" for name, why in failed.items()]
    with gzip.open(dest / notebook.CHECK_ANSWERS, "rt", encoding="utf-8") as source:
        recorded: dict[str, dict[str, dict]] = json.load(source)
    matched, seen = 0, set()
    for entry in entries:
        expected = recorded.get(entry["chapter"], {}).get(entry["key"])
        seen.add((entry["chapter"], entry["key"]))
        if entry.get("measured"):           # its inputs are this run's measurements: nothing recorded
            continue
        if expected is None:
            problems.append(f"{entry['chapter']}: check {entry['label']!r} has no recorded answer: {entry['line']}")
        elif entry["line"] != expected["line"]:
            problems.append(f"{entry['chapter']}: check {entry['label']!r} says {entry['line']!r} in the edition, "
                            f"{expected['line']!r} in the full course")
        else:
            matched += 1
    problems += [f"{chapter}: check {entry['label']!r} did not run in the edition"
                 for chapter, keys in recorded.items() for key, entry in keys.items() if (chapter, key) not in seen
                 and chapter not in failed]
    return problems, matched


def _chapter_of_file(path: Path) -> int | None:
    found = re.search(r"pytest\.mark\.chapter\((\d+)\)", path.read_text(encoding="utf-8"))
    return int(found.group(1)) if found else None


def timed(action, *args, **kwargs):
    """(action's result, seconds it took)."""
    started = time.perf_counter()
    return action(*args, **kwargs), time.perf_counter() - started
