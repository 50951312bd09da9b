"""Chapter 35: token-level guides, the constrained-decoding state the engine keeps per request.

    TokenTrie      the tokens' distinct byte prefixes as a tree, numbered level by level
    Vocabulary     every token's bytes, laid out once for walking them all at the same time
    TokenIndex     one (pattern, vocabulary) pair: the mask of allowed tokens per DFA state,
                   computed the first time a state is reached and kept
    RegexGuide     one request's position in its pattern (serve.interfaces.Guide)
    GuideFactory   SamplingParams.guided_regex / guided_json -> a RegexGuide; compiles each
                   pattern or schema once and shares its TokenIndex between requests;
                   guided_json {"type": "json_object"} -> a pushdown json_pda.JsonGuide

A token is allowed in a DFA state when reading all of its bytes from there leaves the DFA
in a live state (one from which a match can still be completed: compile_regex trims the
others). EOS is allowed exactly in accepting states. A token with no bytes (b"": special
tokens such as <|im_start|>, ids past the tokenizer's list) is never allowed: it would
change nothing and could be drawn forever.
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Protocol

import numpy as np
import torch

from ..json_pda import JsonGuide, JsonIndex
from ..json_regex import compile_schema
from ..regex_dfa import DFA, compile_regex
from .request import SamplingParams

# OpenAI's response_format for "any JSON object", accepted as guided_json: not a schema, and
# not a regular language, so it gets the pushdown guide of json_pda.py.
JSON_OBJECT = {"type": "json_object"}


@dataclass(frozen=True)
class TokenTrie:
    """The distinct byte prefixes of a vocabulary's tokens as a tree, numbered level by level.

    Node 0 is the root (no bytes); node u != 0 is one prefix: its parent's prefix followed by
    byte[u]. The nodes of prefixes d bytes long are the ids levels[d] .. levels[d + 1] - 1,
    ordered by parent and then byte (so a parent's id is always smaller than its children's).
    parent: int64 [N] (-1 for the root); byte: uint8 [N] (0 for the root);
    levels: list of len(longest token) + 2 ids (levels[0] = 0, levels[-1] = N);
    token_node: int64 [n], the node whose prefix is all of row r's bytes (row r of
    Vocabulary.token_ids). A token may end at a node that has children (b"ca" under b"cat"),
    and tokens with the same bytes share a node.
    """
    parent: np.ndarray
    byte: np.ndarray
    levels: list[int]
    token_node: np.ndarray

    @property
    def num_nodes(self) -> int:
        return len(self.parent)


class Vocabulary:
    """The tokens' bytes laid out for walking them all at once: a prefix tree (for the masks
    of TokenIndex) and a matrix, longest token first (for the pushdown guide's walks).

    vocab_bytes: token id -> its bytes (b"" for a token that never appears in guided text).
    eos_token_id: the end-of-sequence id (its bytes are ignored), or None.
    vocab_size: the width of the model's logits (>= len(vocab_bytes); the ids past the list
    are never allowed).
    Both are laid out on first use, so an engine that never sees a guided request
    never pays for it.
    """

    def __init__(self, vocab_bytes: Sequence[bytes], eos_token_id: int | None, vocab_size: int) -> None:
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
            raise ValueError(f"vocab_size must be a positive integer, got {vocab_size!r}")
        if len(vocab_bytes) > vocab_size:
            raise ValueError(f"vocab_bytes has {len(vocab_bytes)} entries for a vocabulary of {vocab_size}")
        bad = next((i for i, b in enumerate(vocab_bytes) if not isinstance(b, bytes)), None)
        if bad is not None:
            raise ValueError(f"vocab_bytes[{bad}] must be bytes, got {type(vocab_bytes[bad]).__name__}")
        if eos_token_id is not None and not 0 <= eos_token_id < vocab_size:
            raise ValueError(f"eos_token_id {eos_token_id} is outside the vocabulary 0..{vocab_size - 1}")
        self.vocab_bytes = list(vocab_bytes)
        self.eos_token_id = eos_token_id
        self.vocab_size = vocab_size

    @cached_property
    def token_ids(self) -> np.ndarray:
        """int64 [n]: the ids of the tokens that have bytes (EOS aside), longest first."""
        usable = [i for i, b in enumerate(self.vocab_bytes) if b and i != self.eos_token_id]
        usable.sort(key=lambda i: -len(self.vocab_bytes[i]))
        return np.array(usable, dtype=np.int64)

    @cached_property
    def trie(self) -> TokenTrie:
        """The tokens' bytes as a prefix tree (TokenTrie), laid out on first use."""
        rows = [self.vocab_bytes[i] for i in self.token_ids.tolist()]
        depth = max((len(data) for data in rows), default=0)
        prefixes: list[set[bytes]] = [set() for _ in range(depth + 1)]
        for data in rows:
            for cut in range(1, len(data) + 1):
                prefixes[cut].add(data[:cut])
        number = {b"": 0}                                  # prefix -> node id
        levels, parents, last_bytes = [0, 1], [-1], [0]
        for cut in range(1, depth + 1):
            for prefix in sorted(prefixes[cut]):           # sorted: by parent (numbered in order), then byte
                number[prefix] = len(parents)
                parents.append(number[prefix[:-1]])
                last_bytes.append(prefix[-1])
            levels.append(len(parents))
        return TokenTrie(np.array(parents, dtype=np.int64), np.array(last_bytes, dtype=np.uint8), levels,
                         np.array([number[data] for data in rows], dtype=np.int64))

    @cached_property
    def byte_matrix(self) -> np.ndarray:
        """uint8 [n, longest]: row r holds the bytes of token_ids[r], zero-padded. Stored
        column by column (Fortran order): a walk reads one byte position of many rows at a
        time, which is then one contiguous column (the pushdown guide of json_pda.py walks it)."""
        rows = [self.vocab_bytes[i] for i in self.token_ids.tolist()]
        matrix = np.zeros((len(rows), len(rows[0]) if rows else 0), dtype=np.uint8)
        for row, data in enumerate(rows):
            matrix[row, :len(data)] = np.frombuffer(data, dtype=np.uint8)
        return np.asfortranarray(matrix)

    @cached_property
    def longer_than(self) -> list[int]:
        """longer_than[p]: how many tokens have more than p bytes (they lead the rows)."""
        lengths = np.array([len(self.vocab_bytes[i]) for i in self.token_ids.tolist()], dtype=np.int64)
        return [int((lengths > p).sum()) for p in range(self.byte_matrix.shape[1])]

    def token_bytes(self, token_id: int) -> bytes:
        return self.vocab_bytes[token_id] if 0 <= token_id < len(self.vocab_bytes) else b""


