"""Conceptual diagrams of the book, drawn with matplotlib from code kept here; the later
chapters' own diagrams are its modules chNN, and `python -m course.diagrams.refresh` re-runs
a notebook's diagram cells.

Each function returns a matplotlib Figure; `show(fig)` puts it in a notebook as SVG, which
stays sharp at any zoom and scales to the book's column (about 780 px), with a PNG twin for
the one reader that refuses SVG: JupyterLab does not draw the SVG outputs of a notebook it
does not trust (every chapter a learner opens before running it), and falls back to the PNG.
The chapters call these from cells tagged `remove-input`: the book shows the picture, not the
plotting code.

    from course import diagrams
    diagrams.show(diagrams.engine_map(highlight="V"))
"""
from __future__ import annotations

import io

import matplotlib
from matplotlib import patches
from matplotlib.figure import Figure

# One palette for every diagram, so a colour means the same thing from chapter to chapter.
INK = "#222222"
MUTED = "#B8B8B8"
QUERY = "#4C72B0"
KEY = "#DD8452"
PAD = "#E8E8E8"
REQUEST_COLOURS = ("#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860")

# Wide enough to fill the book's column with text at a readable size.
COLUMN_INCHES = 7.8


def show(fig: Figure) -> None:
    """Display `fig` in the notebook as SVG (vector: sharp on any screen), with a PNG of it for
    viewers that do not render SVG here.

    Jupyter Book and a trusted notebook pick the SVG; JupyterLab shows an untrusted notebook's
    SVG output as a line of text, so there it shows the PNG, drawn at 1.5x for high-density
    screens and sized (`width` metadata) to match the SVG on the page."""
    from IPython.display import SVG, display

    svg = io.StringIO()
    # A fixed hash salt and no date keep the SVG identical from one execution to the next,
    # so re-executing a notebook does not rewrite its diagrams.
    with matplotlib.rc_context({"svg.hashsalt": "course-diagrams"}):
        fig.savefig(svg, format="svg", bbox_inches="tight", metadata={"Date": None})
    png, width, height = _png_twin(fig)
    # IPython's SVG keeps only the <svg> element (no XML prologue), as the book always had it.
    display({"image/svg+xml": SVG(svg.getvalue()).data, "image/png": png, "text/plain": repr(fig)}, raw=True,
            metadata={"image/png": {"width": width, "height": height}})


# CSS pixels per inch, the scale at which a browser draws the SVG's points (72 to the inch).
_CSS_DPI = 96
# The PNG twin's resolution: 1.5 device pixels per CSS pixel, sharp on most laptop screens.
_PNG_DPI = 144


def _png_twin(fig: Figure) -> tuple[str, int, int]:
    """`fig` as a base64 PNG with its display size in CSS pixels. The diagrams are flat colours
    on white, so a 256-colour palette (no dithering) looks the same as full colour at about a
    third of the bytes, which is what the notebooks keep in the repository."""
    import base64

    from PIL import Image

    raw = io.BytesIO()
    fig.savefig(raw, format="png", dpi=_PNG_DPI, bbox_inches="tight")
    image = Image.open(io.BytesIO(raw.getvalue())).convert("RGB")
    palette = image.quantize(256, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE)
    packed = io.BytesIO()
    palette.save(packed, format="png", optimize=True)
    width, height = (round(side * _CSS_DPI / _PNG_DPI) for side in image.size)
    return base64.b64encode(packed.getvalue()).decode("ascii"), width, height


def _canvas(width: float, height: float, figheight: float) -> tuple[Figure, matplotlib.axes.Axes]:
    """A figure whose axes use data units width x height with equal aspect and no frame."""
    fig = Figure(figsize=(COLUMN_INCHES, figheight))
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, width)
    ax.set_ylim(0, height)
    ax.set_aspect("equal")
    ax.axis("off")
    return fig, ax


def _box(ax, x, y, w, h, text, face="white", edge=INK, size=10.5, weight="normal", color=INK, round_=True):
    style = "round,pad=0.02,rounding_size=0.12" if round_ else "square,pad=0"
    ax.add_patch(patches.FancyBboxPatch((x, y), w, h, boxstyle=style, facecolor=face, edgecolor=edge, lw=1.2))
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=size, weight=weight, color=color)


def _arrow(ax, start, end, color=INK, style="-|>", lw=1.2, connection="arc3"):
    ax.add_patch(patches.FancyArrowPatch(start, end, arrowstyle=style, mutation_scale=11, color=color, lw=lw,
                                         connectionstyle=connection, shrinkA=2, shrinkB=2))


# --- the engine map (Chapter 1, and the start of each part) -----------------------------------

