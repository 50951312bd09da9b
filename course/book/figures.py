"""Alt text and captions for the book's figures, written when the book is built.

A chapter's figures are the image outputs of its notebook. Jupyter Book names each image
file by the SHA-256 of its bytes and, with nothing better, uses that path as the image's
alt text. `figure_texts` finds, for every image output, words that say what it shows:

1. the cell's own `figure` metadata (`caption`, `alt`), where a chapter gives it: in the
   MyST file, `figure: {caption: ..., alt: ...}` in the code cell's option block (the
   course's key: myst-nb's own `mystnb.figure` would caption the picture a second time);
2. else the docstring of the drawing function the cell calls (course/diagrams/, a
   chapter's chNN_views.py): its first sentence is the caption, its first paragraph the
   alt text;
3. else, for a plot drawn in the cell, its title and axis labels as written in the code;
4. else the first sentence of the text just above the cell.

`describe_figures` then puts them on the built page: the alt attribute, and a caption
"Figure N.k" under the picture.
"""
from __future__ import annotations

import ast
import base64
import hashlib
import html
import os
import re
from functools import cache
from mimetypes import guess_extension
from pathlib import Path

from course.manifest import ROOT

# Modules whose public functions draw a figure: their docstrings say what it shows.
DRAWING_MODULES = ("course/diagrams/__init__.py", "course/diagrams/ch*.py", "chapters/*/ch*_views.py")
# Calls in a plotting cell whose first string argument names what is drawn.
TITLE_CALLS = ("set_title", "title", "suptitle")
X_LABEL_CALLS = ("set_xlabel", "xlabel")
Y_LABEL_CALLS = ("set_ylabel", "ylabel")
IMAGE_TAG = re.compile(r'<img alt="[^"]*" src="(?P<src>[^"]*/_images/(?P<name>[0-9a-f]{64}\.\w+))"(?P<rest>[^>]*)>')


@cache
def drawing_docstrings(root: Path = ROOT) -> dict[str, str]:
    """{function name: docstring} of every public function in the drawing modules."""
    found = {}
    for pattern in DRAWING_MODULES:
        for path in sorted(root.glob(pattern)):
            for node in ast.parse(path.read_text(encoding="utf-8")).body:
                if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
                    doc = ast.get_docstring(node)
                    if doc and node.name != "show":
                        found[node.name] = doc
    return found


def image_file_name(mime: str, content) -> str:
    """The name myst-nb gives an image output's file: SHA-256 of its bytes, then the
    extension (myst_nb.core.render.render_image)."""
    text = content if isinstance(content, str) else "".join(content)
    if mime in ("image/png", "image/jpeg", "image/gif"):
        data = base64.b64decode(text)
    else:
        data = os.linesep.join(text.splitlines()).encode("utf-8")
    extension = guess_extension(mime) or "." + mime.rsplit("/")[-1]
    return hashlib.sha256(data).hexdigest() + (".jpeg" if extension == ".jpe" else extension)


def one_line(text: str) -> str:
    """Text on one line, with Markdown's marks ([link](target), **bold**, `code`) removed:
    alt text and captions are plain text."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    return " ".join(text.replace("**", "").replace("`", "").split())


def first_sentence(text: str) -> str:
    """Up to the first full stop that ends a word and is followed by a space or the end (not
    one inside serve.engine, 0.5 or "q . k"), with the stop; a closing colon becomes one."""
    text = one_line(text)
    match = re.search(r"(?<=\S)\.(\s|$)", text)
    sentence = text[:match.start() + 1] if match else text
    return sentence[:-1] + "." if sentence.endswith(":") else sentence


def spoken(node: ast.expr) -> str | None:
    """A string argument as a reader would see it: f-string fields become '...'."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(part.value if isinstance(part, ast.Constant) and isinstance(part.value, str) else "..."
                       for part in node.values)
    return None


