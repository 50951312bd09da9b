"""Pictures for Chapter 38's notebook: a request's life through the server, and when each
client's tokens arrived."""
import matplotlib.pyplot as plt

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
    (3, 2, "RequestOutput(new_token_ids=[t])", "reply"),
    (2, 1, "deliver(output) -> the request's asyncio.Queue", "reply"),
    (1, 0, 'data: {"choices": [{"text": "..."}]}', "reply"),
    (0, 1, "hangs up (TCP close)", "abort"),
    (1, 2, 'Job.close(): inbox.put(("abort", submission))', "abort"),
    (2, 3, "abort_request(id) BEFORE the next step(): blocks freed", "abort"),
]


def draw_lifecycle(ax=None):
    """A sequence diagram of one streamed request, its refusals and its cancellation."""
    if ax is None:
        _, ax = plt.subplots(figsize=(11, 6.4))
    xs = [0.0, 3.2, 6.4, 9.2]
    rows = len(LIFECYCLE)
    for x, name in zip(xs, LANES):
        ax.plot([x, x], [0.3, rows + 0.6], color="#999999", lw=1, zorder=0)
        ax.text(x, rows + 0.9, name, ha="center", va="bottom", fontsize=9, fontweight="bold")
    for i, (src, dst, label, kind) in enumerate(LIFECYCLE):
        y = rows - i
        ax.annotate("", xy=(xs[dst], y), xytext=(xs[src], y),
                    arrowprops=dict(arrowstyle="->", color=COLOURS[kind], lw=1.6))
        middle = (xs[src] + xs[dst]) / 2
        ax.text(middle, y + 0.12, label, ha="center", va="bottom", fontsize=7.5, color=COLOURS[kind])
    ax.set_xlim(-0.8, 10.4)
    ax.set_ylim(0, rows + 1.8)
    ax.axis("off")
    handles = [plt.Line2D([], [], color=c, lw=2, label=k) for k, c in COLOURS.items()]
    ax.legend(handles=handles, loc="lower left", fontsize=8, frameon=False, ncol=4)
    ax.set_title("One request through the server: handlers never call the engine, one thread does", fontsize=10)
    return ax


def draw_token_arrivals(timelines, ax=None):
    """timelines: {client label: [seconds when each token arrived]}, one row per client;
    a cross marks a client that hung up."""
    if ax is None:
        _, ax = plt.subplots(figsize=(9, 0.32 * len(timelines) + 1.2))
    for row, (label, (times, hung_up)) in enumerate(timelines.items()):
        ax.plot(times, [row] * len(times), "|", markersize=9, color="#4c78a8")
        if hung_up and times:
            ax.plot([times[-1]], [row], "x", color="#e45756", markersize=8)
    ax.set_yticks(range(len(timelines)), list(timelines))
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the first request was sent")
    ax.set_title("Tokens as each client received them (x: the client hung up)", fontsize=10)
    return ax
