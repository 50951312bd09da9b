"""Chapter 36: byte-level BPE, chat templates, and text for streams.

Chapter 3's byte tokenizer spends one id per UTF-8 byte. Real checkpoints ship a byte-level
BPE: the same 256 byte symbols, plus tens of thousands of learned merges that glue frequent
neighbours into one token, so common words cost one id. This module holds:

- the byte-to-symbol map that lets BPE work on printable strings (`bytes_to_unicode`),
- the pre-tokenizer (a regex that cuts text into words before any merge),
- training (`count_pairs`, `merge_word`, `train_bpe`),
- `BPETokenizer`: encode, decode, special tokens, the chat template, and
  loading SmolLM2's tokenizer from a GGUF file's metadata (`from_gguf_metadata`),
- `IncrementalDetokenizer`: token ids in, text out as soon as it is complete and stable,
- `StopStringMatcher`: stop strings found across token boundaries in a stream.

How a stream over Chapter 31's EngineCore uses the last two (the core itself only knows
ids; one detokenizer and one matcher per request live in the layer that makes text):

    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=True)
    matcher = StopStringMatcher(["\\n\\nUser:"])
    for token_id in output.new_token_ids:        # one request's tokens from engine.step()
        piece = matcher.push(detok.push(token_id))
        send(piece.text)
        if piece.stopped:                        # the stop string is not sent
            engine.abort_request(request_id); break
    if output.finished and not matcher.stopped:  # EOS or length: release what is held
        send(matcher.push(detok.flush()).text + matcher.flush())
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, NoReturn, Sequence

import regex

if TYPE_CHECKING:
    from jinja2 import Template

# GPT-2's pre-tokenizer: English contractions, runs of letters or of digits (each with at
# most one leading space), runs of other symbols, and whitespace. `\s+(?!\S)` leaves the last
# space of a run to the word after it, so " hello" keeps its space and merges learn it.
GPT2_SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# Every numeric character a piece of its own, before GPT-2's split (StarCoder and SmolLM2
# were trained this way, so "2024" is four tokens and arithmetic sees its digits).
DIGIT_SPLIT = r"\p{N}"

# tokenizer.ggml.pre (the name llama.cpp gives a pre-tokenizer) -> the splits applied in order.
PRE_TOKENIZERS: dict[str, tuple[str, ...]] = {
    "gpt2": (GPT2_SPLIT,),
    "smollm": (DIGIT_SPLIT, GPT2_SPLIT),
    "starcoder": (DIGIT_SPLIT, GPT2_SPLIT),
}

# Pieces whose ids encode() remembers, per tokenizer.
WORD_CACHE_SIZE = 1 << 17

# GGUF token types (tokenizer.ggml.token_type) that are matched whole in text when asked.
CONTROL_TOKEN = 3
USER_DEFINED_TOKEN = 4


def bytes_to_unicode() -> dict[int, str]:
    """The byte -> symbol map of byte-level BPE: every byte value gets one printable character.

    Printable Latin-1 bytes ('!'..'~', '¡'..'¬', '®'..'ÿ') stand for themselves; the other 68
    (control bytes, space, DEL, NBSP, soft hyphen) are moved to U+0100 onwards, in byte order.
    So a space is 'Ġ' (U+0120) and a newline 'Ċ' (U+010A): a vocabulary of such strings can
    be stored as text, with no invisible or unstorable characters in it.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    moved = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + moved)
            moved += 1
    return mapping


BYTE_TO_SYMBOL = bytes_to_unicode()
SYMBOL_TO_BYTE = {symbol: b for b, symbol in BYTE_TO_SYMBOL.items()}


def to_symbols(piece: str) -> str:
    """A piece of text -> its UTF-8 bytes spelled in the byte alphabet ("é" -> "Ã©")."""
    return "".join(BYTE_TO_SYMBOL[b] for b in piece.encode("utf-8"))


