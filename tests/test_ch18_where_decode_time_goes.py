"""Chapter 18 milestone: measuring where a decode step's time goes.

Timings are noisy, so the oracles are built to be exact where they can be and wide where
they cannot:
  * a wrapper around the tiny model that sleeps a known time per row and records every
    call: the step timer must time [batch, 1] calls at exactly `context` cached tokens,
    skip its warm-up, and grow with the batch as the sleeps do;
  * a dispatch-level counter of the operations the launch-overhead chain runs;
  * Chapter 2's cost model from the reference package for the roofline figures, with
    measurements passed in so the arithmetic is checked exactly;
  * a decoder layer made slow on purpose, which the per-part breakdown must find.
"""
import dataclasses
import time

import pytest
import torch
from torch import nn

from course import reference
from course.models import tiny_qwen3
from course.testing.milestone_helpers import OperatorCounter
from course.testing.oracle_records import recorded
from course.testing.oracles import reference_call

pytestmark = pytest.mark.chapter(18)


class SleepyModel(nn.Module):
    """The tiny model plus a sleep of `per_row` seconds per batch row; records each call."""

    def __init__(self, inner, per_row, first_call_extra=0.0):
        super().__init__()
        self.inner, self.cfg = inner, inner.cfg
        self.per_row, self.first_call_extra = per_row, first_call_extra
        self.calls = []

    def forward(self, input_ids, positions=None, cache=None, allowed=None):
        self.calls.append((tuple(input_ids.shape), None if cache is None else int(cache.length)))
        out = self.inner(input_ids, positions, cache, allowed)
        time.sleep(self.per_row * input_ids.shape[0] + (self.first_call_extra if len(self.calls) == 1 else 0.0))
        return out


def test_decode_step_seconds_times_the_right_step(impl, tiny_model):
    model = SleepyModel(tiny_model, per_row=0.004, first_call_extra=0.5)
    try:
        seconds = impl.decode_timing.decode_step_seconds(model, 3, 12, repeats=3, warmup=1)
    except ValueError as error:          # a cache not set to `context` before each step overflows or cannot be cut
        seconds = error
    for n, (shape, length) in enumerate(model.calls):
        assert shape == (3, 1), f"call {n}: a decode step feeds [batch, 1] tokens, got {shape}"
        assert length == 12, (f"call {n}: the cache held {length} tokens; every timed step must start from "
                              f"`context` = 12 (truncate the cache back after each step)")
    assert not isinstance(seconds, ValueError), f"decode_step_seconds raised {seconds}"
    assert len(model.calls) == 4, f"warmup=1 and repeats=3 should make 4 calls, made {len(model.calls)}"
    assert 0.012 <= seconds < 0.3, (f"3 rows sleeping 4 ms each take >= 12 ms per step, and the 0.5 s first "
                                    f"call is a warm-up that must not be timed; got {seconds * 1e3:.1f} ms")


def test_step_time_grows_with_batch(impl, tiny_model):
    model = SleepyModel(tiny_model, per_row=0.005)
    for batch in (1, 4, 16):
        model.calls.clear()
        seconds = impl.decode_timing.decode_step_seconds(model, batch, 4, repeats=3, warmup=1)
        # A sleep is a floor a busy machine can only lengthen, so the floor is the robust check.
        assert seconds >= 0.005 * batch, (f"batch {batch}: each row sleeps 5 ms inside the step, so it takes at "
                                          f"least {5 * batch} ms; measured {seconds * 1e3:.1f} ms")
        assert {shape for shape, _ in model.calls} == {(batch, 1)}, f"batch {batch}: calls {model.calls}"
    # On the real model the gap is large on an idle machine but a busy one can swallow a single
    # measurement, so the claim only has to hold in one of three tries.
    for _ in range(3):
        real = [impl.decode_timing.decode_step_seconds(tiny_model, b, 8, repeats=5, warmup=1) for b in (1, 2048)]
        if real[0] < real[1]:
            break
    assert real[0] < real[1], f"2048 rows must take longer than 1 row on the real tiny model: {real}"


def test_launch_overhead_runs_a_chain(impl, device):
    with OperatorCounter() as counter:
        per_op = impl.decode_timing.launch_overhead(device, num_ops=50, repeats=4, warmup=1)
    arithmetic = sum(n for name, n in counter.ops.items() if name in ("add", "sub", "mul", "div", "neg"))
    assert arithmetic >= 50 * 5, (f"50 ops x (4 repeats + 1 warm-up) = 250 tiny operations expected, "
                                  f"saw {dict(counter.ops)}")
    assert 1e-8 < per_op < 1e-3, f"one tiny op should cost between 10 ns and 1 ms, measured {per_op:.2e} s"


