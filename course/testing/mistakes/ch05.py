"""Chapter 5: causal attention driven by positions, with grouped-query heads."""
from . import Mistake

MILESTONE = "tests/test_ch05_attention.py"
WHOLE_PROMPT = f"{MILESTONE}::test_whole_prompt"

MISTAKES = [
    Mistake("attention.py", "causal_attention",
            before="mask = k_pos[..., None, :] <= q_pos[..., :, None]",
            after="mask = k_pos[..., None, :] < q_pos[..., :, None]",
            rule="a query sees the key at its own position (itself included)",
            expect="at its own position and before", tests=(WHOLE_PROMPT,)),
    Mistake("attention.py", "causal_attention",
            before="mask = k_pos[..., None, :] <= q_pos[..., :, None]",
            after="mask = torch.ones(q_len, k_len, dtype=torch.bool, device=q.device).tril()",
            rule="positions, not row numbers, decide which keys a query sees",
            expect="positions, not row numbers, decide", tests=(f"{MILESTONE}::test_chunk_in_the_middle",)),
    Mistake("attention.py", "causal_attention",
            before="grouped = q.float().reshape(batch, kv_heads, group * q_len, dim)",
            after="grouped = q.float().reshape(batch, group, kv_heads, q_len, dim).transpose(1, 2)"
                  ".reshape(batch, kv_heads, group * q_len, dim)",
            rule="consecutive query heads share a key/value head (h // group), not every Hkv-th one",
            expect="reads K/V head h //", tests=(WHOLE_PROMPT,)),
    Mistake("attention.py", "causal_attention",
            before="1.0 / math.sqrt(dim)",
            after="1.0 / dim",
            rule="the default scale is 1/sqrt(head_dim)",
            expect="1/sqrt(head_dim)", tests=(f"{MILESTONE}::test_scale",)),
    Mistake("attention.py", "causal_attention",
            before="torch.softmax(scores, dim=-1).nan_to_num_(0.0)",
            after="torch.softmax(scores, dim=-1)",
            rule="a query that may see no key returns zeros, not NaN",
            expect="not NaN", tests=(f"{MILESTONE}::test_rows_with_no_visible_key_are_zero",)),
    Mistake("attention.py", "causal_attention",
            before="mask = mask & allowed",
            after="mask = mask | allowed",
            rule="`allowed` is intersected with the causal rule, never widens it",
            expect="intersected with the causal rule", tests=(f"{MILESTONE}::test_allowed_mask",)),
]

# What the learner must decide at each stub (one sentence each), and the chapter's design stubs.
DECIDES = {
    "causal_attention": (
        "how to build who-sees-whom from positions rather than row numbers (so one function "
        "serves a prompt, a decode step and a chunk), how each key/value head serves its group "
        "of query heads without copying keys, and what a query that may see nothing returns"
    ),
}
DESIGN = ("causal_attention",)
