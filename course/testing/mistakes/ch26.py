"""Chapter 26: speculative decoding."""
from . import Mistake

MILESTONE = "tests/test_ch26_speculative_decoding.py"
GREEDY_ACCEPT = f"{MILESTONE}::test_accept_greedy_keeps_the_matching_prefix_plus_one"
PROPOSE = f"{MILESTONE}::test_propose_guesses_what_the_draft_would_generate"
SAMPLED = f"{MILESTONE}::test_sampled_acceptance_keeps_the_target_distribution"
PARITY = f"{MILESTONE}::test_greedy_output_equals_target_solo_generate"
COUNTS = f"{MILESTONE}::test_perfect_draft_counts"
DRAFT_CACHE = f"{MILESTONE}::test_the_drafts_cache_never_holds_a_rejected_guess"

MISTAKES = [
    Mistake("speculative.py", "accept_greedy",
            before="            break\n",
            after="            continue\n",
            rule="only the guesses before the first mismatch are accepted",
            expect="up to the first mismatch",
            tests=(GREEDY_ACCEPT,)),
    Mistake("speculative.py", "accept_greedy",
            before="    emitted.append(choices[len(emitted)])\n",
            after="",
            rule="the target's own choice after the accepted guesses is emitted too",
            expect="the target's own choice there",
            tests=(GREEDY_ACCEPT,)),
    Mistake("speculative.py", "accept_greedy",
            before="choices[len(emitted)]",
            after="choices[-1]",
            rule="the extra token is the target's choice at the first mismatch",
            expect="the target's own choice there",
            tests=(GREEDY_ACCEPT,)),
    Mistake("speculative.py", "accept_greedy",
            before="zip(draft_tokens, choices)",
            after="zip(draft_tokens, choices[1:])",
            rule="each guess is judged against the target's choice for its own slot, not the next one",
            expect="up to the first mismatch",
            tests=(GREEDY_ACCEPT,)),
    Mistake("speculative.py", "speculative_generate",
            before="_last_logits(target, [committed[-1]] + guesses, t_cache)",
            after="_last_logits(target, guesses or [committed[-1]], t_cache)",
            rule="the verify gives k + 1 predictions: the last committed token is fed before the guesses",
            expect="whatever the draft guesses",
            tests=(PARITY,)),
    Mistake("speculative.py", "propose",
            before="step = [token]",
            after="step = step + [token]",
            rule="after the prompt, the draft is fed each guess alone",
            expect="each guess alone",
            tests=(PROPOSE,)),
    Mistake("speculative.py", "propose",
            before="for _ in range(k):",
            after="for _ in range(k - 1):",
            rule="propose returns k guesses",
            expect="draft's greedy continuation",
            tests=(PROPOSE,)),
    Mistake("speculative.py", "propose",
            before="_last_logits(draft, step, cache)[-1]",
            after="_last_logits(draft, step, cache)[0]",
            rule="a guess comes from the logits of the last token fed",
            expect="draft's greedy continuation",
            tests=(PROPOSE,)),
    Mistake("speculative.py", "accept_sampled",
            before="if u * q[guess] <= p[guess]:",
            after="if True:",
            rule="a guess is accepted with probability min(1, p/q), not always",
            expect="should follow the target row",
            tests=(SAMPLED,)),
    Mistake("speculative.py", "accept_sampled",
            before="leftover = (p - q).clamp_min(0.0)",
            after="leftover = p",
            rule="a rejected guess is replaced by a draw from max(p - q, 0), not from p",
            expect="should follow the target row",
            tests=(SAMPLED,)),
    Mistake("speculative.py", "accept_sampled",
            before="if u * q[guess] <= p[guess]:",
            after="if u * p[guess] <= q[guess]:",
            rule="a guess is accepted with probability min(1, p/q), not min(1, q/p)",
            expect="should follow the target row",
            tests=(SAMPLED,)),
    Mistake("speculative.py", "speculative_generate",
            before="t_cache.truncate(before + len(emitted))",
            after="t_cache.truncate(t_cache.length)",
            rule="rejected guesses leave the target's cache",
            expect="whatever the draft guesses",
            tests=(PARITY,)),
    Mistake("speculative.py", "speculative_generate",
            before="t_cache.truncate(before + len(emitted))",
            after="t_cache.truncate(before + len(emitted) - 1)",
            rule="the target's cache keeps the last committed token and every accepted guess",
            expect="whatever the draft guesses",
            tests=(PARITY,)),
    Mistake("speculative.py", "speculative_generate",
            before="d_cache.truncate(min(d_cache.length, t_cache.length))",
            after="pass",
            rule="the draft's cache is rolled back too: it never holds a rejected guess (the target's verify "
                 "hides a stale draft, so only the cache shows it)",
            expect="the draft's cache never holds a rejected guess",
            tests=(DRAFT_CACHE,)),
    Mistake("speculative.py", "speculative_generate",
            before="propose(draft, d_cache, committed[d_cache.length:],",
            after="propose(draft, d_cache, committed[-1:],",
            rule="the draft sees every committed token before it guesses (the prompt, and an accepted last guess "
                 "it was never fed), each in its own position",
            expect="sees every committed token before it guesses",
            tests=(DRAFT_CACHE,)),
    Mistake("speculative.py", "speculative_generate",
            before="min(k, max_new_tokens - len(out) - 1)",
            after="k",
            rule="no guesses past max_new_tokens: the last round proposes fewer",
            expect="guesses proposed",
            tests=(COUNTS,)),
    Mistake("speculative.py", "speculative_generate",
            before="out = out[:stop + 1] if stop is not None else out[:max_new_tokens]",
            after="out = out[:max_new_tokens]",
            rule="the stop token is the last token returned; accepted guesses after it are dropped",
            expect="accepted guesses after it are dropped",
            tests=(f"{MILESTONE}::test_stops_at_a_stop_token_like_generate",)),
]

DECIDES = {
    "propose": (
        "which tokens the draft must be fed before guessing, and which guesses end up in its cache (all but "
        "the last)"),
    "accept_greedy": (
        "where the target first disagrees with the draft, and which token of the target's own ends the round"),
    "accept_sampled": (
        "how to accept or reject each guess and what to draw from after a rejection so that the output "
        "follows the target exactly"),
    "speculative_generate": (
        "where the state of a round lives (two caches, the committed tokens, the token not yet fed) and how "
        "both caches are rolled back so no rejected guess survives"),
}

DESIGN = ("speculative_generate",)
