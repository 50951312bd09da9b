"""Chapters 1-2: parameters, FLOPs, weight and KV bytes of a Qwen3 config; prefill vs decode on a roofline.

--config names a published Qwen3 size (Qwen3-0.6B ... Qwen3-32B) or "tiny" (the test model);
--model PATH reads a checkpoint directory's config.json instead. Prints JSON lines: first
the model (parameters, non-embedding parameters, weight bytes, KV bytes per token, FLOPs
per token at the given context), then one line per step kind (a prefill of --prompt tokens,
a decode step at batch 1 and at --batch) with FLOPs, bytes moved, arithmetic intensity,
the roofline time on --gpu and whether the step is compute- or memory-bound. Everything is
computed from the config by the implementation's cost module; no model is built.
"""
import json
from pathlib import Path

from course.cli import CommandError, add_impl_argument

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "int8": "int8", "fp8": "float8_e4m3fn"}


def add_arguments(parser):
    add_impl_argument(parser)
    parser.add_argument("--config", default="Qwen3-8B",
                        help="a published size (Qwen3-0.6B, -1.7B, -4B, -8B, -14B, -32B) or 'tiny' (default Qwen3-8B)")
    parser.add_argument("--model", default=None, metavar="PATH", help="read config.json from this checkpoint directory")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="weight and KV dtype (default bf16)")
    parser.add_argument("--gpu", default="H100-SXM",
                        help="roofline hardware: A100-80GB, H100-SXM or H200 (default H100-SXM)")
    parser.add_argument("--prompt", type=int, default=2048, help="prefill length in tokens (default 2048)")
    parser.add_argument("--context", type=int, default=2048,
                        help="tokens already cached at a decode step (default 2048)")
    parser.add_argument("--batch", type=int, default=64, help="sequences decoding together (default 64)")


def _config(impl, args):
    if args.model:
        path = Path(args.model) / "config.json"
        if not path.is_file():
            raise CommandError(f"--model {args.model}: no config.json there")
        return path.parent.name, impl.qwen3.Qwen3Config.from_dict(json.loads(path.read_text()))
    if args.config == "tiny":
        from course.models import tiny_config
        return "tiny", tiny_config(impl.package)
    try:
        return args.config, impl.cost.qwen3_config(args.config)
    except KeyError as exc:
        raise CommandError(str(exc.args[0])) from None


def run(args):
    import torch

    from course.impl import load
    impl = load(args.impl)
    cost = impl.cost
    name, cfg = _config(impl, args)
    dtype = getattr(torch, DTYPES[args.dtype])
    if args.gpu not in cost.GPUS:
        raise CommandError(f"--gpu {args.gpu}: known GPUs are {', '.join(cost.GPUS)}")
    gpu = cost.GPUS[args.gpu]
    print(json.dumps({
        "model": name, "dtype": args.dtype,
        "parameters": cost.count_parameters(cfg),
        "non_embedding_parameters": cost.count_parameters(cfg, embeddings=False),
        "weight_bytes": cost.weight_bytes(cfg, dtype),
        "kv_bytes_per_token": cost.kv_bytes_per_token(cfg, dtype),
        "flops_per_token": cost.flops_per_token(cfg, args.context + 1),
        "context": args.context + 1,
    }))
    steps = [("prefill", args.prompt, 0, 1), ("decode", 1, args.context, 1),
             ("decode", 1, args.context, args.batch)]
    for kind, new, past, batch in steps:
        step = cost.step_cost(cfg, new, past, batch=batch, dtype=dtype)
        print(json.dumps({
            "step": kind, "batch": batch, "new_tokens": new, "past_tokens": past,
            "gflops": round(step.flops / 1e9, 3), "gbytes": round(step.bytes / 1e9, 3),
            "intensity": round(step.intensity, 2), "gpu": gpu.name, "ridge": round(gpu.ridge, 1),
            "time_ms": round(step.time(gpu) * 1e3, 4), "bound": step.bound(gpu),
            "tokens_per_s": round(batch * new / step.time(gpu)),
        }))
