"""The course manifest, book.toml, as Python objects.

book.toml is the only list of chapters in the repository: run.py, the tests, the progress
report, grading and the book build all read it through this module. Invariants checked on
load: chapter numbers are 1..N without gaps, slugs are unique, every chapter names a part
that exists, and every status is "written" or "planned".
"""
from __future__ import annotations

import tomllib
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BOOK_TOML = ROOT / "book.toml"
STATUSES = ("written", "planned")


class ManifestError(ValueError):
    """book.toml breaks one of the manifest's invariants."""


@dataclass(frozen=True)
class Part:
    id: str
    title: str


@dataclass(frozen=True)
class Chapter:
    number: int
    slug: str
    title: str
    part: str
    status: str
    # A chapter that teaches by measuring (no code for the learner to write) sets
    # `stubs = false` in book.toml; every other written chapter must own at least one stub.
    has_stubs: bool = True

    @property
    def written(self) -> bool:
        return self.status == "written"

    @property
    def dirname(self) -> str:
        """`05-attention`: the chapter's folder under chapters/ and its notebook stem."""
        return f"{self.number:02d}-{self.slug}"

    @property
    def notebook_md(self) -> str:
        """Path of the MyST notebook, relative to the repository root."""
        return f"chapters/{self.dirname}/{self.dirname}.md"

    @property
    def notebook_ipynb(self) -> str:
        return f"chapters/{self.dirname}/{self.dirname}.ipynb"

    @property
    def milestone(self) -> str:
        """`tests/test_ch05_attention.py`: the chapter's milestone file, relative to the root."""
        return f"tests/test_ch{self.number:02d}_{self.slug.replace('-', '_')}.py"


@dataclass(frozen=True)
class Manifest:
    title: str
    default_impl: str
    parts: tuple[Part, ...]
    chapters: tuple[Chapter, ...]

    def chapter(self, number: int) -> Chapter:
        for chapter in self.chapters:
            if chapter.number == number:
                return chapter
        raise KeyError(f"book.toml has no Chapter {number} (it lists 1-{len(self.chapters)})")

    def part(self, part_id: str) -> Part:
        for part in self.parts:
            if part.id == part_id:
                return part
        raise KeyError(f"book.toml has no part {part_id!r}")

    def in_part(self, part_id: str) -> list[Chapter]:
        return [c for c in self.chapters if c.part == part_id]

    @property
    def numbers(self) -> frozenset[int]:
        return frozenset(c.number for c in self.chapters)

    @property
    def written(self) -> list[Chapter]:
        return [c for c in self.chapters if c.written]


def parse(text: str, source: str = "book.toml") -> Manifest:
    """Build and validate a Manifest from the text of a book.toml."""
    data = tomllib.loads(text)
    course = data.get("course", {})
    try:
        parts = tuple(Part(id=str(p["id"]), title=str(p["title"])) for p in data.get("parts", []))
        chapters = tuple(
            Chapter(number=int(c["number"]), slug=str(c["slug"]), title=str(c["title"]),
                    part=str(c["part"]), status=str(c["status"]), has_stubs=bool(c.get("stubs", True)))
            for c in data.get("chapters", [])
        )
    except KeyError as missing:
        raise ManifestError(f"{source}: an entry lacks the field {missing}") from None
    _validate(parts, chapters, source)
    return Manifest(title=str(course.get("title", "")),
                    default_impl=str(course.get("default_impl", "solutions")),
                    parts=parts, chapters=chapters)


def _validate(parts: tuple[Part, ...], chapters: tuple[Chapter, ...], source: str) -> None:
    if not chapters:
        raise ManifestError(f"{source} lists no chapters")
    numbers = [c.number for c in chapters]
    if numbers != list(range(1, len(chapters) + 1)):
        raise ManifestError(f"{source}: chapters must be numbered 1..{len(chapters)} in order, got {numbers}")
    slugs = [c.slug for c in chapters]
    duplicates = sorted({s for s in slugs if slugs.count(s) > 1})
    if duplicates:
        raise ManifestError(f"{source}: duplicate slugs {duplicates}")
    part_ids = {p.id for p in parts}
    for chapter in chapters:
        if chapter.part not in part_ids:
            raise ManifestError(f"{source}: Chapter {chapter.number} names part {chapter.part!r}, "
                                f"which is not among the parts {sorted(part_ids)}")
        if chapter.status not in STATUSES:
            raise ManifestError(f"{source}: Chapter {chapter.number} has status {chapter.status!r}; "
                                f"use one of {STATUSES}")


def load(path: Path | str | None = None) -> Manifest:
    """Read book.toml (the repository's own unless a path is given)."""
    path = Path(path) if path is not None else BOOK_TOML
    return _load_cached(str(path.resolve()), path.stat().st_mtime_ns)


@lru_cache(maxsize=8)
def _load_cached(path: str, mtime_ns: int) -> Manifest:
    # Keyed by mtime so a long-lived process (a notebook kernel) sees edits to book.toml.
    return parse(Path(path).read_text(encoding="utf-8"), source=path)
