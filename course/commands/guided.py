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
- mask_apply_us: setting the forbidden logits of one [vocab] float32 row to -inf.
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
            "precompute_ms": round(precompute_s * 1e3, 1), **percentiles("cold_step", cold_s),
            **percentiles("step", step_s), "mask_apply_us": round(min(apply_s) * 1e6, 1)}


def percentiles(name, seconds):
    """{name_us: median, name_p99_us: 99th percentile} of step times, in microseconds."""
    ordered = sorted(seconds)
    return {f"{name}_us": round(statistics.median(ordered) * 1e6, 1),
            f"{name}_p99_us": round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1e6, 1)}


def walk_steps(factory, params, eos, rng, walks, max_tokens=200):
    """The time of each allowed() + advance() over `walks` walks that draw a random allowed
    token each step, until the guide finishes, EOS is drawn or max_tokens are written."""
    import torch
    step_s = []
    for _ in range(walks):
        guide = factory(params)
        for _ in range(max_tokens):
            if guide.finished:
                break
            start = time.perf_counter()
            allowed = guide.allowed()
            middle = time.perf_counter()
            token = rng.choice(torch.nonzero(allowed).flatten().tolist())
            restart = time.perf_counter()
            guide.advance(token)
            step_s.append(time.perf_counter() - restart + middle - start)
            if token == eos:
                break
    return step_s


def measure_pushdown(guided, request, name, vocab_bytes, eos, args):
    """Cold and warm steps of the pushdown guide (json_object) on one vocabulary."""
    params = request.SamplingParams(guided_json={"type": "json_object"})
    factory = guided.GuideFactory(vocab_bytes, eos, len(vocab_bytes))
    rng = random.Random(args.seed)
    cold_s = walk_steps(factory, params, eos, rng, args.walks)
    step_s = walk_steps(factory, params, eos, rng, args.walks)
    return {"vocabulary": name, "vocab_size": len(vocab_bytes), "grammar": "json_object",
            **percentiles("cold_step", cold_s), **percentiles("step", step_s)}


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
        for grammar, fields in (("regex", {"guided_regex": REGEX}), ("json", {"guided_json": SCHEMA})):
            print(json.dumps(measure(guided, request, name, vocab_bytes, eos, grammar, fields, args)), flush=True)
        print(json.dumps(measure_pushdown(guided, request, name, vocab_bytes, eos, args)), flush=True)
