"""EngineConfig.compile_decode (Chapter 33, given code): the padded decode step compiled with
torch.compile per bucket, attention outside the graph as opaque operators.

Oracles: the same implementation's eager, unpadded engine (cuda_graphs="off") for greedy
tokens, and the eager static path's forward on the same buffers for logits. The parity test
compiles one or two buckets with inductor (seconds), so it runs only under --stress (and in
.ci/gpu-checks on CUDA, with and without graphs).
"""
import pytest
import torch

pytestmark = pytest.mark.chapter(33)

EOS = 257


def test_compile_decode_needs_the_padded_path(serve):
    with pytest.raises(ValueError, match=r"compile_decode.*cuda_graphs='off'"):
        serve.config.EngineConfig(compile_decode=True)
    with pytest.raises(ValueError, match="compile_decode must be True or False"):
        serve.config.EngineConfig(compile_decode=1, cuda_graphs="static")
    config = serve.config.EngineConfig(compile_decode=True, cuda_graphs="static")
    config.cuda_graphs = "off"
    with pytest.raises(ValueError, match="cuda_graphs"):
        config.validate()
    assert serve.config.EngineConfig().compile_decode is False


def outputs(serve, model, prompts, backend="vectorised", **config):
    engine = serve.engine.EngineCore(model, serve.config.EngineConfig(
        block_size=16, num_blocks=64, max_num_seqs=4, attention_backend=backend, **config), eos_token_id=EOS)
    params = [serve.request.SamplingParams(max_tokens=12) for _ in prompts]
    return engine, [out.output_token_ids for out in engine.generate(prompts, params)]


def test_compiled_decode_matches_eager(serve, tiny_model, request):
    if not request.config.getoption("stress"):
        pytest.skip("compiles buckets with inductor (seconds): runs under --stress")
    prompts = [[(5 * i + j) % 256 for j in range(n)] for i, n in enumerate((3, 21, 40))]
    _, want = outputs(serve, tiny_model, prompts)
    modes = ["static"] + (["on"] if next(tiny_model.parameters()).is_cuda else [])
    for mode in modes:
        if mode == "on":
            engine, got = outputs(serve, tiny_model, prompts, "triton", cuda_graphs="on", compile_decode=True)
        else:
            engine, got = outputs(serve, tiny_model, prompts, cuda_graphs=mode, compile_decode=True)
        g = engine.runner.graphs
        assert got == want, f"compiled decode (cuda_graphs={mode!r}) changed greedy tokens"
        assert g.compiled is not None and g.compiled.compile_seconds, "no step went through the compiled forward"
        assert g.runs["eager"] + g.runs["replayed"] > 0
        # Logits of one bucket: compiled forward vs the eager forward on the same static buffers.
        size = min(g.compiled.compile_seconds)
        g.input_ids[:size].copy_(torch.arange(size) + 7)
        g.positions[:size].copy_(torch.arange(size) + 3)
        g.seq_lens[:size].copy_(g.positions[:size] + 1)
        g.slot_mapping[:size].fill_(-1)
        with torch.inference_mode():
            meta = g.static_meta(size, (g.positions[:size] + 1).tolist())
            _, compiled = g.forward(size, meta)
            compiled = compiled.clone()
            keep, g.compiled = g.compiled, None
            _, eager = g.forward(size, meta)
            g.compiled = keep
        torch.testing.assert_close(compiled.float(), eager.float(), rtol=1e-4, atol=1e-4)
