"""Chapter 35: free-form JSON, a pushdown guide over bytes (response_format json_object).

Any JSON value is not a regular language: `[[[...]]]` must close exactly as many brackets
as it opened, which no finite automaton can count. A pushdown automaton can: a finite
lexer state plus a stack of the containers still open.

    JsonTables     the lexer's byte tables (next state, stack action) for one setting
    pushdown_step  one byte through the tables and the stack (the recogniser)
    JsonIndex      the allowed-token masks of one vocabulary: a context-free part per lexer
                   state (cached), completed per stack by walking the few tokens whose walk
                   reaches below the top of the stack, the result cached per (state, stack top)
    JsonGuide      one request's place (serve.interfaces.Guide)

The language, stated: one JSON value (RFC 8259) with `max_depth` containers open at most
and whitespace (space, tab, newline, carriage return) in runs of at most `max_whitespace`
bytes between tokens, none after the top-level value; with `object_only` (OpenAI's
json_object) the value is an object. Strings are valid UTF-8, without control characters;
escapes are JSON's (\\uXXXX takes any four hex digits, as json.loads does).
A lexer state is `position * 3 + top`: the place in the grammar and the kind of the
innermost open container (NONE, OBJECT, ARRAY), so only a byte that closes a container
needs to look deeper into the stack.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:        # only a type here, so serve/guided.py may import this module
    from .serve.guided import Vocabulary

NONE, OBJECT, ARRAY, UNKNOWN = 0, 1, 2, 3        # container kinds (UNKNOWN: below what a walk knows)
KEEP, PUSH, POP = 0, 1, 2                          # what a byte does to the stack
DEEPER = -2                                        # pushdown_step: the byte would open too many containers

WHITESPACE = b" \t\n\r"
HEX = b"0123456789abcdefABCDEF"
DIGITS = b"0123456789"
# Places where whitespace may come, each with a count of the whitespace read so far.
GAPS = ("value", "array_first", "object_first", "key", "colon", "after")
STRING_PARTS = ("in", "escape", "u4", "u3", "u2", "u1", "cont1", "cont2", "cont3", "e0", "ed", "f0", "f4")
NUMBER_PARTS = ("minus", "zero", "int", "dot", "frac", "e", "esign", "exp")
NUMBER_ENDS = ("zero", "int", "frac", "exp")       # a number may end here
LITERALS = (b"true", b"false", b"null")


@dataclass(frozen=True)
class JsonTables:
    """The lexer of one (object_only, max_whitespace) setting.

    next: int32 [S, 256], the state after a byte (-1: refused). For a PUSH byte the state's
    top is the pushed kind; for a POP byte it is the state with top NONE, to which the
    kind of the container that becomes innermost is added.
    action: int8 [S, 256], KEEP, PUSH or POP. accepting: bool [S], EOS may come (the stack
    must then be empty, which top NONE says). start: the first state."""
    next: np.ndarray
    action: np.ndarray
    accepting: np.ndarray
    start: int

    @property
    def num_states(self) -> int:
        return int(self.next.shape[0])


@lru_cache(maxsize=8)
def json_tables(object_only: bool = True, max_whitespace: int = 20) -> JsonTables:
    """Build the lexer's tables (shared: never modify them)."""
    if isinstance(max_whitespace, bool) or not isinstance(max_whitespace, int) or max_whitespace < 0:
        raise ValueError(f"max_whitespace must be a non-negative integer, got {max_whitespace!r}")
    names: list[tuple] = [("gap", gap, count) for gap in GAPS for count in range(max_whitespace + 1)]
    names += [("string", role, part) for role in ("value", "key") for part in STRING_PARTS]
    names += [("number", part) for part in NUMBER_PARTS]
    names += [("literal", word, read) for word in LITERALS for read in range(1, len(word))]
    position = {name: index for index, name in enumerate(names)}
    size = len(names) * 3
    table = np.full((size, 256), -1, dtype=np.int32)
    action = np.zeros((size, 256), dtype=np.int8)

    def state(name: tuple, top: int) -> int:
        return position[name] * 3 + top

    def gap(kind: str) -> tuple:
        return ("gap", kind, 0)

    def allow(source: int, data: bytes, target: int, does: int = KEEP) -> None:
        for byte in data:
            table[source, byte], action[source, byte] = target, does

    def value_start(source: int, top: int) -> None:
        allow(source, b"{", state(gap("object_first"), OBJECT), PUSH)
        if object_only and top == NONE:
            return
        allow(source, b"[", state(gap("array_first"), ARRAY), PUSH)
        allow(source, b'"', state(("string", "value", "in"), top))
        allow(source, b"-", state(("number", "minus"), top))
        allow(source, b"0", state(("number", "zero"), top))
        allow(source, b"123456789", state(("number", "int"), top))
        for word in LITERALS:
            allow(source, word[:1], state(("literal", word, 1), top))

    def after_value(source: int, top: int) -> None:
        """A value just ended: a comma or the closing bracket of the innermost container."""
        if top == OBJECT:
            allow(source, b",", state(gap("key"), top))
            allow(source, b"}", state(gap("after"), NONE), POP)
        elif top == ARRAY:
            allow(source, b",", state(gap("value"), top))
            allow(source, b"]", state(gap("after"), NONE), POP)

    for top in (NONE, OBJECT, ARRAY):
        for kind in GAPS:
            for count in range(max_whitespace + 1):
                here = state(("gap", kind, count), top)
                if count < max_whitespace and not (kind == "after" and top == NONE):
                    allow(here, WHITESPACE, state(("gap", kind, count + 1), top))
                if kind in ("value", "array_first"):
                    value_start(here, top)
                if kind == "array_first":
                    allow(here, b"]", state(gap("after"), NONE), POP)
                if kind in ("object_first", "key"):
                    allow(here, b'"', state(("string", "key", "in"), top))
                if kind == "object_first":
                    allow(here, b"}", state(gap("after"), NONE), POP)
                if kind == "colon":
                    allow(here, b":", state(gap("value"), top))
                if kind == "after":
                    after_value(here, top)
        for role in ("value", "key"):
            def part(name: str, role: str = role, top: int = top) -> int:
                return state(("string", role, name), top)
            inside = part("in")
            allow(inside, bytes(b for b in range(0x20, 0x80) if b not in b'"\\'), inside)
            allow(inside, b'"', state(gap("after" if role == "value" else "colon"), top))
            allow(inside, b"\\", part("escape"))
            # UTF-8: a lead byte says how many continuation bytes follow; E0, ED, F0 and F4
            # narrow the first one (no overlong forms, no surrogates, nothing past U+10FFFF).
            allow(inside, bytes(range(0xC2, 0xE0)), part("cont1"))
            allow(inside, bytes([0xE0]), part("e0"))
            allow(inside, bytes(range(0xE1, 0xED)) + bytes([0xEE, 0xEF]), part("cont2"))
            allow(inside, bytes([0xED]), part("ed"))
            allow(inside, bytes([0xF0]), part("f0"))
            allow(inside, bytes(range(0xF1, 0xF4)), part("cont3"))
            allow(inside, bytes([0xF4]), part("f4"))
            allow(part("cont1"), bytes(range(0x80, 0xC0)), inside)
            allow(part("cont2"), bytes(range(0x80, 0xC0)), part("cont1"))
            allow(part("cont3"), bytes(range(0x80, 0xC0)), part("cont2"))
            allow(part("e0"), bytes(range(0xA0, 0xC0)), part("cont1"))
            allow(part("ed"), bytes(range(0x80, 0xA0)), part("cont1"))
            allow(part("f0"), bytes(range(0x90, 0xC0)), part("cont2"))
            allow(part("f4"), bytes(range(0x80, 0x90)), part("cont2"))
            allow(part("escape"), b'"\\/bfnrt', inside)
            allow(part("escape"), b"u", part("u4"))
            for need, then in (("u4", "u3"), ("u3", "u2"), ("u2", "u1"), ("u1", "in")):
                allow(part(need), HEX, part(then))

        def number(name: str, top: int = top) -> int:
            return state(("number", name), top)
        for end in NUMBER_ENDS:          # a number ends at the first byte that cannot extend it
            here = number(end)
            table[here], action[here] = table[state(gap("after"), top)], action[state(gap("after"), top)]
        allow(number("minus"), b"0", number("zero"))
        allow(number("minus"), b"123456789", number("int"))
        allow(number("int"), DIGITS, number("int"))
        for source in (number("zero"), number("int")):
            allow(source, b".", number("dot"))
        for source in (number("zero"), number("int"), number("frac")):
            allow(source, b"eE", number("e"))
        allow(number("dot"), DIGITS, number("frac"))
        allow(number("frac"), DIGITS, number("frac"))
        allow(number("e"), b"+-", number("esign"))
        allow(number("e"), DIGITS, number("exp"))
        allow(number("esign"), DIGITS, number("exp"))
        allow(number("exp"), DIGITS, number("exp"))
        for word in LITERALS:
            for read in range(1, len(word)):
                last = read + 1 == len(word)
                allow(state(("literal", word, read), top), word[read:read + 1],
                      state(gap("after"), top) if last else state(("literal", word, read + 1), top))

    accepting = np.zeros(size, dtype=bool)
    accepting[state(gap("after"), NONE)] = True
    if not object_only:
        for end in NUMBER_ENDS:
            accepting[state(("number", end), NONE)] = True
    return JsonTables(table, action, accepting, state(gap("value"), NONE))


