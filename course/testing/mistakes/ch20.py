"""Chapter 20: int8 weights."""
from . import Mistake

MILESTONE = "tests/test_ch20_quantized_weights.py"
PER_CHANNEL = f"{MILESTONE}::test_quantize_per_channel"
LINEAR = f"{MILESTONE}::test_int8_linear_within_rounding_bound"
SWAP = f"{MILESTONE}::test_quantize_model_swaps_every_linear"

MISTAKES = [
    Mistake("quant.py", "quantize_per_channel",
            before="w.abs().amax(dim=1) / QMAX",
            after="w.abs().amax().expand(w.shape[0]) / QMAX",
            rule="one scale per output row, from that row's largest weight",
            expect="per output channel",
            tests=(PER_CHANNEL,)),
    Mistake("quant.py", "quantize_per_channel",
            before="torch.round(w / scale[:, None])",
            after="(w / scale[:, None])",
            rule="weights are rounded to the nearest code, not truncated by the cast",
            expect="rounding error must be at most scale / 2",
            tests=(PER_CHANNEL,)),
    Mistake("quant.py", "quantize_per_channel",
            before="torch.where(scale > 0, scale, torch.full_like(scale, torch.finfo(torch.float32).tiny))",
            after="scale",
            rule="an all-zero row gets a tiny positive scale, never a division by zero",
            expect="an all-zero row needs a tiny positive scale",
            tests=(PER_CHANNEL,)),
    Mistake("quant.py", "Int8Linear.forward",
            before="dequantize(self.qweight, self.scale, x.dtype), bias)",
            after="dequantize(self.qweight, self.scale, x.dtype), None)",
            rule="forward adds the bias",
            expect="forward must be x @ (qweight * scale)^T + bias",
            tests=(LINEAR,)),
    Mistake("quant.py", "Int8Linear.forward",
            before="dequantize(self.qweight, self.scale, x.dtype)",
            after="self.qweight.to(x.dtype)",
            rule="the weight is qweight times its row's scale",
            expect="forward must be x @ (qweight * scale)^T + bias",
            tests=(LINEAR,)),
    Mistake("quant.py", "Int8Linear.forward",
            before="self.bias.to(x.dtype)",
            after="self.bias",
            rule="the output keeps the input's dtype: the bias is used in that dtype too",
            expect="the output keeps the input's dtype",
            tests=(LINEAR,)),
    Mistake("quant.py", "quantize_model",
            before=" and name not in skip",
            after="",
            rule="a layer named in skip stays an nn.Linear",
            expect="named in skip",
            tests=(f"{MILESTONE}::test_quantize_model_skip",)),
    Mistake("quant.py", "quantize_model",
            before="model.named_modules()",
            after="model.named_children()",
            rule="every nn.Linear at any depth is replaced, not only the model's direct children",
            expect="left unquantized",
            tests=(SWAP,)),
    Mistake("quant.py", "quantize_model",
            before="setattr(parent, child, Int8Linear.from_linear(module))",
            after="setattr(model, child, Int8Linear.from_linear(module))",
            rule="each replacement takes the place of the layer in its own parent module",
            expect="left unquantized",
            tests=(SWAP,)),
]

DECIDES = {
    "quantize_per_channel": "along which axis the scales run and how to map each row onto 255 symmetric levels "
                            "without dividing by zero or letting a cast wrap values around",
    "Int8Linear.forward": "in which dtype and in which order to apply codes and scales so that one int8 layer serves "
                          "any activation dtype without overflowing",
    "quantize_model": "how to find every linear layer at any depth of a module tree you did not write and put its "
                      "replacement in the same place, so names, state_dict keys and the skip list keep their meaning",
}
DESIGN = ("quantize_model",)