# Each component of the finished engine, where it sits on the map, and the parts of the
# book that build it. A part's map highlights the components it builds.
ENGINE_COMPONENTS = (
    # name, x, y, w, h, parts
    ("HTTP API\n(OpenAI)", 0.1, 4.2, 2.3, 1.1, {"VIII"}),
    ("Tokenizer,\ndetokenizer", 2.8, 4.2, 2.2, 1.1, {"I", "VII"}),
    ("Scheduler", 5.4, 4.2, 2.3, 1.1, {"V", "VII"}),
    ("Sampler", 8.3, 4.2, 2.0, 1.1, {"I", "III", "VII"}),
    ("Model: Qwen3 forward\nembed, N layers, LM head", 3.1, 2.1, 4.5, 1.2, {"I", "II"}),
    ("Weights,\ncheckpoints", 0.1, 2.1, 2.5, 1.2, {"II", "IV", "VIII"}),
    ("KV cache: buffer,\nslots, pages", 8.0, 2.1, 2.9, 1.2, {"III", "V", "VI"}),
    ("Kernels: attention,\nMoE, Triton, graphs", 3.1, 0.2, 4.5, 1.2, {"IV", "VI", "VII"}),
    ("Measurement:\ncost, profiles", 0.1, 0.2, 2.5, 1.2, {"I", "III", "IV", "V"}),
    ("Batching: static,\ncontinuous, speculative", 8.0, 0.2, 2.9, 1.2, {"IV", "V", "VI", "VII"}),
)


def engine_map(highlight: str | None = None, title: str | None = None) -> Figure:
    """The engine you build, as boxes: the path of a request along the top row, the model
    in the middle, what makes it fast below. With `highlight` (a part id such as "V"), the
    components that part builds are coloured and the rest greyed."""
    fig, ax = _canvas(11.0, 6.3 if highlight else 5.95, 4.5 if highlight else 4.25)
    for name, x, y, w, h, parts in ENGINE_COMPONENTS:
        lit = highlight is None or highlight in parts
        face = "#DCE6F2" if lit else "#F4F4F4"
        edge = QUERY if (highlight and lit) else (INK if lit else MUTED)
        label = name + ("" if highlight else "\n" + ", ".join(sorted(parts, key=_roman)))
        bold = bool(highlight and lit)
        _box(ax, x, y, w, h, label, face=face, edge=edge, size=9 if bold else 9.5, color=INK if lit else "#909090",
             weight="bold" if bold else "normal")
    # The request's path: API -> tokenizer -> scheduler -> model -> sampler -> back out.
    for start, end in [((2.4, 4.75), (2.8, 4.75)), ((5.0, 4.75), (5.4, 4.75)), ((6.5, 4.2), (5.6, 3.3)),
                       ((7.6, 3.1), (8.6, 4.2)), ((7.6, 2.7), (8.0, 2.7)), ((2.6, 2.7), (3.1, 2.7)),
                       ((5.35, 1.4), (5.35, 2.1))]:
        _arrow(ax, start, end)
    _arrow(ax, (9.3, 5.3), (3.9, 5.3), connection="arc3,rad=0.12", color="#707070")
    ax.text(6.6, 5.65, "next token: stream text back, or schedule the next step", ha="center", fontsize=9,
            color="#505050")
    if highlight:
        ax.text(0.1, 6.1, title or f"Part {highlight}", fontsize=11.5, weight="bold", color=QUERY, va="center")
    return fig


def part_map(part_id: str) -> Figure:
    """The engine map for the first page of a part: the part's components highlighted,
    titled with the part's title from book.toml."""
    from course import manifest

    part = next(p for p in manifest.load().parts if p.id == part_id)
    return engine_map(highlight=part_id, title=f"Part {part.id}: {part.title}: what this part builds")


def _roman(numeral: str) -> int:
    return ("I", "II", "III", "IV", "V", "VI", "VII", "VIII").index(numeral)


# --- the decoder block (Chapter 7) ----------------------------------------------------------

def decoder_block() -> Figure:
    """One Qwen3 decoder layer: the residual stream down the middle, two branches (attention
    and MLP) that each read a normalised copy and add their result back."""
    fig, ax = _canvas(11.0, 6.2, 4.4)
    stream_x = 1.2
    ax.plot([stream_x, stream_x], [0.2, 6.0], color=INK, lw=2.2)
    ax.text(stream_x - 0.25, 6.05, "residual stream x  [T, hidden]", fontsize=10, va="bottom")
    ax.text(stream_x - 0.25, 0.0, "to the next layer", fontsize=10, va="top")
    for y, kind in [(4.1, "attention"), (1.3, "mlp")]:
        ax.add_patch(patches.Circle((stream_x, y), 0.2, facecolor="white", edgecolor=INK, lw=1.4, zorder=3))
        ax.text(stream_x, y, "+", ha="center", va="center", fontsize=13, zorder=4)
        top = y + 1.2
        ax.plot([stream_x, 2.0], [top, top], color=INK, lw=1.2)
        if kind == "attention":
            _box(ax, 2.0, top - 0.35, 1.75, 0.7, "input_layernorm\n(RMSNorm)", face="#EAE6F5", size=9)
            _box(ax, 4.05, top - 0.35, 1.45, 0.7, "q / k / v_proj", face="#DCE6F2", size=9)
            _box(ax, 5.8, top - 0.35, 1.75, 0.7, "q_norm, k_norm,\nthen RoPE", face="#EAE6F5", size=9)
            _box(ax, 7.85, top - 0.35, 1.75, 0.7, "causal\nattention (GQA)", face="#FBE3D3", size=9)
            _box(ax, 9.85, top - 0.35, 0.95, 0.7, "o_proj", face="#DCE6F2", size=9)
            boxes = [(3.75, 4.05), (5.5, 5.8), (7.55, 7.85), (9.6, 9.85)]
            ax.text(6.4, top + 0.55, "attention sublayer: the only place positions mix (Chapters 5, 6, 9)",
                    fontsize=9, ha="center", color="#505050")
        else:
            _box(ax, 2.0, top - 0.35, 1.75, 0.7, "post_attention_\nlayernorm", face="#EAE6F5", size=9)
            _box(ax, 4.05, top - 0.05, 1.45, 0.55, "gate_proj", face="#DCE6F2", size=9.5)
            _box(ax, 4.05, top - 0.75, 1.45, 0.55, "up_proj", face="#DCE6F2", size=9.5)
            _box(ax, 5.85, top - 0.05, 1.1, 0.55, "SiLU", face="#E5F1E7", size=9.5)
            _box(ax, 7.35, top - 0.45, 0.8, 0.55, "x", face="#E5F1E7", size=10.5)
            _box(ax, 8.8, top - 0.45, 2.0, 0.55, "down_proj", face="#DCE6F2", size=9.5)
            _arrow(ax, (3.75, top), (4.05, top + 0.22))
            _arrow(ax, (3.75, top), (4.05, top - 0.48))
            _arrow(ax, (5.5, top + 0.22), (5.85, top + 0.22))
            _arrow(ax, (6.95, top + 0.22), (7.45, top + 0.1))
            _arrow(ax, (5.5, top - 0.48), (7.35, top - 0.2))
            boxes = [(8.15, 8.8)]
            ax.text(6.4, top + 0.7, "MLP sublayer (SwiGLU): each position on its own (Chapter 7)",
                    fontsize=9, ha="center", color="#505050")
        for start, end in boxes:
            _arrow(ax, (start, top - (0.17 if kind == "mlp" else 0)), (end, top - (0.17 if kind == "mlp" else 0)))
        # The branch's result returns to the stream and is added, not substituted.
        right_edge = 10.8
        ax.plot([right_edge, right_edge], [top - 0.35 - (0.1 if kind == "mlp" else 0), y], color=INK, lw=1.2)
        _arrow(ax, (right_edge, y), (stream_x + 0.2, y))
    return fig


