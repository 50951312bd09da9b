"""Chapter 9: Qwen3's attention sublayer (projections, QK-norm, RoPE, grouped-query attention)."""
from . import Mistake

MILESTONE = "tests/test_ch09_qwen3_attention.py"
GQA = f"{MILESTONE}::test_attention_matches_transformers[gqa 4q/2kv]"

MISTAKES = [
    Mistake("qwen3.py", "Qwen3Attention.forward",
            before="q = apply_rope(self.q_norm(q).transpose(1, 2), cos, sin)",
            after="q = self.q_norm(apply_rope(q.transpose(1, 2), cos, sin))",
            rule="each head vector is normalised first and rotated after",
            expect="q_norm/k_norm come before RoPE", tests=(GQA,)),
    Mistake("qwen3.py", "Qwen3Attention.forward",
            before="k = apply_rope(self.k_norm(k).transpose(1, 2), cos, sin)",
            after="k = self.k_norm(k).transpose(1, 2)",
            rule="keys are rotated like queries",
            expect="q and k are rotated", tests=(GQA,)),
    Mistake("qwen3.py", "Qwen3Attention.forward",
            before="v = v.transpose(1, 2)",
            after="v = apply_rope(v.transpose(1, 2), cos, sin)",
            rule="values carry content, not position: they are not rotated",
            expect="v is not", tests=(GQA,)),
    Mistake("qwen3.py", "Qwen3Attention.forward",
            before="y = causal_attention(q, k, v, slots, k_slots, allowed)",
            after="group = self.num_heads // self.num_kv_heads\n"
                  "        y = causal_attention(q, k.repeat(1, group, 1, 1), v.repeat(1, group, 1, 1), slots, k_slots,"
                  " allowed)",
            rule="consecutive query heads share a key/value head (h // group); tiling the K/V heads pairs them wrongly",
            expect="reads K/V head h // (H // Hkv)", tests=(GQA,)),
    Mistake("qwen3.py", "Qwen3Attention.forward",
            before="y.transpose(1, 2).reshape(batch, length, -1)",
            after="y.reshape(batch, length, -1)",
            rule="the heads of one token are merged back into one row before o_proj",
            expect="merged back per token", tests=(GQA,)),
]

# What the learner must decide at each stub (one sentence each), and the chapter's design stubs.
DECIDES = {
    "Qwen3Attention.forward": (
        "how the flat projections become per-head tensors, in which order QK-norm and rotation "
        "apply, which slots the keys carry once a cache hands back every key so far, and how "
        "the heads merge back per token before o_proj"
    ),
}
DESIGN = ("Qwen3Attention.forward",)
