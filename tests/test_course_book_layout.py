"""The book's page: every figure is read at its size in the 784 px column, where no label
may be smaller than 9 px, and no table is wider than the column (course.book)."""
import base64
import io
import json

import pytest
from matplotlib.figure import Figure

from course import book, manifest
from course.manifest import ROOT


def svg_of(width_inches: float, label_pt: float) -> str:
    fig = Figure(figsize=(width_inches, 2))
    fig.text(0.1, 0.5, "a label", fontsize=label_pt)
    fig.text(0.5, 0.5, "a title", fontsize=label_pt + 4)
    buffer = io.StringIO()
    fig.savefig(buffer, format="svg")
    return buffer.getvalue()


def png_of(width_inches: float, dpi: int = 100) -> str:
    buffer = io.BytesIO()
    Figure(figsize=(width_inches, 2)).savefig(buffer, format="png", dpi=dpi)
    return base64.b64encode(buffer.getvalue()).decode()


def test_an_svg_wider_than_the_column_shrinks_its_labels_with_it():
    # 12 inches are 1152 px: shown at 784 px, an 8 pt (10.7 px) label becomes 7.3 px.
    wide = book.svg_figure_size(svg_of(12, 8))
    assert wide.width_px == pytest.approx(784)
    assert wide.smallest_label_px == pytest.approx(8 * 96 / 72 * 784 / 1152, rel=0.01)
    # 7.8 inches (749 px) fit: the label keeps its 10.7 px.
    narrow = book.svg_figure_size(svg_of(7.8, 8))
    assert narrow.width_px == pytest.approx(7.8 * 96)
    assert narrow.smallest_label_px == pytest.approx(8 * 96 / 72, rel=0.01)
    assert narrow.measured


def test_svg_text_written_as_text_is_measured_too():
    fig = Figure(figsize=(7, 2))
    fig.text(0.1, 0.5, "a label", fontsize=6)
    buffer = io.StringIO()
    import matplotlib
    with matplotlib.rc_context({"svg.fonttype": "none"}):
        fig.savefig(buffer, format="svg")
    assert book.svg_figure_size(buffer.getvalue()).smallest_label_px == pytest.approx(6 * 96 / 72, rel=0.01)


def test_a_png_is_measured_at_its_display_width_with_the_sizes_its_cell_names():
    # 12 inches at 100 dpi are 1200 px, shown at 784: the cell's 9 pt title is 8.2 px.
    size = book.png_figure_size(png_of(12), None, code='ax.set_title("t", fontsize=9)')
    assert size.width_px == 784 and not size.measured
    assert size.smallest_label_px == pytest.approx(9 * 100 / 72 * 784 / 1200, rel=0.01)
    # A PNG drawn at 2x with a width in its metadata is shown at that width.
    retina = book.png_figure_size(png_of(6, dpi=200), 600, code="")
    assert retina.width_px == 600
    assert retina.smallest_label_px == pytest.approx(10 * 200 / 72 * 600 / 1200, rel=0.01)


def test_notebook_figures_are_measured_by_what_the_book_shows(tmp_path):
    notebook = tmp_path / "nb.ipynb"
    svg_and_png = {"output_type": "display_data", "metadata": {},
                   "data": {"image/svg+xml": svg_of(12, 8), "image/png": png_of(3), "text/plain": "<Figure>"}}
    png_only = {"output_type": "display_data", "metadata": {}, "data": {"image/png": png_of(3)}}
    notebook.write_text(json.dumps({"cells": [
        {"cell_type": "code", "source": "show(fig)", "outputs": [svg_and_png]},
        {"cell_type": "markdown", "source": "text"},
        {"cell_type": "code", "source": "plt.show()", "outputs": [png_only, {"output_type": "stream", "text": "x"}]},
    ]}))
    first, second = book.notebook_figure_sizes(notebook)
    assert first.measured and first.where == "nb cell 0", "the SVG is what the book shows"
    assert first.smallest_label_px < book.MIN_LABEL_PX
    assert not second.measured and second.where == "nb cell 2" and second.width_px == 300


def test_a_table_whose_words_alone_overflow_the_column_is_flagged():
    narrow = ["| a | b |", "|---|---|", "| short words | that wrap |"]
    # Code breaks after a dot or an underscore (the book puts a <wbr> there), not after a slash.
    wide = ["| term | ours | vLLM |", "|---|---|---|",
            "| x | `solutions/serve/scheduler/Scheduler/schedule/waiting/requests` | "
            "`vllm/v1/core/sched/scheduler/Scheduler/schedule` |"]
    breakable = ["| a | b |", "|---|---|", "| `solutions.serve.scheduler.Scheduler.schedule_waiting_requests` | "
                 "`vllm.v1.core.sched.scheduler.Scheduler.schedule_waiting_requests` |"]
    text = "\n".join(["# page", *narrow, "", "```", "| not | a | table |", "|---|---|---|", "```", *wide, ""])
    tables = book.markdown_tables(text)
    assert [line for line, _ in tables] == [2, 10], "the pipes inside a code fence are no table"
    assert book.markdown_table_min_width_px(tables[0][1]) < book.COLUMN_PX
    assert book.markdown_table_min_width_px(tables[1][1]) > book.COLUMN_PX
    assert book.markdown_table_min_width_px(breakable) < book.COLUMN_PX


def test_every_figure_of_the_book_has_labels_of_at_least_9px_in_the_column():
    problems = [p for p in book.figure_and_table_problems(manifest.load(), ROOT) if "table" not in p]
    assert not problems, ("a figure's labels are under 9 px in the book's 784 px column; draw it "
                          "at most 7.8 inches wide (course.diagrams.COLUMN_INCHES) or stack its panels:\n  "
                          + "\n  ".join(problems))


def test_no_table_is_wider_than_the_column():
    wide = [p for p in book.figure_and_table_problems(manifest.load(), ROOT) if "table" in p]
    assert not wide, f"tables wider than the {book.COLUMN_PX} px column (shorten a cell's longest word):\n  " \
        + "\n  ".join(wide)
