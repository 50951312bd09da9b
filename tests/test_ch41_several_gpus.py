"""Chapter 41 milestone: one model served by several processes (torch.distributed).

Oracles: the REFERENCE package's solo greedy `generate` on the same tiny weights (what
every rank must produce, token for token), torch's own nn.Linear and nn.Embedding on the
unsplit weights (what the shards must add up to), the chapter's arithmetic for the
number of collectives per step (1 + 2 * layers all-reduces and one all-gather), and the
operating system (a rank that exits must make the other end with an error).

The multi-process tests share ONE launch of two ranks (course.testing.distributed_runs): starting
a process that imports torch costs seconds on a small machine. The ranks run tensor
parallel, pipeline parallel and disaggregated prefill in turn; last, rank 1 exits while
rank 0 waits for it in an all-reduce. gloo on a CPU; NCCL when --device cuda and two
GPUs exist. Every wait has a deadline: nothing here can hang.

The tiny model's greedy margins make the parity deterministic: checked once by hand over
48 random prompts (4 seeds x 12 prompts of 1-39 tokens, 12 new tokens each) for TP on
both ranks, PP and disaggregated prefill, every output equal to solo generate.
"""
import os
import tempfile
import time
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn

from course.testing import distributed_runs
from course.testing.oracles import TINY_EOS, solo

pytestmark = pytest.mark.chapter(41)

PROMPTS = [list(range(1, 21)), [5, 6, 7], [9] * 19 + [1, 2]]
MAX_NEW = 8
CONFIG = {"num_blocks": 64, "block_size": 4}
LAYERS = 2                           # the tiny model's
# The tensor-parallel part sizes each rank's pool itself, from a different budget per rank
# (as two GPUs with different free memory would): 10 and 40 blocks of this rank's K and V
# (2 layers x K and V x 4 slots x 1 KV head x 16 dims x 4 bytes). 16 blocks preempt once
# (10 steps), 40 do not (8 steps): pools of different sizes would schedule different
# batches and the ranks' collectives would not match.
TP_POOL_BLOCKS = (16, 40)
TP_BUDGETS = [blocks * LAYERS * 2 * 4 * 1 * 16 * 4 for blocks in TP_POOL_BLOCKS]
_SESSIONS: dict[str, dict] = {}


@pytest.fixture(scope="module")
def session(impl, device):
    """One two-rank launch; what each rank wrote, the launcher's error and the wall time."""
    place = "cuda" if device.type == "cuda" and torch.cuda.device_count() >= 2 else "cpu"
    launch = impl.load("parallel.launch")
    with tempfile.TemporaryDirectory(prefix="ch41-") as out:
        start, failure = time.monotonic(), None
        try:
            launch.launch(distributed_runs.session_rank, 2, impl.spec.text, PROMPTS, MAX_NEW,
                          {**CONFIG, distributed_runs.TP_POOL_BYTES: TP_BUDGETS}, out, distributed_runs.PARTS,
                          place, timeout_s=90)
        except launch.RankFailure as exc:
            failure = str(exc)
        ranks = distributed_runs.read_results(out, 2)
    return {"ranks": ranks, "failure": failure, "seconds": time.monotonic() - start, "place": place}


@pytest.fixture(scope="module")
def expected(impl):
    from course.testing.oracles import reference_tiny_qwen3
    model = reference_tiny_qwen3()
    return [solo(model, p, MAX_NEW, eos_token_id=TINY_EOS) for p in PROMPTS]


def _part(session, rank, part):
    found = session["ranks"][rank].get(part)
    if found is None:
        pytest.fail(f"rank {rank} wrote no result for {part!r}; the launcher said: {session['failure']}")
    if part != "death" and "error" in found:
        pytest.fail(f"rank {rank} failed in {part!r}: {found['error']}")
    return found


def _compare(outputs, expected, what):
    for i, (got, want) in enumerate(zip(outputs, expected)):
        assert got == want, f"{what}: request {i} produced {got}, solo generate gives {want}"


# --- the rules, in one process ---------------------------------------------------------------

