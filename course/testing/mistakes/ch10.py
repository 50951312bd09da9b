"""Chapter 10: the whole Qwen3 (Qwen3Model, Qwen3ForCausalLM)."""
from . import Mistake

MILESTONE = "tests/test_ch10_assembling_qwen3.py"
LOGITS = f"{MILESTONE}::test_logits_match_transformers"
POSITIONS = f"{MILESTONE}::test_positions_argument_matches_position_ids"

MISTAKES = [
    Mistake("qwen3.py", "Qwen3Model.forward",
            before="return self.norm(x)",
            after="return x",
            rule="the model's output is the stream after the final norm",
            expect="after the last layer and the final norm",
            tests=(f"{MILESTONE}::test_hidden_states_are_transformers_last_hidden_state",)),
    Mistake("qwen3.py", "Qwen3Model.forward",
            before="for layer in self.layers:",
            after="for layer in reversed(self.layers):",
            rule="the layers run in order, layer 0 first",
            expect="the layers run in order", tests=(LOGITS,)),
    Mistake("qwen3.py", "Qwen3Model.forward",
            before="positions = slots if positions is None else positions",
            after="positions = slots",
            rule="given positions feed RoPE; they default to the cache slots only when left out",
            expect="positions= must reach RoPE", tests=(POSITIONS,)),
    Mistake("qwen3.py", "Qwen3Model.forward",
            before="""            x = layer(x, cos, sin, slots, cache, allowed)
        if cache is not None:
            cache.advance(input_ids.shape[1])""",
            after="""            x = layer(x, cos, sin, slots, cache, allowed)
            if cache is not None:
                cache.advance(input_ids.shape[1])""",
            rule="the cache advances once per forward pass, after the last layer, so every layer writes at the same "
                 "slots",
            expect="advances the cache once",
            tests=("tests/test_ch16_kv_cache.py::test_cached_logits_equal_full_recompute",)),
    Mistake("qwen3.py", "Qwen3ForCausalLM.forward",
            before="return self.lm_head(hidden).float()",
            after="return self.lm_head(hidden)",
            rule="logits are float32 whatever the model's dtype",
            expect="float32 logits", tests=(f"{MILESTONE}::test_bfloat16_model_returns_float32_logits",)),
    Mistake("qwen3.py", "Qwen3ForCausalLM.forward",
            before="self.lm_head(hidden)",
            after="F.linear(hidden, self.model.embed_tokens.weight)",
            rule="the LM head is lm_head; it is the embedding's matrix only when the config ties them",
            expect="embedding's matrix only when tied", tests=(LOGITS,)),
    Mistake("qwen3.py", "Qwen3ForCausalLM.forward",
            before="self.lm_head(hidden)",
            after="self.lm_head(hidden[:, -1:])",
            rule="the model returns logits for every position, not only the last",
            expect="logits for every position", tests=(LOGITS,)),
    Mistake("qwen3.py", "Qwen3ForCausalLM.forward",
            before="self.model(input_ids, positions, cache, allowed)",
            after="self.model(input_ids, None, cache, allowed)",
            rule="the positions argument reaches the model",
            expect="positions= must reach RoPE", tests=(POSITIONS,)),
]

# What the learner must decide at each stub (one sentence each), and the chapter's design stubs.
DECIDES = {
    "Qwen3Model.forward": (
        "where a step's tokens land in the cache (slots from its length, shared or per row), "
        "what the positions default to, which tables every layer shares, and when the cache "
        "advances so that every layer writes at the same slots"
    ),
    "Qwen3ForCausalLM.forward": (
        "where the LM head sits relative to the final norm, and in which dtype the logits come "
        "back"
    ),
}
DESIGN = ("Qwen3Model.forward",)
