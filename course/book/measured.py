"""Figures the text quotes from a notebook's own outputs, checked against those outputs.

A chapter that quotes a measured number ties it to the cell that printed it: the number is
followed at once by an HTML comment (invisible in JupyterLab and in the book)

    the engine made 4<!-- measured: hangups "client 3" --> tokens for it

and the code cell carries the name in its option block (`measured: hangups`; in the .ipynb,
the cell's metadata). The optional quoted text keeps only the output lines that contain it
(a row of a table), and `NN:name` names a cell of Chapter NN. The number matches when one of
the saved output's numbers rounds to it at the precision it is written with: "1.8" matches
1.79, "3" matches 3 and 3.4, "2.8e-05" matches 2.84e-05; thousands separators and a
trailing % or x are ignored. So re-running a notebook whose numbers move, without rewriting
the sentences that quote them, fails `quoted_figure_problems` (`python run.py book --check`
and tests/test_course_readme_book.py).
"""
from __future__ import annotations

import json
import re
from decimal import Decimal
from pathlib import Path

from course.manifest import ROOT, Manifest

# The code cell option that names a cell whose outputs the text quotes.
CELL_KEY = "measured"
_NUMBER = r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?"
# A quoted number, an optional unit, then the marker.
MARKER = re.compile(rf"(?P<number>{_NUMBER})(?:\s?(?:%|x|[A-Za-zµ/]+))?\s*"
                    r'<!--\s*measured:\s*(?:(?P<chapter>\d+):)?(?P<name>[\w-]+)(?:\s+"(?P<row>[^"]*)")?\s*-->')
# A marker whose number MARKER could not read.
ANY_MARKER = re.compile(r"<!--\s*measured:")
OUTPUT_NUMBER = re.compile(rf"(?<![\w.]){_NUMBER}")


def _value(number: str) -> Decimal:
    return Decimal(number.replace(",", ""))


def matches(quoted: str, printed: str) -> bool:
    """Whether `printed` (a number as an output shows it) rounds to `quoted` at the
    precision `quoted` is written with."""
    target = _value(quoted)
    exponent = target.as_tuple().exponent
    assert isinstance(exponent, int), quoted                  # a number, not NaN or infinity
    half_step = Decimal(1).scaleb(exponent) / 2
    return abs(_value(printed) - target) <= half_step


def output_text(cell: dict) -> str:
    """Everything a code cell printed, as text: streams and the text/plain of its results."""
    pieces = []
    for output in cell.get("outputs", []):
        if output.get("output_type") == "stream":
            pieces.append(output.get("text", ""))
        else:
            pieces.append(output.get("data", {}).get("text/plain", ""))
    # Each output on lines of its own: two tables displayed one after the other would
    # otherwise run a row of the first and the header of the second together.
    texts = ["".join(piece) if isinstance(piece, list) else piece for piece in pieces]
    return "".join(text if text.endswith("\n") or not text else text + "\n" for text in texts)


def named_outputs(notebook: Path) -> dict[str, str]:
    """{name: printed text} of every code cell of a saved notebook that has a name."""
    cells = json.loads(notebook.read_text(encoding="utf-8")).get("cells", [])
    return {cell["metadata"][CELL_KEY]: output_text(cell) for cell in cells
            if cell.get("cell_type") == "code" and CELL_KEY in cell.get("metadata", {})}


def quoted_figure_problems(manifest: Manifest, root: Path = ROOT) -> list[str]:
    """Every marked figure of every written chapter's text that its named output does not
    show, each as 'chapter file:line: why'. Empty when the text and the outputs agree."""
    notebooks = {chapter.number: root / "chapters" / chapter.dirname / f"{chapter.dirname}.ipynb"
                 for chapter in manifest.written}
    outputs: dict[int, dict[str, str]] = {}
    problems = []
    for chapter in manifest.written:
        source = notebooks[chapter.number].with_suffix(".md")
        for line_number, line in enumerate(source.read_text(encoding="utf-8").splitlines(), start=1):
            where = f"{source.relative_to(root)}:{line_number}"
            found = list(MARKER.finditer(line))
            if len(found) != len(ANY_MARKER.findall(line)):
                problems.append(f"{where}: a `measured:` marker not right after a number")
            for marker in found:
                number = int(marker["chapter"] or chapter.number)
                if number not in notebooks:
                    problems.append(f"{where}: Chapter {number} is not a written chapter")
                    continue
                if number not in outputs:
                    outputs[number] = named_outputs(notebooks[number])
                text = outputs[number].get(marker["name"])
                if text is None:
                    problems.append(f"{where}: no code cell of Chapter {number} is named {marker['name']!r} "
                                    f"(`{CELL_KEY}: {marker['name']}` in its options)")
                    continue
                if marker["row"] is not None:
                    text = "\n".join(row for row in text.splitlines() if marker["row"] in row)
                if not any(matches(marker["number"], printed) for printed in OUTPUT_NUMBER.findall(text)):
                    shown = f" in its lines with {marker['row']!r}" if marker["row"] is not None else ""
                    problems.append(f"{where}: the text quotes {marker['number']} but the saved output of "
                                    f"Chapter {number}'s {marker['name']!r}{shown} shows no such number")
    return problems
