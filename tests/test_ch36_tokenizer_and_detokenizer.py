"""Chapter 36 milestone: byte-level BPE, SmolLM2's tokenizer from its GGUF, streams.

Oracles:
- the `tokenizers` library (Rust), given the same vocabulary and merges (read from the GGUF
  by transformers' GGUF reader) and SmolLM2's own pre-tokenizer (course.testing.bpe_oracle: every
  digit alone, then GPT-2's byte-level split, what tokenizer.ggml.pre = "smollm" means);
- transformers' apply_chat_template for the chat template;
- the byte-to-symbol map of transformers (convert_slow_tokenizer.bytes_to_unicode);
- naive scans written out here for training's first merge and for stop strings.
Tests that need the SmolLM2 file skip with one line when it cannot be had.
"""
import random
from collections import Counter
from pathlib import Path

import pytest

from course.testing import bpe_oracle
from course.testing.milestone_helpers import first_difference

pytestmark = pytest.mark.chapter(36)

ROOT = Path(__file__).resolve().parents[1]
BOOK = sorted(ROOT.glob("chapters/*/[0-9][0-9]-*.md"))
FAST_CHAPTERS = 6                          # chapters encoded in the default run; all under --stress

TORTURE = [
    "", " ", "  ", "\n", "\n\n\n", " \n ", "\t\t x", "hello world", "Hello, World!!",
    "don't I'll we've they're DON'T", "x  y   z", "trailing   ", "\n\n1. a list\n2. b",
    "naïve café — déjà vu", "日本語のテキスト", "Привет, мир", "مرحبا بالعالم ٣٤", "हिन्दी",
    "emoji 👩‍🚀🚀 flags 🇯🇵 👍🏽", "😀😀😀😀😀", "e\u0301 combining", "\x01\x1c\x1e\x1f\x7f",
    "\u00a0nbsp\u2009thin\u3000ideo", "\u200b\u200d\ufeff", "x²+y³ ½ ¼ Ⅻ ٣", "1234567890 3.14159 1e-5",
    "\r\n\r\nwindows", "\U0010FFFD\ue000 private use", "\ud7ff\uffff", "\x85next\u2028line\u2029para",
    "ﬁ ﬂ Å Å", "ё" * 30, "    def f(x):\n        return x  # c\n", "<|im_start|", "a <|endoftext|> b",
    "<|im_start|>user\nhi<|im_end|>\n",
]


# --- fixtures --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def metadata(smollm2_path):
    """The GGUF's tokenizer metadata as plain Python values, read by transformers' reader."""
    return bpe_oracle.smollm2_metadata(smollm2_path)


@pytest.fixture(scope="module")
def bpe(impl):
    return impl.load("bpe")


@pytest.fixture(scope="module")
def smol(bpe, metadata):
    return bpe.BPETokenizer.from_gguf_metadata(metadata)


@pytest.fixture(scope="module")
def oracle(metadata):
    """SmolLM2's tokenizer in the tokenizers library, built from the same metadata."""
    return bpe_oracle.library_tokenizer(metadata)


def tokenizer_symbols(text):
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    table = bytes_to_unicode()
    return [table[b] for b in text.encode("utf-8")]


def oracle_ids(oracle, text, parse_special=False):
    """The tokenizers library's ids; special-token names are plain text unless parse_special."""
    oracle.encode_special_tokens = not parse_special
    try:
        return oracle.encode(text, add_special_tokens=False).ids
    finally:
        oracle.encode_special_tokens = False


# --- the byte alphabet and the pre-tokenizer -------------------------------------------------

def test_byte_alphabet_matches_gpt2(bpe):
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    got = bpe.bytes_to_unicode()
    expected = bytes_to_unicode()
    wrong = {b: (got.get(b), expected[b]) for b in range(256) if got.get(b) != expected[b]}
    assert not wrong, f"bytes_to_unicode: byte -> (yours, GPT-2's) differs for {dict(list(wrong.items())[:6])}"


