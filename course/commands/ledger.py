"""Chapter 32: a performance ledger, your engine's speed at every chapter that changes it.

Serves ONE small fixed workload (the bench's serving requests shrunk by --scale: 8
requests of 8-64 prompt tokens and 4-32 output tokens at the default 0.125, on the
serving model: 4 layers, hidden 256, Qwen3's vocabulary unless --vocab-size) with the implementation's code
of each chapter that changes how fast tokens come out, and prints one JSON line per
chapter:
  17  generate with the KV cache, one request after another
  19  FastDecoder (static buffers; a CUDA graph on a GPU), one request after another
  21  static batching: every request in one left-padded batch
  24  continuous batching in slots
  25  the paged engine (block pool, prefix cache)
  31  the engine core, reference attention backend
  32  the engine core, vectorised backend (and Triton on CUDA)
  33  the core with decode steps padded to static buckets (CUDA graphs on a GPU), and with
      asynchronous scheduling on a worker thread
Each line has the chapter's tok/s, transformers' best on the same workload (generate,
static cache, continuous batching: the fastest of them), their ratio, the share of this
machine's matmul peak and memory bandwidth it reached (measured first, as `run.py bench
--roofline` does), and whether its tokens are transformers' (greedy, float32: they must
be). A chapter whose stubs are not written yet says so instead of a rate: a learner
midway sees the chapters done so far. Stages are timed in turn, once each after an
untimed warm-up; --repeat N times N interleaved rounds, each stage's best counting (see
`run.py bench`), and every round's rate joins its line.
"""
import json
import logging

import torch

from course.cli import CommandError, add_device_argument, add_impl_argument, add_threads_argument
from course.models import QWEN3_VOCAB_SIZE, TINY_VOCAB_SIZE


