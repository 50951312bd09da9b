"""SmolLM2's tokenizer as the oracle libraries build it (Chapter 36's tests, notebook, command).

Nothing here shares code with `solutions/bpe.py`: the metadata is read by transformers' GGUF
reader and the tokenizer is the `tokenizers` library (Rust) given the same vocabulary and
merges, with SmolLM2's own pre-tokenizer (each digit alone, then GPT-2's byte-level split).
That is what the file's `tokenizer.ggml.pre = "smollm"` means to llama.cpp and what
SmolLM2's tokenizer.json says; transformers' GGUF loader does not know "smollm" and falls
back to the bare GPT-2 split, which gives other ids for text such as "\\n\\n1." (see
`transformers_gguf_pre_tokenizer`).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

CONTROL_TOKEN = 3     # tokenizer.ggml.token_type of special tokens such as <|im_end|>
TOKENIZER_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type")


def smollm2_metadata(path: str | Path | None = None) -> dict[str, Any]:
    """The tokenizer part of a GGUF file's metadata as plain Python values (lists for arrays),
    keys as in the file. `path` defaults to the course's SmolLM2 (fetched on first use)."""
    from transformers.integrations.gguf.reader import read_gguf_metadata
    if path is None:
        from course.models.smollm2 import smollm2_gguf_path
        path = smollm2_gguf_path(quiet=True)
    values, _ = read_gguf_metadata(str(path), TOKENIZER_ARRAYS)
    return {key: value for key, value in values.items() if key.startswith(("tokenizer.", "general."))}


def smollm2_pre_tokenizer():
    """SmolLM2's pre-tokenizer in the tokenizers library: every digit alone, then GPT-2's split."""
    from tokenizers import pre_tokenizers
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])


def transformers_gguf_pre_tokenizer():
    """What transformers' GGUF loader uses for this file: GPT-2's split alone."""
    from tokenizers import pre_tokenizers
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def library_tokenizer(metadata: dict[str, Any]):
    """A `tokenizers.Tokenizer` with the file's vocabulary, merges and control tokens.

    Its `encode(text, add_special_tokens=False)` matches control-token names in the text
    (like encode(..., parse_special=True)); set `encode_special_tokens = True` on it to spell
    them as ordinary text instead."""
    from tokenizers import AddedToken, Tokenizer, decoders, models
    tokens = metadata["tokenizer.ggml.tokens"]
    merges = [tuple(line.split(" ")) for line in metadata["tokenizer.ggml.merges"]]
    tokenizer = Tokenizer(models.BPE({token: i for i, token in enumerate(tokens)}, merges))
    tokenizer.pre_tokenizer = smollm2_pre_tokenizer()
    tokenizer.decoder = decoders.ByteLevel()
    control = [t for t, kind in zip(tokens, metadata["tokenizer.ggml.token_type"]) if kind == CONTROL_TOKEN]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    return tokenizer


def _byte_of_character() -> dict[str, int]:
    """GPT-2's byte-level alphabet read backwards: each printable stand-in character -> its byte
    (bytes that print as themselves keep their character; the others were moved to 256 + n)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    moved = [b for b in range(256) if b not in printable]
    table = {chr(b): b for b in printable}
    table.update({chr(256 + n): b for n, b in enumerate(moved)})
    return table


def vocabulary_bytes(metadata: dict[str, Any]) -> list[bytes]:
    """Every token's bytes (b"" for control tokens such as <|im_end|>), from the file's token
    strings: the guide's vocabulary (Chapter 35) without Chapter 36's tokenizer."""
    byte_of = _byte_of_character()
    return [b"" if kind == CONTROL_TOKEN else bytes(byte_of[c] for c in token)
            for token, kind in zip(metadata["tokenizer.ggml.tokens"], metadata["tokenizer.ggml.token_type"])]