@pytest.mark.parametrize("pre", ["gpt2", "smollm"])
def test_pretokenize_matches_tokenizers(bpe, pre):
    oracle = bpe_oracle.smollm2_pre_tokenizer() if pre == "smollm" else bpe_oracle.transformers_gguf_pre_tokenizer()
    for text in TORTURE:
        got = [bpe.to_symbols(piece) for piece in bpe.pretokenize(text, pre)]
        expected = [piece for piece, _ in oracle.pre_tokenize_str(text)]
        assert got == expected, (
            f"pretokenize({text!r}, {pre!r}): pieces {got} but the tokenizers library cuts {expected}")


# --- training --------------------------------------------------------------------------------

def test_count_pairs_and_merge_word(bpe):
    counts = bpe.count_pairs({("a", "a", "a"): 2, ("a", "b"): 1})
    assert dict(counts) == {("a", "a"): 4, ("a", "b"): 1}, (
        f"count_pairs: ('a','a','a') x2 holds the pair ('a','a') twice per word, so 4; ('a','b') once; "
        f"got {dict(counts)}")
    assert bpe.merge_word(("a", "a", "a"), ("a", "a")) == ("aa", "a"), "merge_word merges left to right, no overlaps"
    assert bpe.merge_word(("x", "a", "b", "a", "b"), ("a", "b")) == ("x", "ab", "ab"), "every occurrence is merged"
    assert bpe.merge_word(("a", "b"), ("b", "c")) == ("a", "b"), "a word without the pair is unchanged"


@pytest.fixture(scope="module")
def trained(bpe):
    corpus = (ROOT / "chapters/05-attention/05-attention.md").read_text()[:8000]
    return corpus, bpe.train_bpe(corpus, 256 + 120)


def test_train_bpe_first_merge_and_size(bpe, trained):
    corpus, merges = trained
    assert len(merges) == 120, f"train_bpe(vocab_size=376) learns 376 - 256 = 120 merges; got {len(merges)}"
    # The most frequent adjacent pair of byte symbols inside pre-tokenized words, counted naively.
    pairs = Counter()
    for piece in bpe.pretokenize(corpus):
        symbols = tokenizer_symbols(piece)
        pairs.update(zip(symbols, symbols[1:]))
    top = max(pairs.values())
    expected = min(pair for pair, n in pairs.items() if n == top)
    assert merges[0] == expected, f"the first merge is the most frequent pair {expected} ({top} times); got {merges[0]}"
    assert bpe.train_bpe(corpus[:2000], 256 + 20) == bpe.train_bpe(corpus[:2000], 256 + 20), (
        "training is deterministic (ties: smallest pair)")
    tokens = {"".join(m) for m in merges}
    assert len(tokens) == len(merges), "each merge makes a new token"


def test_trained_tokenizer_encodes_like_tokenizers(bpe, trained):
    from tokenizers import Tokenizer, models, pre_tokenizers
    corpus, merges = trained
    ours = bpe.BPETokenizer.from_merges(merges)
    vocab = {t: i for i, t in enumerate(ours.tokens)}
    oracle = Tokenizer(models.BPE(vocab, merges))
    oracle.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    text = (ROOT / "chapters/06-rope/06-rope.md").read_text()[:6000]
    got, expected = ours.encode(text), oracle.encode(text).ids
    i = first_difference(got, expected)
    assert got == expected, (f"encode with your trained merges differs from the tokenizers library at token {i}: "
                             f"{got[i:i + 5]} vs {expected[i:i + 5]}")
    assert ours.decode(got) == text, "decode(encode(text)) == text with trained merges"
    assert len(got) < 0.75 * len(text.encode()), (
        f"120 merges should cut the byte count by more than a quarter: "
        f"{len(got)} tokens for {len(text.encode())} bytes")


def test_train_bpe_rejects_a_vocabulary_below_256(bpe):
    with pytest.raises(ValueError, match="256"):
        bpe.train_bpe("abc", 100)


# --- SmolLM2's tokenizer ---------------------------------------------------------------------

