"""Chapter 41's diagrams: a Qwen3 layer split over two ranks, a pipeline's micro-batches
over time, and disaggregated prefill. Same palette and helpers as course.diagrams.

    from course import diagrams
    from course.diagrams import ch41
    diagrams.show(ch41.tensor_parallel_layer())
"""
from __future__ import annotations

from matplotlib.figure import Figure

from course.diagrams import INK, KEY, MUTED, PAD, QUERY, REQUEST_COLOURS, _arrow, _box, _canvas

COLLECTIVE = "#C44E52"


def tensor_parallel_layer() -> Figure:
    """One decoder layer on two ranks: what each rank computes, where they all-reduce."""
    fig, ax = _canvas(13.0, 5.6, 3.6)
    lanes = {0: 3.3, 1: 0.6}                       # y of each rank's row of boxes
    steps = [(0.9, "x [N, D]\n(whole)", PAD), (2.55, "q,k,v proj\nmy heads", QUERY),
             (4.2, "attention\nmy heads", QUERY), (5.85, "o_proj\nmy columns", KEY),
             (8.05, "gate, up\nmy features", QUERY), (9.7, "down_proj\nmy rows", KEY)]
    for rank, y in lanes.items():
        ax.text(0.05, y + 0.6, f"rank {rank}", fontsize=10, weight="bold", color=INK, rotation=90, va="center")
        for i, (x, text, face) in enumerate(steps):
            _box(ax, x, y, 1.45, 1.2, text, face=face if face == PAD else "white", edge=face if face != PAD else INK,
                 size=8.5)
            if i:
                _arrow(ax, (steps[i - 1][0] + 1.45, y + 0.6), (x, y + 0.6))
    for x, label in ((7.4, "all-reduce\n(sum D floats\nper token)"), (11.25, "all-reduce")):
        _box(ax, x, 0.6, 0.5, 3.9, "", face=COLLECTIVE, edge=COLLECTIVE, round_=False)
        ax.text(x + 0.25, 4.95, label, ha="center", va="bottom", fontsize=8.5, color=COLLECTIVE)
        for y in lanes.values():
            _arrow(ax, (x - 0.1 if x < 8 else x - 0.1, y + 0.6), (x, y + 0.6), color=COLLECTIVE)
    for y in lanes.values():
        _arrow(ax, (7.3 + 0.0, y + 0.6), (7.4, y + 0.6))
        _arrow(ax, (7.9, y + 0.6), (8.05, y + 0.6))
        _arrow(ax, (11.15, y + 0.6), (11.25, y + 0.6))
        _arrow(ax, (11.75, y + 0.6), (12.6, y + 0.6))
    ax.text(12.65, 2.55, "next\nlayer", fontsize=8.5, va="center", color=INK)
    ax.text(4.0, 2.45, "column-parallel: no talk    row-parallel: partial sums", fontsize=8.5, color=MUTED,
            ha="center")
    return fig


def pipeline_timeline(stages: int = 2, micro_batches: int = 3) -> Figure:
    """Micro-batches flowing through the stages of one engine step, time to the right."""
    fig, ax = _canvas(13.0, 1.2 * stages + 1.2, 0.75 * stages + 0.9)
    width = 12.0 / (micro_batches + stages - 1)
    for stage in range(stages):
        y = 1.2 * (stages - 1 - stage) + 0.6
        ax.text(0.1, y + 0.45, f"stage {stage}", fontsize=8.5, va="center", color=INK)
        for mb in range(micro_batches):
            x = 1.0 + (mb + stage) * width
            _box(ax, x + 0.05, y, width - 0.1, 0.9, f"micro-batch {mb + 1}", face=REQUEST_COLOURS[mb % 6],
                 edge=INK, size=8.5, color="white")
            if stage + 1 < stages:
                _arrow(ax, (x + width - 0.1, y), (x + width + 0.1, y - 0.3), color=INK)
        idle = [(1.0, stage * width), (1.0 + (micro_batches + stage) * width, (stages - 1 - stage) * width)]
        for x, w in idle:
            if w > 0:
                _box(ax, x + 0.05, y, w - 0.1, 0.9, "idle", face=PAD, edge=MUTED, size=8.5, color=MUTED)
    ax.text(1.0, 0.1, "time →   each arrow is one send of [rows, D] hidden states to the next stage",
            fontsize=8.5, color=INK)
    return fig


def disaggregation() -> Figure:
    """A prefill engine and a decode engine; blocks shipped through on_finish."""
    fig, ax = _canvas(13.0, 4.2, 2.8)
    _box(ax, 0.1, 1.3, 3.6, 2.2, "prefill engine\n(rank 0)\nprompts in,\nfirst token out", face="white",
         edge=QUERY, size=9.5)
    _box(ax, 9.3, 1.3, 3.6, 2.2, "decode engine\n(rank 1)\nadopts blocks,\ndecodes to the end", face="white",
         edge=KEY, size=9.5)
    for i in range(4):
        _box(ax, 4.7 + i * 0.95, 2.55, 0.8, 0.6, f"b{i}", face=REQUEST_COLOURS[0], edge=INK, size=8.5, color="white")
    _arrow(ax, (3.7, 2.85), (4.65, 2.85))
    _arrow(ax, (8.45, 2.85), (9.3, 2.85))
    ax.text(6.5, 3.75, "on_finish: header (id, tokens, block hashes), then K/V per layer",
            ha="center", fontsize=8.5, color=INK)
    ax.text(6.5, 2.0, "send / recv (NCCL, gloo; NIXL or RDMA in production)", ha="center", fontsize=8.5,
            color=MUTED)
    ax.text(6.5, 0.6, "prefill: long compute-bound steps   |   decode: short memory-bound steps, steady latency",
            ha="center", fontsize=8.5, color=INK)
    return fig
