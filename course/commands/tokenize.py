"""Chapter 3: text through the byte tokenizer and back.

Prints one JSON line: the text, its characters and UTF-8 bytes, the token ids (with
--bos, led by <|bos|>), the decoded text and whether the round trip gave the text back.
With --ids, decodes a comma-separated list of ids instead (--show-special keeps the
special tokens' names).
"""
import json

from course.cli import CommandError, add_impl_argument


def add_arguments(parser):
    add_impl_argument(parser)
    parser.add_argument("text", nargs="?", default="Hello, wörld! 👋", help="the text to encode")
    parser.add_argument("--bos", action="store_true", help="start the ids with <|bos|>")
    parser.add_argument("--ids", default=None, help="decode these comma-separated ids instead of encoding text")
    parser.add_argument("--show-special", action="store_true", help="when decoding, write special tokens by name")


def run(args):
    from course.impl import load
    tokenizer = load(args.impl).tokenizer.ByteTokenizer()
    if args.ids is not None:
        try:
            ids = [int(piece) for piece in args.ids.replace(" ", "").split(",") if piece]
        except ValueError:
            raise CommandError(f"--ids {args.ids!r}: expected comma-separated integers") from None
        try:
            text = tokenizer.decode(ids, skip_special=not args.show_special)
        except ValueError as exc:
            raise CommandError(str(exc)) from None
        print(json.dumps({"ids": ids, "text": text}, ensure_ascii=False))
        return
    ids = tokenizer.encode(args.text, add_bos=args.bos)
    back = tokenizer.decode(ids)
    print(json.dumps({"text": args.text, "characters": len(args.text), "bytes": len(args.text.encode("utf-8")),
                      "ids": ids, "tokens": len(ids), "decoded": back, "round_trip": back == args.text},
                     ensure_ascii=False))
