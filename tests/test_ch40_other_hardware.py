"""Chapter 40 milestone: the device module and layers placed on several devices.

Oracles: torch's own device queries (is_available, device_count, get_device_properties,
is_bf16_supported, is_pinned) and the operating system's (sysconf) for part one; an
exhaustive search over every contiguous split for the layer plan; and for the placed
model, the REFERENCE package's solo greedy `generate` (course.testing.oracles.solo) on the same
weights, one prompt at a time. On a CPU the stages are "cpu" twice (or three times): no
byte changes device, so the test checks the plumbing: every layer's pool sits on its
layer's device, the stream is handed over stages - 1 times per forward, one hand-back of
the sampled rows per step, and the tokens are exactly solo generate's. With a GPU the same
test runs on cuda:0 + cpu, where a missed transfer is a device-mismatch error.
"""
import itertools
import os
import random
from fractions import Fraction

import pytest
import torch

from course.models import tiny_qwen3
from course.testing.oracles import TINY_EOS, assert_engine_idle, make_engine, reference_tiny_qwen3, solo

pytestmark = pytest.mark.chapter(40)

ACCELERATORS = {"cuda": torch.cuda.is_available(), "mps": torch.backends.mps.is_available(),
                "xpu": hasattr(torch, "xpu") and torch.xpu.is_available()}
needs_cuda = pytest.mark.skipif(not ACCELERATORS["cuda"], reason="no CUDA (or ROCm) device here")
PROMPTS = [[10, 20, 30, 40, 50], [7] * 19, [100, 3, 250, 4], list(range(60, 93)), [1, 2]]


@pytest.fixture(scope="module")
def devices(impl):
    return impl.load("devices")


# --- part one: asking a device ------------------------------------------------------------

def test_auto_picks_the_first_present_kind(devices):
    want = next((kind for kind in ("cuda", "mps", "xpu") if ACCELERATORS[kind]), "cpu")
    assert devices.pick_device("auto") == torch.device(want), "auto must try cuda, mps, xpu, then cpu"
    assert devices.pick_device(None) == torch.device(want), "None means auto"
    assert devices.pick_device("cpu") == torch.device("cpu")


def refused(call, choice, match, rule):
    """call(choice) must raise ValueError with `match` in its message; `rule` says why."""
    try:
        got = call(choice)
    except ValueError as error:
        assert match in str(error), \
            f"{call.__name__}({choice!r}) raised {str(error)!r}, which should say {match!r}: {rule}"
        return
    pytest.fail(f"{call.__name__}({choice!r}) returned {got!r}: {rule}")


def test_auto_follows_the_order_whatever_is_present(devices, monkeypatch):
    """Pretended device counts (this machine may have no accelerator): auto takes the first
    kind of cuda, mps, xpu, cpu that has a device."""
    for present, want in ((("mps", "xpu"), "mps"), (("xpu",), "xpu"), (("cuda", "xpu"), "cuda"), ((), "cpu")):
        monkeypatch.setattr(devices, "device_count",
                            lambda kind, present=present: int(kind in present or kind == "cpu"))
        got = devices.pick_device("auto")
        assert got == torch.device(want), (f"with devices of kinds {present or 'none'} (and the cpu), auto must try "
                                           f"cuda, mps, xpu, then cpu: {want}, got {got}")


def test_an_index_past_the_devices_is_refused(devices):
    refused(devices.pick_device, "cpu:1", "cpu:1", "an index must be below device_count(kind): there is one cpu")


@pytest.mark.parametrize("choice", ["tpu", "gpu", "cuda:x", ""])
def test_unknown_device_names_are_refused(devices, choice):
    refused(devices.pick_device, choice, repr(choice), "a name torch does not know is refused, the message quoting "
                                                       "the choice as repr()")


