"""Chapter 37's diagram: one request's verification step inside the engine, drawn with the
helpers and palette of course.diagrams (show it with `diagrams.show(fig)`)."""
from __future__ import annotations

from matplotlib import patches
from matplotlib.figure import Figure

from course.diagrams import INK, KEY, MUTED, PAD, QUERY, _arrow, _box, _canvas

ACCEPTED = "#55A868"
REJECTED = "#C44E52"


def verification_step(block_size: int = 4, computed: int = 6, accepted: int = 1, drafts: int = 4) -> Figure:
    """Top: the slots of one request before the step (computed tokens, the newest real token,
    the drafts fed behind it) and the blocks they sit in. Middle: what each sampled row
    says and whether its draft survives. Bottom: the request after settle(): accepted drafts
    and the target's own token appended, num_computed_tokens rolled back, the blocks that
    held only rejected drafts trimmed."""
    slots = computed + 1 + drafts
    blocks = -(-slots // block_size)
    width = blocks * block_size + 4.5
    fig, ax = _canvas(width, 9.2, 4.4)
    left = 3.6

    def cell(x: float, y: float, text: str, face: str, color: str = INK) -> None:
        _box(ax, left + x + 0.06, y, 0.88, 0.8, text, face=face, size=9, color=color, round_=False)

    ax.text(0.1, 8.0, "before the step", fontsize=10, va="center", color=INK)
    for b in range(blocks):
        ax.plot([left + b * block_size] * 2, [7.35, 8.85], color=MUTED, lw=1)
        ax.text(left + b * block_size + block_size / 2, 9.05, f"block {b}", ha="center", fontsize=9, color=MUTED)
    ax.plot([left + blocks * block_size] * 2, [7.35, 8.85], color=MUTED, lw=1)
    for p in range(computed):
        cell(p, 7.6, f"t{p}", PAD)
    cell(computed, 7.6, f"t{computed}", "white")
    for d in range(drafts):
        cell(computed + 1 + d, 7.6, f"d{d + 1}", "#F3E3D3")
    ax.text(left + computed / 2, 7.1, "num_computed_tokens", ha="center", fontsize=9, color=INK)
    # On a white ground above the arrows that run down from the drafts, which would cross it.
    ax.text(left + computed + (drafts + 1) / 2 + 0.5, 7.1, "scheduled: 1 + drafts", ha="center", fontsize=9,
            color=KEY, zorder=5, bbox={"facecolor": "white", "edgecolor": "none", "pad": 1})

    ax.text(0.1, 5.2, "sampled rows", fontsize=10, va="center", color=INK)
    for r in range(drafts + 1):
        x = computed + r
        if r < accepted:
            label, face, color = f"= d{r + 1}", ACCEPTED, "white"
        elif r == accepted:
            label, face, color = "x", QUERY, "white"
        else:
            label, face, color = "--", PAD, MUTED
        cell(x + 1, 4.8, label, face, color)
        _arrow(ax, (left + x + 0.5, 7.55), (left + x + 1.45, 5.65), color=MUTED, lw=0.9)
    # Notes end at the blocks' right edge, so that the figure stays as wide as the column.
    right = left + blocks * block_size
    ax.text(right, 4.35, f"row {accepted}: the target disagrees, its own token x ends the step", ha="right",
            fontsize=9, va="center", color=INK)

    ax.text(0.1, 2.4, "after settle()", fontsize=10, va="center", color=INK)
    keep = computed + 1 + accepted
    for p in range(keep):
        cell(p, 2.0, f"t{p}" if p <= computed else f"d{p - computed}", PAD if p <= computed else ACCEPTED,
             INK if p <= computed else "white")
    cell(keep, 2.0, "x", QUERY, "white")
    kept_blocks = -(-keep // block_size)
    for b in range(blocks):
        face = "none" if b < kept_blocks else REJECTED
        ax.add_patch(patches.Rectangle(
            (left + b * block_size, 1.75), block_size, 1.3, facecolor=face, alpha=0.15, edgecolor=MUTED))
    ax.text(left + keep / 2, 1.35, f"num_computed_tokens = {keep} (rolled back)", ha="center", fontsize=9,
            color=INK)
    if kept_blocks < blocks:
        ax.text(left + (kept_blocks + blocks) * block_size / 2, 1.35, "trimmed: back to the pool", ha="center",
                fontsize=9, color=REJECTED)
    ax.text(right, 0.6, "the newest token x has no K/V yet: next step feeds it with new drafts",
            ha="right", fontsize=9, color=INK)
    return fig
