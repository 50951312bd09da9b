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
import re
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


class _Session(dict):
    """What the launch left; printed short in a failure's traceback, where the full dict (the
    dying rank's gloo message included) would bury the rank's own error."""

    def __repr__(self):
        return f"<the two-rank launch: {self['seconds']:.0f} s on {self['place']}; parts {sorted(self['ranks'][0])}>"


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
    return _Session(ranks=ranks, failure=failure, seconds=time.monotonic() - start, place=place)


@pytest.fixture(scope="module")
def expected(impl):
    from course.testing.oracles import reference_tiny_qwen3
    model = reference_tiny_qwen3()
    return [solo(model, p, MAX_NEW, eos_token_id=TINY_EOS) for p in PROMPTS]


INTENDED_DEATH = "rank 1: exited with status 3"


# A rank whose partner is gone fails in its next collective with one of these (gloo's words;
# NCCL's differ): an echo of the other rank's death, not an error of its own.
_ECHOES = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "Socket closed",
           "connection refused", "Timed out waiting")
_SIGNALS = {-6: "SIGABRT: the process aborted, typically inside a collective",
            -9: "SIGKILL", -11: "SIGSEGV", -15: "SIGTERM"}


def _short(error):
    """An error without the collective library's source paths and boilerplate."""
    error = re.sub(r"\[[^\]]*\.(?:cc|cpp|h):\d+\]\s*", "", str(error))
    return error.split(" This is typically caused")[0].split(" GLHF")[0].strip()


def _is_echo(error):
    return any(echo.lower() in str(error).lower() for echo in _ECHOES)


def _launcher_report(session):
    """What went wrong, in the order a learner should read it: first the ranks' own errors
    (an exception their code raised), then a rank that died without one (and in which
    part), then the failures that only follow from a dead partner, summed up in one line,
    and last what the final part does on purpose (rank 1 exits, rank 0's all-reduce breaks),
    marked as intended so it does not read as the code's crash."""
    ranks, own, echoes, deaths, intended = session["ranks"], [], [], [], []
    for rank, parts in enumerate(ranks):
        for part, found in parts.items():
            if part == "death" or not isinstance(found, dict) or "error" not in found:
                continue
            (echoes if _is_echo(found["error"]) else own).append(
                f"rank {rank} failed in {part!r}: {_short(found['error'])}")
    for problem in filter(None, (session["failure"] or "").split("; ")):
        rank_word, _, said = problem.partition(": ")
        rank = int(rank_word.split()[-1]) if rank_word.startswith("rank ") else None
        if rank is not None and said.startswith(f"RuntimeError: rank {rank}: ") and " failed: " in said:
            continue                    # the rank's summary of its parts' errors, each listed above already
        if problem == INTENDED_DEATH:
            intended.append(problem + " (intended: the last part stops rank 1 on purpose)")
        elif rank is not None and "death" in ranks[rank]:
            intended.append(f"{rank_word}: {_short(said)} (intended: it was waiting for the rank that was stopped)")
        elif rank is not None and (said.startswith("exited with status") or said.startswith("killed")):
            deaths.append(_death(session, rank, said))
        elif rank is None:
            deaths.append(problem)
        elif not ranks[rank]:           # it raised before writing a result: the launcher has its only words
            (echoes if _is_echo(said) else own).append(f"rank {rank} failed before its first part: {_short(said)}")
    lines = own + deaths
    if echoes:
        lines.append("these only follow from a partner that had gone (not errors of their own): "
                     + "; ".join(sorted({line.split(":")[0] for line in echoes})))
    lines += intended
    return "\n  ".join(["what the two-rank launch saw, the ranks' own errors first:"] + lines)


def _death(session, rank, said):
    """A rank that ended without a Python error: the part it was in and, for the tensor-parallel
    part, the pool sizes the ranks had built (ranks that disagree on it part ways)."""
    parts = session["ranks"][rank]
    during = next((part for part in distributed_runs.PARTS if part not in parts
                   or parts[part].get("unfinished")), None)
    status = said.rsplit(" ", 1)[-1]
    why = _SIGNALS.get(int(status), "") if status.lstrip("-").isdigit() else ""
    line = f"rank {rank} died during {during!r} without a Python error ({said}{': ' + why if why else ''}; " \
           f"not an intended exit)"
    sizes = [found.get("tp", {}).get("num_blocks") for found in session["ranks"]]
    if during == "tp" and None not in sizes and len(set(sizes)) > 1:
        line += (f". The ranks had built pools of {' and '.join(map(str, sizes))} blocks: ranks that size their own "
                 f"pools must agree on one size (the shard's capabilities.agree_num_blocks), or their schedulers "
                 f"plan different batches and their collectives stop pairing up")
    elif during is not None:
        line += ". A rank that dies inside a collective usually means the ranks called different collectives " \
                "(different shapes, or in a different order)"
    return line


