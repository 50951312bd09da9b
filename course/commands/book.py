"""Build the HTML book with Jupyter Book 1 from book.toml and the chapters' notebooks.

Written chapters appear with their saved outputs (nothing is executed); planned chapters
appear in the table of contents as placeholders. Needs `pip install -r requirements-book.txt`.
--check then reads the built HTML and fails (status 2) when a page fetches anything from
another host, refers to a file of the book that is not there, a written chapter's page is
missing or has no figure, or math is on a page without the bundled MathJax: the book must
read offline. It fails too when a figure the text quotes from a notebook's output (marked
`<!-- measured: name -->`, course.book.measured) is not what that output shows. It then measures every figure at
the width the book shows it (at most the 784 px column) and fails when a label would be
under 9 px there (Markdown tables that cannot fit the column are reported as warnings).
Where headless Chromium is available it then serves the book on a local port, opens every
page at a laptop's width and fails on a table wider than the column, code that scrolls
sideways, a figure without alt text, a console error, a file the page asked for that did
not load (MathJax's fonts included), or inline math off the text's baseline or out of scale.
"""
import subprocess
import time
from pathlib import Path

from course import book
from course.book import measured
from course.cli import CommandError


def add_arguments(parser):
    parser.add_argument("--out", type=Path, default=book.DEFAULT_OUT, help="build folder (default build/book)")
    parser.add_argument("--source-only", action="store_true",
                        help="write the generated Jupyter Book source (config, TOC, pages) and stop")
    parser.add_argument("--verbose", action="store_true", help="show Jupyter Book's own output")
    parser.add_argument("--check", action="store_true",
                        help="after building, check that the book reads offline and that every figure's labels "
                             "are readable in the column (status 2 if not)")


def run(args):
    if args.source_only:
        print(f"book source written to {book.build_source(args.out / 'src')}")
        return 0
    started = time.monotonic()
    try:
        html = book.build(args.out, quiet=not args.verbose)
    except FileNotFoundError as exc:
        raise CommandError(str(exc)) from None
    except subprocess.CalledProcessError as exc:
        raise CommandError(f"jupyter-book failed with status {exc.returncode}; rerun with --verbose") from None
    print(f"built {html / 'index.html'} in {time.monotonic() - started:.0f}s")
    if args.check:
        problems = book.offline_problems(html, book.manifest_module.load())
        if problems:
            raise CommandError(f"{len(problems)} problem(s) reading the book offline:\n  " + "\n  ".join(problems[:40]))
        print("offline check: no remote script or style, no missing file, every written chapter has a figure, "
              "math is bundled")
        quotes = measured.quoted_figure_problems(book.manifest_module.load())
        if quotes:
            raise CommandError(f"{len(quotes)} quoted figure(s) not in the output they name:\n  " + "\n  ".join(quotes))
        print("quote check: every figure the text marks as measured is in the saved output it names")
        layout = book.figure_and_table_problems(book.manifest_module.load())
        tables = [p for p in layout if "table" in p]
        for problem in tables:           # estimated from the Markdown: reported, not fatal
            print(f"warning: {problem}")
        figures = [p for p in layout if p not in tables]
        if figures:
            raise CommandError(f"{len(figures)} figure(s) with labels under {book.MIN_LABEL_PX:g} px in the "
                               f"{book.COLUMN_PX} px column:\n  " + "\n  ".join(figures))
        print(f"layout check: every figure's labels are at least {book.MIN_LABEL_PX:g} px in the "
              f"{book.COLUMN_PX} px column")
        started = time.monotonic()
        on_page = book.page_problems(html)
        if on_page is None:
            print("page check skipped: no headless Chromium could be started (it needs selenium and "
                  "chromedriver: apt-get install chromium chromium-driver)")
        elif on_page:
            raise CommandError(f"{len(on_page)} problem(s) on the page:\n  " + "\n  ".join(on_page[:60]))
        else:
            print(f"page check ({time.monotonic() - started:.0f}s): no table wider than the column, no code "
                  "that scrolls sideways, every figure has alt text, no console error, every file loaded, "
                  "inline math on the baseline")
    return 0
