"""Chapter 35 milestone: constrained decoding (regex_dfa.py, json_regex.py, serve/guided.py).

Oracles, none of which shares code with the code under test:
- Python's `re.fullmatch(pattern, text, re.ASCII)` decides what a pattern matches (the
  course's \\d \\w \\s are ASCII, like re.ASCII), on fixed tables and on patterns and strings
  that hypothesis generates (derandomized: the same examples every run);
- the `regex` package's partial matching (`regex.fullmatch(..., partial=True)`: can the
  text still be completed to a match?) decides which tokens a guide must allow;
- `jsonschema` validates every JSON document a schema's guide lets through, and `json`
  parses it;
- the engine's free requests must give the reference's solo greedy tokens even when
  guided requests share their steps.
The engine's guided requests use finite languages, so every draw completes within
max_tokens whatever a correct sampler draws; the mixed JSON/regex scenario was run once by
hand over 40 sampler seeds, every output complete, matching and valid.
"""
import json
import random
import re

import jsonschema
import pytest
import regex
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from course.testing.oracles import TINY_EOS, assert_engine_idle, byte_vocabulary, make_engine, solo

pytestmark = pytest.mark.chapter(35)

QUICK = settings(max_examples=80, deadline=None, database=None, derandomize=True,
                 suppress_health_check=list(HealthCheck))


@pytest.fixture
def rx(impl):
    return impl.load("regex_dfa")


@pytest.fixture
def guided(impl):
    return impl.load("serve.guided")


@pytest.fixture
def json_regex(impl):
    return impl.load("json_regex")


def matches(rx, pattern, text):
    return rx.compile_regex(pattern).fullmatch(text.encode("utf-8"))


# --- the regex engine against Python's re ------------------------------------------------------

FIXED = {
    r"[a-z]+@[a-z]+\.com": ["ab@cd.com", "ab@cd.co", "@cd.com", "AB@cd.com"],
    r"(ab|cd)*e?": ["", "abcde", "abc", "e", "ee"],
    r"\d{3}-\d{2,4}": ["123-45", "123-4567", "123-45678", "12-345"],
    r"a{2,}b{,3}c{2}": ["aacc", "aabbbcc", "aabbbbcc", "acc"],
    r"[^\"\\]*": ["", "héllo €", 'a"b', "a\\b"],
    r"h[é-ü]llo|w.rld": ["héllo", "hüllo", "hzllo", "w€rld", "w\nrld"],
    r"\w+\s\W": ["ab_9 !", "ab_9 a", "é \t"],
    r"(?:x|y(z|))+": ["x", "yzy", "", "zz"],
    r"\x41\u00e9\{\}": ["Aé{}", "Ae{}"],
    r"a{": ["a{", "a"],
    r"[-a]+|[b-]": ["-a-", "b", "-"],
}


@pytest.mark.parametrize("pattern", sorted(FIXED))
def test_the_dfa_matches_what_python_re_matches(rx, pattern):
    dfa = rx.compile_regex(pattern)
    for text in FIXED[pattern]:
        expected = re.fullmatch(pattern, text, re.ASCII) is not None
        assert dfa.fullmatch(text.encode("utf-8")) == expected, (
            f"pattern {pattern!r} on {text!r}: re.fullmatch says {expected}, the DFA says otherwise")


def test_the_dfa_reads_bytes_and_accepts_only_utf8(rx):
    dfa = rx.compile_regex(".*")
    assert dfa.fullmatch("é€😀".encode("utf-8"))
    for bad in (b"\xff", b"\xc3", b"\xe2\x82", b"\xed\xa0\x80", b"\xc0\xaf", b"\xf4\x90\x80\x80"):
        assert not dfa.fullmatch(bad), f"'.*' matched {bad!r}, which is not valid UTF-8"
    state = dfa.walk(dfa.start, b"\xe2\x82")       # half of the euro sign: alive, not accepting
    assert state >= 0 and not dfa.accepting[state], "the DFA must be able to stop in the middle of a character"
    assert dfa.accepting[dfa.walk(state, b"\xac")]


def test_dead_states_are_trimmed(rx):
    dfa = rx.compile_regex("ab|cd")
    assert dfa.walk(dfa.start, b"ac") == -1, "a byte after which no match is possible must lead to -1"
    table = dfa.transitions
    assert table.shape == (dfa.num_states, 256) and str(table.dtype) == "int32"
    for state in range(dfa.num_states):             # every state can still reach an accepting one
        assert dfa.accepting[state] or (table[state] >= 0).any()


