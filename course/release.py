"""The learner's edition: the repository without the reference answers.

`write_release(dest)` copies every tracked file a learner needs (engine/'s skeleton, the
chapters, the tests, course/, run.py, requirements, README, book.toml, the Classroom
configuration) and leaves out solutions/ and the maintainer's own tooling.
`check_release(dest)` then proves, in a subprocess that imports only the edition, that the
tests collect and that Chapter 1's milestone fails with "not implemented yet" for the
stubs rather than with an import or collection error, and that `run.py progress` counts
the stubs from engine/'s markers.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from .manifest import ROOT

# Top-level entries a learner's edition leaves out: the reference answers, the
# maintainer's guide and CI script (both drive solutions/), and local caches.
EXCLUDED = ("solutions", "CONTRIBUTING.md", ".ci", ".course_cache", ".git")
NOT_IMPLEMENTED = "not implemented yet"


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
    return sorted(n for n in names
                  if n.parts[0] not in EXCLUDED and "__pycache__" not in n.parts and (root / n).is_file())


def write_release(dest: Path, root: Path = ROOT) -> list[Path]:
    """Copy the edition into dest (which must not exist or be empty); returns the files."""
    dest = Path(dest)
    if dest.exists() and any(dest.iterdir()):
        raise ReleaseError(f"{dest} is not empty: the edition is written into a new folder")
    if dest.resolve() == root.resolve() or root.resolve() in dest.resolve().parents:
        raise ReleaseError(f"{dest} lies inside the repository; choose a folder outside it")
    files = release_files(root)
    for rel in files:
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / rel, target)
    return files


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