def pretokenize(text: str, pre: str = "gpt2") -> list[str]:
    """Cut text into the pieces BPE merges inside (merges never cross a piece boundary).

    `pre` names the split (a key of PRE_TOKENIZERS). Each split regex keeps its matches and
    the text between them as pieces, so "".join(pretokenize(text, pre)) == text always.
    """
    if pre not in PRE_TOKENIZERS:
        raise ValueError(f"unknown pre-tokenizer {pre!r}: known ones are {sorted(PRE_TOKENIZERS)}")
    pieces = [text] if text else []
    for pattern in _compiled_splits(pre):
        split_pieces = []
        for piece in pieces:
            start = 0
            for match in pattern.finditer(piece):
                if match.start() > start:
                    split_pieces.append(piece[start:match.start()])
                split_pieces.append(match.group())
                start = match.end()
            if start < len(piece):
                split_pieces.append(piece[start:])
        pieces = split_pieces
    return pieces


_COMPILED: dict[str, list[regex.Pattern]] = {}


def _compiled_splits(pre: str) -> list[regex.Pattern]:
    if pre not in _COMPILED:
        _COMPILED[pre] = [regex.compile(p) for p in PRE_TOKENIZERS[pre]]
    return _COMPILED[pre]


# ---------------------------------------------------------------------------------------
# Training


def count_pairs(word_counts: dict[tuple[str, ...], int]) -> Counter[tuple[str, str]]:
    """How often each pair of adjacent symbols occurs in the corpus.  (Your engine: Chapter 36)

    word_counts: a word (a tuple of its current symbols, e.g. ("Ġ", "th", "e")) -> how many
        times the word occurs in the corpus.
    Returns a Counter (left, right) -> how many times, in the whole corpus, a symbol `left`
    stands directly before a symbol `right`. Pairs never span two words.
    Example: {("a", "a", "a"): 2, ("a", "b"): 1} -> {("a", "a"): 4, ("a", "b"): 1}.
    """
    pairs: Counter[tuple[str, str]] = Counter()
    for word, count in word_counts.items():
        for left, right in zip(word, word[1:]):
            pairs[left, right] += count
    return pairs


def merge_word(word: tuple[str, ...], pair: tuple[str, str]) -> tuple[str, ...]:
    """The word with the pair's occurrences replaced by one joined symbol.  (Your engine: Chapter 36)

    word: a tuple of symbols; pair: (left, right). Returns a tuple whose symbols, joined, spell
    the same string as the word's; every symbol of the word ends up in exactly one symbol of
    the result. A word without the pair comes back equal to itself; the input is not modified.
    Examples with pair ("a", "a"): ("a", "a", "a") -> ("aa", "a"); ("ba", "a") -> ("ba", "a").
    """
    left, right = pair
    merged: list[str] = []
    i = 0
    while i < len(word):
        if i + 1 < len(word) and word[i] == left and word[i + 1] == right:
            merged.append(left + right)
            i += 2
        else:
            merged.append(word[i])
            i += 1
    return tuple(merged)


def train_bpe(text: str, vocab_size: int, pre: str = "gpt2") -> list[tuple[str, str]]:
    """Learn byte-level BPE merges from `text`.  (Your engine: Chapter 36)

    vocab_size: the vocabulary wanted, the 256 byte symbols (bytes_to_unicode) included;
    pre: the pre-tokenizer. Returns the merges in the order learned (rank 0 first), as
    (left, right) pairs of symbols, at most vocab_size - 256 of them (fewer when no pair is
    left). The corpus is the pieces of pretokenize(text, pre), spelled in the byte alphabet.
    Property of the result: once merges[0 .. r-1] have been applied to the corpus, merges[r]
    is an adjacent pair with the highest count in it, and of pairs with that count the one
    that sorts first (as a tuple of str). Pairs never span two pieces.
    Example: train_bpe("ab ab ba", 259) -> [("a", "b"), ("b", "a"), ("Ġ", "ab")]; the last
    two were ties (one occurrence each), and "b" < "Ġ", "ab" < "b" decide them.
    Errors: ValueError naming 256 when vocab_size < 256; pretokenize's for an unknown `pre`.
    """
    if vocab_size < 256:
        raise ValueError(f"a byte-level vocabulary has at least the 256 byte symbols: vocab_size={vocab_size}")
    word_counts = Counter(tuple(to_symbols(piece)) for piece in pretokenize(text, pre))
    merges: list[tuple[str, str]] = []
    while len(merges) < vocab_size - 256:
        pairs = count_pairs(word_counts)
        if not pairs:
            break
        best = min(pairs, key=lambda pair: (-pairs[pair], pair))
        merges.append(best)
        merged_counts: Counter[tuple[str, ...]] = Counter()
        for word, count in word_counts.items():
            merged_counts[merge_word(word, best)] += count
        word_counts = merged_counts
    return merges


