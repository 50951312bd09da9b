"""Chapter 32: the engine in bfloat16 (EngineConfig.dtype), held to transformers in bfloat16.

Rounding in a 16-bit format parts two greedy paths wherever the two best logits are closer
than the format's step, so equality is not the rule here. The rule: wherever the engine's
tokens first leave transformers', transformers' own logits there ranked the two tokens
within a few bfloat16 steps of each other (a near tie), and every weight and pool tensor
is really bfloat16. A wrong RoPE, a norm computed in 16 bits or a pool read at the wrong
slot parts the paths at a wide margin.
"""
import copy
import json
import random
from types import SimpleNamespace

import pytest
import torch

from course import bench

pytestmark = pytest.mark.chapter(32)


def item(request_id, prompt_ids):
    return SimpleNamespace(request_id=request_id, prompt_ids=prompt_ids)


def bf16_steps(logits: torch.Tensor, steps: int) -> float:
    """`steps` spacings of bfloat16 numbers at the size of the largest logit."""
    top = float(logits.abs().max())
    exponent = torch.frexp(torch.tensor(top)).exponent.item()
    return steps * 2.0 ** (exponent - 8)           # bfloat16 keeps 8 significant bits


def test_engine_in_bfloat16_follows_transformers_in_bfloat16(serve, tiny_model):
    theirs = bench.transformers_model(tiny_model).to(torch.bfloat16)
    config = serve.config.EngineConfig(num_blocks=64, attention_backend="vectorised", dtype="bfloat16")
    engine = serve.engine.EngineCore(tiny_model, config, eos_token_id=None)
    tensors = list(tiny_model.parameters()) + [t for layer in engine.runner.kv_caches for t in layer]
    assert all(t.dtype == torch.bfloat16 for t in tensors), \
        "EngineConfig(dtype='bfloat16') must leave every weight and pool tensor in bfloat16"
    rng = random.Random(7)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(5, 40))] for _ in range(6)]
    results = engine.generate(prompts, [serve.request.SamplingParams(max_tokens=12) for _ in prompts])
    items = [item(f"r{i}", p) for i, p in enumerate(prompts)]
    mine = {it.request_id: out.output_token_ids for it, out in zip(items, results)}
    want = {}
    with torch.inference_mode():
        for it in items:
            out = theirs.generate(torch.tensor([it.prompt_ids]), do_sample=False, max_new_tokens=12,
                                  eos_token_id=None, pad_token_id=0)
            want[it.request_id] = out[0, len(it.prompt_ids):].tolist()
    logits_of = bench.next_token_logits(theirs)
    held = bench.agreement(mine, want, items, logits_of)
    assert held["tokens_in_common_prefix"] > 0, f"the engine left transformers at the first token: {held}"
    if held["widest_divergence_margin"] is not None:
        rid, _, position = held["widest_divergence_at"].split()
        where = next(it for it in items if it.request_id == rid)
        logits = logits_of(where.prompt_ids + want[rid][:int(position)])
        bound = bf16_steps(logits, 4)
        assert held["widest_divergence_margin"] <= bound, (
            f"the engine in bfloat16 left transformers' greedy path where transformers preferred its token by "
            f"{held['widest_divergence_margin']} (more than 4 bfloat16 steps, {bound}): not a rounding tie: {held}")


def test_agreement_reports_the_margin_of_a_first_divergence():
    items = [item("a", [1, 2]), item("b", [3])]
    logits = torch.zeros(8)
    logits[5], logits[6] = 2.0, 1.5
    held = bench.agreement({"a": [4, 6, 1], "b": [7, 7]}, {"a": [4, 5, 1], "b": [7, 7]}, items, lambda _: logits)
    assert held["identical_requests"] == "1 of 2" and held["first_divergences"] == 1
    assert held["tokens_in_common_prefix"] == 0.6, "3 of 5 reference tokens precede the first divergence"
    assert held["widest_divergence_margin"] == 0.5 and held["widest_divergence_at"] == "a token 1", held


def test_engine_config_refuses_an_unknown_dtype(serve):
    with pytest.raises(ValueError, match="dtype"):
        serve.config.EngineConfig(dtype="bf16")


def test_run_py_bench_in_bfloat16_reports_agreement(impl, device, capsys):
    from course import cli
    status = cli.main(["bench", "--impl", impl.spec.text, "--device", str(device), "--workloads", "seed:vocab=320",
                       "--scale", "0.15", "--repeat", "1", "--dtype", "bfloat16", "--quiet"])
    out, err = capsys.readouterr()
    assert status == 0, f"run.py bench --dtype bfloat16 failed:\n{out}{err}"
    lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    core = next(line for line in lines if line.get("contender") == "core/vectorised")
    assert core["agreement_with"].startswith("hf") and "widest_divergence_margin" in core["agreement"], core
    summary = next(line for line in lines if "vectorised_vs_ch24" in line)
    assert "widest_divergence_margin" in summary and "outputs_identical" not in summary, summary


