"""Chapter 43's diagrams: the per-row adapter gather of batched LoRA, and M-RoPE's grid.

Same conventions as course.diagrams (one palette, SVG through `diagrams.show`).

    from course import diagrams
    from course.diagrams import ch43
    diagrams.show(ch43.lora_gather(["base", "sql", "sql", "poet", "base", "math"]))
"""
from __future__ import annotations

from matplotlib import patches
from matplotlib.figure import Figure

from course.diagrams import COLUMN_INCHES, INK, MUTED, PAD, REQUEST_COLOURS, _arrow, _box, _canvas


def lora_gather(row_adapters: list[str]) -> Figure:
    """A flattened batch whose rows belong to different adapters. Each row picks its own A
    and B out of the stacks (slot 0, all zeros, for rows without adapter): one gather and
    one batched matmul per step, shrink to rank r, then expand back, beside the shared W."""
    names = ["base"] + sorted({a for a in row_adapters if a != "base"})
    colour = {name: (PAD if name == "base" else REQUEST_COLOURS[i % len(REQUEST_COLOURS)])
              for i, name in enumerate(names)}
    rows = len(row_adapters)
    height = max(rows, len(names)) * 0.8 + 2.4
    fig, ax = _canvas(13.0, height, COLUMN_INCHES * height / 13.0)
    top = height - 1.4
    ax.text(1.2, height - 0.6, "rows x [N, in]", ha="center", fontsize=10, weight="bold")
    ax.text(5.6, height - 0.6, "stacked A [S, r, in], B [S, out, r]", ha="center", fontsize=10, weight="bold")
    ax.text(10.6, height - 0.6, "y = x W^T + s[slot] (x A^T) B^T", ha="center", fontsize=10, weight="bold")
    slot_y = {}
    for slot, name in enumerate(names):
        y = top - slot * 0.8
        slot_y[name] = y
        _box(ax, 4.3, y - 0.3, 2.6, 0.6, f"slot {slot}: {'zeros' if name == 'base' else name}",
             face=colour[name], size=9, color=INK if name == "base" else "white")
    for row, name in enumerate(row_adapters):
        y = top - row * 0.8
        ax.add_patch(patches.Rectangle((0.3, y - 0.3), 1.8, 0.6, facecolor=colour[name], edgecolor="white", lw=1.5))
        ax.text(1.2, y, f"row {row}: {name}", ha="center", va="center", fontsize=8.5,
                color=INK if name == "base" else "white")
        _arrow(ax, (2.1, y), (4.3, slot_y[name]), color=MUTED if name == "base" else colour[name])
        ax.add_patch(patches.Rectangle((9.3, y - 0.3), 2.6, 0.6, facecolor="white", edgecolor=colour[name]
                                       if name != "base" else MUTED, lw=1.5))
        ax.text(10.6, y, "base only" if name == "base" else f"base + {name}'s update", ha="center",
                va="center", fontsize=8.5)
        _arrow(ax, (6.9, slot_y[name]), (9.3, y), color=MUTED if name == "base" else colour[name], lw=0.8)
    ax.text(6.5, 0.5, "shrink: index_select(A, slots) then bmm -> [N, r];   expand: index_select(B, slots), "
            "bmm, scale, add", ha="center", fontsize=9, color="#505050")
    return fig


def mrope_grid(before: int = 3, rows: int = 2, cols: int = 3, after: int = 3) -> Figure:
    """A prompt of `before` text tokens, an image of rows x cols image tokens and `after`
    text tokens, with each token's (temporal, height, width) position. The text after the
    image starts at the largest position used + 1, not at the token's index."""
    cell = 1.25
    width = (before + cols + after) * cell + 2.6
    height = rows * cell + 3.2
    fig, ax = _canvas(width, height, COLUMN_INCHES * height / width)
    base_y = 1.4
    counter, x = 0, 0.3
    for index in range(before):
        _token(ax, x, base_y + (rows - 1) * cell / 2, cell, (counter, counter, counter), f"text {index}", MUTED)
        counter, x = counter + 1, x + cell
    start = counter
    for row in range(rows):
        for col in range(cols):
            _token(ax, x + col * cell, base_y + (rows - 1 - row) * cell, cell, (start, start + row, start + col),
                   f"img ({row},{col})", REQUEST_COLOURS[0])
    x += cols * cell
    counter = start + max(rows, cols)
    for index in range(after):
        _token(ax, x, base_y + (rows - 1) * cell / 2, cell, (counter, counter, counter), f"text {before + index}",
               MUTED)
        counter, x = counter + 1, x + cell
    ax.text(width / 2, height - 0.6, f"(t, h, w) of every token: the image's rows move h, its columns move w; "
            f"the text after it restarts at {start} + max({rows}, {cols}) = {start + max(rows, cols)}",
            ha="center", fontsize=9.5)
    ax.text(width / 2, 0.5, f"{before + rows * cols + after} tokens, largest position {counter - 1}: "
            f"a generated token at index q gets q + ({counter - 1} + 1 - {before + rows * cols + after})",
            ha="center", fontsize=9.5, color="#505050")
    return fig


