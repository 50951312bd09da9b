"""Notebooks: pairs in sync and executed, written chapters complete, and the notebook
helpers that turn a learner's exception into one line."""
import dataclasses

import nbformat
import pytest
import torch

from course import chapters, manifest
from course import impl as impl_module
from course.notebook import CheckResult, check, differences, table

from conftest import write_tree

# --- the real repository ---------------------------------------------------------------------


def test_chapter_folders_are_known_and_pairs_in_sync():
    problems = chapters.folder_problems()
    assert not problems, "\n".join(problems)


def test_written_chapters_have_notebook_milestone_and_stubs():
    problems = chapters.written_chapter_problems()
    assert not problems, "\n".join(problems)


def test_notebooks_import_the_installed_repository_not_a_sys_path_hack():
    """Kernels find course/, solutions/ and engine/ through the editable install (a learner's
    `jupyter lab`) or PYTHONPATH (the pytest plugin sets it for nbval), and the chapter's own
    helper modules because a kernel's path includes its working folder, the chapter's."""
    offenders = [str(md.relative_to(manifest.ROOT)) for md in sorted(manifest.ROOT.glob("chapters/*/*.md"))
                 if "sys.path.insert" in md.read_text(encoding="utf-8")]
    assert not offenders, f"these notebooks edit sys.path; import through the installed package: {offenders}"


# --- the checks themselves, on a made-up chapter --------------------------------------------

MD = """\
---
jupytext:
  text_representation:
    extension: .md
    format_name: myst
kernelspec:
  display_name: Python 3
  language: python
  name: python3
---

# A chapter

```{code-cell} ipython3
x = 1 + 1
x
```

```{code-cell} ipython3
:tags: [nbval-ignore-output]

import time
time.perf_counter()
```
"""


@pytest.fixture
def fake_chapters(tmp_path):
    import jupytext
    folder = tmp_path / "chapters" / "05-attention"
    folder.mkdir(parents=True)
    md = folder / "05-attention.md"
    md.write_text(MD)
    notebook = jupytext.read(md)
    for number, cell in enumerate(c for c in notebook.cells if c.cell_type == "code"):
        cell.execution_count = number + 1
    jupytext.write(notebook, folder / "05-attention.ipynb", fmt="ipynb")
    return tmp_path / "chapters"


def test_a_synced_executed_pair_passes(fake_chapters):
    assert chapters.folder_problems(fake_chapters) == []


def test_an_edit_on_one_side_is_caught(fake_chapters):
    md = fake_chapters / "05-attention" / "05-attention.md"
    md.write_text(MD.replace("x = 1 + 1", "x = 1 + 2"))
    [problem] = chapters.folder_problems(fake_chapters)
    assert "differ at cell 2 (source" in problem and "jupytext --sync" in problem
    md.write_text(MD.replace(":tags: [nbval-ignore-output]\n", ""))
    assert "(tags;" in chapters.folder_problems(fake_chapters)[0]
    md.write_text(MD + "\nMore text.\n")
    assert "has 4 cells but" in chapters.folder_problems(fake_chapters)[0]


def test_unexecuted_unpaired_and_unknown_folders_are_caught(fake_chapters):
    ipynb = fake_chapters / "05-attention" / "05-attention.ipynb"
    notebook = nbformat.read(ipynb, as_version=4)
    notebook.cells[1].execution_count = None
    nbformat.write(notebook, ipynb)
    assert "unexecuted code cells [2]" in chapters.folder_problems(fake_chapters)[0]
    ipynb.unlink()
    assert "has no pair 05-attention.ipynb" in chapters.folder_problems(fake_chapters)[0]
    (fake_chapters / "05-atention").mkdir()
    assert any("05-atention/ matches no chapter" in p for p in chapters.folder_problems(fake_chapters))


