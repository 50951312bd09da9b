"""Chapter 38: serve the engine core over an OpenAI-compatible HTTP API (FastAPI + uvicorn).

    python run.py serve                       # the tiny model on http://127.0.0.1:8000
    curl -s localhost:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"model": "tiny", "prompt": "Hello", "max_tokens": 8, "temperature": 0}'

Routes: /v1/completions, /v1/chat/completions (stream: true gives server-sent events),
/v1/models, /health, /version, /metrics (Prometheus text). --model names an entry of MODELS; each
entry builds (model, tokenizer, detokenizer factory). The tiny model speaks Chapter 3's
byte tokenizer with the fallback chat template of server/text.py (Chapter 38), so its
replies are noise: it is there to exercise the server, not to talk. --model smollm2 serves
SmolLM2-135M-Instruct (Chapters 36, 39, 42), which answers in real sentences. --port 0 picks a free
port and prints it.
"""
from course.cli import CommandError, add_device_argument, add_impl_argument, add_threads_argument


def load_tiny(impl, device):
    """The tiny test model with Chapter 3's byte tokenizer (ids 0-255 are bytes, EOS 257)."""
    from course.models import tiny_qwen3
    text = impl.load("server.text")
    model = tiny_qwen3(impl.package, device=device)
    tokenizer = text.ByteChatTokenizer(impl.tokenizer.ByteTokenizer(model.cfg.vocab_size))
    return model, tokenizer, lambda: text.DiffDetokenizer(tokenizer)


def load_smollm2(impl, device):
    """SmolLM2-135M-Instruct (fetched on first use) with Chapter 36's BPE tokenizer read from
    the same GGUF file, and that tokenizer's incremental detokenizer."""
    from course.commands import _setup
    from course.commands._setup import SMOLLM2, gguf_tokenizer, load_model, model_source
    with _setup.needs_chapters("--model smollm2", _setup.SMOLLM2_CHAPTERS, impl):
        model = load_model(impl, device, SMOLLM2)
        tokenizer = gguf_tokenizer(impl, model_source(SMOLLM2))
    bpe = impl.load("bpe")
    return model, tokenizer, lambda: bpe.IncrementalDetokenizer(tokenizer, skip_special_tokens=True)


# name -> loader(impl, device) -> (model, tokenizer, new_detokenizer).
MODELS = {"tiny": load_tiny, "smollm2": load_smollm2}

# What one request may ask (the fields of server.protocol.Limits): each breach is a 400
# naming the field, the body's size a 413.
LIMITS = {
    "max_body_bytes": "bytes of a request body",
    "max_json_depth": "levels of arrays and objects nested in a body",
    "max_string_chars": "characters of any one string but the prompt and message contents",
    "max_prompt_chars": "characters of a text prompt, or of a chat's message contents together",
    "max_messages": "messages of a chat",
    "max_n": "samples per request (n)",
    "max_output_tokens": "the max_tokens a request may ask for",
    "max_stop_strings": "stop strings per request",
    "max_stop_chars": "characters of a stop string",
    "max_stop_token_ids": "stop_token_ids per request",
    "max_logit_bias": "entries of logit_bias",
    "max_guide_chars": "characters of a guided_regex, or of a JSON schema as compact JSON",
    "max_prompts": "prompts in one completions request (a list of prompts)",
}


def add_arguments(parser):
    add_impl_argument(parser)
    add_device_argument(parser)
    parser.add_argument("--model", default="tiny", choices=sorted(MODELS), help="model to serve (default: tiny)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one)")
    parser.add_argument("--num-blocks", type=int, default=512, help="KV blocks in the pool (default 512)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per block (default 16)")
    parser.add_argument("--max-num-seqs", type=int, default=32, help="requests running at once (default 32)")
    parser.add_argument("--max-waiting", type=int, default=64,
                        help="requests allowed to wait beyond the running ones before 429 (default 64)")
    parser.add_argument("--header-timeout", type=float, default=10.0,
                        help="seconds a new connection has to send its request's headers before it is closed "
                             "(default 10)")
    for name, what in LIMITS.items():
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=None,
                            help=f"{what} (default: the server's, listed in Chapter 38)")
    parser.add_argument("--backend", default="reference", help="attention backend (default: reference)")
    add_threads_argument(parser)


def build(args):
    """(app, impl): the FastAPI app around a fresh EngineCore (not yet serving), and the
    implementation it was built from."""
    from course.commands._setup import prepare_device
    from course.impl import load
    from course.testing.oracles import unwritten_server_stubs
    impl = load(args.impl)
    missing = unwritten_server_stubs(impl)
    if missing:                 # the loop would start, then stop on the first of them
        raise CommandError(f"serving needs Chapter 38's stubs written in your engine; not implemented yet: "
                           f"{', '.join(missing)}")
    device = prepare_device(args)
    model, tokenizer, new_detokenizer = MODELS[args.model](impl, device)
    serve_config, serve_engine = impl.load("serve.config"), impl.load("serve.engine")
    app_module = impl.load("server.app")
    try:
        config = serve_config.EngineConfig(num_blocks=args.num_blocks, block_size=args.block_size,
                                           max_num_seqs=args.max_num_seqs, attention_backend=args.backend,
                                           sampler="full")
        # Each token's bytes let the engine build Chapter 35's guides (response_format, guided_regex).
        vocab_bytes = impl.load("serve.guided").token_bytes_of(tokenizer)
        engine = serve_engine.EngineCore(model, config, eos_token_id=tokenizer.eos_token_id, vocab_bytes=vocab_bytes)
        chosen = {name: getattr(args, name) for name in LIMITS if getattr(args, name, None) is not None}
        limits = impl.load("server.protocol").Limits(**chosen)
        app = app_module.build_app(engine, app_module.ServedModel(args.model, tokenizer, new_detokenizer),
                                   max_waiting=args.max_waiting, limits=limits)
    except ValueError as exc:
        raise CommandError(str(exc)) from None
    return app, impl


def run(args):
    import time

    app, impl = build(args)
    app_module = impl.load("server.app")
    loop = app.state.server.loop
    with app_module.serve_in_thread(app, args.host, args.port, log_level="info",
                                    header_timeout_s=args.header_timeout) as url:
        print(f"serving {args.model!r} ({impl.name}) on {url}  (Ctrl-C stops)", flush=True)
        try:
            while loop.alive:              # a dead engine loop must not leave a server that only says 503
                time.sleep(1)
        except KeyboardInterrupt:
            print("stopping", flush=True)
            return 0
    print(f"the engine loop stopped ({loop.error!r}); exiting so a supervisor can restart the server", flush=True)
    return 1
