"""Chapter 35: what constrained decoding costs, on the byte vocabulary and on SmolLM2's.

For each vocabulary (the tiny model's 256 byte tokens plus specials, and SmolLM2-135M's
49,152 BPE tokens read from its GGUF file) and each grammar (a date-and-time regex and a
nested JSON schema), prints one JSON line:
- layout_ms: the vocabulary's bytes laid out as a prefix tree (once per engine, on first use);
- compile_ms: pattern -> minimal byte DFA (parse, NFA, subset construction, minimisation);
- states: the DFA's states; first_mask_ms: the first mask of one state (walking every
  token's bytes once); precompute_ms: every state's mask (what an ahead-of-time index such
  as outlines' would pay before the first token);
- cold_step_us / cold_step_p99_us: one guided step, allowed() + advance(), median and 99th
  percentile over the first --walks random walks, which compute each new state's mask as
  they reach it (what a server pays while a schema is new);
- step_us / step_p99_us: the same once every state's mask is cached;
- mask_apply_us: setting the forbidden logits of one [vocab] float32 row to -inf;
- on SmolLM2's vocabulary, cold_step_cpu_p99_us (the cold steps' 99th percentile in CPU
  time of this thread) and its share of one SmolLM2 decode step per weight type,
  mask_share_of_step {"float32": .., "bfloat16": ..}: the step is the median CPU time of
  --decode-steps decode steps of the core engine (the bench's chat workload: 16 chat
  requests at once to SmolLM2-135M-Instruct, `run.py bench`'s engine setup, one thread),
  measured in the same process first and printed as its own line (decode_step_ms).
Layout, compile and first-mask times are the best of --repeat fresh rounds and mask_apply_us the
best of five batches (a busy machine only ever makes a run slower); precompute_ms is one run.
The walks draw uniformly among allowed tokens (seeded), so they visit many more states than
a model would. The SmolLM2 file is fetched on first use (course.models.smollm2); without it only
the byte vocabulary is measured.

--engine measures the whole engine instead: the same requests (greedy, --requests of them,
--tokens output tokens each) through EngineCore with the full sampler, free and then guided
by a pattern of lowercase prose that can only end after 200 capitals (so no guided request
ends before --tokens tokens, and both runs take the same steps), guided twice: "cold"
computes the masks, "warm" finds them cached (free and warm: best of --repeat interleaved
rounds). One JSON line per model and run: ms per step and the overhead over the free run.
The tiny model speaks bytes; SmolLM2 its BPE vocabulary.

The pushdown guide of {"type": "json_object"} (json_pda.JsonGuide, whose masks depend on the
stack too) is measured the same way, grammar "json_object": its cold and warm steps.

--corpus measures compiling instead: every schema of the suite's corpus
(tests/data/schema_corpus, 300 schemas written for it) and of its JSONSchemaBench sample
(tests/data/jsonschemabench, 30 per subset), one JSON line per corpus and per subset: how
many compile, and the median and 99th percentile of their compile times, in CPU time of
this process (what a compile costs, whatever else the machine runs) and wall time.
"""
import json
import math
import random
import statistics
import time

from course.cli import add_impl_argument

REGEX = r"(19|20)\d\d-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])T([01]\d|2[0-3]):[0-5]\d"
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24},
    "age": {"type": "integer"},
    "languages": {"type": "array", "items": {"enum": ["python", "c", "rust"]}, "maxItems": 3},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string",
                                                                                    "minLength": 5,
                                                                                    "maxLength": 5}}},
    "verified": {"type": "boolean"},
}, "required": ["name", "age"]}


def add_arguments(parser):
    add_impl_argument(parser)
    parser.add_argument("--walks", type=int, default=20, help="random guided walks per grammar (default 20)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the walks (default 0)")
    parser.add_argument("--vocabulary", choices=("bytes", "smollm2", "all"), default="all",
                        help="which vocabularies to measure (default all)")
    parser.add_argument("--engine", action="store_true", help="time whole engine steps, free against guided")
    parser.add_argument("--requests", type=int, default=4, help="requests per --engine run (default 4)")
    parser.add_argument("--tokens", type=int, default=32, help="output tokens per --engine request (default 32)")
    parser.add_argument("--corpus", action="store_true", help="time compiling the suite's schema corpora")
    parser.add_argument("--decode-steps", type=int, default=6,
                        help="timed SmolLM2 decode steps per weight type, for the masks' share of a step "
                             "(default 6; 0: not measured)")
    parser.add_argument("--repeat", type=int, default=3,
                        help="timed rounds, best kept: compiles and first masks; with --engine the free and "
                             "warm runs (default 3)")


