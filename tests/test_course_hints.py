"""Every stub of every written chapter has three progressive hints in its chapter's notebook,
collapsed (`:class: dropdown`), in this order and with these titles:

    Hint 1: the idea (name, ...)
    Hint 2: the structure (name, ...)
    Hint 3: near-pseudocode (name, ...)

The parentheses name the stubs the hint is for: a stub's qualified name (`Qwen3MLP.forward`),
or its bare name where no other stub of the chapter shares it. Further dropdowns for a stub
(`Hint 4: the trap (name)`) are welcome. The docstring is the contract; the walk-through from
the idea to near-pseudocode lives in these hints, so a learner takes only as much help as needed."""
import re
from collections import Counter

from course import manifest, skeleton
from course.manifest import ROOT

DROPDOWN = re.compile(r"```\{admonition\} ([^\n]*)\n\s*:class: dropdown")
HINT_TITLE = re.compile(r"Hint (\d+): ([^()]+?) \(([^()]+)\)")
LEVELS = {1: "the idea", 2: "the structure", 3: "near-pseudocode"}


def hint_titles(chapter) -> list[str]:
    text = (ROOT / chapter.notebook_md).read_text(encoding="utf-8")
    return [title.strip() for title in DROPDOWN.findall(text) if "hint" in title.lower()]


def stubs_by_chapter() -> dict[int, list[str]]:
    chapters: dict[int, list[str]] = {}
    for stubs in skeleton.stubs_of_tree(ROOT / "solutions").values():
        for stub in stubs:
            chapters.setdefault(stub.chapter, []).append(stub.qualname)
    return chapters


def test_every_hint_title_has_the_common_form():
    book = manifest.load()
    wrong = []
    for number in stubs_by_chapter():
        for title in hint_titles(book.chapter(number)):
            match = HINT_TITLE.fullmatch(title)
            level = match and int(match.group(1))
            if not match or (level in LEVELS and match.group(2) != LEVELS[level]):
                wrong.append(f"Chapter {number}: {title!r}")
    assert not wrong, ("hint dropdowns whose title is not 'Hint K: <level> (<stubs>)' with levels "
                       f"{LEVELS}: " + "; ".join(wrong))


def test_every_stub_has_three_progressive_hints():
    book = manifest.load()
    missing = []
    for number, qualnames in sorted(stubs_by_chapter().items()):
        bare = Counter(q.rpartition(".")[2] for q in qualnames)
        found: dict[str, list[int]] = {q: [] for q in qualnames}
        for title in hint_titles(book.chapter(number)):
            match = HINT_TITLE.fullmatch(title)
            if not match:
                continue
            level, named = int(match.group(1)), {name.strip() for name in match.group(3).split(",")}
            if level in LEVELS and match.group(2) != LEVELS[level]:
                continue        # reported by the test above
            for qualname in qualnames:
                short = qualname.rpartition(".")[2]
                if qualname in named or (bare[short] == 1 and short in named):
                    found[qualname].append(level)
        for qualname, levels in found.items():
            if [level for level in levels if level in LEVELS] != sorted(LEVELS):
                missing.append(f"Chapter {number}: {qualname} has hints {levels}")
    assert not missing, ("stubs without hints 1, 2, 3 (the idea, the structure, near-pseudocode), "
                         "in that order, in their chapter's notebook: " + "; ".join(missing))
