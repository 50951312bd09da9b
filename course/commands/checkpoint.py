"""Chapter 11: write the tiny model as a Hugging Face checkpoint directory, or inspect and load one.

`python run.py checkpoint PATH --write [--shard-bytes N]` saves the tiny test model there
(config.json and safetensors, sharded with an index when --shard-bytes is given).
`python run.py checkpoint PATH` lists the directory's shards (tensors and bytes per file),
loads it with the implementation's load_checkpoint and prints one JSON line with the
config, the parameter count, the load time and a greedy continuation of a short prompt.
"""
import json
import time

from course.cli import CommandError, add_device_argument, add_impl_argument


def add_arguments(parser):
    add_impl_argument(parser)
    add_device_argument(parser)
    parser.add_argument("path", help="a checkpoint directory")
    parser.add_argument("--write", action="store_true", help="write the tiny test model to PATH first")
    parser.add_argument("--shard-bytes", type=int, default=None, help="with --write: largest shard in bytes")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                        help="cast the parameters while loading (default: the checkpoint's dtype)")


def run(args):
    import torch

    from course.cli import resolve_device
    from course.impl import load, reference
    from course.models import tiny_qwen3

    impl = load(args.impl)
    device = resolve_device(args.device)
    if args.write:
        ref = reference()
        files = ref.checkpoint.save_checkpoint(tiny_qwen3(ref.package), args.path, args.shard_bytes)
        print(json.dumps({"wrote": args.path, "files": files}))
    try:
        rows = reference().checkpoint.inventory(args.path)
        shards: dict[str, dict[str, int]] = {}
        for row in rows:
            entry = shards.setdefault(row["file"], {"tensors": 0, "bytes": 0})
            entry["tensors"] += 1
            entry["bytes"] += row["nbytes"]
        start = time.perf_counter()
        model = impl.checkpoint.load_checkpoint(args.path, dtype=getattr(torch, args.dtype) if args.dtype else None,
                                                device=device)
        seconds = time.perf_counter() - start
    except impl.checkpoint.CheckpointError as exc:
        raise CommandError(str(exc)) from None
    prompt = [72, 101, 108, 108, 111]
    tokens = impl.sampling.generate(model, prompt, 8, use_cache=False)
    print(json.dumps({"path": args.path, "shards": shards, "load_seconds": round(seconds, 3),
                      "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
                      "parameters": sum(p.numel() for p in model.parameters()),
                      "tied": model.cfg.tie_word_embeddings, "layers": model.cfg.num_hidden_layers,
                      "prompt": prompt, "greedy": tokens}))
