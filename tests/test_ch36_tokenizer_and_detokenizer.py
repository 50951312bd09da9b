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
from hypothesis import given, settings
from hypothesis import strategies as st

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


RANK_RULE = ("a word gets the tokens training made of it: merges apply lowest rank first, wherever in "
             "the word, until no adjacent pair is a merge")


def tokenizer_symbols(text):
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    table = bytes_to_unicode()
    return [table[b] for b in text.encode("utf-8")]


def spelled(tokenizer, ids):
    """Ids as the tokens they are, for messages: [278 'Ġthe', 11 ',']."""
    return "[" + ", ".join(f"{i} {tokenizer.tokens[i]!r}" for i in ids) + "]"


def round_trip_failure(tokenizer, ids, text, where):
    """Why decode(encode(text)) is not the text, naming the rule: where the two first differ,
    and a token of the text that holds only part of a character, if there is one."""
    got = tokenizer.decode(ids)
    at = next((k for k, (a, b) in enumerate(zip(got, text)) if a != b), min(len(got), len(text)))
    message = (f"{where}: decode(encode(text)) is not the text: from character {at}, yours "
               f"{got[max(0, at - 10):at + 20]!r}, the text {text[max(0, at - 10):at + 20]!r}")
    for token_id in ids:
        try:
            tokenizer.token_bytes(token_id).decode("utf-8")
        except UnicodeDecodeError:
            return (f"{message}. The bytes of a character split across tokens are decoded together, never "
                    f"token by token: token {token_id} {tokenizer.tokens[token_id]!r} is only part of a character")
    return f"{message}. decode gives back exactly the text whose bytes the ids stand for"


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
        f"count_pairs counts every adjacent pair of every word, times the word's count: ('a','a','a') "
        f"occurring twice holds the pair ('a','a') twice per word, so 4; ('a','b') once; got {dict(counts)}")
    merged = bpe.merge_word(("a", "a", "a"), ("a", "a"))
    assert isinstance(merged, tuple), f"merge_word returns a tuple of symbols (words are dict keys); got {merged!r}"
    assert merged == ("aa", "a"), (
        f"merge_word(('a','a','a'), ('a','a')): no symbol is used by two merges, the first pair wins: "
        f"('aa', 'a'), got {merged}")
    assert bpe.merge_word(("x", "a", "b", "a", "b"), ("a", "b")) == ("x", "ab", "ab"), (
        "merge_word merges every occurrence of the pair, the last one included")
    assert bpe.merge_word(("ba", "a"), ("a", "a")) == ("ba", "a"), (
        "merge_word matches whole symbols: the 'a' ending the symbol 'ba' is not the symbol 'a'")
    assert bpe.merge_word(("a", "b"), ("b", "c")) == ("a", "b"), "a word without the pair is unchanged"


def naive_merges(pieces, count):
    """A naive trainer: each word a list of symbols, every pair counted afresh each round.
    Returns [(merge, {pair: times seen} at that round)]."""
    words = [list(piece) for piece in pieces]
    rounds = []
    for _ in range(count):
        seen = Counter()
        for word in words:
            seen.update(zip(word, word[1:]))
        if not seen:
            break
        top = max(seen.values())
        best = sorted(pair for pair, n in seen.items() if n == top)[0]
        rounds.append((best, seen))
        for word in words:
            i = 0
            while i < len(word) - 1:
                if (word[i], word[i + 1]) == best:
                    word[i:i + 2] = [word[i] + word[i + 1]]
                i += 1
    return rounds


