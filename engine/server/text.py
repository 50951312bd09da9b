"""Chapter 38: from token ids to the text a client sees, one step at a time.

The server needs four things from a tokenizer (the `ChatTokenizer` protocol) and one
from a detokenizer (`push(token_id) -> str`, the text that became certain). Chapter 3's
byte tokenizer has no chat template, so `ByteChatTokenizer` gives the tiny model a
documented fallback; a real tokenizer (Chapter 36's BPE) brings its own template and its
own incremental detokenizer and plugs in unchanged.

`TextStream` sits between the detokenizer and the wire: it applies the request's stop
strings and holds back any tail that could still grow into one, so no client ever sees
the beginning of a stop string that later turns out to be one.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Protocol, Sequence, runtime_checkable

if TYPE_CHECKING:
    from ..tokenizer import ByteTokenizer

REPLACEMENT_CHAR = "\ufffd"


@runtime_checkable
class ChatTokenizer(Protocol):
    """What the HTTP server needs from a tokenizer: text both ways, the end-of-sequence id and
    a chat template (ByteChatTokenizer, Chapter 36's BPETokenizer). Chapter 17's
    pipeline.TextTokenizer asks for less and differently: no chat, and an optional BOS."""
    eos_token_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str: ...

    def encode_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        """The prompt ids of a chat: the rendered template with its markers ("<|im_start|>")
        as their special ids. `encode` alone would not do: it treats marker names as ordinary
        text, which is right for a raw completion prompt and wrong for a chat template."""
        ...


class Detokenizer(Protocol):
    """Turns a request's output ids into text, one id at a time; flush() hands out what it
    still holds when the output ends (an unfinished character as U+FFFD)."""

    def push(self, token_id: int) -> str: ...

    def flush(self) -> str: ...


class DiffDetokenizer:
    """An incremental detokenizer for any tokenizer with `decode`: decode every id so far and
    hand out what the new id added.

    A character whose bytes are split across ids decodes to U+FFFD until its last byte
    arrives, so text ending in U+FFFD is held back, not sent. Decoding the whole output on
    every id costs O(n^2) characters over a request: fine for the tiny model's short replies;
    Chapter 36's detokenizer decodes only a window."""

    def __init__(self, tokenizer: ChatTokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.sent = 0                       # characters of decode(ids) already handed out

    def push(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        text = self.tokenizer.decode(self.ids)
        if text.endswith(REPLACEMENT_CHAR):
            return ""
        new, self.sent = text[self.sent:], len(text)
        return new

    def flush(self) -> str:
        text = self.tokenizer.decode(self.ids)
        rest, self.sent = text[self.sent:], len(text)
        return rest


class ByteChatTokenizer:
    """Chapter 3's ByteTokenizer with what the server needs on top (for the tiny model).

    The fallback chat template: each message becomes "<|im_start|>{role}\\n{content}<|im_end|>\\n"
    written as plain text (ChatML's layout, which SmolLM2 and Qwen3 use with real special
    ids), then "<|im_start|>assistant\\n" when a reply is wanted. The byte tokenizer encodes
    the markers byte by byte, so a user can type them, and the tiny model's replies mean
    nothing anyway: the template exists so /v1/chat/completions runs end to end."""

    def __init__(self, byte_tokenizer: ByteTokenizer) -> None:
        self.bytes = byte_tokenizer
        self.eos_token_id = byte_tokenizer.eos_token_id
        self.vocab_size = byte_tokenizer.vocab_size

    def encode(self, text: str) -> list[int]:
        return self.bytes.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self.bytes.decode(ids)

    def is_special(self, token_id: int) -> bool:
        return self.bytes.is_special(token_id)

    def token_bytes(self, token_id: int) -> bytes:
        return self.bytes.token_bytes(token_id)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        turns = [f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages]
        return "".join(turns) + ("<|im_start|>assistant\n" if add_generation_prompt else "")

    def encode_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        return self.encode(self.apply_chat_template(messages, add_generation_prompt))


def stop_prefix_overlap(text: str, stops: Sequence[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of some stop string:
    the characters that must wait, because the next token may complete a stop string."""
    longest = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:size]):
                longest = size
                break
    return longest


class TextStream:
    """One choice's text as it is generated: detokenize, cut at stop strings, hold back.

    detokenizer: a fresh Detokenizer for this choice; stops: the request's stop strings.
    After `push` returns, `stopped` says whether a stop string has ended the text."""

    def __init__(self, detokenizer: Detokenizer, stops: Sequence[str] = ()) -> None:
        self.detokenizer = detokenizer
        self.stops = tuple(stops)
        self.pending = ""                  # decoded text not yet handed out
        self.stopped = False

    def push(self, token_ids: Sequence[int]) -> str:
        """The text that may be sent now, after these new output ids.  (Your engine: Chapter 38)

        token_ids: the ids one engine step added to this choice (usually one; none when flush
        calls push(()) to judge the detokenizer's last text). Returns a str, possibly empty.
        Contract:
        - Everything push and flush ever return, joined, equals the decoded output cut just
          before the stop string that a character-by-character stream would complete FIRST
          (the one that ends first, the longest of those ending at the same character), not
          the one that starts first nor the first one listed: with stops ["abcd", "bc"] the
          text "xabcd" sends "xa". The stop string itself is never sent.
        - So the text sent is the same however the output was cut into pushes.
        - A tail that could still grow into a stop string is held back until later ids
          settle it ("Hel" waits when "Hello" is a stop string).
        - After a stop string: `stopped` is True, nothing is held, every later push is "".
        - Without stop strings nothing is held back beyond what the detokenizer holds.
        """
        raise NotImplementedError("Your engine: Chapter 38: TextStream.push")

    def flush(self) -> str:
        """The rest of the text once the choice has finished: what was held back for the stop
        strings and what the detokenizer still holds (an unfinished character as U+FFFD,
        so the text and the logprobs' text_offset count the same tokens), cut before a stop
        string that only this last piece completes."""
        if self.stopped:
            return ""
        self.pending += self.detokenizer.flush()
        text = self.push(())                 # push's stop rule, applied to the last piece too
        rest, self.pending = self.pending, ""    # a held tail can no longer grow into a stop string
        return text + rest


DetokenizerFactory = Callable[[], Detokenizer]

__all__ = ["ChatTokenizer", "Detokenizer", "DetokenizerFactory", "DiffDetokenizer", "ByteChatTokenizer",
           "stop_prefix_overlap", "TextStream", "REPLACEMENT_CHAR"]