def vocabularies(guided, which):
    """(name, vocab_bytes, eos_token_id) for the byte vocabulary and/or, if available, SmolLM2's."""
    from course.models import TINY_VOCAB_SIZE, smollm2
    from course.testing import bpe_oracle
    from course.testing.oracles import byte_vocabulary
    byte_vocab = byte_vocabulary(TINY_VOCAB_SIZE)
    found = [("bytes", byte_vocab, 257)] if which in ("bytes", "all") else []
    if which == "bytes":
        return found
    try:
        metadata = bpe_oracle.smollm2_metadata()
    except smollm2.SmolLM2Unavailable as missing:
        print(json.dumps({"vocabulary": "smollm2", "skipped": str(missing)}))
        return found
    # The file's own token strings (not Chapter 36's tokenizer, which a learner here may not have written).
    found.append(("smollm2", bpe_oracle.vocabulary_bytes(metadata), metadata["tokenizer.ggml.eos_token_id"]))
    return found


def measure(guided, request, name, vocab_bytes, eos, grammar, fields, args):
    import torch
    params = request.SamplingParams(**fields)
    compile_s, first_mask_s, layout_s = [], [], []
    for _ in range(args.repeat):                   # fresh factories: nothing cached between rounds
        factory = guided.GuideFactory(vocab_bytes, eos, len(vocab_bytes))
        start = time.perf_counter()
        _ = factory.vocabulary.trie                # lays out the token trie (once per engine)
        layout_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        index = factory(params).index
        compile_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        index.mask(index.dfa.start)
        first_mask_s.append(time.perf_counter() - start)
    rng = random.Random(args.seed)
    cold_s = walk_steps(guided.GuideFactory(vocab_bytes, eos, len(vocab_bytes)), params, eos, rng, args.walks)
    start = time.perf_counter()
    index.precompute()
    precompute_s = time.perf_counter() - start
    step_s = walk_steps(factory, params, eos, rng, args.walks)
    logits = torch.randn(len(vocab_bytes))
    mask = index.mask(index.dfa.start)
    apply_s = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(40):
            logits.masked_fill(~mask, float("-inf"))
        apply_s.append((time.perf_counter() - start) / 40)
    return {"vocabulary": name, "vocab_size": len(vocab_bytes), "grammar": grammar, "states": index.dfa.num_states,
            "layout_ms": round(min(layout_s) * 1e3, 1), "compile_ms": round(min(compile_s) * 1e3, 1),
            "first_mask_ms": round(min(first_mask_s) * 1e3, 2),
            "precompute_ms": round(precompute_s * 1e3, 1), **percentiles("cold_step", cold_s[0]),
            **percentiles("step", step_s[0]), "mask_apply_us": round(min(apply_s) * 1e6, 1),
            **percentiles("cold_step_cpu", cold_s[1])}


def percentiles(name, seconds):
    """{name_us: median, name_p99_us: 99th percentile} of step times, in microseconds."""
    ordered = sorted(seconds)
    return {f"{name}_us": round(statistics.median(ordered) * 1e6, 1),
            f"{name}_p99_us": round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1e6, 1)}


def walk_steps(factory, params, eos, rng, walks, max_tokens=200):
    """The times of each allowed() + advance() over `walks` walks that draw a random allowed
    token each step, until the guide finishes, EOS is drawn or max_tokens are written:
    (wall seconds, CPU seconds of this thread), one entry per step in each."""
    import torch
    step_s, cpu_s = [], []
    for _ in range(walks):
        guide = factory(params)
        for _ in range(max_tokens):
            if guide.finished:
                break
            start, start_cpu = time.perf_counter(), time.thread_time()
            allowed = guide.allowed()
            middle, middle_cpu = time.perf_counter(), time.thread_time()
            token = rng.choice(torch.nonzero(allowed).flatten().tolist())
            restart, restart_cpu = time.perf_counter(), time.thread_time()
            guide.advance(token)
            step_s.append(time.perf_counter() - restart + middle - start)
            cpu_s.append(time.thread_time() - restart_cpu + middle_cpu - start_cpu)
            if token == eos:
                break
    return step_s, cpu_s


