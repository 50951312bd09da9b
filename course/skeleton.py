"""Stubs and the skeleton: engine/ is solutions/ with every stub body replaced.

A stub is a function or method whose docstring contains "(Your engine: Chapter N)". Its
body is every line after the docstring through the end of its last statement. Generating
the skeleton replaces exactly those lines by one line,

    raise NotImplementedError("Your engine: Chapter N: <qualified name>")

indented like the body, and leaves every other byte of every file alone. Files without
stubs, and files that are not Python, are copied byte for byte; caches are skipped.

The same transformation, limited to the stubs of chapters after N, produces the gated
packages `solutions@N` (see course.impl). Because the positions come from the AST of the
source being transformed, a learner's filled bodies of any length are found just as well
as the reference's, which is what lets `check` ignore them.
"""
from __future__ import annotations

import ast
import difflib
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

STUB_MARKER = re.compile(r"\(Your engine: Chapter (\d+)\)")
# Anything that looks like an attempt at a marker; used to catch typos that would
# otherwise silently leave a stub in the learner's engine fully implemented.
LOOSE_MARKER = re.compile(r"your\s+engine\s*:", re.IGNORECASE)
SKIPPED_DIRS = frozenset({"__pycache__", ".pytest_cache", ".ipynb_checkpoints", ".mypy_cache",
                          ".ruff_cache"})
SKIPPED_SUFFIXES = (".pyc", ".pyo")
_LINE = re.compile(r"[^\r\n]*(?:\r\n|\r|\n)|[^\r\n]+\Z")


class SkeletonError(ValueError):
    """A stub cannot be transformed (bad marker, unknown chapter, unparsable layout)."""


class SkeletonConflict(RuntimeError):
    """Writing the skeleton would destroy filled stubs; the message lists them."""


def raise_statement(chapter: int, qualname: str) -> str:
    """The single statement a generated stub body consists of."""
    return f'raise NotImplementedError("Your engine: Chapter {chapter}: {qualname}")'


@dataclass(frozen=True)
class Stub:
    """One stub in one source text. Line indices are 0-based into `split_lines(source)`;
    the body is lines[body_start:body_end] (empty when the function has only a docstring)."""
    path: str
    qualname: str
    chapter: int
    lineno: int          # 1-based line of the `def`, for messages
    body_start: int
    body_end: int
    indent: str

    @property
    def statement(self) -> str:
        return raise_statement(self.chapter, self.qualname)

    def body(self, lines: list[str]) -> str:
        return "".join(lines[self.body_start:self.body_end])

    def is_filled(self, lines: list[str]) -> bool:
        """True when the body is anything but the generated raise (whitespace aside)."""
        return self.body(lines).strip() != self.statement


def split_lines(source: str) -> list[str]:
    """Lines with their endings, split exactly where Python's tokenizer counts lines
    (str.splitlines would also split on form feeds and other separators)."""
    return _LINE.findall(source)


def _newline_of(lines: list[str]) -> str:
    for line in lines:
        if line.endswith("\r\n"):
            return "\r\n"
        if line.endswith(("\n", "\r")):
            return line[-1]
    return "\n"


class _StubFinder(ast.NodeVisitor):
    def __init__(self, path: str, lines: list[str]):
        self.path = path
        self.lines = lines
        self.scope: list[str] = []
        self.stubs: list[Stub] = []
        self.errors: list[str] = []
        self.inside_stub = 0

    def _where(self, node: ast.stmt) -> str:
        return f"{self.path}:{node.lineno}"

    def visit_Module(self, node: ast.Module) -> None:
        self._reject_marker(node, "a module docstring")
        self.generic_visit(node)

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self._reject_marker(node, f"the docstring of class {node.name}")
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    def visit_FunctionDef(self, node) -> None:
        qualname = ".".join(self.scope + [node.name])
        doc = ast.get_docstring(node, clean=False) or ""
        markers = {int(m) for m in STUB_MARKER.findall(doc)}
        if LOOSE_MARKER.search(doc) and not markers:
            self.errors.append(f"{self._where(node)}: {qualname}: docstring mentions 'Your engine:' "
                               f"but not in the form '(Your engine: Chapter N)'")
        elif len(markers) > 1:
            self.errors.append(f"{self._where(node)}: {qualname}: names several chapters {sorted(markers)}")
        elif markers and self.inside_stub:
            self.errors.append(f"{self._where(node)}: {qualname}: a stub inside another stub's body "
                               f"would vanish with it")
        elif markers:
            self._add_stub(node, qualname, next(iter(markers)))
        is_stub = len(markers) == 1
        self.scope += [node.name, "<locals>"]
        self.inside_stub += is_stub
        self.generic_visit(node)
        self.inside_stub -= is_stub
        del self.scope[-2:]

    visit_AsyncFunctionDef = visit_FunctionDef

    def _reject_marker(self, node, what: str) -> None:
        doc = ast.get_docstring(node, clean=False) or ""
        if STUB_MARKER.search(doc):
            line = getattr(node, "lineno", 1)
            self.errors.append(f"{self.path}:{line}: {what} carries a stub marker; "
                               f"only functions and methods can be stubs")

    def _add_stub(self, node, qualname: str, chapter: int) -> None:
        doc_node, rest = node.body[0], node.body[1:]
        doc_line = self.lines[doc_node.lineno - 1]
        indent = doc_line[:len(doc_line) - len(doc_line.lstrip(" \t"))]
        # col_offset counts UTF-8 bytes; the indentation is ASCII, so it compares directly.
        if len(indent) != doc_node.col_offset:
            self.errors.append(f"{self._where(node)}: {qualname}: the docstring must start its own line")
            return
        if rest and rest[0].lineno == doc_node.end_lineno:
            self.errors.append(f"{self._where(node)}: {qualname}: the body must start on the line "
                               f"after the docstring")
            return
        self.stubs.append(Stub(path=self.path, qualname=qualname, chapter=chapter, lineno=node.lineno,
                               body_start=doc_node.end_lineno,
                               body_end=rest[-1].end_lineno if rest else doc_node.end_lineno,
                               indent=indent))


