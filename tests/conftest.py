"""Shared test setup.

The course's options (--impl, --chapter, --upto, --device, --model), the `chapter(N)`
marker and the fixtures every milestone uses (`impl`, `device`, `model_path`, `tiny_model`,
`ref_model`) come from the plugin course/pytest_plugin.py, which pytest.ini loads: being a
plugin rather than this conftest, it also serves milestone files outside tests/ (an
instructor's own, the grading tests' fakes). What is here serves the machinery's own
tests (tests/test_course_*.py).
"""
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest_plugins = ["pytester"]


def write_tree(root: Path, files: dict[str, str | bytes]) -> Path:
    """Create files under root; str contents are dedented, bytes written as they are."""
    for rel, content in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(textwrap.dedent(content).lstrip("\n"), encoding="utf-8")
    return root


# A small package shaped like solutions/: stubs of three chapters in the forms that matter
# (plain function, methods, a property, a nested function, a docstring-only body),
# relative imports, a helper that stays implemented, and a data file.
FAKE_PACKAGE = {
    "__init__.py": '"""A fake engine for the machinery tests."""\n',
    "helpers.py": """
        def twice(x):
            return 2 * x
    """,
    "ops.py": '''
        """Operations; the module docstring is not a stub."""
        from .helpers import twice


        def add(a, b):
            """Add two numbers.  (Your engine: Chapter 1)"""
            # A comment inside the body goes with the body.
            total = a + b
            return total


        class Box:
            """A box."""

            def area(self, w, h):
                """The area.  (Your engine: Chapter 2)

                A docstring over several lines stays whole.
                """
                return w * h

            @property
            def name(self):
                """The name.  (Your engine: Chapter 2)"""
                return "box"


        def outer():
            def inner():
                """Nested.  (Your engine: Chapter 3)"""
                return 1
            return inner() + 1


        def only_doc():
            """A stub whose reference body is empty.  (Your engine: Chapter 3)"""


        def doubled_sum(a, b):
            return twice(add(a, b))
    ''',
    "sub/__init__.py": "",
    "sub/deep.py": '''
        from ..ops import add


        def add_three(a, b, c):
            """Uses Chapter 1's add.  (Your engine: Chapter 2)"""
            return add(add(a, b), c)
    ''',
    "data/table.txt": b"raw bytes\r\nstay as they are\n",
}

FAKE_CHAPTERS = frozenset({1, 2, 3})


@pytest.fixture
def fake_package(tmp_path) -> Path:
    """A fresh copy of FAKE_PACKAGE at tmp_path/fakepkg."""
    return write_tree(tmp_path / "fakepkg", FAKE_PACKAGE)


@pytest.fixture
def isolated_cache(tmp_path, monkeypatch) -> Path:
    """Gated copies go to a private cache, never the checkout's .course_cache/."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("COURSE_CACHE_DIR", str(cache))
    return cache


SERVE_MODULES = ("request", "config", "batch", "backends", "flat_model", "blocks", "scheduler", "runner",
                 "sampler", "engine", "interfaces")


@pytest.fixture(scope="module")
def serve(impl):
    """Chapter 31's modules of the implementation under test: serve.engine, serve.blocks, ..."""
    return SimpleNamespace(**{name: impl.load(f"serve.{name}") for name in SERVE_MODULES})
