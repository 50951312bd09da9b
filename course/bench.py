"""What `python run.py bench` (Chapter 32) is made of: model shapes, workloads, contenders,
the interleaved timing loop, the step-time profile and the plot.

Every contender serves the same WorkItems with the same weights and returns
{request_id: output token ids}, cut the same way (at the request's max_tokens, and just
after an end-of-sequence token), so their outputs can be compared token for token.
"""
from __future__ import annotations

import dataclasses
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from course.models import QWEN3_VOCAB_SIZE, tiny_qwen3

# --- model shapes ------------------------------------------------------------------------------

# The tiny test model's layout with the serving workload's size: the measurements.
SERVING_SHAPE = dict(num_hidden_layers=4, hidden_size=256, intermediate_size=768, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=64, vocab_size=QWEN3_VOCAB_SIZE,
                     max_position_embeddings=16384)
# Qwen3-0.6B's published config (random weights: speed does not depend on their values).
QWEN3_0_6B_SHAPE = dict(num_hidden_layers=28, hidden_size=1024, intermediate_size=3072, num_attention_heads=16,
                        num_key_value_heads=8, head_dim=128, vocab_size=QWEN3_VOCAB_SIZE,
                        max_position_embeddings=40960, rope_theta=1_000_000.0, tie_word_embeddings=True)


def build_model(impl, device: torch.device, shape: dict, dtype: torch.dtype | None = None):
    """The implementation's Qwen3 with the tiny model's deterministic weights in `shape`."""
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    return tiny_qwen3(impl.package, device=device, dtype=dtype, **shape)


# --- workloads ---------------------------------------------------------------------------------

@dataclass
class Workload:
    """A named list of WorkItems and the model it runs on: the tiny model's weights in
    `shape`, or a real checkpoint file (`checkpoint`, loaded by the implementation)."""
    name: str
    items: list
    shape: dict
    timed_arrivals: bool = False          # Poisson: requests arrive while others run
    checkpoint: str | None = None
    threads: int = 1                      # torch threads every contender runs it with
    model: Any = field(default=None, repr=False)     # the weights every contender serves it with

    @property
    def longest(self) -> int:
        return max(len(it.prompt_ids) + it.max_tokens for it in self.items)


def with_threads(workload: Workload, threads: int, label: bool) -> Workload:
    """The same workload (items, model) timed with `threads` torch threads; with `label`,
    its name says so, so each thread count keeps its own lines and rounds."""
    return dataclasses.replace(workload, threads=threads,
                               name=f"{workload.name} threads={threads}" if label else workload.name)


def _scaled(bounds: tuple, scale: float, floor: int = 4) -> tuple:
    return tuple(max(floor, round(b * scale)) for b in bounds)


def random_items(workloads, count: int, prompt_len: tuple, output_len: tuple, seed: int) -> list:
    """`count` independent prompts (byte-sized ids) with lengths drawn from inclusive ranges."""
    rng = random.Random(seed)
    return [workloads.WorkItem(f"req-{i}", [rng.randrange(256) for _ in range(rng.randint(*prompt_len))],
                               rng.randint(*output_len)) for i in range(count)]


# The chat workload's questions: short, varied, answerable by a 135M-parameter model.
CHAT_QUESTIONS = (
    "What is the capital of France?", "Give me three tips for sleeping better.",
    "Explain what a prime number is.", "Write a haiku about the sea.",
    "How do I boil an egg?", "What is photosynthesis?", "Name three planets of the solar system.",
    "Why is the sky blue?", "Suggest a name for a small bakery.", "What does a compiler do?",
    "How many days are in a leap year?", "Describe a cat in one sentence.",
    "What is the difference between weather and climate?", "Give me a short tip for learning to cook.",
    "What is 12 times 12?", "Translate 'good morning' into Spanish.",
)


def chat_items(impl, workloads, count: int, max_tokens: int) -> tuple[list, str]:
    """`count` single-turn chat prompts for SmolLM2 (its own chat template and tokenizer,
    through the implementation's Chapter 36 and 39 code) and the checkpoint's path.
    Raises course.models.smollm2.SmolLM2Unavailable when the file is neither cached nor fetchable."""
    from course.models.smollm2 import smollm2_gguf_path
    path = smollm2_gguf_path(quiet=True)
    tokenizer = impl.bpe.BPETokenizer.from_gguf_metadata(impl.gguf.GGUFFile(path).metadata)
    questions = [CHAT_QUESTIONS[i % len(CHAT_QUESTIONS)] for i in range(count)]
    items = [workloads.WorkItem(f"chat-{i}", tokenizer.encode_chat([{"role": "user", "content": q}]), max_tokens)
             for i, q in enumerate(questions)]
    return items, str(path)


