"""Regenerate .github/classroom/autograding.json (GitHub Classroom: one test per chapter
milestone, with points) from book.toml (--check: exit 1 if stale)."""
from course.grading import classroom
from course.manifest import ROOT


def add_arguments(parser):
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if the file is stale")


def run(args):
    path = ROOT / classroom.PATH
    if args.check:
        if not path.is_file() or path.read_text(encoding="utf-8") != classroom.render():
            print(f"{classroom.PATH} differs from book.toml: run `python run.py classroom`")
            return 1
        print(f"{classroom.PATH} matches book.toml")
        return 0
    print(f"{classroom.PATH} updated" if classroom.update() else f"{classroom.PATH} already matches book.toml")
    return 0