@pytest.mark.parametrize("pattern, words", [
    ("(ab", "missing"), ("ab)", "unbalanced"), ("a**", "multiple repeat"), ("*a", "nothing to repeat"),
    ("[z-a]", "range"), (r"(a)\1", "escape"), ("^ab", "anchors"), ("a*?", "lazy"), ("[ab", "unterminated"),
    ("(?=a)", "groups"), ("a{5,2}", "greater"),
])
def test_bad_patterns_are_refused_with_the_position(rx, pattern, words):
    with pytest.raises(ValueError, match=words):
        rx.compile_regex(pattern)


def test_epsilon_closure_follows_cycles(rx):
    nfa = rx.NFA()
    for _ in range(5):
        nfa.new_state()
    nfa.empty[0] += [1, 2]
    nfa.empty[2] += [3, 0]                  # a cycle 0 -> 2 -> 0
    nfa.empty[3] += [3]                     # and a self-loop
    nfa.edges[1].append((97, 97, 4))        # a byte move is not an empty move
    closure = rx.epsilon_closure(nfa, [0])
    assert isinstance(closure, frozenset), "the closure names a DFA state: a frozenset, so equal closures hash equal"
    assert closure == frozenset({0, 1, 2, 3}), (
        f"closure of {{0}} is {set(closure)}: every state reachable by empty moves, through the cycle and the "
        f"self-loop, and only by empty moves (a byte move is not an empty move)")
    assert rx.epsilon_closure(nfa, [4]) == frozenset({4}), "the closure includes the states it starts from"
    assert rx.epsilon_closure(nfa, []) == frozenset()


def test_determinize_builds_the_subset_automaton(rx):
    # (a|b)*abb over bytes, written as an NFA by hand: 0 -a,b-> 0, 0 -a-> 1 -b-> 2 -b-> 3 (accept)
    nfa = rx.NFA()
    for _ in range(4):
        nfa.new_state()
    nfa.edges[0] += [(97, 98, 0), (97, 97, 1)]
    nfa.edges[1].append((98, 98, 2))
    nfa.edges[2].append((98, 98, 3))
    nfa.start, nfa.accept = 0, 3
    dfa = rx.determinize(nfa)
    assert dfa.start == 0 and dfa.num_states == 4, "the subsets {0}, {0,1}, {0,2}, {0,3}: four DFA states"
    assert dfa.transitions.shape == (4, 256)
    for text in ("abb", "aabb", "babb", "ab", "abba", "abbabb", "c"):
        assert dfa.fullmatch(text.encode()) == (re.fullmatch("(a|b)*abb", text) is not None), (
            f"(a|b)*abb on {text!r}: each byte class's columns lead to the subset its bytes reach, and a state "
            f"accepts exactly when its subset holds nfa.accept")
    assert int(dfa.accepting.sum()) == 1, "only the subset {0,3} holds nfa.accept: one accepting state"
    assert (dfa.transitions[:, ord("c")] == -1).all(), "a byte no NFA state of the subset reads leads to -1"
    # [a-c]e|x: ranges of one state that do not overlap, each read to its last byte
    nfa = rx.NFA()
    for _ in range(3):
        nfa.new_state()
    nfa.edges[0] += [(120, 120, 2), (97, 99, 1)]
    nfa.edges[1].append((101, 101, 2))
    nfa.start, nfa.accept = 0, 2
    dfa = rx.determinize(nfa)
    for text in ("ae", "be", "ce", "x", "de", "c", "xe", "e"):
        assert dfa.fullmatch(text.encode()) == (re.fullmatch("[a-c]e|x", text) is not None), (
            f"[a-c]e|x on {text!r}: an edge (lo, hi, t) reads every byte from lo to hi, hi included")
    # a(b)? with empty moves at the start and after the byte: 0 -e-> 1 -a-> 2 -e-> 3 (accept), 2 -b-> 3
    nfa = rx.NFA()
    for _ in range(4):
        nfa.new_state()
    nfa.empty[0].append(1)
    nfa.edges[1].append((97, 97, 2))
    nfa.empty[2].append(3)
    nfa.edges[2].append((98, 98, 3))
    nfa.start, nfa.accept = 0, 3
    dfa = rx.determinize(nfa)
    assert dfa.transitions[0, ord("a")] >= 0, (
        "DFA state 0 stands for the epsilon closure of nfa.start, not nfa.start alone")
    assert dfa.fullmatch(b"a") and dfa.fullmatch(b"ab") and not dfa.fullmatch(b""), (
        "a byte leads to the epsilon closure of the NFA states it reaches, so 'a' and 'ab' match a(b)?")