# --- grouped-query attention (Chapters 5 and 9) ---------------------------------------------

def gqa(query_heads: int = 8, kv_heads: int = 2) -> Figure:
    """Which key/value head each query head reads: query head h reads K/V head
    h // (query_heads // kv_heads), so groups of consecutive query heads share one."""
    group = query_heads // kv_heads
    fig, ax = _canvas(11.0, 4.3, 3.1)
    width = 10.0 / query_heads
    kv_width = 10.0 / kv_heads
    for h in range(query_heads):
        colour = REQUEST_COLOURS[h // group]
        _box(ax, 0.5 + h * width + 0.08, 3.0, width - 0.16, 0.75, f"q head {h}", face=colour + "33", edge=colour,
             size=9.5)
    for g in range(kv_heads):
        colour = REQUEST_COLOURS[g]
        x = 0.5 + g * kv_width + 0.3
        _box(ax, x, 0.5, kv_width - 0.6, 0.9, f"K/V head {g}\n(one key and one value per token)",
             face=colour + "33", edge=colour, size=9.5)
        for h in range(g * group, (g + 1) * group):
            _arrow(ax, (0.5 + (h + 0.5) * width, 3.0), (x + (kv_width - 0.6) / 2, 1.4), color=colour)
    ax.text(5.5, 4.05, f"{query_heads} query heads, {kv_heads} key/value heads: each group of {group} query heads "
            f"reads one K/V head", ha="center", fontsize=10.5)
    ax.text(5.5, 0.1, f"the KV cache stores {kv_heads} heads per token, not {query_heads}: "
            f"{query_heads // kv_heads}x less memory, same number of attention scores", ha="center", fontsize=9.5,
            color="#505050")
    return fig


# --- rotary position embeddings (Chapter 6) --------------------------------------------------

def rope_rotation(head_dim: int = 128, theta: float = 1_000_000.0, positions: int = 6) -> Figure:
    """Left: one channel pair of a query, rotated by m * angle at positions m = 0, 1, 2, ...
    Right: how fast each pair turns (its wavelength in tokens), fastest first."""
    import math

    fig = Figure(figsize=(COLUMN_INCHES, 3.3))
    left, right = fig.add_axes((0.02, 0.08, 0.42, 0.82)), fig.add_axes((0.56, 0.17, 0.42, 0.7))
    step = 0.55    # radians per position for the drawn pair: large enough to see the turns
    left.add_patch(patches.Circle((0, 0), 1, fill=False, color=MUTED, lw=1, ls=":"))
    for m in range(positions):
        angle = 0.25 + m * step
        colour = matplotlib.colormaps["viridis"](m / positions)
        left.annotate("", xy=(math.cos(angle), math.sin(angle)), xytext=(0, 0),
                      arrowprops=dict(arrowstyle="-|>", color=colour, lw=1.6))
        left.text(1.14 * math.cos(angle), 1.14 * math.sin(angle), f"m={m}", fontsize=9, ha="center",
                  va="center", color=colour)
    left.add_patch(patches.Arc((0, 0), 0.7, 0.7, theta1=math.degrees(0.25 + 1 * step),
                               theta2=math.degrees(0.25 + 4 * step), color=KEY, lw=1.5))
    left.text(0, -0.55, "between m=1 and m=4: 3 x angle,\nwhatever the absolute positions", fontsize=9,
              color=KEY, ha="center")
    left.set_xlim(-1.35, 1.35)
    left.set_ylim(-1.3, 1.3)
    left.set_aspect("equal")
    left.axis("off")
    left.set_title("one pair (x[i], x[i + D/2]) turned by m x angle_i", fontsize=10)
    pairs = list(range(head_dim // 2))
    wavelengths = [2 * math.pi * theta ** (2 * i / head_dim) for i in pairs]
    right.semilogy(pairs, wavelengths, color=QUERY, lw=2)
    right.set_xlabel("pair index i (channel i with channel i + D/2)", fontsize=9.5)
    right.set_ylabel("wavelength (tokens)", fontsize=9.5)
    right.set_title(f"angle_i = theta^(-2i/D), D = {head_dim}, theta = {theta:,.0f}", fontsize=10)
    right.tick_params(labelsize=9)
    right.grid(alpha=0.3)
    right.annotate("fast pairs: nearby order", xy=(2, wavelengths[2]), xytext=(14, 30), fontsize=9,
                   arrowprops=dict(arrowstyle="->", color="#505050"))
    right.annotate("slow pairs: long range", xy=(60, wavelengths[60]), xytext=(22, wavelengths[60] * 2),
                   fontsize=9, arrowprops=dict(arrowstyle="->", color="#505050"))
    return fig


# --- the KV cache: contiguous, slots, pages (Chapters 16, 24, 25) -----------------------------

# Three requests: name, tokens they hold now, and the most they will hold (prompt + max new tokens).
_REQUESTS = (("A", 9, 14), ("B", 4, 6), ("C", 12, 16))


def kv_cache_layouts(capacity: int = 24, slot_len: int = 20, block_size: int = 4) -> Figure:
    """The same three requests in three cache layouts. Contiguous (Chapter 16): one
    sequence owns a buffer sized for its whole generation. Slots (Chapter 24): a fixed
    row of slot_len positions per request, reserved whether used or not. Pages
    (Chapter 25): a shared pool of small blocks, each request holding only the blocks it
    has filled, in any order."""
    fig, ax = _canvas(capacity + 8.5, 13.2, 5.4)
    cell = 1.0
    x0 = 7.5

    def row(y, cells, label=None):
        for i, (face, text) in enumerate(cells):
            ax.add_patch(patches.Rectangle((x0 + i * cell, y), cell, 0.8, facecolor=face, edgecolor="white", lw=1))
            if text:
                ax.text(x0 + (i + 0.5) * cell, y + 0.4, text, ha="center", va="center", fontsize=8, color="white")
        if label:
            ax.text(x0 - 0.3, y + 0.4, label, ha="right", va="center", fontsize=9.5)

    def title(y, text, note):
        ax.text(0.2, y, text, fontsize=11, weight="bold", va="center")
        ax.text(x0 + capacity + 0.3, y, note, fontsize=9, va="center", ha="right", color="#505050")

    # 1. contiguous: one buffer per sequence, for one request alone.
    title(12.7, "Contiguous (Ch. 16)", "one sequence, one buffer of capacity tokens")
    name, used, _ = _REQUESTS[0]
    row(11.5, [(REQUEST_COLOURS[0], "") if i < used else (PAD, "") for i in range(capacity)], f"request {name}")
    # 2. slots: a fixed row per request.
    title(10.4, "Slots (Ch. 24)", f"each request reserves slot_len = {slot_len} positions")
    for r, (name, used, _) in enumerate(_REQUESTS):
        row(9.2 - r * 1.0, [(REQUEST_COLOURS[r], "") if i < used else (PAD, "") for i in range(slot_len)],
            f"slot {r}: {name}")
    ax.text(x0 + slot_len + 0.3, 8.2, "grey: reserved,\nnever written", fontsize=8.5, va="center", color="#707070")
    # 3. pages: blocks of block_size from one pool, in any order.
    title(5.7, "Pages (Ch. 25)", f"a pool of blocks of {block_size} tokens; a request holds only what it fills")
    # Which request owns each block of the pool (None: free), in the order they were handed out.
    owners = ["C", "A", None, "B", "A", "C", "C", "A", None, None, None, None]
    filled = {name: used for name, used, _ in _REQUESTS}
    seen = {name: 0 for name, *_ in _REQUESTS}
    # Draw the pool as blocks (each block = block_size cells) with their owner's colour.
    y_pool = 4.0
    block_width = block_size * cell * 0.5
    index = {name: i for i, (name, *_) in enumerate(_REQUESTS)}
    for block, owner in enumerate(owners):
        bx = x0 + block * block_width
        for offset in range(block_size):
            if owner is None:
                face = PAD
            else:
                token = seen[owner] * block_size + offset
                face = REQUEST_COLOURS[index[owner]] if token < filled[owner] else PAD
            ax.add_patch(patches.Rectangle((bx + offset * block_width / block_size, y_pool),
                                           block_width / block_size, 0.8, facecolor=face, edgecolor="white",
                                           lw=0.6))
        if owner is not None:
            seen[owner] += 1
        ax.add_patch(patches.Rectangle((bx, y_pool), block_width, 0.8, fill=False, edgecolor=INK, lw=1.0))
        ax.text(bx + block_width / 2, y_pool - 0.3, str(block), ha="center", fontsize=8.5)
    ax.text(x0 - 0.3, y_pool + 0.4, "block pool", ha="right", va="center", fontsize=9.5)
    ax.text(x0 - 0.3, y_pool - 0.3, "block id", ha="right", va="center", fontsize=8.5, color="#505050")
    # Each request's block table: which pool blocks hold its tokens, in order.
    for r, (name, used, _) in enumerate(_REQUESTS):
        table_ids = [b for b, owner in enumerate(owners) if owner == name]
        ax.text(x0, 2.4 - r * 0.75, f"{name}'s block table: {table_ids}  ({used} tokens; "
                f"at most {block_size - 1} positions unused)", fontsize=9.5, va="center",
                color=REQUEST_COLOURS[r])
    return fig


# --- block tables and slot mapping (Chapter 25) ----------------------------------------------

def block_table_mapping(block_size: int = 4, tokens: int = 10, table: tuple[int, ...] = (7, 2, 5)) -> Figure:
    """How a token's position finds its place in the pool: logical block = position //
    block_size, physical block = block_table[logical block], slot = physical block *
    block_size + position % block_size."""
    fig, ax = _canvas(24.0, 9.6, 3.3)
    # Logical view: the request's tokens in order, split into logical blocks.
    ax.text(0.2, 8.9, "the request's tokens (positions)", fontsize=10.5, weight="bold")
    for position in range(len(table) * block_size):
        logical = position // block_size
        colour = REQUEST_COLOURS[logical] if position < tokens else PAD
        ax.add_patch(patches.Rectangle((0.5 + position * 0.9 + logical * 0.4, 7.3), 0.9, 0.9, facecolor=colour,
                                       edgecolor="white"))
        ax.text(0.5 + position * 0.9 + logical * 0.4 + 0.45, 7.75, str(position), ha="center", va="center",
                fontsize=9, color="white" if position < tokens else "#808080")
    for logical, physical in enumerate(table):
        x = 0.5 + logical * (block_size * 0.9 + 0.4)
        ax.text(x + block_size * 0.45, 6.9, f"logical block {logical}", ha="center", fontsize=9)
        # Block table entry.
        _box(ax, 2.0 + logical * 2.6, 4.6, 2.2, 0.9, f"[{logical}] -> {physical}", face=REQUEST_COLOURS[logical] + "33",
             edge=REQUEST_COLOURS[logical], size=10, round_=False)
        _arrow(ax, (x + block_size * 0.45, 6.8), (3.1 + logical * 2.6, 5.5), color=REQUEST_COLOURS[logical])
    ax.text(1.8, 5.05, "block\ntable", ha="right", va="center", fontsize=9.5, weight="bold")
    # The physical pool.
    pool = 9
    for block in range(pool):
        owner = table.index(block) if block in table else None
        bx = 0.5 + block * 2.6
        for offset in range(block_size):
            face = PAD if owner is None or owner * block_size + offset >= tokens else REQUEST_COLOURS[owner]
            ax.add_patch(patches.Rectangle((bx + offset * 0.6, 1.6), 0.6, 0.8, facecolor=face, edgecolor="white"))
            ax.text(bx + offset * 0.6 + 0.3, 1.3, str(block * block_size + offset), ha="center", va="center",
                    fontsize=7.5, color="#606060")
        ax.add_patch(patches.Rectangle((bx, 1.6), block_size * 0.6, 0.8, fill=False, edgecolor=INK))
        ax.text(bx + block_size * 0.3, 2.6, f"block {block}", ha="center", fontsize=8.5)
        if owner is not None:
            _arrow(ax, (3.1 + owner * 2.6, 4.6), (bx + block_size * 0.3, 3.0), color=REQUEST_COLOURS[owner])
    ax.text(0.5, 0.7, "slot numbers in the pool (the rows of the cache tensor)", fontsize=9, color="#505050")
    last = tokens - 1
    ax.text(10.4, 5.05, f"position {last}: logical block {last // block_size}, offset {last % block_size}\n"
            f"slot = block_table[{last // block_size}] x {block_size} + {last % block_size} = "
            f"{table[last // block_size] * block_size + last % block_size}", fontsize=10, va="center",
            bbox=dict(boxstyle="round", facecolor="white", edgecolor=MUTED))
    return fig


# --- Engine v2's core (Chapter 31) -----------------------------------------------------------

def flattened_batch(request_ids: list[str], input_ids: list[int], positions: list[int], slots: list[int],
                    query_start_loc: list[int], seq_lens: list[int], logits_indices: list[int]) -> Figure:
    """One step's batch as the core builds it: the scheduled tokens of every request laid end
    to end in N rows, no padding. Each column is one row: token id, position, pool slot.
    Above: which request owns the rows and its seq_len; below: query_start_loc, the row where
    each request starts; the rows in logits_indices are the only ones sent to the LM head."""
    rows = len(input_ids)
    x0, cell = 3.4, 1.0
    width = x0 + rows * cell + 0.3
    fig, ax = _canvas(width, 8.0, COLUMN_INCHES * 8.0 / width)
    fields = (("input_ids", input_ids, 3.7), ("positions", positions, 2.9), ("slot_mapping", slots, 2.1))
    for k, rid in enumerate(request_ids):
        start, end = query_start_loc[k], query_start_loc[k + 1]
        colour = REQUEST_COLOURS[k % len(REQUEST_COLOURS)]
        for row in range(start, end):
            for _, values, y in fields:
                ax.add_patch(patches.Rectangle((x0 + row * cell, y), cell, 0.8, facecolor=colour, edgecolor="white",
                                               lw=1.5))
                ax.text(x0 + (row + 0.5) * cell, y + 0.4, str(values[row]), ha="center", va="center", fontsize=9,
                        color="white")
        # The request's rows, bracketed above the batch with its context length.
        left, right = x0 + start * cell + 0.08, x0 + end * cell - 0.08
        ax.plot([left, left, right, right], [4.65, 4.8, 4.8, 4.65], color=colour, lw=1.6)
        # Labels of narrow neighbours would collide: every other short request's label goes higher.
        lift = 0.75 if end - start < 3 and k % 2 else 0.0
        ax.text((left + right) / 2, 4.95 + lift, f"{rid}: {end - start} row{'s' if end - start > 1 else ''}\nseq_len "
                f"{seq_lens[k]}", ha="center", va="bottom", fontsize=8.5, color=colour, weight="bold")
    for name, _, y in fields:
        ax.text(x0 - 0.2, y + 0.4, name, ha="right", va="center", fontsize=9.5)
    ax.text(x0 - 0.2, 1.55, "row", ha="right", va="center", fontsize=8.5, color="#505050")
    for row in range(rows):
        ax.text(x0 + (row + 0.5) * cell, 1.55, str(row), ha="center", va="center", fontsize=8.5, color="#505050")
    # query_start_loc: where each request's rows start, and N at the end (one more than requests).
    ax.text(x0 - 0.2, 0.7, "query_start_loc", ha="right", va="center", fontsize=9.5)
    for boundary in query_start_loc:
        bx = x0 + boundary * cell
        ax.plot([bx, bx], [1.2, 4.6], color=INK, lw=1.0, ls=(0, (3, 2)))
        ax.text(bx, 0.7, str(boundary), ha="center", va="center", fontsize=9.5, weight="bold",
                bbox=dict(boxstyle="round,pad=0.2", facecolor="white", edgecolor=MUTED))
    # Only the rows whose next token is unknown reach the LM head.
    for row in logits_indices:
        _arrow(ax, (x0 + (row + 0.5) * cell, 6.6), (x0 + (row + 0.5) * cell, 7.2), color=KEY, lw=1.6)
    ax.text(x0 - 0.2, 6.9, "to the LM head", ha="right", va="center", fontsize=9.5, color=KEY, weight="bold")
    ax.text(x0 + rows * cell / 2, 7.6, f"logits_indices = {list(logits_indices)}: one row of logits per "
            "request that samples", ha="center", va="center", fontsize=9.5, color=KEY)
    return fig


def scheduler_step() -> Figure:
    """The core scheduler's decision for one step: running requests first, in order, each
    allocated its tokens or else the last running request is preempted; then, with what is
    left of the budget, waiting requests are admitted from the front, never by preempting,
    and not at all in a step that preempted."""
    fig, ax = _canvas(11.0, 8.2, 5.9)
    running, waiting, stop, good = "#DCE6F2", "#E5F1E7", "#F6DADA", "#F4F4F4"
    _box(ax, 2.2, 7.45, 6.6, 0.6, "a step starts: budget = max_num_batched_tokens", face=good, size=10,
         weight="bold")
    ax.text(2.7, 6.95, "1. running requests, in order", ha="center", fontsize=10.5, weight="bold", color=QUERY)
    ax.text(8.3, 6.95, "2. admission, with the budget left", ha="center", fontsize=10.5, weight="bold",
            color="#3B7D4A")
    # Phase 1 down the left.
    _box(ax, 0.1, 5.7, 5.2, 0.95, "next running request (arrival order, or\n(priority, arrival)): n = min(tokens "
         "it still\nneeds, budget, long_prefill_token_threshold)", face=running, size=8.8)
    _box(ax, 1.3, 4.5, 3.5, 0.7, "allocate_slots(request, n)?", face="white", size=9.5)
    _box(ax, 0.1, 2.9, 2.45, 1.05, "yes: schedule\n(request, n);\nbudget -= n", face=running, size=8.8)
    _box(ax, 2.85, 2.9, 2.45, 1.05, "no: preempt the LAST\nrunning request (its\nblocks freed; front of\n"
         "the waiting queue)", face=stop, size=8.3)
    _box(ax, 2.85, 1.55, 2.45, 0.9, "the victim was this\nrequest: stop serving\nrunning requests", face=stop,
         size=8.3)
    _arrow(ax, (5.0, 7.45), (4.95, 6.65))
    _arrow(ax, (2.7, 5.7), (2.7, 5.2))
    _arrow(ax, (2.4, 4.5), (1.35, 3.95))
    _arrow(ax, (3.7, 4.5), (4.05, 3.95))
    _arrow(ax, (5.1, 3.95), (4.85, 4.85), connection="arc3,rad=0.5")
    ax.text(5.3, 4.4, "retry", fontsize=8.5, color="#505050")
    _arrow(ax, (4.05, 2.9), (4.05, 2.45))
    _arrow(ax, (0.25, 3.95), (0.25, 5.7), connection="arc3,rad=-0.3")
    ax.text(0.5, 4.85, "while\nbudget\nis left", fontsize=8, color="#505050", va="center")
    ax.text(0.1, 0.75, "running requests hold memory and someone\nreads their streams, so they go before anyone\n"
            "new (a decode asks for 1 token)", fontsize=8.5, color="#505050", va="center")
    # Phase 2 down the right.
    _box(ax, 5.75, 5.7, 5.15, 0.95, "only while: budget > 0, fewer than\nmax_num_seqs running, and NOBODY was\n"
         "preempted this step (the pool is full)", face=waiting, size=8.8)
    _box(ax, 5.75, 4.3, 5.15, 0.95, "front of the waiting queue: skip its longest\ncached prefix "
         "(find_cached_prefix); n = min(tokens\nleft after it, budget, the same chunk cap)", face=waiting, size=8.8)
    _box(ax, 6.5, 3.25, 3.65, 0.6, "allocate_slots(request, n, cached)?", face="white", size=9)
    _box(ax, 5.75, 1.55, 2.45, 1.2, "yes: it joins the\nrunning list;\nschedule (request, n);\nbudget -= n",
         face=waiting, size=8.5)
    _box(ax, 8.45, 1.55, 2.45, 1.2, "no: stop admitting\n(admission never\npreempts; it waits\nfor the next step)",
         face=stop, size=8.5)
    _arrow(ax, (5.3, 6.2), (5.75, 6.2))
    _arrow(ax, (8.3, 5.7), (8.3, 5.25))
    _arrow(ax, (8.3, 4.3), (8.3, 3.85))
    _arrow(ax, (7.6, 3.25), (7.0, 2.75))
    _arrow(ax, (9.0, 3.25), (9.6, 2.75))
    _arrow(ax, (5.9, 2.75), (5.9, 4.3), connection="arc3,rad=-0.3")
    ax.text(5.75, 0.75, "the step's plan: scheduled = [(request, n), ...],\nthe preempted requests and the "
            "swap-ins;\none flattened batch is built from it", fontsize=8.5, color="#505050", va="center")
    return fig


def hash_chain(blocks: int = 3) -> Figure:
    """The prefix cache's keys: each full block's key hashes the previous block's key with
    the block's tokens and the request's extra key, so one key stands for the whole prefix
    up to the end of its block. A second request that differs in block 1 gets a different
    key for block 1 and for every block after it, even where its tokens are the same."""
    fig, ax = _canvas(11.3, 6.6, 4.5)
    width, gap, x0 = 2.0, 0.5, 1.6

    def chain(y, label, changed_from=None):
        ax.text(x0 - 0.2, y + 1.55, label, ha="right", va="center", fontsize=9.5, weight="bold")
        for i in range(blocks + 1):
            x = x0 + i * (width + gap)
            full = i < blocks
            differs = changed_from is not None and i >= changed_from
            token_colour = KEY if changed_from is not None and i == changed_from else QUERY
            tokens = f"tokens of block {i}" + ("" if full else "\n(not full yet)")
            _box(ax, x, y + 1.25, width, 0.6, tokens, face=(token_colour + "33") if full else PAD,
                 edge=token_colour if full else MUTED, size=8.5, round_=False)
            if not full:
                ax.text(x + width / 2, y + 0.45, "no key until\nthe block fills", ha="center", va="center",
                        fontsize=8.5, color="#707070")
                continue
            key = f"h{i}'" if differs else f"h{i}"
            _box(ax, x + 0.35, y + 0.1, width - 0.7, 0.65, key, face="#FBE3D3" if differs else "#DCE6F2",
                 edge=KEY if differs else QUERY, size=10.5, weight="bold")
            _arrow(ax, (x + width / 2, y + 1.25), (x + width / 2, y + 0.75))
            if i:
                _arrow(ax, (x - gap - 0.35, y + 0.42), (x + 0.35, y + 0.42))
            else:
                ax.text(x - 0.1, y + 0.42, "root ->", ha="right", va="center", fontsize=8.5, color="#505050")

    chain(3.7, "request 1")
    chain(0.9, "request 2", changed_from=1)
    ax.text(5.5, 6.35, r"$h_i = H(h_{i-1},\ \mathrm{tokens}_i,\ \mathrm{extra})$: BLAKE2b, 16 bytes; extra = the "
            "request's cache_key", ha="center", va="center", fontsize=10)
    ax.text(5.5, 0.4, "request 2 differs only in block 1: h1' and every later key differ too, so a key pins "
            "down its whole prefix", ha="center", va="center", fontsize=9, color=KEY)
    ax.text(5.5, 3.4, "same block 0, same h0: request 2 adopts request 1's block 0 from the cache",
            ha="center", va="center", fontsize=9, color="#505050")
    return fig


def block_states() -> Figure:
    """The three states of a pool block in the core's BlockManager and what moves a block
    between them. A block whose last owner lets go keeps its key and waits in the free queue
    (cached-free): a prefix hit can adopt it for free until an allocation takes it for new
    contents, which evicts its key."""
    fig, ax = _canvas(11.0, 7.0, 5.0)
    used, cached, free = (3.6, 4.9, 3.8, 1.35), (0.1, 1.45, 3.6, 1.35), (7.3, 1.45, 3.6, 1.35)
    _box(ax, *used, "in use  (state 'used')\nref_count > 0, key or not,\nnot in the free queue", face="#DCE6F2",
         edge=QUERY, size=9.5)
    _box(ax, *cached, "cached-free  ('cached')\nref_count 0, key kept,\nin the free queue", face="#FBE3D3",
         edge=KEY, size=9.5)
    _box(ax, *free, "free  ('free')\nref_count 0, no key,\nin the free queue", face="#F4F4F4", edge=INK, size=9.5)
    # in use -> cached-free / free: the last owner lets go.
    _arrow(ax, (3.9, 4.9), (2.2, 2.8), color=INK, connection="arc3,rad=0.15")
    ax.text(1.2, 4.1, "free: last owner lets go,\nthe block has a key", ha="center", fontsize=8.5)
    _arrow(ax, (7.1, 4.9), (8.8, 2.8), color=INK, connection="arc3,rad=-0.15")
    ax.text(9.8, 4.1, "free: last owner lets go,\nno key", ha="center", fontsize=8.5)
    # cached-free -> in use: adopted (a prefix hit) or evicted (allocated for new contents).
    _arrow(ax, (2.9, 2.8), (4.4, 4.9), color=KEY, connection="arc3,rad=-0.15", lw=1.6)
    ax.text(3.75, 3.9, "adopt: a prefix\nhit, key kept,\nno compute", ha="left", va="center", fontsize=8.5,
            color=KEY)
    # free -> in use: allocation.
    _arrow(ax, (8.1, 2.8), (6.6, 4.9), color=QUERY, connection="arc3,rad=0.15", lw=1.6)
    ax.text(7.1, 3.9, "allocate: taken\nfrom the free\nqueue's front", ha="right", va="center", fontsize=8.5,
            color=QUERY)
    # cached-free -> in use by eviction: allocated for new contents, it leaves the cache.
    _arrow(ax, (3.7, 2.0), (5.5, 4.9), color="#C44E52", connection="arc3,rad=0.3", lw=1.3)
    ax.text(5.75, 2.3, "evict: allocation\ntakes it, key\ndropped", ha="left", va="center", fontsize=8.5,
            color="#C44E52")
    # Changes that stay inside "in use".
    ax.text(5.5, 6.55, "adopt: ref_count + 1   |   free, another owner left: ref_count - 1   |   "
            "publish (cache_full_blocks): gets a key", ha="center", fontsize=8.5, color="#505050")
    # The free queue: LRU, and a finished request's tail goes in before its head.
    ax.text(0.1, 0.6, "free queue (LRU): allocation takes the front, free appends to the back, a request's "
            "blocks tail first,\nso its unique tail is reused before its shared head (the system prompt)",
            fontsize=8.5, va="center", color="#505050")
    return fig


# --- from text to logits (Chapter 3) -----------------------------------------------------------

def token_path(text: str = "Hi!", vocab: int = 320, hidden: int = 64) -> Figure:
    """The two ends of a language model: text becomes ids, ids pick rows of the embedding
    table, the decoder layers transform those rows, and the LM head scores every
    vocabulary entry at every position; the last row's scores choose the next token."""
    ids = list(text.encode("utf-8"))
    rows_y = [3.2 - 0.6 * i for i in range(len(ids))]
    fig, ax = _canvas(11.0, 4.5, 3.2)

    def title(x, line1, line2=""):
        ax.text(x, 4.4, line1 + ("\n" + line2 if line2 else ""), fontsize=9.5, weight="bold", va="top")

    title(0.0, "text")
    ax.text(0.0, 3.4, f'"{text}"', fontsize=12, family="monospace", va="center")
    title(1.3, "token ids", "[T]")
    for y, token in zip(rows_y, ids):
        _box(ax, 1.3, y, 0.8, 0.42, str(token), face=PAD, size=10, round_=False)
    _arrow(ax, (0.9, 3.4), (1.28, 3.41))
    # The embedding table: one row per vocabulary entry; each id selects its row.
    title(2.6, "embedding", f"[{vocab}, {hidden}]")
    top, bottom = 3.75, 0.2
    ax.add_patch(patches.Rectangle((2.6, bottom), 1.5, top - bottom, facecolor="white", edgecolor=INK, lw=1.2))
    title(4.6, "hidden", "[T, hidden]")
    for i, (y, token) in enumerate(zip(rows_y, ids)):
        row = top - (top - bottom) * (token + 0.5) / vocab
        colour = REQUEST_COLOURS[i % len(REQUEST_COLOURS)]
        ax.add_patch(patches.Rectangle((2.6, row - 0.05), 1.5, 0.1, facecolor=colour, lw=0))
        _arrow(ax, (2.1, y + 0.21), (2.6, row), color=colour)
        _box(ax, 4.6, y, 1.0, 0.42, "", face=colour, round_=False)
        _arrow(ax, (4.1, row), (4.6, y + 0.21), color=colour)
    _box(ax, 6.0, 1.9, 1.5, 1.1, "decoder layers,\nfinal norm", face="#EAE6F5", size=9)
    _arrow(ax, (5.6, 2.4), (6.0, 2.4))
    _box(ax, 7.9, 1.9, 1.1, 1.1, f"LM head\n[{hidden}, {vocab}]", face="#DCE6F2", size=9)
    _arrow(ax, (7.5, 2.45), (7.9, 2.45))
    title(9.3, "logits", f"[T, {vocab}]")
    for i, y in enumerate(rows_y):
        last = i == len(ids) - 1
        _box(ax, 9.3, y, 1.6, 0.42, "next token" if last else "", face="#FBE3D3" if last else PAD, size=8.5,
             round_=False)
    _arrow(ax, (9.0, 2.45), (9.3, 2.45))
    ax.text(9.3, rows_y[-1] - 0.15, "only the last row is\nneeded to generate", fontsize=8, va="top",
            color="#505050")
    return fig
