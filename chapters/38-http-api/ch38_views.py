"""Pictures for Chapter 38's notebook: a request's life through the server, the admission
door, a cancellation between two engine steps, and when each client's tokens arrived.

Each function returns a Figure as wide as the book's column (course.diagrams.COLUMN_INCHES)
for course.diagrams.show, with no text under 8 pt, so that no label is shown under 9 px.
"""
import textwrap

from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import FancyBboxPatch

from course.diagrams import COLUMN_INCHES, INK, MUTED, _arrow, _box, _canvas

LANES = ["client", "HTTP handler\n(asyncio event loop)", "engine loop\n(its own thread)", "EngineCore"]
COLOURS = {"request": "#4c78a8", "reply": "#54a24b", "abort": "#e45756", "refuse": "#f58518"}

# (from lane, to lane, label, kind); each message is one row, top to bottom.
LIFECYCLE = [
    (0, 1, "POST /v1/completions  {stream: true}", "request"),
    (1, 0, "400 / 404 / 413: bad body, before anything is queued", "refuse"),
    (1, 0, "429 + Retry-After: AdmissionControl is full", "refuse"),
    (1, 2, 'inbox.put(("add", submission))', "request"),
    (2, 3, "add_request(id, prompt_ids, params)", "request"),
    (2, 1, "deliver(ACCEPTED)  (call_soon_threadsafe)", "reply"),
    (1, 0, "200, text/event-stream", "reply"),
    (2, 3, "step()", "request"),
    (3, 2, "RequestOutput(\nnew_token_ids=[t])", "reply"),
    (2, 1, "deliver(output) -> the request's asyncio.Queue", "reply"),
    (1, 0, 'data: {"choices": [{"text": "..."}]}', "reply"),
    (0, 1, "hangs up (TCP close)", "abort"),
    (1, 2, 'Job.close(): inbox.put(("abort", submission))', "abort"),
    (2, 3, "abort_request(id) BEFORE the next step(): blocks freed", "abort"),
]
# Characters of an 8 pt label that fit in one unit of the lifecycle's x axis (a unit is
# COLUMN_INCHES / 10.6 inches; DejaVu Sans averages about 0.55 em a character).
_CHARS_PER_UNIT = COLUMN_INCHES / 10.6 * 72 / (8 * 0.55)


def draw_lifecycle() -> Figure:
    """A sequence diagram of one streamed request, its refusals and its cancellation. Each
    label is wrapped to the width of its arrow, so that none crosses a lifeline."""
    xs = [0.0, 3.4, 6.8, 9.8]
    rows = len(LIFECYCLE)
    fig = Figure(figsize=(COLUMN_INCHES, 8.6))
    ax = fig.add_axes((0, 0, 1, 1))
    for x, name in zip(xs, LANES):
        ax.plot([x, x], [0.3, rows + 0.6], color="#999999", lw=1, zorder=0)
        ax.text(x, rows + 0.9, name, ha="center", va="bottom", fontsize=9, fontweight="bold")
    for i, (src, dst, label, kind) in enumerate(LIFECYCLE):
        y = rows - i
        ax.annotate("", xy=(xs[dst], y), xytext=(xs[src], y),
                    arrowprops=dict(arrowstyle="->", color=COLOURS[kind], lw=1.6))
        span = abs(xs[dst] - xs[src]) - 0.3
        text = "\n".join(textwrap.fill(line, width=int(span * _CHARS_PER_UNIT), break_long_words=False)
                         for line in label.split("\n"))
        ax.text((xs[src] + xs[dst]) / 2, y + 0.1, text, ha="center", va="bottom", fontsize=8,
                color=COLOURS[kind], linespacing=1.05)
    ax.set_xlim(-0.8, 10.6)
    ax.set_ylim(-0.2, rows + 2.2)
    ax.axis("off")
    handles = [Line2D([], [], color=c, lw=2, label=k) for k, c in COLOURS.items()]
    ax.legend(handles=handles, loc="lower center", fontsize=9, frameon=False, ncol=4, bbox_to_anchor=(0.5, 0.0))
    ax.text(4.9, rows + 2.0, "One request through the server: handlers never call the engine, one thread does",
            ha="center", va="top", fontsize=10)
    return fig


