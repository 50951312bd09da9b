"""Chapter 16: the KV cache and cached generation."""
from . import Mistake

MILESTONE = "tests/test_ch16_kv_cache.py"
UPDATE = f"{MILESTONE}::test_update_stores_new_keys_and_returns_all_so_far"
CAPACITY = f"{MILESTONE}::test_capacity_is_enforced_before_writing"
NEW_CACHE = f"{MILESTONE}::test_a_new_cache_is_empty_zeroed_and_owns_a_buffer_per_layer_and_tensor"
KEYS = "self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]"
VALUES = "self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]"

MISTAKES = [
    Mistake("kv_cache.py", "KVCache.__init__",
            before=KEYS,
            after="self.k = [torch.zeros(shape, dtype=dtype, device=device)] * num_layers",
            rule="each layer has storage of its own: a list of one tensor repeated is one tensor shared by every layer",
            expect="no two layers share storage",
            tests=(NEW_CACHE,)),
    Mistake("kv_cache.py", "KVCache.__init__",
            before=VALUES,
            after="self.v = self.k",
            rule="keys and values are kept in tensors of their own",
            expect="keys and values do not share storage",
            tests=(NEW_CACHE,)),
    Mistake("kv_cache.py", "KVCache.__init__",
            before="shape = (batch, kv_heads, max_len, head_dim)",
            after="shape = (batch, max_len, kv_heads, head_dim)",
            rule="a layer's keys are one tensor [batch, kv_heads, max_len, head_dim]: slots on the third axis, "
                 "so a slice of it is attention's input",
            expect="[batch, kv_heads, max_len, head_dim]",
            tests=(NEW_CACHE,)),
    Mistake("kv_cache.py", "KVCache.__init__",
            before=KEYS,
            after="self.k = [torch.zeros(shape, device=device) for _ in range(num_layers)]",
            rule="the cache is kept in the dtype asked for (the model's), not float32 whatever the model",
            expect="in the dtype asked",
            tests=(NEW_CACHE,)),
    Mistake("kv_cache.py", "KVCache.__init__",
            before=VALUES,
            after=VALUES.replace("torch.zeros", "torch.empty"),
            rule="every slot reads 0 until written: Chapter 19 gives attention whole buffers, and leftover memory "
                 "can be NaN, which a weight of 0 does not cancel",
            expect="every slot reads 0 until written",
            tests=(NEW_CACHE,)),
    Mistake("kv_cache.py", "KVCache.update",
            before="return self.k[layer][:, :, :end], self.v[layer][:, :, :end]",
            after="return self.k[layer][:, :, :end].clone(), self.v[layer][:, :, :end].clone()",
            rule="update returns views into the cache, never copies: copying every step undoes the point",
            expect="not copies",
            tests=(UPDATE,)),
    Mistake("kv_cache.py", "KVCache.update",
            before="return self.k[layer][:, :, :end], self.v[layer][:, :, :end]",
            after="return self.k[layer][:, :, self.length:end], self.v[layer][:, :, self.length:end]",
            rule="update returns the keys and values of every slot so far, not only the new ones",
            expect="all 4 slots so far",
            tests=(UPDATE,)),
    Mistake("kv_cache.py", "KVCache.update",
            before="self.k[layer][:, :, self.length:end] = k",
            after="self.k[layer][:, :, :k.shape[2]] = k",
            rule="new keys are stored after the ones already cached, at slots length .. length + T - 1",
            expect="should hold step 1 then step 2",
            tests=(UPDATE,)),
    Mistake("kv_cache.py", "KVCache.update",
            before="if end > self.max_len:",
            after="if end >= self.max_len:",
            rule="the new tokens may fill the cache exactly to max_len",
            expect="exactly to max_len",
            tests=(CAPACITY,)),
    Mistake("kv_cache.py", "KVCache.update",
            before="if end > self.max_len:",
            after="if self.length > self.max_len:",
            rule="tokens that do not fit are refused with a ValueError before anything is written",
            expect="raised before writing",
            tests=(CAPACITY,)),
    Mistake("sampling.py", "generate_cached",
            before="feed = [token]",
            after="feed = feed + [token]",
            rule="after the prompt, every call feeds exactly one token, the newest",
            expect="each new token alone",
            tests=(f"{MILESTONE}::test_cached_generate_feeds_the_prompt_once_then_one_token_per_call",)),
    Mistake("sampling.py", "generate_cached",
            before="_is_stop(token, eos_token_id, stop_token_ids)",
            after="_is_stop(token, eos_token_id, ())",
            rule="a stop token ends the generation, included in the output",
            expect="stop token included",
            tests=(f"{MILESTONE}::test_stop_tokens_end_cached_generation",)),
    Mistake("sampling.py", "generate_cached",
            before="cache.length + len(feed) < limit",
            after="cache.length + len(feed) + 1 < limit",
            rule="the sequence may grow to exactly the context limit",
            expect="may grow to exactly",
            tests=(f"{MILESTONE}::test_generation_stops_at_the_context_limit",)),
    Mistake("sampling.py", "generate_cached",
            before="len(out) < max_new_tokens",
            after="len(out) <= max_new_tokens",
            rule="generation stops after max_new_tokens tokens",
            expect="differs from full recompute",
            tests=(f"{MILESTONE}::test_greedy_cached_equals_recompute",)),
]

DECIDES = {
    "KVCache.__init__": "what the cache owns and in what layout (one zeroed buffer per layer for keys and one for "
                        "values, sized once for max_len slots, nothing shared), and where the single write position "
                        "lives",
    "KVCache.update": "how to append into a buffer allocated once without copying what is there, what attention "
                      "gets back (views of every filled slot), and why the write position is not moved here",
    "generate_cached": "what each call to the model must be fed so that every token goes through it exactly once, "
                       "and how large the cache must be for the prompt, the new tokens and the context limit",
}
DESIGN = ("KVCache.__init__", "generate_cached")
