"""Chapter 36: text through SmolLM2's byte-level BPE tokenizer, read from its GGUF file.

Prints one JSON line: the token ids, each token's text, bytes and tokens counted, and
whether decode gave the text back. --chat wraps the text as a user message in the
checkpoint's chat template first. --stream pushes the ids one by one through the
incremental detokenizer and prints what each push releases. --bench encodes every chapter
of the book with the implementation's BPE (first with an empty word cache, then again) and
with the tokenizers library, and prints one JSON line each (bytes, tokens, seconds, MB/s,
identical ids). The SmolLM2 file is fetched on first use (course.models.smollm2).
"""
import json
import time
from pathlib import Path

from course.cli import CommandError, add_impl_argument

ROOT = Path(__file__).resolve().parents[2]


def add_arguments(parser):
    add_impl_argument(parser)
    parser.add_argument("text", nargs="?", default="Hello, wörld! 👋 2024", help="the text to encode")
    parser.add_argument("--chat", action="store_true", help="render the text as a user turn of the chat template")
    parser.add_argument("--stream", action="store_true", help="show what the incremental detokenizer releases per id")
    parser.add_argument("--bench", action="store_true",
                        help="time encoding the whole book against the tokenizers library")


def load_tokenizers(impl_spec):
    """(the implementation's BPETokenizer, the tokenizers library's) for SmolLM2."""
    from course.impl import load
    from course.models import smollm2
    from course.testing import bpe_oracle
    try:
        metadata = bpe_oracle.smollm2_metadata()
    except smollm2.SmolLM2Unavailable as missing:
        raise CommandError(f"SmolLM2 unavailable: {missing}") from None
    bpe = load(impl_spec).load("bpe")
    return bpe, bpe.BPETokenizer.from_gguf_metadata(metadata), bpe_oracle.library_tokenizer(metadata)


def bench(tokenizer, library):
    texts = [path.read_text() for path in sorted(ROOT.glob("chapters/*/[0-9][0-9]-*.md"))]
    size = sum(len(text.encode("utf-8")) for text in texts)

    def timed(label, encode):
        start = time.perf_counter()
        ids = [encode(text) for text in texts]
        seconds = time.perf_counter() - start
        return label, ids, seconds

    library.encode_special_tokens = True          # names in the text are text, as in encode()
    runs = [timed("bpe, empty word cache", tokenizer.encode), timed("bpe, warm word cache", tokenizer.encode),
            timed("tokenizers library", lambda text: library.encode(text, add_special_tokens=False).ids)]
    expected = runs[-1][1]
    for label, ids, seconds in runs:
        print(json.dumps({"encoder": label, "chapters": len(texts), "bytes": size, "tokens": sum(map(len, ids)),
                          "seconds": round(seconds, 3), "mb_s": round(size / seconds / 1e6, 2),
                          "identical": ids == expected}))


def run(args):
    bpe, tokenizer, library = load_tokenizers(args.impl)
    if args.bench:
        bench(tokenizer, library)
        return
    text = args.text
    if args.chat:
        text = tokenizer.apply_chat_template([{"role": "user", "content": args.text}])
    ids = tokenizer.encode(text, parse_special=args.chat)
    if args.stream:
        detokenizer = bpe.IncrementalDetokenizer(tokenizer)
        pieces = [detokenizer.push(token_id) for token_id in ids] + [detokenizer.flush()]
        print(json.dumps({"ids": ids, "released": pieces}, ensure_ascii=False))
        return
    back = tokenizer.decode(ids)
    print(json.dumps({"text": text, "ids": ids, "tokens": [tokenizer.tokens[i] for i in ids],
                      "bytes": len(text.encode("utf-8")), "count": len(ids), "round_trip": back == text},
                     ensure_ascii=False))
