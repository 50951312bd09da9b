"""Chapter 35 (stretch): a pushdown guide for free-form JSON, behind the same Guide protocol.

    JsonStackIndex   the three one-level automata, the per-(frame kind, state) mask cache
    JsonStackGuide   one request's stack of open containers (serve.interfaces.Guide)

Any JSON value is not a regular language (brackets nest without bound), so no DFA can guide
it. A stack can: each frame is one open container, and the automaton of a frame describes
ONE level only, in which a nested container is a single placeholder byte, CALL (0x01, a
control byte JSON text never holds outside strings, and never inside them). Reading "[" or
"{" where the frame could read CALL pushes a frame for the new container (the old frame
moves past CALL, so it resumes right after the nested value); reading a container's last
byte pops its frame. Nesting is bounded by MAX_DEPTH open containers, stated on purpose: a
model that likes "[" would otherwise open brackets until max_tokens.

Masks are split as grammar backends split them (XGrammar's "context-independent" tokens):
for the frame on top, a token whose bytes stay inside that frame is allowed or not whatever
lies below, so that verdict is cached per (frame kind, state), computed for every token at
once with numpy; the few tokens that push or pop inside their bytes are walked through the
whole stack at every step.
Whitespace: as the schema compiler, at most one space after "," and ":".
"""
from __future__ import annotations

from functools import cached_property
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..json_regex import NUMBER, OPTIONAL_SPACE, STRING_CHARACTER
from ..regex_dfa import DFA, compile_regex

if TYPE_CHECKING:
    from .guided import Vocabulary

MAX_DEPTH = 32                                  # open containers at most
CALL = 0x01                                     # "a nested container was here", in a frame's automaton
ARRAY, OBJECT, VALUE = 0, 1, 2                  # frame kinds
PUSHES, LEAVES = -2, -3                         # walk codes: the byte opens a container / follows the frame's end
Frame = tuple[int, int]                         # (kind, state in that kind's automaton)


def frame_automata(whitespace: str = OPTIONAL_SPACE) -> list[DFA]:
    """The automata of one level of an array, of an object, and of any one value."""
    string = f'"{STRING_CHARACTER}*"'
    item = f"(?:{string}|{NUMBER}|true|false|null|\\x01)"
    separator, colon = "," + whitespace, ":" + whitespace
    member = f"{string}{colon}{item}"
    return [compile_regex(f"\\[(?:{item}(?:{separator}{item})*)?\\]"),
            compile_regex(f"\\{{(?:{member}(?:{separator}{member})*)?\\}}"),
            compile_regex(item)]