# ---------------------------------------------------------------------------------------
# The tokenizer


class BPETokenizer:
    """A byte-level BPE tokenizer: a vocabulary of byte-alphabet strings and ranked merges.

    tokens: id -> token string (byte alphabet, e.g. "Ġthe"; special tokens such as
        "<|im_end|>" are written as they read). merges: (left, right) pairs, best first.
    special_tokens: the token strings matched whole in text when encode(parse_special=True).
    pre: the pre-tokenizer's name (PRE_TOKENIZERS). chat_template: a Jinja template or None.
    """

    def __init__(self, tokens: Sequence[str], merges: Iterable[tuple[str, str]], *,
                 special_tokens: Iterable[str] = (), pre: str = "gpt2",
                 eos_token_id: int | None = None, bos_token_id: int | None = None,
                 chat_template: str | None = None) -> None:
        if pre not in PRE_TOKENIZERS:
            raise ValueError(f"unknown pre-tokenizer {pre!r}: known ones are {sorted(PRE_TOKENIZERS)}")
        self.tokens: list[str] = list(tokens)
        self.token_to_id: dict[str, int] = {token: i for i, token in enumerate(self.tokens)}
        self.merge_ranks: dict[tuple[str, str], int] = {}
        for rank, (left, right) in enumerate(merges):
            if left + right not in self.token_to_id:
                raise ValueError(f"merge {rank} ({left!r}, {right!r}) makes {left + right!r}, which is not a token")
            self.merge_ranks.setdefault((left, right), rank)
        self.pre = pre
        for name, token_id in (("eos_token_id", eos_token_id), ("bos_token_id", bos_token_id)):
            if token_id is not None and not 0 <= token_id < len(self.tokens):
                raise ValueError(f"{name}={token_id} is outside the vocabulary 0..{len(self.tokens) - 1}")
        self.eos_token_id = eos_token_id
        self.bos_token_id = bos_token_id
        self.chat_template = chat_template
        self.special_ids: frozenset[int] = frozenset(self.token_to_id[t] for t in special_tokens)
        self.special_tokens: dict[str, int] = {self.tokens[i]: i for i in sorted(self.special_ids)}
        # Longest first, so a special token that starts another one never wins by being shorter.
        specials = sorted(self.special_tokens, key=len, reverse=True)
        self._special_split = regex.compile("(" + "|".join(map(regex.escape, specials)) + ")") if specials else None
        self._token_bytes: list[bytes] = [self._spelled_bytes(t) for t in self.tokens]
        self._word_cache: dict[str, list[int]] = {}

    @staticmethod
    def _spelled_bytes(token: str) -> bytes:
        """The bytes a token stands for. A token written outside the byte alphabet (only
        special tokens can be) stands for its own UTF-8 encoding."""
        if all(symbol in SYMBOL_TO_BYTE for symbol in token):
            return bytes(SYMBOL_TO_BYTE[symbol] for symbol in token)
        return token.encode("utf-8")

    @classmethod
    def from_merges(cls, merges: Sequence[tuple[str, str]], special_tokens: Sequence[str] = (),
                    pre: str = "gpt2") -> BPETokenizer:
        """The tokenizer train_bpe's merges define: ids 0-255 are the byte symbols in byte
        order, then one id per merge in rank order, then the special tokens."""
        tokens = [BYTE_TO_SYMBOL[b] for b in range(256)] + [left + right for left, right in merges]
        tokens += list(special_tokens)
        duplicates = [t for t, n in Counter(tokens).items() if n > 1]
        if duplicates:
            raise ValueError(f"tokens must be distinct; repeated: {duplicates[:5]}")
        eos = len(tokens) - len(special_tokens) if special_tokens else None
        return cls(tokens, merges, special_tokens=special_tokens, pre=pre, eos_token_id=eos)

    @classmethod
    def from_gguf_metadata(cls, metadata: dict[str, Any]) -> BPETokenizer:
        """The tokenizer a GGUF file describes, from its metadata (keys as in the file:
        tokenizer.ggml.model, .tokens, .merges, .token_type, .pre, .eos_token_id,
        .bos_token_id, tokenizer.chat_template; arrays as lists). Only "gpt2" (byte-level
        BPE) models are supported; CONTROL and USER_DEFINED tokens become special tokens."""
        model = metadata.get("tokenizer.ggml.model")
        if model != "gpt2":
            raise ValueError(f"tokenizer.ggml.model is {model!r}; only byte-level BPE ('gpt2') is supported")
        for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
            if key not in metadata:
                raise ValueError(f"the GGUF metadata has no {key}")
        tokens = list(metadata["tokenizer.ggml.tokens"])
        if not all(isinstance(token, str) for token in tokens):
            raise ValueError("tokenizer.ggml.tokens must be a list of str (decode the GGUF strings first)")
        merges = []
        for rank, line in enumerate(metadata["tokenizer.ggml.merges"]):
            left, space, right = line.partition(" ")
            if not space or not left or not right:
                raise ValueError(f"merge {rank} is {line!r}; a merge is two symbols separated by one space")
            merges.append((left, right))
        types = metadata.get("tokenizer.ggml.token_type")
        if types is None:                                # no types: no special tokens
            types = [1] * len(tokens)
        special = [t for t, kind in zip(tokens, types) if kind in (CONTROL_TOKEN, USER_DEFINED_TOKEN)]
        pre = metadata.get("tokenizer.ggml.pre", "gpt2")
        if pre == "default":
            pre = "gpt2"
        return cls(tokens, merges, special_tokens=special, pre=pre,
                   eos_token_id=metadata.get("tokenizer.ggml.eos_token_id"),
                   bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
                   chat_template=metadata.get("tokenizer.chat_template"))

    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    def is_special(self, token_id: int) -> bool:
        """Whether the id is one of the special tokens (never produced from text)."""
        return token_id in self.special_ids

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one id stands for (b"\\xc3" for half of "é": not always valid UTF-8)."""
        if not 0 <= token_id < len(self.tokens):
            raise ValueError(f"token id {token_id} is outside the vocabulary 0..{len(self.tokens) - 1}")
        return self._token_bytes[token_id]

    def encode_word(self, word: str) -> list[int]:
        """One pre-tokenized piece, spelled in the byte alphabet -> its token ids.  (Your engine: Chapter 36)

        word: e.g. "Ġlower" (" lower"), one byte symbol per character. Returns the ids
        (self.token_to_id) of the tokens training would have made of this word: the same
        tokens the tokenizers library gives with these merges (self.merge_ranks, rank 0 the
        first learned). An empty word gives []. encode caches the result per word.
        Traps: a tokenization that merely spells the word with tokens of the vocabulary is not
        enough (the model only saw the one training made); a byte symbol the vocabulary lacks
        (SmolLM2 has none for 0xF1) is left out, as the tokenizers library does.
        """
        symbols = tuple(symbol for symbol in word if symbol in self.token_to_id)
        while len(symbols) > 1:
            ranked = [(self.merge_ranks[pair], pair) for pair in zip(symbols, symbols[1:]) if pair in self.merge_ranks]
            if not ranked:
                break
            symbols = merge_word(symbols, min(ranked)[1])
        return [self.token_to_id[symbol] for symbol in symbols]

    def _encode_ordinary(self, text: str) -> list[int]:
        ids: list[int] = []
        for piece in pretokenize(text, self.pre):
            cached = self._word_cache.get(piece)
            if cached is None:
                cached = self.encode_word(to_symbols(piece))
                # Bounded, so a long-running server fed endless new strings does not grow
                # forever; the common words arrive early and stay.
                if len(self._word_cache) < WORD_CACHE_SIZE:
                    self._word_cache[piece] = cached
            ids.extend(cached)
        return ids

    def encode(self, text: str, parse_special: bool = False, add_bos: bool = False) -> list[int]:
        """Text -> token ids. Nothing is added unless asked: add_bos puts bos_token_id first.

        With parse_special=False (the default) special-token names in the text are ordinary
        text ("<|im_end|>" typed by a user becomes several tokens, so nobody can forge the end
        of a turn). With parse_special=True each special token's exact string becomes its one
        id: use it for text the chat template wrote, never for raw user input.
        """
        if not isinstance(text, str):
            raise ValueError(f"encode takes a str, got {type(text).__name__}")
        ids = []
        if add_bos:
            if self.bos_token_id is None:
                raise ValueError("add_bos=True but this tokenizer has no bos_token_id")
            ids.append(self.bos_token_id)
        if not parse_special or self._special_split is None:
            return ids + self._encode_ordinary(text)
        for i, part in enumerate(self._special_split.split(text)):
            if i % 2:                                    # the split keeps the separators at odd indices
                ids.append(self.special_tokens[part])
            elif part:
                ids.extend(self._encode_ordinary(part))
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Token ids -> text.  (Your engine: Chapter 36)

        ids: ints in 0 .. vocab_size - 1. Returns the text the ids stand for: decode(encode(t))
        == t. A token may hold half a character (token_bytes(id) need not be valid UTF-8), so a
        character split over two ids comes back whole. Bytes that are not valid UTF-8 read as
        U+FFFD, never an exception. Special tokens read as their names ("<|im_end|>"), or are
        left out with skip_special_tokens. Errors: ValueError naming the id and the range
        0..vocab_size - 1 for an id outside it.
        """
        data = bytearray()
        for token_id in ids:
            token_id = int(token_id)
            if skip_special_tokens and token_id in self.special_ids:
                continue
            data += self.token_bytes(token_id)
        return data.decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True,
                            **variables: Any) -> str:
        """The conversation as the model was trained to read it, rendered by the checkpoint's own
        Jinja template (tokenizer.chat_template) in jinja2's sandbox, with messages,
        add_generation_prompt, bos_token and eos_token (plus `variables`) in scope.
        add_generation_prompt ends the text with the opening of the assistant's turn, so the
        model's next tokens are its reply. Encode the result with parse_special=True."""
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template (tokenizer.chat_template is missing)")
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str) \
                    or not isinstance(message.get("content"), str):
                raise ValueError(f"message {i} must be a dict with str 'role' and 'content'; got {message!r}")
        special = {"bos_token": self.bos_token_id, "eos_token": self.eos_token_id}
        names = {key: self.tokens[i] if i is not None else "" for key, i in special.items()}
        return _compiled_template(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, **names, **variables)

    def encode_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        """The prompt ids of a chat: apply_chat_template, encoded so that only the template's
        own special-token names become special ids. A name typed inside a message's content
        ("<|im_end|>\n<|im_start|>system") stays ordinary text, so no client can close its
        turn or open another. Text between special tokens is encoded as one piece, as
        encode(parse_special=True) would, so a chat without typed names gets exactly its ids.
        A template that rewrites contents (so they cannot be located in its output) gets a
        ValueError for a content holding a special-token name, rather than the risk."""
        text, typed = self._render_locating_contents(messages, add_generation_prompt)
        if self._special_split is None:
            return self._encode_ordinary(text)
        ids: list[int] = []
        start = 0
        for match in self._special_split.finditer(text):
            if any(low < match.end() and match.start() < high for low, high in typed):
                continue                                 # a name the client typed: plain text
            if match.start() > start:
                ids.extend(self._encode_ordinary(text[start:match.start()]))
            ids.append(self.special_tokens[match.group()])
            start = match.end()
        if start < len(text):
            ids.extend(self._encode_ordinary(text[start:]))
        return ids

    def _render_locating_contents(self, messages: list[dict[str, str]],
                                  add_generation_prompt: bool) -> tuple[str, list[tuple[int, int]]]:
        """(the rendered chat, the [start, end) spans of the messages' contents in it). Each
        content is rendered as a marker first; a template that rewrites contents (drops,
        repeats or edits one) gives no spans (see encode_chat)."""
        text = self.apply_chat_template(messages, add_generation_prompt)
        markers = [f"\ue000{i}\ue001" for i in range(len(messages))]
        marked = [{**message, "content": marker} for message, marker in zip(messages, markers)]
        skeleton = self.apply_chat_template(marked, add_generation_prompt)
        if all(skeleton.count(marker) == 1 for marker in markers):
            pieces, spans, at, rest = [], [], 0, skeleton
            for marker, message in sorted(zip(markers, messages), key=lambda pair: skeleton.index(pair[0])):
                before, rest = rest.split(marker, 1)
                pieces += [before, message["content"]]
                at += len(before)
                spans.append((at, at + len(message["content"])))
                at += len(message["content"])
            if "".join(pieces) + rest == text:          # the template copied every content as it is
                return text, spans
        if self._special_split is not None:
            for i, message in enumerate(messages):
                found = self._special_split.search(message["content"])
                if found:
                    raise ValueError(f"message {i} contains the special token {found.group()!r}, and this chat "
                                     f"template rewrites contents, so it could not be kept as text")
        return text, []


