"""The HTTP server against bodies no honest client sends (Chapter 38's server, issue: the
server survives anything a client sends).

A Hypothesis property: bodies drawn field by field from values that are right, wrong in
type, out of range, huge, nested or not text at all, plus raw bytes cut or flipped from a
good body, are posted to a server running in this process. Every answer is a 200 (a good
body) or a 4xx carrying OpenAI's error object; never a 5xx, never a dropped connection.
Afterwards the engine loop is alive and the engine idle with every KV block free. The
default run draws FAST_EXAMPLES bodies; --stress draws STRESS_EXAMPLES.
"""
import json
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from course.models import tiny_qwen3
from course.testing.oracles import unwritten_server_stubs

pytestmark = pytest.mark.chapter(38)

MODEL = "tiny"
FAST_EXAMPLES = 80
STRESS_EXAMPLES = 3000

# Any JSON value, a little nested: what a confused or hostile client puts in a field.
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70) | st.floats(allow_nan=False)
    | st.text(max_size=12) | st.sampled_from(["\ud800", "²", "<|im_end|>", "", " " * 3]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8)

small_ints = st.integers(-2, 6)
# Each field: mostly values a client would send, sometimes anything at all.
FIELDS = {
    "model": st.sampled_from([MODEL, MODEL, "gpt-4o", ""]),
    "prompt": st.one_of(st.text(max_size=20), st.lists(st.integers(-1, 400), max_size=6),
                        st.lists(st.text(max_size=4), max_size=2)),
    "max_tokens": st.integers(-1, 4),
    "n": st.integers(0, 3),
    "temperature": st.floats(-1, 3, allow_nan=False),
    "top_p": st.floats(-0.5, 1.5, allow_nan=False),
    "top_k": st.integers(-2, 400),
    "min_p": st.floats(-0.5, 1.5, allow_nan=False),
    "typical_p": st.floats(-0.5, 1.5, allow_nan=False),
    "seed": st.integers(-1, 2 ** 65),
    "stop": st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=5)),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "stop_token_ids": st.lists(st.integers(-1, 400), max_size=3),
    "ignore_eos": st.booleans(),
    "return_token_ids": st.booleans(),
    "logprobs": st.one_of(small_ints, st.booleans()),
    "top_logprobs": small_ints,
    "presence_penalty": st.floats(-3, 3, allow_nan=False),
    "logit_bias": st.dictionaries(st.sampled_from(["1", "65", "999", "x", "²", "-3", "9" * 30]),
                                  st.floats(-150, 150, allow_nan=False), max_size=3),
    "echo": st.booleans(),
    "max_token": small_ints,
}
# A guide is a field of its own kind: a compiler meets whatever the client wrote.
schemas = st.sampled_from([{"type": "boolean"}, {"type": {}}, {"type": [{}]}, {"enum": ["x"]}, {"type": "null"},
                           {"type": "object", "properties": {}, "required": 5},
                           {"type": "object", "properties": {"a": {"type": "null"}}, "required": [["a"]]}])
GUIDES = {
    "guided_regex": st.one_of(st.sampled_from(["[a-z]{2}", "(unclosed", "(" * 300 + "a" + ")" * 300,
                                               "(?:" * 300 + "a" + ")" * 300, "a{2,1}", "[z-a]"]),
                              st.text(max_size=8)),
    "guided_json": st.one_of(schemas, json_values),
    "response_format": st.one_of(schemas.map(lambda schema: {"type": "json_schema",
                                                             "json_schema": {"name": "x", "schema": schema}}),
                                 st.sampled_from([{"type": "text"}, {"type": "json_object"}]), json_values),
}
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "robot", 5]),
                                           "content": st.one_of(st.text(max_size=12), json_values)}),
                    max_size=3)


