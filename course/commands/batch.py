"""Chapter 24: serve Chapter 22's shared-prefix workload with the continuous-batching engine.

Prints one JSON line: engine, kv_slots (cache positions reserved: slots x slot_len),
output_tokens, tok_s (output tokens per second of wall time), steps, forward_calls.
--check also compares every request's output with solo greedy generate of the reference.
"""
import json
import time

from course.cli import CommandError, add_device_argument, add_impl_argument, add_model_argument, resolve_device


def add_arguments(parser):
    add_impl_argument(parser)
    add_device_argument(parser)
    add_model_argument(parser)
    parser.add_argument("--requests", type=int, default=16, help="number of requests (default 16)")
    parser.add_argument("--slots", type=int, default=8, help="cache slots (default 8)")
    parser.add_argument("--slot-len", type=int, default=320, help="tokens per slot (default 320)")
    parser.add_argument("--chunk", type=int, default=None, help="prefill chunk size (default: whole prompt)")
    parser.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    parser.add_argument("--check", action="store_true", help="compare outputs with solo generate")


def load_model(impl, device, model_path=None):
    """The tiny test model of `impl`, or a real checkpoint when --model is given."""
    from course.models import tiny_qwen3
    if model_path is None:
        return tiny_qwen3(impl.package, device=device)
    try:
        checkpoint = impl.load("checkpoint")
    except ModuleNotFoundError as exc:
        raise CommandError(f"--model needs {impl.name}.checkpoint (Chapter 11): {exc}") from exc
    import torch
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return checkpoint.load_checkpoint(model_path, dtype=dtype, device=device).eval()


def run(args):
    from course.impl import load
    impl = load(args.impl)
    device = resolve_device(args.device)
    continuous = impl.load("continuous")
    workloads = impl.load("workloads")
    model = load_model(impl, device, args.model)
    items = workloads.shared_prefix_workload(num_requests=args.requests, seed=args.seed)

    def engine():
        return continuous.ContinuousBatchingEngine(model, num_slots=args.slots, slot_len=args.slot_len,
                                                   chunk_size=args.chunk)

    engine().run(items[:2])                 # warm-up: first calls pay one-off allocation costs
    if device.type == "cuda":
        import torch
        torch.cuda.synchronize()
    served = engine()
    start = time.perf_counter()
    outputs = served.run(items)
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    tokens = sum(len(v) for v in outputs.values())
    line = {"engine": "ch24 slots", "kv_slots": args.slots * args.slot_len, "output_tokens": tokens,
            "tok_s": round(tokens / elapsed, 1), "steps": served.steps, "forward_calls": served.forward_calls}
    if args.check:
        from course import reference
        generate = reference().sampling.generate
        eos = getattr(model.cfg, "eos_token_id", None)
        wrong = [it.request_id for it in items
                 if generate(model, it.prompt_ids, it.max_tokens, eos_token_id=eos) != outputs[it.request_id]]
        line["matches_generate"] = not wrong
        if wrong:
            print(json.dumps(line))
            raise CommandError(f"outputs differ from solo generate for {', '.join(wrong)}")
    print(json.dumps(line))
    return 0
