"""Chapter 3 milestone: the byte tokenizer, the embedding lookup and the LM head.

Oracles: Python's own UTF-8 codec (round trips on text in many scripts), torch.nn.Embedding
and torch.nn.functional.linear.
"""
import pytest
import torch
from torch import nn
from torch.nn import functional as F

pytestmark = pytest.mark.chapter(3)

TEXTS = [
    "",
    "hello, world",
    "naïve café — déjà vu",
    "日本語のテキスト",
    "Привет, мир",
    "emoji: 👩‍🚀🚀 and flags 🇯🇵",
    "e\u0301 (a combining accent) and \x00 a NUL byte\nnew line\ttab",
    "<|eos|> written by a user is text, not a token",
]


@pytest.fixture(scope="module")
def tok(impl):
    return impl.tokenizer.ByteTokenizer()


def test_special_ids(tok):
    assert tok.vocab_size == 320, f"the tiny model's vocabulary has 320 ids; ByteTokenizer says {tok.vocab_size}"
    assert (tok.bos_token_id, tok.eos_token_id) == (256, 257), (
        f"<|bos|> is 256 and <|eos|> 257, right after the 256 byte values (the tiny config's bos/eos); "
        f"got {tok.bos_token_id}, {tok.eos_token_id}")
    assert tok.encode("A", add_bos=True) == [256, 65], "encode('A', add_bos=True) is [<|bos|>, 65]"
    assert tok.decode([256, 257], skip_special=False) == "<|bos|><|eos|>", "specials decode to their names on request"


@pytest.mark.parametrize("text", TEXTS)
def test_encode_is_utf8_bytes(tok, text):
    got = tok.encode(text)
    expected = list(text.encode("utf-8"))
    assert got == expected, (f"encode({text!r}) should give its UTF-8 bytes {expected}, and no <|bos|> unless "
                             f"add_bos; got {got}")
    assert all(isinstance(t, int) for t in got), "encode returns a list of Python ints"
    with_bos = tok.encode(text, add_bos=True)
    assert with_bos == [256] + expected, f"encode({text!r}, add_bos=True) should start with 256, got {with_bos[:4]}..."


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok, text):
    ids = tok.encode(text, add_bos=True)
    back = tok.decode(ids)
    assert back == text, f"decode(encode({text!r}, add_bos=True)) gave {back!r}"
    assert tok.decode(torch.tensor(ids)) == text, "decode must accept a 1-D tensor of ids too"


def test_decode_specials(tok):
    ids = [256] + tok.encode("hi") + [257]
    assert tok.decode(ids) == "hi", f"special ids are skipped by default; got {tok.decode(ids)!r}"
    shown = tok.decode(ids, skip_special=False)
    assert shown == "<|bos|>hi<|eos|>", f"with skip_special=False specials appear by name; got {shown!r}"
    assert tok.decode(list("é".encode()) + [257] + list("ß".encode())) == "éß"
    # A skipped special is as if it were absent: the two bytes of "é" on either side of it
    # join again. Shown by name, it splits the character, and each half is invalid UTF-8.
    split = [0xC3, 257, 0xA9]
    assert tok.decode(split) == "é", f"skipping a special must join the bytes around it; got {tok.decode(split)!r}"
    shown = tok.decode(split, skip_special=False)
    assert shown == "\ufffd<|eos|>\ufffd", f"a named special splits the bytes around it; got {shown!r}"
    for bad in (-1, 320, 100_000):
        try:
            tok.decode([104, bad])
        except ValueError:
            continue
        pytest.fail(f"decode([104, {bad}]): an id outside the vocabulary 0..319 must raise ValueError")


def test_decode_broken_utf8_is_replaced_not_raised(tok):
    data = "🚀!".encode()
    for cut in range(1, 4):                       # cut the 4-byte rocket short
        ids = list(data[:cut]) + list(data[4:])
        got = tok.decode(ids)
        expected = bytes(ids).decode("utf-8", errors="replace")
        assert got == expected, f"bytes {ids} are not valid UTF-8: expected {expected!r}, got {got!r}"


def test_decode_all_at_once_not_per_token(tok):
    ids = tok.encode("Grüße")
    got = tok.decode(ids)
    assert got == "Grüße", (f"decoding id by id breaks characters made of several bytes: got {got!r}; "
                            "collect the bytes, then decode them together")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_embed_matches_nn_embedding(impl, device, dtype):
    generator = torch.Generator().manual_seed(3)
    table = torch.randn(320, 24, generator=generator).to(device=device, dtype=dtype)
    oracle = nn.Embedding(320, 24, device=device, dtype=dtype)
    oracle.weight.data.copy_(table)
    for shape in [(7,), (2, 5), (3, 1, 4)]:
        ids = torch.randint(0, 320, shape, generator=generator).to(device)
        got = impl.tokenizer.embed(ids, table)
        expected = oracle(ids)
        assert got.shape == expected.shape and got.dtype == dtype, (
            f"embed(ids {tuple(shape)}, table [320, 24] {dtype}) should be {tuple(expected.shape)} in {dtype}; "
            f"got {tuple(got.shape)} in {got.dtype}")
        assert torch.equal(got, expected), f"embed differs from torch.nn.Embedding for ids of shape {tuple(shape)}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lm_logits_match_linear(impl, device, dtype):
    generator = torch.Generator().manual_seed(4)
    weight = torch.randn(320, 24, generator=generator).to(device=device, dtype=dtype)
    hidden = torch.randn(2, 6, 24, generator=generator).to(device=device, dtype=dtype)
    got = impl.tokenizer.lm_logits(hidden, weight)
    expected = F.linear(hidden, weight).float()
    assert got.shape == (2, 6, 320), f"lm_logits([2, 6, 24], [320, 24]) should be [2, 6, 320], got {tuple(got.shape)}"
    assert got.dtype == torch.float32, f"logits come back in float32 whatever the input dtype; got {got.dtype}"
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    err = (got - expected).abs().max().item()
    assert err <= tol * max(1.0, expected.abs().max().item()), f"lm_logits differ from F.linear by {err:.3g}"


def test_tied_weights_in_the_tiny_model(impl, device):
    """With tied weights, the LM head scores a hidden state against every embedding row."""
    from course.models import tiny_qwen3
    model = tiny_qwen3(impl.package, device=device, tie_word_embeddings=True)
    table = model.model.embed_tokens.weight
    assert model.lm_head.weight is table, "a tied model's lm_head.weight is the embedding table itself"
    ids = torch.tensor([[65, 66, 256, 257]], device=device)
    rows = impl.tokenizer.embed(ids, table)
    logits = impl.tokenizer.lm_logits(rows, model.lm_head.weight)
    expected = F.linear(F.embedding(ids, table), table).float()
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-4)
    own = logits[0].gather(-1, ids[0, :, None])[:, 0]
    norms = table[ids[0]].float().pow(2).sum(-1)
    torch.testing.assert_close(own, norms, rtol=1e-5, atol=1e-3,
                               msg="a token's own logit, scoring its embedding against itself, is its squared norm")