class JsonStackIndex:
    """Shared by every free-form JSON request over one vocabulary."""

    def __init__(self, vocabulary: Vocabulary) -> None:
        self.vocabulary = vocabulary
        self.automata = frame_automata()
        self.walk_tables = [self.walk_table(dfa) for dfa in self.automata]
        self.local: dict[tuple[Frame, bool], tuple[torch.Tensor, list[int]]] = {}

    @staticmethod
    def walk_table(dfa: DFA) -> np.ndarray:
        """dfa.transitions with the bytes that leave the frame marked: "[" and "{" where CALL
        may be read become PUSHES, every byte after a container's closing byte LEAVES, and
        CALL itself is -1."""
        table = dfa.transitions.astype(np.int64)
        can_call = table[:, CALL] >= 0
        table[:, CALL] = -1                                  # the placeholder is never text
        for opening in b"[{":
            table[can_call, opening] = PUSHES
        ended = dfa.accepting & (dfa.transitions < 0).all(axis=1)
        table[ended, :] = LEAVES
        return table

    def step(self, stack: list[Frame], byte: int) -> list[Frame] | None:
        """The stack after one more byte, or None if no JSON text can continue that way.  (Your engine: Chapter 35)

        stack: the open frames, bottom first, each (kind, state) a state of
        self.automata[kind]; byte: 0..255. Returns a new list (`stack` stays as it was):
        the top frame reads the byte, except that "[" or "{" where the top frame could read
        CALL opens a nested container (one frame more, already past its bracket), and a
        container's closing byte closes its frame (one frame fewer; a VALUE frame is never
        removed). None: no continuation, the byte CALL itself, an empty stack, or a
        container beyond MAX_DEPTH open frames.
        Trap: "[" inside a string is text.
        """
        raise NotImplementedError("Your engine: Chapter 35: JsonStackIndex.step")

    def walk(self, stack: list[Frame], data: bytes) -> list[Frame] | None:
        """The stack after `data` (None as soon as a byte cannot follow)."""
        current: list[Frame] | None = stack
        for byte in data:
            if current is None:
                return None
            current = self.step(current, byte)
        return current

    @cached_property
    def nothing(self) -> torch.Tensor:
        """The mask of a guide whose text is complete and ended: no token at all."""
        return torch.zeros(self.vocabulary.vocab_size, dtype=torch.bool)

    def local_verdicts(self, frame: Frame, with_eos: bool) -> tuple[torch.Tensor, list[int]]:
        """For the frame on top: (bool [vocab_size], the tokens to walk through the whole
        stack, False in that tensor). A token whose bytes stay in this frame (no push,
        nothing after its end) is decided here once, for every stack with this frame on
        top; EOS is True in the tensor exactly when `with_eos`."""
        found = self.local.get((frame, with_eos))
        if found is not None:
            return found
        vocabulary = self.vocabulary
        table = self.walk_tables[frame[0]]
        states = np.full(len(vocabulary.token_ids), frame[1], dtype=np.int64)
        reading = np.arange(len(vocabulary.token_ids))
        for position, count in enumerate(vocabulary.longer_than):
            reading = reading[:np.searchsorted(reading, count)]
            if not len(reading):
                break
            moved = table[states[reading], vocabulary.byte_matrix[reading, position]]
            states[reading] = moved
            reading = reading[moved >= 0]
        allowed = torch.zeros(vocabulary.vocab_size, dtype=torch.bool)
        allowed[torch.from_numpy(vocabulary.token_ids[states >= 0])] = True
        context = vocabulary.token_ids[(states == PUSHES) | (states == LEAVES)].tolist()
        if vocabulary.eos_token_id is not None:
            allowed[vocabulary.eos_token_id] = with_eos
        found = self.local[(frame, with_eos)] = (allowed, context)
        return found


class JsonStackGuide:
    """One request's free-form JSON: a stack of open containers (serve.interfaces.Guide).
    `top_level` VALUE admits any JSON value, OBJECT an object (OpenAI's json_object)."""

    def __init__(self, index: JsonStackIndex, top_level: int = OBJECT) -> None:
        self.index = index
        self.stack: list[Frame] = [(top_level, index.automata[top_level].start)]
        self.ended = False

    @property
    def accepting(self) -> bool:
        """Is the text so far one complete JSON value?"""
        if not self.stack:
            return True
        kind, state = self.stack[-1]
        return len(self.stack) == 1 and bool(self.index.automata[kind].accepting[state])

    @property
    def finished(self) -> bool:
        if self.ended or not self.stack:
            return True
        kind, state = self.stack[-1]
        return len(self.stack) == 1 and bool((self.index.automata[kind].transitions[state] < 0).all())

    def allowed(self) -> torch.Tensor:
        """bool [vocab_size]: the tokens that may come next. Often a cached tensor shared
        with other guides: read it, never write to it."""
        vocabulary = self.index.vocabulary
        if not self.stack or self.ended:
            return self.index.nothing
        local, context = self.index.local_verdicts(self.stack[-1], with_eos=self.accepting and not self.ended)
        opened = [token for token in context if self.index.walk(self.stack, vocabulary.token_bytes(token)) is not None]
        if not opened:
            return local
        mask = local.clone()
        mask[opened] = True
        return mask

    def advance(self, token_id: int) -> None:
        """Move past one accepted token (EOS ends the guide; ValueError naming the token
        and its bytes, or containing "EOS", for a token not allowed here; unchanged then)."""
        vocabulary = self.index.vocabulary
        if self.ended:
            raise ValueError(f"token {token_id} after the guided text ended")
        if token_id == vocabulary.eos_token_id and token_id is not None:
            if not self.accepting:
                raise ValueError(f"token {token_id} (EOS) before the text is one complete JSON value")
            self.ended = True
            return
        data = vocabulary.token_bytes(token_id)
        following = self.index.walk(self.stack, data) if data else None
        if following is None:
            raise ValueError(f"token {token_id} ({data!r}) cannot continue the JSON text here "
                             f"({len(self.stack)} containers open)")
        self.stack = following
