"""Run an implementation's milestones chapter by chapter and print a per-chapter table.

Every chapter runs in its own pytest subprocess with a per-test timeout and a per-chapter
time limit, so an engine that hangs or crashes the interpreter costs tests, never the
report. --json and --junit write the same results for a gradebook. --checkouts DIR grades
every learner's checkout in DIR and writes one gradebook (PREFIX.csv: a row per learner, a
column per chapter; PREFIX.jsonl: a line per learner and chapter). Exit status 0 when every
milestone run passed, 1 otherwise.
"""
import json
import sys
from pathlib import Path

from course.cli import add_impl_argument
from course.grading import grade, gradebook


def add_arguments(parser):
    add_impl_argument(parser, default="engine")
    parser.add_argument("--upto", type=int, default=None, metavar="N", help="only Chapters 1..N")
    parser.add_argument("--chapter", type=int, action="append", default=None, metavar="N",
                        help="only Chapter N (repeatable)")
    parser.add_argument("--json", type=Path, default=None, metavar="FILE", help="write the results as JSON")
    parser.add_argument("--junit", type=Path, default=None, metavar="FILE", help="write JUnit XML")
    parser.add_argument("--test-timeout", type=float, default=grade.DEFAULT_TEST_TIMEOUT, metavar="S",
                        help=f"seconds one test may take (default {grade.DEFAULT_TEST_TIMEOUT:g})")
    parser.add_argument("--chapter-timeout", type=float, default=grade.DEFAULT_CHAPTER_TIMEOUT, metavar="S",
                        help=f"seconds one chapter may take (default {grade.DEFAULT_CHAPTER_TIMEOUT:g})")
    parser.add_argument("-j", "--jobs", type=int, default=1, help="chapters graded at once (default 1)")
    parser.add_argument("--tests-dir", type=Path, default=None, help="milestone files (default tests/)")
    parser.add_argument("--checkouts", type=Path, default=None, metavar="DIR",
                        help="grade every learner's checkout in DIR (each subfolder with engine/) instead of --impl")
    parser.add_argument("--gradebook", type=Path, default=Path("gradebook"), metavar="PREFIX",
                        help="with --checkouts: write PREFIX.csv and PREFIX.jsonl (default: gradebook)")


def _progress_line(chapter_grade):
    c = chapter_grade
    if c.milestone:
        print(f"  graded ch{c.chapter.number:02d}: {c.passed}/{c.total} in {c.duration:.1f}s",
              file=sys.stderr, flush=True)


def run(args):
    if args.checkouts:
        return _run_class(args)
    report = grade.grade(args.impl, upto=args.upto, chapters=args.chapter, tests_dir=args.tests_dir,
                         test_timeout=args.test_timeout, chapter_timeout=args.chapter_timeout,
                         jobs=args.jobs, on_chapter=_progress_line)
    print(grade.format_table(report))
    if args.json:
        args.json.write_text(json.dumps(grade.to_json(report), indent=2) + "\n", encoding="utf-8")
    if args.junit:
        grade.to_junit(report).write(args.junit, encoding="utf-8", xml_declaration=True)
    return 0 if report.all_passed else 1


def _run_class(args):
    results = gradebook.grade_checkouts(
        args.checkouts, on_learner=gradebook.progress_bar, upto=args.upto, chapters=args.chapter,
        tests_dir=args.tests_dir, test_timeout=args.test_timeout, chapter_timeout=args.chapter_timeout, jobs=args.jobs)
    print(file=sys.stderr)
    csv_path, jsonl_path = args.gradebook.with_suffix(".csv"), args.gradebook.with_suffix(".jsonl")
    gradebook.write_gradebook(results, csv_path, jsonl_path)
    print(csv_path.read_text(encoding="utf-8"), end="")
    print(f"wrote {csv_path} and {jsonl_path} ({len(results)} learners)")
    return 0 if all(report.all_passed for _, report in results) else 1
