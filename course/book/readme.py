"""The README's chapter list, kept equal to book.toml.

README.md holds the generated table between two marker comments; `python run.py readme`
rewrites that region and nothing else, and a test fails when it is stale. The table lists
parts, numbers, titles and each chapter's status (a written chapter's title links to its
notebook), so whoever marks a chapter written in book.toml reruns `python run.py readme`.
"""
from __future__ import annotations

from pathlib import Path

from course import manifest as manifest_module
from course.book import chapter_table
from course.manifest import ROOT

START = "<!-- chapters:start (generated from book.toml by `python run.py readme`) -->"
END = "<!-- chapters:end -->"


def render(text: str, manifest=None) -> str:
    """`text` with the region between the markers replaced by the current chapter table."""
    manifest = manifest or manifest_module.load()
    if START not in text or END not in text:
        raise ValueError(f"README.md lacks the markers {START!r} ... {END!r}")
    head, _, rest = text.partition(START)
    _, _, tail = rest.partition(END)
    return f"{head}{START}\n{chapter_table(manifest)}\n{END}{tail}"


def update(path: Path | None = None) -> bool:
    """Rewrite README.md's chapter table; returns True when it changed."""
    path = Path(path or ROOT / "README.md")
    text = path.read_text(encoding="utf-8")
    fresh = render(text)
    if fresh != text:
        path.write_text(fresh, encoding="utf-8")
    return fresh != text
