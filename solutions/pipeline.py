"""Chapter 17: Qwen3 end to end, from a checkpoint directory and a prompt to text.

Everything here is glue between parts built earlier: Chapter 11's loader makes the model,
the checkpoint's own tokenizer (or Chapter 3's byte tokenizer for the tiny model) turns
text into ids, Chapter 16's cached generate continues them, and the stop tokens the
checkpoint declares end the answer. Glue is where end-to-end bugs live: the wrong stop
token, a prompt decoded together with the answer, a BOS the model never saw in training.
"""
from __future__ import annotations

import json
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from .checkpoint import CONFIG_FILE, load_checkpoint
from .profiling import synchronizer
from .sampling import generate
from .tokenizer import ByteTokenizer

if TYPE_CHECKING:
    from .qwen3 import Qwen3ForCausalLM

GENERATION_CONFIG_FILE = "generation_config.json"
TOKENIZER_FILE = "tokenizer.json"


class TextTokenizer(Protocol):
    """What the pipeline needs of a tokenizer (ByteTokenizer, HFTokenizer): text to ids, with
    the checkpoint's BOS in front when asked, and back, special tokens skipped. The server's
    chat tokenizer is another protocol (server.text.ChatTokenizer)."""

    def encode(self, text: str, add_bos: bool = False) -> list[int]: ...

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str: ...


def _read_json(file: Path) -> dict[str, Any]:
    return json.loads(file.read_text(encoding="utf-8")) if file.is_file() else {}


def stop_token_ids(path: str | Path) -> tuple[int, ...]:
    """Every token id that ends a generation for the checkpoint directory `path`.  (Your engine: Chapter 17)

    Two files may name end-of-sequence ids, each as an int, a list of ints, or not at all:
    config.json's "eos_token_id" (what the model was trained with) and, when present,
    generation_config.json's "eos_token_id" (what its authors want generate to stop on).
    They differ in practice: Qwen3's config.json names <|im_end|> (151645) alone, while its
    generation_config.json names [151645, 151643], adding <|endoftext|>; a loader that
    reads only config.json (as Qwen3Config.from_dict does: it keeps the first id) lets a
    model that ends with <|endoftext|> ramble on. Return the union, as a sorted tuple of
    ints (empty when neither file names one). A missing generation_config.json is normal.
    """
    ids: set[int] = set()
    for name in (CONFIG_FILE, GENERATION_CONFIG_FILE):
        value = _read_json(Path(path) / name).get("eos_token_id")
        if value is None:
            continue
        ids.update(int(v) for v in (value if isinstance(value, list) else [value]))
    return tuple(sorted(ids))


class HFTokenizer:
    """A checkpoint's own tokenizer (tokenizer.json, read by transformers), behind the same
    encode/decode interface as ByteTokenizer. Chapter 36 replaces it with our own BPE."""

    def __init__(self, path: str | Path) -> None:
        from transformers import AutoTokenizer
        self.inner = AutoTokenizer.from_pretrained(str(path))
        self.bos_token_id = self.inner.bos_token_id
        self.eos_token_id = self.inner.eos_token_id
        self.vocab_size = len(self.inner)

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        ids = self.inner.encode(text, add_special_tokens=False)
        return [self.bos_token_id] + ids if add_bos and self.bos_token_id is not None else ids

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        return self.inner.decode([int(t) for t in ids], skip_special_tokens=skip_special)

    def chat_prompt(self, user_text: str) -> list[int]:
        """The ids of a one-turn chat in the checkpoint's own template (thinking off)."""
        messages = [{"role": "user", "content": user_text}]
        text = self.inner.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                              enable_thinking=False)
        return self.inner.encode(text, add_special_tokens=False)


def load_tokenizer(path: str | Path, vocab_size: int) -> TextTokenizer:
    """The tokenizer for a checkpoint: its tokenizer.json when it ships one, else the byte
    tokenizer (the tiny test checkpoints have none; their vocabulary is bytes + specials)."""
    if (Path(path) / TOKENIZER_FILE).is_file():
        return HFTokenizer(path)
    return ByteTokenizer(vocab_size)


@dataclass
class Completion:
    """The result of one Pipeline.complete call.

    finish_reason: "stop" (a stop token was generated; it is in token_ids, not in text),
    "length" (max_new_tokens reached) or "context" (the model's context limit reached).
    """
    text: str
    token_ids: list[int]
    prompt_ids: list[int]
    finish_reason: str
    seconds: float
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def tokens_per_second(self) -> float:
        return len(self.token_ids) / self.seconds if self.seconds > 0 else float("inf")


class Pipeline:
    """A model, its tokenizer and its stop tokens: text in, text out."""

    def __init__(self, model: Qwen3ForCausalLM, tokenizer: TextTokenizer, stop_ids: Iterable[int] = (),
                 add_bos: bool = False) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.stop_ids = tuple(stop_ids)
        self.add_bos = add_bos
        self.device = next(model.parameters()).device

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype | None = None,
                        device: torch.device | str | None = None) -> Pipeline:
        """Load the checkpoint directory `path` (Chapter 11), its tokenizer and stop ids."""
        model = load_checkpoint(path, dtype=dtype, device=device)
        tokenizer = load_tokenizer(path, model.cfg.vocab_size)
        return cls(model, tokenizer, stop_token_ids(path))

    def encode(self, prompt: str | Iterable[int]) -> list[int]:
        """A str through the tokenizer; a list of ints as it is."""
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_bos=self.add_bos)
        return [int(t) for t in prompt]

    def complete(self, prompt: str | Iterable[int], max_new_tokens: int = 32, *, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0, seed: int | None = None) -> Completion:
        """Continue `prompt` and return a Completion.  (Your engine: Chapter 17)

        prompt: a str (encoded with self.encode) or a list of ids. The new ids are exactly
        those of sampling.generate (Chapter 16) on self.model with self.stop_ids as stop
        tokens and these sampling options; with a seed, its generator is a torch.Generator
        on the model's device seeded with manual_seed(seed), so a seeded completion repeats
        and matches that call. The Completion holds:
          token_ids: the new ids only, a stop token included when one ended the answer;
          text: what self.tokenizer.decode gives for the new ids alone, WITHOUT a final
                stop token (not a cut of decode(prompt + new): a tokenizer need not map a
                prefix of ids to a prefix of text);
          finish_reason: "stop" when a stop id ended the answer (even if it was the
                max_new_tokens-th id), "length" when max_new_tokens ids came, otherwise
                "context" (generate stopped at the context limit);
          seconds: wall time of the generate call, device synchronized before and after.
        """
        prompt_ids = self.encode(prompt)
        generator = None
        if seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(seed)
        sync = synchronizer(self.device)
        sync()
        start = time.perf_counter()
        new = generate(self.model, prompt_ids, max_new_tokens, stop_token_ids=self.stop_ids,
                       temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, generator=generator)
        sync()
        seconds = time.perf_counter() - start
        if new and new[-1] in self.stop_ids:
            reason, shown = "stop", new[:-1]
        elif len(new) == max_new_tokens:
            reason, shown = "length", new
        else:
            reason, shown = "context", new
        return Completion(self.tokenizer.decode(shown), new, prompt_ids, reason, seconds)
