"""Write a learner's edition of the course into DIR: everything but solutions/.

The edition has engine/'s skeleton, the chapters, the tests, course/, run.py, the
requirements, README and book.toml, and leaves out the reference answers (solutions/) and
the maintainer's tooling. Afterwards it checks, importing only the edition, that the tests
collect and that Chapter 1's milestone reports its stubs as not implemented yet
(--no-check skips that). Exit status 1 when the check finds a problem.
"""
from pathlib import Path

from course import release


def add_arguments(parser):
    parser.add_argument("dir", type=Path, help="a new (or empty) folder outside this repository")
    parser.add_argument("--no-check", action="store_true", help="write only; do not run the edition's tests")


def run(args):
    try:
        files = release.write_release(args.dir)
    except release.ReleaseError as exc:
        print(f"release: {exc}")
        return 1
    print(f"wrote {len(files)} files to {args.dir} (no solutions/)")
    if args.no_check:
        return 0
    problems = release.check_release(args.dir)
    for problem in problems:
        print(f"problem: {problem}")
    if problems:
        return 1
    print("checked: the tests collect, and Chapter 1's milestone reports its stubs as not implemented yet")
    return 0
