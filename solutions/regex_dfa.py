"""Chapter 35: a regular-expression engine whose automaton reads BYTES, for constrained decoding.

    parse_regex      a pattern (str) -> a syntax tree of Chars, Concat, Alt and Repeat nodes
    build_nfa        the tree -> a Thompson NFA whose edges are byte ranges (UTF-8)
    epsilon_closure  the NFA states reachable through empty moves
    determinize      subset construction: the NFA -> a DFA over the 256 byte values
    compile_regex    all of it, plus trimming dead states and minimisation: pattern -> DFA

Language models emit tokens, and a token is a run of bytes that may end in the middle of a
character, so the automaton reads bytes, not characters: every character class becomes
the UTF-8 byte sequences of its code points.

The subset: literals; escapes (\\n \\t \\r \\f \\v \\xHH \\uHHHH \\UHHHHHHHH and escaped
metacharacters); classes [a-z], [^...]; \\d \\w \\s and their negations with their ASCII
meaning (Python's re.ASCII), or with ecma=True those of JSON Schema's "pattern", which
validators read with ECMA-262's or with Python's engine: a class is cut to the characters
both engines agree on (see ecma_class_escapes), and "." excludes every line terminator;
"." (any character but newline); groups (...) and (?:...);
alternation |; the quantifiers * + ? {m} {m,} {m,n} {,n}. The whole text must match
(re.fullmatch), so anchors are refused, as are backreferences, lookarounds and lazy
quantifiers (which cannot change what fullmatch accepts, and which we refuse rather
than silently ignore; with ecma=True, for a search, a lazy quantifier is read as greedy).
"""
from __future__ import annotations

import bisect
import gc
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from itertools import chain

import numpy as np

MAX_CODE_POINT = 0x10FFFF
SURROGATES = (0xD800, 0xDFFF)           # not characters: UTF-8 cannot encode them
# Stated limits, so that compiling a hostile pattern is refused in milliseconds instead of
# running for minutes (every one is checked while the automaton is built, not afterwards):
MAX_REPEAT = 1000                       # the largest count {m,n} may name
MAX_NESTING = 64                        # groups (and schema levels) open at once
MAX_NFA_STATES = 60000                  # the Thompson NFA (a "." is about 20 states, a JSON string character 40)
MAX_DFA_STATES = 30000                  # the DFA before minimisation
MINIMIZE_LIMIT = 8000                   # the largest trimmed DFA that compile_nfa minimises

# A set of characters: sorted, disjoint, non-adjacent inclusive code-point intervals.
CharSet = tuple[tuple[int, int], ...]


def _normalise(intervals: Iterable[tuple[int, int]]) -> CharSet:
    """Sort and merge intervals; surrogate code points are dropped (they have no UTF-8)."""
    pieces: list[tuple[int, int]] = []
    for lo, hi in intervals:
        for a, b in ((lo, min(hi, SURROGATES[0] - 1)), (max(lo, SURROGATES[1] + 1), hi)):
            if a <= b:
                pieces.append((a, b))
    merged: list[tuple[int, int]] = []
    for lo, hi in sorted(pieces):
        if merged and lo <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    return tuple(merged)


def complement(chars: CharSet) -> CharSet:
    """Every character not in `chars`."""
    gaps, start = [], 0
    for lo, hi in chars:
        if lo > start:
            gaps.append((start, lo - 1))
        start = hi + 1
    if start <= MAX_CODE_POINT:
        gaps.append((start, MAX_CODE_POINT))
    return _normalise(gaps)


def intersection(a: CharSet, b: CharSet) -> CharSet:
    """The characters in both sets."""
    return complement(_normalise(complement(a) + complement(b)))


DIGITS = _normalise([(ord("0"), ord("9"))])
WORD = _normalise([(ord("a"), ord("z")), (ord("A"), ord("Z")), (ord("0"), ord("9")), (ord("_"), ord("_"))])
SPACE = _normalise([(ord(c), ord(c)) for c in " \t\n\r\f\v"])
ANY_BUT_NEWLINE = complement(_normalise([(10, 10)]))
CLASS_ESCAPES = {"d": DIGITS, "D": complement(DIGITS), "w": WORD, "W": complement(WORD),
                 "s": SPACE, "S": complement(SPACE)}
# ECMA-262's WhiteSpace and LineTerminator code points, which its \\s matches (ES2024 22.2.2.9),
# and those of Python's re (which validators written in Python use): \\s is written only as
# a character both call a space, \\S, \\D and \\W only as one neither calls a space, a
# digit or a word character, so that what is written matches under either engine.
ECMA_SPACE = _normalise([(0x09, 0x0D), (0x20, 0x20), (0xA0, 0xA0), (0x1680, 0x1680), (0x2000, 0x200A),
                         (0x2028, 0x2029), (0x202F, 0x202F), (0x205F, 0x205F), (0x3000, 0x3000),
                         (0xFEFF, 0xFEFF)])
PYTHON_SPACE = _normalise([(code, code) for code in range(0x3001) if chr(code).isspace()])


