"""Chapter 14 milestone: timing that waits for the device, profiles whose shares add up.

Oracles: a fake asynchronous device (a worker thread that runs queued work in order, like
a CUDA stream, with a sync that waits for it) whose true durations are known sleeps; a
hand-built event tree whose shares are computed by hand; torch.profiler's own inclusive
time of the root range, which the per-kind self times must add up to; on CUDA, CUDA events.
"""
import queue
import statistics
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.chapter(14)

KINDS = ("matmul", "attention", "norm", "other")


class FakeStream:
    """Work submitted with launch() runs later on one worker thread, in order; sync()
    returns once everything launched so far has finished (torch.cuda.synchronize's role)."""

    def __init__(self):
        self.work = queue.Queue()
        self.worker = threading.Thread(target=self._run, daemon=True)
        self.worker.start()
        self.syncs = 0

    def _run(self):
        while True:
            seconds = self.work.get()
            time.sleep(seconds)
            self.work.task_done()

    def launch(self, seconds):
        self.work.put(seconds)

    def sync(self):
        self.syncs += 1
        self.work.join()


KERNEL_S = 0.1
WARMUP_KERNEL_S = 0.6           # the warm-up call queues much more work than the timed ones


def test_timer_waits_for_the_device(impl):
    stream = FakeStream()
    calls = []

    def step():                     # returns at once; its "kernel" runs on the stream
        calls.append(1)
        stream.launch(WARMUP_KERNEL_S if len(calls) == 1 else KERNEL_S)

    timing = impl.profiling.time_it(step, warmup=1, repeats=3, sync=stream.sync)
    assert len(calls) == 4, f"warmup=1, repeats=3 should call fn 4 times, got {len(calls)}"
    assert len(timing.samples) == 3, f"expected 3 samples (repeats), got {len(timing.samples)}"
    short = [s for s in timing.samples if s < 0.9 * KERNEL_S]
    assert not short, (f"each call queues {KERNEL_S * 1e3:.0f} ms of device work but samples were "
                       f"{[round(s * 1e3, 1) for s in timing.samples]} ms: the clock stopped before "
                       f"the device finished (sync before reading the clock)")
    # Sleeps are floors a busy machine can only lengthen: a first sample that also waited for
    # the warm-up's queued work takes at least 600 + 100 ms, a right one 100 ms plus noise, so
    # a 600 ms line leaves half a second of noise on either side.
    first = timing.samples[0]
    assert first < WARMUP_KERNEL_S, (
        f"the first timed sample took {first * 1e3:.0f} ms for {KERNEL_S * 1e3:.0f} ms of work: it "
        f"also waited for the warm-up call's {WARMUP_KERNEL_S * 1e3:.0f} ms of queued work (sync before "
        f"starting the clock)")


def test_warmup_is_not_timed_and_samples_are_in_call_order(impl):
    timed = [0.01, 0.06, 0.11]
    durations = iter([0.5, 0.5] + timed)     # two slow warm-up calls, then three

    def step():
        time.sleep(next(durations))

    timing = impl.profiling.time_it(step, warmup=2, repeats=3, sync=lambda: None)
    got = [round(s * 1e3) for s in timing.samples]
    assert len(got) == 3, f"expected 3 samples, got {got} ms"
    # A sleep is a floor a busy machine can only lengthen, so the checks are floors: a timed
    # warm-up call takes at least 500 ms (the calls timed here: at most 110 ms plus noise),
    # and sample i can reach call i's floor only if it timed call i (or a slower one). With
    # the increasing floors 10, 60, 110 ms that pins the order; comparing the noisy samples
    # with each other would not.
    assert max(timing.samples) < 0.4, f"a warm-up call was timed: samples {got} ms"
    assert all(s >= d for s, d in zip(timing.samples, timed)), (
        f"samples {got} ms should follow the calls' 10, 60, 110 ms: time each call separately, in order")
    assert timing.median == pytest.approx(statistics.median(timing.samples)), "median of the samples"


def event(name, self_us, parent=None, device_us=0.0):
    e = SimpleNamespace(name=name, cpu_parent=parent, self_cpu_time_total=float(self_us),
                        self_device_time_total=float(device_us), cpu_time_total=0.0,
                        device_time_total=0.0)
    return e