def pushdown_step(tables: JsonTables, state: int, stack: list[int], byte: int, max_depth: int) -> int:
    """Read one byte of JSON: the recogniser's transition.  (Your engine: Chapter 35)

    state: a lexer state of `tables` whose top (state % 3) is the kind of stack[-1], or NONE
    when `stack` is empty; stack: the kinds (OBJECT, ARRAY) of the open containers,
    outermost first; byte: 0..255; max_depth: how many containers may be open at once.
    Returns the state after the byte and updates `stack` in place: a PUSH byte appends the
    kind its target state names, a POP byte removes the innermost container, and the
    returned state's top is then the kind of the new innermost one (NONE for an empty
    stack). Returns -1 for a byte the tables refuse and DEEPER for a PUSH that would make
    more than max_depth containers open; in both cases `stack` is left unchanged.
    """
    raise NotImplementedError("Your engine: Chapter 35: pushdown_step")


@dataclass
class StackFreeMasks:
    """What one lexer state decides without knowing the stack below its top.

    allowed: bool [n] over vocabulary.token_ids rows, tokens accepted whatever lies below;
    peak: int16 [n], the most containers each of them has open beyond the start at any
    byte (the depth limit is checked against it per stack); reaching: int64 [m], ascending
    rows of the tokens that close the starting container and read below it."""
    allowed: np.ndarray
    peak: np.ndarray
    reaching: np.ndarray