@lru_cache(maxsize=None)
def _unicode_class(name: str) -> CharSet:
    """The code points Python's re counts as digits ("d") or word characters ("w"), as
    intervals: a scan of every code point, made once, on first use (a fraction of a second)."""
    test = str.isdecimal if name == "d" else (lambda char: char.isalnum() or char == "_")
    runs: list[tuple[int, int]] = []
    start = -1
    for code in range(MAX_CODE_POINT + 2):
        inside = code <= MAX_CODE_POINT and not SURROGATES[0] <= code <= SURROGATES[1] and test(chr(code))
        if inside and start < 0:
            start = code
        elif not inside and start >= 0:
            runs.append((start, code - 1))
            start = -1
    return _normalise(runs)


class _EcmaClasses(dict):
    """The class escapes of a JSON Schema pattern; \\D and \\W are computed when first asked."""

    def __missing__(self, key: str) -> CharSet:
        if key not in "DW":
            raise KeyError(key)
        value = self[key] = complement(_normalise(CLASS_ESCAPES[key.lower()] + _unicode_class(key.lower())))
        return value

    def __contains__(self, key: object) -> bool:
        return key in ("d", "w", "s", "S", "D", "W")


ECMA_CLASS_ESCAPES = _EcmaClasses(d=DIGITS, w=WORD, s=intersection(ECMA_SPACE, PYTHON_SPACE),
                                  S=complement(_normalise(ECMA_SPACE + PYTHON_SPACE)))


ECMA_ANY = complement(_normalise([(10, 10), (13, 13), (0x2028, 0x2029)]))
CONTROL_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v", "a": "\a"}
HEX_ESCAPES = {"x": 2, "u": 4, "U": 8}
METACHARACTERS = set(".^$*+?{}[]\\|()")


# --- the syntax tree ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Chars:
    """One character from `chars`."""
    chars: CharSet


@dataclass(frozen=True)
class Concat:
    """The parts one after another (no parts: the empty string)."""
    parts: tuple[Node, ...]


@dataclass(frozen=True)
class Alt:
    """Any one of the options."""
    options: tuple[Node, ...]


@dataclass(frozen=True)
class Repeat:
    """`node` between `low` and `high` times (high None: no upper bound)."""
    node: Node
    low: int
    high: int | None


Node = Chars | Concat | Alt | Repeat


