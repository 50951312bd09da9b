"""Run the mistakes catalogue: each plausible learner mistake must fail its chapter's tests.

Every entry of course/testing/mistakes/chNN.py is made in a copy of the reference, one at a
time, and the tests that cover its stub are run against that copy. A mistake is caught when a
test fails AND its failure line names the rule (the entry's `expect` phrase). Prints one line
per mistake, a table per chapter, the stubs that have fewer than three mistakes, and exits 1
if any mistake survived, went unnamed, hung or could not run. A maintainer's tool: it needs
solutions/.
"""
from __future__ import annotations

import json
import sys
import time

from course.cli import CommandError

MINIMUM_PER_STUB = 3


def add_arguments(parser):
    parser.add_argument("--chapter", type=int, action="append", metavar="N",
                        help="only this chapter's mistakes (repeatable)")
    parser.add_argument("--stub", metavar="NAME", action="append",
                        help="only mistakes of stubs whose qualified name contains NAME (repeatable)")
    parser.add_argument("--sample", action="store_true", help="one mistake per chapter (what the suite runs)")
    parser.add_argument("--jobs", type=int, default=2, help="mistakes run at once (default 2)")
    parser.add_argument("--list", action="store_true", help="list the catalogue and its coverage; run nothing")
    parser.add_argument("--json", action="store_true", help="one JSON line per mistake instead of text")
    parser.add_argument("--table", action="store_true",
                        help="a Markdown table of every stub: its docstring's words, its mistakes, whether it is a "
                             "design stub and what the learner decides there; run nothing")


def run(args):
    from course.impl import have_reference
    from course.testing import mistakes as catalogue_module
    if not have_reference():
        raise CommandError("the mistakes catalogue is made of edits to solutions/, which this checkout lacks")
    catalogue = catalogue_module.catalogue()
    stubs = catalogue_module.reference_stubs()
    chosen = [m for chapter, entries in catalogue.items() for m in entries
              if not args.chapter or chapter in args.chapter]
    if args.sample:
        chosen = [m for m in catalogue_module.sample() if not args.chapter or
                  catalogue_module.chapter_of(m, stubs) in args.chapter]
    if args.stub:
        chosen = [m for m in chosen if any(name in m.stub for name in args.stub)]
    if args.table:
        _table(catalogue, stubs, catalogue_module.decisions(), args.chapter)
        return 0
    if args.list:
        for mistake in chosen:
            print(f"ch{catalogue_module.chapter_of(mistake, stubs):02d} {mistake.label}")
        _coverage(catalogue, stubs, args.chapter)
        return 0
    if not chosen:
        raise CommandError("no mistake matches the options")
    started = time.monotonic()

    def show(outcome):
        if args.json:
            print(json.dumps({"chapter": outcome.chapter, "file": outcome.mistake.file, "stub": outcome.mistake.stub,
                              "rule": outcome.mistake.rule, "verdict": outcome.verdict,
                              "seconds": round(outcome.seconds, 1), "message": outcome.message}), flush=True)
        else:
            print(f"{outcome.verdict:8} {outcome.seconds:5.1f}s ch{outcome.chapter:02d} {outcome.mistake.label}\n"
                  f"{'':15}-> {outcome.message}", flush=True)

    outcomes = catalogue_module.run(chosen, jobs=args.jobs, progress=show)
    by_chapter: dict[int, list] = {}
    for outcome in outcomes:
        by_chapter.setdefault(outcome.chapter, []).append(outcome)
    print(f"\n{'chapter':>7} {'mistakes':>8} {'caught':>6}  not caught")
    for chapter, found in sorted(by_chapter.items()):
        missed = [f"{o.mistake.stub} ({o.verdict})" for o in found if not o.ok]
        print(f"{chapter:>7} {len(found):>8} {sum(o.ok for o in found):>6}  {', '.join(missed)}")
    caught = sum(o.ok for o in outcomes)
    print(f"\n{caught} of {len(outcomes)} mistakes caught with the rule named, in {time.monotonic() - started:.0f} s")
    _coverage(catalogue, stubs, args.chapter)
    if caught < len(outcomes):
        for outcome in outcomes:
            if not outcome.ok and outcome.verdict in ("error", "unnamed"):
                print(f"\n--- {outcome.mistake.label} ({outcome.verdict}): end of its pytest report\n"
                      + "\n".join(outcome.log.splitlines()[-25:]), file=sys.stderr)
        return 1
    return 0


def _coverage(catalogue, stubs, chapters) -> None:
    counts: dict[tuple[str, str], int] = {key: 0 for key in stubs}
    for entries in catalogue.values():
        for mistake in entries:
            counts[(mistake.file, mistake.stub)] = counts.get((mistake.file, mistake.stub), 0) + 1
    wanted = [key for key in stubs if not chapters or stubs[key].chapter in chapters]
    short = [key for key in wanted if counts[key] < MINIMUM_PER_STUB]
    print(f"coverage: {len(wanted) - len(short)} of {len(wanted)} stubs have at least {MINIMUM_PER_STUB} mistakes")
    for file, qualname in short:
        print(f"  ch{stubs[(file, qualname)].chapter:02d} {file}::{qualname}: {counts[(file, qualname)]}")


def docstring_words(source: str, qualname: str) -> int:
    """How many words the docstring of the function `qualname` in `source` has."""
    import ast
    scope: list[ast.stmt] = ast.parse(source).body
    node: ast.AST | None = None
    for part in qualname.split("."):
        node = next(n for n in scope if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                    and n.name == part)
        scope = node.body
    assert isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    return len((ast.get_docstring(node) or "").split())


def _table(catalogue, stubs, decisions, chapters) -> None:
    from course.testing.mistakes import REFERENCE
    counts: dict[tuple[str, str], int] = {}
    for entries in catalogue.values():
        for mistake in entries:
            counts[(mistake.file, mistake.stub)] = counts.get((mistake.file, mistake.stub), 0) + 1
    print("| ch | stub | design | docstring words | mistakes | what the learner decides |")
    print("|---:|---|:---:|---:|---:|---|")
    sources: dict[str, str] = {}
    for (file, qualname), stub in sorted(stubs.items(), key=lambda item: (item[1].chapter, item[1].path,
                                                                          item[1].lineno)):
        if chapters and stub.chapter not in chapters:
            continue
        source = sources.setdefault(file, (REFERENCE / file).read_text(encoding="utf-8"))
        chapter = decisions.get(stub.chapter)
        decides = chapter.decides.get(qualname, "(not stated)") if chapter else "(not stated)"
        design = "yes" if chapter and qualname in chapter.design else ""
        print(f"| {stub.chapter} | `{file}::{qualname}` | {design} | {docstring_words(source, qualname)} | "
              f"{counts.get((file, qualname), 0)} | {decides} |")
