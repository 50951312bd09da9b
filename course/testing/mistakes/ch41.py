"""Chapter 41: tensor parallelism and disaggregated prefill."""
from . import Mistake

MILESTONE = "tests/test_ch41_several_gpus.py"
HEADS = f"{MILESTONE}::test_kv_heads_split_or_replicate"
ROW = f"{MILESTONE}::test_row_parallel_parts_add_up_with_the_bias_once"
EMBEDDING = f"{MILESTONE}::test_vocab_parallel_embedding_parts_add_up"
SHARDS = f"{MILESTONE}::test_shard_model_cuts_every_layer"
REPLICAS = f"{MILESTONE}::test_shard_model_copies_a_kv_head_to_the_ranks_that_read_it"
ADOPTION = (MILESTONE, "-k", "adopted or adopt")

MISTAKES = [
    Mistake("parallel/tp.py", "kv_heads_of_rank",
            before="head = rank // (world // num_kv_heads)",
            after="head = rank % num_kv_heads",
            rule="a replicated KV head lives on the neighbouring ranks whose query heads read it",
            expect="query heads read", tests=(HEADS,)),
    Mistake("parallel/tp.py", "kv_heads_of_rank",
            before="return range(rank * per_rank, (rank + 1) * per_rank)",
            after="return range(rank, rank + per_rank)",
            rule="split KV heads are the consecutive share the rank's own query heads read",
            expect="query heads read", tests=(HEADS,)),
    Mistake("parallel/tp.py", "kv_heads_of_rank",
            before="if num_heads % world:",
            after="if num_heads < world:",
            rule="the query heads must split evenly over the ranks",
            expect="refused", tests=(HEADS,)),
    Mistake("parallel/tp.py", "kv_heads_of_rank",
            before="if world < 1 or not 0 <= rank < world:",
            after="if world < 1:",
            rule="a rank outside the group does not exist",
            expect="refused", tests=(HEADS,)),
    Mistake("parallel/tp.py", "RowParallelLinear.forward",
            before="partial = nn.functional.linear(x, self.weight)",
            after="partial = nn.functional.linear(x, self.weight, self.bias)",
            rule="the bias belongs to the sum: added once, after the all-reduce",
            expect="bias counted once", tests=(ROW,)),
    Mistake("parallel/tp.py", "RowParallelLinear.forward",
            before="partial = nn.functional.linear(x, self.weight)\n"
                   "        dist.all_reduce(partial, group=self.group)\n"
                   "        return partial if self.bias is None else partial + self.bias",
            after="partial = nn.functional.linear(x, self.weight, self.bias)\n"
                  "        dist.all_reduce(partial, group=self.group)\n        return partial",
            rule="every rank adding the bias to its part adds it world times: it belongs to the sum",
            expect="bias counted once", tests=(ROW,)),
    Mistake("parallel/tp.py", "RowParallelLinear.forward",
            before="return partial if self.bias is None else partial + self.bias",
            after="return partial",
            rule="the whole bias is added to the sum",
            expect="bias counted once", tests=(ROW,)),
    Mistake("parallel/tp.py", "RowParallelLinear.forward",
            before="dist.all_reduce(partial, group=self.group)",
            after="dist.all_reduce(partial, group=self.group)\n        dist.all_reduce(partial, group=self.group)",
            rule="exactly one collective per call",
            expect="two per layer", tests=(ROW, f"{MILESTONE}::test_tensor_parallel_collectives_per_step")),
    Mistake("parallel/tp.py", "VocabParallelEmbedding.forward",
            before="rows = nn.functional.embedding(local, self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)",
            after="rows = nn.functional.embedding(local, self.weight)",
            rule="an id another rank owns contributes nothing here",
            expect="zeros from the others", tests=(EMBEDDING,)),
    Mistake("parallel/tp.py", "VocabParallelEmbedding.forward",
            before="local = torch.where(mine, ids - self.start, torch.zeros_like(ids))",
            after="local = torch.where(mine, ids, torch.zeros_like(ids))",
            rule="the rank's table starts at row `start`: ids are shifted into it",
            expect="vocabulary-parallel embedding", tests=(EMBEDDING,)),
    Mistake("parallel/tp.py", "VocabParallelEmbedding.forward",
            before="mine = (ids >= self.start) & (ids < self.stop)",
            after="mine = (ids >= self.start) & (ids <= self.stop)",
            rule="the rank owns rows start..stop-1: stop belongs to the next rank",
            expect="vocabulary-parallel embedding", tests=(EMBEDDING,)),
    Mistake("parallel/tp.py", "shard_model",
            before="attn.k_proj = ColumnParallelLinear(attn.k_proj, kv_rows)",
            after="attn.k_proj = ColumnParallelLinear(attn.k_proj, heads)",
            rule="k_proj gives the KV heads this rank holds (kv_heads_of_rank), not its query heads' columns",
            expect="the KV heads it holds", tests=(SHARDS,)),
    Mistake("parallel/tp.py", "shard_model",
            before="kv_rows = slice(kv_heads.start * dim, kv_heads.stop * dim)",
            after="kv_rows = slice(rank % cfg.num_key_value_heads * dim, (rank % cfg.num_key_value_heads + 1) * dim) "
                  "if cfg.num_key_value_heads < world else slice(kv_heads.start * dim, kv_heads.stop * dim)",
            rule="with more ranks than KV heads, each KV head is copied to the neighbouring ranks whose query "
                 "heads read it (not dealt out round-robin)",
            expect="copied whole to the neighbouring ranks", tests=(REPLICAS,)),
    Mistake("parallel/tp.py", "shard_model",
            before="num_key_value_heads=len(kv_heads))",
            after="num_key_value_heads=cfg.num_key_value_heads)",
            rule="the shard's cfg counts this rank's KV heads, so its pool holds those only",
            expect="its cfg counts its own heads", tests=(SHARDS,)),
    Mistake("parallel/tp.py", "shard_model",
            before="mlp.down_proj = RowParallelLinear(mlp.down_proj, features, group)",
            after="mlp.down_proj = ColumnParallelLinear(mlp.down_proj, features)",
            rule="down_proj is row-parallel: it takes the rank's slice of the intermediate features",
            expect="down_proj is row-parallel", tests=(SHARDS,)),
    Mistake("parallel/tp.py", "shard_model",
            before="sharded: Any = copy.deepcopy(model)",
            after="sharded: Any = model",
            rule="the original model is left untouched: each rank's shard is cut from the whole model",
            expect="untouched", tests=(SHARDS,)),
    Mistake("parallel/tp.py", "shard_model",
            before="agree_num_blocks=functools.partial(smallest_over_group, group=group)",
            after="agree_num_blocks=None",
            rule="ranks that size their own pools agree on one size (agree_num_blocks)",
            expect="agree_num_blocks", tests=(SHARDS,)),
    Mistake("parallel/tp.py", "shard_model",
            before="sharded.model.embed_tokens = VocabParallelEmbedding(model.model.embed_tokens, vocab, group)",
            after="pass",
            rule="each rank holds 1/world of the embedding table",
            expect="embedding table", tests=(SHARDS,)),
    Mistake("parallel/disagg.py", "adopt_blocks",
            before="data.index_select(0, shipped_rows.to(data.device))",
            after="data[:len(targets)]",
            rule="each block gets the data shipped for its own key, even when earlier keys needed none",
            expect="data shipped for that block's own key", tests=ADOPTION),
    Mistake("parallel/disagg.py", "adopt_blocks",
            before="for pool, data in zip(distinct_pools(layer), shipped):",
            after="for pool, data in zip(distinct_pools(layer)[:2], shipped):",
            rule="every pool tensor of every layer is filled (a quantized pool's scales too)",
            expect="every pool tensor", tests=ADOPTION),
    Mistake("parallel/disagg.py", "adopt_blocks",
            before="store.index_copy_(0, pool_rows.to(pool.device),",
            after="store.index_copy_(0, shipped_rows.to(pool.device),",
            rule="a block's data lands in the pool row the block manager gave it",
            expect="in the row the block manager gave", tests=ADOPTION),
    Mistake("parallel/disagg.py", "adopt_blocks",
            before="return len(targets)",
            after="return len(keys)",
            rule="it returns how many blocks were filled: keys cached already need no data",
            expect="adopt", tests=ADOPTION),
]

DECIDES = {
    "kv_heads_of_rank":
        "which KV heads a rank's query heads read, when KV heads are split and when copied, and which world sizes "
        "to refuse",
    "RowParallelLinear.forward":
        "where the one all-reduce goes and where the bias is added, so the sum over ranks holds it exactly once",
    "VocabParallelEmbedding.forward":
        "how a rank answers for ids it does not own without indexing out of range, so one all-reduce assembles "
        "every row",
    "shard_model":
        "which parallel module replaces each module of a Qwen3 layer and with which slice, and what the copy's "
        "config and pool agreement must say so the unchanged engine runs on every rank",
    "adopt_blocks":
        "how to pair each shipped block with the pool row the block manager gave its key, for every pool tensor "
        "of every layer, skipping keys already cached",
}

DESIGN = ("shard_model",)
