"""Chapters 18-19: where a decode step's time goes, and FastDecoder against generate.

Prints JSON lines. First one line describing this machine as the roofline sees it
(measured copy bandwidth and matmul peak). Then, for each --batch size, one decode step
at --context cached tokens (Chapter 18's decode_report): step_ms, ops per step, launch_ms
(ops x the cost of one tiny op), launch_share, roofline_ms (Chapter 2's bound on this
machine) and achieved GB/s. Last, unless --no-fast, Chapter 17's generate and Chapter 19's
FastDecoder decode --tokens tokens greedily after the same prompt: median ms per decode
step, tokens/s, whether FastDecoder used a CUDA graph, and whether the outputs are
identical.
"""
import json
import statistics

from course.cli import CommandError, add_device_argument, add_impl_argument, add_model_argument, add_threads_argument
from course.commands._setup import load_model, prepare


def add_arguments(parser):
    add_impl_argument(parser)
    add_device_argument(parser)
    add_model_argument(parser)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64, 256],
                        help="batch sizes of the decode-step sweep (default 1 8 64 256)")
    parser.add_argument("--context", type=int, default=128, help="tokens already cached per sequence (default 128)")
    parser.add_argument("--tokens", type=int, default=64, help="tokens decoded in the generate comparison (default 64)")
    parser.add_argument("--prompt-len", type=int, default=16, help="prompt length for the comparison (default 16)")
    parser.add_argument("--no-fast", action="store_true", help="skip the generate vs FastDecoder comparison")
    add_threads_argument(parser)



def run(args):
    import torch

    impl, device = prepare(args)
    if min(args.batch) < 1 or args.context < 0 or args.tokens < 2 or args.prompt_len < 1:
        raise CommandError("--batch >= 1, --context >= 0, --tokens >= 2 and --prompt-len >= 1 please")
    model = load_model(impl, device, args.model)
    timing = impl.load("decode_timing")
    hardware = timing.measure_hardware(device)
    print(json.dumps({"hardware": hardware.name, "bandwidth_GB_s": round(hardware.bandwidth / 1e9, 1),
                      "peak_GFLOP_s": round(hardware.peak_flops / 1e9, 1), "threads": torch.get_num_threads()}))
    overhead = timing.launch_overhead(device)
    for batch in args.batch:
        report = timing.decode_report(model, batch, args.context, hardware, overhead_seconds=overhead)
        print(json.dumps({"batch": batch, "context": args.context, "step_ms": round(report.step_seconds * 1e3, 3),
                          "ops": report.num_ops, "launch_ms": round(report.launch_seconds * 1e3, 3),
                          "launch_share": round(report.launch_share, 3),
                          "roofline_ms": round(report.roofline_seconds * 1e3, 4),
                          "achieved_GB_s": round(report.achieved_bandwidth / 1e9, 2)}))
    if args.no_fast:
        return 0
    fast = impl.load("fast_decoder")
    generate = impl.load("sampling").generate
    vocab = model.cfg.vocab_size
    prompt = [(7 * i + 3) % min(vocab, 256) for i in range(args.prompt_len)]
    decoder = fast.FastDecoder(model, args.prompt_len + args.tokens + 1)
    same = generate(model, prompt, args.tokens) == decoder.generate(prompt, args.tokens)
    for label, dec in (("ch17 generate", None), ("ch19 FastDecoder", decoder)):
        fast.step_latencies(model, prompt, 4, dec)                      # warm-up
        times = fast.step_latencies(model, prompt, args.tokens, dec)
        line = {"decoder": label, "step_ms": round(statistics.median(times) * 1e3, 3),
                "tok_s": round(len(times) / sum(times), 1)}
        if dec is not None:
            line.update(cuda_graph=dec.graph is not None, same_tokens_as_generate=same)
        print(json.dumps(line))
    if not same:
        raise CommandError("FastDecoder's greedy tokens differ from generate's")
    return 0