class _Parser:
    """Recursive descent over the pattern: alternation > concatenation > quantified atom."""

    def __init__(self, pattern: str, ecma: bool) -> None:
        self.pattern = pattern
        self.classes = ECMA_CLASS_ESCAPES if ecma else CLASS_ESCAPES
        self.any = ECMA_ANY if ecma else ANY_BUT_NEWLINE
        self.ecma = ecma
        self.pos = 0
        self.depth = 0                                  # groups open at self.pos

    def fail(self, rule: str, at: int | None = None) -> ValueError:
        where = self.pos if at is None else at
        shown = self.pattern if len(self.pattern) <= 60 else self.pattern[:57] + "..."
        return ValueError(f"regex {shown!r}, position {where}: {rule}")

    def peek(self, text: str) -> bool:
        return self.pattern.startswith(text, self.pos)

    def parse(self) -> Node:
        node = self.alternation()
        if self.pos < len(self.pattern):         # only an unmatched ")" stops the alternation early
            raise self.fail("unbalanced parenthesis ')'")
        return node

    def alternation(self) -> Node:
        options = [self.concatenation()]
        while self.peek("|"):
            self.pos += 1
            options.append(self.concatenation())
        return options[0] if len(options) == 1 else Alt(tuple(options))

    def concatenation(self) -> Node:
        parts: list[Node] = []
        while self.pos < len(self.pattern) and not self.peek("|") and not self.peek(")"):
            parts.append(self.quantified(self.atom()))
        return parts[0] if len(parts) == 1 else Concat(tuple(parts))

    def quantified(self, node: Node) -> Node:
        """`node` with the quantifier that follows it, if any (one per atom, as in Python)."""
        if self.pos >= len(self.pattern):
            return node
        char = self.pattern[self.pos]
        if char in "*+?":
            self.pos += 1
            low, high = {"*": (0, None), "+": (1, None), "?": (0, 1)}[char]
        elif char == "{" and (counts := self.counts()) is not None:
            low, high = counts
        else:
            return node
        if self.ecma and self.peek("?"):
            self.pos += 1     # lazy: a pattern (a search) finds a match exactly when the greedy one does
        elif self.peek("?") or self.peek("+"):
            raise self.fail("lazy and possessive quantifiers are not supported (fullmatch needs neither)")
        after = self.pos
        if self.peek("*") or (self.peek("{") and self.counts() is not None):
            raise self.fail("multiple repeat: put the repeated part in a group first", after)
        return Repeat(node, low, high)

    def counts(self) -> tuple[int, int | None] | None:
        """{m} {m,} {m,n} {,n} at self.pos, consumed; None (nothing consumed) when the brace
        is not a quantifier, in which case it is a literal "{" as in Python's re."""
        end = self.pattern.find("}", self.pos)
        if end < 0:
            return None
        body = self.pattern[self.pos + 1:end]
        low_text, comma, high_text = body.partition(",")
        if not (low_text.isdigit() or (comma and not low_text)) or not (high_text.isdigit() or not high_text):
            return None
        if not comma and not low_text:
            return None
        low = int(low_text) if low_text else 0
        high = (int(high_text) if high_text else None) if comma else low
        if max(low, high or 0) > MAX_REPEAT:
            raise self.fail(f"repeat counts above {MAX_REPEAT} are refused")
        if high is not None and high < low:
            raise self.fail(f"min repeat {low} greater than max repeat {high}")
        self.pos = end + 1
        return low, high

    def atom(self) -> Node:
        char = self.pattern[self.pos]
        if char == "(":
            if self.depth >= MAX_NESTING:
                raise self.fail(f"groups nested more than MAX_NESTING={MAX_NESTING} deep are refused")
            self.pos += 1
            if self.peek("?:"):
                self.pos += 2
            elif self.peek("?"):
                raise self.fail("only (...) and (?:...) groups are supported")
            self.depth += 1
            inner = self.alternation()
            self.depth -= 1
            if not self.peek(")"):
                raise self.fail("missing ), unterminated subpattern")
            self.pos += 1
            return inner
        if char in "*+?":
            raise self.fail(f"nothing to repeat before {char!r}")
        if char in "^$":
            raise self.fail("anchors are not supported: the whole output must match anyway")
        if char == "[":
            return Chars(self.char_class())
        self.pos += 1
        if char == ".":
            return Chars(self.any)
        if char == "\\":
            return Chars(self.escape())
        return Chars(_normalise([(ord(char), ord(char))]))

    def escape(self) -> CharSet:
        """The set an escape (self.pos just past the backslash) stands for; consumes it."""
        if self.pos >= len(self.pattern):
            raise self.fail("bad escape (end of pattern)")
        char = self.pattern[self.pos]
        self.pos += 1
        if char in self.classes:
            return self.classes[char]
        if char in CONTROL_ESCAPES:
            return _normalise([(ord(CONTROL_ESCAPES[char]),) * 2])
        if char in HEX_ESCAPES:
            digits = self.pattern[self.pos:self.pos + HEX_ESCAPES[char]]
            if len(digits) != HEX_ESCAPES[char] or any(d not in "0123456789abcdefABCDEF" for d in digits):
                raise self.fail(f"\\{char} needs {HEX_ESCAPES[char]} hex digits")
            self.pos += len(digits)
            code = int(digits, 16)
            if code > MAX_CODE_POINT:
                raise self.fail(f"\\{char}{digits} is beyond the last code point")
            return _normalise([(code, code)])
        if char.isascii() and char.isalnum():          # \b, \1, \A ...: anchors and backreferences
            raise self.fail(f"bad escape \\{char} (not in the supported subset)", self.pos - 2)
        return _normalise([(ord(char), ord(char))])

    def char_class(self) -> CharSet:
        start = self.pos
        self.pos += 1                                   # the "["
        negate = self.peek("^")
        if negate:
            self.pos += 1
        if self.peek("]"):
            raise self.fail("an empty class or a leading ']' is not supported: write \\] for a literal ]")
        items: list[tuple[int, int]] = []
        while not self.peek("]"):
            if self.pos >= len(self.pattern):
                raise self.fail("unterminated character set", start)
            first = self.class_item()
            if self.peek("-") and not self.pattern.startswith("-]", self.pos):
                dash = self.pos
                self.pos += 1
                last = self.class_item()
                if len(first) != 1 or first[0][0] != first[0][1] or len(last) != 1 or last[0][0] != last[0][1]:
                    raise self.fail("bad character range: both ends must be single characters", dash)
                if last[0][0] < first[0][0]:
                    raise self.fail("bad character range: the end is before the start", dash)
                items.append((first[0][0], last[0][0]))
            else:
                items.extend(first)
        self.pos += 1                                   # the "]"
        chars = _normalise(items)
        return complement(chars) if negate else chars

    def class_item(self) -> CharSet:
        if self.pos >= len(self.pattern):
            raise self.fail("unterminated character set")
        char = self.pattern[self.pos]
        self.pos += 1
        if char == "\\":
            return self.escape()
        if char == "[":
            raise self.fail("a literal '[' inside a class must be escaped (\\[)", self.pos - 1)
        return _normalise([(ord(char), ord(char))])


def parse_regex(pattern: str, ecma: bool = False) -> Node:
    """The syntax tree of `pattern` (ecma: its classes and "." as ECMA-262 reads them);
    ValueError naming the position and the rule it breaks."""
    if not isinstance(pattern, str):
        raise ValueError(f"a regex is a str, got {type(pattern).__name__}")
    return _Parser(pattern, ecma).parse()


# --- characters to UTF-8 byte ranges ----------------------------------------------------------

UTF8_LENGTH_LIMITS = (0x7F, 0x7FF, 0xFFFF, MAX_CODE_POINT)     # last code point of 1..4 bytes


def utf8_sequences(lo: int, hi: int) -> list[list[tuple[int, int]]]:
    """The code points lo..hi (no surrogates) as UTF-8: a list of sequences of byte ranges,
    each sequence matching a contiguous block of code points byte range by byte range."""
    for limit in UTF8_LENGTH_LIMITS[:-1]:               # one encoded length per piece
        if lo <= limit < hi:
            return utf8_sequences(lo, limit) + utf8_sequences(limit + 1, hi)
    if hi <= 0x7F:
        return [[(lo, hi)]]
    length = next(n for n, limit in enumerate(UTF8_LENGTH_LIMITS, 1) if hi <= limit)
    for i in range(1, length):
        # Split until every continuation byte after the varying one spans its full 0x80..0xBF.
        low_bits = (1 << (6 * i)) - 1
        if lo & ~low_bits != hi & ~low_bits:
            if lo & low_bits:
                return utf8_sequences(lo, lo | low_bits) + utf8_sequences((lo | low_bits) + 1, hi)
            if hi & low_bits != low_bits:
                return utf8_sequences(lo, (hi & ~low_bits) - 1) + utf8_sequences(hi & ~low_bits, hi)
    first, last = chr(lo).encode("utf-8"), chr(hi).encode("utf-8")
    return [list(zip(first, last))]