def test_loaded_from_gguf_metadata(smol, metadata):
    assert smol.vocab_size == 49152, f"SmolLM2 has 49,152 tokens; got {smol.vocab_size}"
    assert smol.eos_token_id == metadata["tokenizer.ggml.eos_token_id"] == 2, "eos is <|im_end|> (id 2)"
    assert smol.decode([1, 2]) == "<|im_start|><|im_end|>", "special tokens decode to their names"


def test_book_encodes_like_tokenizers(smol, oracle, request):
    chapters = BOOK if request.config.getoption("stress") else BOOK[::max(1, len(BOOK) // FAST_CHAPTERS)]
    for path in chapters:
        text = path.read_text()
        got, expected = smol.encode(text), oracle_ids(oracle, text)
        i = first_difference(got, expected)
        assert got == expected, (f"{path.name}: token {i} differs from the tokenizers library: yours "
                                 f"{got[i:i + 5]} ({smol.decode(got[i:i + 5])!r}), expected {expected[i:i + 5]} "
                                 f"({oracle.decode(expected[i:i + 5])!r})")
        assert smol.decode(got) == text, f"{path.name}: decode(encode(text)) is not the text"


@pytest.mark.parametrize("text", TORTURE)
def test_torture_text_encodes_like_tokenizers(smol, oracle, text):
    got = smol.encode(text, parse_special=True)
    expected = oracle_ids(oracle, text, parse_special=True)
    assert got == expected, f"encode({text!r}, parse_special=True): {got}, the tokenizers library gives {expected}"
    plain = smol.encode(text)
    assert plain == oracle_ids(oracle, text), (
        f"encode({text!r}) without parse_special spells special-token names as text")
    assert smol.decode(plain) == text, f"decode(encode({text!r})) gave {smol.decode(plain)!r}"


def test_bytes_the_vocabulary_lacks_are_dropped_like_tokenizers(smol, oracle):
    for text in ("a\U00050000b", "a\x1db"):     # SmolLM2 has no token for the bytes 0xF1 and 0x1D
        assert smol.encode(text) == oracle_ids(oracle, text), f"encode({text!r}) drops what it cannot spell"


def test_special_tokens_only_when_asked(smol):
    text = "<|im_start|>user\nhi<|im_end|>"
    asked = smol.encode(text, parse_special=True)
    assert asked[0] == 1 and asked[-1] == 2, f"with parse_special, <|im_start|> is id 1 and <|im_end|> id 2: {asked}"
    plain = smol.encode(text)
    assert 1 not in plain and 2 not in plain, f"without parse_special, typed special names are text: {plain}"
    assert smol.encode("hi", add_bos=True)[0] == smol.bos_token_id == 1, "add_bos puts bos_token_id first"
    assert smol.decode(asked, skip_special_tokens=True) == "user\nhi", "skip_special_tokens drops them"


def test_decode_of_any_ids_matches_tokenizers(smol, oracle):
    rng = random.Random(36)
    ordinary = [i for i in range(smol.vocab_size) if i > 16]
    for _ in range(200):
        ids = rng.sample(ordinary, rng.randint(1, 6))
        got, expected = smol.decode(ids), oracle.decode(ids, skip_special_tokens=False)
        assert got == expected, f"decode({ids}): {got!r}, expected {expected!r} (broken UTF-8 becomes U+FFFD)"


def test_decode_rejects_ids_outside_the_vocabulary(smol):
    with pytest.raises(ValueError, match="49152|49151"):
        smol.decode([5, 49152])


# --- chat template ---------------------------------------------------------------------------

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Capital of Peru?"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! 👋"},
     {"role": "user", "content": "Count: 1, 2, 3\n\n1. go"}],
]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(smol, oracle, metadata, add_generation_prompt):
    from transformers import PreTrainedTokenizerFast
    hf = PreTrainedTokenizerFast(tokenizer_object=oracle, chat_template=metadata["tokenizer.chat_template"],
                                 bos_token="<|im_start|>", eos_token="<|im_end|>")
    for messages in CONVERSATIONS:
        got = smol.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        assert got == expected, f"chat template for {messages}:\n{got!r}\nexpected\n{expected!r}"
        assert smol.encode_chat(messages, add_generation_prompt) == oracle_ids(oracle, expected, parse_special=True)


