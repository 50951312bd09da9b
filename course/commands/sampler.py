"""Chapter 34: what the full sampler costs inside an engine step.

Runs --requests decoding requests (64 by default) through the engine core on a model with
Qwen3's vocabulary of 151,936 tokens, and times --steps decode steps (after every prompt
is prefilled) for each sampling setting in turn:

    simple-greedy   Chapter 31's SimpleSampler, greedy (the baseline: one argmax)
    greedy          the full sampler, greedy rows only
    top-p           temperature 0.8, top_k 50, top_p 0.95, half the requests seeded
    everything      top-p's settings plus min_p, repetition/presence/frequency penalties,
                    a logit_bias, bad words and 5 logprobs per token

Prints one JSON line per setting: the mean step time, the mean time inside the sampler
(the call from EngineCore.step, its device work synchronized on CUDA) and the sampler's
share of the step. On a CPU the clock is the process's CPU time (torch runs one thread by
default), so other processes on a shared machine do not inflate the numbers; on CUDA it is
wall time. The model is the tiny test model's two layers (--shape tiny, where
the LM head is most of the forward) or a model shaped like Qwen3-0.6B with deterministic
random weights (--shape qwen3-0.6b: 28 layers, hidden 1,024; slow on a CPU).
"""
import json
import random
import time

from course.cli import add_device_argument, add_impl_argument, add_threads_argument
from course.models import QWEN3_VOCAB_SIZE

SHAPES = {
    "tiny": {},
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, max_position_embeddings=4096),
}


def add_arguments(parser):
    add_impl_argument(parser)
    add_device_argument(parser)
    parser.add_argument("--requests", type=int, default=64, help="running requests (default 64)")
    parser.add_argument("--vocab-size", type=int, default=QWEN3_VOCAB_SIZE,
                        help=f"vocabulary (default {QWEN3_VOCAB_SIZE:,}, Qwen3's)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny", help="model shape (default tiny)")
    parser.add_argument("--steps", type=int, default=5, help="timed decode steps per setting (default 5)")
    parser.add_argument("--prompt-len", type=int, default=32, help="tokens per prompt (default 32)")
    add_threads_argument(parser)


def settings(serve, index, max_tokens):
    """name -> the SamplingParams of request `index` under that setting; none ends before `max_tokens`."""
    params = serve.request.SamplingParams
    sampled = dict(temperature=0.8, top_k=50, top_p=0.95, seed=index if index % 2 else None)
    return {
        "simple-greedy": params(max_tokens=max_tokens, ignore_eos=True),
        "greedy": params(max_tokens=max_tokens, ignore_eos=True),
        "top-p": params(max_tokens=max_tokens, ignore_eos=True, **sampled),
        "everything": params(max_tokens=max_tokens, ignore_eos=True, min_p=0.01, repetition_penalty=1.1,
                             presence_penalty=0.2, frequency_penalty=0.1, logit_bias={17: 2.0, 99: -5.0},
                             bad_words_token_ids=((5,), (6, 7)), logprobs=5, **sampled),
    }


class TimedSampler:
    """Wraps the engine's sampler and adds up the seconds spent inside it."""

    def __init__(self, inner, device):
        self.inner, self.device, self.seconds = inner, device, 0.0

    def __call__(self, logits, requests, generators):
        start = clock(self.device)
        result = self.inner(logits, requests, generators)
        self.seconds += clock(self.device) - start
        return result


def clock(device):
    """Seconds: CPU time of this process on a CPU, wall time after a synchronize on CUDA."""
    if device.type != "cuda":
        return time.process_time()
    import torch
    torch.cuda.synchronize()
    return time.perf_counter()


def measure(serve, model, device, name, requests, steps, vocab_size, prompt_len):
    sampled_per_request = steps + 2                 # the prefill's token, the warm-up's, the timed steps'
    blocks_each = -(-(prompt_len + sampled_per_request) // 16)
    config = serve.config.EngineConfig(num_blocks=requests * blocks_each, block_size=16, max_num_seqs=requests,
                                       max_num_batched_tokens=max(2048, requests * (prompt_len + 1)),
                                       sampler="simple" if name == "simple-greedy" else "full")
    # The sampler the engine would build for itself (seeded by config.seed), timed, handed in.
    import torch
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(config.seed)
    inner = (serve.sampler.SimpleSampler if config.sampler == "simple" else serve.sampler.Sampler)(generator)
    timed = TimedSampler(inner, device)
    engine = serve.engine.EngineCore(model, config, eos_token_id=None, sampler=timed)
    rng = random.Random(0)
    for i in range(requests):
        prompt = [rng.randrange(vocab_size) for _ in range(prompt_len)]
        engine.add_request(f"r{i}", prompt, settings(serve, i, sampled_per_request)[name])
    engine.step()                                   # every prompt in one step
    engine.step()                                   # one warm-up decode step
    timed.seconds = 0.0                             # only the timed steps count
    start = clock(device)
    for _ in range(steps):
        engine.step()
    step_s = (clock(device) - start) / steps
    sampler_s = timed.seconds / steps
    return {"setting": name, "requests": requests, "vocab": vocab_size, "step_ms": round(step_s * 1e3, 2),
            "sampler_ms": round(sampler_s * 1e3, 2), "sampler_share": round(sampler_s / step_s, 3)}


def run(args):
    from course.commands._setup import prepare, serve_modules
    from course.models import tiny_qwen3
    impl, device = prepare(args)
    serve = serve_modules(impl, "sampler")
    model = tiny_qwen3(impl.package, device=device, vocab_size=args.vocab_size, **SHAPES[args.shape])
    for name in settings(serve, 0, max_tokens=1):
        line = measure(serve, model, device, name, args.requests, args.steps, args.vocab_size, args.prompt_len)
        print(json.dumps({"shape": args.shape, "device": str(device), **line}), flush=True)
