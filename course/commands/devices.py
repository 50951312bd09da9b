"""Chapter 40: the devices torch can see here, and the tiny model's layers placed on several.

Prints one JSON line per visible device (CUDA/ROCm devices by index, Apple's MPS, Intel's
XPU, the CPU): name, free and total memory as the device's runtime reports them, whether
it computes bfloat16, the dtype a real checkpoint loads in, whether swapped K/V gets
pinned host buffers, and torch's threads on the CPU.

Then the pipeline check: the tiny model (--layers decoder layers) served by the engine core
on one device, and again with its layers spread over --stages (default: the first
visible device, then cpu; "cpu,cpu" here, two stages on one device still hand the stream
over, so the plumbing is counted). One JSON line: the stages, the plan (layers per
stage), steps, stream transfers per step (stages - 1 per forward), rows brought home for
the LM head, bytes moved, and whether every request's greedy output is identical; a
difference is an error (exit status 2).
"""
import json

from course.cli import CommandError, add_impl_argument

PROMPTS = [[10, 20, 30, 40, 50], [7] * 19, [100, 3, 250, 4], list(range(60, 93))]


def add_arguments(parser):
    add_impl_argument(parser)
    parser.add_argument("--stages", default=None,
                        help="comma-separated devices of the pipeline stages (default: first visible device, cpu)")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers of the tiny model (default 4)")
    parser.add_argument("--max-tokens", type=int, default=12, help="tokens per request (default 12)")
    parser.add_argument("--no-pipeline", action="store_true", help="only list the devices")


def run(args):
    from course.impl import load
    from course.models import tiny_qwen3
    from course.testing.oracles import TINY_EOS
    impl = load(args.impl)
    devices = impl.load("devices")
    try:
        for device in devices.visible_devices():
            print(json.dumps(devices.describe(device)), flush=True)
        if args.no_pipeline:
            return 0
        names = args.stages.split(",") if args.stages else [str(devices.visible_devices()[0]), "cpu"]
        stage_devices = [devices.pick_device(name.strip()) for name in names]
        if args.layers < len(stage_devices):
            raise CommandError(f"--layers {args.layers}: need at least one layer per stage ({len(stage_devices)})")
        engine_module, config = impl.load("serve.engine"), impl.load("serve.config")
        request = impl.load("serve.request")

        def serve(model):
            engine = engine_module.EngineCore(model, config.EngineConfig(num_blocks=64, block_size=4),
                                              eos_token_id=TINY_EOS)
            params = request.SamplingParams(max_tokens=args.max_tokens)
            outputs = engine.generate(PROMPTS, [params] * len(PROMPTS))
            return engine, [out.output_token_ids for out in outputs]

        _, single = serve(tiny_qwen3(impl.package, device=stage_devices[0], num_hidden_layers=args.layers))
        placed = devices.PlacedFlatModel(tiny_qwen3(impl.package, num_hidden_layers=args.layers), stage_devices)
        engine, spread = serve(placed)
    except NotImplementedError as exc:
        raise CommandError(f"{impl.name} is not complete yet: {exc}") from None
    except ValueError as exc:
        raise CommandError(str(exc)) from None
    plan = [placed.stage_of_layer.count(stage) for stage in range(len(stage_devices))]
    line = {"stages": [str(d) for d in stage_devices], "layers_per_stage": plan, "steps": engine.steps,
            "transfers": placed.transfers, "transfers_per_step": round(placed.transfers / engine.steps, 2),
            "transfer_bytes": placed.transfer_bytes, "rows_home": placed.returns,
            "rows_home_bytes": placed.return_bytes, "outputs_identical": spread == single}
    print(json.dumps(line), flush=True)
    if spread != single:
        raise CommandError("the placed model's greedy outputs differ from one device's")
    return 0