def find_stubs(source: str, path: str = "<source>") -> list[Stub]:
    """Every stub in a module's source, in file order. Raises SkeletonError on a syntax
    error or a malformed marker, naming the file and the function."""
    try:
        tree = ast.parse(source, filename=path)
    except SyntaxError as exc:
        raise SkeletonError(f"{path}:{exc.lineno}: cannot parse: {exc.msg}") from None
    finder = _StubFinder(path, split_lines(source))
    finder.visit(tree)
    if finder.errors:
        raise SkeletonError("\n".join(finder.errors))
    return finder.stubs


def blank_stubs(source: str, path: str = "<source>", after_chapter: int | None = None,
                keep_lines: bool = False) -> str:
    """The source with stub bodies replaced by the generated raise: every stub when
    `after_chapter` is None, otherwise only the stubs of chapters > after_chapter.

    keep_lines pads each replaced body with empty lines to its old height, so every line
    outside the stubs keeps its number (gated copies: a traceback's line is the source's).
    A stub whose body is only its docstring has no lines to fill; the raise adds one."""
    stubs = [s for s in find_stubs(source, path) if after_chapter is None or s.chapter > after_chapter]
    if not stubs:
        return source
    lines = split_lines(source)
    newline = _newline_of(lines)
    # Replace from the bottom up so earlier indices stay valid.
    for stub in reversed(stubs):
        replaced = lines[stub.body_start:stub.body_end]
        text = stub.indent + stub.statement + newline * (max(len(replaced), 1) if keep_lines else 1)
        if replaced and not replaced[-1].endswith(("\n", "\r")):
            text = text[: -len(newline)]           # the body ended the file without a newline
        if stub.body_start and not lines[stub.body_start - 1].endswith(("\n", "\r")):
            text = newline + text[: -len(newline)]  # the docstring ended the file
        lines[stub.body_start:stub.body_end] = [text]
    return "".join(lines)


def check_chapters(stubs: list[Stub], known: set[int] | frozenset[int]) -> list[str]:
    return [f"{s.path}:{s.lineno}: {s.qualname}: stub names Chapter {s.chapter}, which book.toml "
            f"does not list" for s in stubs if s.chapter not in known]


# --- trees ---------------------------------------------------------------------------------