# --- the NFA ------------------------------------------------------------------------------------

def _too_many_nfa_states() -> ValueError:
    return ValueError(f"the automaton needs more than MAX_NFA_STATES={MAX_NFA_STATES} NFA states "
                      f"(a repeat count or a nesting too large)")


@dataclass
class NFA:
    """A Thompson NFA over bytes: state i has `edges[i]` (lo, hi, target) byte-range moves
    and `empty[i]` moves that read nothing; one start, one accepting state. ValueError
    once it would grow past MAX_NFA_STATES states."""
    edges: list[list[tuple[int, int, int]]] = field(default_factory=list)
    empty: list[list[int]] = field(default_factory=list)
    start: int = 0
    accept: int = 0

    def new_state(self) -> int:
        if len(self.edges) >= MAX_NFA_STATES:
            raise _too_many_nfa_states()
        self.edges.append([])
        self.empty.append([])
        return len(self.edges) - 1

    def new_states(self, count: int) -> list[int]:
        """`count` new states at once, numbered on from the last (as many new_state calls)."""
        first = len(self.edges)
        if first + count > MAX_NFA_STATES:
            raise _too_many_nfa_states()
        self.edges.extend([] for _ in range(count))
        self.empty.extend([] for _ in range(count))
        return list(range(first, first + count))

    def link(self, source: int, target: int) -> None:
        """An empty move from `source` to `target`."""
        self.empty[source].append(target)

    def chain(self, fragments: list[tuple[int, int]]) -> tuple[int, int]:
        """The fragments one after another (no fragments: the empty string)."""
        if not fragments:
            state = self.new_state()
            return state, state
        for (_, end), (start, _) in zip(fragments, fragments[1:]):
            self.link(end, start)
        return fragments[0][0], fragments[-1][1]

    def choice(self, fragments: list[tuple[int, int]]) -> tuple[int, int]:
        """Any one of the fragments (no fragments: no string at all)."""
        start, end = self.new_state(), self.new_state()
        for option_start, option_end in fragments:
            self.link(start, option_start)
            self.link(option_end, end)
        return start, end


def add_fragment(nfa: NFA, node: Node) -> tuple[int, int]:
    """Add the states of `node` to `nfa`; returns (start, end): the paths from start to end
    read exactly the UTF-8 encodings of the strings `node` matches."""
    if isinstance(node, Chars):
        start, end = nfa.new_state(), nfa.new_state()
        for lo, hi in node.chars:
            for sequence in utf8_sequences(lo, hi):
                here = start
                for k, (byte_lo, byte_hi) in enumerate(sequence):
                    there = end if k == len(sequence) - 1 else nfa.new_state()
                    nfa.edges[here].append((byte_lo, byte_hi, there))
                    here = there
        return start, end
    if isinstance(node, Concat):
        return nfa.chain([add_fragment(nfa, part) for part in node.parts])
    if isinstance(node, Alt):
        return nfa.choice([add_fragment(nfa, option) for option in node.options])
    return add_repeat(nfa, lambda: add_fragment(nfa, node.node), node.low, node.high)


def add_repeat(nfa: NFA, make: Callable[[], tuple[int, int]], low: int, high: int | None,
               separator: Callable[[], tuple[int, int]] | None = None) -> tuple[int, int]:
    """`make()`'s language low..high times (high None: no bound), `separator()`'s between
    two copies. An unbounded repeat loops back into its last copy instead of adding one, so
    x{1,} holds one copy of x, not two: nested repeats grow linearly, not by doubling."""
    def unit(first: bool) -> tuple[int, int]:
        return make() if first or separator is None else nfa.chain([separator(), make()])

    start = here = nfa.new_state()
    end = nfa.new_state()
    copies = max(low, 1) if high is None else high
    for k in range(copies):
        if k >= low:                                      # an optional copy: may stop before it
            nfa.link(here, end)
        copy_start, copy_end = unit(k == 0)
        nfa.link(here, copy_start)
        here = copy_end
    if high is None:                                      # loop back into the last copy
        if separator is None or copies > 1:               # (its start reads the separator, if any)
            nfa.link(here, copy_start)
        else:
            separator_start, separator_end = separator()
            nfa.link(here, separator_start)
            nfa.link(separator_end, copy_start)
    nfa.link(here, end)
    return start, end


def build_nfa(tree: Node) -> NFA:
    """The NFA that accepts exactly the UTF-8 encodings of the strings `tree` matches."""
    nfa = NFA()
    nfa.start, nfa.accept = add_fragment(nfa, tree)
    return nfa