def _token(ax, x: float, y: float, cell: float, position: tuple[int, int, int], label: str, colour: str) -> None:
    ax.add_patch(patches.Rectangle((x, y), cell - 0.08, cell - 0.08, facecolor=colour, edgecolor="white", lw=1.5,
                                   alpha=0.9))
    ax.text(x + cell / 2, y + cell * 0.65, label, ha="center", va="center", fontsize=7.5,
            color="white" if colour != MUTED else INK)
    ax.text(x + cell / 2, y + cell * 0.3, "{},{},{}".format(*position), ha="center", va="center", fontsize=8.5,
            weight="bold", color="white" if colour != MUTED else INK)


def vision_tower(rows: int = 4, cols: int = 4, merge: int = 2) -> Figure:
    """Qwen3-VL's vision tower on a rows x cols grid of patches: patches numbered in the order
    the encoder reads them (square by square), the stages they go through, and the merged
    grid of image tokens, each coloured like the square of patches it came from."""
    cell = 0.9
    width, height = 17.0, rows * cell + 3.0
    fig, ax = _canvas(width, height, COLUMN_INCHES * height / width)
    base_y = 1.1
    squares_per_row = cols // merge
    for row in range(rows):
        for col in range(cols):
            square = (row // merge) * squares_per_row + col // merge
            order = square * merge * merge + (row % merge) * merge + col % merge
            y = base_y + (rows - 1 - row) * cell
            ax.add_patch(patches.Rectangle((0.3 + col * cell, y), cell - 0.06, cell - 0.06, lw=1.5,
                                           facecolor=REQUEST_COLOURS[square % len(REQUEST_COLOURS)],
                                           edgecolor="white"))
            ax.text(0.3 + (col + 0.47) * cell, y + 0.47 * cell, str(order), ha="center", va="center",
                    fontsize=9, color="white", weight="bold")
    ax.text(0.3 + cols * cell / 2, height - 0.7, f"{rows} x {cols} patches,\nnumbered in reading order",
            ha="center", fontsize=9)
    stages = ["patch embed: Linear on C x T x p x p pixels\n+ learned positions, resampled to the grid",
              "blocks: LayerNorm, attention rotated by\n(row, col) (2-D RoPE), LayerNorm, MLP",
              f"merger: each run of {merge * merge} patches (one square)\nLayerNorm, side by side, MLP"]
    left, box_w, box_h = 0.3 + cols * cell + 0.9, 6.6, 0.95
    for index, text in enumerate(stages):
        y = base_y + rows * cell - (index + 1) * (box_h + 0.35) + 0.3
        _box(ax, left, y, box_w, box_h, text, size=8.5)
        if index:
            _arrow(ax, (left + box_w / 2, y + box_h + 0.35), (left + box_w / 2, y + box_h))
    _arrow(ax, (0.3 + cols * cell + 0.1, base_y + rows * cell / 2), (left, base_y + rows * cell / 2))
    token_left = left + box_w + 1.2
    _arrow(ax, (left + box_w, base_y + rows * cell / 2), (token_left, base_y + rows * cell / 2))
    big = cell * merge * 0.75
    for row in range(rows // merge):
        for col in range(squares_per_row):
            square = row * squares_per_row + col
            y = base_y + rows * cell / 2 + ((rows // merge) / 2 - 1 - row) * big
            ax.add_patch(patches.Rectangle((token_left + col * big, y), big - 0.06, big - 0.06, lw=1.5,
                                           facecolor=REQUEST_COLOURS[square % len(REQUEST_COLOURS)],
                                           edgecolor="white"))
            ax.text(token_left + (col + 0.5) * big, y + 0.5 * big, f"token {square}", ha="center", va="center",
                    fontsize=8.5, color="white")
    ax.text(token_left + squares_per_row * big / 2, height - 0.7,
            f"{rows // merge} x {squares_per_row} image tokens,\nlanguage model's width", ha="center", fontsize=9)
    ax.text(width / 2, 0.4, "the order makes merging a reshape: patches 0-3 are one square, 4-7 the next, ...",
            ha="center", fontsize=9, color="#505050")
    return fig