@pytest.mark.parametrize("kind", ["cuda", "mps", "xpu"])
def test_absent_or_out_of_range_devices_are_refused(devices, kind):
    count = {"cuda": torch.cuda.device_count() if ACCELERATORS["cuda"] else 0,
             "xpu": torch.xpu.device_count() if ACCELERATORS["xpu"] else 0,
             "mps": 1 if ACCELERATORS["mps"] else 0}[kind]
    if count == 0:
        refused(devices.pick_device, kind, f"no {kind} device", f"a kind with no device present is refused, "
                                                                  f"its message saying 'no {kind} device'")
        for ask in (devices.memory_info, devices.default_dtype):     # torch's own answer is an AssertionError
            with pytest.raises(ValueError, match=kind):
                ask(kind)
    else:
        assert devices.pick_device(f"{kind}:0") == torch.device(kind, 0)
    if kind != "mps":
        with pytest.raises(ValueError, match=kind):
            devices.pick_device(f"{kind}:{count}")
        with pytest.raises(ValueError, match=f"{kind}:{count}"):
            devices.memory_info(f"{kind}:{count}")


def test_device_questions_refuse_what_torch_does_not_know(devices):
    for ask in (devices.memory_info, devices.default_dtype):
        with pytest.raises(ValueError, match="'gpu'"):
            ask("gpu")


def test_cpu_memory_dtype_and_host_buffers(devices):
    info = devices.memory_info("cpu")
    if hasattr(os, "sysconf"):                            # POSIX: the operating system's own count
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        assert info.total_bytes == pytest.approx(physical, rel=0.01), "CPU total memory must be the machine's RAM"
    assert 0 < info.free_bytes <= info.total_bytes
    assert devices.default_dtype("cpu") == torch.float32, "a CPU computes in float32 by default"
    host = torch.arange(6.0)
    assert devices.pinned(host, "cpu") is host, "a CPU-only engine has nothing to pin"
    devices.synchronize("cpu")                            # nothing queued: returns at once


@needs_cuda
def test_cuda_answers_match_torch(devices):
    info = devices.memory_info("cuda:0")
    assert info.total_bytes == pytest.approx(torch.cuda.get_device_properties(0).total_memory, rel=0.01)
    assert 0 < info.free_bytes <= info.total_bytes
    native = torch.cuda.is_bf16_supported(including_emulation=False)
    assert (devices.default_dtype("cuda:0") == torch.bfloat16) == native, "bfloat16 only where the GPU computes it"
    assert devices.pinned(torch.zeros(4), "cuda").is_pinned(), "CUDA swap buffers must be page-locked"


# --- part two: the plan -------------------------------------------------------------------

def best_split(sizes, free):
    """Exhaustive oracle: every contiguous split, the smallest fullest stage, then the most
    layers on stage 0, stage 1, ..."""
    layers, stages = len(sizes), len(free)
    best = None
    for cuts in itertools.combinations(range(1, layers), stages - 1):
        bounds = (0, *cuts, layers)
        plan = [s for s in range(stages) for _ in range(bounds[s], bounds[s + 1])]
        peak = max(Fraction(sum(sizes[bounds[s]:bounds[s + 1]]), free[s]) for s in range(stages))
        key = (peak, [-plan.count(s) for s in range(stages)])
        if best is None or key < best[0]:
            best = (key, plan)
    return best[0][0], best[1]


PLAN_RULE = ("of the contiguous plans, one whose fullest stage (its bytes / its budget, compared exactly) is as "
             "empty as possible; ties give stage 0 the most layers, then stage 1, ...; it fits when that stage is "
             "at most full")


def test_plan_layers_fixed_cases(devices):
    for sizes, free, want in (([10] * 4, [100, 100], [0, 0, 1, 1]), ([10] * 4, [300, 100], [0, 0, 0, 1]),
                              ([10] * 3, [100, 100], [0, 0, 1]), ([10] * 4, [20, 20], [0, 0, 1, 1]),
                              ([1, 3, 1, 1], [4, 4], [0, 0, 1, 1])):
        try:
            got = devices.plan_layers(sizes, free)
        except ValueError as error:
            pytest.fail(f"plan_layers({sizes}, {free}) raised {error}; {want} fits: {PLAN_RULE}")
        assert got == want, f"plan_layers({sizes}, {free}): {got}, expected {want}: {PLAN_RULE}"


