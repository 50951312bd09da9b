"""Chapter 29: flash attention (the online softmax, tiles, skipped tiles)."""
from . import Mistake

MILESTONE = "tests/test_ch29_flash_attention.py"
ONLINE = f"{MILESTONE}::test_online_update_equals_softmax_in_one_go"

MISTAKES = [
    Mistake("flash.py", "online_softmax_update",
            before="acc = alpha[..., None] * acc + p @ v",
            after="acc = acc + p @ v",
            rule="when the running max grows, the accumulated output is rescaled by exp(old max - new max)",
            expect="acc / l is softmax @ v",
            tests=(ONLINE,)),
    Mistake("flash.py", "online_softmax_update",
            before="l = alpha * l + p.sum(dim=-1)",
            after="l = l + p.sum(dim=-1)",
            rule="when the running max grows, the running sum is rescaled too",
            expect="running sum",
            tests=(ONLINE,)),
    Mistake("flash.py", "online_softmax_update",
            before="torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)",
            after="m_new",
            rule="a row that has seen only -inf scores keeps l = 0 and acc = 0, never NaN",
            expect="must keep l = 0",
            tests=(ONLINE,)),
    Mistake("flash.py", "online_softmax_update",
            before="torch.maximum(m, scores.amax(dim=-1))",
            after="scores.amax(dim=-1)",
            rule="the running max is the max over every tile so far",
            expect="running max",
            tests=(ONLINE,)),
    Mistake("flash.py", "flash_attention",
            before="k_pos2[:, None, ks:ke] <= q_pos2[:, qs:qe, None]",
            after="k_pos2[:, None, ks:ke] < q_pos2[:, qs:qe, None]",
            rule="a query attends to every key at or before its position, its own included",
            expect="at or before its position",
            tests=(f"{MILESTONE}::test_equals_attention",)),
    Mistake("flash.py", "flash_attention",
            before="if not tile_is_visible(q_pos2[:, qs:qe], k_pos2[:, ks:ke]):",
            after="if False:",
            rule="a tile that holds only future keys is skipped, not computed",
            expect="6 skipped",
            tests=(f"{MILESTONE}::test_causal_tiles_are_skipped",)),
    Mistake("flash.py", "flash_attention",
            before="torch.where(seen[..., None], acc / torch.where(seen, l, 1.0)[..., None], 0.0)",
            after="acc / l[..., None]",
            rule="a query that sees no key outputs zeros, not NaN",
            expect="sees no key",
            tests=(f"{MILESTONE}::test_per_row_positions_padding_and_empty_rows",)),
    Mistake("flash.py", "flash_attention",
            before="return out.reshape(batch, heads, tq, dim).to(q.dtype)",
            after="return out.reshape(batch, heads, tq, dim)",
            rule="the output has the inputs' dtype (float32 inside, rounded once at the end)",
            expect="the inputs' dtype",
            tests=(f"{MILESTONE}::test_bfloat16_inputs",)),
]

DECIDES = {
    "online_softmax_update": (
        "what running state replaces a row's full softmax and how to rescale it when a new tile raises the "
        "maximum, including rows that have seen only masked scores"),
    "flash_attention": (
        "how to walk the query and key tiles so no full score matrix exists, which tiles can be skipped "
        "without arithmetic, and how to finish rows that saw no key"),
}

DESIGN = ("flash_attention",)
