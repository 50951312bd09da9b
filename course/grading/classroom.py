"""GitHub Classroom's autograding configuration, generated from book.toml.

One test per written chapter that has a milestone file: it runs that milestone against the
learner's engine/ and is worth POINTS_PER_CHAPTER points. The file lives at
.github/classroom/autograding.json; `python run.py classroom` rewrites it and a test checks
that it matches book.toml, as for the README's chapter list.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from course import manifest as manifest_module
from course.manifest import ROOT

PATH = Path(".github/classroom/autograding.json")
POINTS_PER_CHAPTER = 10
TIMEOUT_MINUTES = 10
SETUP = "pip install -r requirements.txt"
# The milestone alone: no notebooks (nbval), no cache folder in the learner's repository.
RUN = "python -m pytest -p no:nbval -p no:cacheprovider -o addopts='-p course.pytest_plugin' -q --impl engine {path}"


def autograding(manifest: manifest_module.Manifest | None = None, root: Path = ROOT) -> dict[str, Any]:
    manifest = manifest or manifest_module.load()
    tests: list[dict[str, Any]] = []
    for chapter in manifest.chapters:
        if not chapter.written or not (root / chapter.milestone).is_file():
            continue
        tests.append({
            "name": f"Chapter {chapter.number}: {chapter.title}",
            "setup": SETUP if not tests else "",       # the first test installs for all of them
            "run": RUN.format(path=chapter.milestone),
            "input": "", "output": "", "comparison": "included",
            "timeout": TIMEOUT_MINUTES, "points": POINTS_PER_CHAPTER,
        })
    return {"tests": tests}


def render(manifest: manifest_module.Manifest | None = None, root: Path = ROOT) -> str:
    return json.dumps(autograding(manifest, root), indent=2, ensure_ascii=False) + "\n"


def update(root: Path = ROOT) -> bool:
    """Rewrite the file if stale; True when it changed."""
    path = root / PATH
    text = render(root=root)
    if path.is_file() and path.read_text(encoding="utf-8") == text:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return True
