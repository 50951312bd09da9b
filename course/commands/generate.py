"""Chapters 14-17: generate text with the tiny model or a real checkpoint.

The prompt is --prompt TEXT (through the byte tokenizer of the tiny model, or the
checkpoint's own tokenizer with --model; `--model smollm2` fetches SmolLM2-135M-Instruct
on first use and reads its tokenizer from the GGUF file) or --ids 1,2,3. Prints the new token ids, their
text, and one JSON line: prompt_tokens, new_tokens, finish_reason, seconds, tok_s (new
tokens per second of the whole generate call), and prefill_ms / prefill_tok_s (one forward
over the prompt, timed on its own: Chapter 15's contrast between the two regimes).
--no-cache recomputes the whole sequence every step (Chapter 8) instead of keeping a KV
cache (Chapter 16). --profile adds a JSON line with the prompt forward's time per kind of
work (Chapter 14's profiler shares).
"""
import json

from course.cli import CommandError, add_device_argument, add_impl_argument, add_model_argument, resolve_device

DEFAULT_PROMPT = "The KV cache"
DTYPES = ("float32", "bfloat16", "float16")


def add_arguments(parser):
    add_impl_argument(parser)
    add_device_argument(parser)
    add_model_argument(parser)
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--prompt", default=None, help=f"prompt text (default {DEFAULT_PROMPT!r})")
    source.add_argument("--ids", default=None, help="prompt token ids, comma-separated: 1,2,3")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="most tokens to generate (default 32)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    parser.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0: all)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus mass (1.0: all)")
    parser.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min-p x the top one")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampling generator (default 0)")
    parser.add_argument("--dtype", choices=DTYPES, default=None,
                        help="weights' dtype (default for --model: the device's, Chapter 40: bfloat16 where it "
                             "computes, float32 on a CPU)")
    parser.add_argument("--no-cache", action="store_true", help="full recompute every step (Chapter 8)")
    parser.add_argument("--chat", action="store_true",
                        help="wrap --prompt in the checkpoint's chat template (needs --model with a tokenizer)")
    parser.add_argument("--profile", action="store_true", help="print op-kind shares of the prompt's forward")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: 1 on CPU, torch's choice on CUDA)")


def printable(text):
    """Text with control characters (other than newline and tab) shown as \\xNN escapes:
    the tiny model's random bytes would otherwise garble the terminal."""
    return "".join(c if c.isprintable() or c in "\n\t" else f"\\x{ord(c):02x}" for c in text)


def _load(impl, args, device, dtype):
    """(model, tokenizer, stop ids, label) for the tiny model or --model PATH."""
    import torch
    if args.model is None:
        from course.models import tiny_qwen3
        model = tiny_qwen3(impl.package, device=device, dtype=dtype or torch.float32)
        tokenizer = impl.load("tokenizer").ByteTokenizer(model.cfg.vocab_size)
        return model, tokenizer, (tokenizer.eos_token_id,), "tiny"
    if dtype is None:
        from course.cli import default_dtype
        dtype = default_dtype(device)
    from course.commands._setup import SMOLLM2_CHAPTERS, gguf_tokenizer, model_source, needs_chapters
    path = model_source(args.model)
    if str(path).endswith(".gguf"):              # Chapters 36, 39, 42: the file brings weights and tokenizer
        try:
            with needs_chapters(f"--model {args.model}", SMOLLM2_CHAPTERS, impl):
                model = impl.load("checkpoint").load_model(path, dtype=dtype, device=device)
                tokenizer = gguf_tokenizer(impl, path)
        except (OSError, ValueError) as exc:
            raise CommandError(f"--model {args.model}: {exc}") from None
        return model, tokenizer, (tokenizer.eos_token_id,), str(args.model)
    pipeline = impl.load("pipeline")
    try:
        model = impl.load("checkpoint").load_checkpoint(args.model, dtype=dtype, device=device)
    except (OSError, ValueError) as exc:          # CheckpointError is a ValueError
        raise CommandError(f"--model {args.model}: {exc}") from None
    tokenizer = pipeline.load_tokenizer(args.model, model.cfg.vocab_size)
    return model, tokenizer, pipeline.stop_token_ids(args.model), str(args.model)


