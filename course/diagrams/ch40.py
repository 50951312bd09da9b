"""Chapter 40's diagrams: one model's layers on two devices, and what moving a row costs.

Same conventions as course.diagrams (each function returns a Figure; `diagrams.show`
puts it in the notebook as SVG).
"""
from __future__ import annotations

from matplotlib.figure import Figure

from course.diagrams import COLUMN_INCHES, INK, KEY, MUTED, QUERY, _arrow, _box, _canvas

HOME_FACE = "#DCE6F2"
STAGE_FACE = "#FBE5D6"
POOL_FACE = "#E2F0D9"


def layer_placement(layers_per_stage: tuple[int, ...] = (14, 14), devices: tuple[str, ...] = ("cuda:0", "cuda:1"),
                    hidden: int = 1024) -> Figure:
    """Each stage as a column: its device, its range of decoder layers with their KV pools
    beside them; stage 0 also holds the embedding, the LM head and the sampler. Arrows: the
    residual stream [N, D] handed from stage to stage, and the L sampled rows coming home."""
    stages = len(layers_per_stage)
    width = 3.9 * stages + 0.1
    fig, ax = _canvas(width, 6.4, 3.3)
    first = 0
    for stage, (count, device) in enumerate(zip(layers_per_stage, devices)):
        x = 0.3 + 3.9 * stage
        face = HOME_FACE if stage == 0 else STAGE_FACE
        _box(ax, x, 0.3, 3.0, 5.4, "", face=face, edge=QUERY if stage == 0 else KEY)
        ax.text(x + 1.5, 6.0, f"stage {stage}: {device}" + ("  (home)" if stage == 0 else ""), ha="center",
                fontsize=10.5, weight="bold", color=INK)
        top = 4.6
        if stage == 0:
            _box(ax, x + 0.2, top, 2.6, 0.7, "embed_tokens", size=9.5)
            top -= 0.9
        last = first + count - 1
        _box(ax, x + 0.2, top - 1.4, 1.6, 1.6, f"layers\n{first}..{last}", size=10)
        _box(ax, x + 1.95, top - 1.4, 0.85, 1.6, "KV\npools", face=POOL_FACE, size=9)
        if stage == stages - 1:
            _box(ax, x + 0.2, top - 2.3, 2.6, 0.6, "final norm", size=9.5)
        if stage == 0:
            _box(ax, x + 0.2, 0.5, 2.6, 0.6, "LM head, sampler", size=9.5)
        first += count
        if stage + 1 < stages:
            _arrow(ax, (x + 3.0, 3.0), (x + 3.9, 3.0), color=KEY, lw=1.8)
            ax.text(x + 3.45, 3.25, "[N, D]", ha="center", fontsize=8.5, color=KEY)
    if stages > 1:
        last_x = 0.3 + 3.9 * (stages - 1)
        _arrow(ax, (last_x + 1.5, 2.0), (2.9, 0.8), color=QUERY, lw=1.5, connection="arc3,rad=-0.15")
        ax.text(last_x + 2.1, 1.35, "[L, D] rows that\nneed logits", ha="center", fontsize=8.5, color=QUERY)
    ax.text(width / 2, -0.15, f"D = {hidden}: a bf16 row is {2 * hidden:,} bytes; prefill sends N rows, "
            f"decode one per request", ha="center", fontsize=8.5, color="#505050")
    return fig


def transfer_time(tokens: list[int], links: dict[str, float], hidden: int = 1024, bytes_per: int = 2,
                  latency_us: float = 10.0) -> Figure:
    """Microseconds to hand [N, D] rows over one link, for each link's bandwidth (GB/s):
    a fixed launch-and-sync latency plus bytes / bandwidth."""
    fig = Figure(figsize=(COLUMN_INCHES * 0.8, 3.2))
    ax = fig.add_subplot()
    for (name, gbps), colour in zip(links.items(), (KEY, QUERY, "#55A868", MUTED)):
        micros = [latency_us + n * hidden * bytes_per / (gbps * 1e9) * 1e6 for n in tokens]
        ax.plot(tokens, micros, marker="o", color=colour, label=f"{name} ({gbps:g} GB/s)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("rows handed over (tokens in the step)")
    ax.set_ylabel("microseconds per hand-over")
    ax.set_title(f"One stage boundary, D = {hidden}, {bytes_per}-byte values, {latency_us:g} us fixed cost",
                 fontsize=10)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8.5)
    fig.tight_layout()
    return fig
