"""Write a learner's edition of the course into DIR: everything but solutions/.

The edition has engine/'s skeleton, the chapters (notebooks without the outputs that would
give a stub away), the tests, course/, run.py, the requirements, README and book.toml, and
the reference's answers the milestones compare with, recorded here by running them against
solutions/ (tests/oracle_records/; --no-record skips that, and the edition's engine
milestones then cannot run). Afterwards it checks, importing only the edition, that the
tests collect and that Chapter 1's milestone reports its stubs as not implemented yet
(--no-check skips that). --verify then proves the edition whole: every notebook runs to its
end on the bare engine/; then, the reference copied into the edition's engine/, every written
chapter's milestone runs with --impl engine there (solutions/ absent), one line per chapter,
and every notebook runs again with each check line the full course's (minutes; CI runs it).
Exit status 1 on a problem.
"""
from pathlib import Path

from course import release


def add_arguments(parser):
    parser.add_argument("dir", type=Path, help="a new (or empty) folder outside this repository")
    parser.add_argument("--no-check", action="store_true", help="write only; do not run the edition's tests")
    parser.add_argument("--no-record", action="store_true",
                        help="do not record the reference's answers (quick, but the edition's oracles cannot replay)")
    parser.add_argument("--verify", action="store_true",
                        help="afterwards, copy the reference into the edition's engine/ and run every milestone "
                             "there with --impl engine (the edition is then no longer a learner's starting point)")


def run(args):
    try:
        files, seconds = release.timed(release.write_release, args.dir,
                                       record=None if args.no_record else release.ALL_MILESTONES)
    except release.ReleaseError as exc:
        print(f"release: {exc}")
        return 1
    recorded = "" if args.no_record else ", the reference's answers recorded"
    print(f"wrote {len(files)} files to {args.dir} in {seconds:.0f}s (no solutions/{recorded})")
    if not args.no_check:
        problems = release.check_release(args.dir)
        for problem in problems:
            print(f"problem: {problem}")
        if problems:
            return 1
        print("checked: the tests collect, and Chapter 1's milestone reports its stubs as not implemented yet")
    if not args.verify:
        return 0
    (bare_problems, not_yet), seconds = release.timed(release.verify_bare_notebooks, args.dir)
    for problem in bare_problems:
        print(f"problem: {problem}")
    print(f"verify: the notebooks on the bare engine/: {len(release.chapter_notebooks(args.dir)) - len(bare_problems)}"
          f" run to their end, {not_yet} checks say NOT IMPLEMENTED YET ({seconds:.0f}s)")
    try:
        results, seconds = release.timed(release.verify_release, args.dir)
    except release.ReleaseError as exc:
        print(f"release --verify: {exc}")
        return 1
    for chapter, (passed, failed) in results.items():
        print(f"Chapter {chapter:2d}: {'PASS' if not failed else 'FAIL'} ({passed} passed, {failed} failed)")
    failing = [chapter for chapter, (_, failed) in results.items() if failed]
    print(f"verify: {len(results) - len(failing)}/{len(results)} chapters pass with the reference as engine/ and "
          f"no solutions/ ({seconds:.0f}s)" + (f"; failing: {failing}" if failing else ""))
    (problems, matched), seconds = release.timed(release.verify_reference_notebooks, args.dir)
    for problem in problems:
        print(f"problem: {problem}")
    print(f"verify: the notebooks with the reference as engine/: {matched} check lines as in the full course, "
          f"{len(problems)} problems ({seconds:.0f}s)")
    return 1 if failing or problems or bare_problems else 0