def package_files(root: Path) -> list[str]:
    """Relative POSIX paths of the files that make up a package tree, caches excluded."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIPPED_DIRS)
        for name in sorted(filenames):
            # Skip caches, and the temporary files of a concurrent `materialize`.
            if not name.endswith(SKIPPED_SUFFIXES) and not _is_temporary(name):
                found.append((Path(dirpath) / name).relative_to(root).as_posix())
    return found


def _is_temporary(name: str) -> bool:
    return name.startswith(".") and name.endswith(".tmp")


def _label(root: Path) -> str:
    return root.name or str(root)


def stubs_of_tree(root: Path) -> dict[str, list[Stub]]:
    """{relative path: stubs} for every Python file of a package tree."""
    root = Path(root)
    result = {}
    for rel in package_files(root):
        if rel.endswith(".py"):
            source = (root / rel).read_text(encoding="utf-8")
            result[rel] = find_stubs(source, f"{_label(root)}/{rel}")
    return result


def generate_tree(source_root: Path, after_chapter: int | None = None,
                  known_chapters: set[int] | frozenset[int] | None = None,
                  keep_lines: bool = False) -> dict[str, bytes]:
    """The skeleton of a package tree as {relative path: content}. Stubs naming chapters
    outside `known_chapters` (default: book.toml's) are an error, reported all at once.
    keep_lines: see blank_stubs (gated copies keep the source's line numbers)."""
    if known_chapters is None:
        from . import manifest
        known_chapters = manifest.load().numbers
    source_root = Path(source_root)
    generated, errors = {}, []
    for rel in package_files(source_root):
        data = (source_root / rel).read_bytes()
        if rel.endswith(".py"):
            label = f"{_label(source_root)}/{rel}"
            try:
                text = data.decode("utf-8")
                errors += check_chapters(find_stubs(text, label), known_chapters)
                data = blank_stubs(text, label, after_chapter, keep_lines).encode("utf-8")
            except SkeletonError as exc:
                errors.append(str(exc))
        generated[rel] = data
    if errors:
        raise SkeletonError("\n".join(errors))
    return generated


def materialize(files: dict[str, bytes], target: Path, read_only: bool = False) -> tuple[list[str], list[str]]:
    """Make `target` hold exactly `files` (caches aside). Unchanged files are not touched,
    so their timestamps and compiled caches stay valid; each write is atomic, so two
    processes producing the same tree at once cannot leave a torn file. read_only writes
    the files without write permission (generated copies nobody should edit). Returns
    (written, removed) relative paths."""
    target = Path(target)
    written, removed = [], []
    for rel, data in files.items():
        path = target / rel
        try:
            if path.read_bytes() == data:
                if read_only and path.stat().st_mode & 0o222:
                    try:
                        os.chmod(path, 0o444)   # a copy written before copies were made read-only
                    except PermissionError:     # someone else's file in a shared cache: leave it
                        pass
                continue
        except (FileNotFoundError, IsADirectoryError):
            pass
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.chmod(tmp, 0o444 if read_only else 0o644)    # mkstemp's 0600 would hide it from others
        try:
            os.replace(tmp, path)
        except PermissionError:             # Windows will not replace a read-only file
            os.chmod(path, 0o644)
            os.replace(tmp, path)
        written.append(rel)
    if target.is_dir():
        for rel in package_files(target):
            if rel not in files:
                (target / rel).unlink(missing_ok=True)
                removed.append(rel)
                _prune_empty_parents(target, (target / rel).parent)
    return written, removed


def _prune_empty_parents(root: Path, folder: Path) -> None:
    """Remove folders emptied by a removal (a stale __pycache__ does not count as content).
    Only those: an empty folder elsewhere may be one a concurrent writer just created."""
    while folder != root and root in folder.parents:
        if not set(os.listdir(folder)) <= {"__pycache__"}:
            return
        shutil.rmtree(folder, ignore_errors=True)
        folder = folder.parent


@dataclass
class WriteReport:
    written: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)


def filled_stubs(root: Path, rel: str) -> list[str]:
    """Qualified names of the filled stubs in one file of a learner's tree. A file that
    no longer parses is reported as a single entry, since its bodies cannot be told apart."""
    path = Path(root) / rel
    source = path.read_text(encoding="utf-8")
    try:
        stubs = find_stubs(source, str(path))
    except SkeletonError:
        return ["(the file does not parse; any work in it would be lost)"]
    lines = split_lines(source)
    return [s.qualname for s in stubs if s.is_filled(lines)]


# The first paragraph of the learner's package docstring: the reference's own first
# paragraph ("The reference engine: every chapter's code, complete ...") is not true of it.
LEARNER_PACKAGE_DOC = '''Your engine, to build chapter by chapter: the course's code with the bodies of
the stubs left for you to write. The course's skeleton generator made this package from
the reference engine, keeping everything but the stub bodies: a function whose
docstring names its chapter as "(Your engine: Chapter N)" raises NotImplementedError until
you write it, and everything else already works. Each chapter's notebook introduces its
stubs; `pytest --impl engine tests/test_chNN_*.py` checks them and `python run.py progress`
says where you are. Modules import each other relatively, so this package loads under any
name.'''


def learner_tree(source_root: Path, known_chapters=None) -> dict[str, bytes]:
    """What engine/ must hold: the skeleton of `source_root` (every stub blanked) whose
    package docstring speaks to the learner (LEARNER_PACKAGE_DOC replaces its first
    paragraph; the rest, such as a map of the modules, stays)."""
    files = generate_tree(source_root, known_chapters=known_chapters)
    if "__init__.py" in files:
        files["__init__.py"] = _with_learner_docstring(files["__init__.py"].decode("utf-8")).encode("utf-8")
    return files


def _with_learner_docstring(source: str) -> str:
    tree = ast.parse(source)
    if ast.get_docstring(tree, clean=False) is None:
        return source
    node = tree.body[0]
    lines = split_lines(source)
    newline = _newline_of(lines)
    docstring = lines[node.lineno - 1:node.end_lineno]
    # The first paragraph ends at the docstring's first blank line (or with the docstring).
    blank = next((i for i, line in enumerate(docstring) if not line.strip()), None)
    headline = '"""' + LEARNER_PACKAGE_DOC.replace("\n", newline) + newline
    rest = docstring[blank:] if blank is not None else ['"""' + newline]
    lines[node.lineno - 1:node.end_lineno] = [headline, *rest]
    return "".join(lines)


def write_skeleton(source_root: Path, target_root: Path, force: bool = False,
                   known_chapters=None) -> WriteReport:
    """Regenerate `target_root` from `source_root`. Without `force`, refuses (changing
    nothing) when a file to be rewritten or removed holds a filled stub."""
    source_root, target_root = Path(source_root), Path(target_root)
    files = learner_tree(source_root, known_chapters=known_chapters)
    if not force and target_root.is_dir():
        conflicts = []
        for rel in package_files(target_root):
            if not rel.endswith(".py") or files.get(rel) == (target_root / rel).read_bytes():
                continue
            for name in filled_stubs(target_root, rel):
                conflicts.append(f"{_label(target_root)}/{rel}: {name}")
        if conflicts:
            raise SkeletonConflict(
                "these stubs are filled in and would be overwritten:\n  " + "\n  ".join(conflicts)
                + "\nrerun with --force to overwrite them anyway")
    written, removed = materialize(files, target_root)
    return WriteReport(written=written, removed=removed)


def _enclosing_definition(source: str, lineno: int) -> str | None:
    """Qualified name of the innermost def or class spanning a 1-based line, if any."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    best: tuple[int, str] | None = None

    def walk(node, scope):
        nonlocal best
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = ".".join(scope + [child.name])
                first = min([child.lineno] + [d.lineno for d in child.decorator_list])
                if first <= lineno <= (child.end_lineno or first) and (best is None or first >= best[0]):
                    best = (first, name)
                inner = scope + [child.name] + ([] if isinstance(child, ast.ClassDef) else ["<locals>"])
                walk(child, inner)
            else:
                walk(child, scope)

    walk(tree, [])
    return best[1] if best else None


def check_tree(source_root: Path, target_root: Path, known_chapters=None) -> list[str]:
    """Where `target_root` differs from the skeleton of `source_root` outside stub bodies:
    one message per difference, naming file and function. Empty when they agree. Filled
    stub bodies never count: the target's own stubs are blanked before comparing."""
    source_root, target_root = Path(source_root), Path(target_root)
    expected = learner_tree(source_root, known_chapters=known_chapters)
    label = _label(target_root)
    if not target_root.is_dir():
        return [f"{label}/ does not exist: run `python run.py skeleton`"]
    problems = []
    present = set(package_files(target_root))
    for rel in sorted(present - expected.keys()):
        problems.append(f"{label}/{rel}: not in {_label(source_root)}/ (remove it or regenerate)")
    for rel, want in expected.items():
        if rel not in present:
            problems.append(f"{label}/{rel}: missing (run `python run.py skeleton`)")
            continue
        have = (target_root / rel).read_bytes()
        if not rel.endswith(".py"):
            if have != want:
                problems.append(f"{label}/{rel}: differs from {_label(source_root)}/{rel}")
            continue
        try:
            have_text = blank_stubs(have.decode("utf-8"), f"{label}/{rel}")
        except (SkeletonError, UnicodeDecodeError) as exc:
            problems.append(f"{label}/{rel}: cannot compare: {exc}")
            continue
        want_text = want.decode("utf-8")
        if have_text != want_text:
            problems += _describe_drift(f"{label}/{rel}", want_text, have_text)
    return problems


def _describe_drift(label: str, want: str, have: str) -> list[str]:
    want_lines, have_lines = split_lines(want), split_lines(have)
    matcher = difflib.SequenceMatcher(a=want_lines, b=have_lines, autojunk=False)
    messages, seen = [], set()
    for tag, w1, w2, h1, _h2 in matcher.get_opcodes():
        if tag == "equal":
            continue
        # Name the definition around the first line involved: in the expected text when
        # the skeleton has lines there, else in the target's extra lines.
        if w2 > w1:
            where = _enclosing_definition(want, w1 + 1)
        else:
            where = _enclosing_definition(have, h1 + 1)
        where = where or "module level"
        if where in seen:
            continue
        seen.add(where)
        messages.append(f"{label}: {where}: differs from the generated skeleton outside stub bodies "
                        f"(line {h1 + 1})")
    return messages or [f"{label}: differs from the generated skeleton (line endings or encoding)"]
