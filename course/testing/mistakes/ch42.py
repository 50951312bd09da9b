"""Chapter 42: Llama 3's rotary frequencies, the sliding window, latent attention in the engine."""
from . import Mistake

MILESTONE = "tests/test_ch42_more_model_families.py"
FREQUENCIES = f"{MILESTONE}::test_llama3_frequencies_match_transformers"
WINDOW = f"{MILESTONE}::test_sliding_window_mask_rule"
LATENT = f"{MILESTONE}::test_family_engine_core_matches_solo_generate[recompute-deepseek v2 latent attention]"

MISTAKES = [
    Mistake("families.py", "llama3_inv_freq",
            before="return (1 - s) * f / factor + s * f",
            after="return s * f / factor + (1 - s) * f",
            rule="the blend's weight s is on the unscaled f",
            expect="blended with the weight", tests=(FREQUENCIES,)),
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
