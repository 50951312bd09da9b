"""Chapter 33's diagrams: the host/device timeline of a synchronous and an asynchronous
engine, and decode batches padded to graph buckets. Same style as course.diagrams
(matplotlib Figures, shown with diagrams.show)."""
from __future__ import annotations

from matplotlib.figure import Figure

from course.diagrams import COLUMN_INCHES, INK, KEY, MUTED, PAD, QUERY, REQUEST_COLOURS, _box, _canvas

HOST, DEVICE, WAIT = "#EAF0F8", QUERY, PAD


def timeline(steps: int = 4, host: float = 1.0, device: float = 2.2, update: float = 0.5) -> Figure:
    """Host and device lanes for `steps` engine steps, synchronous above, asynchronous below.

    host: time to schedule and build a batch; device: the forward pass and sampling;
    update: reading tokens back and applying stop rules. Synchronous: each phase waits for
    the one before. Asynchronous: the host schedules step t+1 while the device runs step t
    (with placeholders for step t's tokens), then settles step t."""
    sync_end = steps * (host + device + update)
    width = sync_end + 3.2
    fig, ax = _canvas(width, 9.2, figheight=COLUMN_INCHES * 9.2 / width)
    ax.text(0.1, 8.85, "synchronous: one step at a time", fontsize=11, weight="bold", color=INK, va="center")
    ax.text(0.1, 4.35, "asynchronous: plan t+1 while t computes", fontsize=11, weight="bold", color=INK, va="center")
    lanes = {"sync host": 7.4, "sync device": 6.0, "async host": 2.9, "async device": 1.5}
    for name, y in lanes.items():
        ax.text(width - 2.9, y + 0.45, name.split()[1], fontsize=10, color=INK, va="center")
        ax.plot([0, width - 3.1], [y - 0.1, y - 0.1], color=MUTED, lw=0.8)
    t = 0.0
    for s in range(steps):
        _box(ax, t, lanes["sync host"], host, 0.9, f"plan {s}", face=HOST, size=8.5)
        t += host
        _box(ax, t, lanes["sync device"], device, 0.9, f"forward {s}", face=DEVICE, color="white", size=8.5)
        _box(ax, t, lanes["sync host"], device, 0.9, "wait", face=WAIT, edge=MUTED, color="#888888", size=8.5)
        t += device
        _box(ax, t, lanes["sync host"], update, 0.9, f"{s}", face=KEY, size=8.5)
        t += update
    # Asynchronous, as serve/overlap.py runs it: call k plans and launches step k, then
    # settles step k-1 (waiting for its tokens if the device is not done yet).
    now = device_free = 0.0
    ends = []

    def plan_and_launch(s: int) -> None:
        nonlocal now, device_free
        _box(ax, now, lanes["async host"], host, 0.9, f"plan {s}", face=HOST, size=8.5)
        now += host
        begin = max(now, device_free)
        _box(ax, begin, lanes["async device"], device, 0.9, f"forward {s}", face=DEVICE, color="white", size=8.5)
        device_free = begin + device
        ends.append(device_free)

    plan_and_launch(0)
    for s in range(1, steps + 1):
        if s < steps:
            plan_and_launch(s)
        if ends[s - 1] > now:
            _box(ax, now, lanes["async host"], ends[s - 1] - now, 0.9, "", face=WAIT, edge=MUTED)
            now = ends[s - 1]
        _box(ax, now, lanes["async host"], update, 0.9, f"{s - 1}", face=KEY, size=8.5)
        now += update
    async_end = now
    for y, end in ((6.0, sync_end), (1.5, async_end)):
        ax.annotate("", (end, y - 0.35), (0, y - 0.35), arrowprops=dict(arrowstyle="<->", color=INK, lw=0.9))
        ax.text(end / 2, y - 0.65, f"{steps} steps: {end:.1f} time units", ha="center", fontsize=9, color=INK)
    ax.text(0.1, 0.2, "plan = schedule + build batch      forward = model + sampling (queued on the device)      "
            "orange = read tokens, stop rules, outputs", fontsize=8.5, color="#555555")
    return fig


def buckets(sizes: tuple[int, ...] = (1, 2, 4, 8, 16), batches: tuple[int, ...] = (3, 6, 13)) -> Figure:
    """Decode batches of `batches` requests padded up to the next of `sizes` (one graph each):
    real rows in colour, padding rows (slot -1, seq_len 0) grey."""
    largest = max(sizes)
    fig, ax = _canvas(largest + 6, len(batches) * 1.3 + 1.2, figheight=1.0 + 0.55 * len(batches))
    for i, count in enumerate(batches):
        bucket = next(s for s in sizes if s >= count)
        y = (len(batches) - 1 - i) * 1.3 + 0.4
        ax.text(0.1, y + 0.4, f"{count} decodes", fontsize=9.5, va="center", color=INK)
        for row in range(bucket):
            real = row < count
            _box(ax, 3.0 + row, y, 0.9, 0.8, "" if real else "pad", face=REQUEST_COLOURS[row % 6] if real else PAD,
                 edge=INK if real else MUTED, size=7, color="#777777", round_=False)
        ax.text(3.2 + bucket, y + 0.4, f"-> graph of {bucket}", fontsize=9.5, va="center", color=INK)
    ax.text(0.1, len(batches) * 1.3 + 0.6, f"captured sizes: {', '.join(map(str, sizes))}", fontsize=9.5,
            color=INK)
    return fig
