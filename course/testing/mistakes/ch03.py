"""Chapter 3: the byte tokenizer, the embedding lookup and the LM head."""
from . import Mistake

MILESTONE = "tests/test_ch03_tokens_embeddings_logits.py"
ENCODE = f"{MILESTONE}::test_encode_is_utf8_bytes"
SPECIALS = f"{MILESTONE}::test_decode_specials"
EMBED = f"{MILESTONE}::test_embed_matches_nn_embedding"
LOGITS = f"{MILESTONE}::test_lm_logits_match_linear"

MISTAKES = [
    Mistake("tokenizer.py", "ByteTokenizer.encode",
            before='list(text.encode("utf-8"))',
            after="[ord(character) for character in text]",
            rule="one id per UTF-8 byte, not one per character (code point)",
            expect="UTF-8 bytes", tests=(ENCODE,)),
    Mistake("tokenizer.py", "ByteTokenizer.encode",
            before="[self.bos_token_id] + ids if add_bos",
            after="ids + [self.bos_token_id] if add_bos",
            rule="with add_bos the list starts with <|bos|>",
            expect="should start with 256", tests=(ENCODE,)),
    Mistake("tokenizer.py", "ByteTokenizer.encode",
            before="return [self.bos_token_id] + ids if add_bos else ids",
            after="return [self.bos_token_id] + ids",
            rule="only add_bos puts <|bos|> in front",
            expect="no <|bos|> unless add_bos", tests=(ENCODE,)),
    Mistake("tokenizer.py", "ByteTokenizer.decode",
            before="pending.append(token)\n",
            after='pieces.append(bytes([token]).decode("utf-8", errors="replace"))\n',
            rule="a character's bytes are decoded together, not id by id",
            expect="decoding id by id breaks characters",
            tests=(f"{MILESTONE}::test_decode_all_at_once_not_per_token",)),
    Mistake("tokenizer.py", "ByteTokenizer.decode",
            before="""            if not skip_special:
                pieces.append(pending.decode("utf-8", errors="replace"))
                pieces.append(self.special_names[token])
                pending = bytearray()""",
            after="""            pieces.append(pending.decode("utf-8", errors="replace"))
            pending = bytearray()
            if not skip_special:
                pieces.append(self.special_names[token])""",
            rule="a skipped special id reads as if absent: the bytes on its two sides join up",
            expect="must join the bytes around it", tests=(SPECIALS,)),
    Mistake("tokenizer.py", "ByteTokenizer.decode",
            before="""        pieces.append(pending.decode("utf-8", errors="replace"))
        return""",
            after="""        pieces.append(pending.decode("utf-8", errors="ignore"))
        return""",
            rule="bytes that are not valid UTF-8 become U+FFFD, not nothing",
            expect="not valid UTF-8",
            tests=(f"{MILESTONE}::test_decode_broken_utf8_is_replaced_not_raised",)),
    Mistake("tokenizer.py", "ByteTokenizer.decode",
            before="if not self.is_special(token):",
            after="if token >= self.vocab_size:",
            rule="ids outside 0 .. vocab_size - 1 (negative ones too) raise ValueError",
            expect="must raise ValueError", tests=(SPECIALS,)),
    Mistake("tokenizer.py", "embed",
            before="return table[ids]",
            after="return table[ids.flatten()]",
            rule="the result has the ids' shape plus the hidden axis",
            expect="should be (2, 5, 24)", tests=(EMBED,)),
    Mistake("tokenizer.py", "embed",
            before="return table[ids]",
            after="return F.one_hot(ids, table.shape[0]).float() @ table.float()",
            rule="the rows come back in the table's dtype",
            expect="in torch.bfloat16", tests=(EMBED,)),
    Mistake("tokenizer.py", "embed",
            before="return table[ids]",
            after="return table[ids] * table.shape[1] ** 0.5",
            rule="the lookup is the table's row, unscaled (no sqrt(hidden) factor in Qwen3)",
            expect="differs from torch.nn.Embedding", tests=(EMBED,)),
    Mistake("tokenizer.py", "lm_logits",
            before="return F.linear(hidden, weight).float()",
            after="return F.linear(hidden, weight)",
            rule="logits are returned in float32 whatever the input dtype",
            expect="in float32", tests=(LOGITS,)),
    Mistake("tokenizer.py", "lm_logits",
            before="return F.linear(hidden, weight).float()",
            after="return F.linear(hidden, weight).float().softmax(dim=-1)",
            rule="logits are unnormalised scores, not probabilities",
            expect="differ from F.linear", tests=(LOGITS,)),
    Mistake("tokenizer.py", "lm_logits",
            before="return F.linear(hidden, weight).float()",
            after="return F.linear(hidden[..., -1, :], weight).float()",
            rule="every position gets its logits, not only the last",
            expect="should be [2, 6, 320]", tests=(LOGITS,)),
]

# What the learner must decide at each stub (one sentence each), and the chapter's design stubs.
DECIDES = {
    "ByteTokenizer.encode": (
        "what one token is for this tokenizer (a UTF-8 byte, not a character) and where BOS "
        "goes, so that no text can ever produce a special id"
    ),
    "ByteTokenizer.decode": (
        "where bytes wait until they can become text, so that a character split over several "
        "ids comes back whole, and whether a special id interrupts that run of bytes (shown) or "
        "not (skipped)"
    ),
    "embed": (
        "how to turn ids of any shape into table rows without a one-hot product, keeping the "
        "table's dtype"
    ),
    "lm_logits": (
        "which product scores every vocabulary entry at every position, in which dtype it runs "
        "and in which dtype the logits come back"
    ),
}
DESIGN = ("ByteTokenizer.decode",)