# --- property tests: random patterns of the subset, random strings -----------------------------

ATOMS = st.sampled_from(["a", "b", "é", "€", "-", r"\.", ".", "[a-c]", "[^ab]", r"\d", r"\w", r"\s", "[é-ü]",
                         r"\W", "[0-9x]", r"\x62"])


def combine(children):
    pair = st.tuples(children, children)
    return st.one_of(
        pair.map(lambda p: p[0] + p[1]),
        pair.map(lambda p: f"(?:{p[0]}|{p[1]})"),
        st.tuples(children, st.sampled_from(["*", "+", "?", "{2}", "{1,3}", "{2,}", "{,2}"])).map(
            lambda p: f"(?:{p[0]}){p[1]}"),
        children.map(lambda c: f"({c})"),
    )


PATTERNS = st.recursive(ATOMS, combine, max_leaves=6)
TEXTS = st.text(alphabet="abcé€ü-.0 \n_x", max_size=8)


@QUICK
@given(pattern=PATTERNS, texts=st.lists(TEXTS, min_size=1, max_size=6))
def test_random_patterns_agree_with_re_on_random_strings(rx, pattern, texts):
    dfa = rx.compile_regex(pattern)
    for text in texts:
        expected = re.fullmatch(pattern, text, re.ASCII) is not None
        assert dfa.fullmatch(text.encode("utf-8")) == expected, f"{pattern!r} on {text!r}: re says {expected}"


@QUICK
@given(data=st.data(), pattern=PATTERNS)
def test_random_patterns_accept_strings_that_re_generates(rx, data, pattern):
    text = data.draw(st.from_regex(re.compile(pattern, re.ASCII), fullmatch=True))
    try:
        encoded = text.encode("utf-8")
    except UnicodeEncodeError:                  # hypothesis may draw a lone surrogate: not text
        return
    assert rx.compile_regex(pattern).fullmatch(encoded), f"{pattern!r} must match {text!r}"


# --- JSON schemas ------------------------------------------------------------------------------

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "minLength": 1, "maxLength": 12},
    "age": {"type": "integer"},
    "height": {"type": "number"},
    "tags": {"type": "array", "items": {"enum": ["red", "green", 7, None]}, "maxItems": 3},
    "pet": {"anyOf": [{"type": "null"}, {"type": "object", "properties": {
        "kind": {"enum": ["cat", "dog"]}, "legs": {"type": ["integer", "null"]}}, "required": ["kind"]}]},
    "ok": {"type": "boolean"},
    "nothing": {"type": "null"},
    "exact": {"const": {"a": [1, "x"]}},
}, "required": ["name", "age"]}


def test_a_schema_automaton_accepts_what_json_dumps_writes(json_regex):
    dfa = json_regex.compile_schema(PERSON)
    document = {"name": "Zoë \"Z\"\n", "age": -3, "height": 1.5e3, "tags": ["red", 7, None],
                "pet": {"kind": "cat", "legs": None}, "ok": True, "nothing": None, "exact": {"a": [1, "x"]}}
    for text in (json.dumps(document, ensure_ascii=False), json.dumps(document),
                 json.dumps(document, separators=(",", ":"))):
        assert dfa.fullmatch(text.encode("utf-8")), f"the schema's automaton refused {text}"
    too_long = dict(document, name="x" * 13)
    assert not dfa.fullmatch(json.dumps(too_long).encode()), "maxLength 12 must refuse 13 characters"
    assert not dfa.fullmatch(json.dumps(dict(document, age=1.5)).encode()), "an integer has no fraction"
    assert dfa.fullmatch(b'{"name":"Ada","age":36}'), "properties not in required may be left out"
    assert not dfa.fullmatch(b'{"age":36}'), "a property in required must be written"


@pytest.mark.parametrize("schema, words", [
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
    ({"type": "object", "properties": {"a": {"$ref": "https://x.org/s"}}}, r"\$\.properties\.a"),
    ({"type": "object", "properties": {}, "required": ["a"], "additionalProperties": False}, "'a'"),
    ({"type": "date"}, "date"),
    ("{not json", "JSON"),
])
def test_unsupported_schemas_are_refused_by_name(json_regex, schema, words):
    with pytest.raises(ValueError, match=words):
        json_regex.compile_schema(schema)


# --- the token-level guide ---------------------------------------------------------------------