def test_plan_layers_matches_exhaustive_search(devices):
    rule = PLAN_RULE
    rng = random.Random(40)
    for _ in range(400):
        layers = rng.randint(1, 7)
        stages = rng.randint(1, layers)
        sizes = [rng.randint(0, 5) for _ in range(layers)]
        free = [rng.randint(1, 12) for _ in range(stages)]
        peak, want = best_split(sizes, free)
        try:
            got = devices.plan_layers(sizes, free)
        except ValueError as error:
            assert peak > 1, (f"plan_layers({sizes}, {free}) raised {error}, but {want} fits (its fullest stage is "
                              f"{peak} full): {rule}")
            assert "do not fit" in str(error), f"plan_layers({sizes}, {free}) must say the layers 'do not fit': {error}"
            continue
        assert peak <= 1, f"plan_layers({sizes}, {free}) returned {got}, yet no plan fits: it must say 'do not fit'"
        assert got == want, f"plan_layers({sizes}, {free}): {got}, expected {want}: {rule}"


@pytest.mark.parametrize("sizes, free, rule", [([], [1], "layers and stages"), ([1], [], "layers and stages"),
                                               ([1, 1], [5, 5, 5], "no layer"), ([1, -1], [5], ">= 0"),
                                               ([1, 1], [5, 0], "> 0")])
def test_plan_layers_refuses_bad_input(devices, sizes, free, rule):
    try:
        got = devices.plan_layers(sizes, free)
    except ValueError as error:
        assert rule in str(error), f"plan_layers({sizes}, {free}) must be refused naming the rule {rule!r}: {error}"
        return
    pytest.fail(f"plan_layers({sizes}, {free}) must be refused naming the rule {rule!r}; it returned {got}")


# --- part two: the placed model in the engine ---------------------------------------------

def params(serve, max_tokens):
    return serve.request.SamplingParams(max_tokens=max_tokens)


def serve_placed(impl, serve, devices, stage_devices, layers, **config):
    placed = devices.PlacedFlatModel(tiny_qwen3(impl.package, num_hidden_layers=layers), stage_devices)
    engine = make_engine(serve, placed, **{"block_size": 4, "num_blocks": 64, **config})
    results = engine.generate(PROMPTS, [params(serve, 10 + i) for i in range(len(PROMPTS))])
    return placed, engine, [r.output_token_ids for r in results]


def check_placed_run(impl, serve, devices, stage_devices, layers, **config):
    placed, engine, outputs = serve_placed(impl, serve, devices, stage_devices, layers, **config)
    ref = reference_tiny_qwen3(num_hidden_layers=layers)
    for i, (prompt, got) in enumerate(zip(PROMPTS, outputs)):
        want = solo(ref, prompt, 10 + i, eos_token_id=TINY_EOS)
        assert got == want, f"request {i} on stages {stage_devices}: expected {want}, got {got}"
    for index, layer_pool in enumerate(engine.runner.kv_caches):
        where = placed.layer_device(index)
        assert all(t.device.type == where.type for t in layer_pool), \
            f"layer {index}'s KV pool is on {layer_pool[0].device}, its layer on {where}"
    stages = len(stage_devices)
    assert placed.transfers == engine.steps * (stages - 1), \
        f"{engine.steps} steps over {stages} stages should hand the stream over {engine.steps * (stages - 1)} times, " \
        f"counted {placed.transfers}"
    assert placed.returns == engine.steps, "each step brings its sampled rows home once"
    hidden = placed.cfg.hidden_size * 4                      # float32 bytes of one row
    assert placed.transfer_bytes % hidden == 0 and placed.return_bytes % hidden == 0
    assert_engine_idle(engine, f"after serving on {stage_devices}")
    return placed, engine


@pytest.mark.parametrize("stage_devices, layers", [(["cpu", "cpu"], 4), (["cpu", "cpu", "cpu"], 5)])
def test_layers_on_several_stages_match_solo_generate(impl, serve, devices, stage_devices, layers):
    placed, _ = check_placed_run(impl, serve, devices, stage_devices, layers)
    per_stage = [placed.stage_of_layer.count(s) for s in range(len(stage_devices))]
    assert per_stage == {4: [2, 2], 5: [2, 2, 1]}[layers], "equal devices share the layers evenly"


def test_placed_model_survives_preemption_and_swap(impl, serve, devices):
    _, engine = check_placed_run(impl, serve, devices, ["cpu", "cpu"], 4, num_blocks=12,
                                 preemption_mode="swap")
    assert engine.preemptions > 0, "a 12-block pool should preempt on this workload"


