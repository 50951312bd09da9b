"""Show stubs done per chapter for an implementation, and the milestone to run next.

A stub counts as done once its body is no longer the generated NotImplementedError.
Nothing is imported or run; `python run.py grade` runs the milestones.
"""
from course.cli import add_impl_argument
from course.grading import progress


def add_arguments(parser):
    add_impl_argument(parser, default="engine")
    parser.add_argument("--all", action="store_true", help="list planned chapters without stubs too")


def run(args):
    rows = progress.chapter_progress(args.impl)
    print(progress.format_report(args.impl, rows, show_all=args.all))