def draw_admission(max_running: int = 2, max_waiting: int = 2) -> Figure:
    """AdmissionControl as a door: at most max_running + max_waiting samples inside (running
    in the engine, or waiting for a slot); a request that does not fit now is a 429, one
    that could never fit is a 400; every way out gives its count back, once."""
    fig, ax = _canvas(11.0, 5.6, COLUMN_INCHES * 5.6 / 11.0)
    ax.add_patch(FancyBboxPatch((4.0, 0.9), 4.4, 3.9, boxstyle="round,pad=0.02,rounding_size=0.2",
                                facecolor="#f4f4f4", edgecolor=MUTED, lw=1.0))
    ax.text(6.2, 4.95, f"inside: at most max_running + max_waiting = {max_running + max_waiting}",
            ha="center", fontsize=9.5, color=INK)
    for k in range(max_waiting):
        _box(ax, 4.3 + k * 1.0, 3.2, 0.85, 0.8, "wait", face="#fdebd3", size=9)
    ax.text(4.3, 2.85, f"max_waiting = {max_waiting}: queued in the engine", fontsize=9, color=INK)
    for k in range(max_running):
        _box(ax, 4.3 + k * 1.0, 1.55, 0.85, 0.8, "run", face="#dbe7f3", size=9)
    ax.text(4.3, 1.2, f"max_running = {max_running}: slots of a step", fontsize=9, color=INK)
    _arrow(ax, (4.72, 3.2), (4.72, 2.4), color=MUTED)

    arrivals = [("n = 1", "#4c78a8", 3.6), ("n = 1 (door full)", COLOURS["refuse"], 2.3),
                (f"n = {max_running + max_waiting + 1}", "#e45756", 1.0)]
    for label, colour, y in arrivals:
        _box(ax, 0.1, y - 0.35, 1.9, 0.7, label, face="white", edge=colour, size=9, color=colour)
    _arrow(ax, (2.05, 3.6), (4.25, 3.6), color="#4c78a8")
    ax.text(3.1, 3.72, "admitted", ha="center", fontsize=9, color="#4c78a8")
    _arrow(ax, (2.05, 2.3), (3.3, 2.3), color=COLOURS["refuse"])
    ax.text(2.1, 1.95, "429 + Retry-After\nat once, costs nothing", fontsize=9, color=COLOURS["refuse"], va="top")
    _arrow(ax, (2.05, 1.0), (3.3, 1.0), color="#e45756")
    ax.text(2.1, 0.6, "400: more than the door\never holds", fontsize=9, color="#e45756", va="top")

    ax.text(8.7, 4.3, "every way out\ngives the count back,\nexactly once\n(Job.close):", fontsize=9,
            color=INK, va="top")
    for k, way in enumerate(("finished", "stop string", "refused by the engine", "client gone")):
        _arrow(ax, (8.4, 2.4 - 0.45 * k + 0.45), (8.75, 2.4 - 0.45 * k + 0.45), color=COLOURS["reply"])
        ax.text(8.8, 2.4 - 0.45 * k + 0.45, way, fontsize=9, va="center", color=COLOURS["reply"])
    return fig