def assert_merges_like_naive(bpe, text, vocab_size):
    merges = bpe.train_bpe(text, vocab_size)
    rounds = naive_merges([tokenizer_symbols(piece) for piece in bpe.pretokenize(text)], vocab_size - 256)
    for rank, (expected, seen) in enumerate(rounds):
        if rank >= len(merges) or merges[rank] == expected:
            continue
        got = merges[rank]
        if seen.get(got) == seen[expected]:
            raise AssertionError(f"train_bpe({text[:30]!r}...): merge {rank} is {got}, but {expected} is seen as often "
                                 f"({seen[expected]} times) and ties go to the pair that sorts first")
        raise AssertionError(f"train_bpe({text[:30]!r}...): merge {rank} is the most frequent pair once merges "
                             f"0..{rank - 1} are applied: {expected} ({seen[expected]} times), got {got} "
                             f"({seen.get(got, 0)} times)")
    assert len(merges) == len(rounds), (
        f"train_bpe(vocab_size={vocab_size}) learns vocab_size - 256 = {len(rounds)} merges (fewer only when no "
        f"pair is left); got {len(merges)}")


def test_train_bpe_tiny_corpus(bpe):
    """The chapter's corpus: merge 1 is a tie, ('h','e') and ('t','h') both seen 4 times."""
    assert_merges_like_naive(bpe, "the cat sat on the mat; the rat sat on the hat", 256 + 8)
    assert_merges_like_naive(bpe, "aaaa aaaa ab", 256 + 5)        # runs out of pairs: fewer merges


@pytest.fixture(scope="module")
def trained(bpe):
    corpus = (ROOT / "chapters/05-attention/05-attention.md").read_text()[:8000]
    return corpus, bpe.train_bpe(corpus, 256 + 120)


def test_train_bpe_merges_and_size(bpe, trained):
    corpus, merges = trained
    assert_merges_like_naive(bpe, corpus[:3000], 256 + 40)
    assert len(merges) == 120, f"train_bpe(vocab_size=376) learns vocab_size - 256 = 120 merges; got {len(merges)}"
    assert bpe.train_bpe(corpus[:2000], 256 + 20) == bpe.train_bpe(corpus[:2000], 256 + 20), (
        "training is deterministic (ties: the pair that sorts first)")
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
                             f"{got[i:i + 5]} vs {expected[i:i + 5]}: {RANK_RULE}")
    assert ours.decode(got) == text, round_trip_failure(ours, got, text, "with your trained merges")
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
    assert smol.decode([1, 2]) == "<|im_start|><|im_end|>", (
        f"special tokens decode to their names (unless skip_special_tokens); got {smol.decode([1, 2])!r}")


