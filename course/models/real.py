"""The real model for the chapters that show real text: SmolLM2-135M-Instruct, loaded once.

Chapters 16, 17 and 26 teach on the tiny random Qwen3 and then show the same technique on a
trained model. They share this loader so that each notebook pays the load (a few seconds)
once, and so that a machine without the checkpoint gets the same one-line explanation
everywhere (`course.models.smollm2.SmolLM2Unavailable`) instead of a traceback.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from course import reference
from course.impl import have_reference, load
from course.models.smollm2 import SMOLLM2_CHAPTERS, SmolLM2Unavailable, smollm2_gguf_path


@cache
def smollm2() -> tuple[Any, Any]:
    """(model, tokenizer) of SmolLM2-135M-Instruct through the reference implementation (in a
    learner's edition, through the learner's engine).

    The model is Chapter 42's Llama-family model, read from the GGUF file by Chapter 39's
    loader into float32 on the CPU, in eval mode; the tokenizer is Chapter 36's BPE
    tokenizer built from the same file's metadata (`encode_chat`, `decode`,
    `eos_token_id`). Fetches the file on first use; raises `SmolLM2Unavailable` (one line
    saying how to provide it) when it is not cached and cannot be fetched. Cached per
    process: every call returns the same two objects, so callers must not modify the model.
    """
    path = smollm2_gguf_path(quiet=True)
    if not have_reference():        # a learner's edition: SmolLM2 runs on the learner's engine
        engine = load("engine")
        try:
            return _load(engine, path)
        except NotImplementedError as exc:
            from course.grading.progress import chapters_still_needed
            raise SmolLM2Unavailable(f"SmolLM2 runs on your engine once you have done "
                                     f"{chapters_still_needed(engine, SMOLLM2_CHAPTERS)} ({exc} is not written yet)"
                                     ) from None
    return _load(reference(), path)


def _load(impl: Any, path: Any) -> tuple[Any, Any]:
    model = impl.checkpoint.load_model(path).eval()
    tokenizer = impl.bpe.BPETokenizer.from_gguf_metadata(impl.gguf.GGUFFile(path).metadata)
    return model, tokenizer