def hand_built_tree():
    """forward > [layer0 ranges ...]; self times in microseconds; returns events, expected."""
    root = event("forward", 40)
    attn = event("kind:attention", 30, root, 0)
    q = event("kind:matmul", 5, attn)
    mm = event("aten::mm", 1000, q, device_us=800)
    linear = event("aten::linear", 20, q)
    mm.cpu_parent = linear
    qn = event("kind:norm", 3, attn)
    pow_ = event("aten::pow", 70, qn, device_us=50)
    softmax = event("aten::softmax", 400, attn, device_us=300)
    add = event("aten::add", 60, root, device_us=40)
    head = event("kind:matmul", 2, root)
    mm2 = event("aten::mm", 500, head, device_us=450)
    events = [root, attn, q, linear, mm, qn, pow_, softmax, add, head, mm2]
    # Inclusive times, as the profiler would report them, for anyone tempted to use them.
    for e in reversed(events):
        e.cpu_time_total += e.self_cpu_time_total
        e.device_time_total += e.self_device_time_total
        if e.cpu_parent is not None:
            e.cpu_parent.cpu_time_total += e.cpu_time_total
            e.cpu_parent.device_time_total += e.device_time_total
    cpu = {"matmul": 5 + 20 + 1000 + 2 + 500, "attention": 30 + 400, "norm": 3 + 70, "other": 40 + 60}
    gpu = {"matmul": 800 + 450, "attention": 300, "norm": 50, "other": 40}
    return events, cpu, gpu


@pytest.mark.parametrize("device_time", [False, True], ids=["cpu time", "device time"])
def test_op_shares_on_a_hand_built_tree(impl, device_time):
    events, cpu, gpu = hand_built_tree()
    expected = gpu if device_time else cpu
    got = impl.profiling.op_shares(events, device_time=device_time)
    assert set(got) == set(KINDS), f"op_shares must return every kind of {KINDS}, got {sorted(got)}"
    for kind in KINDS:
        assert got[kind] == pytest.approx(expected[kind] / 1e6, rel=1e-9, abs=1e-12), (
            f"{kind}: expected {expected[kind]} us of self time, got {got[kind] * 1e6:.1f} us "
            f"(self times of every event, each attributed to its innermost kind:<kind> range, "
            f"the range's own self time included)")
    total = sum(expected.values())
    assert sum(got.values()) == pytest.approx(total / 1e6), "shares must add up to the sum of self times"


def test_shares_of_a_forward_pass_add_up(impl, tiny_model, device):
    ids = torch.randint(0, tiny_model.cfg.vocab_size, (1, 48), generator=torch.Generator().manual_seed(0)).to(device)
    prof = impl.profiling.profile_forward(tiny_model, ids)
    shares = prof.shares
    assert set(shares) == set(KINDS)
    summed = sum(shares.values())
    assert summed == pytest.approx(prof.total, rel=0.01), (
        f"shares add up to {summed * 1e3:.3f} ms but the profiled forward took {prof.total * 1e3:.3f} ms: "
        f"{ {k: round(v * 1e3, 3) for k, v in shares.items()} }")
    for kind in ("matmul", "attention", "norm"):
        assert shares[kind] > 0, f"a Qwen3 forward has {kind} work, but its share is {shares[kind]}"
    assert prof.total <= prof.wall * 1.05, "the profiled time cannot exceed the wall time around the call"


class SlowRMSNorm(nn.Module):
    """Wraps a norm and sleeps first: a 'norm' whose time is known."""

    def __init__(self, inner, seconds):
        super().__init__()
        self.inner, self.seconds = inner, seconds

    def forward(self, x):
        time.sleep(self.seconds)
        return self.inner(x)


def test_time_goes_to_the_innermost_labelled_module(impl, tiny_model, device):
    # The sleep is a floor; the rest of a tiny forward is well under a millisecond of 'other'
    # on an idle machine, but a busy one can stall any op for tens of milliseconds, so the
    # sleep is long enough that 'other' stays far below it unless the sleep itself lands there.
    seconds = 0.2
    original = tiny_model.model.norm
    tiny_model.model.norm = SlowRMSNorm(original, seconds)
    try:
        ids = torch.arange(16, device=device)[None]
        prof = impl.profiling.profile_forward(tiny_model, ids, device_time=False)
    finally:
        tiny_model.model.norm = original
    norm = prof.shares["norm"]
    assert norm >= 0.95 * seconds, (
        f"the final norm sleeps {seconds * 1e3:.0f} ms inside its kind:norm range, yet the norm share is "
        f"{norm * 1e3:.1f} ms (shares: { {k: round(v * 1e3, 1) for k, v in prof.shares.items()} } ms): "
        f"a range's own self time belongs to its own kind")
    assert prof.shares["other"] < seconds, "the sleep inside the norm was counted as 'other'"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_timer_agrees_with_cuda_events(impl):
    a = torch.randn(4096, 4096, device="cuda")

    def work():
        b = a
        for _ in range(8):
            b = b @ a
        return b

    timing = impl.profiling.time_it(work, warmup=2, repeats=5, device="cuda")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    work()
    end.record()
    torch.cuda.synchronize()
    gpu = start.elapsed_time(end) / 1e3
    assert timing.median >= 0.7 * gpu, (f"time_it says {timing.median * 1e3:.2f} ms, CUDA events "
                                        f"{gpu * 1e3:.2f} ms: the timer does not wait for the GPU")
