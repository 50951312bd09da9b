"""Chapter 35's diagrams: the path from a pattern to a masked sampler, and a byte DFA drawn
with its states and moves (the same style as course.diagrams, which the functions reuse).

    from course import diagrams
    from course.diagrams import ch35
    diagrams.show(ch35.guided_pipeline())
    diagrams.show(ch35.thompson_fragments())
    diagrams.show(ch35.subset_step())
    diagrams.show(ch35.dfa_graph(dfa, "a DFA"))
"""
from __future__ import annotations

import math

from matplotlib.figure import Figure

from course.diagrams import COLUMN_INCHES, INK, KEY, MUTED, QUERY, _arrow, _box, _canvas

ONCE = "#DCE6F2"          # work done once per (pattern, vocabulary)
EVERY_STEP = "#FBE3D0"    # work done at every decoding step
# A DFA's edge labels, in points: 12 px at the drawing's own size, about 11 px once the
# widest drawing is scaled to the book's column.
EDGE_PT = 9


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


def _state(ax, x: float, y: float, label: str = "", edge: str = INK, face: str = "white", r: float = 0.24) -> None:
    ax.add_patch(_circle(x, y, r, edge, face))
    if label:
        ax.text(x, y, label, ha="center", va="center", fontsize=9, color=edge)


def _move(ax, start, end, label: str, color: str = INK, connection: str = "arc3", above: float = 0.1,
          at: tuple[float, float] | None = None, rims: tuple[bool, bool] = (True, True)) -> None:
    """An arrow between two points with its label; an end that is a state's centre (rims)
    is moved out to the state's rim."""
    (sx, sy), (ex, ey) = start, end
    gap = 0.26 / max(math.hypot(ex - sx, ey - sy), 1e-9)
    if rims[0]:
        sx, sy = sx + (ex - sx) * gap, sy + (ey - sy) * gap
    if rims[1]:
        ex, ey = ex - (ex - start[0]) * gap, ey - (ey - start[1]) * gap
    _arrow(ax, (sx, sy), (ex, ey), color=color, connection=connection)
    x, y = at if at else ((sx + ex) / 2, (sy + ey) / 2 + above)
    ax.text(x, y, label, ha="center", va="bottom", fontsize=9, color=color)


