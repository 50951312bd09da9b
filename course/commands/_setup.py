"""What the model-running commands share: threads, and the model to run (not a command:
the dispatcher skips files whose name starts with an underscore)."""
import re
from contextlib import contextmanager
from types import SimpleNamespace

from course.cli import CommandError, resolve_device
from course.models.smollm2 import SMOLLM2_CHAPTERS


@contextmanager
def needs_chapters(what, chapters, impl):
    """Turn a stub's NotImplementedError inside the block into one line naming every chapter
    `what` needs that `impl` has not done (a learner learns which, not only the first stub):
    those of `chapters` with stubs still unwritten, and the chapter of the stub that raised."""
    try:
        yield
    except NotImplementedError as exc:
        from course.grading.progress import chapters_still_needed
        raising = re.search(r"\bChapter (\d+)\b", str(exc))
        if not chapters and not raising:
            raise
        needed = chapters_still_needed(impl, chapters, int(raising.group(1)) if raising else None)
        raise CommandError(f"{what} needs {needed} done in your engine: {exc} is not written yet") from None


def set_threads(device, threads):
    """torch threads: `threads` if given, else 1 on a CPU (steadier timings on a shared
    machine) and torch's own choice on CUDA."""
    import torch
    threads = threads if threads is not None else (1 if device.type == "cpu" else None)
    if threads is not None:
        if threads < 1:
            raise CommandError(f"--threads must be at least 1, got {threads}")
        torch.set_num_threads(threads)


def prepare_device(args):
    """The device --device names (cli.resolve_device), with torch's threads set from
    --threads (set_threads)."""
    device = resolve_device(args.device)
    set_threads(device, args.threads)
    return device


def prepare(args):
    """(impl, device) for a command that runs a model: the implementation --impl names, and
    prepare_device's device."""
    from course.impl import load
    return load(args.impl), prepare_device(args)


def serve_modules(impl, *more):
    """Chapter 31's serve.engine, serve.config and serve.request of `impl` (and serve.<name>
    for each name in `more`) as attributes, like the milestones' `serve` fixture."""
    return SimpleNamespace(**{name: impl.load(f"serve.{name}") for name in ("engine", "config", "request", *more)})


def load_model(impl, device, model_path=None, vocab_size=None):
    """The tiny test model of `impl` (with `vocab_size` rows of embedding and LM head if
    given), or a real checkpoint (Chapter 11's loader) with --model, in the device's default
    dtype (Chapter 40: bfloat16 where it computes, float32 on a CPU)."""
    from course.models import TINY_VOCAB_SIZE, tiny_qwen3
    if model_path is not None and vocab_size is not None:
        raise CommandError("a vocabulary size applies to the tiny model only: a checkpoint brings its own")
    if vocab_size is not None and vocab_size < TINY_VOCAB_SIZE:
        raise CommandError(f"the tiny model's vocabulary must be at least {TINY_VOCAB_SIZE} (bytes and special "
                           f"ids), got {vocab_size}")
    if model_path is None:
        overrides = {} if vocab_size is None else {"vocab_size": vocab_size}
        return tiny_qwen3(impl.package, device=device, **overrides)
    try:
        checkpoint = impl.load("checkpoint")
    except ModuleNotFoundError as exc:
        raise CommandError(f"--model needs {impl.name}.checkpoint (Chapter 11): {exc}") from exc
    from course.cli import default_dtype
    dtype = default_dtype(device)
    named, model_path = model_path, model_source(model_path)
    # load_model (Chapters 39, 42) reads GGUF files and every family; older checkouts have Qwen3 only.
    loader = getattr(checkpoint, "load_model", checkpoint.load_checkpoint)
    try:
        if str(model_path).endswith(".gguf"):          # a GGUF file: Chapter 39's reader, Llama or Qwen3
            with needs_chapters(f"--model {named}", (39,), impl):
                return loader(model_path, dtype=dtype, device=device).eval()
        return loader(model_path, dtype=dtype, device=device).eval()
    except (OSError, ValueError) as exc:          # CheckpointError and GGUFError are ValueErrors
        raise CommandError(f"--model {model_path}: {exc}") from None


SMOLLM2 = "smollm2"


def model_source(model):
    """What --model names: None (the tiny model), a path, or "smollm2", which becomes the
    cached SmolLM2-135M-Instruct GGUF file, fetched on first use (course.models.smollm2)."""
    if model != SMOLLM2:
        return model
    from course.models import smollm2
    try:
        return smollm2.smollm2_gguf_path(quiet=False)
    except smollm2.SmolLM2Unavailable as missing:
        raise CommandError(str(missing)) from None


def load_gguf(impl, named, path, device, dtype):
    """(model, tokenizer) from one GGUF file: Chapter 39's reader loads the weights, Chapter
    36's BPE tokenizer comes from its metadata. `named` is what
    --model said, for the messages."""
    try:
        with needs_chapters(f"--model {named}", SMOLLM2_CHAPTERS, impl):
            model = impl.load("checkpoint").load_model(path, dtype=dtype, device=device)
            tokenizer = gguf_tokenizer(impl, path)
    except (OSError, ValueError) as exc:
        raise CommandError(f"--model {named}: {exc}") from None
    return model, tokenizer


def gguf_tokenizer(impl, path):
    """Chapter 36's BPE tokenizer of a GGUF file, from its metadata (Chapter 39's reader)."""
    metadata = impl.load("gguf").GGUFFile(path).metadata
    return impl.load("bpe").BPETokenizer.from_gguf_metadata(metadata)
