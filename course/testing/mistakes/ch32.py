"""Chapter 32: the vectorised backend's plan, gather and attention, the Triton paged
attention and KV store (TRITON_INTERPRET=1 on a CPU), quantized pools."""
from . import Mistake

MILESTONE = "tests/test_ch32_fast_kernels.py"
TILES = (f"{MILESTONE}::test_query_tiles_split_each_request",)
STORE = (f"{MILESTONE}::test_triton_store_writes_through_the_slot_mapping",)
TRITON_ATTENTION = (MILESTONE, "-k", "triton_paged_attention_matches and 4-2")
GATHER = (f"{MILESTONE}::test_gather_blocks_reads_every_table_at_once",)
QUANTIZED = (f"{MILESTONE}::test_quantized_write_keeps_codes_and_scales_per_token_and_head",)
ONE_CALL = (f"{MILESTONE}::test_attend_all_makes_one_attention_call_per_group_and_shares_the_window_mask",)


def vectorised(scenario: str) -> tuple[str, ...]:
    """The vectorised backend against the reference on the scenarios whose ids contain `scenario`."""
    return (MILESTONE, "-k", f"vectorised_backend_matches and {scenario}")


MISTAKES = [
    Mistake("paged_kernels.py", "query_tiles",
            before="if seq_len == 0:",
            after="if seq_len < 0:",
            rule="a padding request (seq_len 0) contributes no tile",
            expect="a padding request none", tests=TILES),
    Mistake("paged_kernels.py", "query_tiles",
            before="range(starts[r], starts[r + 1], block_m)",
            after="range(starts[r], starts[r + 1] - 1, block_m)",
            rule="every request with rows gets a tile, a one-row decode included",
            expect="a decode one", tests=TILES),
    Mistake("paged_kernels.py", "query_tiles",
            before="tile_row.append(row)",
            after="tile_row.append(row - starts[r])",
            rule="a tile's first row is a row of the step, not an index inside its request",
            expect="3 tiles of 16", tests=TILES),
    Mistake("paged_kernels.py", "store_kv_kernel",
            before="if slot >= 0:",
            after="if slot > 0:",
            rule="only a negative slot is padding: slot 0 is a real slot",
            expect="(slot 0 too)", tests=STORE),
    Mistake("paged_kernels.py", "store_kv_kernel",
            before="k = tl.load(k_ptr + row * row_size + offsets, mask=inside)",
            after="k = tl.load(k_ptr + slot * row_size + offsets, mask=inside)",
            rule="program i reads row i of k; the slot says only where it goes",
            expect="row i of k and v is stored whole", tests=STORE),
    Mistake("paged_kernels.py", "store_kv_kernel",
            before="tl.store(v_cache_ptr + slot * row_size + offsets",
            after="tl.store(v_cache_ptr + row * row_size + offsets",
            rule="row i goes to slot slot_mapping[i] in BOTH pools, v's as well as k's",
            expect="row i of k and v is stored whole", tests=STORE),
    Mistake("paged_kernels.py", "paged_attention_kernel",
            before="visible = key_positions[None, :] <= positions[:, None]",
            after="visible = key_positions[None, :] < positions[:, None]",
            rule="a row sees the keys up to and including its own position",
            expect="including its own", tests=TRITON_ATTENTION),
    Mistake("paged_kernels.py", "paged_attention_kernel",
            before="key_positions[None, :] > positions[:, None] - window",
            after="key_positions[None, :] >= positions[:, None] - window",
            rule="with window w a row sees only keys at positions > its own - w",
            expect="with window 7", tests=TRITON_ATTENTION),
    Mistake("paged_kernels.py", "paged_attention_kernel",
            before="positions = seq_len - (query_end - query_start) + (rows - query_start)",
            after="positions = seq_len - (query_end - query_start) + rows",
            rule="a row's position counts from its request's first row, not from the step's",
            expect="sits at position seq_len - t + i", tests=TRITON_ATTENTION),
    Mistake("serve/backends.py", "plan_group",
            before="[n - t for n, t in zip(lengths, counts)]",
            after="[n - t + 1 for n, t in zip(lengths, counts)]",
            rule="row i of a request's t new rows sits at position seq_len - t + i",
            expect="sits at position seq_len - t + i", tests=vectorised("mixed")),
    Mistake("serve/backends.py", "plan_group",
            before="visible = (keys <= query_positions[:, :, None])",
            after="visible = (keys < query_positions[:, :, None])",
            rule="a row sees its own key: key j is visible when j <= the row's position",
            expect="including its own", tests=vectorised("mixed")),
    Mistake("serve/backends.py", "plan_group",
            before="num_blocks = max(1, -(-max(lengths) // meta.block_size))",
            after="num_blocks = max(1, max(lengths) // meta.block_size)",
            rule="the gathered blocks cover every key: num_blocks rounds seq_len / block_size up",
            expect="up to and including the last one", tests=vectorised("only")),
    Mistake("serve/backends.py", "plan_group",
            before="empty = upload_indices([",
            after="empty = (lambda parts, device: [torch.tensor(part, dtype=torch.int64, device=device)\n"
                  "                                          for part in parts])([",
            rule="the plan's index lists reach the device in one copy, never one tensor per list or request",
            expect="one copy per group",
            tests=(f"{MILESTONE}::test_a_step_reads_nothing_back_and_copies_its_indices_once",)),
    Mistake("serve/backends.py", "gather_blocks",
            before="pool.index_select(0, block_table.flatten())",
            after="pool.index_select(0, block_table.t().flatten())",
            rule="request r's context is its own blocks, in its table's order",
            expect="its blocks in table order", tests=GATHER),
    Mistake("serve/backends.py", "gather_blocks",
            before="pool.index_select(0, block_table.flatten())",
            after="pool.index_select(0, block_table.flatten().sort().values)",
            rule="blocks are read in logical (table) order, not sorted by block id",
            expect="its blocks in table order", tests=GATHER),
    Mistake("serve/backends.py", "gather_blocks",
            before="blocks.view(block_table.shape[0], -1, *pool.shape[2:])",
            after="blocks.view(block_table.shape[1], -1, *pool.shape[2:])",
            rule="the result has one run of W * block_size rows per request (R of them)",
            expect="one run of W * block_size rows per request", tests=GATHER),
    Mistake("serve/backends.py", "gather_blocks",
            before="pool.index_select(0, block_table.flatten())",
            after="torch.cat([pool.index_select(0, row) for row in block_table])",
            rule="one indexing call for the whole table, whatever the number of requests",
            expect="in one indexing call whatever the number of requests",
            tests=(f"{MILESTONE}::test_gather_blocks_makes_one_indexing_call_whatever_the_number_of_requests",)),
    Mistake("serve/backends.py", "attend_all",
            before="recent = keys_at > plan.query_positions[:, :, None] - window",
            after="recent = keys_at >= plan.query_positions[:, :, None] - window",
            rule="with window w a row sees only keys at positions > its own - w",
            expect="with window 5", tests=vectorised("mixed")),
    Mistake("serve/backends.py", "attend_all",
            before="out = out.masked_fill(plan.empty_rows, 0.0)",
            after="out = out.nan_to_num(0.0)",
            rule="rows of padding requests come back as zeros",
            expect="come back as zeros", tests=vectorised("padding")),
    Mistake("serve/backends.py", "attend_all",
            before="slot_of_row = plan.row_request * slots + plan.row_offset",
            after="slot_of_row = plan.row_offset * requests + plan.row_request",
            rule="the [R, Tq] layout is request-major: row i goes to its request's slot row_offset",
            expect="sits at position seq_len - t + i", tests=vectorised("mixed")),
    Mistake("serve/backends.py", "attend_all",
            before="cached = plan.masks.get(window)",
            after="cached = None",
            rule="a windowed mask is built once per step and kept in plan.masks for the other layers",
            expect="kept in plan.masks", tests=ONE_CALL),
    Mistake("serve/backends.py", "attend_all",
            before="(laid_out, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)",
            after="(laid_out, keys.repeat_interleave(q.shape[1] // keys.shape[1], 1), "
                  "values.repeat_interleave(q.shape[1] // values.shape[1], 1), attn_mask=mask, scale=scale)",
            rule="K/V heads are never repeated in memory: the keys reach attention with their Hkv heads",
            expect="never repeated in memory", tests=ONE_CALL),
    Mistake("serve/backends.py", "write_quantized_kv",
            before="write_kv(cache[2], cache[3], k_scale, v_scale, slot_mapping)",
            after="write_kv(cache[2], cache[3], k_scale, k_scale, slot_mapping)",
            rule="v's scales are v's own, stored beside its codes",
            expect="v's codes and scales are v's own", tests=QUANTIZED),
    Mistake("serve/backends.py", "write_quantized_kv",
            before="(v_codes, v_scale) = quantize_kv(k, fmt), quantize_kv(v, fmt)",
            after="(v_codes, v_scale) = quantize_kv(k, fmt), quantize_kv(k, fmt)",
            rule="v is quantized from v, not from k",
            expect="v's codes and scales are v's own", tests=QUANTIZED),
    Mistake("serve/backends.py", "write_quantized_kv",
            before="write_kv(cache[2], cache[3], k_scale, v_scale, slot_mapping)",
            after="write_kv(cache[2], cache[3], k_scale.abs().amax(-1, keepdim=True).expand_as(k_scale), v_scale, "
                  "slot_mapping)",
            rule="one scale per token AND head, not one per token",
            expect="per token and head", tests=QUANTIZED),
    Mistake("serve/backends.py", "write_quantized_kv",
            before="raw_bytes(cache[0]), raw_bytes(cache[1]), raw_bytes(k_codes), raw_bytes(v_codes)",
            after="cache[0], cache[1], k_codes, v_codes",
            rule="an fp8 pool is written on every device, a CPU too, where index_copy_ has no one-byte-float kernel",
            expect="written on every device", tests=QUANTIZED),
]

DECIDES = {
    "store_kv_kernel":
        "how one Triton program per row finds its slot in the slot-major pool and how padding rows store nothing, "
        "decided on the device",
    "paged_attention_kernel":
        "how a tile of query rows walks only the pool blocks its rows can see, with an online softmax that never "
        "holds a whole score row and never yields NaN",
    "query_tiles":
        "how to cut every request's rows into fixed-size tiles from the host lists alone, skipping padding "
        "requests",
    "write_quantized_kv":
        "how to quantize a step's rows per token and head and store codes and scales at their slots, on devices "
        "without an fp8 copy kernel",
    "plan_group":
        "which index tensors a group of requests needs so that one attention call can serve them, built on the "
        "host and moved in one copy",
    "gather_blocks": "how to gather every request's blocks from the pool in one indexing call, not one per request",
    "attend_all":
        "how to serve a whole group with one attention call, GQA without repeating heads, and where to cache a "
        "window mask so other layers reuse it",
}

DESIGN = ("paged_attention_kernel",)