def make_workloads(impl, names: list, scale: float = 1.0, seed_vocab: int = QWEN3_VOCAB_SIZE, rate: float = 1.0,
                   shape: dict | None = None) -> list:
    """The bench's workloads by name; `shape` (a model shape) replaces each one's own.

    seed     Chapter 31's `run.py core` workload (16 requests sharing a 192-token system
             prompt) on the tiny 2-layer model with vocabulary seed_vocab
    serving  64 independent requests, prompts 64-512 tokens, outputs 32-256, SERVING_SHAPE
    long     4 requests with 2k-8k-token prompts, outputs 16-64
    poisson  the serving requests arriving as a Poisson process of `rate` requests/s
    chat     16 chat questions to SmolLM2-135M-Instruct (the real model), up to 64 tokens
             each, ending at its end-of-turn token
    `scale` multiplies the number of requests and (except the seed's) the lengths; the
    arrival rate is divided by it, so a shrunk workload keeps about the same load."""
    workloads = impl.load("workloads")
    count = lambda n: max(2, round(n * scale))        # noqa: E731
    made = []
    for name in names:
        if name == "seed":
            items = workloads.shared_prefix_workload(num_requests=count(16), seed=0)
            made.append(Workload(name, items, shape or {"vocab_size": seed_vocab}))
        elif name in ("serving", "poisson"):
            items = random_items(workloads, count(64), _scaled((64, 512), scale), _scaled((32, 256), scale), 1)
            if name == "poisson":
                items = workloads.with_arrivals(items, workloads.poisson_arrivals(rate / scale, len(items), seed=2))
            made.append(Workload(name, items, shape or SERVING_SHAPE, timed_arrivals=name == "poisson"))
        elif name == "long":
            items = random_items(workloads, count(4), _scaled((2048, 8192), scale), _scaled((16, 64), scale), 3)
            made.append(Workload(name, items, shape or SERVING_SHAPE))
        elif name == "chat":
            items, path = chat_items(impl, workloads, count(16), max(4, round(64 * scale)))
            made.append(Workload(name, items, {}, checkpoint=path))
        else:
            raise ValueError(f"unknown workload {name!r}: choose from seed, serving, long, poisson, chat")
    return made


# --- contenders --------------------------------------------------------------------------------

def cut(tokens: list, max_tokens: int, eos: int | None) -> list:
    """A generation as every engine reports it: at most max_tokens, ending at the first EOS."""
    tokens = list(tokens[:max_tokens])
    if eos is not None and eos in tokens:
        tokens = tokens[:tokens.index(eos) + 1]
    return tokens


class CoreSteps:
    """EngineCore behind Part V's step API (add_request(id, prompt, max_tokens); step() ->
    (id, new tokens, finished) triples), so Chapter 22's replay drives it like Chapter 24's."""

    def __init__(self, core, request_module):
        self.core, self.params = core, request_module.SamplingParams

    @property
    def has_unfinished(self) -> bool:
        return self.core.has_unfinished

    @property
    def steps(self) -> int:
        return self.core.steps

    def add_request(self, request_id: str, prompt_ids: list, max_tokens: int) -> None:
        self.core.add_request(request_id, prompt_ids, self.params(max_tokens=max_tokens))

    def step(self) -> list:
        outputs = self.core.step()
        for out in outputs:
            # The core turns a request's failure into an aborted request; a timed run cannot
            # go on without it, and an unwritten stub is reported as what it is.
            if out.error:
                stub = out.error.partition("NotImplementedError: ")[2]
                raise NotImplementedError(stub) if stub else RuntimeError(f"request {out.request_id}: {out.error}")
        return [(out.request_id, out.new_token_ids, out.finished) for out in outputs]


@dataclass
class Contender:
    """One way of serving a workload. make(workload) builds it (not timed); serve(engine,
    items) returns (outputs, records): records are Chapter 22's RequestRecords when the
    contender streams tokens (None for one-shot batched generate)."""
    label: str
    make: Callable
    serve: Callable
    streams: bool = True
    subset: int | None = None                         # serves only the first `subset` requests
    same_weights: bool = True                         # False: its tokens are not held to the others'
    same_kernels: bool = True                         # False: same weights, another program's arithmetic:
                                                      # held to the first contender by agreement, not equality
    weights: str | None = None                        # its weights' type when not the workload model's dtype
    best: dict = field(default_factory=dict)          # workload name -> (seconds, outputs, records, steps)
    rounds: dict = field(default_factory=dict)        # workload name -> every timed round's seconds


class Recorded:
    """A step-API engine that also keeps every request's tokens (replay keeps only times)."""

    def __init__(self, engine):
        self.engine, self.outputs = engine, {}

    @property
    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished

    @property
    def steps(self) -> int:
        return self.engine.steps

    def add_request(self, request_id: str, prompt_ids: list, max_tokens: int) -> None:
        self.outputs[request_id] = []
        self.engine.add_request(request_id, prompt_ids, max_tokens)

    def step(self) -> list:
        triples = self.engine.step()
        for request_id, tokens, _ in triples:
            self.outputs[request_id].extend(tokens)
        return triples


def step_contender(label: str, make: Callable, workloads) -> Contender:
    """A contender with Part V's step API, driven by Chapter 22's replay (arrival times honoured)."""
    def serve(engine, items):
        records = workloads.replay(engine, items)
        return engine.outputs, records
    return Contender(label, lambda workload: Recorded(make(workload)), serve)