_TEMPLATES: dict[str, Template] = {}


def _compiled_template(source: str) -> Template:
    """A chat template compiled once, in an immutable sandbox: a template is data shipped with
    a checkpoint, so it may not touch Python objects beyond the values it is given."""
    if source not in _TEMPLATES:
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> NoReturn:
            raise TemplateError(message)

        # trim_blocks/lstrip_blocks: the layout Hugging Face templates are written for.
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.globals["raise_exception"] = raise_exception
        _TEMPLATES[source] = env.from_string(source)
    return _TEMPLATES[source]


# ---------------------------------------------------------------------------------------
# Streams


class IncrementalDetokenizer:
    """Text for a stream of token ids, released only when it will not change.

    A token can end in the middle of a character (an emoji is 4 bytes, often 2-3 tokens), so
    the text of one token alone may be garbage. State: `ids`, every id pushed; `read_offset`,
    how many of them have had their text returned; `prefix_offset` (<= read_offset), free for
    push() to use. Invariant: the concatenation of everything push() and flush() returned
    equals tokenizer.decode(all ids, skip_special_tokens).
    """

    def __init__(self, tokenizer: BPETokenizer, skip_special_tokens: bool = False) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def _decode(self, start: int, end: int) -> str:
        return self.tokenizer.decode(self.ids[start:end], skip_special_tokens=self.skip_special_tokens)

    def push(self, token_id: int) -> str:
        """Add one token id; return the text that became complete and stable (often "").  (Your engine: Chapter 36)

        token_id: an int in the vocabulary. Invariants:
          - nothing returned is ever taken back: never half a character;
          - nothing is held longer than needed: once decode(self.ids) ends in a complete
            character, everything up to it has been returned (a U+FFFD that is really in the
            text is no reason to wait, once a character follows it);
          - everything push() and flush() return, joined, equals
            tokenizer.decode(self.ids, skip_special_tokens);
          - self.ids holds every id pushed; the text of ids[:read_offset] has been returned, no
            more and no less; read_offset only moves forward, and only to a boundary between
            complete characters (flush() decodes ids[read_offset:] on its own);
            prefix_offset <= read_offset, also only forward.
        Errors: ValueError for an id outside the vocabulary, the state unchanged.
        """
        self.tokenizer.token_bytes(token_id)             # validates before any state changes
        self.ids.append(int(token_id))
        already_read = self._decode(self.prefix_offset, self.read_offset)
        with_new = self._decode(self.prefix_offset, len(self.ids))
        if len(with_new) <= len(already_read) or with_new.endswith("\ufffd"):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return with_new[len(already_read):]

    def flush(self) -> str:
        """The held-back text at the end of a stream, unfinished characters as U+FFFD.

        Relies on push()'s invariant: ids[:read_offset] ends on a character boundary, so the
        ids not yet returned decode correctly on their own.
        """
        rest = self._decode(self.read_offset, len(self.ids))
        self.prefix_offset = self.read_offset = len(self.ids)
        return rest


