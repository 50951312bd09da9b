"""The chapters' text as stored: what a reader would see garbled is caught here, before the book."""
import json
import re

from course.manifest import ROOT

# Every C0 control character but the newline, DEL, and the C1 range. A TAB is among them:
# it is how "\times" or "\theta" comes out when LaTeX passes through a non-raw Python string
# ("$R \times V$" renders as "R imes V"), and code cells indent with spaces.
CONTROL = re.compile(r"[\x00-\x09\x0b-\x1f\x7f-\x9f]")


def chapter_texts():
    """(where, text) for every chapter's MyST file, every reference page, and every cell
    source of every chapter notebook (markdown and code alike)."""
    for path in sorted((ROOT / "chapters").rglob("*.md")):
        if ".ipynb_checkpoints" not in path.parts:
            yield path.relative_to(ROOT).as_posix(), path.read_text(encoding="utf-8")
    for path in sorted((ROOT / "chapters").rglob("*.ipynb")):
        if ".ipynb_checkpoints" in path.parts:
            continue
        cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
        for index, cell in enumerate(cells):
            source = cell["source"] if isinstance(cell["source"], str) else "".join(cell["source"])
            yield f"{path.relative_to(ROOT).as_posix()} cell {index} ({cell['cell_type']})", source


def control_characters(where, text):
    found = []
    for number, line in enumerate(text.split("\n"), 1):
        for match in CONTROL.finditer(line):
            start = max(0, match.start() - 25)
            found.append(f"{where}, line {number}: {match.group()!r} in {line[start:match.end() + 25]!r}")
    return found


def test_chapter_sources_hold_no_control_characters():
    found = [problem for where, text in chapter_texts() for problem in control_characters(where, text)]
    assert not found, ("a chapter's text holds control characters (a TAB where a backslash was meant, "
                       "as in \\times written through a non-raw Python string):\n" + "\n".join(found))


def test_the_check_sees_a_tab_where_a_backslash_was_meant():
    assert control_characters("x.md", "fine\n$R \times V$ costs") == \
        ["x.md, line 2: '\\t' in '$R \\times V$ costs'"]
    assert control_characters("x.md", "plain $R \\times V$\n\n  indented\r\n") != []
    assert control_characters("x.md", "plain $R \\times V$\n\n  indented\n") == []