def measure_pushdown(guided, request, name, vocab_bytes, eos, args):
    """Cold and warm steps of the pushdown guide (json_object) on one vocabulary."""
    params = request.SamplingParams(guided_json={"type": "json_object"})
    factory = guided.GuideFactory(vocab_bytes, eos, len(vocab_bytes))
    rng = random.Random(args.seed)
    cold_s = walk_steps(factory, params, eos, rng, args.walks)
    step_s = walk_steps(factory, params, eos, rng, args.walks)
    return {"vocabulary": name, "vocab_size": len(vocab_bytes), "grammar": "json_object",
            **percentiles("cold_step", cold_s[0]), **percentiles("step", step_s[0]),
            **percentiles("cold_step_cpu", cold_s[1])}


def decode_step_ms(impl, steps):
    """{"float32": ms, "bfloat16": ms}: the median CPU time of `steps` decode steps of the
    core engine on the bench's chat workload (16 SmolLM2 chat requests decoding together,
    one thread, run.py bench's core setup), each weight type loaded in turn. Raises what
    loading raises (SmolLM2Unavailable, NotImplementedError for an unwritten stub)."""
    import torch

    from course import bench
    workloads = impl.load("workloads")
    items, path = bench.chat_items(impl, workloads, 16, 1)
    found = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = impl.checkpoint.load_model(path, dtype=dtype, device=torch.device("cpu"))
        name = str(dtype).removeprefix("torch.")
        make = bench.core_contender(impl, model, "vectorised", dtype=name).make
        engine = make(bench.Workload("chat", items, {}, checkpoint=path)).engine     # bench.CoreSteps
        params = engine.params(max_tokens=steps + 4, ignore_eos=True)
        for item in items:
            engine.core.add_request(item.request_id, item.prompt_ids, params)
        started: set[str] = set()
        while len(started) < len(items):                       # the prompts' prefill is not a decode step
            started.update(rid for rid, tokens, _ in engine.step() if tokens)
        times = []
        for _ in range(steps):
            start = time.process_time()
            engine.step()
            times.append(time.process_time() - start)
        found[name] = statistics.median(times) * 1e3
    return found


def shares(line, step_ms):
    """The cold steps' CPU p99 of one result line as a share of each decode step."""
    return {"mask_share_of_step": {name: round(line["cold_step_cpu_p99_us"] / 1e3 / ms, 3)
                                   for name, ms in step_ms.items()}}


def timed(engine, prompts, params):
    """(ms per engine step, steps) to serve one request per prompt with `params`."""
    for prompt in prompts:
        engine.add_request(f"r{time.perf_counter_ns()}", prompt, params)
    steps, start = 0, time.perf_counter()
    while engine.has_unfinished:
        engine.step()
        steps += 1
    return (time.perf_counter() - start) / steps * 1e3, steps