class JsonIndex:
    """The allowed-token masks of free JSON over one vocabulary, shared by its guides.

    A token's fate depends on the lexer state and on at most `reach` stack entries: it can
    close at most reach - 1 containers (its count of `}` and `]`), then read the kind of
    the one below. So a mask is cached per (state, top `reach` entries, depth room) and is
    made from a per-state stack-free part plus a walk of the few tokens that reach below.
    """

    def __init__(self, vocabulary: Vocabulary, object_only: bool = True, max_depth: int = 32,
                 max_whitespace: int = 20, max_masks: int = 512) -> None:
        if isinstance(max_depth, bool) or not isinstance(max_depth, int) or max_depth < 1:
            raise ValueError(f"max_depth must be a positive integer, got {max_depth!r}")
        self.vocabulary = vocabulary
        self.tables = json_tables(object_only, max_whitespace)
        self.object_only = object_only
        self.max_depth = max_depth
        self.max_whitespace = max_whitespace
        self.max_masks = max_masks
        tokens = [vocabulary.vocab_bytes[i] for i in vocabulary.token_ids.tolist()]
        self.reach = 1 + max((t.count(b"}") + t.count(b"]") for t in tokens), default=0)
        self.max_opens = max((t.count(b"{") + t.count(b"[") for t in tokens), default=0)
        self.stack_free: dict[int, StackFreeMasks] = {}
        self.masks: OrderedDict[tuple, torch.Tensor] = OrderedDict()
        self.dead_end = np.asarray((self.tables.next < 0).all(axis=1))   # no byte may follow

    def walk_tokens(self, rows: np.ndarray, state: int, stack: list[int] | None) -> tuple[np.ndarray, np.ndarray,
                                                                                           np.ndarray]:
        """Walk many tokens at once through the pushdown automaton.  (Your engine: Chapter 35)

        rows: int64 [m], ascending rows of self.vocabulary.byte_matrix (uint8 [n, longest],
        longest token first; vocabulary.longer_than[p] rows have more than p bytes).
        state: the lexer state every walk starts in. stack: the open containers' kinds,
        outermost first, ending with the kind state % 3 names; or None when only the top
        (state % 3) is known and anything may lie below it.
        Returns (alive, reaching, peak), each [m]: alive (bool) is True when every byte of
        the token was accepted by self.tables (next >= 0) and the token never needed the
        kind below a container it closed that the walk did not know; reaching (bool) is True
        for the tokens that needed it (only possible with stack=None; they are not alive);
        peak (int16) is the largest number of containers open at once during the walk beyond
        those open at the start (0 for a token that opens none). The depth limit is not
        checked here. Trap: tokens cannot share one Python stack, and a Python loop over
        the tokens is far too slow (every lexer state walks the whole vocabulary).
        """
        raise NotImplementedError("Your engine: Chapter 35: JsonIndex.walk_tokens")

    def stack_free_masks(self, state: int) -> StackFreeMasks:
        found = self.stack_free.get(state)
        if found is None:
            rows = np.arange(len(self.vocabulary.token_ids))
            alive, reaching, peak = self.walk_tokens(rows, state, None)
            found = self.stack_free[state] = StackFreeMasks(alive, peak, np.flatnonzero(reaching))
        return found

    def mask(self, state: int, stack: list[int]) -> torch.Tensor:
        """bool [vocab_size]: the tokens allowed in `state` over `stack` (cached and shared:
        never modify it). ValueError when the vocabulary cannot spell any continuation."""
        room = self.max_depth - len(stack)
        key = (state, tuple(stack[-self.reach:]), min(room, self.max_opens + 1))
        found = self.masks.get(key)
        if found is not None:
            self.masks.move_to_end(key)
            return found
        free = self.stack_free_masks(state)
        allowed_rows = free.allowed & (free.peak <= room)
        if len(free.reaching):
            alive, _, peak = self.walk_tokens(free.reaching, state, stack)
            allowed_rows[free.reaching[alive & (peak <= room)]] = True
        vocabulary = self.vocabulary
        found = torch.zeros(vocabulary.vocab_size, dtype=torch.bool)
        found[torch.from_numpy(vocabulary.token_ids[allowed_rows])] = True
        if vocabulary.eos_token_id is not None and self.tables.accepting[state]:
            found[vocabulary.eos_token_id] = True
        if not bool(found.any()):
            raise ValueError(f"no token of the vocabulary can continue the JSON text from lexer state {state}")
        self.masks[key] = found
        if len(self.masks) > self.max_masks:
            self.masks.popitem(last=False)
        return found