@st.composite
def bodies(draw):
    """(route, raw bytes) of one request."""
    chat = draw(st.booleans())
    body = {"model": MODEL, "max_tokens": 2, "temperature": 0}
    body["messages" if chat else "prompt"] = [{"role": "user", "content": "hi"}] if chat else "hi"
    # One thing changed at a time: two bad fields would hide each other behind the first 400.
    name = draw(st.sampled_from(sorted(FIELDS) + sorted(GUIDES) * 3 + ["messages"]))
    if name == "messages":
        body["messages" if chat else "prompt"] = draw(messages)
    else:
        values = GUIDES[name] if name in GUIDES else FIELDS[name]
        body[name] = draw(st.one_of(values, json_values) if draw(st.booleans()) else values)
    raw = json.dumps(body).encode()
    mutation = draw(st.sampled_from(["none"] * 6 + ["cut", "flip", "nest"]))
    if mutation == "cut":
        raw = raw[:draw(st.integers(0, len(raw)))]
    elif mutation == "flip":
        at = draw(st.integers(0, len(raw) - 1))
        raw = raw[:at] + bytes([draw(st.integers(0, 255))]) + raw[at + 1:]
    elif mutation == "nest":
        depth = draw(st.integers(30, 3000))
        raw = raw[:-1] + b', "user": ' + b"[" * depth + b"]" * depth + b"}"
    return ("/v1/chat/completions" if chat else "/v1/completions"), raw


@pytest.fixture(scope="module")
def served(impl, device):
    missing = unwritten_server_stubs(impl)
    if missing:
        pytest.skip(f"needs {', '.join(missing)} (Chapter 38), not implemented yet")
    text, app_module = impl.load("server.text"), impl.load("server.app")
    model = tiny_qwen3(impl.package, device=device)
    tokenizer = text.ByteChatTokenizer(impl.tokenizer.ByteTokenizer(model.cfg.vocab_size))
    config = impl.load("serve.config").EngineConfig(block_size=16, num_blocks=64, max_num_seqs=4, sampler="full")
    engine = impl.load("serve.engine").EngineCore(model, config, eos_token_id=tokenizer.eos_token_id,
                                                  vocab_bytes=impl.load("serve.guided").token_bytes_of(tokenizer))
    served_model = app_module.ServedModel(MODEL, tokenizer, lambda: text.DiffDetokenizer(tokenizer))
    app = app_module.build_app(engine, served_model, limits=impl.load("server.protocol").Limits(max_output_tokens=4))
    with app_module.serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=30) as client:
        yield client, engine, app.state.server.loop


def test_no_body_gets_a_5xx_or_stops_the_engine_loop(served, request):
    client, engine, loop = served
    examples = STRESS_EXAMPLES if request.config.getoption("stress") else FAST_EXAMPLES

    @settings(max_examples=examples, deadline=None, database=None, derandomize=not request.config.getoption("stress"),
              suppress_health_check=list(HealthCheck))
    @given(bodies())
    def answered(case):
        route, raw = case
        r = client.post(route, content=raw, headers={"content-type": "application/json"})
        assert r.status_code < 500, f"a body must never get a 5xx: {r.status_code} {r.text[:300]} for {raw[:300]!r}"
        if r.status_code != 200:
            error = r.json().get("error")
            assert isinstance(error, dict) and error.get("message") and "param" in error, \
                f"a refused body gets OpenAI's error object, got {r.text[:300]}"
        elif r.headers["content-type"].startswith("text/event-stream"):
            assert "server_error" not in r.text, f"a stream must not end in a server error: {r.text[-300:]}"
        assert loop.alive, f"the engine loop stopped ({loop.error!r}) after {raw[:300]!r}"

    answered()
    deadline = time.monotonic() + 5
    while (engine.has_unfinished or engine.blocks.num_free != engine.blocks.num_blocks) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not engine.has_unfinished and engine.blocks.num_free == engine.blocks.num_blocks, \
        f"after the fuzzing the engine must be idle with every block free: {engine.blocks.num_free} of " \
        f"{engine.blocks.num_blocks} free"
