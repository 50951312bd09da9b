"""Build the HTML book with Jupyter Book 1 from book.toml and the chapters' notebooks.

Written chapters appear with their saved outputs (nothing is executed); planned chapters
appear in the table of contents as placeholders. Needs `pip install -r requirements-book.txt`.
"""
import subprocess
import time
from pathlib import Path

from course import book
from course.cli import CommandError


def add_arguments(parser):
    parser.add_argument("--out", type=Path, default=book.DEFAULT_OUT, help="build folder (default build/book)")
    parser.add_argument("--source-only", action="store_true",
                        help="write the generated Jupyter Book source (config, TOC, pages) and stop")
    parser.add_argument("--verbose", action="store_true", help="show Jupyter Book's own output")


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
    return 0