class JsonGuide:
    """One request's place in free-form JSON (the serve.interfaces.Guide contract)."""

    def __init__(self, index: JsonIndex) -> None:
        self.index = index
        self.state = index.tables.start
        self.stack: list[int] = []
        self.ended = False                        # EOS was accepted: nothing at all may follow

    @property
    def finished(self) -> bool:
        return self.ended or bool(self.index.dead_end[self.state])

    @property
    def complete(self) -> bool:
        """Is the text so far one whole JSON value (of the kind the index asks for)?"""
        return bool(self.index.tables.accepting[self.state])

    def allowed(self) -> torch.Tensor:
        """bool [vocab_size]: the tokens that may come next (shared: read, never write)."""
        return self.index.mask(self.state, self.stack)

    def advance(self, token_id: int) -> None:
        """Move past one accepted token; a refused one raises ValueError naming it and
        leaves the guide as it was."""
        vocabulary = self.index.vocabulary
        if self.ended:
            raise ValueError(f"token {token_id} after the JSON text ended")
        if token_id == vocabulary.eos_token_id and token_id is not None:
            if not self.complete:
                raise ValueError(f"token {token_id} (EOS) before the JSON text is complete")
            self.ended = True
            return
        data = vocabulary.token_bytes(token_id)
        if not data:
            raise ValueError(f"token {token_id} has no bytes and is never allowed in JSON text")
        state, stack = self.state, list(self.stack)
        for offset, byte in enumerate(data):
            state = pushdown_step(self.index.tables, state, stack, byte, self.index.max_depth)
            if state == DEEPER:
                raise ValueError(f"token {token_id} ({data!r}) would nest JSON deeper than max_depth "
                                 f"{self.index.max_depth}")
            if state < 0:
                raise ValueError(f"token {token_id} ({data!r}) is not allowed in JSON here: byte {offset} "
                                 f"({bytes([byte])!r}) cannot follow {data[:offset]!r} in lexer state {self.state}")
        self.state, self.stack = state, stack