def synthetic_vocabulary(seed=0, size=300):
    """Whole characters, words, and the halves of multi-byte characters, plus b"" specials."""
    rng = random.Random(seed)
    pieces = ["a", "b", "c", "1", "2", "0", "-", '"', "{", "}", ":", ",", " ", "é", "€", "ab", "abc", "12",
              '{"', '":', '",', "true", "false", "null", "cat", "dog", "ca"]
    tokens = [bytes([b]) for b in range(256)] + [p.encode() for p in pieces]
    tokens += [b"\xe2\x82", b"\xac", b"\xc3", b"a\xc3"]        # partial UTF-8
    while len(tokens) < size - 2:
        tokens.append("".join(rng.choice("abc1 é€-") for _ in range(rng.randint(2, 5))).encode())
    return tokens + [b"", b""]                                  # EOS and one special: no bytes


# The only non-ASCII characters the mask patterns below can match: an unfinished character at
# the end of a token's bytes can be completed only to one of these.
NON_ASCII_IN_PATTERNS = "é€"


def partial_ok(pattern, data):
    """The oracle for a token's bytes after `data`: can the text still complete a match?"""
    try:
        return regex.fullmatch(pattern, data.decode("utf-8"), flags=regex.ASCII, partial=True) is not None
    except UnicodeDecodeError as exc:
        if exc.reason != "unexpected end of data":          # invalid UTF-8, not just unfinished
            return False
        head, tail = data[:exc.start].decode("utf-8"), data[exc.start:]
        return any(regex.fullmatch(pattern, head + ch, flags=regex.ASCII, partial=True) is not None
                   for ch in NON_ASCII_IN_PATTERNS if ch.encode("utf-8").startswith(tail))


@pytest.mark.parametrize("pattern", [r"(ab|c)+\d?", r"[a-c]{2,4}-[é€]+", r"cat|dog|ca€", r'\{"a":(true|null)\}'])
def test_the_mask_allows_exactly_the_tokens_that_keep_a_match_possible(guided, pattern):
    vocab = synthetic_vocabulary()
    eos = len(vocab) - 2
    factory = guided.GuideFactory(vocab, eos, len(vocab) + 3)
    guide = factory(params_for(guided, guided_regex=pattern))
    rng = random.Random(1)
    prefix = b""
    for _ in range(6):
        try:
            allowed = guide.allowed()
        except ValueError as error:
            pytest.fail(f"pattern {pattern!r} after {prefix!r}: allowed() refused to give a mask ({error}), yet "
                        f"some token should be allowed: every token whose bytes keep a match possible is allowed")
        assert allowed.dtype == torch.bool and allowed.shape == (len(vocab) + 3,)
        for token, data in enumerate(vocab):
            if token == eos or not data:
                continue
            expected = partial_ok(pattern, prefix + data)
            assert bool(allowed[token]) == expected, (
                f"pattern {pattern!r} after {prefix!r}: token {token} ({data!r}) should be "
                f"{'allowed' if expected else 'forbidden'}")
        complete = re.fullmatch(pattern, prefix.decode("utf-8", "replace"), re.ASCII) is not None
        assert bool(allowed[eos]) == complete, f"EOS after {prefix!r} must be allowed exactly on a complete match"
        assert not allowed[-4:-3].any() and not allowed[-3:].any(), "tokens without bytes are never allowed"
        choices = [t for t in torch.nonzero(allowed).flatten().tolist() if t != eos]
        if not choices:
            break
        token = rng.choice(choices)
        guide.advance(token)
        prefix += vocab[token]


def walk_lives(table, state, data):
    """The oracle of one token: its bytes read one at a time through the DFA's table."""
    for byte in data:
        state = int(table[state, byte])
        if state < 0:
            return False
    return True


