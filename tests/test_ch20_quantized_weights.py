"""Chapter 20 milestone: int8 weight-only linear layers.

Oracles: float64 formulas for per-channel symmetric quantization and its rounding bound
(every weight within half a step, scale / 2, of its original; every output of a layer
within sum_i |x_i| * scale / 2 of the float layer's), and the reference tiny model in
float32 for the whole model: logits within the bounds measured in the chapter's notebook
(over these prompts: max |error| ~0.57 with logits of standard deviation ~8, mean |error|
~0.075, argmax agreement 96-99%), asserted here with about 2x headroom. Everything is
deterministic: quantization is a pure function of the weights, and the prompts are seeded.
"""
import copy
import random

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.chapter(20)


def test_quantize_per_channel(impl):
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(12, 40, generator=gen) * torch.logspace(-3, 1, 12)[:, None]   # rows of very different size
    weight[5] = 0.0                                                                  # an all-zero row
    q, scale = impl.quant.quantize_per_channel(weight)
    assert q.dtype == torch.int8 and q.shape == weight.shape, f"q must be int8 {tuple(weight.shape)}"
    assert scale.dtype == torch.float32 and scale.shape == (12,), "one float32 scale per output row"
    w64 = weight.double()
    expected_scale = w64.abs().amax(dim=1) / 127
    nonzero = expected_scale > 0
    assert torch.allclose(scale.double()[nonzero], expected_scale[nonzero], rtol=1e-6), \
        "scale must be max |row| / 127 for every row (per output channel, symmetric)"
    assert torch.isfinite(scale).all() and scale[5] > 0 and (q[5] == 0).all(), \
        "an all-zero row needs a tiny positive scale and all-zero q, not a division by zero"
    assert int(q.min()) >= -127 and int(q.max()) <= 127, "q must stay in [-127, 127]"
    err = (q.double() * scale.double()[:, None] - w64).abs()
    assert (err <= scale.double()[:, None] / 2 * (1 + 1e-5)).all(), \
        f"rounding error must be at most scale / 2; worst ratio {float((err / scale.double()[:, None]).max()):.3f}"
    assert (q.abs().amax(dim=1)[nonzero] == 127).all(), "the largest weight of each row must map to +-127"
    q16, scale16 = impl.quant.quantize_per_channel(weight.to(torch.bfloat16))
    assert q16.dtype == torch.int8 and scale16.dtype == torch.float32, "a bfloat16 weight still gives int8 + float32"


def test_int8_linear_within_rounding_bound(impl, device):
    torch.manual_seed(0)
    linear = nn.Linear(48, 20, bias=True).to(device)
    layer = impl.quant.Int8Linear.from_linear(linear)
    x = torch.randn(3, 5, 48, device=device)
    with torch.no_grad():
        got = layer(x)
        exact = x.double() @ linear.weight.double().T + linear.bias.double()
    assert got.shape == (3, 5, 20) and got.dtype == x.dtype
    q, scale = layer.qweight.double(), layer.scale.double()
    dequantized = x.double() @ (q * scale[:, None]).T + linear.bias.double()
    assert torch.allclose(got.double(), dequantized, atol=1e-4), "forward must be x @ (qweight * scale)^T + bias"
    bound = x.double().abs().sum(dim=-1, keepdim=True) * scale / 2
    assert ((got.double() - exact).abs() <= bound + 1e-4).all(), "a layer's output must stay within sum|x| * scale / 2"
    try:
        half = layer(x.to(torch.bfloat16)) if device.type == "cpu" else layer(x.half())
    except RuntimeError as error:
        pytest.fail(f"a half-precision input failed ({error}): the output keeps the input's dtype, so the "
                    "dequantized weight and the bias are used in that dtype")
    assert half.dtype in (torch.bfloat16, torch.float16), "the output keeps the input's dtype"


