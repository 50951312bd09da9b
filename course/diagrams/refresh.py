"""Re-run only the diagram cells of chapter notebooks and keep every other cell's outputs.

    python -m course.diagrams.refresh chapters/NN-slug/NN-slug.ipynb [...]

A diagram cell is a code cell whose saved output holds an SVG. Re-executing a whole notebook
to change how figures are saved (or to redraw one) costs minutes and rewrites every timing;
this runs the diagram cells alone, and only where one needs names from earlier cells (a
NameError or the like) runs the notebook up to it first. It prints which cells' SVG changed,
so a refresh that was meant to keep the drawing can be checked to have kept it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError


def is_diagram(cell) -> bool:
    return cell.cell_type == "code" and any("image/svg+xml" in o.get("data", {}) for o in cell.get("outputs", []))


def svgs(cell) -> list[str]:
    return [o["data"]["image/svg+xml"] for o in cell.get("outputs", []) if "image/svg+xml" in o.get("data", {})]


def refresh(path: Path) -> list[int]:
    """Re-run `path`'s diagram cells in one kernel, save their new outputs, and return the
    indices of the cells whose SVG changed."""
    notebook = nbformat.read(path, as_version=4)
    diagrams = [i for i, cell in enumerate(notebook.cells) if is_diagram(cell)]
    if not diagrams:
        return []
    work = nbformat.from_dict(notebook)  # the client writes outputs into this copy
    client = NotebookClient(work, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}})
    ran: set[int] = set()
    changed = []
    with client.setup_kernel():
        for index in diagrams:
            try:
                client.execute_cell(work.cells[index], index)
            except CellExecutionError:
                for earlier in range(index):
                    if work.cells[earlier].cell_type == "code" and earlier not in ran:
                        client.execute_cell(work.cells[earlier], earlier)
                        ran.add(earlier)
                client.execute_cell(work.cells[index], index)
            ran.add(index)
            if svgs(work.cells[index]) != svgs(notebook.cells[index]):
                changed.append(index)
            notebook.cells[index].outputs = work.cells[index].outputs
    nbformat.write(notebook, path)
    return changed


if __name__ == "__main__":
    for name in sys.argv[1:]:
        print(f"{name}: diagram cells whose SVG changed: {refresh(Path(name))}")