@dataclass
class StopCheck:
    """What a StopStringMatcher lets through for one pushed piece of text.

    text: safe to send now (never part of a stop string). stopped: a stop string completed;
    `text` then ends just before it and the stream is over. stop_string: which one.
    """
    text: str
    stopped: bool = False
    stop_string: str | None = None


class StopStringMatcher:
    """Finds stop strings in streamed text, whatever the token boundaries.

    A stop string can arrive split over several tokens ("\\n\\nUser" + ":"), so text that could
    be the start of one is held back until the next piece shows whether it is. The stop string
    itself is never sent. When several could end the stream, the one that ENDS first wins (it
    would have stopped a character-by-character stream first); among those, the longest.
    """

    def __init__(self, stop_strings: Sequence[str]) -> None:
        if isinstance(stop_strings, str):
            raise ValueError("stop_strings is a list of strings, not one string")
        for stop in stop_strings:
            if not isinstance(stop, str) or not stop:
                raise ValueError(f"every stop string must be a non-empty str; got {stop!r}")
        self.stop_strings: tuple[str, ...] = tuple(stop_strings)
        self.held = ""                                   # text that may be the start of a stop string
        self.stopped = False

    def push(self, text: str) -> StopCheck:
        """Add newly detokenized text; return what may be sent.  (Your engine: Chapter 36)

        text: the stream's next piece (may be ""). Returns StopCheck(text, stopped, stop_string).
        The stream stops where a character-by-character stream would first have completed a stop
        string (the longest, of two completed by the same character): `text` is then everything
        before that stop string not sent yet, and the stream is over (self.held "", self.stopped
        True). Otherwise `text` is what can be sent now and self.held what cannot yet.
        Invariants: no text sent is ever part of a stop string, and no text is held that could
        not still become one; the results do not depend on how the stream was cut into pushes.
        Errors: ValueError for a push after a stop.
        """
        if self.stopped:
            raise ValueError("this stream already stopped on a stop string; no more text may be pushed")
        buffer = self.held + text
        first_match = None                               # (end, start, stop string), smallest first
        for stop in self.stop_strings:
            start = buffer.find(stop)
            if start >= 0 and (first_match is None or (start + len(stop), start) < first_match[:2]):
                first_match = (start + len(stop), start, stop)
        if first_match is not None:
            _, start, stop = first_match
            self.held, self.stopped = "", True
            return StopCheck(buffer[:start], True, stop)
        keep = 0
        for stop in self.stop_strings:
            for length in range(min(len(stop) - 1, len(buffer)), keep, -1):
                if buffer.endswith(stop[:length]):
                    keep = length
                    break
        self.held = buffer[len(buffer) - keep:] if keep else ""
        return StopCheck(buffer[:len(buffer) - keep])

    def flush(self) -> str:
        """The held text at the end of a stream that did not stop (no stop string came)."""
        held, self.held = self.held, ""
        return held