@pytest.mark.edition_stress
def test_book_encodes_like_tokenizers(smol, oracle, request):
    chapters = BOOK if request.config.getoption("stress") else BOOK[::max(1, len(BOOK) // FAST_CHAPTERS)]
    for path in chapters:
        text = path.read_text()
        got, expected = smol.encode(text), oracle_ids(oracle, text)
        i = first_difference(got, expected)
        assert got == expected, (f"{path.name}: token {i} differs from the tokenizers library: yours "
                                 f"{spelled(smol, got[i:i + 5])}, expected {spelled(smol, expected[i:i + 5])}; "
                                 f"{RANK_RULE}")
        assert smol.decode(got) == text, round_trip_failure(smol, got, text, path.name)


@pytest.mark.parametrize("text", TORTURE)
def test_torture_text_encodes_like_tokenizers(smol, oracle, text):
    got = smol.encode(text, parse_special=True)
    expected = oracle_ids(oracle, text, parse_special=True)
    assert got == expected, (f"encode({text!r}, parse_special=True): {spelled(smol, got)}, the tokenizers library "
                             f"gives {spelled(smol, expected)}; {RANK_RULE}")
    plain = smol.encode(text)
    assert plain == oracle_ids(oracle, text), (
        f"encode({text!r}) without parse_special spells special-token names as text")
    assert smol.decode(plain) == text, round_trip_failure(smol, plain, text, f"encode({text!r})")


def test_bytes_the_vocabulary_lacks_are_dropped_like_tokenizers(smol, oracle):
    for text in ("a\U00050000b", "a\x1db"):     # SmolLM2 has no token for the bytes 0xF1 and 0x1D
        rule = f"encode({text!r}) leaves out a byte symbol the vocabulary lacks, as the tokenizers library does"
        try:
            got = smol.encode(text)
        except (KeyError, ValueError) as error:
            pytest.fail(f"{rule}; it raised {type(error).__name__}: {error}")
        assert got == oracle_ids(oracle, text), f"{rule}; got {spelled(smol, got)}"


def test_special_tokens_only_when_asked(smol):
    text = "<|im_start|>user\nhi<|im_end|>"
    asked = smol.encode(text, parse_special=True)
    assert asked[0] == 1 and asked[-1] == 2, f"with parse_special, <|im_start|> is id 1 and <|im_end|> id 2: {asked}"
    plain = smol.encode(text)
    assert 1 not in plain and 2 not in plain, f"without parse_special, typed special names are text: {plain}"
    assert smol.encode("hi", add_bos=True)[0] == smol.bos_token_id == 1, "add_bos puts bos_token_id first"
    assert smol.decode(asked, skip_special_tokens=True) == "user\nhi", "skip_special_tokens drops them"


def test_decode_of_any_ids_matches_tokenizers(smol, oracle):
    text = "Go 🚀 naïve 日本"
    ids = smol.encode(text)
    assert smol.decode(ids) == text, (
        f"decode({ids}) gave {smol.decode(ids)!r}, not {text!r}: the ids' bytes are decoded together, so a "
        f"character split over tokens (the rocket is {len(smol.encode('🚀'))} of them) comes back whole")
    rng = random.Random(36)
    ordinary = [i for i in range(smol.vocab_size) if i > 16]
    for _ in range(200):
        ids = rng.sample(ordinary, rng.randint(1, 6))
        got, expected = smol.decode(ids), oracle.decode(ids, skip_special_tokens=False)
        assert got == expected, (f"decode({ids}): {got!r}, expected {expected!r}: the ids' bytes are decoded "
                                 f"together, so a character split over tokens comes back whole, and bytes "
                                 f"that are not valid UTF-8 read as U+FFFD")


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
    return [t for t in TORTURE if t] + [chapter.read_text()[:1500], "a real \ufffd in the text, then more"]


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
            if not full.endswith("\ufffd"):
                assert sent == full, (f"after {k} tokens of {text[:30]!r} the decode ends in a complete character, "
                                      f"yet the stream holds {full[len(sent):][:20]!r}: text is held only while it "
                                      f"ends in an unfinished character")
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


def test_incremental_detokenizer_releases_a_real_replacement_character(bpe, smol):
    """U+FFFD that is really in the text goes out as soon as a character follows it."""
    ids = smol.encode("ok \ufffd x y z")
    detok = bpe.IncrementalDetokenizer(smol)
    sent = "".join(detok.push(i) for i in ids)
    assert sent == "ok \ufffd x y z", (
        f"the stream sent {sent!r} of 'ok \ufffd x y z' before flush: only a trailing U+FFFD (an unfinished "
        f"character) is held back, not one in the middle of the text")


def test_incremental_detokenizer_rejects_bad_ids_untouched(bpe, smol):
    rocket = smol.encode("🚀")
    detok = bpe.IncrementalDetokenizer(smol)
    detok.push(rocket[0])
    with pytest.raises(ValueError):
        detok.push(10 ** 6)
    rule = "a rejected id leaves the stream as it was (validate before changing any state)"
    try:
        rest = "".join(detok.push(i) for i in rocket[1:])
    except ValueError as error:
        pytest.fail(f"{rule}; the next good id raised ValueError: {error}")
    assert rest == "🚀", f"{rule}; the rocket's other tokens gave {rest!r}"


def reference_stop(text, stops):
    """The first stop match a character-by-character stream would see: (text before it, stop)."""
    for end in range(1, len(text) + 1):
        done = [s for s in stops if text[:end].endswith(s)]
        if done:
            stop = max(done, key=len)
            return text[:end - len(stop)], stop
    return text, None


STOP_RULE = ("the stream stops where a character-by-character stream would first complete a stop string "
             "(the one that ENDS first; of two ending together, the longer), sends everything before it, and "
             "holds back only the longest tail that may still become one")


def stream_through_matcher(bpe, text, stops, cuts):
    """Push `text` cut at `cuts` into a StopStringMatcher: (text sent, stop string or None)."""
    matcher = bpe.StopStringMatcher(stops)
    sent, bounds = "", [0, *sorted(set(cuts)), len(text)]
    for start, end in zip(bounds, bounds[1:]):
        out = matcher.push(text[start:end])
        sent += out.text
        if out.stopped:
            return sent, out.stop_string
    return sent + matcher.flush(), None


def assert_stream_stops_like_a_scan(bpe, text, stops, cuts):
    expected = reference_stop(text, stops)
    got = stream_through_matcher(bpe, text, stops, cuts)
    pieces = [text[a:b] for a, b in zip([0, *sorted(set(cuts))], [*sorted(set(cuts)), len(text)])]
    assert got == expected, (
        f"text {text!r} pushed as {pieces}, stops {stops}: the stream sent {got[0]!r} and stopped on {got[1]!r}; "
        f"expected {expected[0]!r} and {expected[1]!r}: {STOP_RULE}")


@pytest.mark.parametrize("seed", range(20))
def test_stop_strings_any_chunking(bpe, seed):
    rng = random.Random(seed)
    alphabet = "ab\nU:"
    text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
    stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
    cuts = [rng.randint(0, len(text)) for _ in range(rng.randint(0, 8))]
    assert_stream_stops_like_a_scan(bpe, text, stops, cuts)


@pytest.mark.parametrize("text, stops, cuts, sent, stop", [
    ("xabcd", ["abcd", "bc"], [], "xa", "bc"),           # "bc" ends first, though "abcd" starts first
    ("xabcd", ["bc", "abc"], [], "x", "abc"),            # both end at the c: the longer wins
    ("aab", ["aab"], [2], "", "aab"),                    # "aa" is held whole: both a's may start "aab"
    ("xaab", ["aab", "b"], [1, 3], "x", "aab"),
    ("xaab", ["aab"], [3], "x", "aab"),                  # the chapter's stories: "aa" held, not "a"
    ("xabcd", ["abc", "bc"], [3], "x", "abc"),           # one character completes both, over two pushes
    ("xabcd", ["abc", "bc"], [], "x", "abc"),
])
def test_stop_strings_fixed_cases(bpe, text, stops, cuts, sent, stop):
    assert reference_stop(text, stops) == (sent, stop)
    assert_stream_stops_like_a_scan(bpe, text, stops, cuts)


@st.composite
def texts_and_stops(draw):
    """A text over a small alphabet, stop strings cut from it (so they do occur, often
    overlapping each other) or drawn freely, and the cuts of the stream."""
    text = draw(st.text(alphabet="ab:\n", max_size=24))
    pieces = []
    for _ in range(draw(st.integers(1, 3))):
        if text and draw(st.booleans()):
            start = draw(st.integers(0, len(text) - 1))
            pieces.append(text[start:draw(st.integers(start + 1, min(len(text), start + 5)))])
        else:
            pieces.append(draw(st.text(alphabet="ab:\n", min_size=1, max_size=4)))
    cuts = draw(st.lists(st.integers(0, len(text)), max_size=8))
    return text, pieces, cuts


@settings(max_examples=300, deadline=None, database=None, derandomize=True)
@given(case=texts_and_stops())
def test_stop_strings_cut_from_the_text(bpe, case):
    assert_stream_stops_like_a_scan(bpe, *case)


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


@pytest.mark.edition_stress
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
