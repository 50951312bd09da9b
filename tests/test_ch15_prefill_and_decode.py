"""Chapter 15 milestone: FLOPs and bytes of prefill and decode, counted on a real forward.

Oracles: torch's FlopCounterMode (FLOPs of the very same forward pass), bytes worked out by
hand for single operations, and Chapter 2's cost model from the reference package
(cost.step_cost), which the counts must confirm: a decode step moves about one byte per
FLOP in 16-bit weights, and a prefill's intensity grows with its length.
"""
from types import SimpleNamespace

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from course.models import tiny_config_values, tiny_qwen3
from course.testing.oracles import reference_call

pytestmark = pytest.mark.chapter(15)

aten = torch.ops.aten
# Wider than the tiny test model, so that weights outweigh activations as they do in a
# real Qwen3 (hidden 1024 and up); still a few MB.
WIDE = dict(hidden_size=256, intermediate_size=768, head_dim=64)


def wide_model(impl, dtype, device):
    return tiny_qwen3(impl.package, device=device, dtype=dtype, **WIDE)


def torch_flops(model, ids):
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(ids)
    return counter.get_total_flops()


def test_matmul_flops_per_op(impl):
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(5, 7, generator=g), torch.randn(7, 3, generator=g)
    bias = torch.randn(3, generator=g)
    ba, bb = torch.randn(4, 5, 7, generator=g), torch.randn(4, 7, 3, generator=g)
    bbias = torch.randn(4, 5, 3, generator=g)
    cases = [("mm", aten.mm.default, (a, b)), ("addmm", aten.addmm.default, (bias, a, b)),
             ("bmm", aten.bmm.default, (ba, bb)), ("baddbmm", aten.baddbmm.default, (bbias, ba, bb))]
    for name, func, args in cases:
        with FlopCounterMode(display=False) as counter:
            func(*args)
        expected = counter.get_total_flops()
        got = impl.roofline.matmul_flops(func, args)
        assert got == expected, (
            f"{name} on shapes {[tuple(t.shape) for t in args]}: expected {expected} FLOPs, got {got} (2 FLOPs, a "
            "multiply and an add, per multiply-accumulate of the product)")
    for name, func, args in [("add", aten.add.Tensor, (a, a)), ("softmax", aten._softmax.default, (a, -1, False))]:
        got = impl.roofline.matmul_flops(func, args)
        assert got == 0, f"{name} is not a matrix product; matmul_flops gave {got}"


@pytest.mark.parametrize("batch,length", [(1, 1), (1, 5), (1, 33), (2, 9)])
def test_counted_flops_equal_torch_count(impl, device, batch, length):
    model = tiny_qwen3(impl.package, device=device)
    ids = torch.arange(batch * length, device=device).remainder(250).view(batch, length)
    expected = torch_flops(model, ids)
    cost, _ = impl.roofline.count_step(model, ids)
    assert cost.flops == expected, (f"batch {batch} x {length} tokens: torch counts {expected:,} FLOPs "
                                    f"in the forward pass, count_step gave {cost.flops:,}")


def test_op_bytes_by_hand(impl):
    f32 = 4
    a, b = torch.randn(64, 32), torch.randn(64, 32)
    out = a + b
    cases = [
        ("add [64, 32] + [64, 32]", aten.add.Tensor, [a, b], [out], 3 * 64 * 32 * f32),
        ("view (moves nothing)", aten.view.default, [a], [a.view(32, 64)], 0),
        ("transpose (moves nothing)", aten.transpose.int, [a], [a.t()], 0),
        ("add of a stride-0 broadcast row", aten.add.Tensor, [a, b[:1].expand(64, 32)], [out],
         (64 * 32 + 32 + 64 * 32) * f32),
    ]
    table, ids = torch.randn(320, 16), torch.tensor([3, 1, 4, 1, 5])
    cases.append(("embedding of 5 rows from a 320-row table", aten.embedding.default, [table, ids],
                  [table[ids]], 2 * 5 * 16 * f32 + 5 * 8))
    cache, new = torch.zeros(2, 100, 16), torch.randn(2, 3, 16)
    dst = cache[:, 10:13]
    cases.append(("copy_ of 3 new rows into a cache slice", aten.copy_.default, [dst, new], [dst],
                  2 * 2 * 3 * 16 * f32))
    for name, func, inputs, outputs, expected in cases:
        got = impl.roofline.op_bytes(func, inputs, outputs)
        assert got == expected, f"{name}: expected {expected} bytes, op_bytes gave {got}"


@pytest.fixture(scope="module")
def wide_counts(impl, device):
    """{(dtype, T): (measured StepCost, Chapter 2's StepCost)} for prefill lengths T."""
    counts = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = wide_model(impl, dtype, device)
        for length in (1, 2, 4, 8, 16):
            measured, _ = impl.roofline.count_step(model, torch.arange(length, device=device)[None])
            counts[dtype, length] = measured, reference_call("cost.step_cost", model.cfg, length, 0, dtype=dtype)
    return counts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_decode_moves_about_a_byte_per_flop(wide_counts, dtype):
    measured, model = wide_counts[dtype, 1]
    assert measured.flops == pytest.approx(model.flops, rel=0.002), (
        f"one token: Chapter 2 predicts {model.flops:,} FLOPs, the forward did {measured.flops:,}")
    ratio = measured.bytes / model.bytes
    assert 1.0 <= ratio <= 1.15, (
        f"one token in {dtype}: Chapter 2 predicts {model.bytes:,} bytes (weights read once), the forward "
        f"moved {measured.bytes:,} ({ratio:.2f}x); expected the weights plus a few percent of activations")
    per_flop = 0.5 if dtype == torch.float32 else 1.0
    assert measured.intensity == pytest.approx(per_flop, rel=0.1), (
        f"decode in {dtype} should do about {per_flop} FLOP per byte (2 FLOPs per weight, "
        f"{4 if dtype == torch.float32 else 2} bytes per weight); measured {measured.intensity:.3f}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_prefill_intensity_grows_with_length(wide_counts, dtype):
    lengths = (1, 2, 4, 8, 16)
    measured = [wide_counts[dtype, n][0].intensity for n in lengths]
    predicted = [wide_counts[dtype, n][1].intensity for n in lengths]
    shown = ", ".join(f"T={n}: {m:.2f} (model {p:.2f})" for n, m, p in zip(lengths, measured, predicted))
    assert all(x < y for x, y in zip(measured, measured[1:])), f"intensity must grow with T: {shown}"
    assert measured[-1] > 4 * measured[0], f"16 tokens share one read of the weights: {shown}"
    for m, p in zip(measured, predicted):
        assert m <= p * 1.01, f"activations only add bytes, so measured <= Chapter 2's model: {shown}"
    cfg = SimpleNamespace(**tiny_config_values(**WIDE))
    for n in lengths[1:]:
        got, model = wide_counts[dtype, n]
        overcount = 4 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * n * (n - 1) // 2
        assert got.flops == model.flops + overcount, (
            f"T={n}: the forward's FLOPs should be Chapter 2's {model.flops:,} plus the {overcount:,} spent on "
            f"masked-out scores (causal_attention computes every query-key product); got {got.flops:,}")