def test_chat_template_rejects_malformed_messages(smol):
    with pytest.raises(ValueError, match="role"):
        smol.apply_chat_template([{"content": "no role"}])


# --- streams ---------------------------------------------------------------------------------

def stream_texts():
    chapter = ROOT / "chapters/03-tokens-embeddings-logits/03-tokens-embeddings-logits.md"
    return [t for t in TORTURE if t] + [chapter.read_text()[:1500]]


@pytest.mark.parametrize("skip_special_tokens", [False, True])
def test_incremental_detokenizer_every_prefix(bpe, smol, oracle, skip_special_tokens):
    for text in stream_texts():
        ids = smol.encode(text, parse_special=True)
        detok = bpe.IncrementalDetokenizer(smol, skip_special_tokens=skip_special_tokens)
        sent = ""
        for k, token_id in enumerate(ids, start=1):
            sent += detok.push(token_id)
            full = oracle.decode(ids[:k], skip_special_tokens=skip_special_tokens)
            assert full.startswith(sent), (f"after {k} tokens of {text[:30]!r} the stream sent {sent[-20:]!r}, "
                                           f"which is not a prefix of the full decode {full[-20:]!r}")
            if "\ufffd" not in text:
                assert "\ufffd" not in sent, f"the stream sent U+FFFD after {k} tokens: half a character went out"
        sent += detok.flush()
        assert sent == oracle.decode(ids, skip_special_tokens=skip_special_tokens), (
            f"pushes + flush != decode for {text[:30]!r}")


def test_a_stream_cut_anywhere_flushes_to_the_full_decode(bpe, smol, oracle):
    """Stopped after any k tokens, pushes + flush give decode(ids[:k]) (short texts: k^2 pushes)."""
    for text in (t for t in stream_texts() if len(smol.encode(t)) <= 40):
        ids = smol.encode(text, parse_special=True)
        for k in range(1, len(ids) + 1):
            detok = bpe.IncrementalDetokenizer(smol)
            sent = "".join(detok.push(i) for i in ids[:k]) + detok.flush()
            assert sent == oracle.decode(ids[:k], skip_special_tokens=False), (
                f"{text[:30]!r} cut after {k} tokens: the stream gave {sent!r}")


def test_incremental_detokenizer_holds_half_characters(bpe, smol):
    ids = smol.encode("🚀")
    assert len(ids) >= 2, f"the rocket should take several tokens in SmolLM2; got {ids}"
    detok = bpe.IncrementalDetokenizer(smol)
    pieces = [detok.push(i) for i in ids]
    assert pieces[:-1] == [""] * (len(ids) - 1) and pieces[-1] == "🚀", (
        f"pieces {pieces}: text leaves only when complete")
    detok = bpe.IncrementalDetokenizer(smol)
    detok.push(ids[0])
    assert detok.flush() == "\ufffd", "flush sends an unfinished character as U+FFFD"


def test_incremental_detokenizer_rejects_bad_ids_untouched(bpe, smol):
    rocket = smol.encode("🚀")
    detok = bpe.IncrementalDetokenizer(smol)
    detok.push(rocket[0])
    with pytest.raises(ValueError):
        detok.push(10 ** 6)
    assert "".join(detok.push(i) for i in rocket[1:]) == "🚀", "a rejected id leaves the stream as it was"


def reference_stop(text, stops):
    """The first stop match a character-by-character stream would see: (text before it, stop)."""
    for end in range(1, len(text) + 1):
        done = [s for s in stops if text[:end].endswith(s)]
        if done:
            stop = max(done, key=len)
            return text[:end - len(stop)], stop
    return text, None