def epsilon_closure(nfa: NFA, states: Iterable[int]) -> frozenset[int]:
    """The NFA states reachable from `states` by empty moves alone, `states` included.  (Your engine: Chapter 35)

    nfa.empty[i]: the targets of state i's empty moves (byte moves do not count). states:
    any iterable of state numbers, possibly empty. Returns a frozenset[int]: DFA states are
    named by these sets, so equal closures must compare and hash equal.
    Trap: empty moves form cycles.
    """
    seen = set(states)
    stack = list(seen)
    while stack:
        for target in nfa.empty[stack.pop()]:
            if target not in seen:
                seen.add(target)
                stack.append(target)
    return frozenset(seen)


def byte_classes(nfa: NFA) -> list[int]:
    """One representative byte per class of bytes that every NFA edge treats alike: two bytes
    in one class go to the same states from every state, so the DFA needs one column each."""
    cuts = {0, 256}
    for edges in nfa.edges:
        for lo, hi, _ in edges:
            cuts.update((lo, hi + 1))
    return sorted(cuts)[:-1]


@dataclass
class DFA:
    """A deterministic automaton over bytes.

    transitions: int32 [num_states, 256], the next state for each byte, -1 for "no match
    can follow"; accepting: bool [num_states]; start: the start state. After compile_regex
    every state can still reach an accepting state (dead states are trimmed to -1)."""
    transitions: np.ndarray
    accepting: np.ndarray
    start: int

    @property
    def num_states(self) -> int:
        return int(self.transitions.shape[0])

    @cached_property
    def byte_runs(self) -> list[tuple[int, int, int, int]]:
        """(state, first byte, last byte, target): each state's moves as runs of consecutive
        bytes with one target, -1 left out (an automaton is never changed once built)."""
        table = self.transitions
        starts_run = np.ones(table.shape, dtype=bool)
        starts_run[:, 1:] = table[:, 1:] != table[:, :-1]
        states, lows = np.nonzero(starts_run)
        highs = np.append(lows[1:] - 1, 255)
        highs[np.append(states[1:] != states[:-1], True)] = 255     # a state's last run ends at 255
        targets = table[states, lows]
        kept = targets >= 0
        return list(zip(states[kept].tolist(), lows[kept].tolist(), highs[kept].tolist(), targets[kept].tolist()))

    def walk(self, state: int, data: bytes) -> int:
        """The state after reading `data` from `state`; -1 once no match can follow."""
        table = self.transitions
        for byte in data:
            state = int(table[state, byte])
            if state < 0:
                return -1
        return state

    def fullmatch(self, data: bytes) -> bool:
        """Does the whole of `data` match?"""
        end = self.walk(self.start, data)
        return end >= 0 and bool(self.accepting[end])


def determinize(nfa: NFA) -> DFA:
    """The DFA that reads bytes as `nfa` does, one state per set of NFA states.  (Your engine: Chapter 35)

    Returns DFA(transitions int32 [S, 256], accepting bool [S], start 0) such that:
    - each state stands for one set of NFA states closed under empty moves (an
      epsilon_closure), no two states for the same set, state 0 for nfa.start's closure;
    - for every byte string w, walking w from state 0 through transitions (an edge
      (lo, hi, target) of the NFA reads bytes lo..hi) ends in the state whose set is exactly
      the NFA states the NFA can be in after reading w, or at -1 as soon as that set is
      empty;
    - accepting[s] is True exactly when s's set holds nfa.accept;
    - every state is reachable from state 0; states that cannot reach an accepting one
      stay (trim and minimize come later, in compile_nfa).
    Errors: ValueError naming MAX_DFA_STATES when the DFA would need more states than that.
    Example: (a|b)*abb as the NFA 0 -a,b-> 0, 0 -a-> 1 -b-> 2 -b-> 3 (accept, no empty
    moves) gives four states, the sets {0}, {0,1}, {0,2} and {0,3}; only {0,3} accepts, and
    every column but 'a' and 'b' holds -1.
    Trap: a JSON schema's pattern makes hundreds of states of 256 columns each, and it is
    compiled while a request waits; byte_classes(nfa) (given) lists the byte ranges that
    every NFA state treats alike.
    """
    cuts = byte_classes(nfa)
    bounds = cuts + [256]
    first = epsilon_closure(nfa, [nfa.start])
    number = {first: 0}
    order = [first]
    # Most classes of a row reach the same few sets, which other rows reach too: each set's
    # closure (and so its DFA state) is looked up once, not once per class and row.
    number_after: dict[frozenset[int], int] = {}    # NFA states a byte reaches -> the DFA state

    def state_after(reached: frozenset[int], closed: bool = False) -> int:
        """The DFA state of the NFA states `reached` (closed: already closed under empty moves)."""
        if reached not in number_after:
            closure = reached if closed else epsilon_closure(nfa, reached)
            if closure not in number:
                if len(order) >= MAX_DFA_STATES:
                    raise ValueError(f"the pattern needs more than MAX_DFA_STATES={MAX_DFA_STATES} DFA states")
                number[closure] = len(order)
                order.append(closure)
            number_after[reached] = number[closure]
        return number_after[reached]

    after_one: dict[int, int] = {}                  # the same for one NFA state reached
    table = np.full((64, 256), -1, dtype=np.int32)  # rows filled so far, room doubled when full
    done = 0
    while done < len(order):
        if done == len(table):
            table = np.concatenate([table, np.full_like(table, -1)])
        current, row = order[done], table[done]
        done += 1
        # Most sets of a schema's automaton move on byte ranges that do not overlap (one NFA
        # state moves, a piece added from a DFA): then each range reaches one NFA state and is
        # written at once, without splitting it into byte classes.
        moves = sorted(chain.from_iterable(map(nfa.edges.__getitem__, current)))   # every state's edges
        last = -1
        for lo, hi, _ in moves:
            if lo <= last:
                break
            last = hi
        else:
            for lo, hi, target in moves:
                after = after_one.get(target)
                if after is None:                   # (a state without empty moves is its own closure)
                    after = after_one[target] = state_after(frozenset((target,)), not nfa.empty[target])
                row[lo:hi + 1] = after
            continue
        moved_by_class: dict[int, set[int]] = {}        # class -> NFA states its bytes reach
        for lo, hi, target in moves:
            for k in range(bisect.bisect_left(cuts, lo), bisect.bisect_right(cuts, hi)):
                moved_by_class.setdefault(k, set()).add(target)
        for k, moved in moved_by_class.items():
            row[cuts[k]:bounds[k + 1]] = state_after(frozenset(moved))
    accepting = np.array([nfa.accept in subset for subset in order], dtype=bool)
    return DFA(table[:done].copy(), accepting, 0)


