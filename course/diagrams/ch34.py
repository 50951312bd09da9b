"""Chapter 34's diagram: the full sampler's pipeline over one step's [R, V] logits.

Drawn with the helpers and palette of course.diagrams, shown with `diagrams.show`.

    from course import diagrams
    from course.diagrams import ch34
    diagrams.show(ch34.sampler_pipeline())
"""
from __future__ import annotations

from matplotlib.figure import Figure

from course.diagrams import INK, KEY, QUERY, REQUEST_COLOURS, _arrow, _box, _canvas

# (label, colour group) of each stage, in the order the sampler applies them.
STAGES = (
    ("guide\nmask", "ban"),
    ("allowed\ntokens", "ban"),
    ("bad\nwords", "ban"),
    ("min_tokens:\nno EOS/stop", "ban"),
    ("logit_bias\n(+ b)", "shift"),
    ("penalties:\nrep, pres, freq", "shift"),
    ("greedy rows:\nargmax", "pick"),
    ("÷ temperature", "shape"),
    ("min_p", "shape"),
    ("top_k, top_p,\ntypical_p", "shape"),
    ("draw:\nargmax p / q", "pick"),
)
FACES = {"ban": "#F6D5D5", "shift": "#FBE3CF", "shape": "#DCE6F2", "pick": "#DDEFD9"}
LEGEND = (("ban", "forbid (-inf)"), ("shift", "move logits"), ("shape", "reshape"), ("pick", "choose a token"))


def sampler_pipeline() -> Figure:
    """The stages as a two-row snake of boxes (the order is vLLM's), the raw logits
    branching off to the log-probabilities before any rule touches them, and the per-row
    parameter columns feeding the stages."""
    fig, ax = _canvas(12.4, 6.6, 4.6)
    width, height, gap = 1.6, 1.0, 0.3
    top, bottom = 3.9, 1.9
    positions = []
    for i in range(6):                          # first row, left to right
        positions.append((0.6 + i * (width + gap), top))
    for i in range(5):                          # second row, right to left
        positions.append((0.6 + (5 - i) * (width + gap), bottom))
    for (label, group), (x, y) in zip(STAGES, positions):
        _box(ax, x, y, width, height, label, face=FACES[group], size=8.8)
    for (x0, y0), (x1, y1) in zip(positions, positions[1:]):
        if y0 == y1:
            step = 1 if x1 > x0 else -1
            _arrow(ax, (x0 + (width if step > 0 else 0), y0 + height / 2), (x1 + (0 if step > 0 else width),
                                                                           y1 + height / 2))
        else:
            _arrow(ax, (x0 + width / 2, y0), (x1 + width / 2, y1 + height))
    # Raw logits in, logprobs out of the raw copy.
    _box(ax, 0.6, 5.4, 3.2, 0.8, "logits [R, V] (raw, float32)", face="white", size=9)
    _arrow(ax, (1.5, 5.4), (1.5, top + height))
    _box(ax, 4.4, 5.4, 3.6, 0.8, "log_softmax → logprobs, ranks", face="white", edge=KEY, size=9, color=KEY)
    _arrow(ax, (3.8, 5.8), (4.4, 5.8), color=KEY)
    _box(ax, 8.8, 5.4, 3.0, 0.8, "per-row parameters [R]", face="white", edge=QUERY, size=9, color=QUERY)
    _arrow(ax, (10.3, 5.4), (10.3, top + height), color=QUERY)
    x_last, y_last = positions[-1]
    _box(ax, 0.6, 0.35, 2.6, 0.8, "one token per row", face="white", size=9)
    _arrow(ax, (x_last + width / 2, y_last), (1.9, 1.15))
    for i, (group, text) in enumerate(LEGEND):
        x = 3.8 + i * 2.2
        _box(ax, x, 0.45, 0.35, 0.35, "", face=FACES[group], round_=False)
        ax.text(x + 0.45, 0.62, text, fontsize=8, va="center", color=INK)
    ax.text(0.6, 3.45, "rules that name tokens (loops only build index lists)", fontsize=8,
            color=REQUEST_COLOURS[3])
    return fig
