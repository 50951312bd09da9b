"""Helpers for the chapter notebooks.

    from course.notebook import load_impl, check, table

    ref = load_impl("solutions")
    mine = load_impl()                      # the learner's engine (or $COURSE_IMPL)
    check("attention.causal_attention", q, k, v, q_pos, k_pos)

`check` runs the learner's function and the reference's on the same arguments and shows
one line in the same words everywhere in the book: PASS, FAIL (with the first difference,
or the exception's one-line message), or NOT IMPLEMENTED YET (naming the stub to fill in).
It never lets a learner's exception escape as a traceback, so a notebook always runs top to
bottom, with or without the learner's work: that is what lets nbval execute every notebook
in CI against the bare skeleton.
"""
from __future__ import annotations

import html
import os
import re
from dataclasses import dataclass
from typing import Any, Callable

from . import impl as impl_module

DEFAULT_IMPL_VARIABLE = "COURSE_IMPL"
_STUB_MESSAGE = re.compile(r"Your engine: Chapter (\d+): (\S+)")


def load_impl(name: str | None = None) -> impl_module.Impl:
    """An implementation by spec (see course.impl): by default the learner's `engine`,
    or whatever $COURSE_IMPL names (so one notebook can be run against any checkout).

    A kernel imports each module once: after you edit a file of engine/, the running
    kernel still has the old code. Restart the kernel (Kernel > Restart), or call
    reload_impl(). load_impl prints a note when it finds files changed since the import.
    """
    loaded = impl_module.load(name or os.environ.get(DEFAULT_IMPL_VARIABLE) or "engine")
    changed = impl_module.changed_since_loaded(loaded)
    if changed:
        print(f"note: {', '.join(changed)} changed after this kernel imported {loaded.source.name}/; "
              f"restart the kernel (or call reload_impl()) to run your new code")
    return loaded


def reload_impl(name: str | None = None) -> impl_module.Impl:
    """load_impl with a fresh import of every module of the implementation, so edits made
    since the kernel started take effect. Objects built before (a model, an engine) keep
    the old code: build them again, or restart the kernel to be sure."""
    impl_module.forget(name or os.environ.get(DEFAULT_IMPL_VARIABLE) or "engine")
    return load_impl(name)


def reference_or_engine() -> impl_module.Impl:
    """What a chapter's demonstrations run on: the reference (solutions/) where the checkout has
    it; in a learner's edition, which leaves the reference out, the learner's engine (their
    stubs fill in the demonstrations as they write them; checks still say "no reference")."""
    if impl_module.have_reference():
        return impl_module.reference()
    print("note: no reference engine in this edition: the demonstrations below run your engine/")
    return load_impl()


@dataclass
class CheckResult:
    """The outcome of one check. `status` is "pass", "fail", "not implemented" or "unchecked"
    (it ran, but there is no reference here to compare with: a learner's edition);
    the object displays itself as one line in a notebook, and is truthy only on pass."""
    name: str
    status: str
    detail: str = ""
    value: Any = None

    # The words a learner reads; the book's prose quotes them, so change them together.
    _ICONS = {"pass": "PASS", "fail": "FAIL", "not implemented": "NOT IMPLEMENTED YET", "unchecked": "RAN"}
    _COLOURS = {"pass": "#1a7f37", "fail": "#cf222e", "not implemented": "#9a6700", "unchecked": "#57606a"}

    def __bool__(self) -> bool:
        return self.status == "pass"

    def __repr__(self) -> str:
        detail = f": {self.detail}" if self.detail else ""
        return f"[{self._ICONS[self.status]}] {self.name}{detail}"

    def _repr_html_(self) -> str:
        colour = self._COLOURS[self.status]
        detail = f" &mdash; {html.escape(self.detail)}" if self.detail else ""
        return (f'<div style="font-family: monospace"><b style="color: {colour}">'
                f'{self._ICONS[self.status]}</b> {html.escape(self.name)}{detail}</div>')


def _resolve(target, impl) -> Callable:
    """A dotted name ("attention.causal_attention", "qwen3.Qwen3MLP") looked up in `impl`."""
    parts = str(target).split(".")
    # The longest prefix that is a module; the rest are attributes (a class, then a method).
    for split in range(len(parts) - 1, 0, -1):
        try:
            owner = impl.load(".".join(parts[:split]))
        except ModuleNotFoundError:
            continue
        break
    else:
        owner, split = impl.package, 0
    for part in parts[split:]:
        owner = getattr(owner, part)
    return owner


