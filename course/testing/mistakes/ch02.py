"""Chapter 2: FLOPs, KV bytes and the cost of a step."""
from . import Mistake

MILESTONE = "tests/test_ch02_the_cost_of_a_token.py"
TWICE = f"{MILESTONE}::test_flops_per_token_is_about_twice_the_parameters"
KV_8B = f"{MILESTONE}::test_kv_bytes_qwen3_8b"
STEP_FLOPS = f"{MILESTONE}::test_step_flops_match_the_model"
STEP_BYTES = f"{MILESTONE}::test_step_bytes"

MISTAKES = [
    Mistake("cost.py", "kv_bytes_per_token",
            before="2 * cfg.num_key_value_heads",
            after="cfg.num_key_value_heads",
            rule="the cache stores a key AND a value per key/value head",
            expect="K and V", tests=(KV_8B,)),
    Mistake("cost.py", "kv_bytes_per_token",
            before="cfg.num_key_value_heads * head_dim_of(cfg)",
            after="cfg.num_attention_heads * head_dim_of(cfg)",
            rule="only the key/value heads store anything, not the query heads",
            expect="only key/value heads store",
            tests=(f"{MILESTONE}::test_kv_bytes_depend_on_kv_heads_not_query_heads",)),
    Mistake("cost.py", "kv_bytes_per_token",
            before="bytes_per_element(dtype)",
            after="2",
            rule="a number's size follows the cache dtype, not always bfloat16's",
            expect="in torch.float32", tests=(KV_8B,)),
    Mistake("cost.py", "kv_bytes_per_token",
            before="cfg.num_hidden_layers * per_layer",
            after="per_layer",
            rule="every layer keeps its own keys and values",
            expect="36 layers", tests=(KV_8B,)),
    Mistake("cost.py", "flops_per_token",
            before="cfg.num_attention_heads * head_dim_of(cfg) * context",
            after="cfg.num_key_value_heads * head_dim_of(cfg) * context",
            rule="every query head scores the keys on its own, even when it shares a key/value head",
            expect="query_heads", tests=(TWICE,)),
    Mistake("cost.py", "flops_per_token",
            before="attention = 4 *",
            after="attention = 2 *",
            rule="each key costs a dot product for the score and a multiply-add for the value (Q.K and A.V)",
            expect="Q.K and A.V", tests=(TWICE,)),
    Mistake("cost.py", "flops_per_token",
            before="2 * matmul_parameters(cfg) + attention",
            after="2 * count_parameters(cfg, embeddings=False) + attention",
            rule="the LM head is a matrix product every token pays for, tied or not",
            expect="LM head included", tests=(TWICE,)),
    Mistake("cost.py", "step_cost",
            before="new_tokens * (new_tokens + 1) // 2",
            after="new_tokens * (new_tokens - 1) // 2",
            rule="causal attention: new token i sees past_tokens + i keys, itself included",
            expect="token i sees past + i keys", tests=(STEP_FLOPS,)),
    Mistake("cost.py", "step_cost",
            before="flops = batch * (",
            after="flops = (",
            rule="every sequence of the batch pays its own FLOPs",
            expect="every sequence of the batch pays its own", tests=(STEP_FLOPS,)),
    Mistake("cost.py", "step_cost",
            before="moved = (matmul_parameters(cfg) * bytes_per_element(dtype)",
            after="moved = (new_tokens * matmul_parameters(cfg) * bytes_per_element(dtype)",
            rule="the weights are read once per step, however many tokens share them",
            expect="reads every weight matrix once", tests=(STEP_BYTES,)),
    Mistake("cost.py", "step_cost",
            before="moved = (matmul_parameters(cfg) * bytes_per_element(dtype)",
            after="moved = (weight_bytes(cfg, dtype)",
            rule="a step reads the matrices it multiplies by, not the norms or the embedding table",
            expect="norms and embedding table left out", tests=(STEP_BYTES,)),
    Mistake("cost.py", "step_cost",
            before="batch * (past_tokens + new_tokens) * kv_bytes_per_token(cfg, dtype)",
            after="batch * past_tokens * kv_bytes_per_token(cfg, dtype)",
            rule="each sequence moves the K and V of its past tokens and of its new ones",
            expect="past + new tokens per sequence", tests=(STEP_BYTES,)),
]

# What the learner must decide at each stub (one sentence each), and the chapter's design stubs.
DECIDES = {
    "flops_per_token": (
        "which products of one token's forward pass count (the LM head does, the embedding "
        "lookup does not) and which part grows with the context, scaled by which kind of head"
    ),
    "kv_bytes_per_token": (
        "what one token leaves in the cache of every layer and which head count (query or "
        "key/value) sizes it"
    ),
    "step_cost": (
        "how a step's cost splits into what the whole batch shares (one read of the weights) "
        "and what each sequence pays (its own K/V traffic, causal attention over its past plus "
        "the new tokens before it), in closed form rather than a loop over tokens"
    ),
}
DESIGN = ("step_cost",)
