"""Regenerate the chapter list in README.md from book.toml (--check: exit 1 if stale)."""
from course.book import readme
from course.manifest import ROOT


def add_arguments(parser):
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if the list is stale")


def run(args):
    path = ROOT / "README.md"
    if args.check:
        text = path.read_text(encoding="utf-8")
        if readme.render(text) != text:
            print("README.md's chapter list differs from book.toml: run `python run.py readme`")
            return 1
        print("README.md's chapter list matches book.toml")
        return 0
    print("README.md updated" if readme.update(path) else "README.md already matches book.toml")
    return 0
