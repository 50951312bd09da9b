"""The package's modules import one another without a circle, and the modes that run a step
reach the engine only through its public parts (issue 33).

A circle (serve/backends.py importing paged_kernels.py, which imports serve/backends.py)
means neither side can be understood, tested or replaced alone, and which module loads
first decides whether a name exists yet. Plug-ins import the core; the core names them
(a registry entry, an object handed to the constructor) and never imports them back.

What counts as an import: every `import` and `from ... import` statement that runs, at
module level or inside a function (a function-level import only delays the circle to the
first call). Relative imports are resolved against the importing module's package, and
`from package import name` counts as importing the submodule `name` when one exists.
Imports under `if TYPE_CHECKING:` are not counted: they never run (every such module has
`from __future__ import annotations`, so its annotations are never evaluated either);
they only let a type checker name a class in an annotation.
"""
import ast
from pathlib import Path

import pytest

from course.manifest import ROOT


def module_names(root: Path) -> dict[str, tuple[Path, bool]]:
    """Dotted name -> (file, whether it is a package's __init__) for every module under root."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return found


def under_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")


def import_statements(tree: ast.AST):
    """Every import statement that can run: all of them but those under `if TYPE_CHECKING:`
    (an `else:` branch of such an `if` does run, so it is searched)."""
    for child in ast.iter_child_nodes(tree):
        if under_type_checking(child):
            for branch in child.orelse:
                yield from import_statements(ast.Module(body=[branch], type_ignores=[]))
            continue
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child
        yield from import_statements(child)


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports (see the module docstring)."""
    modules = module_names(root)
    graph: dict[str, set[str]] = {}
    for name, (path, is_package) in modules.items():
        here = name.split(".") if is_package else name.split(".")[:-1]
        targets = set()
        for node in import_statements(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
                continue
            if node.level:
                base = here[:len(here) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                targets.add(submodule if submodule in modules else source)
        graph[name] = {target for target in targets if target in modules and target != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan), each as one circle
    through its modules, in import order, starting from its first name."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.add(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(group)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [one_circle(graph, group) for group in groups]


def one_circle(graph: dict[str, set[str]], group: set[str]) -> list[str]:
    """A shortest path from the group's first module back to itself, inside the group."""
    start = min(group)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for target in sorted(graph[node] & group):
                if target == start:
                    return paths[node] + [start]
                if target not in paths:
                    paths[target] = paths[node] + [target]
                    following.append(target)
        frontier = following
    raise AssertionError(f"{sorted(group)} is not a circle")


@pytest.mark.parametrize("package", ["solutions", "engine"])
def test_no_module_imports_itself_through_others(package):
    found = circles(import_graph(ROOT / package))
    assert not found, (f"import circles in {package}/ (plug-ins must import the core, never the other way round; "
                       f"register them or pass them in): " + "; ".join(" -> ".join(c) for c in found))


def test_the_check_sees_a_circle_closed_inside_a_function(tmp_path):
    """The check on a planted package: a circle closed by a function-level relative import
    is found and named; one closed only under TYPE_CHECKING is not a circle."""
    package = tmp_path / "planted"
    (package / "serve").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "serve" / "__init__.py").write_text("")
    (package / "kernels.py").write_text("from .serve.core import Base\n")
    (package / "serve" / "core.py").write_text("class Base: ...\n\ndef load():\n    from .. import kernels\n")
    (package / "serve" / "types.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .core import Base\n")
    (package / "serve" / "uses_types.py").write_text("from . import types\n")
    graph = import_graph(package)
    assert graph["planted.serve.core"] == {"planted.kernels"}, graph
    assert graph["planted.serve.types"] == set(), "an import under TYPE_CHECKING never runs"
    assert circles(graph) == [["planted.kernels", "planted.serve.core", "planted.kernels"]]


# The modes and plug-ins that run a step: they reach the engine only through its public
# parts (schedule, execute_model, sample_tokens, record_prompt_logprobs, update) and what
# it hands them (a stop rule, a DrafterContext), never its private methods or its state.
STEP_PLUG_INS = ("serve/overlap.py", "serve/spec_decode.py")


def reaches_into_the_engine(path: Path) -> list[str]:
    """`engine._private` reads and `engine.attribute = ...` writes (also `self.engine.x`) in a file."""
    def is_engine(node: ast.AST) -> bool:
        return (isinstance(node, ast.Name) and node.id == "engine") or (
            isinstance(node, ast.Attribute) and node.attr == "engine")

    found = []
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and is_engine(node.value) and node.attr.startswith("_"):
            found.append(f"line {node.lineno}: reads engine.{node.attr}")
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AugAssign, ast.AnnAssign)) else []
        for target in targets:
            if isinstance(target, ast.Attribute) and is_engine(target.value):
                found.append(f"line {target.lineno}: writes engine.{target.attr}")
    return found


@pytest.mark.parametrize("package", ["solutions", "engine"])
@pytest.mark.parametrize("plug_in", STEP_PLUG_INS)
def test_step_plug_ins_use_only_the_engines_public_parts(package, plug_in):
    found = reaches_into_the_engine(ROOT / package / plug_in)
    assert not found, f"{package}/{plug_in} reaches into the engine: " + "; ".join(found)


def test_the_boundary_check_sees_a_write_and_a_private_call(tmp_path):
    planted = tmp_path / "stepper.py"
    planted.write_text("def step(engine):\n    engine.preemptions += 1\n    return engine._sample()\n")
    assert reaches_into_the_engine(planted) == ["line 2: writes engine.preemptions", "line 3: reads engine._sample"]