def test_count_ops_depends_on_layers_only(impl, device):
    count = impl.decode_timing.count_ops
    small = tiny_qwen3(impl.package, device=device)
    base = sum(count(small, 1, 8).values())
    assert base == sum(count(small, 7, 30).values()), "the number of operations must not depend on batch or context"
    per_layer = sum(count(tiny_qwen3(impl.package, device=device, num_hidden_layers=3), 1, 8).values()) - base
    four = sum(count(tiny_qwen3(impl.package, device=device, num_hidden_layers=4), 1, 8).values())
    assert per_layer > 10 and four == base + 2 * per_layer, "each decoder layer must add the same number of ops"


def test_decode_report_arithmetic(impl, tiny_model):
    hardware = impl.cost.Hardware("test", peak_flops=1e12, bandwidth=1e10)
    report = impl.decode_timing.decode_report(tiny_model, 4, 20, hardware, step_seconds=2e-3,
                                              overhead_seconds=5e-6, num_ops=120)
    cost = reference_call("cost.step_cost", tiny_model.cfg, 1, 20, 4, torch.float32)
    assert report.bytes_moved == cost.bytes and report.flops == cost.flops, \
        "bytes and FLOPs come from Chapter 2's step_cost(cfg, 1, context, batch, model dtype)"
    roofline = recorded("cost.step_cost(...).time", (tiny_model.cfg, hardware), lambda: reference().cost.step_cost(
        tiny_model.cfg, 1, 20, 4, torch.float32).time(reference().cost.Hardware(**dataclasses.asdict(hardware))))
    assert report.roofline_seconds == pytest.approx(roofline), "roofline = step_cost(...).time(hardware)"
    assert report.launch_seconds == pytest.approx(120 * 5e-6), "launch_seconds = num_ops * overhead_seconds"
    assert report.achieved_bandwidth == pytest.approx(cost.bytes / 2e-3), "achieved bandwidth = bytes / step time"
    assert report.launch_share == pytest.approx(0.3)


def test_decode_report_measures_what_is_missing(impl, tiny_model):
    hardware = impl.cost.Hardware("test", peak_flops=1e12, bandwidth=1e10)
    report = impl.decode_timing.decode_report(tiny_model, 2, 16, hardware)
    assert report.step_seconds > 0 and report.overhead_seconds > 0
    assert report.num_ops == sum(impl.decode_timing.count_ops(tiny_model, 2, 16).values())
    assert report.launch_seconds == pytest.approx(report.num_ops * report.overhead_seconds)
    assert report.achieved_bandwidth * report.step_seconds == pytest.approx(report.bytes_moved)


class SlowMLP(nn.Module):
    def __init__(self, inner, delay):
        super().__init__()
        self.inner, self.delay = inner, delay

    def forward(self, x):
        time.sleep(self.delay)
        return self.inner(x)


def test_breakdown_adds_up_and_finds_the_slow_layer(impl, device):
    model = tiny_qwen3(impl.package, device=device)
    layer = model.model.layers[1]
    layer.mlp = SlowMLP(layer.mlp, 0.05)
    # The sleep is a floor, so layer.1 >= 50 ms always holds; that it dominates the step compares
    # it with the rest of the step, which a busy machine can stall for as long (layer.0 was
    # seen at 105 ms): that claim only has to hold in one of three tries. The other checks are
    # exact and hold in every try.
    for _ in range(3):
        parts = impl.decode_timing.step_breakdown(model, 2, 8, repeats=3)
        named = [k for k in parts if k not in ("total", "other")]
        assert set(named) == {"embed", "layer.0", "layer.1", "norm", "lm_head"}
        assert sum(parts[k] for k in named) + parts["other"] == pytest.approx(parts["total"])
        assert parts["other"] >= 0, "parts must not overlap"
        assert parts["layer.1"] >= 0.05, f"layer.1 sleeps 50 ms per call: {parts}"
        if parts["layer.1"] > 0.5 * parts["total"]:
            break
    assert parts["layer.1"] > 0.5 * parts["total"], f"layer.1 sleeps 50 ms per call and must dominate: {parts}"