def test_kv_heads_split_or_replicate(impl):
    rule = impl.load("parallel.tp").kv_heads_of_rank
    assert [rule(4, 2, r, 2) for r in range(2)] == [range(0, 1), range(1, 2)], "2 KV heads on 2 ranks: one each"
    assert [rule(8, 4, r, 2) for r in range(2)] == [range(0, 2), range(2, 4)]
    assert [rule(8, 2, r, 4) for r in range(4)] == [range(0, 1), range(0, 1), range(1, 2), range(1, 2)], \
        "2 KV heads on 4 ranks: each replicated on two neighbouring ranks"
    assert [rule(9, 3, r, 3) for r in range(3)] == [range(0, 1), range(1, 2), range(2, 3)], \
        "SmolLM2 (9 heads, 3 KV heads) splits over 3 ranks, one KV head each"
    for bad in ((9, 3, 0, 2), (8, 3, 0, 2), (8, 4, 2, 2)):
        with pytest.raises(ValueError):
            rule(*bad)


@pytest.fixture
def one_rank_group():
    """A one-process gloo group: each collective is the identity, so a shard's output is
    its own part and the test adds the parts itself."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=10))
    yield
    dist.destroy_process_group()


def test_row_parallel_parts_add_up_with_the_bias_once(impl, one_rank_group):
    tp = impl.load("parallel.tp")
    torch.manual_seed(0)
    full = nn.Linear(12, 5)
    x = torch.randn(7, 12)
    with torch.no_grad():
        parts = [tp.RowParallelLinear(full, slice(6 * r, 6 * r + 6))(x[:, 6 * r:6 * r + 6]) for r in range(2)]
        want = full(x)
    got = parts[0] + parts[1] - full.bias          # two ranks' outputs: the all-reduce adds them
    torch.testing.assert_close(got, want, msg="row-parallel: the ranks' partial products do not add up to "
                                              "x @ W.T + bias (with the bias counted once)")


def test_vocab_parallel_embedding_parts_add_up(impl, one_rank_group):
    tp = impl.load("parallel.tp")
    torch.manual_seed(0)
    full = nn.Embedding(10, 4)
    ids = torch.tensor([0, 9, 4, 5, 5, 3])
    with torch.no_grad():
        parts = [tp.VocabParallelEmbedding(full, slice(5 * r, 5 * r + 5))(ids) for r in range(2)]
        want = full(ids)
    torch.testing.assert_close(parts[0] + parts[1], want,
                               msg="vocabulary-parallel embedding: each id must come from the one rank owning it, "
                                   "zeros from the others")


def test_pipeline_stages_and_micro_batches(impl):
    pp = impl.load("parallel.pp")
    assert pp.stage_layers(5, 2) == [range(0, 3), range(3, 5)]
    assert pp.stage_layers(28, 4) == [range(0, 7), range(7, 14), range(14, 21), range(21, 28)]
    with pytest.raises(ValueError):
        pp.stage_layers(2, 3)
    plan = [("a", 10), ("b", 1), ("c", 1), ("d", 10)]
    parts = pp.split_micro_batches(plan, 2)
    assert [entry for part in parts for entry in part] == plan, "micro-batches must keep the plan's order"
    assert len(parts) == 2


def test_adopted_blocks_serve_the_prefix(impl, serve, ref_model):
    """Blocks taken out of one engine's pool and adopted into another's are found by its
    prefix cache, and the continuation is exactly solo generate's."""
    from course.models import tiny_qwen3
    from course.testing.oracles import assert_engine_idle, make_engine
    disagg = impl.load("parallel.disagg")
    prompt = list(range(30, 52))
    prefill = make_engine(serve, tiny_qwen3(impl.package), **CONFIG)
    decode = make_engine(serve, tiny_qwen3(impl.package), **CONFIG)
    shipped = {}

    def capture(request):
        count = disagg.full_blocks_computed(prefill, request)
        index = torch.tensor(prefill.blocks.req_blocks[request.request_id][:count])
        shipped["keys"] = prefill.blocks.update_hashes(request)[:count]
        shipped["contents"] = [[pool.index_select(0, index).clone() for pool in layer]
                               for layer in prefill.runner.kv_caches]
        shipped["tokens"] = list(request.token_ids)

    prefill.scheduler.on_finish = capture
    prefill.generate([prompt], serve.request.SamplingParams(max_tokens=1))
    assert len(shipped["keys"]) == len(prompt) // CONFIG["block_size"]
    adopted = disagg.adopt_blocks(decode, shipped["keys"], shipped["contents"])
    assert adopted == len(shipped["keys"]), f"adopted {adopted} of {len(shipped['keys'])} shipped blocks"
    assert disagg.adopt_blocks(decode, shipped["keys"], shipped["contents"]) == 0, \
        "blocks whose keys are already cached must not be adopted twice"
    assert decode.blocks.num_free == CONFIG["num_blocks"], "adopted blocks are cached-FREE: no request holds them"
    out = decode.generate([shipped["tokens"]], serve.request.SamplingParams(max_tokens=MAX_NEW - 1))[0]
    assert decode.blocks.stats["hits"] == adopted * CONFIG["block_size"], \
        "the decode engine's prefix cache did not find the adopted blocks"
    want = solo(ref_model, prompt, MAX_NEW, eos_token_id=TINY_EOS)
    assert shipped["tokens"][len(prompt):] + out.output_token_ids == want
    assert_engine_idle(decode, "after decoding on adopted blocks")