def test_bench_threads_option_makes_one_labelled_plan_per_count():
    from course.cli import CommandError
    from course.commands import bench as command
    assert command._thread_counts("1,2") == [1, 2] and command._thread_counts(None) == []
    for wrong in ("0", "two", ","):
        with pytest.raises(CommandError, match="--threads"):
            command._thread_counts(wrong)
    workload = bench.Workload("seed", [], {})
    workload.model = "the same weights"
    twin = bench.with_threads(workload, 2, label=True)
    assert (twin.name, twin.threads, twin.model) == ("seed threads=2", 2, "the same weights"), \
        "each thread count keeps its own lines (its name) and the workload's model"
    assert bench.with_threads(workload, 1, label=False).name == "seed"


def test_roofline_share_counts_two_flops_per_weight_per_token_and_one_weight_read_per_step(tiny_model):
    weights = bench.matmul_weights(tiny_model)
    linears = [m for m in tiny_model.modules() if isinstance(m, torch.nn.Linear)]
    assert weights == sum(m.weight.numel() for m in linears) and tiny_model.lm_head in linears
    workload = bench.Workload("w", [item("a", [1] * 30), item("b", [2] * 10)], {}, model=tiny_model)
    line = {"dtype": "float32", "requests": 2, "output_tokens": 60, "seconds": 2.0, "steps": 25}
    share = bench.roofline_share(line, workload, {"matmul_tflops": {"float32": 1e-6}, "memory_gb_s": 1e-3})
    assert share["of_matmul_peak"] == round(2 * weights * 100 / 2.0 / 1e6, 3), share
    assert share["of_memory_bandwidth"] == round(25 * weights * 4 / 2.0 / 1e6, 3), share
    limits = bench.machine_limits(torch.device("cpu"), [torch.float32], size=64, rounds=1)
    assert limits["matmul_tflops"]["float32"] > 0 and limits["memory_gb_s"] > 0, limits


def test_run_py_core_in_bfloat16_runs_every_engine_on_bfloat16_weights(impl, device, capsys):
    from course import cli
    status = cli.main(["core", "--impl", impl.spec.text, "--device", str(device), "--requests", "3",
                       "--vocab-size", "320", "--repeat", "1", "--dtype", "bfloat16", "--backend", "vectorised"])
    out, err = capsys.readouterr()
    assert status == 0, f"run.py core --dtype bfloat16 failed (a near-tie difference is reported, not an error):\n" \
                        f"{out}{err}"
    lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    summary = next(line for line in lines if "outputs_identical" in line)
    assert summary["dtype"] == "bfloat16", summary
    assert all(line["tok_s"] > 0 for line in lines if "engine" in line), out


class AttentionQueryDtypes(torch.overrides.TorchFunctionMode):
    """Records the query dtype of every scaled_dot_product_attention call made inside it."""

    def __init__(self):
        super().__init__()
        self.dtypes = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.nn.functional.scaled_dot_product_attention:
            self.dtypes.append(args[0].dtype)
        return func(*args, **(kwargs or {}))


def test_vectorised_backend_attends_bfloat16_queries_in_float32_on_a_cpu(serve):
    """On a CPU torch's bfloat16 scaled_dot_product_attention is several times slower than its
    float32 one at decode shapes, so the backend widens the gathered keys and values and the
    queries to float32 for the call, and returns the rows in the queries' dtype."""
    requests = [serve.request.Request(f"r{i}", list(range(3 + 4 * i))) for i in range(3)]
    tables = {"r0": [0], "r1": [1, 2], "r2": [3, 4, 5]}
    batch = serve.batch.build_batch([(r, len(r.token_ids)) for r in requests], tables, 4, "cpu")
    generator = torch.Generator().manual_seed(0)
    rows = batch.input_ids.shape[0]
    q, k, v = (torch.randn(rows, heads, 8, generator=generator).to(torch.bfloat16) for heads in (4, 2, 2))
    outputs = {}
    for name in ("vectorised", "reference"):
        backend = serve.backends.get_backend(name)
        pools = backend.allocate((7, 4, 2, 8), torch.bfloat16, "cpu")
        backend.write(pools, k, v, batch.meta)
        with AttentionQueryDtypes() as seen:
            outputs[name] = backend.forward(q, pools, batch.meta)
        if name == "vectorised":
            assert seen.dtypes and set(seen.dtypes) == {torch.float32}, (
                f"on a CPU the vectorised backend attends bfloat16 queries in float32; its attention calls "
                f"got {seen.dtypes}")
    assert outputs["vectorised"].dtype == torch.bfloat16, "the backend returns rows in the queries' dtype"
    torch.testing.assert_close(outputs["vectorised"].float(), outputs["reference"].float(), atol=1e-2, rtol=1e-2)


