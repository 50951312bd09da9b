"""Chapter 1: counting a Qwen3's parameters from its config."""
from . import Mistake

TRANSFORMERS = "tests/test_ch01_the_engine_you_will_build.py::test_count_matches_transformers"

MISTAKES = [
    Mistake("cost.py", "count_parameters",
            before="tables = 1 if cfg.tie_word_embeddings else 2",
            after="tables = 2",
            rule="a tied embedding and LM head share one matrix, counted once",
            expect="tied embedding and LM head counts once", tests=(TRANSFORMERS,)),
    Mistake("cost.py", "count_parameters",
            before="norms = 2 * head_dim + 2 * hidden",
            after="norms = 2 * hidden",
            rule="every layer has q_norm and k_norm, one head_dim vector each",
            expect="q_norm and k_norm", tests=(TRANSFORMERS,)),
    Mistake("cost.py", "count_parameters",
            before="q_width = cfg.num_attention_heads * head_dim",
            after="q_width = hidden",
            rule="q and o are num_attention_heads x head_dim wide, and head_dim need not be hidden / heads",
            expect="attention projections' widths", tests=(TRANSFORMERS,)),
    Mistake("cost.py", "count_parameters",
            before="kv_width = cfg.num_key_value_heads * head_dim",
            after="kv_width = cfg.num_attention_heads * head_dim",
            rule="grouped-query attention: k and v have num_key_value_heads heads, not num_attention_heads",
            expect="k and v num_key_value_heads", tests=(TRANSFORMERS,)),
    Mistake("cost.py", "count_parameters",
            before="total = layers * (attention + norms + mlp) + hidden",
            after="total = layers * (attention + norms + mlp)",
            rule="the final norm after the last layer has hidden_size weights",
            expect="final norm", tests=(TRANSFORMERS,)),
    Mistake("cost.py", "count_parameters",
            before="if embeddings:",
            after="if True:",
            rule="embeddings=False leaves out the embedding table and an untied LM head",
            expect="non-embedding parameters",
            tests=("tests/test_ch01_the_engine_you_will_build.py::test_count_without_embeddings",)),
    Mistake("cost.py", "count_parameters",
            before="    if embeddings:\n        tables = 1 if cfg.tie_word_embeddings else 2\n",
            after=("    if embeddings or not cfg.tie_word_embeddings:\n"
                   "        tables = (1 if cfg.tie_word_embeddings else 2) if embeddings else 1\n"),
            rule="embeddings=False leaves out an untied LM head too: the figure is the same tied or untied",
            expect="untied LM head",
            tests=("tests/test_ch01_the_engine_you_will_build.py::test_count_without_embeddings",)),
]

# What the learner must decide at each stub (one sentence each), and the chapter's design stubs.
DECIDES = {
    "count_parameters": (
        "which tensors one Qwen3 layer and the parts around the layers hold and how wide each "
        "is, from config fields alone: grouped key/value heads, a head_dim that is not hidden / "
        "heads, optional biases, and a tied matrix counted once"
    ),
}
DESIGN = ("count_parameters",)
