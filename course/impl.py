"""Which implementation of the engine a test, a command or a notebook uses.

An implementation spec is one of

    solutions          the reference package (the default)
    engine             the learner's package in this checkout
    PATH               a package directory (one with __init__.py), or a checkout whose
                       engine/ is the package: grading another learner's work
    SPEC@N             any of the above as a learner who has finished Chapter N would have
                       it: the stubs of every chapter after N replaced by the generated
                       NotImplementedError body

A gated package (SPEC@N) is generated into the cache directory (.course_cache/, or
$COURSE_CACHE_DIR) and imported under its own module name (solutions_at_8), so the full
package and any number of gated copies live side by side in one process. This works because
every package uses relative imports only: no copy ever reaches into another.

Gated copies are generated code: their files are read-only, rewritten on every load, and
keep the source's line numbers, so `source_of` maps a traceback's line in a copy back to the
file a maintainer or learner should open (the pytest plugin does so in failure reports).

Loading is cached per process: a module is imported once, so an edit to engine/ reaches a
running notebook only after a kernel restart (or course.notebook.reload_impl()).
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from . import skeleton
from .manifest import ROOT

NAMED = {"solutions": ROOT / "solutions", "engine": ROOT / "engine"}


class ImplError(ValueError):
    """An implementation spec that names nothing loadable."""


def cache_dir() -> Path:
    return Path(os.environ.get("COURSE_CACHE_DIR") or ROOT / ".course_cache")


@dataclass(frozen=True)
class ImplSpec:
    """A parsed spec. `source` is the package directory the code comes from; `upto` is the
    last chapter kept (None: nothing removed); `module_name` is unique per (source, upto)."""
    text: str
    source: Path
    upto: int | None
    module_name: str


def _module_name_for(source: Path) -> str:
    for name, path in NAMED.items():
        if source == path.resolve():
            return name
    # Another checkout: its own name, made unique by where it lives.
    digest = hashlib.sha1(str(source).encode()).hexdigest()[:8]
    stem = re.sub(r"\W", "_", source.parent.name if source.name == "engine" else source.name)
    return f"impl_{stem}_{digest}"


def _resolve_source(base: str) -> Path:
    if base in NAMED:
        path = NAMED[base]
        if base == "solutions" and not have_reference():
            raise ImplError("this learner's edition has no reference engine: --impl engine runs your engine/")
        if not (path / "__init__.py").is_file():
            hint = " (run `python run.py skeleton` to create it)" if base == "engine" else ""
            raise ImplError(f"{base}/ is not a package in {ROOT}{hint}")
        return path.resolve()
    path = Path(base).expanduser()
    if (path / "__init__.py").is_file():
        return path.resolve()
    if (path / "engine" / "__init__.py").is_file():
        return (path / "engine").resolve()
    raise ImplError(
        f"unknown implementation {base!r}: use 'solutions', 'engine', a package directory, or a "
        f"checkout that contains engine/; add '@N' for the state after Chapter N")


def parse(text: str) -> ImplSpec:
    """Resolve a spec without importing anything. Raises ImplError with the accepted forms."""
    text = str(text).strip()
    base, upto = text, None
    head, sep, tail = text.rpartition("@")
    if sep and tail.isdigit():              # a path may contain '@'; only '@<digits>' gates
        base, upto = head, int(tail)
        from . import manifest
        last = len(manifest.load().chapters)
        if not 0 <= upto <= last:
            raise ImplError(f"{text!r}: chapter {upto} is outside book.toml's 0-{last}")
    source = _resolve_source(base)
    name = _module_name_for(source)
    if upto is not None:
        name = f"{name}_at_{upto}"
    return ImplSpec(text=text, source=source, upto=upto, module_name=name)


class Impl:
    """A loaded implementation: the package module plus a convenient way to reach its
    modules. `impl.attention` imports and returns the top-level module `attention` of
    this package; `impl.load("serve.engine")` imports any submodule by dotted path."""

    def __init__(self, spec: ImplSpec, package: ModuleType, root: Path):
        self.spec = spec
        self.package = package
        self.root = root            # where the code that runs lives (the cache for gated copies)
        self.loaded_at = time.time()

    @property
    def name(self) -> str:
        return self.package.__name__

    @property
    def source(self) -> Path:
        """The package directory the code was taken from (for stub counting)."""
        return self.spec.source

    @property
    def upto(self) -> int | None:
        return self.spec.upto

    def load(self, dotted: str) -> ModuleType:
        return importlib.import_module(f"{self.name}.{dotted}")

    def __getattr__(self, attr: str):
        if attr.startswith("_"):
            raise AttributeError(attr)
        return _submodule_or_attribute(self.package, attr)

    def __repr__(self) -> str:
        return f"<Impl {self.spec.text} as module {self.name!r} from {self.root}>"


def _submodule_or_attribute(package: ModuleType, attr: str):
    try:
        return importlib.import_module(f"{package.__name__}.{attr}")
    except ModuleNotFoundError as exc:
        if exc.name != f"{package.__name__}.{attr}":
            raise                            # the module exists but imports something missing
    try:
        return object.__getattribute__(package, attr)
    except AttributeError:
        raise AttributeError(f"{package.__name__} has no module or attribute {attr!r}") from None


def _import_package(name: str, directory: Path) -> ModuleType:
    existing = sys.modules.get(name)
    if existing is not None:
        loaded_from = Path(getattr(existing, "__file__", "") or "").resolve().parent
        if loaded_from != directory.resolve():
            raise ImplError(f"module name {name!r} is already taken by {loaded_from}")
        return existing
    spec = importlib.util.spec_from_file_location(
        name, directory / "__init__.py", submodule_search_locations=[str(directory)])
    if spec is None or spec.loader is None:
        raise ImplError(f"{directory} cannot be imported as a package")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    if "__getattr__" not in vars(module):
        # `package.qwen3` works whether or not __init__ imported it, so code handed the bare
        # package (a model factory, a notebook) needs no import dance.
        vars(module)["__getattr__"] = lambda attr: _lazy_submodule(module, attr)
    return module


def _lazy_submodule(package: ModuleType, attr: str):
    if attr.startswith("__"):
        raise AttributeError(attr)
    try:
        return importlib.import_module(f"{package.__name__}.{attr}")
    except ModuleNotFoundError as exc:
        if exc.name == f"{package.__name__}.{attr}":
            raise AttributeError(f"module {package.__name__!r} has no attribute {attr!r}") from None
        raise


def load(spec: str | ImplSpec | Impl) -> Impl:
    """Load an implementation (cached per process by module name)."""
    if isinstance(spec, Impl):
        return spec
    if not isinstance(spec, ImplSpec):
        spec = parse(spec)
    if spec.module_name in _loaded:
        return _loaded[spec.module_name]
    if spec.upto is None:
        root = spec.source
    else:
        root = cache_dir() / spec.module_name
        # Regenerated on every load so edits to the source show up; unchanged files are not
        # rewritten, so this costs a parse of the package and nothing more.
        files = skeleton.generate_tree(spec.source, after_chapter=spec.upto, keep_lines=True)
        skeleton.materialize(_with_provenance(files, spec), root, read_only=True)
    impl = _loaded[spec.module_name] = Impl(spec, _import_package(spec.module_name, root), root)
    return impl


_loaded: dict[str, Impl] = {}


def _with_provenance(files: dict[str, bytes], spec: ImplSpec) -> dict[str, bytes]:
    """Each Python file of a gated copy ends with a comment naming the file to edit instead
    (at the end, so that every line keeps its number)."""
    marked = {}
    for rel, data in files.items():
        if rel.endswith(".py"):
            ending = b"" if not data or data.endswith(b"\n") else b"\n"
            note = (f"# Generated for {spec.text} from {spec.source / rel}; read-only and rewritten on "
                    f"every load: edit that file instead.\n")
            data = data + ending + note.encode("utf-8")
        marked[rel] = data
    return marked


def changed_since_loaded(impl: Impl) -> list[str]:
    """Source files of `impl` (relative paths) modified after this process loaded it: code
    the running process does not see, since each module is imported once per process."""
    return [rel for rel in skeleton.package_files(impl.source)
            if rel.endswith(".py") and (impl.source / rel).stat().st_mtime > impl.loaded_at]


def forget(spec: str | ImplSpec | Impl) -> None:
    """Drop a loaded implementation and its modules from this process, so the next load
    imports the files afresh. Objects made from the old modules keep the old code."""
    if isinstance(spec, Impl):
        name = spec.name
    else:
        name = (spec if isinstance(spec, ImplSpec) else parse(spec)).module_name
    _loaded.pop(name, None)
    for module in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
        del sys.modules[module]


def loaded_gated() -> list[Impl]:
    """The gated copies this process has loaded."""
    return [loaded for loaded in _loaded.values() if loaded.upto is not None]


def source_of(path: str | Path) -> Path | None:
    """The file a gated copy's file was generated from (same line numbers), or None when
    `path` is not inside a gated copy loaded by this process."""
    path = Path(path).resolve()
    for loaded in loaded_gated():
        root = loaded.root.resolve()
        if root in path.parents:
            return loaded.source / path.relative_to(root)
    return None


def have_reference() -> bool:
    """Whether this checkout has the reference package (solutions/); a learner's edition does not."""
    return (NAMED["solutions"] / "__init__.py").is_file()


def reference() -> Impl:
    """The full reference package (`solutions`), for oracles such as solo generate."""
    if not have_reference():
        raise ImplError("this oracle compares with the course's reference engine, which a learner's edition "
                        "leaves out")
    return load("solutions")