def _chain(serve, count):
    keys = []
    for i in range(count):
        keys.append(serve.blocks.hash_block(keys[-1] if keys else None, [i] * 4))
    return keys


def _pool_state(manager):
    return (list(manager.free_queue), dict(manager.cached), list(manager.block_hash), list(manager.ref_count))


def test_prepare_store_refuses_bad_keys_and_changes_nothing(serve):
    manager = serve.blocks.BlockManager(6, 4)
    keys = _chain(serve, 3)
    manager.prepare_store(keys[:1])
    before = _pool_state(manager)
    for bad, rule in (([keys[1], "k"], "bytes"), ([keys[1], keys[2], keys[1]], "repeat")):
        with pytest.raises(ValueError, match=rule):
            manager.prepare_store(bad)
        assert _pool_state(manager) == before, f"a refused prepare_store({rule} rule) changed the pool"
    with pytest.raises(ValueError, match="prefix caching"):
        serve.blocks.BlockManager(6, 4, enable_prefix_caching=False).prepare_store(keys)


def test_prepare_store_keeps_the_chain_it_extends(serve):
    """Storing a chain whose head is cached already, in a pool with room for four blocks:
    the head's cached-free block must not be the one evicted to make room (the lookup of
    the stored chain would then find nothing), and the run stops where the pool is full."""
    manager = serve.blocks.BlockManager(4, 4)
    keys = _chain(serve, 5)
    head = manager.prepare_store(keys[:1])
    assert list(head) == [0] and manager.cached[keys[0]] == head[0]
    stored = manager.prepare_store(keys)
    assert list(stored) == [1, 2, 3], \
        f"4 free blocks, the head cached: keys 1-3 need data, key 4 does not fit; got rows for keys {list(stored)}"
    assert [manager.cached.get(key) for key in keys[:4]] == [head[0], *stored.values()], \
        "the head of the chain lost its block while room was made for its tail"
    assert keys[4] not in manager.cached and manager.num_free == 4, "stored blocks are cached-FREE"
    assert list(manager.free_queue) == [manager.cached[key] for key in reversed(keys[:4])], \
        "a stored chain joins the back of the free queue tail first, as a freed request does"
    assert manager.prepare_store(keys[:4]) == {}, "keys cached already need no data"


# --- two processes ---------------------------------------------------------------------------

def test_tensor_parallel_matches_solo(session, expected):
    for rank in range(2):
        _compare(_part(session, rank, "tp")["outputs"], expected, f"tensor parallel, rank {rank}")


def test_tensor_parallel_collectives_per_step(session):
    for rank in range(2):
        tp = _part(session, rank, "tp")
        steps = tp["steps"]
        assert tp["collectives"] == {"all_reduce": steps * (1 + 2 * LAYERS), "all_gather": steps}, \
            (f"rank {rank}: {tp['collectives']} in {steps} steps; each step is one all-reduce for the embedding, "
             f"two per layer (after o_proj and after down_proj) and one all-gather for the LM head")