def engine_runs(impl, guided, args):
    """Yield one result per (model, run): free, guided cold, guided warm."""
    from course.models import smollm2, tiny_qwen3
    from course.models.real import smollm2 as load_smollm2
    from course.testing.oracles import TINY_EOS, byte_vocabulary
    engine_module, config, request = (impl.load(f"serve.{name}") for name in ("engine", "config", "request"))
    tiny = tiny_qwen3(impl.package)
    models = [("tiny", tiny, byte_vocabulary(tiny.cfg.vocab_size), TINY_EOS,
               [[1 + i, 2, 3] for i in range(args.requests)])]
    if args.vocabulary != "bytes":
        try:
            model, tokenizer = load_smollm2()
            prompts = [tokenizer.encode_chat([{"role": "user", "content": f"Write {i + 2} words about the sea."}])
                       for i in range(args.requests)]
            models.append(("smollm2", model, guided.token_bytes_of(tokenizer), tokenizer.eos_token_id, prompts))
        except smollm2.SmolLM2Unavailable as missing:
            print(json.dumps({"model": "smollm2", "skipped": str(missing)}))
    pattern = "[a-z ,.]*[A-Z]{200}"
    for name, model, vocab_bytes, eos, prompts in models:
        engine = engine_module.EngineCore(model, config.EngineConfig(num_blocks=256, sampler="full"),
                                          eos_token_id=eos, vocab_bytes=vocab_bytes)
        guided_fields = {"guided_regex": pattern}
        best = {"free": timed(engine, prompts, request.SamplingParams(max_tokens=args.tokens, ignore_eos=True)),
                "guided cold": timed(engine, prompts, request.SamplingParams(max_tokens=args.tokens, ignore_eos=True,
                                                                              **guided_fields))}
        for _ in range(args.repeat):                    # interleaved, best of each: load only slows
            for label, fields in (("free", {}), ("guided warm", guided_fields)):
                params = request.SamplingParams(max_tokens=args.tokens, ignore_eos=True, **fields)
                best[label] = min(best.get(label, (math.inf, 0)), timed(engine, prompts, params))
        for label in ("free", "guided cold", "guided warm"):
            ms, steps = best[label]
            yield {"model": name, "vocab_size": len(vocab_bytes), "run": label, "requests": len(prompts),
                   "steps": steps, "ms_per_step": round(ms, 2), "overhead_ms": round(ms - best["free"][0], 2)}


def corpus_compiles(json_regex):
    """Yield one result per corpus and per JSONSchemaBench subset: compiled count, compile times."""
    from pathlib import Path
    data = Path(__file__).resolve().parents[2] / "tests" / "data"
    groups: dict[str, list] = {}
    for entry in json.loads((data / "schema_corpus" / "corpus.json").read_text(encoding="utf-8")):
        groups.setdefault("corpus", []).append(entry["schema"])
    for entry in json.loads((data / "jsonschemabench" / "sample.json").read_text(encoding="utf-8")):
        groups.setdefault(f"jsonschemabench/{entry['subset']}", []).append(entry["schema"])
        groups.setdefault("jsonschemabench", []).append(entry["schema"])
    for name, schemas in groups.items():
        compiled, cpu_s, wall_s = 0, [], []
        for schema in schemas:
            cpu, wall = time.process_time(), time.perf_counter()
            try:
                json_regex.compile_schema(schema)
                compiled += 1
            except ValueError:
                pass
            cpu_s.append(time.process_time() - cpu)
            wall_s.append(time.perf_counter() - wall)
        yield {"corpus": name, "schemas": len(schemas), "compiled": compiled,
               **{key.replace("_us", "_ms"): round(value / 1e3, 1) for key, value in
                  {**percentiles("compile_cpu", cpu_s), **percentiles("compile_wall", wall_s)}.items()}}


def run(args):
    import torch

    from course.impl import load
    torch.set_num_threads(1)
    impl = load(args.impl)
    guided = impl.load("serve.guided")
    request = impl.load("serve.request")
    if args.corpus:
        for result in corpus_compiles(impl.load("json_regex")):
            print(json.dumps(result), flush=True)
        return
    if args.engine:
        for result in engine_runs(impl, guided, args):
            print(json.dumps(result), flush=True)
        return
    for name, vocab_bytes, eos in vocabularies(guided, args.vocabulary):
        step_ms = {}
        if name == "smollm2" and args.decode_steps > 0:
            from course.models import smollm2
            try:
                step_ms = decode_step_ms(impl, args.decode_steps)
            except (smollm2.SmolLM2Unavailable, NotImplementedError) as missing:
                print(json.dumps({"decode_step": "smollm2", "skipped": str(missing)}), flush=True)
            else:
                print(json.dumps({"decode_step": "smollm2 chat, 16 requests, 1 thread, core engine",
                                  "steps": args.decode_steps,
                                  **{f"{k}_step_ms": round(v, 2) for k, v in step_ms.items()}}), flush=True)
        for grammar, fields in (("regex", {"guided_regex": REGEX}), ("json", {"guided_json": SCHEMA})):
            line = measure(guided, request, name, vocab_bytes, eos, grammar, fields, args)
            print(json.dumps({**line, **(shares(line, step_ms) if step_ms else {})}), flush=True)
        line = measure_pushdown(guided, request, name, vocab_bytes, eos, args)
        print(json.dumps({**line, **(shares(line, step_ms) if step_ms else {})}), flush=True)
