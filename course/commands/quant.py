"""Chapter 20: int8 weight-only quantization against the float model.

Quantizes the model's linear layers (Chapter 20's quantize_model) and prints JSON lines:
the bytes of the linear weights before and after; over --prompts seeded prompts, the
largest and mean absolute logit error against the float model, the standard deviation of
the float logits (for scale) and the share of positions whose argmax agrees; how many of
--tokens greedy tokens per prompt match the float model's before the first difference;
and the median decode-step time of both models (Chapter 18's timer). On a CPU the int8
model is not faster: this reference dequantizes each weight on every call, which saves
memory, not time.
"""
import copy
import json
import random
import statistics

from course.cli import CommandError, add_device_argument, add_impl_argument, add_model_argument, add_threads_argument
from course.commands._setup import load_model, prepare


def add_arguments(parser):
    add_impl_argument(parser)
    add_device_argument(parser)
    add_model_argument(parser)
    parser.add_argument("--prompts", type=int, default=8, help="seeded prompts to compare on (default 8)")
    parser.add_argument("--tokens", type=int, default=16, help="greedy tokens per prompt (default 16)")
    parser.add_argument("--skip", nargs="*", default=[], help="module names to keep in float, e.g. lm_head")
    parser.add_argument("--seed", type=int, default=0, help="prompt seed (default 0)")
    add_threads_argument(parser)


def run(args):
    import torch

    impl, device = prepare(args)
    if args.prompts < 1 or args.tokens < 1:
        raise CommandError("--prompts and --tokens must be at least 1")
    model = load_model(impl, device, args.model)
    quant = impl.load("quant")
    qmodel = quant.quantize_model(copy.deepcopy(model), skip=tuple(args.skip))
    print(json.dumps({"linear_bytes_float": quant.linear_weight_bytes(model),
                      "linear_bytes_int8": quant.linear_weight_bytes(qmodel),
                      "ratio": round(quant.linear_weight_bytes(qmodel) / quant.linear_weight_bytes(model), 3)}))
    rng = random.Random(args.seed)
    vocab = min(model.cfg.vocab_size, 256)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(4, 40))] for _ in range(args.prompts)]
    errors, scales, agree, total = [], [], 0, 0
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt], device=device)
            exact, approx = model(ids)[0].float(), qmodel(ids)[0].float()
            errors.append((approx - exact).abs().flatten())
            scales.append(exact.flatten())
            agree += int((approx.argmax(-1) == exact.argmax(-1)).sum())
            total += len(prompt)
    err = torch.cat(errors)
    print(json.dumps({"prompts": len(prompts), "positions": total, "max_abs_logit_error": round(float(err.max()), 4),
                      "mean_abs_logit_error": round(float(err.mean()), 4),
                      "float_logit_std": round(float(torch.cat(scales).std()), 3),
                      "argmax_agreement": round(agree / total, 4)}))
    generate = impl.load("sampling").generate
    same_prefix = []
    for prompt in prompts:
        a, b = generate(model, prompt, args.tokens), generate(qmodel, prompt, args.tokens)
        same_prefix.append(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))))
    print(json.dumps({"greedy_tokens": args.tokens, "identical_prefix_median": statistics.median(same_prefix),
                      "fully_identical": sum(n == args.tokens for n in same_prefix)}))
    timing = impl.load("decode_timing")
    print(json.dumps({"step_ms_float": round(timing.decode_step_seconds(model, 1, 64) * 1e3, 3),
                      "step_ms_int8": round(timing.decode_step_seconds(qmodel, 1, 64) * 1e3, 3)}))
    return 0