def test_int8_linear_forward_leaves_the_module_unchanged(impl, device):
    torch.manual_seed(1)
    layer = impl.quant.Int8Linear.from_linear(nn.Linear(32, 8, bias=True).to(device))
    before = {name: tensor.clone() for name, tensor in layer.state_dict().items()}
    x = torch.randn(4, 32, device=device)
    with torch.no_grad():
        first = layer(x)
        layer(x.to(torch.bfloat16 if device.type == "cpu" else torch.float16))
        again = layer(x)
    for name, tensor in layer.state_dict().items():
        assert tensor.dtype == before[name].dtype and torch.equal(tensor, before[name]), \
            f"forward changed the layer's {name} (dtype {before[name].dtype} -> {tensor.dtype}): " \
            "cast a copy, not the module"
    assert torch.equal(first, again), "a float32 call after a half-precision one must give the same output"


def test_quantize_model_swaps_every_linear(impl, tiny_model):
    floats = sum(isinstance(m, nn.Linear) for m in tiny_model.modules())
    float_bytes = sum(p.numel() * p.element_size() for m in tiny_model.modules() if isinstance(m, nn.Linear)
                      for p in m.parameters())
    model = impl.quant.quantize_model(tiny_model)
    assert model is tiny_model, "quantize_model works in place and returns the model"
    assert not any(isinstance(m, nn.Linear) for m in model.modules()), "an nn.Linear was left unquantized"
    assert sum(isinstance(m, impl.quant.Int8Linear) for m in model.modules()) == floats
    keys = set(model.state_dict())
    assert {"model.layers.0.mlp.up_proj.qweight", "model.layers.1.self_attn.o_proj.scale",
            "lm_head.qweight"} <= keys, "quantized layers must keep their places (and state_dict names)"
    assert isinstance(model.model.embed_tokens, nn.Embedding), "the embedding table stays float"
    int8_bytes = sum(b.numel() * b.element_size() for m in model.modules() if isinstance(m, impl.quant.Int8Linear)
                     for b in m.buffers())
    assert int8_bytes < 0.3 * float_bytes, f"int8 weights should take ~1/4 of float32: {int8_bytes} vs {float_bytes}"


def test_quantize_model_skip(impl, tiny_model):
    model = impl.quant.quantize_model(tiny_model, skip=("lm_head", "model.layers.1.mlp.down_proj"))
    assert isinstance(model.lm_head, nn.Linear) and isinstance(model.model.layers[1].mlp.down_proj, nn.Linear), (
        "a layer named in skip stays an nn.Linear")
    assert isinstance(model.model.layers[1].mlp.up_proj, impl.quant.Int8Linear)


def test_model_within_measured_bound(impl, tiny_model, ref_model, device):
    model = impl.quant.quantize_model(copy.deepcopy(tiny_model))
    # Every quantized layer, on the activations it really sees, stays within its rounding
    # bound of the float layer (the reference model's weights at the same name).
    violations = []

    def checker(name):
        weight = ref_model.get_submodule(name).weight.double()

        def check(module, args, output):
            x = args[0].double()
            exact = x @ weight.T
            bound = x.abs().sum(dim=-1, keepdim=True) * module.scale.double() / 2
            excess = float(((output.double() - exact).abs() - bound).max())
            if excess > 1e-3:
                violations.append(f"{name} exceeds sum|x| * scale / 2 by {excess:.2e}")
        return check

    handles = [m.register_forward_hook(checker(name)) for name, m in model.named_modules()
               if isinstance(m, impl.quant.Int8Linear)]
    assert len(handles) == 15, f"expected 15 quantized layers in the tiny model, found {len(handles)}"
    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(1, 40))] for _ in range(8)]
    errors, agree, total = [], 0, 0
    try:
        with torch.inference_mode():
            for prompt in prompts:
                ids = torch.tensor([prompt], device=device)
                expected, got = ref_model(ids)[0], model(ids)[0]
                errors.append((got.float() - expected).abs().flatten())
                agree += int((got.argmax(-1) == expected.argmax(-1)).sum())
                total += len(prompt)
    finally:
        for handle in handles:
            handle.remove()
    assert not violations, "; ".join(violations[:3])
    err = torch.cat(errors)
    assert err.max() < 1.2, f"max |logit error| {err.max():.3f} exceeds the measured bound (~0.57, asserted < 1.2)"
    assert err.mean() < 0.15, (
        f"mean |logit error| {err.mean():.4f} exceeds the measured bound (~0.075, asserted < 0.15)")
    assert agree / total >= 0.93, f"argmax agrees with the float model at only {agree}/{total} positions (measured 98%)"