def add_arguments(parser):
    add_impl_argument(parser)
    add_device_argument(parser)
    parser.add_argument("--scale", type=float, default=0.125,
                        help="the bench's serving workload shrunk by this factor (default 0.125: 8 requests)")
    parser.add_argument("--vocab-size", type=int, default=QWEN3_VOCAB_SIZE,
                        help=f"the model's vocabulary (default {QWEN3_VOCAB_SIZE:,}, Qwen3's, whose LM head is most "
                             f"of a token's work; {TINY_VOCAB_SIZE} shows the overhead-bound regime)")
    # One round by default: the ledger's question is which chapter is far off, which one round
    # answers, and two doubled a run that took six minutes on a busy two-core machine.
    parser.add_argument("--repeat", type=int, default=1,
                        help="timed rounds, interleaved; each stage's best counts (default 1)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    add_threads_argument(parser)


def stages(impl, bench, model, device) -> list:
    """(chapter, what it changed, Contender) for every chapter that changes the speed."""
    eos = model.cfg.eos_token_id
    workloads = impl.load("workloads")

    def one_by_one(label, generate_of):
        """A contender that serves requests one after another with generate_of(workload)."""
        def serve(generate, items):
            return {it.request_id: generate(it.prompt_ids, it.max_tokens) for it in items}, None
        return bench.Contender(label, generate_of, serve, streams=False)

    def fast_decoder(workload):
        decoder = impl.fast_decoder.FastDecoder(model, max_len=workload.longest)
        return lambda prompt, n: decoder.generate(prompt, n, eos_token_id=eos)

    def static_batch(engine, items):
        outputs = impl.static_batch.generate_batch(model, [it.prompt_ids for it in items],
                                                   max(it.max_tokens for it in items), eos_token_id=eos)
        return {it.request_id: out for it, out in zip(items, outputs)}, None

    def paged(workload):
        blocks = sum(-(-(len(it.prompt_ids) + it.max_tokens) // 16) for it in workload.items) + 8
        return impl.paged.PagedEngine(model, num_blocks=blocks, block_size=16, max_num_seqs=len(workload.items),
                                      eos_token_id=eos)

    cuda = device.type == "cuda"
    fast = "triton" if cuda else "vectorised"
    listed = [
        (17, "generate with the KV cache, one request at a time", one_by_one(
            "ch17 generate", lambda w: lambda prompt, n: impl.sampling.generate(model, prompt, n, eos_token_id=eos))),
        (19, "FastDecoder: static buffers" + (" and a CUDA graph" if cuda else ""),
         one_by_one("ch19 FastDecoder", fast_decoder)),
        (21, "static batching: one padded batch", bench.Contender("ch21 static batch", lambda w: None, static_batch,
                                                                   streams=False)),
        (24, "continuous batching in slots", bench.slots_contender(impl, model)),
        (25, "paged KV cache and prefix caching", bench.step_contender("ch25 paged", paged, workloads)),
        (31, "engine core, reference backend", bench.core_contender(impl, model, "reference",
                                                                     label="ch31 core/reference")),
        (32, "engine core, vectorised backend", bench.core_contender(impl, model, "vectorised",
                                                                      label="ch32 core/vectorised")),
    ]
    if cuda:
        listed.append((32, "engine core, Triton paged attention", bench.core_contender(
            impl, model, "triton", label="ch32 core/triton")))
    listed += [
        (33, "CUDA graphs of the decode step" if cuda else "decode padded to static buckets",
         bench.core_contender(impl, model, fast, label=f"ch33 core/{fast}, " + ("cuda graphs" if cuda else "static"),
                              cuda_graphs="on" if cuda else "static")),
        (33, "asynchronous scheduling", bench.core_contender(
            impl, model, fast, label=f"ch33 core/{fast}, async", async_scheduling=True,
            device_queue="cuda" if cuda else "thread")),
    ]
    return listed


def run(args):
    from course import bench
    from course.commands._setup import prepare
    if args.repeat < 1 or args.scale <= 0 or args.vocab_size < TINY_VOCAB_SIZE:
        raise CommandError(f"--repeat must be at least 1, --scale positive and --vocab-size at least "
                           f"{TINY_VOCAB_SIZE} (bytes and special ids)")
    impl, device = prepare(args)
    try:
        workload, = bench.make_workloads(impl, ["serving"], args.scale,
                                         shape={**bench.SERVING_SHAPE, "vocab_size": args.vocab_size})
        workload.model = model = bench.build_model(impl, device, workload.shape, torch.float32)
    except NotImplementedError as exc:
        raise CommandError(f"the ledger needs the model (Chapters 1-17) done in your engine: {exc} "
                           f"is not written yet") from None
    workload.threads = torch.get_num_threads()
    workload.name = f"serving:scale={args.scale:g}:vocab={args.vocab_size}"
    limits = bench.machine_limits(device, [torch.float32])
    # Static batches of 16 and one request at a time are never transformers' fastest here.
    theirs = [c for c in bench.hf_contenders(model, workload) if c.subset is None and "batches of" not in c.label]
    mine = stages(impl, bench, model, device)
    progress = bench.Progress((len(theirs) + len(mine)) * (args.repeat + 1), enabled=not args.quiet)
    unwritten: dict = {}            # label -> the stub's message
    contenders = theirs + [contender for _, _, contender in mine]
    # The core logs a request it aborts with the traceback; an unwritten stub is reported in
    # its chapter's line instead, and any other failure stops the ledger with its message.
    core_log = logging.getLogger(impl.load("serve.engine").__name__)
    level, core_log.level = core_log.level, logging.CRITICAL
    try:
        for contender in contenders:
            progress.show(f"warm-up: {contender.label}")
            _unless_unwritten(unwritten, contender, lambda c=contender: bench.warm_up(c, workload))
            progress.tick()
        for _ in range(args.repeat):
            for contender in contenders:
                progress.show(contender.label)
                if contender.label not in unwritten:
                    _unless_unwritten(unwritten, contender, lambda c=contender: bench.timed_run(c, workload, device))
                progress.tick()
    finally:
        core_log.setLevel(level)
        progress.close()

    eos, workload_module = model.cfg.eos_token_id, impl.load("workloads")
    hf_lines = {c.label: bench.report(c, workload, eos, workload_module) for c in theirs}
    best_label = max(hf_lines, key=lambda label: hf_lines[label][0]["tok_s"])
    best, reference = hf_lines[best_label]
    print(json.dumps({"ledger": workload.name, "requests": len(workload.items), "threads": workload.threads,
                      "dtype": "float32", "roofline": limits, "transformers_best": best_label,
                      "transformers_best_tok_s": best["tok_s"]}), flush=True)
    differ = []
    for chapter, change, contender in mine:
        line = {"chapter": chapter, "change": change, "contender": contender.label}
        if contender.label in unwritten:
            line.update(status="not written yet", stub=unwritten[contender.label])
        else:
            timed, _ = bench.report(contender, workload, eos, workload_module, reference)
            line.update(tok_s=timed["tok_s"], tok_s_rounds=timed.get("tok_s_rounds"),
                        vs_transformers_best=bench.ratio(timed["tok_s"], best["tok_s"]),
                        roofline=bench.roofline_share(timed, workload, limits),
                        identical_to_transformers=timed["identical"])
            if not timed["identical"]:
                differ.append(f"chapter {chapter} ({contender.label}) in {', '.join(timed['differing_requests'])}")
        print(json.dumps({k: v for k, v in line.items() if v is not None}), flush=True)
    if differ:
        raise CommandError("greedy outputs differ from transformers': " + "; ".join(differ))
    return 0


def _unless_unwritten(unwritten: dict, contender, work) -> None:
    """Run work(); a stub's NotImplementedError marks the contender as not written yet."""
    try:
        work()
    except NotImplementedError as exc:
        unwritten[contender.label] = str(exc) or type(exc).__name__