def test_tensor_parallel_ranks_agree_on_the_pool_size(session):
    found = [_part(session, rank, "tp")["num_blocks"] for rank in range(2)]
    assert found[0] == found[1], \
        f"the ranks sized their pools {found[0]} and {found[1]} blocks: their schedulers would part ways"
    if session["place"] == "cpu":        # on GPUs the pool is measured, not taken from the budgets
        assert found[0] == min(TP_POOL_BLOCKS), \
            f"the ranks agreed on {found[0]} blocks; only {min(TP_POOL_BLOCKS)} fit on both"


def test_tensor_parallel_pool_holds_own_heads(session):
    for rank in range(2):
        shape = _part(session, rank, "tp")["pool_shape"]
        assert shape[2] == 1, f"rank {rank}'s pool has {shape[2]} KV heads; of the tiny model's 2 it holds 1"


def test_pipeline_parallel_matches_solo(session, expected):
    for rank in range(2):
        pp = _part(session, rank, "pp")
        _compare(pp["outputs"], expected, f"pipeline parallel, stage {rank}")
        assert pp["layers_held"] == 1, f"stage {rank} holds pools for {pp['layers_held']} layers, not its 1"


def test_disaggregated_prefill_matches_solo(session, expected):
    prefill, decode = _part(session, 0, "disagg"), _part(session, 1, "disagg")
    _compare(decode["outputs"], expected, "disaggregated prefill")
    full = sum(len(p) // CONFIG["block_size"] for p in PROMPTS)
    assert prefill["shipped"] == full, \
        f"the prefill engine shipped {prefill['shipped']} blocks, not the {full} full ones"
    assert decode["adopted"] == full, f"the decode engine adopted {decode['adopted']} of {full} blocks"
    assert decode["prefix_hits"] == full * CONFIG["block_size"], \
        "the decode engine recomputed prompt tokens it had received"
    assert prefill["free_after"] == decode["free_after"] == CONFIG["num_blocks"], "blocks leaked"


def test_a_dead_rank_ends_the_other_with_an_error(session):
    stopped = [found["error"] for parts in session["ranks"] for found in parts.values()
               if isinstance(found, dict) and "Your engine: Chapter" in str(found.get("error"))]
    if stopped:     # the ranks never reached the death in step: the stub is the learner's news
        pytest.fail(f"the ranks stopped before the death test: {stopped[0]}")
    assert session["failure"] is not None, "rank 1 exited, yet the launcher reported success"
    assert "rank 1: exited with status 3" in session["failure"], session["failure"]
    if session["place"] == "cpu":        # gloo raises at once; NCCL's watchdog may end the process instead
        death = _part(session, 0, "death")
        assert death["error"], "rank 0's all-reduce with a dead peer returned instead of failing"
    assert session["seconds"] < 60, f"the launch took {session['seconds']:.0f} s: someone waited on a dead peer"


class _RanksThatEndTogether:
    """Stand-in processes for launch(): every rank is alive at the first look anyone takes
    and has ended (status 0) at every later one, as ranks in lockstep end together, between
    two of the launcher's looks. A sentinel of an ended process reads at once."""
    looks = 0

    def __init__(self, **_):
        self.exitcode = None
        self.sentinel, write_end = os.pipe()
        os.close(write_end)

    def start(self):
        pass

    def is_alive(self):
        type(self).looks += 1
        if type(self).looks > 1:
            self.exitcode = 0
        return self.exitcode is None

    def kill(self):
        pass

    def join(self, timeout=None):
        os.close(self.sentinel)


def test_launch_returns_when_the_ranks_end_together(impl, monkeypatch):
    """Ranks that end between two of the launcher's looks must not leave it waiting out its
    deadline (a wait on no process at all sleeps until the timeout)."""
    launch = impl.load("parallel.launch")
    monkeypatch.setattr(_RanksThatEndTogether, "looks", 0)
    monkeypatch.setattr(launch.mp, "get_context", lambda method: SimpleNamespace(Process=_RanksThatEndTogether))
    start = time.monotonic()
    launch.launch(print, 2, timeout_s=10)
    waited = time.monotonic() - start
    assert waited < 5, f"launch() took {waited:.1f} s after its ranks had ended: it waited out the deadline"


@pytest.mark.timeout(600)
def test_smollm2_splits_over_three_ranks(impl, request):
    """SmolLM2-135M's 9 query heads and 3 KV heads over 3 ranks (three processes; slow on
    a small CPU machine, so only with --stress): the greedy tokens of solo generate."""
    if not request.config.getoption("stress"):
        pytest.skip("three processes loading SmolLM2: run with --stress")
    from course.models.real import smollm2
    from course.models.smollm2 import SmolLM2Unavailable
    try:
        model, tokenizer = smollm2()
    except SmolLM2Unavailable as missing:
        pytest.skip(str(missing))
    prompt = tokenizer.encode("The capital of France is")
    want = solo(model, prompt, 8, eos_token_id=tokenizer.eos_token_id)
    launch = impl.load("parallel.launch")
    with tempfile.TemporaryDirectory(prefix="ch41-smollm2-") as out:
        launch.launch(distributed_runs.smollm2_tensor_parallel_rank, 3, impl.spec.text, prompt, 8,
                      tokenizer.eos_token_id, out, timeout_s=240)
        ranks = distributed_runs.read_results(out, 3)
    for rank, found in enumerate(ranks):
        assert found["tp"]["kv_heads"] == 1, \
            f"rank {rank} of 3 holds {found['tp']['kv_heads']} of SmolLM2's 3 KV heads"
        _compare(found["tp"]["outputs"], [want], f"SmolLM2, TP=3, rank {rank}")


def test_run_py_core_tp2(impl, device, capsys, request):
    """`python run.py core --tp 2`, shortened: the split engine's lines, same steps and
    outputs as the single-process core (three processes' worth of start-up: --stress only)."""
    if not request.config.getoption("stress"):
        pytest.skip("two ranks serving run.py core's workload: run with --stress")
    import json

    from course import cli
    status = cli.main(["core", "--tp", "2", "--impl", impl.spec.text, "--device", str(device), "--requests", "3",
                       "--repeat", "1", "--vocab-size", "320"])
    out, err = capsys.readouterr()
    assert status == 0, f"run.py core --tp 2 failed:\n{out}{err}"
    lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    engines = {line["engine"]: line for line in lines if "engine" in line}
    assert list(engines) == ["ch31 core, ample pool", "ch31 core, ample pool, tp=2", "ch31 core, 24-block pool, tp=2"]
    assert engines["ch31 core, ample pool"]["steps"] == engines["ch31 core, ample pool, tp=2"]["steps"], \
        "the split engine ran a different schedule from the single-process one"
    assert lines[-1]["outputs_identical"] is True


def test_torchrun_starts_the_ranks_and_they_match_one_process(impl, tmp_path):
    """Past one machine, PyTorch's launcher starts the ranks: `torchrun --standalone
    --nproc-per-node 2 run.py core --tp 2` (gloo on the CPU) joins them through torchrun's
    environment (env://) and serves the core's workload with the same schedule and the
    same tokens as one process (the command compares, token for token)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {key: value for key, value in os.environ.items()
           if key not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")])))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(root / "run.py"), "core", "--tp", "2", "--impl", impl.spec.text, "--device", "cpu",
               "--requests", "3", "--repeat", "1", "--vocab-size", "320"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert done.returncode == 0, f"torchrun ... run.py core --tp 2 failed:\n{done.stdout[-2000:]}{done.stderr[-3000:]}"
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    engines = {line["engine"]: line for line in lines if "engine" in line}
    want = ["ch31 core, ample pool", "ch31 core, ample pool, tp=2", "ch31 core, 24-block pool, tp=2"]
    assert list(engines) == want, f"rank 0 alone prints the one-process line and the two split ones: {list(engines)}"
    assert engines["ch31 core, ample pool"]["steps"] == engines["ch31 core, ample pool, tp=2"]["steps"], \
        "the ranks torchrun started ran a different schedule from the single-process engine"
    assert lines[-1]["outputs_identical"] is True, "the ranks' tokens differ from one process's"


def test_half_a_torchrun_environment_is_refused(impl, monkeypatch):
    """A process with RANK but not the rest of torchrun's variables was not started by
    torchrun: the launcher says which are missing instead of waiting at a rendezvous."""
    launch = impl.load("parallel.launch")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    assert launch.torchrun_rank() is None, "no torchrun variables: not started by torchrun"
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(RuntimeError, match="MASTER_ADDR"):
        launch.torchrun_rank()
