"""Pictures for Chapter 31's notebook: the block pool and a step's scheduled tokens.

`snapshot(engine)` copies what a picture needs out of an EngineCore after a step, so a
series of snapshots can be drawn later; `draw(snap, axes)` draws one; `stepper(make)` is
the interactive version (ipywidgets): a Step button that advances a live engine by one
step and redraws; `animation_html(snaps)` is the version for a page without a kernel (a
player of every step whose frames are embedded in the page).
"""
import matplotlib.pyplot as plt
from matplotlib.patches import Patch, Rectangle

FREE, CACHED = "#eeeeee", "#b9d7ea"
# Text sizes in points. The player's frames and the static series are drawn at 100 dpi and
# shown about one image pixel per CSS pixel, so 7 points is about 10 px on the page, the
# smallest a reader can read without zooming (block ids included).
SMALL_PT, LABEL_PT = 7, 8
PALETTE = ["#e45756", "#f58518", "#54a24b", "#b279a2", "#ff9da6", "#9d755d", "#eeca3b", "#4c78a8",
           "#72b7b2", "#bab0ac", "#d67195", "#8cd17d"]


def colour_of(request_id, order):
    if request_id not in order:
        order[request_id] = len(order)
    return PALETTE[order[request_id] % len(PALETTE)]


def snapshot(engine, outputs=()):
    """What the engine looks like now (after its latest step)."""
    blocks = engine.blocks
    owners = {}
    for rid, owned in blocks.req_blocks.items():
        for b in owned:
            owners.setdefault(b, []).append(rid)
    plan = engine.last_plan
    scheduled = []
    if plan is not None:
        for request, n in plan.scheduled:
            before = request.num_computed_tokens - n if request.num_computed_tokens >= n else 0
            kind = "decode" if n == 1 and before >= request.num_prompt_tokens else "prefill"
            scheduled.append((request.request_id, n, kind))
    return {
        "step": engine.steps,
        "states": [blocks.state(b) for b in range(blocks.num_blocks)],
        "owners": owners,
        "ref_count": list(blocks.ref_count),
        "scheduled": scheduled,
        "preempted": [r.request_id for r in plan.preempted] if plan is not None else [],
        "waiting": [r.request_id for r in engine.scheduler.waiting],
        "finished": [o.request_id for o in outputs if o.finished],
        "hit_rate": blocks.hit_rate,
    }


