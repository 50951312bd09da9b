"""The chapters on disk, checked against book.toml.

A chapter folder chapters/NN-slug/ holds NN-slug.md (MyST Markdown, edited by hand) and
NN-slug.ipynb (its jupytext pair, executed, outputs kept). The invariants, each reported
as one readable line by the functions below:

- every folder under chapters/ is named after a chapter of book.toml;
- the .md and the .ipynb of a folder exist together and hold the same cells (type,
  source and tags: a tag like nbval-ignore-output changes how the notebook is tested);
- the .ipynb has been executed (every code cell with source has an execution count);
- a chapter marked "written" has its notebook pair, its milestone file and, unless
  book.toml says `stubs = false`, at least one stub in solutions/.
"""
from __future__ import annotations

import re
from pathlib import Path

from . import manifest as manifest_module
from . import skeleton
from .manifest import ROOT

FOLDER = re.compile(r"^(\d{2})-([a-z0-9-]+)$")


def _cells(notebook) -> list[tuple[str, str, tuple[str, ...]]]:
    return [(cell.cell_type, cell.source.strip(), tuple(sorted(cell.get("metadata", {}).get("tags", []))))
            for cell in notebook.cells]


def pair_problems(md: Path, ipynb: Path) -> list[str]:
    """Why the two sides of a notebook pair disagree (empty: in sync)."""
    import jupytext
    md_cells = _cells(jupytext.read(md))
    nb = jupytext.read(ipynb)
    nb_cells = _cells(nb)
    problems = []
    for index, (a, b) in enumerate(zip(md_cells, nb_cells)):
        if a != b:
            what = "type" if a[0] != b[0] else "source" if a[1] != b[1] else "tags"
            first_line = (a[1].splitlines() or [""])[0][:60]
            problems.append(f"{md.name} and {ipynb.name} differ at cell {index + 1} ({what}; "
                            f"the .md cell starts {first_line!r}): run `jupytext --sync {md}`")
            break
    if not problems and len(md_cells) != len(nb_cells):
        problems.append(f"{md.name} has {len(md_cells)} cells but {ipynb.name} has {len(nb_cells)}: "
                        f"run `jupytext --sync {md}`")
    unexecuted = [i + 1 for i, cell in enumerate(nb.cells)
                  if cell.cell_type == "code" and cell.source.strip() and cell.get("execution_count") is None]
    if unexecuted:
        problems.append(f"{ipynb.name} has unexecuted code cells {unexecuted[:5]}: run "
                        f"`jupyter nbconvert --to notebook --execute --inplace {ipynb}`")
    return problems


def folder_problems(chapters_dir: Path | None = None, manifest=None) -> list[str]:
    """Folders that book.toml does not know, and notebook pairs out of sync."""
    chapters_dir = Path(chapters_dir or ROOT / "chapters")
    manifest = manifest or manifest_module.load()
    known = {c.dirname for c in manifest.chapters}
    problems: list[str] = []
    if not chapters_dir.is_dir():
        return problems
    for folder in sorted(p for p in chapters_dir.iterdir() if p.is_dir() and not p.name.startswith((".", "_"))):
        if folder.name not in known:
            problems.append(f"chapters/{folder.name}/ matches no chapter of book.toml "
                            f"(folders are NN-slug, e.g. {manifest.chapters[0].dirname})")
            continue
        md, ipynb = folder / f"{folder.name}.md", folder / f"{folder.name}.ipynb"
        if md.exists() != ipynb.exists():
            present, absent = (md, ipynb) if md.exists() else (ipynb, md)
            problems.append(f"chapters/{folder.name}/{present.name} has no pair {absent.name}: "
                            f"run `jupytext --sync {present}`")
        elif md.exists():
            problems += [f"chapters/{folder.name}/: {p}" for p in pair_problems(md, ipynb)]
    return problems


def written_chapter_problems(root: Path | None = None, manifest=None) -> list[str]:
    """What each chapter marked "written" in book.toml is missing."""
    root = Path(root or ROOT)
    manifest = manifest or manifest_module.load()
    stub_chapters = {s.chapter for stubs in skeleton.stubs_of_tree(root / "solutions").values() for s in stubs} \
        if (root / "solutions").is_dir() else set()
    problems = []
    for chapter in manifest.written:
        label = f"Chapter {chapter.number} ({chapter.slug}) is written but"
        for path in (chapter.notebook_md, chapter.notebook_ipynb, chapter.milestone):
            if not (root / path).is_file():
                problems.append(f"{label} {path} does not exist")
        if chapter.has_stubs and chapter.number not in stub_chapters:
            problems.append(f"{label} no stub in solutions/ names it (add one, or set stubs = false "
                            f"in book.toml for a chapter with nothing to write)")
    return problems
