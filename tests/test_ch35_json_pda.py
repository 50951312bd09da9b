"""Chapter 35 milestone, free-form JSON: the pushdown guide (json_pda.py).

Oracles, none of which shares code with the code under test:
- `json.loads` parses every text the guide lets a random walk finish (soundness), and the
  text is an object when the guide is built for OpenAI's json_object;
- `json.dumps` writes values that hypothesis generates, compact, with its default
  separators and with indent=2; the guide must accept each of them token by token, EOS
  only at the end (completeness);
- a guide's advance() (one byte at a time through pushdown_step) and its mask (many tokens
  at once through walk_tokens) must agree on every token.
"""
import json
import random
from functools import cache

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.chapter(35)

QUICK = settings(max_examples=60, deadline=None, database=None, derandomize=True,
                 suppress_health_check=list(HealthCheck))

# JSON's punctuation glued the ways BPE vocabularies glue it, half characters included, so
# that tokens open and close several containers at once.
FRAGMENTS = ['{"', '"}', '":', '": ', '", "', '","', ", ", "},", "}}", "]}", "}]", "]]", "[[", "[{", '[{"',
             '"}]', '"]', "}}}", "]]]", "},{", '"},{"', "true", "false", "null", "tr", "ue", "0.", ".5", "e+",
             "-1", "12", "00", "\\u00", "\\n", '\\"', "  ", "\n  ", "\n    ", "\t", "name", " name", "é",
             "\u20ac"[:1], "{}", "[]", ': {"', "1e", "E-"]


def fragment_vocabulary():
    """Every byte, then the fragments (UTF-8 and a lone lead byte), then EOS with no bytes."""
    pieces = [bytes([i]) for i in range(256)] + [f.encode("utf-8") for f in FRAGMENTS] + [b"\xe2\x82"]
    return pieces + [b""]


@pytest.fixture
def pda(impl):
    return impl.load("json_pda")


@pytest.fixture
def guided(impl):
    return impl.load("serve.guided")


def index_over(pda, guided, vocab, **options):
    vocabulary = guided.Vocabulary(vocab, len(vocab) - 1, len(vocab))
    return pda.JsonIndex(vocabulary, **options)


@cache
def shared_index(pda, guided, object_only):
    """One index per implementation for the hypothesis test, so masks stay warm across examples."""
    return index_over(pda, guided, fragment_vocabulary(), object_only=object_only)


def random_walk(pda, index, rng, limit):
    """Draw allowed tokens uniformly until the guide finishes, EOS or `limit` tokens."""
    guide = pda.JsonGuide(index)
    vocab = index.vocabulary.vocab_bytes
    text = b""
    for _ in range(limit):
        choices = torch.nonzero(guide.allowed()).flatten().tolist()
        assert choices, f"the guide allows nothing after {text!r}: a walk that follows the masks never gets stuck"
        token = rng.choice(choices)
        guide.advance(token)
        if token == index.vocabulary.eos_token_id:
            return text, True
        text += vocab[token]
        if guide.finished:
            return text, True
    return text, False


@pytest.mark.parametrize("object_only", [True, False])
def test_every_finished_random_walk_is_json(pda, guided, object_only):
    index = index_over(pda, guided, fragment_vocabulary(), object_only=object_only, max_depth=6)
    rng = random.Random(35)
    finished = 0
    for _ in range(1500):
        text, done = random_walk(pda, index, rng, limit=40)
        if not done:
            continue
        finished += 1
        try:
            value = json.loads(text)
        except ValueError as error:
            raise AssertionError(f"the guide let a walk finish with {text!r}, "
                                 f"which json.loads refuses: {error}") from None
        if object_only:
            assert isinstance(value, dict), f"json_object guide finished {text!r}, which is not an object"
    assert finished > 300, f"only {finished} of 1500 walks finished: the guide should let JSON close"


