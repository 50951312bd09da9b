"""Chapter 35's picture of the pushdown guide: a JSON text read token by token, with the
stack of open containers after every byte (same style as course.diagrams).

    from course import diagrams
    from course.diagrams import ch35_pda
    diagrams.show(ch35_pda.stack_trace(tokens, stacks))
"""
from __future__ import annotations

from course.diagrams import COLUMN_INCHES, INK, KEY, MUTED, QUERY, _box, _canvas

KIND_COLOURS = {1: QUERY, 2: KEY}          # OBJECT, ARRAY (json_pda's kinds)
KIND_LABELS = {1: "{", 2: "["}


def stack_trace(tokens: list[bytes], stacks: list[list[int]]):
    """A JSON text read token by token: each byte in its column, the containers open after
    it stacked above (an object in blue, an array in orange), and a bracket under each
    token. A token such as ]} closes two containers in one step."""
    text = b"".join(tokens)
    assert len(stacks) == len(text), "one stack per byte"
    height = max(len(s) for s in stacks) + 1
    cell = 0.42
    width, tall = len(text) * cell + 0.4, (height + 2.6) * cell
    fig, ax = _canvas(width, tall, COLUMN_INCHES * tall / width)
    base = 1.6 * cell
    for column, (byte, stack) in enumerate(zip(text, stacks)):
        x = 0.2 + column * cell
        ax.text(x + cell / 2, base - 0.45 * cell, chr(byte) if byte != 32 else "·", ha="center", va="center",
                fontsize=9, family="monospace", color=INK)
        for level, kind in enumerate(stack):
            _box(ax, x + 0.03, base + level * cell, cell - 0.06, cell - 0.06, KIND_LABELS[kind],
                 face=KIND_COLOURS[kind], edge="white", size=7, color="white", round_=False)
    start = 0
    for number, token in enumerate(tokens):
        x0, x1 = 0.2 + start * cell + 0.04, 0.2 + (start + len(token)) * cell - 0.04
        colour = INK if number % 2 == 0 else MUTED
        ax.plot([x0, x0, x1, x1], [0.75 * cell, 0.6 * cell, 0.6 * cell, 0.75 * cell], color=colour, lw=1.2)
        start += len(token)
    ax.text(0.2, tall - 0.5 * cell, "open containers after each byte ({ object, [ array); tokens bracketed below",
            fontsize=9, color=INK)
    return fig
