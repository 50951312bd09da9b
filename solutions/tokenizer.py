"""Chapter 3: text to token ids and back, and the two matrices at the ends of the model.

The byte tokenizer is the smallest tokenizer that can represent every string: a token is
one UTF-8 byte. It is what the tiny test model speaks (vocab_size 320 = 256 bytes + 64
special ids). Real checkpoints ship a byte-level BPE tokenizer, which Chapter 36 builds.
"""
from collections.abc import Iterable

import torch
from torch.nn import functional as F

NUM_BYTES = 256
# Named special tokens; every other id from 256 to vocab_size - 1 is "<|reserved_N|>".
SPECIAL_TOKENS = {"<|bos|>": 256, "<|eos|>": 257, "<|pad|>": 258, "<|im_start|>": 259,
                  "<|im_end|>": 260}


class ByteTokenizer:
    """Ids 0-255 are the byte values; ids 256 .. vocab_size - 1 are special tokens.

    The specials are never produced from text: encode("<|eos|>") gives the seven bytes of
    that string, so no user text can forge an end-of-sequence. Only add_bos (or a caller
    that appends ids itself) puts a special id into a sequence.
    """

    def __init__(self, vocab_size: int = 320) -> None:
        if vocab_size < NUM_BYTES + len(SPECIAL_TOKENS):
            raise ValueError(f"a byte tokenizer needs at least {NUM_BYTES + len(SPECIAL_TOKENS)} ids")
        self.vocab_size = vocab_size
        names = {i: f"<|reserved_{i - NUM_BYTES}|>" for i in range(NUM_BYTES, vocab_size)}
        names.update({i: name for name, i in SPECIAL_TOKENS.items()})
        self.special_names = names                   # id -> name, for every id >= 256
        self.bos_token_id = SPECIAL_TOKENS["<|bos|>"]
        self.eos_token_id = SPECIAL_TOKENS["<|eos|>"]
        self.pad_token_id = SPECIAL_TOKENS["<|pad|>"]

    def is_special(self, token_id: int) -> bool:
        return NUM_BYTES <= token_id < self.vocab_size

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one id stands for: its byte for 0-255, b"" for a special id (it spells
        no text)."""
        if not 0 <= token_id < self.vocab_size:
            raise ValueError(f"token id {token_id} is outside the vocabulary 0..{self.vocab_size - 1}")
        return b"" if self.is_special(token_id) else bytes([token_id])

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        """A str -> a list of ints, one per UTF-8 byte.  (Your engine: Chapter 3)

        Characters outside ASCII take 2-4 bytes each ("é" is [195, 169]), so the list is
        usually longer than len(text). With add_bos, the list starts with bos_token_id.
        Special-token names in the text are plain text here and are encoded byte by byte.
        """
        ids = list(text.encode("utf-8"))
        return [self.bos_token_id] + ids if add_bos else ids

    def decode(self, ids: Iterable[int] | torch.Tensor, skip_special: bool = True) -> str:
        """A sequence of ints (or a 1-D tensor) -> str.  (Your engine: Chapter 3)

        Properties: decode(encode(text, add_bos=True)) == text for every str; a character
        whose bytes are spread over several ids comes back whole ([195, 169] -> "é"); bytes
        that are not valid UTF-8 (a character cut short) become U+FFFD, never an error.
        With skip_special, a special id reads as if it were absent ([0xC3, eos, 0xA9] ->
        "é"); otherwise it reads as its name and separates the bytes on its two sides
        ([0xC3, eos, 0xA9] -> "\ufffd<|eos|>\ufffd"). Ids outside 0 .. vocab_size - 1 raise
        ValueError.
        """
        pieces, pending = [], bytearray()
        for token in (int(t) for t in ids):
            if 0 <= token < NUM_BYTES:
                pending.append(token)
                continue
            if not self.is_special(token):
                raise ValueError(f"token id {token} is outside the vocabulary 0..{self.vocab_size - 1}")
            if not skip_special:
                pieces.append(pending.decode("utf-8", errors="replace"))
                pieces.append(self.special_names[token])
                pending = bytearray()
        pieces.append(pending.decode("utf-8", errors="replace"))
        return "".join(pieces)

    def token_to_str(self, token_id: int) -> str:
        """A readable label for one id: the character of a printable ASCII byte, '\\xNN' for
        other bytes, the name of a special id. For tables and plots."""
        if self.is_special(token_id):
            return self.special_names[token_id]
        if 32 <= token_id < 127:
            return chr(token_id)
        return f"\\x{token_id:02x}"


def embed(ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Look up the embedding row of every token id.  (Your engine: Chapter 3)

    ids: int64 tensor of any shape [...]; table: [vocab, hidden]. Returns [..., hidden] in
    the table's dtype, exactly equal to torch.nn.Embedding with this table (no scaling).
    The same numbers as one_hot(ids) @ table, for a copy of hidden numbers per position
    instead of vocab * hidden multiply-adds.
    """
    return table[ids]


def lm_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Score every vocabulary entry against the final hidden states.  (Your engine: Chapter 3)

    hidden: [..., hidden_size]; weight: [vocab, hidden_size] (the LM head; with tied
    embeddings, the embedding table itself). Returns [..., vocab] in float32, one logit per
    position and vocabulary entry: logit v scores the hidden state against row v of weight
    (unnormalised: no softmax). The product runs in the inputs' dtype; only the result is
    widened to float32, as the model's logits always are.
    """
    return F.linear(hidden, weight).float()


def one_hot_embed(ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """The same lookup as a matrix product, for comparison: one_hot(ids) @ table."""
    return F.one_hot(ids, table.shape[0]).to(table.dtype) @ table