def column_classes(table: np.ndarray) -> tuple[list[int], np.ndarray]:
    """The bytes (columns) that move every state (row) of `table` alike, as classes: the
    first byte of each class in order, and each byte's class number (int64 [256])."""
    # A column equal to the one before it joins that one's class: only the first column of
    # each run of equal neighbours (a few dozen of 256) is compared with the others.
    starts_run = np.ones(table.shape[1], dtype=bool)
    starts_run[1:] = (table[:, 1:] != table[:, :-1]).any(axis=0)
    heads = np.flatnonzero(starts_run)
    first_with: dict[bytes, int] = {}                # a column's bytes -> its class
    columns = np.ascontiguousarray(table[:, heads].T)
    class_of_head = np.array([first_with.setdefault(column.tobytes(), len(first_with)) for column in columns],
                             dtype=np.int64)
    class_of = class_of_head[np.cumsum(starts_run) - 1]
    return np.unique(class_of, return_index=True)[1].tolist(), class_of     # classes are numbered by first byte


def distinct_columns(table: np.ndarray) -> np.ndarray:
    """The table with one column per distinct byte behaviour (bytes that move every state
    alike need one column): [S, 256] -> [S, C] with C usually a few dozen."""
    return table[:, column_classes(table)[0]]


def breadth_first(columns: np.ndarray, start: int, keep: np.ndarray) -> list[int]:
    """The states `keep` allows that `start` reaches, in breadth-first order, start first."""
    # Each row's moves into kept states, all rows' as one flat list read row by row; a move
    # to the target of the column before it is left out (it would find its target seen).
    wanted = (columns >= 0) & keep[np.maximum(columns, 0)]
    wanted[:, 1:] &= columns[:, 1:] != columns[:, :-1]
    sources, places = np.nonzero(wanted)
    targets = columns[sources, places].tolist()
    first = np.searchsorted(sources, np.arange(columns.shape[0] + 1)).tolist()
    order, seen = [start], {start}
    for state in order:
        for target in targets[first[state]:first[state + 1]]:
            if target not in seen:
                seen.add(target)
                order.append(target)
    return order


def renumbered(dfa: DFA, order: list[int], group: np.ndarray) -> DFA:
    """The DFA whose state i is dfa's state order[i]; a move to state t goes to the new
    number of group[t] (states of one group become one state), -1 stays -1."""
    new_number = np.full(int(group.max()) + 1, -1, dtype=np.int32)
    new_number[group[order]] = np.arange(len(order))
    # Each old state's new number, then one more entry, -1, which the -1 moves index.
    lookup = np.append(np.where(group >= 0, new_number[np.maximum(group, 0)], -1), -1).astype(np.int32)
    return DFA(lookup[dfa.transitions[order]], dfa.accepting[order].copy(), 0)


def _predecessors(columns: np.ndarray) -> tuple[list[int], list[int]]:
    """The states with a move to t (each once) are sources[first[t]:first[t + 1]], from a
    [S, C] table."""
    size = columns.shape[0]
    sources, _ = np.nonzero(columns >= 0)
    pairs = np.unique(columns[columns >= 0].astype(np.int64) * size + sources)   # target, source
    first = np.searchsorted(pairs, np.arange(size + 1, dtype=np.int64) * size)
    return (pairs % size).tolist(), first.tolist()


def trim(dfa: DFA) -> DFA:
    """Drop the states from which no accepting state can be reached (moves into them become
    -1) and those the start cannot reach; renumber so the start is state 0."""
    columns = distinct_columns(dfa.transitions)
    sources, first = _predecessors(columns)
    live = dfa.accepting.tolist()
    todo = np.flatnonzero(dfa.accepting).tolist()
    while todo:                                      # grow backwards from the accepting states
        target = todo.pop()
        for source in sources[first[target]:first[target + 1]]:
            if not live[source]:
                live[source] = True
                todo.append(source)
    alive = np.array(live, dtype=bool)
    if not alive[dfa.start]:
        raise ValueError("the pattern or schema matches no string: nothing could be written")
    order = breadth_first(columns, dfa.start, alive)
    return renumbered(dfa, order, np.where(alive, np.arange(dfa.num_states), -1))