@pytest.mark.parametrize("pattern", [r"a{0,24}b{0,3}", r"(ab|ba)*c?", r"[ab]{3,30}c"])
def test_each_states_mask_allows_exactly_the_tokens_whose_walk_lives(guided, pattern):
    """Every state of the DFA, against a walk of each token's bytes through the table, on a
    vocabulary whose tokens share prefixes, end inside other tokens, repeat, and include
    the longest ones a pattern allows."""
    import itertools
    vocab = [bytes(t) for n in range(1, 5) for t in itertools.product(b"abc", repeat=n)]
    vocab += [b"a" * 24, b"a" * 23 + b"b", b"ab" * 12, b"ba" * 12 + b"c", b"ab", b"c", b"\xff", b"a" * 30 + b"c"]
    vocab += [b"", b""]                                          # EOS and a special
    eos = len(vocab) - 2
    index = guided.GuideFactory(vocab, eos, len(vocab) + 2).index_for(pattern)
    table = index.dfa.transitions
    for state in range(index.dfa.num_states):
        allowed = index.compute_mask(state)
        assert allowed.dtype == torch.bool and allowed.shape == (len(vocab) + 2,)
        for token, data in enumerate(vocab[:eos]):
            expected = walk_lives(table, state, data)
            assert bool(allowed[token]) == expected, (
                f"pattern {pattern!r}, DFA state {state}: token {token} ({data!r}) should be "
                f"{'allowed' if expected else 'forbidden'}: its walk through the table "
                f"{'never meets -1' if expected else 'meets -1'}")
        assert bool(allowed[eos]) == bool(index.dfa.accepting[state]), (
            f"pattern {pattern!r}, DFA state {state}: EOS must be allowed exactly on a complete match")
        assert not allowed[eos + 1:].any(), "tokens without bytes (and ids past the list) are never allowed"


def params_for(guided, **fields):
    return guided.SamplingParams(max_tokens=8, **fields)


def test_advance_refuses_forbidden_tokens_and_eos_before_a_match(guided, impl):
    vocab = synthetic_vocabulary()
    eos = len(vocab) - 2
    guide = guided.GuideFactory(vocab, eos, len(vocab))(params_for(guided, guided_regex="ab+"))
    assert isinstance(guide, impl.load("serve.interfaces").Guide), "a guide implements interfaces.Guide"
    state = guide.state
    for bad, rule, words in ((ord("b"), "its bytes b'b' cannot start a match of 'ab+'", "98"),
                             (eos, "EOS before the text is a complete match", "EOS"),
                             (len(vocab) - 1, "a token with no bytes is never allowed", str(len(vocab) - 1))):
        try:
            guide.advance(bad)
        except ValueError as error:
            assert words in str(error), (
                f"advance({bad}) must raise a ValueError that names {words!r} (the contract), got: {error}")
        else:
            pytest.fail(f"advance({bad}) accepted token {bad} in the start state of 'ab+': {rule}, so it must "
                        f"raise ValueError")
        assert guide.state == state, "a refused token must leave the guide unchanged"
    guide.advance(ord("a"))
    guide.advance(vocab.index(b"b"))
    assert guide.allowed()[eos] and not guide.finished
    guide.advance(eos)
    assert guide.finished, "after EOS nothing may follow"
    with pytest.raises(ValueError):
        guide.advance(ord("b"))
        pytest.fail("advance accepted a token after EOS ended the guide: nothing may follow EOS")


def test_finished_once_no_byte_may_follow(guided):
    vocab = synthetic_vocabulary()
    guide = guided.GuideFactory(vocab, len(vocab) - 2, len(vocab))(params_for(guided, guided_regex="cat|ca€"))
    guide.advance(vocab.index(b"ca"))
    assert not guide.finished
    guide.advance(vocab.index(b"\xe2\x82"))        # half of the euro sign
    assert not guide.finished and not guide.allowed()[len(vocab) - 2]
    guide.advance(vocab.index(b"\xac"))
    assert guide.finished, "'ca€' is complete and nothing can follow it"


def test_masks_are_computed_once_per_pattern_and_vocabulary(guided):
    vocab = synthetic_vocabulary()
    factory = guided.GuideFactory(vocab, len(vocab) - 2, len(vocab))
    first = factory(params_for(guided, guided_json={"type": "boolean"}))
    second = factory(params_for(guided, guided_json={"type": "boolean"}))
    assert first.allowed() is second.allowed(), "two guides of one schema share the masks of their states"
    assert first.allowed()[vocab.index(b"true")] and not first.allowed()[vocab.index(b"null")]
    with pytest.raises(ValueError, match="bytes"):
        guided.GuideFactory([b"a", "b"], None, 4)
    with pytest.raises(ValueError, match="vocab"):
        guided.GuideFactory([b"a"] * 5, None, 4)


# --- the engine: guided and free requests in the same steps ------------------------------------

def guided_engine(serve, model, **config):
    engine = serve.engine.EngineCore(
        model, serve.config.EngineConfig(**{"block_size": 16, "num_blocks": 64, "sampler": "full", **config}),
        eos_token_id=TINY_EOS, vocab_bytes=byte_vocabulary(model.cfg.vocab_size))
    return engine


def drain(engine, limit=400):
    finished = {}
    for _ in range(limit):
        if not engine.has_unfinished:
            return finished
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    raise AssertionError("the engine did not finish its requests")


def text_of(tokens):
    return bytes(t for t in tokens if t < 256).decode("utf-8")