def thompson_fragments() -> Figure:
    """Thompson's construction as `build_nfa` does it: every node becomes a fragment with
    its own entry (s) and exit (e) state; bytes are read on edges, and empty moves (ε)
    join the fragments of a node's children (boxes A and B)."""
    fig, ax = _canvas(11.0, 6.6, COLUMN_INCHES * 6.6 / 11.0)

    def fragment_box(x: float, y: float, name: str) -> tuple[tuple[float, float], tuple[float, float]]:
        _box(ax, x, y - 0.32, 1.0, 0.64, name, face=ONCE, size=10)
        return (x, y), (x + 1.0, y)                          # its left and right edges

    def title(x: float, y: float, text: str) -> None:
        ax.text(x, y, text, fontsize=10, weight="bold", color=INK)

    title(0.1, 6.25, "a character class: one edge per byte range")
    _state(ax, 0.6, 5.4, "s")
    _state(ax, 3.4, 5.4, "e")
    _move(ax, (0.6, 5.4), (3.4, 5.4), "61-63   ([a-c])", color=QUERY)
    _state(ax, 0.6, 4.2, "s")
    _state(ax, 2.0, 4.2)
    _state(ax, 3.4, 4.2, "e")
    _move(ax, (0.6, 4.2), (2.0, 4.2), "C3", color=QUERY)
    _move(ax, (2.0, 4.2), (3.4, 4.2), "A9", color=QUERY)
    ax.text(4.0, 4.2, "é: two bytes,\na state between", fontsize=9, va="center", color=INK)

    title(5.8, 6.25, "A B: concatenation")
    _state(ax, 6.0, 5.0, "s")
    a_in, a_out = fragment_box(6.75, 5.0, "A")
    b_in, b_out = fragment_box(8.55, 5.0, "B")
    _state(ax, 10.3, 5.0, "e")
    _move(ax, (6.0, 5.0), a_in, "ε", color=KEY, rims=(True, False))
    _move(ax, a_out, b_in, "ε", color=KEY, rims=(False, False))
    _move(ax, b_out, (10.3, 5.0), "ε", color=KEY, rims=(False, True))
    ax.text(5.8, 3.95, "each box is a child's fragment,\nfrom its own s to its own e", fontsize=9, color=INK)

    title(0.1, 2.95, "A | B: alternation")
    _state(ax, 0.6, 1.5, "s")
    a_in, a_out = fragment_box(1.9, 2.2, "A")
    b_in, b_out = fragment_box(1.9, 0.8, "B")
    _state(ax, 4.1, 1.5, "e")
    _move(ax, (0.6, 1.5), a_in, "ε", color=KEY, at=(1.15, 2.0), rims=(True, False))
    _move(ax, (0.6, 1.5), b_in, "ε", color=KEY, at=(1.15, 0.6), rims=(True, False))
    _move(ax, a_out, (4.1, 1.5), "ε", color=KEY, at=(3.55, 2.0), rims=(False, True))
    _move(ax, b_out, (4.1, 1.5), "ε", color=KEY, at=(3.55, 0.6), rims=(False, True))

    title(5.8, 2.95, "A*: repetition")
    _state(ax, 6.2, 1.6, "s")
    a_in, _ = fragment_box(7.6, 1.6, "A")
    _state(ax, 10.3, 0.7, "e")
    _move(ax, (6.2, 1.6), a_in, "ε", color=KEY, rims=(True, False))
    _move(ax, (8.3, 1.92), (6.2, 1.6), "ε  (once more)", color=KEY, connection="arc3,rad=0.5", at=(7.4, 2.45),
          rims=(False, True))                                  # from A's exit, back to s
    _move(ax, (6.2, 1.6), (10.3, 0.7), "ε  (stop)", color=KEY, at=(8.3, 0.45))
    ax.text(5.8, -0.25, "A+ and A{2,4} chain copies of A first,\nthen this loop or optional copies",
            fontsize=9, color=INK)
    return fig


def subset_step() -> Figure:
    """One step of the subset construction: from the subset S that is DFA state 2, the
    byte class of `a` moves S's NFA states along their `a` edges, and the epsilon closure
    of where they land is the DFA state that `a` leads to (numbered now if it is new)."""
    fig, ax = _canvas(11.0, 5.4, COLUMN_INCHES * 5.4 / 11.0)
    from matplotlib.patches import FancyBboxPatch
    for x, y, w, h, text, face in ((0.5, 1.55, 1.9, 3.0, "S = DFA state 2\n= {1, 3, 5}", ONCE),
                                   (4.1, 2.55, 4.2, 2.0, "closure({4, 6}) = {4, 6, 7, 9}\n= DFA state 3 (new)",
                                    EVERY_STEP)):
        ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02,rounding_size=0.2",
                                    facecolor=face, edgecolor=MUTED, lw=1.0))
        ax.text(x + w / 2, 4.75, text, ha="center", va="bottom", fontsize=9.5, color=INK)
    for state, y in {1: 4.0, 3: 3.05, 5: 2.1}.items():
        _state(ax, 1.45, y, str(state))
    _state(ax, 4.8, 4.0, "4")
    _state(ax, 4.8, 3.05, "6")
    _state(ax, 7.4, 4.0, "7")
    _state(ax, 7.4, 3.05, "9")
    _state(ax, 4.8, 2.1, "8", edge=MUTED)
    _move(ax, (1.45, 4.0), (4.8, 4.0), "a", color=QUERY)
    _move(ax, (1.45, 3.05), (4.8, 3.05), "a-z", color=QUERY)
    _move(ax, (1.45, 2.1), (4.8, 2.1), "b", color=MUTED)
    ax.text(5.2, 2.1, "does not read a: not followed", fontsize=9, va="center", color=MUTED)
    _move(ax, (4.8, 4.0), (7.4, 4.0), "ε", color=KEY)
    _move(ax, (7.4, 4.0), (7.4, 3.05), "ε", color=KEY, at=(7.6, 3.4))
    ax.text(0.5, 1.05, "1. move: the states of S with an edge that reads a, along it: {4, 6}", fontsize=9.5,
            color=QUERY)
    ax.text(0.5, 0.55, "2. closure: add every state their empty moves reach: {4, 6, 7, 9}", fontsize=9.5, color=KEY)
    ax.text(0.5, 0.05, "3. the DFA gets the move 2 --a--> 3; every byte of a's class gets the same one",
            fontsize=9.5, color=INK)
    return fig