def _part(session, rank, part):
    found = session["ranks"][rank].get(part)
    if found is None or found.get("unfinished"):
        pytest.fail(f"rank {rank} wrote no result for {part!r}.\n{_launcher_report(session)}", pytrace=False)
    if part != "death" and "error" in found:
        if _is_echo(found["error"]):
            pytest.fail(f"rank {rank} failed in {part!r} because its partner had gone.\n"
                        f"{_launcher_report(session)}", pytrace=False)
        pytest.fail(f"rank {rank} failed in {part!r}: {_short(found['error'])}", pytrace=False)
    return found


def _compare(outputs, expected, what):
    for i, (got, want) in enumerate(zip(outputs, expected)):
        assert got == want, f"{what}: request {i} produced {got}, solo generate gives {want}"


# --- the rules, in one process ---------------------------------------------------------------

def kv_heads_read(num_heads, num_kv_heads, rank, world):
    """The KV heads rank's query heads read, counted head by head."""
    group, share = num_heads // num_kv_heads, num_heads // world
    return range(rank * share // group, ((rank + 1) * share - 1) // group + 1)


def test_kv_heads_split_or_replicate(impl):
    rule = impl.load("parallel.tp").kv_heads_of_rank
    for heads, kv, world in ((4, 2, 2), (8, 4, 2), (8, 2, 4), (9, 3, 3), (16, 8, 4), (32, 8, 16), (8, 8, 8),
                             (12, 4, 2), (16, 2, 8)):
        got = [rule(heads, kv, rank, world) for rank in range(world)]
        want = [kv_heads_read(heads, kv, rank, world) for rank in range(world)]
        how = "split" if kv >= world else "each replicated on neighbouring ranks"
        assert got == want, (f"{heads} query heads / {kv} KV heads on {world} ranks: rank r holds exactly the KV "
                             f"heads its query heads read ({how}): {[list(r) for r in want]}, "
                             f"got {[list(r) for r in got]}")
    for bad, why in (((9, 3, 0, 2), "9 query heads do not split over 2 ranks"),
                     ((6, 2, 0, 4), "6 query heads do not split over 4 ranks"),
                     ((12, 3, 0, 2), "3 KV heads neither split over 2 ranks nor replicate onto them"),
                     ((8, 4, 2, 2), "rank 2 of a 2-rank group does not exist"),
                     ((8, 4, -1, 2), "rank -1 does not exist")):
        try:
            held = rule(*bad)
        except ValueError:
            continue
        pytest.fail(f"kv_heads_of_rank{bad} must be refused with a ValueError ({why}); it returned {held}")


@pytest.fixture
def one_rank_group():
    """A one-process gloo group: each collective is the identity, so a shard's output is
    its own part and the test adds the parts itself."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=10))
    yield
    dist.destroy_process_group()


def test_row_parallel_parts_add_up_with_the_bias_once(impl, one_rank_group, monkeypatch):
    """Two ranks' RowParallelLinear in one process, with torch.distributed.all_reduce replaced
    by what it does across two ranks: first each rank's call is recorded, then each rank runs
    again and its tensor becomes the sum of both recorded ones. (A one-rank group's
    all-reduce is the identity, which cannot tell a bias added after the sum from one added
    by every rank before it.)"""
    tp = impl.load("parallel.tp")
    torch.manual_seed(0)
    full = nn.Linear(12, 5)
    x = torch.randn(7, 12)
    modules = [tp.RowParallelLinear(full, slice(6 * r, 6 * r + 6)) for r in range(2)]
    sent: list[torch.Tensor] = []

    def record(tensor, *args, **kwargs):
        sent.append(tensor.detach().clone())

    def add_both(tensor, *args, **kwargs):
        tensor.copy_(sent[0] + sent[1])

    with torch.no_grad():
        want = full(x)
        monkeypatch.setattr(dist, "all_reduce", record)
        for r, module in enumerate(modules):
            calls = len(sent)
            module(x[:, 6 * r:6 * r + 6])
            assert len(sent) == calls + 1, \
                (f"row-parallel: one call made {len(sent) - calls} torch.distributed.all_reduce calls; exactly one "
                 f"per call adds the ranks' partial products (so a step makes two per layer: after o_proj and after "
                 f"down_proj)")
        monkeypatch.setattr(dist, "all_reduce", add_both)
        outputs = [module(x[:, 6 * r:6 * r + 6]) for r, module in enumerate(modules)]
    for r, got in enumerate(outputs):
        torch.testing.assert_close(got, want, msg=lambda detail, r=r: (
            f"row-parallel, rank {r} of 2: after the all-reduce the output is not x @ W.T + bias (with the bias "
            f"counted once: it belongs to the sum, so a bias every rank adds before the all-reduce arrives twice, "
            f"and one nobody adds is missing). {detail.splitlines()[0]}"))


def test_vocab_parallel_embedding_parts_add_up(impl, one_rank_group):
    tp = impl.load("parallel.tp")
    torch.manual_seed(0)
    full = nn.Embedding(10, 4)
    ids = torch.tensor([0, 9, 4, 5, 5, 3])
    with torch.no_grad():
        try:
            parts = [tp.VocabParallelEmbedding(full, slice(5 * r, 5 * r + 5))(ids) for r in range(2)]
        except IndexError as error:
            pytest.fail(f"vocabulary-parallel embedding: an id outside the rank's rows [start, stop) must not be "
                        f"looked up in its table ({error})")
        want = full(ids)
    torch.testing.assert_close(parts[0] + parts[1], want,
                               msg="vocabulary-parallel embedding: each id must come from the one rank owning it, "
                                   "zeros from the others")


def _assert_adds_up(what, compute_parts, want, rule):
    """compute_parts() gives the ranks' outputs; they must add up to `want`."""
    try:
        parts = compute_parts()
    except (RuntimeError, IndexError) as error:
        pytest.fail(f"{what}: the shards raised {type(error).__name__} ({str(error).splitlines()[0]}): {rule}")
    shapes = {tuple(part.shape) for part in parts}
    assert shapes == {tuple(want.shape)}, \
        f"{what}: the ranks' outputs have shapes {sorted(shapes)}, not {tuple(want.shape)}: {rule}"
    torch.testing.assert_close(sum(parts), want, msg=f"{what}: the ranks' outputs do not add up to the unsplit "
                                                     f"layer's: {rule}")


def _check_layer_shards(tp, cfg, index, layer, parts):
    """One layer's two shards against the unsplit layer's nn.Linear modules."""
    attn, mlp, dim, heads_per_rank = layer.self_attn, layer.mlp, cfg.head_dim, cfg.num_attention_heads // 2
    torch.manual_seed(index)
    x = torch.randn(5, cfg.hidden_size)
    for rank, part in enumerate(parts):
        kv = tp.kv_heads_of_rank(cfg.num_attention_heads, cfg.num_key_value_heads, rank, 2)
        for name, columns in (("q_proj", slice(rank * heads_per_rank * dim, (rank + 1) * heads_per_rank * dim)),
                              ("k_proj", slice(kv.start * dim, kv.stop * dim)),
                              ("v_proj", slice(kv.start * dim, kv.stop * dim))):
            got, want = getattr(part.self_attn, name)(x), getattr(attn, name)(x)[:, columns]
            assert got.shape == want.shape and torch.allclose(got, want), \
                (f"layer {index}, rank {rank}: {name} must give the features of the heads this rank holds (its "
                 f"query heads; the KV heads it holds, kv_heads_of_rank {kv}): columns {columns} of the unsplit "
                 f"{name}'s output")
    hidden = torch.randn(5, cfg.num_attention_heads * dim)
    half = hidden.shape[1] // 2
    _assert_adds_up(f"layer {index} o_proj",
                    lambda: [part.self_attn.o_proj(hidden[:, r * half:(r + 1) * half]) for r, part in enumerate(parts)],
                    attn.o_proj(hidden), "o_proj is row-parallel: each rank multiplies its heads' slice")
    inner = mlp.gate_proj.out_features
    widths = [part.mlp.gate_proj(x).shape[1] for part in parts]
    assert widths == [inner // 2] * 2, \
        f"layer {index}: gate_proj is column-parallel: each rank computes half of its {inner} features, not {widths}"
    features = torch.randn(5, inner)
    _assert_adds_up(f"layer {index} down_proj",
                    lambda: [part.mlp.down_proj(features[:, r * inner // 2:(r + 1) * inner // 2])
                             for r, part in enumerate(parts)],
                    mlp.down_proj(features), "down_proj is row-parallel: each rank multiplies its features' slice")


def test_shard_model_cuts_every_layer(impl, one_rank_group):
    """Two shards of the tiny model built in one process (building them communicates
    nothing); each projection checked against torch's unsplit nn.Linear / nn.Embedding."""
    from course.models import tiny_qwen3
    tp = impl.load("parallel.tp")
    model = tiny_qwen3(impl.package)
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    shards = []
    for rank in range(2):
        shards.append(tp.shard_model(model, rank, 2))
        untouched = all(torch.equal(before[name], tensor) for name, tensor in model.state_dict().items())
        assert untouched and set(before) == set(model.state_dict()), \
            (f"shard_model(model, {rank}, 2) changed the model: it leaves the original untouched (it builds a "
             f"copy), since the other ranks' shards are cut from the same whole model")
    cfg = model.cfg
    for rank, shard in enumerate(shards):
        kv = tp.kv_heads_of_rank(cfg.num_attention_heads, cfg.num_key_value_heads, rank, 2)
        counted = (shard.cfg.num_attention_heads, shard.cfg.num_key_value_heads)
        assert counted == (cfg.num_attention_heads // 2, len(kv)), \
            (f"rank {rank}'s cfg counts {counted} query and KV heads; its cfg counts its own heads, "
             f"{(cfg.num_attention_heads // 2, len(kv))}, so the engine's pool holds its KV heads only")
        assert callable(shard.capabilities.agree_num_blocks), \
            (f"rank {rank}'s shard declares no capabilities.agree_num_blocks: ranks that size their own pools "
             f"would not agree on one")
        table = shard.model.embed_tokens.weight
        assert table.shape[0] * 2 == cfg.vocab_size, \
            f"rank {rank} holds {table.shape[0]} rows of the {cfg.vocab_size}-row embedding table, not 1/2 of them"
    ids = torch.tensor([0, 3, cfg.vocab_size // 2, cfg.vocab_size - 1])
    with torch.no_grad():
        _assert_adds_up("embed_tokens", lambda: [shard.model.embed_tokens(ids) for shard in shards],
                        model.model.embed_tokens(ids), "each id's row comes from the one rank owning it")
        for index, layer in enumerate(model.model.layers):
            _check_layer_shards(tp, cfg, index, layer, [shard.model.layers[index] for shard in shards])


def test_shard_model_copies_a_kv_head_to_the_ranks_that_read_it(impl):
    """Four ranks over the tiny model's 4 query heads and 2 KV heads: more ranks than KV
    heads, so each KV head is copied whole to the ranks whose query heads read it. Which
    heads those are is worked out here from the grouping itself (query head q reads KV head
    q // (H / Hkv)), not from kv_heads_of_rank, so a shard that cuts k_proj by some other
    rule fails even when its own kv_heads_of_rank agrees with it. Building and calling the
    column-parallel projections communicates nothing."""
    from course.models import tiny_qwen3
    tp = impl.load("parallel.tp")
    model = tiny_qwen3(impl.package)
    cfg, world, dim = model.cfg, 4, model.cfg.head_dim
    queries_per_kv = cfg.num_attention_heads // cfg.num_key_value_heads
    queries_per_rank = cfg.num_attention_heads // world
    assert cfg.num_key_value_heads < world, "this test needs more ranks than KV heads"
    x = torch.randn(3, cfg.hidden_size, generator=torch.Generator().manual_seed(41))
    for rank in range(world):
        queries = range(rank * queries_per_rank, (rank + 1) * queries_per_rank)
        read = sorted({q // queries_per_kv for q in queries})
        shard = tp.shard_model(model, rank, world)
        assert shard.cfg.num_key_value_heads == len(read), \
            (f"rank {rank} of {world}: its cfg counts {shard.cfg.num_key_value_heads} KV heads; its query heads "
             f"{list(queries)} read KV head(s) {read}, and those are the ones its pool holds")
        columns = slice(read[0] * dim, (read[-1] + 1) * dim)
        for index, (layer, whole) in enumerate(zip(shard.model.layers, model.model.layers)):
            for name in ("k_proj", "v_proj"):
                with torch.no_grad():
                    got, want = getattr(layer.self_attn, name)(x), getattr(whole.self_attn, name)(x)[:, columns]
                assert got.shape == want.shape and torch.allclose(got, want), \
                    (f"layer {index}, rank {rank} of {world}: {name} must give the features of KV head(s) {read}, "
                     f"the ones its query heads {list(queries)} read (columns {columns} of the unsplit {name}'s "
                     f"output): with more ranks than KV heads, a KV head is copied whole to the neighbouring ranks "
                     f"that read it")


@pytest.mark.parametrize("pool", ["model dtype", "int8", "latent"])
def test_adopted_blocks_hold_their_own_data(impl, serve, pool):
    """Adoption after two of five keys were cached already (with other data), into a plain,
    a quantized (codes and scales) and a latent (one tensor for K and V) pool: every
    block's data lands where the block manager put that block."""
    from course.models import tiny_qwen3
    from course.testing.oracles import make_engine
    disagg = impl.load("parallel.disagg")
    raw_bytes = impl.load("serve.backends").raw_bytes
    config = {**CONFIG, "num_blocks": 16, "kv_cache_dtype": "int8" if pool == "int8" else "auto"}
    engine = make_engine(serve, tiny_qwen3(impl.package), **config)
    if pool == "latent":            # what Chapter 42's latent attention hands the runner: one tensor, twice
        latent = [torch.zeros(17, CONFIG["block_size"], 1, 24) for _ in engine.runner.kv_caches]
        engine.runner.kv_caches = [(tensor, tensor) for tensor in latent]
    layers = [list({id(t): t for t in layer}.values()) for layer in engine.runner.kv_caches]
    generator = torch.Generator().manual_seed(41)

    def shipment(count):
        return [[(torch.randn((count, *t.shape[1:]), generator=generator) * 50).to(raw_bytes(t).dtype)
                 for t in layer] for layer in layers]

    other = []                      # another prompt's blocks first, so pool rows differ from positions
    for i in range(3):
        other.append(serve.blocks.hash_block(other[-1] if other else None, [100 + i] * 4))
    other_data = shipment(3)
    assert disagg.adopt_blocks(engine, other, other_data) == 3
    keys = _chain(serve, 5)
    early, late = shipment(2), shipment(5)
    assert disagg.adopt_blocks(engine, keys[:2], early) == 2
    filled = disagg.adopt_blocks(engine, keys, late)
    assert filled == 3, f"keys 0-1 were cached already: adopt_blocks fills the other 3 blocks, it said {filled}"
    shipments = {"the first shipment": early, "the second shipment": late, "the other prompt's shipment": other_data}
    for i, key in enumerate(keys):
        row = engine.blocks.cached[key]
        sent, whose = (early, "the first shipment's (it was cached before)") if i < 2 else (late, "its own shipment's")
        for index, layer in enumerate(layers):
            for j, tensor in enumerate(layer):
                got, want = raw_bytes(tensor)[row], sent[index][j][i]
                if not torch.equal(got, want):
                    pytest.fail(f"{pool} pool, layer {index}, tensor {j} of {len(layer)}: block row {row} (key {i}) "
                                f"does not hold {whose} data for key {i}; it holds "
                                f"{_whose_data(got, shipments, index, j)} (max abs difference "
                                f"{_max_difference(got, want)}). Each block's data lands in every pool tensor, "
                                f"in the row the block manager gave that block, and is the data shipped for that "
                                f"block's own key")


def _max_difference(got, want):
    return f"{(got.double() - want.double()).abs().max().item():.3g}"


def _whose_data(row, shipments, layer, tensor):
    """Which shipped block a pool row's contents came from, in words (the rows are random
    enough that equal contents mean the same block)."""
    for name, sent in shipments.items():
        for i, block in enumerate(sent[layer][tensor]):
            if torch.equal(row, block):
                return f"the data of key {i} of {name}"
    if not row.any():
        return "zeros (nothing was written there)"
    return "data that no shipment sent"


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
    broken = [part for parts in session["ranks"] for part, found in parts.items()
              if part != "death" and isinstance(found, dict) and ("error" in found or found.get("unfinished"))]
    missing = [part for parts in session["ranks"] for part in distributed_runs.PARTS[:-1] if part not in parts]
    if broken or missing:
        pytest.fail("the launch broke before its last part (where rank 1 exits on purpose), so this test "
                    f"could not look at a dead rank.\n{_launcher_report(session)}", pytrace=False)
    assert session["failure"] is not None, "rank 1 exited, yet the launcher reported success"
    assert INTENDED_DEATH in session["failure"], \
        f"the launcher must name the rank that exited and its status: {_launcher_report(session)}"
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
@pytest.mark.edition_stress
def test_smollm2_splits_over_three_ranks(impl, request):
    """SmolLM2-135M's 9 query heads and 3 KV heads over 3 ranks (three processes; slow on
    a small CPU machine, so only with --stress): the greedy tokens of solo generate. The
    chapter promises it to the learner, so the release records solo generate's answer."""
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


@pytest.mark.edition_stress
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