def test_guided_and_free_requests_share_steps(serve, tiny_model, ref_model):
    engine = guided_engine(serve, tiny_model)
    P = serve.request.SamplingParams
    free = [3, 14, 15, 92, 65]
    engine.add_request("free", free, P(max_tokens=12))
    pattern = r"(yes|no|maybe), [a-z]{2,5}\d?"
    engine.add_request("regex", [1, 2, 3], P(max_tokens=40, temperature=1.0, seed=5, guided_regex=pattern))
    # A finite language (at most ~75 bytes), so every draw completes within max_tokens.
    schema = {"type": "object", "properties": {"id": {"type": "string", "maxLength": 6}, "ok": {"type": "boolean"},
                                               "tag": {"enum": ["a", "b"]}}}
    engine.add_request("json", [4, 5], P(max_tokens=120, temperature=0.8, seed=1, guided_json=schema))
    engine.add_request("many", [7, 7], P(max_tokens=40, n=3, temperature=1.0, seed=9, guided_regex=pattern))
    outputs = drain(engine)
    assert outputs["free"].output_token_ids == solo(ref_model, free, 12), (
        "a free request must decode exactly as alone, whatever guided neighbours do to the batch")
    for rid in ("regex", "many:0", "many:1", "many:2", "json"):
        out = outputs[rid]
        assert out.error is None and out.finish_reason == "stop", f"{rid}: {out.finish_reason} {out.error}"
        text = text_of(out.output_token_ids)
        if rid != "json":
            assert re.fullmatch(pattern, text, re.ASCII), f"request {rid!r} wrote {text!r}, which {pattern!r} refuses"
    texts = {text_of(outputs[f"many:{i}"].output_token_ids) for i in range(3)}
    assert len(texts) > 1, "each of the n samples has its own seed and its own guide"
    document = json.loads(text_of(outputs["json"].output_token_ids))
    jsonschema.validate(document, schema)
    assert_engine_idle(engine)


def test_a_guide_ends_its_request_when_nothing_may_follow(serve, tiny_model):
    engine = guided_engine(serve, tiny_model)
    P = serve.request.SamplingParams
    engine.add_request("fixed", [1, 2], P(max_tokens=10, guided_regex="(true|false)"))
    out = drain(engine)["fixed"]
    assert text_of(out.output_token_ids) in ("true", "false") and out.stop_reason == "guided"
    assert TINY_EOS not in out.output_token_ids


def test_guided_requests_survive_preemption(serve, tiny_model):
    engine = guided_engine(serve, tiny_model, num_blocks=6, max_num_batched_tokens=64)
    P = serve.request.SamplingParams
    pattern = r"[a-f0-9]{20,40}"
    for i in range(4):
        engine.add_request(f"r{i}", [i + 1] * 9, P(max_tokens=45, temperature=1.0, seed=i, guided_regex=pattern))
    outputs = drain(engine)
    assert engine.preemptions > 0, "the small pool must have forced a preemption"
    for rid, out in outputs.items():
        text = text_of(out.output_token_ids)
        assert re.fullmatch(pattern, text), f"{rid} wrote {text!r} after preemption"
    assert_engine_idle(engine)


def test_guided_requests_are_refused_without_what_they_need(serve, tiny_model):
    P = serve.request.SamplingParams
    plain = make_engine(serve, tiny_model, num_blocks=16, sampler="full")
    with pytest.raises(ValueError, match="vocab_bytes"):
        plain.add_request("g", [1, 2], P(guided_regex="a+"))
    engine = guided_engine(serve, tiny_model)
    engine.add_request("busy", [1, 2, 3], P(max_tokens=4))
    before = (len(engine.scheduler.waiting), engine.blocks.num_free)
    for bad, words in ((P(guided_regex="(a"), "missing"), (P(guided_json={"type": "string", "format": "ipv6"}),
                                                         "format")):
        with pytest.raises(ValueError, match=words) as caught:
            engine.add_request("bad", [1, 2], bad)
        assert "'bad'" in str(caught.value), "the error must name the request"
        assert (len(engine.scheduler.waiting), engine.blocks.num_free) == before
    drain(engine)
    assert_engine_idle(engine)