def plot_words(source: str) -> tuple[list[str], list[str], list[str]]:
    """(titles, x labels, y labels) written in a plotting cell's code."""
    titles: list[str] = []
    x_labels: list[str] = []
    y_labels: list[str] = []
    try:
        tree = ast.parse("\n".join(line for line in source.splitlines() if not line.lstrip().startswith(("%", "!"))))
    except SyntaxError:
        return titles, x_labels, y_labels
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            words = spoken(node.args[0])
            if not words:
                continue
            for names, into in ((TITLE_CALLS, titles), (X_LABEL_CALLS, x_labels), (Y_LABEL_CALLS, y_labels)):
                if node.func.attr in names and words not in into:
                    into.append(one_line(words))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "set":
            for keyword in node.keywords:
                words = spoken(keyword.value)
                if words and keyword.arg in ("title", "xlabel", "ylabel"):
                    {"title": titles, "xlabel": x_labels, "ylabel": y_labels}[keyword.arg].append(one_line(words))
    return titles, x_labels, y_labels


def described(cell: dict, text_above: str, root: Path = ROOT) -> tuple[str, str]:
    """(alt text, caption) for the figure(s) of one code cell."""
    written = cell.get("metadata", {}).get("figure", {})
    alt, caption = written.get("alt"), written.get("caption")
    if alt or caption:
        return one_line(alt or caption), one_line(caption or alt)
    source = cell["source"] if isinstance(cell["source"], str) else "".join(cell["source"])
    docs = drawing_docstrings(root)
    drawn = [name for name in re.findall(r"\b([A-Za-z_]\w*)\s*\(", source) if name in docs]
    if drawn:                               # the last drawing call makes the figure
        paragraph = one_line(docs[drawn[-1]].split("\n\n")[0])
        return paragraph, first_sentence(paragraph)
    titles, x_labels, y_labels = plot_words(source)
    if titles or x_labels or y_labels:
        # Words with a computed part ("layer ..., head ...") would be read out with their
        # placeholders: the text above says more.
        titles, x_labels, y_labels = ([words for words in found if "..." not in words]
                                      for found in (titles, x_labels, y_labels))
        caption = "; ".join(titles) or first_sentence(text_above) or "A plot"
        axes = []
        if x_labels:
            axes.append("horizontal axis: " + ", ".join(x_labels))
        if y_labels:
            axes.append("vertical axis: " + ", ".join(y_labels))
        alt = f"Plot: {caption}" + (f" ({'; '.join(axes)})" if axes else "")
        return alt, caption
    sentence = first_sentence(text_above) or "A figure computed by the cell above"
    return sentence, sentence


def figure_texts(notebook: dict, chapter_number: int, root: Path = ROOT) -> dict[str, tuple[str, str]]:
    """{image file name: (alt text, caption "Figure N.k: ...")} for one chapter's notebook."""
    texts: dict[str, tuple[str, str]] = {}
    text_above, number = "", 0
    for cell in notebook.get("cells", []):
        if cell.get("cell_type") == "markdown":
            source = cell["source"] if isinstance(cell["source"], str) else "".join(cell["source"])
            paragraphs = [p for p in source.split("\n\n")     # prose, not headings, code or lists
                          if p.strip() and not p.lstrip().startswith(("#", "```", ":::", "- ", "* ", "1. "))]
            text_above = paragraphs[-1] if paragraphs else text_above
            continue
        # One output is one figure, whatever number of formats it comes in (SVG and PNG).
        figures = [[(mime, content) for mime, content in output.get("data", {}).items() if mime.startswith("image/")]
                   for output in cell.get("outputs", [])]
        figures = [formats for formats in figures if formats]
        if not figures:
            continue
        alt, caption = described(cell, text_above, root)
        for formats in figures:
            number += 1
            for mime, content in formats:
                texts[image_file_name(mime, content)] = (alt, f"Figure {chapter_number}.{number}: {caption}")
    return texts


def describe_figures(page: str, texts: dict[str, tuple[str, str]]) -> str:
    """The HTML of a built page with each known image given its alt text and a caption."""
    def replace(match: re.Match) -> str:
        known = texts.get(match.group("name"))
        if known is None:
            return match.group(0)
        alt, caption = (html.escape(t, quote=True) for t in known)
        return (f'<figure class="course-figure"><img alt="{alt}" src="{match.group("src")}"{match.group("rest")}>'
                f"<figcaption>{caption}</figcaption></figure>")
    return IMAGE_TAG.sub(replace, page)