MOORE_ROUNDS = 48                      # vectorised refinement rounds tried before Hopcroft's


def _moore_rounds(columns: np.ndarray, accepting: np.ndarray, rounds: int) -> tuple[np.ndarray, bool]:
    """Moore's refinement in numpy: every round splits each block by the blocks its states
    move to on every class, all at once. The block of each state after at most `rounds`
    rounds, and whether no block splits any more (if not, a long chain: Hopcroft's order
    refines these blocks further)."""
    block = _row_classes(np.concatenate([accepting[:, None], columns >= 0], axis=1).astype(np.int64))
    count = int(block.max()) + 1
    for _ in range(rounds):
        moved = np.append(block, -1)[columns]             # a -1 move indexes the appended -1
        block = _row_classes(np.concatenate([block[:, None], moved], axis=1))
        if int(block.max()) + 1 == count:
            return block, True
        count = int(block.max()) + 1
    return block, False


def _row_classes(rows: np.ndarray) -> np.ndarray:
    """A number per row, equal for equal rows (0, 1, ... in sorted order of the rows)."""
    order = np.lexsort(rows.T[::-1])
    ordered = rows[order]
    starts = np.concatenate([[0], np.any(ordered[1:] != ordered[:-1], axis=1)]).cumsum()
    numbers = np.empty(len(rows), dtype=np.int64)
    numbers[order] = starts
    return numbers


def minimize(dfa: DFA) -> DFA:
    """The smallest DFA for the same language: states that accept alike, have moves on the
    same bytes and move to the same blocks on every byte merge. Partition refinement: up to
    MOORE_ROUNDS rounds of Moore's (each vectorised), which settle most automata of schemas;
    when they do not (long chains), Hopcroft's from the blocks they reached (O(C E log S)
    for S states, C byte classes and E moves).
    Expects a trimmed DFA (so a -1 move and a move into a live state always differ)."""
    columns = distinct_columns(dfa.transitions)
    blocks, settled = _moore_rounds(columns, dfa.accepting, MOORE_ROUNDS)
    dense = blocks if settled else _hopcroft(columns, blocks)
    # One representative per block, in breadth-first order from the start's block.
    first_of_block = np.full(int(dense.max()) + 1, -1, dtype=np.int64)
    first_of_block[dense[::-1]] = np.arange(dfa.num_states)[::-1]
    is_first = np.zeros(dfa.num_states, dtype=bool)
    is_first[first_of_block] = True
    representative = first_of_block[dense]           # every state -> its block's first state
    reduced = np.where(columns >= 0, representative[np.maximum(columns, 0)], -1)
    order = breadth_first(reduced, int(representative[dfa.start]), is_first)
    return renumbered(dfa, order, representative)