def test_a_guide_that_fails_aborts_only_its_request(serve, tiny_model, ref_model):
    class FailingGuide:
        finished = False

        def allowed(self):
            return torch.ones(tiny_model.cfg.vocab_size, dtype=torch.bool)

        def advance(self, token_id):
            raise ValueError(f"token {token_id} broke the guide")

    engine = guided_engine(serve, tiny_model)
    P = serve.request.SamplingParams
    engine.add_request("fine", [3, 14, 15], P(max_tokens=6))
    broken = engine.add_request("broken", [1, 2], P(max_tokens=6, guided_regex="[a-z]+"))
    broken.guide = FailingGuide()
    outputs = drain(engine)
    assert outputs["broken"].finish_reason == "abort" and "advancing its guide" in outputs["broken"].error, (
        f"a guide that raises must abort its own request with the reason, got {outputs['broken'].error!r}")
    assert outputs["fine"].output_token_ids == solo(ref_model, [3, 14, 15], 6), "the other request goes on"
    assert_engine_idle(engine)


# --- the engine's random workloads, some requests guided --------------------------------------------

STRESS_WORKLOADS = 300


def pytest_generate_tests(metafunc):
    if "workload_seed" in metafunc.fixturenames:
        from test_engine_random_workloads import FAST_SEEDS
        stress = metafunc.config.getoption("stress")
        metafunc.parametrize("workload_seed", list(range(STRESS_WORKLOADS)) if stress else FAST_SEEDS[:6])


def test_random_workloads_with_guided_requests(serve, tiny_model, ref_model, workload_seed):
    """Chapter 31's random workloads (preemption in both modes, aborts, n > 1, priorities,
    chunking, small budgets) with some requests guided by a pattern: those spell it and end
    by their guide (oracle: Python's re), every other request still equals solo generate,
    and the engine ends idle-clean."""
    from test_engine_random_workloads import run_workload
    features, _ = run_workload(serve, tiny_model, ref_model, workload_seed, guided=True)
    assert features.get("guided"), "the workload guided no request: the test lost its point"


# --- the engine's state machine, with guided requests --------------------------------------------------

GUIDED = "[a-z]{3}"


def test_engine_state_machine_with_guided_requests(serve, tiny_model, request):
    """Chapter 31's engine state machine (scripted model, arrivals, aborts, preemption in both
    modes, chunking, prefix caching, every scheduler invariant checked each step) with one
    more rule: a request guided by three lowercase letters. The scripted model prefers other
    tokens, so only the guide's mask makes it spell the pattern (oracle: re), and it must end
    by its guide. With the simple sampler the guided request is refused and nothing changes."""
    import re

    import test_engine_state_machines as machines
    from hypothesis.stateful import precondition, rule, run_state_machine_as_test

    class GuidedMachine(machines.EngineMachine):
        def build_engine(self, config, **parts):
            vocab_bytes = byte_vocabulary(self.model.cfg.vocab_size)
            return self.serve.engine.EngineCore(self.model, self.serve.config.EngineConfig(**config),
                                                eos_token_id=None, vocab_bytes=vocab_bytes, **parts)

        @precondition(lambda self: self.ready and len(self.engine.scheduler.requests) < 8)
        @rule(prompt=machines.prompts, max_tokens=st.integers(4, 10))
        def add_guided(self, prompt, max_tokens):
            self.counter += 1
            rid, engine = f"g{self.counter}", self.engine
            tokens = machines.prompt_tokens(prompt)
            cfg, before = engine.config, machines.engine_state(engine)
            fits = len(tokens) + max_tokens <= cfg.num_blocks * cfg.block_size and (
                cfg.enable_chunked_prefill or len(tokens) <= cfg.max_num_batched_tokens)
            params = self.serve.request.SamplingParams(max_tokens=max_tokens, guided_regex=GUIDED)
            try:
                engine.add_request(rid, tokens, params, arrival_time=float(self.counter))
            except ValueError as exc:
                self.log.append(f"add guided {rid} rejected: {exc}")
                assert machines.engine_state(engine) == before, f"rejecting {rid} changed the engine"
                assert cfg.sampler != "full" or not fits, f"guided {rid} fits, yet was rejected: {exc}"
                return
            assert cfg.sampler == "full" and fits, f"guided {rid} was accepted by {cfg}"
            self.log.append(f"add guided {rid}: {tokens} max_tokens={max_tokens}")

        def check_output(self, request, out):
            if request.guide is None:
                return super().check_output(request, out)
            text = bytes(out.output_token_ids).decode("latin-1")
            assert re.fullmatch("[a-z]{1,3}", text), f"{self.where()}: guided {out.request_id} spelled {text!r}"
            if out.finished:
                assert re.fullmatch(GUIDED, text) and out.stop_reason == "guided", (
                    f"{self.where()}: guided {out.request_id} ended with {text!r} by {out.stop_reason!r}")

    GuidedMachine.serve, GuidedMachine.model = serve, tiny_model
    run_state_machine_as_test(GuidedMachine, settings=machines.machine_settings(
        request, 40, 40, stress_examples=1000, stress_steps=80))