def test_the_mask_agrees_with_advance(pda, guided):
    vocab = fragment_vocabulary()
    index = index_over(pda, guided, vocab, object_only=False, max_depth=4, max_whitespace=3)
    rng = random.Random(7)
    for _ in range(12):
        guide = pda.JsonGuide(index)
        text = b""
        for _ in range(25):
            mask = guide.allowed()
            for token in range(len(vocab)):
                trial = pda.JsonGuide(index)
                trial.state, trial.stack, trial.ended = guide.state, list(guide.stack), guide.ended
                try:
                    trial.advance(token)
                    accepted = True
                except ValueError:
                    accepted = False
                assert bool(mask[token]) == accepted, (
                    f"after {text!r} (open: {guide.stack}) the mask says {bool(mask[token])} for token {token} "
                    f"({vocab[token]!r}) but advance {'accepts' if accepted else 'refuses'} it: the mask (walk_tokens, "
                    f"all tokens at once) must allow exactly the tokens advance (one byte at a time) accepts")
            choices = torch.nonzero(mask).flatten().tolist()
            token = rng.choice(choices)
            guide.advance(token)
            if token == len(vocab) - 1 or guide.finished:
                break
            text += vocab[token]


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=6),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=4), children, max_size=3),
    max_leaves=8)


def tokenize_longest_first(vocab, data):
    """Greedy longest match over the vocabulary's byte pieces (every byte is a piece)."""
    pieces = {piece: token for token, piece in enumerate(vocab) if piece}
    longest = max(len(p) for p in pieces)
    tokens, at = [], 0
    while at < len(data):
        size = next(s for s in range(min(longest, len(data) - at), 0, -1) if data[at:at + s] in pieces)
        tokens.append(pieces[data[at:at + size]])
        at += size
    return tokens


@QUICK
@given(value=json_values)
def test_what_json_dumps_writes_is_accepted(pda, guided, value):
    vocab = fragment_vocabulary()
    index, objects = shared_index(pda, guided, False), shared_index(pda, guided, True)
    eos = len(vocab) - 1
    for options in ({}, {"separators": (",", ":")}, {"indent": 2}, {"ensure_ascii": False}):
        data = json.dumps(value, **options).encode("utf-8")
        for tokens in (list(data), tokenize_longest_first(vocab, data)):
            for chosen in ([index, objects] if isinstance(value, dict) else [index]):
                guide = pda.JsonGuide(chosen)
                for at, token in enumerate(tokens):
                    assert guide.allowed()[token], (
                        f"json.dumps({options}) wrote {data!r}; the guide refuses token {vocab[token]!r} "
                        f"after {b''.join(vocab[t] for t in tokens[:at])!r}")
                    guide.advance(token)
                assert guide.allowed()[eos], f"EOS must be allowed after the whole value {data!r}"


def test_pushdown_step_keeps_the_stack_of_open_containers(pda, guided):
    tables = index_over(pda, guided, fragment_vocabulary(), object_only=False).tables
    kinds = {ord("{"): pda.OBJECT, ord("["): pda.ARRAY}
    state = tables.start
    stack: list[int] = []
    expected: list[int] = []
    for at, byte in enumerate(b'[{"a":[1,{}]},[[2]]]'):
        state = pda.pushdown_step(tables, state, stack, byte, 4)
        assert state >= 0, f"byte {at} ({chr(byte)!r}) of a JSON text was refused"
        if byte in kinds:
            expected.append(kinds[byte])
        elif byte in b"]}":
            expected.pop()
        assert stack == expected, (
            f"after byte {at} ({chr(byte)!r}) the stack is {stack}, expected {expected}: an opening bracket appends "
            f"its kind, a closing one removes the innermost container")
        assert state % 3 == (stack[-1] if stack else pda.NONE), (
            f"after byte {at} ({chr(byte)!r}) the state's top is {state % 3}: it must be the kind of the innermost "
            f"open container (NONE when none is open)")
    state, stack = tables.start, []
    for byte in b"[[[":
        state = pda.pushdown_step(tables, state, stack, byte, 3)
    assert pda.pushdown_step(tables, state, stack, ord("["), 3) == pda.DEEPER, (
        "with 3 containers open and max_depth 3, a 4th opening bracket returns DEEPER")
    assert stack == [pda.ARRAY] * 3, "a PUSH refused for depth leaves the stack unchanged"
    assert pda.pushdown_step(tables, state, stack, ord("}"), 3) == -1 and stack == [pda.ARRAY] * 3, (
        "a byte the tables refuse returns -1 and leaves the stack unchanged")
    for byte in b"],":
        state = pda.pushdown_step(tables, state, stack, byte, 3)
    assert pda.pushdown_step(tables, state, stack, ord("["), 3) >= 0 and len(stack) == 3, (
        "with 2 containers open, max_depth 3 allows a 3rd")


