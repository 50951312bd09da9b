"""Write engine/ from solutions/: every stub body becomes a NotImplementedError.

Refuses to overwrite a stub you have filled in unless --force is given. With --check,
writes nothing and exits 1 if engine/ differs from the generated skeleton anywhere outside
stub bodies (filled stubs are fine), naming each file and function.
"""
from pathlib import Path

from course import skeleton
from course.manifest import ROOT


def add_arguments(parser):
    parser.add_argument("--check", action="store_true",
                        help="compare instead of writing; exit 1 on any difference outside stub bodies")
    parser.add_argument("--force", action="store_true", help="overwrite filled stubs")
    parser.add_argument("--source", type=Path, default=ROOT / "solutions", help="default: solutions/")
    parser.add_argument("--target", type=Path, default=ROOT / "engine", help="default: engine/")


def run(args):
    if args.check:
        problems = skeleton.check_tree(args.source, args.target)
        for problem in problems:
            print(problem)
        if problems:
            print(f"\n{len(problems)} difference(s); `python run.py skeleton` regenerates engine/ "
                  f"(filled stubs are kept safe unless --force).")
            return 1
        print(f"{args.target.name}/ is the skeleton of {args.source.name}/ (stub bodies aside)")
        return 0
    report = skeleton.write_skeleton(args.source, args.target, force=args.force)
    for rel in report.written:
        print(f"wrote   {args.target.name}/{rel}")
    for rel in report.removed:
        print(f"removed {args.target.name}/{rel}")
    stubs = sum(len(s) for s in skeleton.stubs_of_tree(args.source).values())
    print(f"{args.target.name}/ is up to date: {stubs} stubs "
          f"({len(report.written)} written, {len(report.removed)} removed)")
    return 0