def core_contender(impl, model, backend: str, block_size: int = 16, dtype: str = "auto", label: str | None = None,
                   **config) -> Contender:
    """Chapter 31's EngineCore with attention `backend`, a pool sized to the workload, and
    any further EngineConfig fields in `config` (Chapter 33's cuda_graphs, async_scheduling)."""
    serve_modules = {name: impl.load(f"serve.{name}") for name in ("engine", "config", "request")}
    workloads = impl.load("workloads")
    eos = getattr(model.cfg, "eos_token_id", None)

    def make(workload):
        blocks = sum(-(-(len(it.prompt_ids) + it.max_tokens) // block_size) for it in workload.items) + 8
        settings = serve_modules["config"].EngineConfig(num_blocks=blocks, block_size=block_size,
                                                        attention_backend=backend, dtype=dtype, **config)
        return CoreSteps(serve_modules["engine"].EngineCore(model, settings, eos_token_id=eos),
                         serve_modules["request"])

    return step_contender(label or f"core/{backend}", make, workloads)


def slots_contender(impl, model, max_slots: int = 64) -> Contender:
    continuous, workloads = impl.load("continuous"), impl.load("workloads")
    eos = getattr(model.cfg, "eos_token_id", None)

    def make(workload):
        return continuous.ContinuousBatchingEngine(model, num_slots=min(max_slots, len(workload.items)),
                                                   slot_len=workload.longest, eos_token_id=eos)

    return step_contender("ch24 slots", make, workloads)


def transformers_model(model):
    """transformers' class of our model's family (Qwen3ForCausalLM, LlamaForCausalLM, ...:
    ours carry the same names) with our model's config and weights (state dicts share names)."""
    import transformers
    transformers.logging.set_verbosity_error()
    family = type(model).__name__
    values = dataclasses.asdict(model.cfg)
    if not values.get("sliding_window"):         # our "no window" is 0; transformers' is None, and 0 means 0
        values.pop("sliding_window", None)
    config = getattr(transformers, family.replace("ForCausalLM", "Config"))(**values)
    theirs = getattr(transformers, family)(config).to(device=next(model.parameters()).device,
                                                      dtype=next(model.parameters()).dtype)
    theirs.load_state_dict(model.state_dict(), strict=False)     # tied heads: lm_head may be absent
    return theirs.eval()


def hf_contender(model, static: bool, batch: int | None = None, subset: int | None = None) -> Contender:
    """transformers' batched greedy generate: left-padded batches of `batch` requests (all at
    once when None), each running to its longest request's max_tokens. With `subset`, only
    the workload's first `subset` requests are served and timed: the contender's tok/s is
    their rate, which stands for the whole workload's (its JSON line says so)."""
    hf = transformers_model(model)
    eos = getattr(model.cfg, "eos_token_id", None)
    pad = 0

    @torch.inference_mode()
    def serve(engine, items):
        outputs = {}
        items = items[:subset] if subset else items
        size = batch or len(items)
        for first in range(0, len(items), size):
            group = items[first:first + size]
            width = max(len(it.prompt_ids) for it in group)
            ids = torch.tensor([[pad] * (width - len(it.prompt_ids)) + it.prompt_ids for it in group])
            mask = torch.tensor([[0] * (width - len(it.prompt_ids)) + [1] * len(it.prompt_ids) for it in group])
            device = next(hf.parameters()).device
            kwargs = {"cache_implementation": "static"} if static else {}
            out = hf.generate(ids.to(device), attention_mask=mask.to(device), do_sample=False,
                              max_new_tokens=max(it.max_tokens for it in group), eos_token_id=eos,
                              pad_token_id=pad, **kwargs)
            for row, it in enumerate(group):
                outputs[it.request_id] = out[row, width:].tolist()
        return outputs, None

    if batch == 1:
        label = "hf one at a time" + (f", first {subset}" if subset else "")
    else:
        label = "hf " + ("static" if static else "default") + (f", batches of {batch}" if batch else "")
    return Contender(label, lambda workload: None, serve, streams=False, subset=subset)


ONE_AT_A_TIME_SUBSET = 8       # requests transformers serves one by one; their rate stands for all


def hf_contenders(model, workload: Workload) -> list:
    """transformers' ways of serving `workload` on `model`: generate on the whole batch
    (default and static cache), its continuous batching, static batches of 16 when there
    are more requests, and one request after another as a naive server would (the first
    ONE_AT_A_TIME_SUBSET requests, timed). None when requests arrive while others run:
    generate cannot take them."""
    if workload.timed_arrivals:
        return []
    contenders = [hf_contender(model, static=False), hf_contender(model, static=True),
                  hf_continuous_contender(model)]
    if len(workload.items) > 16:
        contenders.append(hf_contender(model, static=True, batch=16))
    contenders.append(hf_contender(model, static=False, batch=1, subset=ONE_AT_A_TIME_SUBSET))
    return contenders


LLAMA_CPP_HOW = ("pip install llama-cpp-python (it builds llama.cpp; not a requirement of the course), then "
                 "rerun with the chat workload")


def llama_cpp_missing() -> str | None:
    """Why llama.cpp cannot be a contender here (None when its Python package imports)."""
    import shutil
    try:
        import llama_cpp  # noqa: F401
        return None
    except ImportError:
        found = [name for name in ("llama-server", "llama-batched-bench") if shutil.which(name)]
        if found:
            return (f"{', '.join(found)} found on PATH, but the bench drives llama.cpp through its Python "
                    f"package only")
        return "neither the llama_cpp Python package nor llama-server is installed"
    except OSError as exc:          # the package loads its compiled library on import
        return f"the llama_cpp package is installed but its library does not load ({exc})"


def llama_cpp_f32_file(gguf_path: str) -> str:
    """The GGUF file with every tensor dequantized to float32 by llama.cpp's own quantize tool,
    made once beside the file as shipped: the engine's float32 weights, since the course's
    reader dequantizes the same blocks with the same rule."""
    import ctypes
    from pathlib import Path

    import llama_cpp
    source = Path(gguf_path)
    target = source.with_name(source.name.split(".")[0] + ".F32.gguf")
    if not target.is_file():
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype, params.allow_requantize, params.pure = llama_cpp.LLAMA_FTYPE_ALL_F32, True, True
        partial = target.with_name(target.name + ".partial")       # never a half-written file under the name
        if llama_cpp.llama_model_quantize(str(source).encode(), str(partial).encode(), ctypes.byref(params)) != 0:
            raise RuntimeError(f"llama.cpp could not convert {source} to float32")
        partial.rename(target)
    return str(target)


class LlamaCppBatch:
    """One llama.cpp context (through llama-cpp-python's bindings of its C API) that serves a
    list of requests together, as llama.cpp's own batched bench and server do: every
    prompt in one batch, each request a sequence of its own in one shared KV cache, then one
    batch per step holding the next token of every unfinished request, greedy."""

    def __init__(self, gguf_path: str, threads: int, context: int, sequences: int, batch: int):
        import llama_cpp
        import llama_cpp._logger
        llama_cpp._logger.set_verbose(False)          # llama.cpp logs every load on stderr
        self.api = api = llama_cpp
        api.llama_backend_init()
        self.model = api.llama_model_load_from_file(gguf_path.encode(), api.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf_path}")
        settings = api.llama_context_default_params()
        settings.n_ctx, settings.n_batch, settings.n_ubatch = context, batch, min(batch, 512)
        settings.n_seq_max, settings.kv_unified = sequences, True    # one cache, shared by the sequences
        settings.n_threads = settings.n_threads_batch = threads
        self.context = api.llama_init_from_model(self.model, settings)
        if not self.context:
            raise RuntimeError(f"llama.cpp could not make a context of {context} tokens for {sequences} sequences")
        self.batch = api.llama_batch_init(batch, 0, 1)
        self.vocab = api.llama_vocab_n_tokens(api.llama_model_get_vocab(self.model))
        self.steps = 0

    def __del__(self):
        api = self.api
        if getattr(self, "batch", None) is not None:
            api.llama_batch_free(self.batch)
        if getattr(self, "context", None):
            api.llama_free(self.context)
        if getattr(self, "model", None):
            api.llama_model_free(self.model)

    def greedy_step(self, rows: list) -> list:
        """rows: (sequence, tokens, first position); feeds them in one llama_decode and
        returns each row's next token (the argmax of its last token's logits)."""
        import numpy as np
        batch, count = self.batch, 0
        for sequence, tokens, first in rows:
            for offset, token in enumerate(tokens):
                batch.token[count], batch.pos[count] = token, first + offset
                batch.n_seq_id[count], batch.seq_id[count][0] = 1, sequence
                batch.logits[count] = offset == len(tokens) - 1
                count += 1
        batch.n_tokens = count
        if self.api.llama_decode(self.context, batch) != 0:
            raise RuntimeError(f"llama_decode failed on a batch of {count} tokens")
        self.steps += 1
        logits = np.ctypeslib.as_array(self.api.llama_get_logits(self.context), shape=(len(rows), self.vocab))
        return logits.argmax(axis=1).tolist()


def llama_cpp_contenders(gguf_path: str, eos: int | None, float32_engine: bool) -> list:
    """llama.cpp on the workload's GGUF file: batched on the file dequantized to float32 (the
    engine's weights: held to the engine's tokens by agreement when the engine runs in
    float32, since its kernels sum in another order), batched on the file as shipped
    (SmolLM2's Q4_1, other weights: not compared), and one request after another on the
    shipped file through llama-cpp-python's Llama, as a single-user program uses it. All
    greedy, with the workload's thread count."""
    from llama_cpp import Llama

    def batched(path: str):
        def make(workload):
            prompts = sum(len(it.prompt_ids) for it in workload.items)
            room = sum(len(it.prompt_ids) + it.max_tokens for it in workload.items)
            return LlamaCppBatch(path, workload.threads, room + 256, len(workload.items),
                                 max(prompts, len(workload.items)))

        def serve(engine, items):
            outputs: dict = {it.request_id: [] for it in items}
            rows = [(sequence, list(it.prompt_ids), 0) for sequence, it in enumerate(items)]
            while rows:
                following = []
                for (sequence, tokens, first), token in zip(rows, engine.greedy_step(rows)):
                    it = items[sequence]
                    generated = outputs[it.request_id]
                    generated.append(token)
                    if len(generated) < it.max_tokens and token != eos:
                        following.append((sequence, [token], first + len(tokens)))
                rows = following
            return outputs, None
        return make, serve

    def one_at_a_time(llm, items):
        outputs = {}
        for it in items:
            tokens: list = []
            for token in llm.generate(it.prompt_ids, temp=0.0, top_k=1, repeat_penalty=1.0, reset=True):
                tokens.append(token)
                if len(tokens) >= it.max_tokens or token == eos:
                    break
            outputs[it.request_id] = tokens
        return outputs, None

    def single(workload):
        return Llama(model_path=gguf_path, n_ctx=workload.longest + 8, n_threads=workload.threads,
                     n_threads_batch=workload.threads, verbose=False)

    shipped = gguf_path.rsplit(".", 2)[-2]        # the quantization in the file's name: Q4_1
    make_f32, serve_f32 = batched(llama_cpp_f32_file(gguf_path))
    make_shipped, serve_shipped = batched(gguf_path)
    return [Contender("llama.cpp batched, F32", make_f32, serve_f32, streams=False, same_weights=float32_engine,
                      same_kernels=False, weights="float32"),
            Contender(f"llama.cpp batched, {shipped}", make_shipped, serve_shipped, streams=False, same_weights=False,
                      weights=shipped),
            Contender(f"llama.cpp one at a time, {shipped}", single, one_at_a_time, streams=False,
                      same_weights=False, weights=shipped)]


# --- reduced precision: agreement instead of equality -----------------------------------------

def agreement(outputs: dict, reference: dict, items: list, logits_of: Callable) -> dict:
    """How closely `outputs` follow `reference` (both {request_id: tokens}, already cut) when
    the two ran in a reduced precision, where bit equality is not the rule: requests whose
    tokens are identical, the share of the reference's tokens inside each request's common
    prefix, and at every first divergence the margin by which `logits_of(prompt + prefix)`
    (the reference model's logits for the next token, float32 [vocab]) preferred its own
    token to the other's. A rounding difference shows as a near tie (a margin of a few
    hundredths of a logit in bfloat16); a bug shows as a wide margin or a low share."""
    prompts = {it.request_id: it.prompt_ids for it in items}
    same, common, total, margins = 0, 0, 0, []
    for rid, want in reference.items():
        got = outputs[rid]
        total += len(want)
        prefix = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
        common += prefix
        if got == want:
            same += 1
        elif prefix < min(len(want), len(got)):       # a different token, not only a different length
            logits = logits_of(prompts[rid] + want[:prefix])
            margins.append((float(logits[want[prefix]] - logits[got[prefix]]), rid, prefix))
    widest = max(margins, default=None)
    return {"identical_requests": f"{same} of {len(reference)}",
            "tokens_in_common_prefix": round(common / max(1, total), 3),
            "first_divergences": len(margins),
            "widest_divergence_margin": None if widest is None else round(widest[0], 4),
            "widest_divergence_at": None if widest is None else f"{widest[1]} token {widest[2]}"}


def next_token_logits(model) -> Callable:
    """logits_of for agreement(): a causal LM (ours or transformers') on one token list."""
    device = next(model.parameters()).device

    @torch.inference_mode()
    def logits_of(tokens: list) -> torch.Tensor:
        out = model(torch.tensor([tokens], device=device))
        return (out.logits if hasattr(out, "logits") else out)[0, -1].float().cpu()
    return logits_of


def hf_continuous_contender(model, block_size: int = 16) -> Contender:
    """transformers' own continuous batching (the manager behind `generate_batch`: a paged KV
    cache, requests joining and leaving the batch step by step), greedy, each request with
    its own max_tokens and the model's EOS: the strongest transformers path, and the closest
    to the engine's design. Like the core, it gets a pool sized to the workload (blocks of
    `block_size` tokens) and a 2,048-token step budget, and builds its manager untimed (in
    make): sized from free memory instead, its setup alone fills tens of gigabytes."""
    import logging

    from transformers import ContinuousBatchingConfig, GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints
    hf = transformers_model(model)
    eos = getattr(model.cfg, "eos_token_id", None)
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)    # per-run notices, not results

    @torch.inference_mode()
    def make(workload):
        longest = max(it.max_tokens for it in workload.items)
        settings = GenerationConfig(do_sample=False, eos_token_id=-1 if eos is None else eos, pad_token_id=0,
                                    max_new_tokens=longest)
        blocks = sum(-(-(len(it.prompt_ids) + it.max_tokens) // block_size) for it in workload.items) + 8
        sizes = ContinuousBatchingConfig(block_size=block_size, num_blocks=blocks, max_batch_tokens=2048)
        hints = WorkloadHints(max_prompt_length=max(len(it.prompt_ids) for it in workload.items),
                              max_generated_length=longest, num_requests=len(workload.items))
        manager = hf.init_continuous_batching(settings, sizes, hints)
        manager.warmup()
        return manager

    @torch.inference_mode()
    def serve(manager, items):
        outputs: dict[str, list] = {}
        manager.start()
        try:
            for it in items:
                manager.add_request(list(it.prompt_ids), request_id=it.request_id, max_new_tokens=it.max_tokens)
            while len(outputs) < len(items):
                result = manager.get_result(timeout=1)
                if result is not None and result.is_finished():
                    outputs[result.request_id] = list(result.generated_tokens)
                elif result is None and not manager.is_running():
                    raise RuntimeError(f"transformers' continuous batching stopped with {len(outputs)} of "
                                       f"{len(items)} requests done")
        finally:
            # Ask the loop to end and return: joining it waits out its idle poll (over a
            # second), teardown that no request waits for.
            manager.stop(block=False)
        return outputs, None

    return Contender("hf generate_batch", make, serve, streams=False)


# --- the machine's limits (a roofline) --------------------------------------------------------

def _best_seconds(work: Callable, rounds: int) -> float:
    work()                                           # first call: allocation, kernel choice
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        work()
        best = min(best, time.perf_counter() - start)
    return best


def machine_limits(device: torch.device, dtypes: list, size: int = 2048, rounds: int = 5) -> dict:
    """This machine's two roofs at the current torch thread count: the matmul rate in each of
    `dtypes` (FLOP/s of a size x size product, the best of `rounds`) and the memory bandwidth
    (bytes read and written per second by a copy of 256 MiB, far larger than any cache)."""
    limits: dict = {"threads": torch.get_num_threads(), "matmul_tflops": {}}
    for dtype in dtypes:
        a = torch.randn(size, size, device=device).to(dtype)
        b = torch.randn(size, size, device=device).to(dtype)
        seconds = _best_seconds(lambda a=a, b=b: (a @ b, _sync(device)), rounds)
        limits["matmul_tflops"][str(dtype).removeprefix("torch.")] = round(2 * size ** 3 / seconds / 1e12, 3)
    source = torch.empty(64 << 20, dtype=torch.float32, device=device)
    target = torch.empty_like(source)
    seconds = _best_seconds(lambda: (target.copy_(source), _sync(device)), rounds)
    limits["memory_gb_s"] = round(2 * source.numel() * 4 / seconds / 1e9, 1)
    return limits


def matmul_weights(model) -> int:
    """Weights that take part in a matrix product per token (every nn.Linear, the LM head
    among them even when tied to the embedding, which is only gathered)."""
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))


def roofline_share(line: dict, workload: Workload, limits: dict) -> dict:
    """What share of this machine's limits a contender's line reached. The model's matmul
    work is 2 FLOPs per weight per token, prompt and output tokens alike (attention and
    prefix-cache hits aside: a lower bound); the bytes are one read of every weight per
    step (engines report their steps; weights in a GGUF block type such as Q4_1 get no
    bandwidth share). The slower of the two roofs is the step's limit."""
    dtype = line["dtype"]
    weights = matmul_weights(workload.model)
    served = workload.items[:line["requests"]]
    tokens = sum(len(it.prompt_ids) for it in served) + line["output_tokens"]
    peak = limits["matmul_tflops"].get(dtype)
    share: dict = {}
    if peak:
        share["of_matmul_peak"] = round(2 * weights * tokens / line["seconds"] / (peak * 1e12), 3)
    if line.get("steps") and isinstance(getattr(torch, dtype, None), torch.dtype):     # not a GGUF block type
        element = torch.empty((), dtype=getattr(torch, dtype)).element_size()
        share["of_memory_bandwidth"] = round(line["steps"] * weights * element / line["seconds"]
                                             / (limits["memory_gb_s"] * 1e9), 3)
    return share


# --- running -----------------------------------------------------------------------------------

def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def warm_up(contender: Contender, workload: Workload) -> None:
    """Serve the workload's first two requests once, untimed: first calls pay one-off costs
    (allocation, kernel choice, lazy imports)."""
    warm = Workload(workload.name, workload.items[:2], workload.shape)
    contender.serve(contender.make(warm), warm.items)


def timed_run(contender: Contender, workload: Workload, device: torch.device) -> None:
    engine = contender.make(workload)
    _sync(device)
    start = time.perf_counter()
    outputs, records = contender.serve(engine, workload.items)
    _sync(device)
    seconds = time.perf_counter() - start
    contender.rounds.setdefault(workload.name, []).append(seconds)
    best = contender.best.get(workload.name)
    if best is None or seconds < best[0]:
        contender.best[workload.name] = (seconds, outputs, records, getattr(engine, "steps", None), engine)


def report(contender: Contender, workload: Workload, eos: int | None, workloads,
           reference_outputs: dict | None = None) -> tuple[dict, dict]:
    """The JSON line of one contender on one workload, from its fastest run."""
    seconds, outputs, records, steps, engine = contender.best[workload.name]
    items = {it.request_id: it for it in workload.items}
    outputs = {rid: cut(tokens, items[rid].max_tokens, eos) for rid, tokens in outputs.items()}
    tokens = sum(len(v) for v in outputs.values())
    line = {"workload": workload.name, "contender": contender.label, "threads": workload.threads,
            "dtype": contender.weights or str(next(workload.model.parameters()).dtype).removeprefix("torch."),
            "requests": len(outputs),
            "output_tokens": tokens, "seconds": round(seconds, 3), "tok_s": round(tokens / seconds, 1)}
    rounds = contender.rounds.get(workload.name, [])
    if len(rounds) > 1:                  # the spread a busy machine gives: every round's rate
        line["tok_s_rounds"] = [round(tokens / s, 1) for s in rounds]
    if len(outputs) < len(items):
        line["rate_of_first_requests"] = f"{len(outputs)} of {len(items)}"
    if steps is not None:
        line["steps"] = steps
    if records is not None:
        line.update(latency_summary(workloads, records))
    if reference_outputs is not None:
        differ = [rid for rid in outputs if outputs[rid] != reference_outputs[rid]]
        line["identical"] = not differ
        if differ:
            line["differing_requests"] = differ[:8]
    return line, outputs


def latency_summary(workloads, records: dict) -> dict:
    """TTFT and TPOT percentiles in milliseconds, from Chapter 22's summarize."""
    summary = workloads.summarize(list(records.values()))
    return {f"{metric}_p{q}_ms": _ms(summary[f"{metric}_p{q}"]) for metric in ("ttft", "tpot") for q in (50, 99)}


def _ms(seconds):
    return None if seconds is None else round(seconds * 1000, 2)


class Progress:
    """A one-line progress bar on stderr (the JSON lines go to stdout)."""

    def __init__(self, total: int, enabled: bool = True):
        self.total, self.done, self.enabled = total, 0, enabled

    def show(self, label: str) -> None:
        if self.enabled:
            filled = round(30 * self.done / max(1, self.total))
            sys.stderr.write(f"\r[{'#' * filled}{'.' * (30 - filled)}] {self.done}/{self.total} {label[:60]:<60}")
            sys.stderr.flush()

    def tick(self):
        self.done += 1

    def close(self):
        if self.enabled:
            sys.stderr.write("\n")


# --- where a core step's time goes ------------------------------------------------------------

PROFILE_PARTS = ("schedule", "build_batch", "attention", "lm_head", "other_forward", "sample", "bookkeeping")


def profile_core(core, device: torch.device) -> dict:
    """Wrap the parts of one EngineCore's step with timers; returns a dict of seconds that
    fills as the engine runs. Instance attributes shadow the methods, so nothing else changes."""
    spent = dict.fromkeys(PROFILE_PARTS + ("step",), 0.0)

    def timed(part, fn):
        def wrapper(*args, **kwargs):
            _sync(device)
            start = time.perf_counter()
            result = fn(*args, **kwargs)
            _sync(device)
            spent[part] += time.perf_counter() - start
            return result
        return wrapper

    runner = core.runner
    core.scheduler.schedule = timed("schedule", core.scheduler.schedule)
    runner.prepare = timed("build_batch", runner.prepare)
    runner.execute = timed("forward", runner.execute)
    runner.backend.forward = timed("attention", runner.backend.forward)
    runner.backend.write = timed("attention", runner.backend.write)
    runner.flat.compute_logits = timed("lm_head", runner.flat.compute_logits)
    spent["forward"] = 0.0
    sampler = core.sampler
    core.sampler = timed("sample", sampler)
    core.step = timed("step", core.step)
    return spent


def profile_shares(spent: dict) -> dict:
    """Seconds by part -> percent of step time (forward minus attention and LM head is
    'other_forward': projections, MLP, norms, RoPE; what the step does after sampling is
    'bookkeeping')."""
    total = spent["step"] or 1.0
    other = spent["forward"] - spent["attention"] - spent["lm_head"]
    parts = dict(spent, other_forward=other,
                 bookkeeping=total - spent["forward"] - spent["schedule"] - spent["build_batch"] - spent["sample"])
    return {part: round(100 * parts[part] / total, 1) for part in PROFILE_PARTS}


# --- the Triton kernel's memory bandwidth ---------------------------------------------------------

def kernel_bandwidth(impl, device: torch.device, shape: dict, requests: int = 64, context: int = 2048,
                     block_size: int = 16, rounds: int = 20) -> dict:
    """Time one launch of Chapter 32's paged_attention on a decode step of `requests`
    requests with `context` tokens each, with one layer of `shape`'s heads; return the
    bytes it must read (every context's keys and values, the queries) and write (the
    output) over its median time, beside the device's datasheet bandwidth when known
    (solutions' cost.GPUS). A decode step reads each key and value once, so a memory-bound
    kernel's speed is exactly this share of the peak."""
    kernels, batch = impl.load("paged_kernels"), impl.load("serve.batch")
    heads, kv_heads = shape["num_attention_heads"], shape["num_key_value_heads"]
    dim = shape.get("head_dim") or shape["hidden_size"] // heads
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    per_request = -(-context // block_size)
    generator = torch.Generator().manual_seed(0)
    tables = torch.randperm(requests * per_request, generator=generator).view(requests, per_request)
    pools = [torch.randn(requests * per_request + 1, block_size, kv_heads, dim, generator=generator).to(device, dtype)
             for _ in "kv"]
    q = torch.randn(requests, heads, dim, generator=generator).to(device, dtype)
    starts, lengths = list(range(requests + 1)), [context] * requests
    slots = [int(tables[r, (context - 1) // block_size]) * block_size + (context - 1) % block_size
             for r in range(requests)]
    meta = batch.BatchMeta(query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
                           seq_lens=torch.tensor(lengths, dtype=torch.int32, device=device),
                           block_table=tables.to(device=device, dtype=torch.int32),
                           slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device), block_size=block_size,
                           query_start_loc_cpu=starts, seq_lens_cpu=lengths, max_query_len=1, max_seq_len=context)
    tiles = kernels.tile_tensors(meta, 16, device)
    seconds = []
    for round_ in range(rounds + 3):                # three warm-up launches (the first compiles)
        _sync(device)
        start = time.perf_counter()
        kernels.paged_attention(q, pools[0], pools[1], meta, tiles=tiles)
        _sync(device)
        if round_ >= 3:
            seconds.append(time.perf_counter() - start)
    median = sorted(seconds)[len(seconds) // 2]
    moved = (2 * requests * context * kv_heads + 2 * requests * heads) * dim * q.element_size()
    line = {"kernel": "paged_attention (Chapter 32, Triton)", "requests": requests, "context": context,
            "heads": heads, "kv_heads": kv_heads, "head_dim": dim, "dtype": str(dtype).removeprefix("torch."),
            "bytes_moved": moved, "median_us": round(median * 1e6, 1), "achieved_GB_s": round(moved / median / 1e9, 1)}
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        known = [hw for key, hw in impl.load("cost").GPUS.items() if key.split("-")[0] in name]
        if known:
            line.update(datasheet=known[0].name, datasheet_GB_s=round(known[0].bandwidth / 1e9),
                        share_of_datasheet=round(moved / median / known[0].bandwidth, 3))
    return line


# --- the plot ----------------------------------------------------------------------------------

def plot(lines: list, path):
    """Throughput bars per workload (relative to Chapter 24's engine where it ran) and p99
    TPOT bars of the streaming contenders."""
    from matplotlib import colormaps
    from matplotlib.figure import Figure  # not pyplot: leave a notebook's backend alone
    from matplotlib.patches import Rectangle

    from course.diagrams import COLUMN_INCHES
    runs = [line for line in lines if "contender" in line]
    names = list(dict.fromkeys(line["workload"] for line in runs))
    # One panel above the other, as wide as the book's column: side by side, the book would
    # shrink the labels below what a reader can read.
    fig = Figure(figsize=(COLUMN_INCHES, 7.0))
    axes = fig.subplots(2, 1)
    labels = list(dict.fromkeys(line["contender"] for line in runs))
    colours = {label: colormaps["tab10"](i % 10) for i, label in enumerate(labels)}
    width = 0.8 / max(1, len(labels))
    for w, name in enumerate(names):
        mine = {line["contender"]: line for line in runs if line["workload"] == name}
        base = mine.get("ch24 slots", next(iter(mine.values())))["tok_s"]
        for i, label in enumerate(labels):
            if label in mine:
                axes[0].bar(w + i * width, mine[label]["tok_s"] / base, width, color=colours[label],
                            label=label if w == 0 else None)
                tpot = mine[label].get("tpot_p99_ms")
                if tpot is not None:
                    axes[1].bar(w + i * width, tpot, width, color=colours[label])
    for ax, title in ((axes[0], "throughput, relative to Chapter 24's engine"),
                      (axes[1], "p99 time per output token (ms), streaming engines")):
        ax.set_xticks([w + 0.4 - width / 2 for w in range(len(names))], names)
        ax.set_title(title)
    axes[0].axhline(1.0, color="grey", lw=0.8)
    handles = [Rectangle((0, 0), 1, 1, color=colours[label]) for label in labels]
    fig.legend(handles, labels, loc="lower center", ncol=min(3, len(labels)), frameon=False)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    fig.savefig(path, dpi=110)
    return path


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a and b else None


def summarise(workload: Workload, lines: list) -> dict:
    """The ratios the book quotes, for one workload."""
    tok = {line["contender"]: line["tok_s"] for line in lines}
    hf = {label: value for label, value in tok.items() if label.startswith("hf")}
    hf_static = max((v for k, v in hf.items() if "static" in k), default=None)
    out = {"workload": workload.name, "outputs_identical": all(line.get("identical", True) for line in lines)}
    held = [line for line in lines if "agreement" in line]
    if held:       # a reduced-precision run, or another program on the same weights: agreement was asked
        if not any("identical" in line for line in lines):
            del out["outputs_identical"]
        out["widest_divergence_margin"] = max((line["agreement"]["widest_divergence_margin"] or 0.0
                                               for line in held), default=0.0)
    for label in (k for k in tok if k.startswith("core/")):
        backend = label.split("/", 1)[1]
        out[f"{backend}_vs_ch24"] = ratio(tok[label], tok.get("ch24 slots"))
        if hf:
            out[f"{backend}_vs_hf_best"] = ratio(tok[label], max(hf.values()))
        if hf_static:
            out[f"{backend}_vs_hf_static"] = ratio(tok[label], hf_static)
        if "hf default" in tok:
            out[f"{backend}_vs_hf_default"] = ratio(tok[label], tok["hf default"])
        for peer in (k for k in tok if k.startswith("llama.cpp")):      # "llama.cpp batched, F32" -> ..._batched_F32
            name = peer.replace("llama.cpp", "llama_cpp").replace(", ", "_").replace(" ", "_")
            out[f"{backend}_vs_{name}"] = ratio(tok[label], tok[peer])
        alone = next((v for k, v in tok.items() if k.startswith("hf one at a time")), None)
        if alone:
            out[f"{backend}_vs_hf_one_at_a_time"] = ratio(tok[label], alone)
    tpot = {line["contender"]: line.get("tpot_p99_ms") for line in lines if line.get("tpot_p99_ms")}
    for label in (k for k in tpot if k.startswith("core/")):
        if "ch24 slots" in tpot:
            out[f"{label.split('/', 1)[1]}_tpot_p99_vs_ch24"] = ratio(tpot[label], tpot["ch24 slots"])
    return {k: v for k, v in out.items() if v is not None}