class TokenIndex:
    """The allowed-token masks of one DFA over one vocabulary, one per state, made on demand."""

    def __init__(self, dfa: DFA, vocabulary: Vocabulary) -> None:
        self.dfa = dfa
        self.vocabulary = vocabulary
        self.masks: dict[int, torch.Tensor] = {}
        self.stuck: set[int] = set()          # states whose mask allows nothing
        # A state with no live move: the text so far admits no further byte.
        self.dead_end = np.asarray((dfa.transitions < 0).all(axis=1))

    def mask(self, state: int) -> torch.Tensor:
        """The cached mask of `state` (computed on first use); shared, so never modify it."""
        found = self.masks.get(state)
        if found is None:
            found = self.masks[state] = self.compute_mask(state)
            if not bool(found.any()):
                self.stuck.add(state)
        return found

    def compute_mask(self, state: int) -> torch.Tensor:
        """Which tokens may come next in DFA state `state`.  (Your engine: Chapter 35)

        Returns a bool tensor [vocabulary.vocab_size] on the CPU: token t is True exactly
        when reading all of t's bytes from `state` through self.dfa.transitions (int32
        [S, 256]) never meets -1; vocabulary.eos_token_id is True exactly when
        self.dfa.accepting[state]; ids listed with b"" and ids past the byte list are False.
        Given: vocabulary.token_ids (int64 [n], the tokens with bytes) and vocabulary.trie
        (a TokenTrie): every distinct prefix of those tokens' bytes is one node, the nodes
        numbered level by level (levels[d] .. levels[d + 1] - 1 hold the prefixes of d
        bytes), each with its parent node and its last byte; token_node[r] is the node of
        all of token_ids[r]'s bytes.
        Traps: a token may end at a node that has children, and it is allowed or not by its
        own bytes alone, whatever longer tokens below it do; once a prefix meets -1, every
        token that starts with it is refused; a Python loop over 49,152 tokens costs tens of
        milliseconds per state (the mask is computed once per state).
        """
        raise NotImplementedError("Your engine: Chapter 35: TokenIndex.compute_mask")

    def precompute(self) -> int:
        """Compute every state's mask now (for measuring); returns the number of states."""
        for state in range(self.dfa.num_states):
            self.mask(state)
        return self.dfa.num_states


