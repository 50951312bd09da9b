"""Chapter 43: many LoRA adapters in one engine, with and without the per-step cap.

Loads --adapters random rank---rank adapters on all seven projections of the tiny model
(made in memory: what load_peft_adapter returns for a PEFT directory) and serves
--requests requests, each with one of the adapters in turn (every fifth with none),
three ways: the base model alone (the same prompts, no adapters: the price of the LoRA
path), all adapters in one batch (max_loras = --adapters), and one adapter at a time
(max_loras = 1: a request whose adapter differs from the running ones waits). Prints one
JSON line each: engine, max_loras, output_tokens, tok_s, steps, adapters_per_step (mean
distinct adapters among a step's requests); then a summary line. The two LoRA runs must
give every request the same tokens (the batch a row shares never changes its result):
any difference is an error (exit status 2). Timings are the best of --repeat runs.
"""
import json
import random
import time

from course.cli import CommandError, add_device_argument, add_impl_argument, add_threads_argument
from course.commands._setup import load_model, prepare


def add_arguments(parser):
    add_impl_argument(parser)
    add_device_argument(parser)
    parser.add_argument("--adapters", type=int, default=4, help="number of adapters (default 4)")
    parser.add_argument("--rank", type=int, default=8, help="rank of every adapter (default 8)")
    parser.add_argument("--requests", type=int, default=24, help="number of requests (default 24)")
    parser.add_argument("--max-tokens", type=int, default=16, help="output tokens per request (default 16)")
    parser.add_argument("--repeat", type=int, default=2, help="timed runs per engine; the best is kept (default 2)")
    add_threads_argument(parser)


def random_adapter(lora, model, name, rank, seed, targets=None):
    """An adapter of `lora` (a serve.lora module) with random A and B on `targets` (default:
    all seven projections) of every layer of `model`, scaling alpha / rank = 1."""
    import torch
    g = torch.Generator().manual_seed(seed)
    weights = {}
    for index, layer in enumerate(model.model.layers):
        for target in targets or lora.TARGETS:
            linear = getattr(getattr(layer, lora.TARGETS[target]), target)
            a = torch.randn(rank, linear.in_features, generator=g) * linear.in_features ** -0.5
            b = torch.randn(linear.out_features, rank, generator=g) * rank ** -0.5
            weights[(index, target)] = (a, b)
    return lora.LoraAdapter(name, rank, float(rank), weights)


def serve_all(impl, model, adapters, requests, max_tokens, max_loras):
    """Run every request to the end; returns (outputs by id, seconds, steps, adapters per step)."""
    serve_config, engine_module = impl.load("serve.config"), impl.load("serve.engine")
    request_module = impl.load("serve.request")
    engine = engine_module.EngineCore(model, serve_config.EngineConfig(block_size=16, num_blocks=512,
                                                                       max_loras=max_loras),
                                      adapters=adapters or None)
    params = request_module.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    for rid, prompt, name in requests:
        engine.add_request(rid, prompt, params, lora=name if adapters else None)
    outputs, per_step = {}, []
    while engine.has_unfinished:
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.output_token_ids
        slots = {r.lora_slot for r, _ in engine.last_plan.scheduled} - {0}
        per_step.append(len(slots))
    return outputs, time.perf_counter() - start, engine.steps, sum(per_step) / max(1, len(per_step))


def run(args):
    impl, device = prepare(args)
    if min(args.adapters, args.rank, args.requests, args.max_tokens, args.repeat) < 1:
        raise CommandError("--adapters, --rank, --requests, --max-tokens and --repeat must be at least 1")
    model = load_model(impl, device)
    lora = impl.load("serve.lora")
    adapters = [random_adapter(lora, model, f"adapter{i}", args.rank, seed=i) for i in range(args.adapters)]
    rng = random.Random(0)
    names = [None if i % 5 == 4 else adapters[i % args.adapters].name for i in range(args.requests)]
    requests = [(f"r{i}", [rng.randrange(256) for _ in range(rng.randrange(16, 49))], name)
                for i, name in enumerate(names)]
    serve_all(impl, model, adapters, requests[:2], 2, args.adapters)          # warm-up
    results = {}
    for engine, cap, used in (("base", args.adapters, []), ("lora-batched", args.adapters, adapters),
                              ("lora-one-at-a-time", 1, adapters)):
        runs = [serve_all(impl, model, used, requests, args.max_tokens, cap) for _ in range(args.repeat)]
        outputs, seconds, steps, per_step = min(runs, key=lambda r: r[1])
        tokens = sum(len(t) for t in outputs.values())
        results[engine] = outputs, seconds
        print(json.dumps({"engine": engine, "max_loras": cap if used else None, "output_tokens": tokens,
                          "tok_s": round(tokens / seconds, 1), "steps": steps,
                          "adapters_per_step": round(per_step, 2)}))
    same = results["lora-batched"][0] == results["lora-one-at-a-time"][0]
    print(json.dumps({"summary": True, "batched_vs_one_at_a_time": round(results["lora-one-at-a-time"][1]
                                                                          / results["lora-batched"][1], 2),
                      "lora_vs_base_time": round(results["lora-batched"][1] / results["base"][1], 2),
                      "same_tokens": same}))
    return 0 if same else 2