def draw_cancellation() -> Figure:
    """A client hangs up while step k computes: the handler's task is cancelled, Job.close
    puts an abort in the inbox, and the engine loop applies it before step k + 1, which runs
    without the request; its blocks are free for whoever that step admits."""
    fig, ax = _canvas(11.0, 4.6, COLUMN_INCHES * 4.6 / 11.0)
    lanes = {"client": 4.3, "HTTP handler\n(event loop)": 3.05, "engine loop\n(thread)": 1.7}
    for name, y in lanes.items():
        ax.plot([2.0, 10.9], [y, y], color="#cccccc", lw=1, zorder=0)
        ax.text(1.9, y, name, ha="right", va="center", fontsize=9, weight="bold", color=INK)
    engine_y = lanes["engine loop\n(thread)"]
    for x, w, label, face in ((2.1, 2.2, "step k - 1", "#dbe7f3"), (4.6, 2.6, "step k", "#dbe7f3"),
                              (8.2, 2.6, "step k + 1\n(without it)", "#dbe7f3")):
        _box(ax, x, engine_y - 0.35, w, 0.7, label, face=face, size=9)
    _box(ax, 7.3, engine_y - 0.35, 0.8, 0.7, "inbox", face="#fbd9d9", size=9)
    ax.text(7.7, engine_y - 0.55, "abort_request:\nblocks freed", ha="center", va="top", fontsize=9,
            color=COLOURS["abort"])
    hang_up_x = 5.2
    ax.plot([hang_up_x], [lanes["client"]], "x", color=COLOURS["abort"], markersize=9, mew=2)
    ax.text(hang_up_x + 0.2, lanes["client"] + 0.15, "hangs up while step k computes", fontsize=9,
            color=COLOURS["abort"])
    handler_y = lanes["HTTP handler\n(event loop)"]
    _arrow(ax, (hang_up_x, lanes["client"] - 0.1), (hang_up_x + 0.3, handler_y + 0.1), color=COLOURS["abort"])
    ax.text(hang_up_x + 0.5, handler_y + 0.15, "http.disconnect: task cancelled;\nEngineStream's finally runs "
            "Job.close", fontsize=9, color=COLOURS["abort"], va="bottom")
    _arrow(ax, (hang_up_x + 0.4, handler_y - 0.1), (7.6, engine_y + 0.38), color=COLOURS["abort"],
           connection="arc3,rad=0.15")
    ax.text(7.1, 2.55, 'inbox.put(("abort", ...))', fontsize=9, color=COLOURS["abort"])
    ax.text(2.1, 0.1, "Applied before the next step: the request never costs another forward pass.",
            fontsize=9, color=INK)
    return fig


def draw_token_arrivals(timelines, steps) -> Figure:
    """Streaming clients' tokens, one row per client: above, each token at the engine step
    that made it; below, at the moment the client read it, with a grey line where each step
    ended. A cross marks a client that hung up.

    timelines: {client label: (seconds when each token arrived, hung up?, request id)};
    steps: [(seconds when an engine step ended, ids of the requests it gave a token)]."""
    rows = len(timelines)
    fig = Figure(figsize=(COLUMN_INCHES, 0.5 * rows + 2.4))
    by_step, by_time = fig.subplots(2, 1, sharey=True)
    for row, (times, hung_up, request_id) in enumerate(timelines.values()):
        made = [k for k, (_, ids) in enumerate(steps) if request_id in ids]
        by_step.plot(made, [row] * len(made), "|", markersize=9, mew=1.5, color="#4c78a8")
        by_time.plot(times, [row] * len(times), "|", markersize=9, mew=1.5, color="#4c78a8")
        if hung_up and made:
            by_step.plot([made[-1] + 0.5], [row], "x", color="#e45756", markersize=7)
        if hung_up and times:
            by_time.plot([times[-1] + 0.004], [row], "x", color="#e45756", markersize=7)
    for end, _ in steps:
        by_time.axvline(end, color="#dddddd", lw=0.8, zorder=0)
    busy = [k for k, (_, ids) in enumerate(steps) if ids]
    by_step.set_xlim(min(busy) - 1, max(busy) + 1)
    by_time.set_xlim(steps[min(busy)][0] - 0.02, steps[max(busy)][0] + 0.02)
    for ax in (by_step, by_time):
        ax.set_yticks(range(rows), list(timelines))
        ax.tick_params(labelsize=8)
    by_step.invert_yaxis()
    by_step.set_xlabel("engine step", fontsize=9)
    by_step.set_title("Each token at the engine step that made it", fontsize=10)
    by_time.set_xlabel("seconds since the first request was sent (grey: a step ended)", fontsize=9)
    by_time.set_title("The same tokens as each client received them (x: the client hung up)", fontsize=10)
    fig.tight_layout()
    return fig