def _hopcroft(columns: np.ndarray, first: np.ndarray) -> np.ndarray:
    """Each state's block (numbered densely) by Hopcroft's partition refinement, from the
    blocks `first` (any partition coarser than the result that already parts states which
    accept or have moves differently: Moore's after a few rounds, say). A splitter
    (block, class) is kept only when some state of the block is entered on the class: the
    others split nothing, and in the automata of schemas most states are entered on a few
    of the dozens of classes, so skipping them saves most of the work."""
    size, num_classes = columns.shape
    sources, classes = np.nonzero(columns >= 0)
    targets = columns[sources, classes].astype(np.int64)
    # inverse[c]: the states sorted by their target on class c, and where each target's run
    # starts (the -1 moves sort first and are never looked up).
    inverse = []
    for c in range(num_classes):
        by_target = np.argsort(columns[:, c], kind="stable")
        starts = np.searchsorted(columns[by_target, c], np.arange(size + 1))
        inverse.append((by_target.tolist(), starts.tolist()))
    # entering[s]: the classes on which some move enters s; entered_on[c]: the states entered on c.
    pairs = np.unique(targets * num_classes + classes)
    entering: list[list[int]] = [[] for _ in range(size)]
    entered_on: list[set[int]] = [set() for _ in range(num_classes)]
    for target, c in zip((pairs // num_classes).tolist(), (pairs % num_classes).tolist()):
        entering[target].append(c)
        entered_on[c].add(target)

    def entered(states: set[int]) -> set[int]:
        return set().union(*(entering[state] for state in states))

    # The first blocks are all splitters.
    block_of = first.tolist()
    blocks: list[set[int]] = [set() for _ in range(max(block_of) + 1)]
    for state, block in enumerate(block_of):
        blocks[block].add(state)
    pending = [entered(states) for states in blocks]     # block -> the classes it still splits on
    waiting = list(range(len(blocks)))                   # blocks that may have pending classes
    while waiting:
        splitter = waiting.pop()
        if not pending[splitter]:
            continue
        c = pending[splitter].pop()
        waiting.append(splitter)
        by_target, starts = inverse[c]
        reaching: dict[int, list[int]] = {}          # block -> its states that move into the splitter
        for target in blocks[splitter] & entered_on[c]:
            for source in by_target[starts[target]:starts[target + 1]]:
                reaching.setdefault(block_of[source], []).append(source)
        for block, inside in reaching.items():
            if len(inside) == len(blocks[block]):
                continue
            new = len(blocks)
            part = set(inside)
            blocks[block] -= part
            blocks.append(part)
            for state in inside:
                block_of[state] = new
            # Splitters pending for the block are pending for both halves; of the others,
            # the smaller half's suffice (the larger half's follow from them and the block's).
            pending.append(set(pending[block]))
            smaller = new if len(part) <= len(blocks[block]) else block
            pending[smaller] |= entered(blocks[smaller])
            waiting += [new, block]
    return np.unique(np.array(block_of, dtype=np.int64), return_inverse=True)[1].reshape(-1)


def compile_nfa(nfa: NFA) -> DFA:
    """The trimmed DFA of an NFA, minimal when trimming leaves at most MINIMIZE_LIMIT states.
    Past that it is only trimmed: minimising a large schema's automaton took seconds of CPU
    (most of its compile time) and, because its pieces are minimal DFAs already, mostly
    saved few states."""
    return reduced(determinize(nfa))


def reduced(dfa: DFA) -> DFA:
    """`dfa` trimmed, then minimised when at most MINIMIZE_LIMIT states are left."""
    trimmed = trim(dfa)
    return minimize(trimmed) if trimmed.num_states <= MINIMIZE_LIMIT else trimmed


def combine(a: DFA, b: DFA, keep: Callable[[bool, bool], bool]) -> DFA | None:
    """The product automaton of `a` and `b`: it accepts the strings for which keep(a accepts,
    b accepts) holds (and: intersection; a and not b: difference). A missing move counts as a
    move to a rejecting sink, so a difference keeps the strings b never reads to the end.
    Reduced as compile_nfa's result is; None when it accepts nothing. ValueError past
    MAX_DFA_STATES."""
    sink_a, sink_b = a.num_states, b.num_states              # each side's sink: its row is all sinks
    moves_a = np.vstack([np.where(a.transitions >= 0, a.transitions, sink_a), np.full((1, 256), sink_a)])
    moves_b = np.vstack([np.where(b.transitions >= 0, b.transitions, sink_b), np.full((1, 256), sink_b)])
    accepts_a = np.append(a.accepting, False)
    accepts_b = np.append(b.accepting, False)
    # Bytes that move every state of both automata alike form one class: the product is
    # explored one column per class (a few dozen), then spread back over the 256 bytes.
    first_bytes, byte_class = column_classes(np.vstack([moves_a, moves_b]))
    moves_a, moves_b = moves_a[:, first_bytes].astype(np.int64), moves_b[:, first_bytes]
    width = sink_b + 1
    # Once a side is in its sink, a pair that can no longer be kept (either side's sink for an
    # intersection, a's for a difference) is not explored: a move into it is -1.
    kept_after_sink_a = keep(False, False) or keep(False, True)
    kept_after_sink_b = keep(False, False) or keep(True, False)
    # Explored breadth first, a level at a time: the pairs a level moves to are numbered in
    # numpy, and only the distinct ones (a few per row of dozens of columns) are looked up.
    number = {a.start * width + b.start: 0}
    order = [a.start * width + b.start]
    rows: list[np.ndarray] = []
    level = np.array(order, dtype=np.int64)
    while len(level):
        codes = moves_a[level // width] * width + moves_b[level % width]
        distinct, where = np.unique(codes, return_inverse=True)
        states, new = [], []
        for code in distinct.tolist():
            state = number.get(code)
            if state is None:
                if ((code // width == sink_a and not kept_after_sink_a)
                        or (code % width == sink_b and not kept_after_sink_b)):
                    state = -1
                elif len(order) >= MAX_DFA_STATES:
                    raise ValueError(f"combining two automata needs more than MAX_DFA_STATES={MAX_DFA_STATES} states")
                else:
                    state = len(order)
                    order.append(code)
                    new.append(code)
                number[code] = state
            states.append(state)
        rows.append(np.array(states, dtype=np.int32)[where.reshape(codes.shape)])
        level = np.array(new, dtype=np.int64)
    pairs = np.array(order, dtype=np.int64)
    accepting = np.array([keep(bool(x), bool(y)) for x, y in zip(accepts_a[pairs // width], accepts_b[pairs % width])])
    if not accepting.any():
        return None
    table = np.concatenate(rows)[:, byte_class]
    return reduced(DFA(table, accepting, 0))


def add_dfa(nfa: NFA, dfa: DFA) -> tuple[int, int]:
    """Add a DFA's states to `nfa` as a fragment (start, end) that reads its language: the
    way a compiled piece (a difference, a product) joins a larger automaton."""
    *states, end = nfa.new_states(dfa.num_states + 1)
    for state, low, high, target in dfa.byte_runs:
        nfa.edges[states[state]].append((low, high, states[target]))
    for state in np.flatnonzero(dfa.accepting).tolist():
        nfa.link(states[state], end)
    return states[dfa.start], end


@contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cycle collector off for the block, then as it was. Building an automaton
    allocates hundreds of thousands of small lists, tuples and sets that form no cycles, and
    each burst of them made the collector walk them all again: about 30% of the CPU time of
    the largest schemas' compiles."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def compile_regex(pattern: str) -> DFA:
    """The trimmed, minimal byte DFA of `pattern` (fullmatch semantics)."""
    with collector_paused():
        return compile_nfa(build_nfa(parse_regex(pattern)))


def escape(text: str) -> str:
    """A pattern that matches `text` literally."""
    return "".join("\\" + c if c in METACHARACTERS or c == "-" else c for c in text)
