"""Chapter 37: prompt lookup, the warped rows of the verifier, settling a verified step."""
from . import Mistake

MILESTONE = "tests/test_ch37_speculative_decoding_in_the_engine.py"
LOOKUP = f"{MILESTONE}::test_ngram_lookup_finds_the_latest_repeat_of_the_tail"
WARPS = (MILESTONE, "-k", "warped_rows")
STOPS = f"{MILESTONE}::test_stop_rules_apply_to_accepted_tokens_in_order"
TRIMS = f"{MILESTONE}::test_rejected_drafts_are_trimmed_and_never_published"

MISTAKES = [
    # --- propose_ngram ----------------------------------------------------------------------
    Mistake("serve/spec_decode.py", "propose_ngram",
            before="for start in range(len(tokens) - n - 1, -1, -1):",
            after="for start in range(0, len(tokens) - n):",
            rule="the guess follows the LATEST earlier occurrence of the tail",
            expect="latest earlier occurrence", tests=(LOOKUP,)),
    Mistake("serve/spec_decode.py", "propose_ngram",
            before="for n in range(max_n, min_n - 1, -1):",
            after="for n in range(min_n, max_n + 1):",
            rule="the LONGEST recurring tail decides",
            expect="longest recurring tail", tests=(LOOKUP,)),
    Mistake("serve/spec_decode.py", "propose_ngram",
            before="for start in range(len(tokens) - n - 1, -1, -1):",
            after="for start in range(len(tokens) - n, -1, -1):",
            rule="the tail itself is not an earlier occurrence: a match starts before the tail does",
            expect="latest earlier occurrence", tests=(LOOKUP,)),
    Mistake("serve/spec_decode.py", "propose_ngram",
            before="for n in range(max_n, min_n - 1, -1):",
            after="for n in range(max_n, 0, -1):",
            rule="tails shorter than min_n never decide",
            expect="min_n=2 refuses", tests=(LOOKUP,)),
    # --- warped_probs -----------------------------------------------------------------------
    Mistake("serve/spec_decode.py", "warped_probs",
            before="scaled = logits.double() / params.temperature",
            after="scaled = logits.float() / params.temperature",
            rule="warped rows are float64, as Chapter 8's sample computes them",
            expect="float64", tests=WARPS),
    Mistake("serve/spec_decode.py", "warped_probs",
            before="scaled = logits.double() / params.temperature",
            after="scaled = logits.double()",
            rule="the logits are divided by the temperature before any cut",
            expect="chapter 8", tests=WARPS),
    Mistake("serve/spec_decode.py", "warped_probs",
            before="    apply_top_k_top_p(scaled, top_k, scaled.new_full((rows,), params.top_p))\n"
                   "    apply_min_p(scaled, scaled.new_full((rows,), params.min_p))\n",
            after="    apply_min_p(scaled, scaled.new_full((rows,), params.min_p))\n"
                  "    apply_top_k_top_p(scaled, top_k, scaled.new_full((rows,), params.top_p))\n",
            rule="the cuts apply in sample's order: top-k, then top-p, then min-p",
            expect="chapter 8", tests=WARPS),
    Mistake("serve/spec_decode.py", "warped_probs",
            before="params.top_k if 0 < params.top_k < vocab else vocab",
            after="params.top_k",
            rule="top_k 0 means no top-k cut, as in Chapter 8's sample",
            expect="chapter 8", tests=WARPS),
    # --- settle -----------------------------------------------------------------------------
    Mistake("serve/spec_decode.py", "settle",
            before="        if reason is not None:\n            break\n",
            after="",
            rule="the first accepted token that stops the request is its last: those after it are dropped",
            expect="must be dropped", tests=(STOPS,)),
    Mistake("serve/spec_decode.py", "settle",
            before="    trim(request, request.num_computed_tokens)\n",
            after="",
            rule="blocks that held only rejected drafts go back to the pool",
            expect="not trimmed", tests=(TRIMS,)),
    Mistake("serve/spec_decode.py", "settle",
            before="request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens - 1)",
            after="pass",
            rule="rows of rejected drafts hold no valid K/V: only the kept tokens, less the newest, count as computed",
            expect="rejected draft", tests=(TRIMS,)),
]

DECIDES = {
    "propose_ngram":
        "how to find the longest tail that recurs and its latest earlier occurrence, and how far its continuation "
        "may run",
    "warped_probs":
        "how to turn logits into exactly the distribution Chapter 8's sampler draws from, in float64, for target "
        "and draft alike",
    "settle":
        "how to reconcile a verified step's tokens, computed count and blocks so no rejected draft keeps K/V, a "
        "block or a key",
}

DESIGN = ("settle", "propose_ngram")