def test_hand_over_counts_same_device_transfers(impl, devices):
    placed = devices.PlacedFlatModel(tiny_qwen3(impl.package, num_hidden_layers=2), ["cpu", "cpu"])
    stream = torch.randn(3, placed.cfg.hidden_size)
    moved = placed.hand_over(stream, 1)
    assert torch.equal(moved, stream) and moved.device == torch.device("cpu")
    assert (placed.transfers, placed.transfer_bytes) == (1, 3 * placed.cfg.hidden_size * 4), \
        (f"hand_over counts every transfer, even between stages on the same device, and its bytes (N * D * element "
         f"size): expected (1, {3 * placed.cfg.hidden_size * 4}), got ({placed.transfers}, {placed.transfer_bytes})")
    half = placed.hand_over(stream.to(torch.bfloat16), 1)
    assert half.dtype == torch.bfloat16 and placed.transfer_bytes == 3 * placed.cfg.hidden_size * 6, \
        (f"a bfloat16 stream carries 2 bytes per value: the bytes are N * D * element size, whatever the dtype "
         f"(got {placed.transfer_bytes} after a float32 and a bfloat16 hand-over of 3 rows)")


def test_placed_pool_is_what_fits_on_every_device(impl, serve, devices, monkeypatch):
    """EngineConfig.num_blocks None: every layer's pool holds all the blocks, on its own
    device, so the count is the smallest any device can hold for the layers it has. The
    GPUs' memory answers are faked (only the arithmetic runs: no tensor moves there)."""
    placed = devices.PlacedFlatModel(tiny_qwen3(impl.package, num_hidden_layers=4), ["cpu", "cpu"], [0, 0, 0, 1])
    block, mib = 1024, 1 << 20
    unplaced_rule = 4 * mib // (4 * block)                    # an all-CPU pool: kv_cache_bytes over every layer
    assert placed.pool_blocks(block, 4 * mib, 0.9) == unplaced_rule, \
        "stages that are all CPUs must size the pool as one CPU does, from kv_cache_bytes"
    answers = {"cuda:0": (300 * mib, 1000 * mib), "cuda:1": (150 * mib, 500 * mib)}     # (free, total)
    monkeypatch.setattr(devices, "memory_info",
                        lambda device: devices.MemoryInfo(*answers[str(torch.device(device))], "faked"))
    placed.stage_devices = [torch.device("cuda:0"), torch.device("cuda:1")]
    # cuda:0 gives 300 - 10% of 1000 = 200 MiB to 3 layers, cuda:1 150 - 50 = 100 MiB to 1
    assert placed.pool_blocks(block, 4 * mib, 0.9) == min(200 * mib // (3 * block), 100 * mib // block), \
        "the pool must fit on the device with the least room per layer (a GPU keeps 1 - utilization of its total)"
    placed.stage_devices = [torch.device("cuda:0"), torch.device("cpu")]
    assert placed.pool_blocks(block, 4 * mib, 0.9) == (4 * mib // 4) // block, \
        "a CPU stage gets its layers' share of kv_cache_bytes, here the tighter limit"
    placed.stage_devices = [torch.device("cpu"), torch.device("cpu")]
    engine = make_engine(serve, placed, block_size=4, kv_cache_bytes=4 * mib)
    assert engine.blocks.num_blocks == 4 * mib // (4 * 2 * 4 * 2 * 16 * 4), \
        "a self-sized engine on CPU stages: kv_cache_bytes over 4 layers x K and V x 4 slots x 2 heads x 16 dims"


@needs_cuda
@pytest.mark.parametrize("config", [{}, {"num_blocks": 12, "preemption_mode": "swap"}, {"num_blocks": None}],
                         ids=["ample", "swapping", "self-sized"])
def test_layers_on_cuda_and_cpu_match_solo_generate(impl, serve, devices, config):
    placed, engine = check_placed_run(impl, serve, devices, ["cuda:0", "cpu"], 4, **config)
    assert engine.runner.kv_caches[0][0].device.type == "cuda" and engine.runner.kv_caches[-1][0].device.type == "cpu"
