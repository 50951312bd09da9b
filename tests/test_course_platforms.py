"""The course installs and runs beyond Linux: requirements that exist only on Linux carry a
platform marker, and what needs them skips with one line where they are missing."""
import re
from pathlib import Path

from packaging.requirements import Requirement

from course import pytest_plugin

ROOT = Path(__file__).resolve().parents[1]
# Packages whose wheels exist for Linux only (checked on the package index: no macOS or
# Windows wheel of these pins).
LINUX_ONLY = {"triton"}
ELSEWHERE = ({"sys_platform": "darwin", "platform_system": "Darwin"},
             {"sys_platform": "win32", "platform_system": "Windows"})


def requirements() -> list[Requirement]:
    lines = (ROOT / "requirements.txt").read_text().splitlines()
    return [Requirement(line) for line in lines if line.strip() and not line.startswith(("#", "-"))]


def test_linux_only_requirements_are_left_out_elsewhere():
    found = {r.name.lower(): r for r in requirements()}
    assert LINUX_ONLY <= found.keys(), f"requirements.txt no longer lists {sorted(LINUX_ONLY - found.keys())}"
    for name in sorted(LINUX_ONLY):
        marker = found[name].marker
        assert marker is not None, f"{name} has Linux wheels only: it needs a marker such as sys_platform == \"linux\""
        assert marker.evaluate({"sys_platform": "linux", "platform_system": "Linux"}), f"{name} must install on Linux"
        for environment in ELSEWHERE:
            assert not marker.evaluate(environment), f"{name} would be required on {environment['platform_system']}"


def test_every_notebook_that_needs_triton_skips_without_it():
    """A notebook that runs Triton code is listed, so it skips where Triton is missing."""
    uses_triton = re.compile(r"import triton|triton_kernels|paged_kernels|TRITON_INTERPRET")
    needing = {path.with_suffix(".ipynb").name for path in ROOT.glob("chapters/*/*.md")
               if uses_triton.search(path.read_text())}
    listed = set(pytest_plugin.TRITON_NOTEBOOKS)
    assert needing == listed, f"notebooks using Triton {sorted(needing)}, plugin's TRITON_NOTEBOOKS {sorted(listed)}"


class FakeItem:
    def __init__(self, name: str) -> None:
        self.path = Path("chapters") / name
        self.markers: list = []

    def add_marker(self, marker) -> None:
        self.markers.append(marker)


def test_without_triton_its_notebooks_are_skipped_with_the_reason(monkeypatch):
    import importlib.util
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name == "triton" else real_find_spec(name, *args))
    items = [FakeItem(name) for name in (*pytest_plugin.TRITON_NOTEBOOKS, "31-engine-v2.ipynb")]
    pytest_plugin._skip_triton_notebooks(items)
    *triton_items, other = items
    for item in triton_items:
        assert [m.name for m in item.markers] == ["skip"]
        assert "Linux wheels only" in item.markers[0].kwargs["reason"]
    assert other.markers == [], "a notebook without Triton code must still run"