# --- json_object through the factory: Chapter 35's pushdown guide (json_pda.py; its own
# milestone, tests/test_ch35_json_pda.py, checks the recogniser and the masks) ----------------

DOCUMENTS = [{}, {"a": [1, {"b": "[x]{"}], "c": None}, {"x": [[[]], {}], "y": "é\"\\", "z": -1.5e3},
             {"deep": [[[[{"k": [True, False]}]]]]}]


def test_the_stack_guide_writes_only_json_objects(guided):
    vocab = synthetic_vocabulary() + [b"[{", b"}]", b"]}", b'"}', b"[]", b'":[', b", "]
    eos = len(vocab)
    vocab.append(b"")
    factory = guided.GuideFactory(vocab, eos, len(vocab))
    rng = random.Random(3)
    complete = 0
    for _ in range(60):
        guide = factory(params_for(guided, guided_json={"type": "json_object"}))
        text = b""
        for _ in range(200):
            choices = torch.nonzero(guide.allowed()).flatten().tolist()
            assert choices, f"after {text!r} the guide allows nothing: a JSON object can always go on or end"
            closing = [t for t in choices if t == eos or vocab[t][-1:] in (b"]", b"}", b'"')]
            token = rng.choice(closing if closing and rng.random() < 0.6 else choices)
            guide.advance(token)
            if token == eos:
                break
            text += vocab[token]
            if guide.finished:
                break
        if guide.finished:
            complete += 1
            assert isinstance(json.loads(text), dict), f"the json_object guide wrote {text!r}, not a JSON object"
    assert complete >= 30, f"only {complete} of 60 random walks closed their object within 200 tokens"
    for document in DOCUMENTS:
        guide = factory(params_for(guided, guided_json={"type": "json_object"}))
        for byte in json.dumps(document).encode():
            guide.advance(byte)
        assert guide.finished, f"{json.dumps(document)} is one complete object: its last byte ends the guide"


def test_the_stack_guide_refuses_by_rule(guided, impl):
    vocab = [bytes([i]) for i in range(256)] + [b""]
    eos = 256
    factory = guided.GuideFactory(vocab, eos, len(vocab))
    guide = factory(params_for(guided, guided_json={"type": "json_object"}))
    max_depth = guide.index.max_depth
    for byte in b'{"a":' + b"[" * (max_depth - 1):
        guide.advance(byte)
    assert not guide.allowed()[ord("[")], f"{max_depth} containers are open: max_depth allows no more"
    with pytest.raises(ValueError, match=str(ord("["))):
        guide.advance(ord("["))
        pytest.fail(f"advance accepted a container past max_depth={max_depth}")
    with pytest.raises(ValueError, match="EOS"):
        guide.advance(eos)
        pytest.fail("advance accepted EOS inside open containers: EOS needs one complete JSON value")
    assert guide.allowed()[ord("1")] and guide.allowed()[ord("]")] and not guide.allowed()[ord("}")]


def test_json_object_requests_share_steps_with_free_ones(serve, tiny_model, ref_model, impl):
    engine = guided_engine(serve, tiny_model)
    P = serve.request.SamplingParams
    engine.add_request("free", [3, 14, 15, 92], P(max_tokens=10))
    for i in range(3):
        engine.add_request(f"json{i}", [1, 2, 3 + i], P(max_tokens=150, temperature=1.0, seed=i,
                                                        guided_json={"type": "json_object"}))
    outputs = drain(engine)
    assert outputs["free"].output_token_ids == solo(ref_model, [3, 14, 15, 92], 10)
    for i in range(3):
        out = outputs[f"json{i}"]
        assert out.finish_reason == "stop" and out.stop_reason == "guided", f"json{i}: {out.finish_reason} {out.error}"
        text = text_of(out.output_token_ids)
        assert isinstance(json.loads(text), dict), f"a json_object request wrote {text!r}, not one JSON object"
    guide = impl.load("serve.guided").GuideFactory(byte_vocabulary(tiny_model.cfg.vocab_size), TINY_EOS,
                                                   tiny_model.cfg.vocab_size)(P(guided_json={"type": "json_object"}))
    assert isinstance(guide, impl.load("serve.interfaces").Guide), "the stack guide implements interfaces.Guide"
    assert_engine_idle(engine)