def test_bfloat16_linears_on_a_cpu_run_on_weights_packed_once_and_match_plain_linear(impl, serve, tiny_model):
    """On a CPU the engine lays each bfloat16 linear weight out for oneDNN once, when it loads
    the model (devices.prepack_linears), instead of on every call. The packed path must give
    what torch's own F.linear gives on the module's weight, bit for bit, for any number of
    rows, must follow a weight changed in place after packing and survive a deep copy."""
    if tiny_model.lm_head.weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        pytest.skip("weights are packed for oneDNN on a CPU only")
    config = serve.config.EngineConfig(num_blocks=64, attention_backend="vectorised", dtype="bfloat16")
    engine = serve.engine.EngineCore(tiny_model, config, eos_token_id=None)
    linears = [m for m in tiny_model.modules() if type(m) is torch.nn.Linear]
    packed = [m for m in linears if isinstance(vars(m).get("forward"), impl.devices.PackedLinear)]
    assert linears and packed == linears, f"{len(packed)} of {len(linears)} bfloat16 linears were packed"
    generator = torch.Generator().manual_seed(3)
    with torch.inference_mode():
        for module in (linears[0], tiny_model.lm_head):
            for rows in (1, 7, 64):
                x = torch.randn(rows, module.in_features, generator=generator).to(torch.bfloat16)
                assert torch.equal(module(x), torch.nn.functional.linear(x, module.weight, module.bias)), \
                    f"the packed linear must equal F.linear on {rows} rows"
        module.weight.mul_(-2)                     # changed in place after packing: packed again
        assert torch.equal(module(x), torch.nn.functional.linear(x, module.weight, module.bias)), \
            "a weight changed in place after packing must be packed again before use"
        module.weight.div_(-2)
        twin = copy.deepcopy(tiny_model).lm_head    # the packed copy is opaque: copies must pack their own
        assert twin.weight.data_ptr() != module.weight.data_ptr() and torch.equal(
            twin(x), torch.nn.functional.linear(x, twin.weight, twin.bias)), "a deep copy of a packed model must work"
    prompts = [[5, 9, 14, 200, 31], list(range(40, 75))]
    params = [serve.request.SamplingParams(max_tokens=8) for _ in prompts]
    packed_tokens = [out.output_token_ids for out in engine.generate(prompts, params)]
    for m in linears:
        del m.forward                              # back to nn.Linear's own forward
    unpacked = serve.engine.EngineCore(tiny_model, config, eos_token_id=None)
    for m in linears:
        del m.forward
    plain_tokens = [out.output_token_ids for out in unpacked.generate(prompts, params)]
    assert packed_tokens == plain_tokens, "greedy tokens must not change when the weights are packed"


def test_float32_linears_on_a_cpu_are_packed_and_used_for_large_calls_within_float32_error(impl, serve, tiny_model):
    """A float32 engine on a CPU packs its linears too (devices.prepack_linears) but sends a
    call to the packed weight only from devices.PACKED_FLOAT32_MIN_WORK multiply-adds (rows x
    in_features x out_features), F.linear below it. Either way the result must be within
    float32 rounding of the exact product, held to a float64 oracle: at most in_features
    units of float32 rounding of the sum of absolute terms, per output."""
    if tiny_model.lm_head.weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        pytest.skip("weights are packed for oneDNN on a CPU only")
    serve.engine.EngineCore(tiny_model, serve.config.EngineConfig(num_blocks=16, dtype="float32"))
    linears = [m for m in tiny_model.modules() if type(m) is torch.nn.Linear]
    packed = [m for m in linears if isinstance(vars(m).get("forward"), impl.devices.PackedLinear)]
    assert linears and packed == linears, f"{len(packed)} of {len(linears)} float32 linears were packed"
    generator = torch.Generator().manual_seed(5)
    eps = torch.finfo(torch.float32).eps
    with torch.inference_mode():
        for module in (tiny_model.lm_head, linears[0]):
            forward = vars(module)["forward"]
            calls: list[torch.Size] = []

            def counted(*args, on_packed=forward.linear_on_packed, calls=calls):
                calls.append(args[0].shape)
                return on_packed(*args)

            forward.linear_on_packed = counted
            work = module.in_features * module.out_features
            for rows in (1, 3, 16, 64, -(-impl.devices.PACKED_FLOAT32_MIN_WORK // work)):
                x = torch.randn(rows, module.in_features, generator=generator)
                calls.clear()
                got = module(x).double()
                assert len(calls) == (rows * work >= impl.devices.PACKED_FLOAT32_MIN_WORK), (
                    f"{rows} rows x {module.in_features} x {module.out_features}: the packed weight serves a call "
                    f"from {impl.devices.PACKED_FLOAT32_MIN_WORK} multiply-adds, F.linear below")
                weight, bias = module.weight.double(), module.bias
                exact = torch.nn.functional.linear(x.double(), weight, None if bias is None else bias.double())
                bound = module.in_features * eps * (x.double().abs() @ weight.abs().T + 1e-30)
                excess = ((got - exact).abs() / bound).max().item()
                assert excess <= 1, f"{rows} rows: error {excess:.2f}x the float32 rounding bound"