def draw(snap, pool_ax, tokens_ax, order, columns=8, budget=None):
    """Draw one snapshot: the pool as a grid of blocks, and the step's tokens as one bar."""
    states, owners = snap["states"], snap["owners"]
    rows = -(-len(states) // columns)
    pool_ax.clear()
    for b, state in enumerate(states):
        r, c = divmod(b, columns)
        y = rows - 1 - r
        if state == "used":
            holders = owners.get(b, [])
            face = colour_of(holders[0], order) if holders else "#888888"
            pool_ax.add_patch(Rectangle((c, y), 0.92, 0.92, facecolor=face, edgecolor="black",
                                        linewidth=2.0 if len(holders) > 1 else 0.5))
            label = holders[0] if len(holders) == 1 else f"x{len(holders)}"
            pool_ax.text(c + 0.46, y + 0.4, label, ha="center", va="center", fontsize=LABEL_PT)
        else:
            pool_ax.add_patch(Rectangle((c, y), 0.92, 0.92, facecolor=CACHED if state == "cached" else FREE,
                                        edgecolor="#999999", linewidth=0.5, hatch="//" if state == "cached" else None))
        pool_ax.text(c + 0.06, y + 0.86, str(b), fontsize=SMALL_PT, color="#333333", va="top")
    # A margin around the grid, so the outer blocks' edges are not cut at the axes' border.
    pool_ax.set_xlim(-0.05, columns + 0.02)
    pool_ax.set_ylim(-0.05, rows + 0.02)
    pool_ax.set_aspect("equal", adjustable="box")
    pool_ax.axis("off")
    title = f"after step {snap['step']}: hit rate {snap['hit_rate']:.2f}"
    if snap["preempted"]:
        title += f"\npreempted {', '.join(snap['preempted'])}"
    pool_ax.set_title(title, fontsize=LABEL_PT + 1)

    tokens_ax.clear()
    x = 0
    for rid, n, kind in snap["scheduled"]:
        tokens_ax.barh(0, n, left=x, color=colour_of(rid, order), edgecolor="black", linewidth=0.5,
                       hatch=None if kind == "decode" else "..")
        if n >= 3:
            tokens_ax.text(x + n / 2, 0, f"{rid}\n{n}", ha="center", va="center", fontsize=SMALL_PT,
                           bbox={"facecolor": "white", "edgecolor": "none", "pad": 1, "alpha": 0.85})
        x += n
    width = max(budget or 0, x, 1)
    tokens_ax.set_xlim(0, width)
    tokens_ax.set_yticks([])
    tokens_ax.set_xlabel(f"{x} tokens this step" + (f" (budget {budget})" if budget else ""), fontsize=LABEL_PT)
    tokens_ax.tick_params(labelsize=SMALL_PT)
    waiting = ", ".join(snap["waiting"]) or "nobody"
    tokens_ax.set_title(f"waiting: {waiting}", fontsize=LABEL_PT)


def legend_handles():
    return [Patch(facecolor=FREE, edgecolor="#999999", label="free"),
            Patch(facecolor=CACHED, edgecolor="#999999", hatch="//", label="cached-free (has a hash)"),
            Patch(facecolor=PALETTE[0], edgecolor="black", label="in use (colour = owner, thick = shared)"),
            Patch(facecolor="white", edgecolor="black", hatch="..", label="prefill tokens"),
            Patch(facecolor="white", edgecolor="black", label="decode token")]


def draw_series(snaps, columns=8, budget=None, per_row=3):
    """A static figure: one panel per snapshot (pool on top, scheduled tokens below),
    `per_row` panels to a row, so the figure stays readable at a page's width."""
    order = {}
    rows = -(-len(snaps) // per_row)
    fig, axes = plt.subplots(2 * rows, per_row, figsize=(2.6 * per_row, 4.2 * rows),
                             gridspec_kw={"height_ratios": [4, 1] * rows}, squeeze=False)
    for i in range(rows * per_row):
        pool_ax, tokens_ax = axes[2 * (i // per_row), i % per_row], axes[2 * (i // per_row) + 1, i % per_row]
        if i < len(snaps):
            draw(snaps[i], pool_ax, tokens_ax, order, columns, budget)
        else:                                    # an unused slot in the last row
            pool_ax.axis("off")
            tokens_ax.axis("off")
    fig.legend(handles=legend_handles(), loc="lower center", ncol=3, fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0.05 / rows, 1, 1))
    return fig


PLAYER = """<div id="{uid}" style="max-width:100%">
<img id="{uid}-frame" src="data:image/png;base64,{first}" style="width:100%;max-width:{width}px" alt="{alt}">
<div style="font:13px sans-serif;margin-top:4px">
<button id="{uid}-first">|&lt;</button> <button id="{uid}-back">&lt; step</button>
<button id="{uid}-play">play</button> <button id="{uid}-next">step &gt;</button>
<input id="{uid}-slider" type="range" min="0" max="{last}" value="0" style="vertical-align:middle">
<span id="{uid}-label"></span></div></div>
<script>
(function() {{
  var frames = {frames}, at = 0, timer = null;
  function el(name) {{ return document.getElementById("{uid}-" + name); }}
  function show(i) {{
    at = Math.max(0, Math.min(frames.length - 1, i));
    el("frame").src = "data:image/png;base64," + frames[at];
    el("slider").value = at;
    el("label").textContent = "frame " + (at + 1) + " of " + frames.length;
  }}
  function stop() {{ if (timer) {{ clearInterval(timer); timer = null; el("play").textContent = "play"; }} }}
  el("first").onclick = function() {{ stop(); show(0); }};
  el("back").onclick = function() {{ stop(); show(at - 1); }};
  el("next").onclick = function() {{ stop(); show(at + 1); }};
  el("slider").oninput = function() {{ stop(); show(+this.value); }};
  el("play").onclick = function() {{
    if (timer) {{ stop(); return; }}
    if (at === frames.length - 1) show(0);
    el("play").textContent = "pause";
    timer = setInterval(function() {{ if (at === frames.length - 1) stop(); else show(at + 1); }}, {interval});
  }};
  show(0);
}})();
</script>"""


# The player's frames fill the book's column (about 780 px): drawn 7.8 x 3.9 inches at
# 100 dpi, they are shown at their own size, so a 7-point label is about 10 px on the page.
FRAME_INCHES = (7.8, 3.9)
FRAME_DPI = 100


def animation_html(snaps, columns=8, budget=None, interval_ms=700):
    """Every snapshot as one frame of a small HTML/JavaScript player (buttons and a slider),
    for pages read without a live kernel. A frame is as wide as the book's column: the pool
    on the left, the step's tokens and the legend on the right. The frames are PNG images
    embedded in the page and the script is inline: nothing is fetched from anywhere. The first
    frame is in the page itself, so a viewer that runs no script (JupyterLab, in a notebook it
    does not trust) still shows the first step."""
    import base64
    import io
    import uuid

    order, frames = {}, []
    fig = plt.figure(figsize=FRAME_INCHES, dpi=FRAME_DPI)
    grid = fig.add_gridspec(2, 2, width_ratios=[1, 1.3], height_ratios=[1, 1.4])
    pool_ax, tokens_ax = fig.add_subplot(grid[:, 0]), fig.add_subplot(grid[0, 1])
    fig.legend(handles=legend_handles(), loc="center", bbox_to_anchor=(0.7, 0.3), ncol=1, fontsize=8,
               frameon=False)
    for snap in snaps:
        draw(snap, pool_ax, tokens_ax, order, columns, budget)
        fig.subplots_adjust(left=0.02, right=0.98, top=0.9, bottom=0.05, wspace=0.15, hspace=0.6)
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png", dpi=FRAME_DPI)
        frames.append(base64.b64encode(buffer.getvalue()).decode("ascii"))
    plt.close(fig)
    return PLAYER.format(uid=f"steps-{uuid.uuid4().hex[:8]}", first=frames[0], last=len(frames) - 1,
                         interval=interval_ms,
                         width=round(FRAME_INCHES[0] * FRAME_DPI),
                         alt="The block pool (left, one square per block, coloured by owner) and the step's "
                             "scheduled tokens (right), after each engine step",
                         frames="[" + ",".join(f'"{f}"' for f in frames) + "]")


def stepper(make_engine, columns=8, budget=None):
    """An interactive stepper: make_engine() returns a fresh EngineCore with requests queued.
    Step runs engine.step() once; Reset starts over."""
    import ipywidgets as widgets
    from IPython.display import display

    state = {"engine": make_engine(), "order": {}}
    out = widgets.Output()
    step_button = widgets.Button(description="Step")
    reset_button = widgets.Button(description="Reset")
    info = widgets.HTML()

    def redraw(snap):
        with out:
            out.clear_output(wait=True)
            fig, (pool_ax, tokens_ax) = plt.subplots(2, 1, figsize=(5, 5), gridspec_kw={"height_ratios": [4, 1]})
            draw(snap, pool_ax, tokens_ax, state["order"], columns, budget)
            fig.legend(handles=legend_handles(), loc="lower center", ncol=2, fontsize=7, frameon=False)
            fig.tight_layout(rect=(0, 0.1, 1, 1))
            plt.show()
        done = ", ".join(snap["finished"])
        info.value = f"step {snap['step']}" + (f": finished {done}" if done else "")

    def on_step(_):
        engine = state["engine"]
        if not engine.has_unfinished:
            info.value = "every request has finished: press Reset"
            return
        outputs = engine.step()
        redraw(snapshot(engine, outputs))

    def on_reset(_):
        state["engine"], state["order"] = make_engine(), {}
        redraw(snapshot(state["engine"]))

    step_button.on_click(on_step)
    reset_button.on_click(on_reset)
    display(widgets.VBox([widgets.HBox([step_button, reset_button, info]), out]))
    redraw(snapshot(state["engine"]))