class RegexGuide:
    """One request's place in its pattern (the serve.interfaces.Guide contract)."""

    def __init__(self, index: TokenIndex) -> None:
        self.index = index
        self.state = index.dfa.start
        self.ended = False                    # EOS was accepted: nothing at all may follow

    @property
    def finished(self) -> bool:
        return self.ended or bool(self.index.dead_end[self.state])

    @property
    def accepting(self) -> bool:
        """Is the text so far a complete match?"""
        return bool(self.index.dfa.accepting[self.state])

    def allowed(self) -> torch.Tensor:
        """bool [vocab_size]: the tokens that may come next (shared with other guides of the
        same pattern: read it, never write to it). ValueError when the vocabulary cannot
        spell any continuation (a pattern that needs a byte no token has)."""
        mask = self.index.mask(self.state)
        if not self.ended and self.state in self.index.stuck:
            raise ValueError(f"no token of the vocabulary can continue the pattern from DFA state {self.state}")
        return mask

    def advance(self, token_id: int) -> None:
        """Move past one accepted token.  (Your engine: Chapter 35)

        token_id: the token the engine just appended to the request.
        After it, self.state is the DFA state after the token's bytes
        (self.index.vocabulary.token_bytes); EOS (vocabulary.eos_token_id) ends the guide
        instead, so `finished` becomes True. advance(t) succeeds exactly when allowed()[t]
        is True (and nothing succeeds after EOS).
        Errors: ValueError for any other token, naming token_id and its bytes; refusing EOS
        before the text is a complete match, the message contains "EOS". A refused token
        leaves the guide unchanged.
        """
        raise NotImplementedError("Your engine: Chapter 35: RegexGuide.advance")


class ByteLevelTokenizer(Protocol):
    """What a guide needs of a tokenizer: Chapter 3's ByteTokenizer (and the server's
    ByteChatTokenizer around it) and Chapter 36's BPETokenizer are all one."""
    vocab_size: int

    def is_special(self, token_id: int) -> bool: ...

    def token_bytes(self, token_id: int) -> bytes: ...


def token_bytes_of(tokenizer: ByteLevelTokenizer) -> list[bytes]:
    """The vocab_bytes of a tokenizer, one entry per id: the bytes the id spells, b"" for
    a special id, so that no guide ever allows one."""
    return [b"" if tokenizer.is_special(i) else tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)]