def byte_label(values: list[int]) -> str:
    """Bytes as short ranges: printable ASCII as characters, others as hex. A label that is
    one punctuation byte is quoted (`'.'`, `'-'`): a lone dot or dash is too small to see."""
    def show(b: int) -> str:
        return chr(b) if 33 <= b < 127 else ("␠" if b == 32 else f"x{b:02X}")
    if len(values) == 1 and 33 <= values[0] < 127 and not chr(values[0]).isalnum():
        return f"'{chr(values[0])}'"
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
    width = 1.9 * max(columns) + 1.5
    height = 1.5 * max(len(v) for v in columns.values()) + 0.2
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
                ax.text(x, y + radius + 0.42, byte_label(values), ha="center", fontsize=EDGE_PT, color=QUERY)
                continue
            angle = math.atan2(ty - y, tx - x)
            start = (x + radius * math.cos(angle), y + radius * math.sin(angle))
            end = (tx - radius * math.cos(angle), ty - radius * math.sin(angle))
            # A move to the right is straight. A move within a column bends to the east,
            # away from the moves that come in from the west, and further when it passes a
            # state on its way; a move back to the west bends by a fixed amount.
            if tx > x:
                bend = 0.0
            elif tx == x:
                bend = (0.6 if abs(ty - y) > 1.6 else 0.35) * (1 if ty > y else -1)
            else:
                bend = 0.35
            _arrow(ax, start, end, connection=f"arc3,rad={bend}")
            _move_label(ax, start, end, bend, byte_label(values))
    _arrow(ax, (0.05, where[dfa.start][1]), (where[dfa.start][0] - radius, where[dfa.start][1]))
    if title:
        ax.text(0.05, height - 0.25, title, fontsize=10, weight="bold", color=INK)
    return fig


def _move_label(ax, start, end, bend: float, text: str) -> None:
    """Label a move: above the middle of a straight arrow; outside a bent one, a third of
    the way along, where it is clear of the states and of the labels of the straight moves
    between them. (matplotlib's arc3 is a quadratic curve whose control point lies `bend`
    chords from the chord's middle, on its right-hand side for a positive bend.)"""
    (sx, sy), (ex, ey) = start, end
    if not bend:
        ax.text((sx + ex) / 2, (sy + ey) / 2 + 0.12, text, ha="center", fontsize=EDGE_PT, color=QUERY)
        return
    chord = math.hypot(ex - sx, ey - sy)
    out_x, out_y = (ey - sy) / chord, -(ex - sx) / chord        # unit vector to the bulge's side
    control = ((sx + ex) / 2 + bend * chord * out_x, (sy + ey) / 2 + bend * chord * out_y)
    t = 1 / 3
    x, y = ((1 - t) ** 2 * a + 2 * t * (1 - t) * c + t ** 2 * b for a, c, b in zip(start, control, end))
    ha = "left" if out_x > 0.3 else "right" if out_x < -0.3 else "center"
    va = "bottom" if out_y > 0.3 else "top" if out_y < -0.3 else "center"
    ax.text(x + 0.08 * out_x, y + 0.08 * out_y, text, ha=ha, va=va, fontsize=EDGE_PT, color=QUERY)


def _circle(x: float, y: float, r: float, edge: str, face: str = "white"):
    from matplotlib.patches import Circle
    return Circle((x, y), r, facecolor=face, edgecolor=edge, lw=1.3)