@pytest.mark.parametrize("seed", range(20))
def test_stop_strings_any_chunking(bpe, seed):
    rng = random.Random(seed)
    alphabet = "ab\nU:"
    text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
    stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
    expected_text, expected_stop = reference_stop(text, stops)
    matcher = bpe.StopStringMatcher(stops)
    sent, stop, position = "", None, 0
    while position < len(text):
        chunk = text[position:position + rng.randint(1, 5)]
        position += len(chunk)
        out = matcher.push(chunk)
        sent += out.text
        if out.stopped:
            stop = out.stop_string
            break
    if stop is None:
        sent += matcher.flush()
    assert (sent, stop) == (expected_text, expected_stop), (
        f"text {text!r}, stops {stops}: the stream sent {sent!r} and stopped on {stop!r}; "
        f"expected {expected_text!r} and {expected_stop!r}")


def test_stop_string_across_tokens_is_held_back(bpe):
    matcher = bpe.StopStringMatcher(["\n\nUser:"])
    assert matcher.push("Paris.\n").text == "Paris.", "a possible start of a stop string is held back"
    assert matcher.push("\nUs").text == "", "still a possible stop string: nothing sent"
    out = matcher.push("er: next")
    assert (out.text, out.stopped, out.stop_string) == ("", True, "\n\nUser:"), f"the stop string completed: {out}"
    with pytest.raises(ValueError):
        matcher.push("more")
    matcher = bpe.StopStringMatcher(["\n\nUser:"])
    assert matcher.push("a\n\nUse").text == "a"
    assert matcher.push("d it").text == "\n\nUsed it", "a false alarm releases the held text"


def test_stop_strings_reject_bad_input(bpe):
    with pytest.raises(ValueError):
        bpe.StopStringMatcher("stop")
    with pytest.raises(ValueError):
        bpe.StopStringMatcher(["ok", ""])


def test_gguf_metadata_bad_model_is_rejected(bpe, metadata):
    with pytest.raises(ValueError, match="gpt2"):
        bpe.BPETokenizer.from_gguf_metadata({**metadata, "tokenizer.ggml.model": "llama"})


def test_transformers_gguf_tokenizer_agrees_away_from_digits(smol, smollm2_path, request):
    """transformers' own GGUF tokenizer (GPT-2's split, no digit rule) gives the same ids on
    every paragraph of the book that has no numeric character. Slow to build: --stress only."""
    if not request.config.getoption("stress"):
        pytest.skip("builds transformers' tokenizer from the GGUF (slow); runs under --stress")
    import regex
    from transformers import AutoTokenizer
    hf = AutoTokenizer.from_pretrained(smollm2_path.parent, gguf_file=smollm2_path.name)
    numeric = regex.compile(r"\p{N}")
    paragraphs = [p for path in BOOK for p in path.read_text().split("\n\n")] + TORTURE
    for text in (p for p in paragraphs if not numeric.search(p)):
        expected = hf.encode(text, add_special_tokens=False)
        assert smol.encode(text, parse_special=True) == expected, (
            f"transformers' GGUF tokenizer differs on {text[:60]!r}")


# --- the chapter's command ---------------------------------------------------------------------

def test_run_py_bpe_encodes_chats_and_streams(impl, smollm2_path, oracle, capsys):
    """`python run.py bpe` on the implementation under test: --chat prints the chat prompt's
    ids (the library's ids for the same text), --stream the pieces the detokenizer releases."""
    import json

    from course import cli
    assert cli.main(["bpe", "--impl", impl.spec.text, "--chat", "What is the capital of France?"]) == 0
    chat = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert chat["ids"] == oracle_ids(oracle, chat["text"], parse_special=True) and chat["round_trip"], chat
    assert chat["ids"][0] == 1 and chat["text"].endswith("<|im_start|>assistant\n"), chat["text"]
    assert cli.main(["bpe", "--impl", impl.spec.text, "--stream", "Go 🚀 go"]) == 0
    stream = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert stream["released"] == ["Go", "", "", " 🚀", " go", ""], f"run.py bpe --stream released {stream['released']}"
