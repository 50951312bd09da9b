"""Chat with a real model, the reply streamed token by token through the Chapter 31 engine.

`python run.py chat --model smollm2 --prompt "What is the capital of France?"` answers
one question; without --prompt it reads your lines from the terminal and keeps the
conversation (an empty line or end of input quits). The model and its tokenizer come from
one GGUF file: Chapter 39's reader loads the weights (Chapter 42 picks the family),
Chapter 36's tokenizer renders the file's chat template and the IncrementalDetokenizer
prints each piece of text as soon as it can no longer change. The engine is the Chapter 31
EngineCore; the reply ends at the model's end-of-turn token or --max-tokens. A short
summary (tokens, seconds, tok/s) goes to stderr.
"""
import sys
import time

from course.cli import CommandError, add_device_argument, add_impl_argument, resolve_device


def add_arguments(parser):
    add_impl_argument(parser)
    add_device_argument(parser)
    parser.add_argument("--model", default="smollm2", metavar="PATH",
                        help="a .gguf file with a tokenizer, or smollm2 (the default; fetched on first use)")
    parser.add_argument("--prompt", default=None, help="ask one question and exit (default: interactive)")
    parser.add_argument("--system", default=None, help="a system message (default: the template's own)")
    parser.add_argument("--max-tokens", type=int, default=200, help="most tokens per reply (default 200)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus mass (1.0: all)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: 1 on CPU, torch's choice on CUDA)")


def reply(engine, tokenizer, detokenizer_class, prompt_ids, params, request_id, write):
    """Stream one reply: add the request, step the engine, write text as it becomes stable.
    Returns the reply's token ids (without the end-of-turn token)."""
    engine.add_request(request_id, prompt_ids, params)
    detokenizer = detokenizer_class(tokenizer, skip_special_tokens=True)
    tokens = []
    while engine.has_unfinished:
        for out in engine.step():
            for token in out.new_token_ids:
                tokens.append(token)
                write(detokenizer.push(token))
    write(detokenizer.flush())
    return [t for t in tokens if t != tokenizer.eos_token_id]


def run(args):
    import torch

    from course.commands._setup import SMOLLM2_CHAPTERS, gguf_tokenizer, model_source, needs_chapters, set_threads
    from course.impl import load
    impl = load(args.impl)
    device = resolve_device(args.device)
    set_threads(device, args.threads)
    if args.max_tokens < 1:
        raise CommandError("--max-tokens must be at least 1")
    path = model_source(args.model)
    if not str(path).endswith(".gguf"):
        raise CommandError(f"--model {args.model}: chat needs a .gguf file (its metadata carries the tokenizer)")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        with needs_chapters(f"--model {args.model}", SMOLLM2_CHAPTERS, impl):
            model = impl.load("checkpoint").load_model(path, dtype=dtype, device=device)
            tokenizer = gguf_tokenizer(impl, path)
    except (OSError, ValueError) as exc:
        raise CommandError(f"--model {args.model}: {exc}") from None
    serve_engine, config, request = (impl.load(f"serve.{name}") for name in ("engine", "config", "request"))
    engine = serve_engine.EngineCore(model, config.EngineConfig(num_blocks=512, block_size=16),
                                     eos_token_id=tokenizer.eos_token_id)
    detokenizer_class = impl.load("bpe").IncrementalDetokenizer
    try:
        params = request.SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                        seed=args.seed)
    except ValueError as exc:
        raise CommandError(str(exc)) from None

    def write(text):
        sys.stdout.write(text)
        sys.stdout.flush()

    messages = [{"role": "system", "content": args.system}] if args.system else []
    questions = [args.prompt] if args.prompt is not None else None
    turn = 0
    while True:
        if questions is not None:
            if turn == len(questions):
                return 0
            question = questions[turn]
        else:
            try:
                question = input("you> ").strip()
            except EOFError:
                return 0
            if not question:
                return 0
            write("model> ")
        messages.append({"role": "user", "content": question})
        prompt_ids = tokenizer.encode_chat(messages)
        if len(prompt_ids) + args.max_tokens > engine.max_model_len:
            raise CommandError(f"the conversation has {len(prompt_ids)} tokens; the model's context holds "
                               f"{engine.max_model_len}")
        start = time.perf_counter()
        answer = reply(engine, tokenizer, detokenizer_class, prompt_ids, params, f"turn{turn}", write)
        seconds = time.perf_counter() - start
        write("\n")
        print(f"[{len(answer)} tokens in {seconds:.2f} s, {len(answer) / seconds:.1f} tok/s; "
              f"prompt {len(prompt_ids)} tokens]", file=sys.stderr)
        messages.append({"role": "assistant", "content": tokenizer.decode(answer)})
        turn += 1