def test_forbidden_tokens_are_refused_by_name(pda, guided):
    vocab = fragment_vocabulary()
    eos = len(vocab) - 1
    index = index_over(pda, guided, vocab)                    # json_object: the top level is an object
    guide = pda.JsonGuide(index)
    for token in (ord("["), ord("1"), ord('"'), eos):
        assert not guide.allowed()[token], f"json_object must begin with an object, yet {vocab[token]!r} is allowed"
        with pytest.raises(ValueError, match=str(token)):
            guide.advance(token)
        assert (guide.state, guide.stack) == (index.tables.start, []), "a refused token must not move the guide"
    for token in tokenize_longest_first(vocab, b'{"a": 0'):
        guide.advance(token)
    for bad in (b"1", b"}}", b"]", b'"'):
        token = vocab.index(bad)
        assert not guide.allowed()[token], f"after {{\"a\": 0 the token {bad!r} must be refused"
        with pytest.raises(ValueError, match=str(token)):
            guide.advance(token)
    assert not guide.allowed()[eos], "EOS before the object is closed"
    guide.advance(ord("}"))
    assert guide.finished and guide.allowed()[eos], "a closed top-level object is a complete json_object"


def test_depth_and_whitespace_have_stated_bounds(pda, guided):
    vocab = fragment_vocabulary()
    index = index_over(pda, guided, vocab, object_only=False, max_depth=3, max_whitespace=4)
    guide = pda.JsonGuide(index)
    guide.advance(vocab.index(b"[["))
    assert not guide.allowed()[vocab.index(b"[[")], "[[ would open the 4th container past max_depth 3"
    guide.advance(ord("["))
    assert not guide.allowed()[ord("[")] and not guide.allowed()[ord("{")], "max_depth 3: no 4th container"
    try:
        guide.advance(ord("{"))
    except ValueError as error:
        assert "max_depth" in str(error), f"a refusal for depth must name max_depth, got: {error}"
    else:
        pytest.fail("advance('{') with 3 containers open was accepted: max_depth 3 allows no 4th container")
    spaces = pda.JsonGuide(index)
    for _ in range(4):
        spaces.advance(ord(" "))
    assert not spaces.allowed()[ord(" ")] and not spaces.allowed()[ord("\n")], (
        "max_whitespace 4: a fifth whitespace byte in one run must be refused")
    with pytest.raises(ValueError, match="max_depth"):
        pda.JsonIndex(guided.Vocabulary(vocab, len(vocab) - 1, len(vocab)), max_depth=0)


def test_numbers_strings_and_literals_follow_json(pda, guided):
    vocab = fragment_vocabulary()
    index = index_over(pda, guided, vocab, object_only=False)

    def accepts(text):
        guide = pda.JsonGuide(index)
        for byte in text:
            if not guide.allowed()[byte]:
                return False
            guide.advance(byte)
        return bool(guide.allowed()[len(vocab) - 1])

    for good in (b"0", b"-0.5e+10", b"12E3", b'"\\u00e9\\"\\\\"', '"é€😀"'.encode(), b"[true,false,null]",
                 b'{"a" : [ 1 ,2 ] }', b"\t[]"):
        assert accepts(good), f"{good!r} is JSON (json.loads: {json.loads(good)!r}), the guide must accept it"
    for bad in (b"01", b"1.", b"-", b".5", b"1e", b"+1", b'"\\x"', b'"\\u12g4"', b'"a\nb"', b'"\xc0\xaf"',
                b'"\xed\xa0\x80"', b"tru", b"nul", b"[1,]", b'{"a"}', b"{1: 2}", b"[1] "):
        assert not accepts(bad), f"{bad!r} is not a JSON text the guide should complete"