class GuideFactory:
    """Makes the guide of a request's SamplingParams (EngineCore keeps one as self.guides).

    Each distinct pattern (a guided_regex, or a guided_json schema compiled straight to an
    automaton by json_regex.compile_schema) is compiled once; its TokenIndex is shared by
    every request that uses it, so a state's mask is computed once per (pattern,
    vocabulary). The `max_patterns` most recently used are kept. Compiling is bounded by
    regex_dfa's stated limits (MAX_NFA_STATES, MAX_DFA_STATES, MAX_REPEAT, MAX_NESTING): a
    pattern or schema over them is refused with a ValueError naming the limit.

    A server calls `prepare(params)` from a worker thread before it hands the request to the
    engine loop, so the compile (up to a second for a large schema) never stalls the other
    requests' steps: the engine's own call then finds the index cached. The cache is shared
    by those threads under a lock that is never held while compiling."""

    def __init__(self, vocab_bytes: Sequence[bytes], eos_token_id: int | None, vocab_size: int,
                 max_patterns: int = 64) -> None:
        self.vocabulary = Vocabulary(vocab_bytes, eos_token_id, vocab_size)
        self.max_patterns = max_patterns
        self.indexes: OrderedDict[tuple[str, str], TokenIndex] = OrderedDict()
        self.lock = threading.Lock()
        self.json_index: JsonIndex | None = None

    def key_of(self, params: SamplingParams) -> tuple[str, str]:
        """("regex", the pattern) or ("json", the schema's JSON text) of a request, "json_open"
        for a schema under JSON Schema's additionalProperties rule (guided_json_strict False)
        (ValueError: neither field is set, or the field has the wrong type)."""
        if params.guided_regex is not None:
            if not isinstance(params.guided_regex, str):
                raise ValueError(f"guided_regex must be a str, got {type(params.guided_regex).__name__}")
            return "regex", params.guided_regex
        if params.guided_json is not None:
            schema = params.guided_json
            try:                                    # the key keeps the order of properties
                kind = "json" if params.guided_json_strict else "json_open"
                return kind, schema if isinstance(schema, str) else json.dumps(schema)
            except (TypeError, ValueError, RecursionError) as exc:
                raise ValueError(f"guided_json is not a JSON schema: {exc}") from None
        raise ValueError("the request asks for no guide (set guided_regex or guided_json)")

    def index_for(self, text: str, kind: str = "regex") -> TokenIndex:
        """The shared TokenIndex of a pattern (kind "regex") or a schema's JSON text (kind
        "json", or "json_open" under JSON Schema's additionalProperties rule), compiled on
        first use."""
        key = (kind, text)
        with self.lock:
            index = self.indexes.get(key)
            if index is not None:
                self.indexes.move_to_end(key)
                return index
        # Compiled outside the lock, so other threads' lookups never wait for it; a thread
        # that compiled the same text meanwhile wins, and its index is the one shared.
        dfa = compile_regex(text) if kind == "regex" else compile_schema(text, strict=kind == "json")
        with self.lock:
            index = self.indexes.setdefault(key, TokenIndex(dfa, self.vocabulary))
            self.indexes.move_to_end(key)
            if len(self.indexes) > self.max_patterns:
                self.indexes.popitem(last=False)
        return index

    def prepare(self, params: SamplingParams) -> None:
        """Build what the guide of `params` needs (its TokenIndex, or the pushdown guide's
        shared masks) into the shared cache, so that the guide the engine later makes for
        it compiles nothing. Raises what compiling raises: ValueError for a pattern or
        schema that is refused."""
        if params.guided_json == JSON_OBJECT:
            self.free_json()
            return
        kind, text = self.key_of(params)
        self.index_for(text, kind)

    def free_json(self) -> JsonIndex:
        """The pushdown guides' shared masks, made on the first json_object request (built
        outside the lock, like a compile; a thread that loses the race drops its copy)."""
        if self.json_index is None:
            index = JsonIndex(self.vocabulary)
            with self.lock:
                if self.json_index is None:
                    self.json_index = index
        return self.json_index

    def __call__(self, params: SamplingParams) -> RegexGuide | JsonGuide:
        if params.guided_json == JSON_OBJECT:
            return JsonGuide(self.free_json())
        kind, text = self.key_of(params)
        return RegexGuide(self.index_for(text, kind))
