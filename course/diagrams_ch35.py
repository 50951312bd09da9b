"""Chapter 35's diagrams: the path from a pattern to a masked sampler, and a byte DFA drawn
with its states and moves (the same style as course/diagrams.py, which the functions reuse).

    from course import diagrams, diagrams_ch35
    diagrams.show(diagrams_ch35.guided_pipeline())
    diagrams.show(diagrams_ch35.dfa_graph(dfa, "a DFA"))
"""
from __future__ import annotations

import math

from matplotlib.figure import Figure

from .diagrams import COLUMN_INCHES, INK, KEY, MUTED, QUERY, _arrow, _box, _canvas

ONCE = "#DCE6F2"          # work done once per (pattern, vocabulary)
EVERY_STEP = "#FBE3D0"    # work done at every decoding step


def guided_pipeline() -> Figure:
    """Pattern -> NFA -> DFA -> per-state token masks (once, cached) and, at every step,
    the guide's state -> its mask -> the sampler -> the token -> advance."""
    fig, ax = _canvas(11.0, 4.9, 3.6)
    once = [("JSON schema\nor regex", 0.1), ("syntax tree\n(parse)", 2.3), ("NFA over bytes\n(Thompson)", 4.5),
            ("DFA over bytes\n(subsets, trim,\nminimise)", 6.7),
            ("token masks,\none per DFA state\n(lazy, cached)", 8.9)]
    for text, x in once:
        _box(ax, x, 3.1, 2.0, 1.35, text, face=ONCE, size=9)
    for (_, x), (_, x_next) in zip(once, once[1:]):
        _arrow(ax, (x + 2.0, 3.77), (x_next, 3.77))
    ax.text(0.1, 4.7, "once per (pattern, vocabulary)", fontsize=9.5, color=QUERY, weight="bold")
    step = [("guide.state\n(a DFA state)", 0.9), ("allowed():\nthe state's mask", 3.5),
            ("sampler: forbidden\nlogits = -inf", 6.1), ("token drawn,\nappended", 8.7)]
    for text, x in step:
        _box(ax, x, 0.85, 2.1, 1.2, text, face=EVERY_STEP, size=9)
    for (_, x), (_, x_next) in zip(step, step[1:]):
        _arrow(ax, (x + 2.1, 1.45), (x_next, 1.45))
    _arrow(ax, (9.75, 0.85), (1.95, 0.85), connection="arc3,rad=-0.12", color=KEY)
    ax.text(5.9, 0.05, "advance(token): walk its bytes through the DFA", fontsize=9, color=KEY, ha="center")
    _arrow(ax, (9.9, 3.1), (4.55, 2.05), color=MUTED)
    ax.text(0.1, 2.35, "every decoding step, per guided request", fontsize=9.5, color=KEY, weight="bold")
    return fig


def byte_label(values: list[int]) -> str:
    """Bytes as short ranges: printable ASCII as characters, others as hex."""
    def show(b: int) -> str:
        return chr(b) if 33 <= b < 127 else ("␠" if b == 32 else f"x{b:02X}")
    runs: list[list[int]] = []
    for b in values:
        if runs and b == runs[-1][1] + 1:
            runs[-1][1] = b
        else:
            runs.append([b, b])
    parts = [show(lo) if lo == hi else f"{show(lo)}-{show(hi)}" for lo, hi in runs]
    return ",".join(parts) if len(parts) <= 3 else ",".join(parts[:3]) + ",…"


def dfa_graph(dfa, title: str = "", highlight: int | None = None) -> Figure:
    """The states of a small DFA left to right by distance from the start, each move an
    arrow labelled with its bytes; accepting states have a double ring; `highlight` is
    drawn in orange."""
    table = dfa.transitions
    depth = {dfa.start: 0}
    order = [dfa.start]
    for state in order:
        for target in table[state].tolist():
            if target >= 0 and target not in depth:
                depth[target] = depth[state] + 1
                order.append(target)
    columns: dict[int, list[int]] = {}
    for state in order:
        columns.setdefault(depth[state], []).append(state)
    width = 1.9 * (max(columns) + 1) + 0.6
    height = 1.5 * max(len(v) for v in columns.values()) + 1.0
    fig, ax = _canvas(width, height, min(COLUMN_INCHES * height / width, 4.6))
    where = {}
    for d, states in columns.items():
        for k, state in enumerate(states):
            where[state] = (0.7 + 1.9 * d, height - 0.9 - 1.5 * k - 0.75 * (max(len(v) for v in columns.values())
                                                                             - len(states)))
    radius = 0.32
    for state in order:
        x, y = where[state]
        edge = KEY if state == highlight else INK
        ax.add_patch(_circle(x, y, radius, edge))
        if dfa.accepting[state]:
            ax.add_patch(_circle(x, y, radius - 0.07, edge))
        ax.text(x, y, str(state), ha="center", va="center", fontsize=10, color=edge)
        targets: dict[int, list[int]] = {}
        for byte, target in enumerate(table[state].tolist()):
            if target >= 0:
                targets.setdefault(target, []).append(byte)
        for target, values in targets.items():
            tx, ty = where[target]
            if target == state:
                _arrow(ax, (x - 0.15, y + radius), (x + 0.15, y + radius), connection="arc3,rad=-2.2")
                ax.text(x, y + radius + 0.42, byte_label(values), ha="center", fontsize=8, color=QUERY)
                continue
            angle = math.atan2(ty - y, tx - x)
            start = (x + radius * math.cos(angle), y + radius * math.sin(angle))
            end = (tx - radius * math.cos(angle), ty - radius * math.sin(angle))
            bend = 0.0 if tx > x else 0.35
            _arrow(ax, start, end, connection=f"arc3,rad={bend}")
            ax.text((start[0] + end[0]) / 2, (start[1] + end[1]) / 2 + 0.12, byte_label(values), ha="center",
                    fontsize=8, color=QUERY)
    _arrow(ax, (0.05, where[dfa.start][1]), (where[dfa.start][0] - radius, where[dfa.start][1]))
    if title:
        ax.text(0.05, height - 0.25, title, fontsize=10, weight="bold", color=INK)
    return fig


def _circle(x: float, y: float, r: float, edge: str):
    from matplotlib.patches import Circle
    return Circle((x, y), r, facecolor="white", edgecolor=edge, lw=1.3)
