"""Pictures for Chapter 32's notebook: the vectorised gather and the Triton kernel's tiling.

Both take the same small description of a step, [(name, seq_len, new_rows, block_table)],
and a block size, and draw what each backend does with it. Each returns a Figure as wide as
the book's column (course.diagrams.COLUMN_INCHES) for course.diagrams.show, with no label
under 8 pt, so that no label is shown under 9 px.
"""
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from course.diagrams import COLUMN_INCHES

COLOURS = ["#e45756", "#4c78a8", "#54a24b", "#f58518", "#b279a2", "#9d755d"]


def _box(ax, x, y, w, h, face, text=None, alpha=1.0, size=9, edge="black"):
    ax.add_patch(Rectangle((x, y), w, h, facecolor=face, edgecolor=edge, alpha=alpha, lw=0.8))
    if text is not None:
        ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=size)


def draw_gather(requests, block_size, pool_blocks):
    """Left: the pool, blocks coloured by owner. Middle: the block table, one row per
    request. Right: the gathered [R, K] keys (K = widest table x block_size) with the mask
    of each request's query rows: which keys each new row may read."""
    # The pool and the table side by side above, the wide mask below on the full width.
    fig = Figure(figsize=(COLUMN_INCHES, 5.6))
    grid = fig.add_gridspec(2, 2, height_ratios=[1, 1.5], width_ratios=[1, 1])
    pool_ax, table_ax, mask_ax = fig.add_subplot(grid[0, 0]), fig.add_subplot(grid[0, 1]), fig.add_subplot(grid[1, :])
    owner = {}
    for r, (_, _, _, table) in enumerate(requests):
        for b in table:
            owner[b] = r
    for b in range(pool_blocks):
        face = COLOURS[owner[b] % len(COLOURS)] if b in owner else "#eeeeee"
        _box(pool_ax, b % 4, -(b // 4), 0.9, 0.9, face, str(b))
    pool_ax.set_title("the pool (block ids)", fontsize=10)
    width = max(len(t) for *_, t in requests)
    for r, (name, _, _, table) in enumerate(requests):
        for j in range(width):
            block = table[j] if j < len(table) else 0
            face = COLOURS[r % len(COLOURS)] if j < len(table) else "#ffffff"
            _box(table_ax, j, -r, 0.9, 0.9, face, str(block), alpha=1.0 if j < len(table) else 0.4)
        table_ax.text(-0.3, -r + 0.45, name, ha="right", va="center", fontsize=10)
    table_ax.set_title("block_table [R, W]\n(one gather: pool[block_table])", fontsize=10)
    keys = width * block_size
    y = 0
    for r, (name, seq_len, rows, _) in enumerate(requests):
        for i in range(rows):
            position = seq_len - rows + i
            for j in range(keys):
                visible = j <= position
                face = COLOURS[r % len(COLOURS)] if visible else ("#f4f4f4" if j < seq_len else "#dddddd")
                _box(mask_ax, j, -y, 1, 1, face, edge="white")
            mask_ax.text(-0.5, -y + 0.5, f"{name} @{position}", ha="right", va="center", fontsize=9)
            y += 1
        y += 0.6
    for b in range(1, width):
        mask_ax.axvline(b * block_size, color="black", lw=0.6, ls=":")
    mask_ax.set_title(f"gathered keys [R, K={keys}] and the mask:\nquery row i sees key j <= its position",
                      fontsize=10)
    for ax in (pool_ax, table_ax, mask_ax):
        ax.set_aspect("equal")
        ax.axis("off")
        ax.autoscale_view()
    pool_ax.set_xlim(-0.2, 4)
    table_ax.set_xlim(-1.5, width)
    mask_ax.set_xlim(-4, keys)
    fig.tight_layout()
    return fig


def draw_tiling(requests, block_size, block_m, heads):
    """The Triton launch: one column of programs per query head, one program per tile of
    block_m rows of one request; each program walks that request's blocks (the arrows)
    up to its last row's position, one block per loop iteration."""
    tiles = []
    for r, (name, seq_len, rows, table) in enumerate(requests):
        for first in range(0, rows, block_m):
            last_row = min(first + block_m, rows) - 1
            last_position = seq_len - rows + last_row
            tiles.append((r, name, first, min(first + block_m, rows), table[:last_position // block_size + 1]))
    fig = Figure(figsize=(COLUMN_INCHES, 0.55 * len(tiles) + 1.4))
    ax = fig.add_subplot()
    for t, (r, name, first, end, blocks) in enumerate(tiles):
        y = -t
        for h in range(heads):
            _box(ax, h * 0.7, y, 0.6, 0.8, COLOURS[r % len(COLOURS)], f"h{h}", alpha=0.85)
        ax.text(heads * 0.7 + 0.2, y + 0.4, f"{name}: rows {first}-{end - 1}", va="center", fontsize=9)
        for k, block in enumerate(blocks):
            _box(ax, heads * 0.7 + 3.2 + k * 1.1, y, 0.9, 0.8, "#dddddd", f"blk {block}")
            if k:
                ax.annotate("", (heads * 0.7 + 3.2 + k * 1.1, y + 0.4), (heads * 0.7 + 3.2 + k * 1.1 - 0.2, y + 0.4),
                            arrowprops=dict(arrowstyle="->", lw=0.8))
    ax.text(heads * 0.35, 1.1, "programs\n(tile, head)", ha="center", fontsize=10)
    ax.text(heads * 0.7 + 3.2, 1.1, "blocks it reads in place,\none per iteration (online softmax)",
            fontsize=10)
    ax.set_xlim(-0.2, heads * 0.7 + 3.2 + 1.1 * max(len(t[-1]) for t in tiles) + 0.3)
    ax.set_ylim(-len(tiles) + 0.6, 2.0)
    ax.axis("off")
    fig.tight_layout()
    return fig


def draw_profile(profiles):
    """Stacked bars: share of a core step in each part, one bar per (workload, backend)."""
    parts = list(next(iter(profiles.values())))
    colours = dict(zip(parts, ["#4c78a8", "#72b7b2", "#e45756", "#f58518", "#54a24b", "#b279a2", "#9d755d"]))
    fig = Figure(figsize=(COLUMN_INCHES, 0.6 * len(profiles) + 1.6))
    ax = fig.add_subplot()
    for i, shares in enumerate(profiles.values()):
        left = 0.0
        for part in parts:
            ax.barh(i, shares[part], left=left, color=colours[part], label=part if i == 0 else None)
            if shares[part] >= 6:
                ax.text(left + shares[part] / 2, i, f"{shares[part]:.0f}", ha="center", va="center", fontsize=9)
            left += shares[part]
    ax.set_yticks(range(len(profiles)), list(profiles))
    ax.invert_yaxis()
    ax.set_xlabel("percent of step time")
    ax.legend(ncol=3, fontsize=9, loc="upper center", bbox_to_anchor=(0.5, -0.3), frameon=False)
    fig.tight_layout()
    return fig