def differences(got, expected, atol: float = 1e-5, rtol: float = 1e-4, path: str = "") -> str | None:
    """None when `got` matches `expected`, else one sentence saying where they differ.
    Tensors and arrays compare with tolerances, containers element by element, anything
    else with ==."""
    where = f" at {path}" if path else ""
    import numpy
    import torch  # both here, so importing course.notebook stays quick
    if isinstance(expected, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            return f"expected a tensor{where}, got {type(got).__name__}"
        if tuple(got.shape) != tuple(expected.shape):
            return f"shape {list(got.shape)}{where}, expected {list(expected.shape)}"
        if got.dtype != expected.dtype:
            return f"dtype {got.dtype}{where}, expected {expected.dtype}"
        if expected.dtype == torch.bool or not expected.is_floating_point():
            wrong = (got.cpu() != expected.cpu()).nonzero()
            if len(wrong):
                index = tuple(wrong[0].tolist())
                return (f"{len(wrong)} element(s) differ{where}; first at {index}: "
                        f"got {got[index].item()}, expected {expected[index].item()}")
            return None
        a, b = got.detach().double().cpu(), expected.detach().double().cpu()
        if torch.isnan(a).any() and not torch.isnan(b).any():
            return f"NaN in the result{where}"
        if not torch.allclose(a, b, atol=atol, rtol=rtol, equal_nan=True):
            error = (a - b).abs().nan_to_num(float("inf"))
            # numpy's unravel_index: torch's imports sympy on its first call (seconds per notebook)
            index = tuple(int(i) for i in numpy.unravel_index(int(error.argmax()), tuple(error.shape)))
            return (f"max abs difference {error.max().item():.3g}{where} at {index}: "
                    f"got {a[index].item():.6g}, expected {b[index].item():.6g}")
        return None
    if isinstance(expected, (list, tuple)):
        if not isinstance(got, (list, tuple)) or len(got) != len(expected):
            size = len(got) if isinstance(got, (list, tuple)) else type(got).__name__
            return f"expected {len(expected)} items{where}, got {size}"
        for i, (g, e) in enumerate(zip(got, expected)):
            found = differences(g, e, atol, rtol, f"{path}[{i}]")
            if found:
                return found
        return None
    if isinstance(expected, dict):
        if not isinstance(got, dict) or set(got) != set(expected):
            return f"keys {sorted(got) if isinstance(got, dict) else type(got).__name__}{where}, " \
                   f"expected {sorted(expected)}"
        for key in expected:
            found = differences(got[key], expected[key], atol, rtol, f"{path}[{key!r}]")
            if found:
                return found
        return None
    if isinstance(expected, float) and isinstance(got, (int, float)):
        return None if abs(got - expected) <= atol + rtol * abs(expected) else \
            f"got {got!r}{where}, expected {expected!r}"
    return None if got == expected else f"got {got!r}{where}, expected {expected!r}"


def _not_implemented(exc: NotImplementedError) -> str:
    found = _STUB_MESSAGE.search(str(exc))
    if found:
        return f"fill in {found.group(2)} (Chapter {found.group(1)})"
    return str(exc) or "NotImplementedError"


def check(target, *args, expected=None, impl=None, reference=None, name: str | None = None,
          atol: float = 1e-5, rtol: float = 1e-4, compare: Callable | None = None, **kwargs) -> CheckResult:
    """Run `target` from the learner's implementation on the arguments and judge the result.

    target: a dotted name looked up in both implementations ("layers.rms_norm"), or a
        callable taking the implementation (`lambda impl: impl.layers.rms_norm(x, w)`),
        for checks that need more than one call.
    expected: the right answer; when omitted, the reference computes it from the same
        arguments (so a check can never drift from the reference).
    compare: optional `compare(got, expected) -> str | None` replacing the default
        `differences` (None means equal).
    Arguments are passed as they are: a function that mutates its inputs should get copies.
    """
    label = name or (target if isinstance(target, str) else str(getattr(target, "__name__", "check")))
    if label == "<lambda>":
        label = "check"
    try:
        mine = impl if impl is not None else load_impl()
        mine = impl_module.load(mine) if isinstance(mine, str) else mine
    except impl_module.ImplError as exc:        # no engine/ yet: nothing implemented
        return CheckResult(label, "not implemented", str(exc))

    def call(which):
        if isinstance(target, str):
            return _resolve(target, which)(*args, **kwargs)
        return target(which, *args, **kwargs)

    try:
        got = call(mine)
    except NotImplementedError as exc:
        return CheckResult(label, "not implemented", _not_implemented(exc))
    except Exception as exc:                    # the learner's bug, shown as one line
        return CheckResult(label, "fail", f"{type(exc).__name__}: {exc}")
    if expected is None:
        try:
            ref = reference if reference is not None else impl_module.reference()
        except impl_module.ImplError:           # a learner's edition: the milestone is the judge
            return CheckResult(label, "unchecked", "no reference here to compare with; run the milestone", got)
        expected = call(impl_module.load(ref) if isinstance(ref, str) else ref)
    problem = (compare or (lambda g, e: differences(g, e, atol, rtol)))(got, expected)
    if problem:
        return CheckResult(label, "fail", problem, got)
    return CheckResult(label, "pass", "", got)


class Table:
    """A small table that renders as HTML in a notebook and as aligned text elsewhere
    (nbval compares text, and the book shows HTML)."""

    def __init__(self, rows, headers=None, floatfmt: str = ".4g"):
        self.headers = list(headers) if headers else None
        self.rows = [[format(v, floatfmt) if isinstance(v, float) else str(v) for v in row] for row in rows]

    def __repr__(self) -> str:
        grid = ([self.headers] if self.headers else []) + self.rows
        widths = [max(len(row[i]) for row in grid) for i in range(len(grid[0]))] if grid else []
        lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in grid]
        if self.headers:
            lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{html.escape(h)}</th>" for h in self.headers) if self.headers else ""
        body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>"
                       for row in self.rows)
        return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def table(rows, headers=None, floatfmt: str = ".4g") -> Table:
    """Lay out small data (a handful of rows) for the reader: `table(rows, ["pos", "cos"])`."""
    return Table(rows, headers, floatfmt)
