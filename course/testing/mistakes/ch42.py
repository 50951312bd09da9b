"""Chapter 42: Llama 3's rotary frequencies, the sliding window, latent attention in the engine."""
from . import Mistake

MILESTONE = "tests/test_ch42_more_model_families.py"
FREQUENCIES = f"{MILESTONE}::test_llama3_frequencies_match_transformers"
WINDOW = f"{MILESTONE}::test_sliding_window_mask_rule"
LATENT = f"{MILESTONE}::test_family_engine_core_matches_solo_generate[recompute-deepseek v2 latent attention]"
ABSORBING = (MILESTONE, "-k", "test_family_logits_match_transformers and deepseek")

MISTAKES = [
    Mistake("families.py", "llama3_inv_freq",
            before="return (1 - s) * f / factor + s * f",
            after="return s * f / factor + (1 - s) * f",
            rule="the blend's weight s is on the unscaled f",
            expect="blended with the weight", tests=(FREQUENCIES,)),
    Mistake("mla.py", "LatentAttention.absorbed",
            before="entry = torch.cat([self.kv_a_layernorm(c).unsqueeze(-2), k_rope], dim=-1)",
            after="entry = torch.cat([c.unsqueeze(-2), k_rope], dim=-1)",
            rule="a token's entry holds its latent after kv_a_layernorm",
            expect="NORMALISED latent", tests=ABSORBING),
    Mistake("mla.py", "LatentAttention.absorbed",
            before="k_rope = apply_rope(pairs_to_halves(k_rope).unsqueeze(-2), cos, sin)",
            after="k_rope = apply_rope(k_rope.unsqueeze(-2), cos, sin)",
            rule="the shared rotary key is reordered like the query's rotary part before rotation",
            expect="reordered by pairs_to_halves", tests=ABSORBING),
    Mistake("mla.py", "LatentAttention.absorbed",
            before="q_rope = apply_rope(pairs_to_halves(q_rope), cos, sin)",
            after="q_rope = pairs_to_halves(q_rope)",
            rule="the query's rotary part is rotated at its position",
            expect="rotated q_rope", tests=ABSORBING),
    Mistake("mla.py", "LatentAttention.absorbed",
            before="q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(h)))",
            after="q = self.q_b_proj(self.q_a_proj(h))",
            rule="low-rank queries are normalised between their two projections",
            expect="q_a_layernorm", tests=ABSORBING),
    Mistake("mla.py", "LatentAttention.absorbed",
            before='q_latent = torch.einsum("...hn,hnl->...hl", q_nope, w_uk)',
            after='q_latent = torch.einsum("...hn,hnl->...hl", q_nope, w_uk.flip(0))',
            rule="each head absorbs its own W_UK",
            expect="W_UK^T q_nope", tests=ABSORBING),
    Mistake("families.py", "llama3_inv_freq",
            before="wavelength = 2 * torch.pi / f",
            after="wavelength = 1 / f",
            rule="a channel's wavelength is 2 pi / f",
            expect="wavelength 2 pi / f", tests=(FREQUENCIES,)),
    Mistake("families.py", "llama3_inv_freq",
            before=".clamp(0.0, 1.0)",
            after="",
            rule="fast channels keep f and slow ones get f / factor: the blend weight stays in [0, 1]",
            expect="keeps f", tests=(FREQUENCIES,)),
    Mistake("families.py", "sliding_window_allowed",
            before="allowed = k_slots > q_slots[..., None] - window",
            after="allowed = k_slots >= q_slots[..., None] - window",
            rule="a query sees itself and the window - 1 slots before it, not window slots before it",
            expect="the window - 1 slots before it", tests=(WINDOW,)),
    Mistake("families.py", "sliding_window_allowed",
            before="k_slots = torch.arange(int(q_slots.max()) + 1, device=q_slots.device)",
            after="k_slots = torch.arange(int(q_slots.max()), device=q_slots.device)",
            rule="the keys are slots 0 .. the largest query slot, that slot included",
            expect="the keys are slots", tests=(WINDOW,)),
    Mistake("families.py", "sliding_window_allowed",
            before="return allowed.reshape(-1, 1, *allowed.shape[-2:])",
            after="return allowed[None, None]",
            rule="query slots [B, Tq] give one mask per sequence, [B, 1, Tq, K]",
            expect="one mask per sequence", tests=(WINDOW,)),
    Mistake("mla.py", "LatentAttention.paged_forward",
            before=("backend.write(kv, entry, entry, meta)\n"
                    "        return self.output(backend.forward(q, kv, meta, scale=self.scale))"),
            after=("out = self.output(backend.forward(q, kv, meta, scale=self.scale))\n"
                   "        backend.write(kv, entry, entry, meta)\n        return out"),
            rule="this step's entries are written to the pool before attention reads it",
            expect="written to the pool before attention reads it", tests=(LATENT,)),
    Mistake("mla.py", "LatentAttention.paged_forward",
            before="scale=self.scale",
            after="scale=None",
            rule="the softmax scale is self.scale, not one derived from the query's width",
            expect="softmax scale is", tests=(LATENT,)),
    Mistake("mla.py", "LatentAttention.paged_forward",
            before="backend.write(kv, entry, entry, meta)",
            after="backend.write(kv, entry, torch.zeros_like(entry), meta)",
            rule="one entry per token is both the key and the value",
            expect="both key and value", tests=(LATENT,)),
]

DECIDES = {
    "llama3_inv_freq":
        "how to classify each rotary channel by its wavelength against the original context and blend the scaled "
        "and unscaled frequencies in between, as one tensor expression",
    "sliding_window_allowed":
        "which key slots a query may see under a window (itself and window - 1 before it), built for one or many "
        "rows of query slots at once",
    "LatentAttention.absorbed":
        "what a token leaves in the cache (one small entry shared by every head) and what each head's query must "
        "absorb so their dot product is the model's attention score",
    "LatentAttention.paged_forward":
        "in which order the latent entries are written and read through the backend, as one key/value head, with "
        "the model's own softmax scale",
}

DESIGN = ("LatentAttention.absorbed",)