def _prompt_ids(args, tokenizer, vocab_size):
    if args.ids is not None:
        try:
            ids = [int(piece) for piece in args.ids.split(",") if piece.strip()]
        except ValueError:
            raise CommandError(f"--ids: expected comma-separated integers, got {args.ids!r}") from None
        bad = [i for i in ids if not 0 <= i < vocab_size]
        if bad:
            raise CommandError(f"--ids: {bad} outside the vocabulary 0..{vocab_size - 1}")
        return ids
    text = DEFAULT_PROMPT if args.prompt is None else args.prompt
    if args.chat:
        if hasattr(tokenizer, "encode_chat"):          # Chapter 36's tokenizer renders the file's own template
            return tokenizer.encode_chat([{"role": "user", "content": text}])
        if not hasattr(tokenizer, "chat_prompt"):
            raise CommandError("--chat needs a checkpoint whose directory ships a tokenizer (--model PATH)")
        return tokenizer.chat_prompt(text)
    return tokenizer.encode(text)


def run(args):
    import time

    import torch

    from course.impl import have_reference, load, reference
    impl = load(args.impl)
    device = resolve_device(args.device)
    threads = args.threads if args.threads is not None else (1 if device.type == "cpu" else None)
    if threads is not None:
        if threads < 1:
            raise CommandError(f"--threads must be at least 1, got {threads}")
        torch.set_num_threads(threads)
    if args.max_new_tokens < 1:
        raise CommandError("--max-new-tokens must be at least 1")
    dtype = getattr(torch, args.dtype) if args.dtype else None
    model, tokenizer, stop_ids, label = _load(impl, args, device, dtype)
    ids = _prompt_ids(args, tokenizer, model.cfg.vocab_size)
    if not ids:
        raise CommandError("the prompt is empty")
    if len(ids) >= model.context_limit:
        raise CommandError(f"the prompt has {len(ids)} tokens; the model's context holds {model.context_limit}")

    # Measurement tools come from the reference, so a learner's engine is timed fairly
    # whatever chapter it has reached; what runs is the engine's own model and generate. A
    # learner's edition has no reference: there the engine's own Chapter 14 tools time it.
    ref = reference() if have_reference() else impl
    use_cache = not args.no_cache
    prompt = torch.tensor([ids], device=device)

    def prefill():
        with torch.inference_mode():
            cache = impl.kv_cache.KVCache.for_model(model, 1, len(ids)) if use_cache else None
            model(prompt, cache=cache)

    prefill_s = ref.profiling.time_it(prefill, warmup=1, repeats=3, device=device).median
    generator = torch.Generator(device=device).manual_seed(args.seed)
    generate = impl.sampling.generate
    options = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p)
    generate(model, ids, 2, stop_token_ids=stop_ids, use_cache=use_cache, **options,
             generator=torch.Generator(device=device).manual_seed(args.seed))          # warm-up
    sync = ref.profiling.synchronizer(device)
    sync()
    start = time.perf_counter()
    new = generate(model, ids, args.max_new_tokens, stop_token_ids=stop_ids, use_cache=use_cache, **options,
                   generator=generator)
    sync()
    seconds = time.perf_counter() - start
    if new and new[-1] in stop_ids:
        reason, shown = "stop", new[:-1]
    elif len(new) == args.max_new_tokens:
        reason, shown = "length", new
    else:
        reason, shown = "context", new

    print(f"prompt ids: {ids if len(ids) <= 32 else ids[:16] + ['...'] + ids[-8:]}")
    print(f"new ids:    {new}")
    print(f"text:       {printable(tokenizer.decode(shown))}")
    print(json.dumps({"impl": args.impl, "model": label, "device": device.type,
                      "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
                      "cache": use_cache, "prompt_tokens": len(ids), "new_tokens": len(new),
                      "finish_reason": reason, "seconds": round(seconds, 4),
                      "tok_s": round(len(new) / seconds, 1) if seconds > 0 else None,
                      "prefill_ms": round(prefill_s * 1e3, 3),
                      "prefill_tok_s": round(len(ids) / prefill_s, 1) if prefill_s > 0 else None}))
    if args.profile:
        prof = impl.profiling.profile_forward(model, prompt)
        print(json.dumps({"profile": "prompt forward", "tokens": len(ids), "total_ms": round(prof.total * 1e3, 3),
                          "device_time": prof.device_time,
                          **{f"{kind}_ms": round(s * 1e3, 3) for kind, s in prof.shares.items()},
                          **{f"{kind}_share": round(f, 3) for kind, f in prof.fractions().items()}}))
    return 0