def test_a_written_chapter_must_be_complete(tmp_path):
    real = manifest.load()
    book = dataclasses.replace(real, chapters=tuple(
        dataclasses.replace(c, status="written" if c.number == 5 else "planned") for c in real.chapters))
    assert [c.number for c in book.written] == [5]
    write_tree(tmp_path, {"solutions/__init__.py": "", "solutions/m.py": "X = 1\n"})
    problems = chapters.written_chapter_problems(tmp_path, book)
    assert len(problems) == 4 and "05-attention.md does not exist" in problems[0]
    assert "no stub in solutions/ names it" in problems[3]


# --- check() --------------------------------------------------------------------------------


def test_check_reports_pass_fail_and_not_implemented(fake_package, isolated_cache):
    full = impl_module.load(str(fake_package))
    gated = impl_module.load(f"{fake_package}@1")
    passed = check("ops.add", 2, 3, impl=gated, reference=full)
    assert passed and passed.status == "pass" and passed.value == 5
    todo = check("ops.Box.area", full.ops.Box(), 2, 3, impl=gated, reference=full)
    assert todo.status == "not implemented" and todo.detail == "fill in Box.area (Chapter 2)"
    assert repr(todo) == "[NOT IMPLEMENTED YET] ops.Box.area: fill in Box.area (Chapter 2)"
    wrong = check("ops.add", 2, 3, impl=gated, expected=6)
    assert not wrong and wrong.detail == "got 5, expected 6"
    crashed = check(lambda impl: impl.ops.add(1, None), impl=gated, expected=1, name="add None")
    assert crashed.status == "fail" and crashed.detail.startswith("TypeError:")
    assert "NOT IMPLEMENTED YET" in todo._repr_html_() and isinstance(todo, CheckResult)
    missing = check("ops.add", 1, 2, impl=str(fake_package.parent / "nowhere"))
    assert missing.status == "not implemented" and "unknown implementation" in missing.detail


def test_differences_say_where():
    a = torch.zeros(2, 3)
    assert differences(a, a.clone()) is None
    b = a.clone()
    b[1, 2] = 0.5
    assert differences(b, a) == "max abs difference 0.5 at (1, 2): got 0.5, expected 0"
    assert differences(a[:1], a) == "shape [1, 3], expected [2, 3]"
    assert differences(a.double(), a) == "dtype torch.float64, expected torch.float32"
    assert differences([1, 2, 4], [1, 2, 3]) == "got 4 at [2], expected 3"
    assert differences(torch.tensor([1, 2]), torch.tensor([1, 3])).startswith("1 element(s) differ")
    assert differences({"a": 1.0}, {"a": 1.0 + 1e-9}) is None


def test_table_renders_as_text_and_html():
    shown = table([[1, 0.5], [20, 1 / 3]], ["pos", "value"])
    assert repr(shown).splitlines() == ["pos   value", "---  ------", "  1     0.5", " 20  0.3333"]
    assert "<th>pos</th>" in shown._repr_html_()


# --- diagrams -------------------------------------------------------------------------------


def test_engine_v2_diagrams_fit_the_column():
    """Chapter 31's diagrams draw, and none is wider than the book's column (about 780 px),
    so the book never shrinks their text below a readable size."""
    import io
    import re

    from course import diagrams

    figures = {
        "part map": diagrams.part_map("VII"),
        "flattened batch": diagrams.flattened_batch(["a", "b"], [7, 8, 9], [4, 5, 11], [12, 13, 3], [0, 2, 3],
                                                    [6, 12], [1, 2]),
        "scheduler step": diagrams.scheduler_step(),
        "hash chain": diagrams.hash_chain(),
        "block states": diagrams.block_states(),
    }
    for name, fig in figures.items():
        buffer = io.StringIO()
        fig.savefig(buffer, format="svg", bbox_inches="tight")
        width_pt = float(re.search(r'width="([\d.]+)pt"', buffer.getvalue()).group(1))
        assert width_pt <= 1.1 * diagrams.COLUMN_INCHES * 72, f"the {name} diagram is {width_pt:.0f} pt wide"
