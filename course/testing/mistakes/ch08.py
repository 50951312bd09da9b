"""Chapter 8: the batched filters, sample() and generation by full recompute."""
from . import Mistake

MILESTONE = "tests/test_ch08_sampling_and_generate.py"
FREQUENCIES = f"{MILESTONE}::test_frequencies_match_the_filtered_softmax"
TOP_K_TOP_P = (f"{MILESTONE}::test_top_k_and_top_p_keep_what_transformers_warpers_keep",)
MIN_P = (f"{MILESTONE}::test_min_p_keeps_what_transformers_warper_keeps",)

MISTAKES = [
    Mistake("sampling.py", "sample",
            before="chosen = rows.float().argmax(dim=-1)",
            after="chosen = (rows.shape[-1] - 1) - rows.float().flip(-1).argmax(dim=-1)",
            rule="greedy breaks exact ties by the lowest id",
            expect="lowest id among ties", tests=(f"{MILESTONE}::test_greedy",)),
    Mistake("sampling.py", "sample",
            before="scaled = rows.double() / temperature",
            after="scaled = rows.double()",
            rule="the draw follows softmax(logits / temperature)",
            expect="softmax(logits / temperature)", tests=(FREQUENCIES,)),
    Mistake("sampling.py", "sample",
            before="top_k if 0 < top_k < vocab else vocab",
            after="top_k",
            rule="top_k = 0 is off: apply_top_k_top_p then gets the vocabulary size, not a k of 0",
            expect="with or without top_k", tests=(FREQUENCIES,)),
    Mistake("sampling.py", "sample",
            before="scaled.masked_fill_(scaled < kth, float(\"-inf\"))",
            after="scaled.masked_fill_(scaled <= kth, float(\"-inf\"))",
            rule="top_k keeps the k highest logits, the k-th included",
            expect="top_k keeps the k highest logits", tests=(FREQUENCIES,)),
    Mistake("sampling.py", "sample",
            before="if top_p < 1.0:",
            after="if top_p < 1.0 and not 0 < top_k < vocab:",
            rule="top_p filters whether or not top_k is on",
            expect="with or without top_k", tests=(FREQUENCIES,)),
    Mistake("sampling.py", "sample",
            before="""        if top_p < 1.0:
            apply_top_k_top_p(""",
            after="""        if min_p > 0.0:
            apply_min_p(scaled, scaled.new_full((count,), min_p))
        if top_p < 1.0:
            apply_top_k_top_p(""",
            rule="min_p comes last: it filters what top_k and top_p kept",
            expect="applied after top_k and top_p", tests=(FREQUENCIES,)),
    Mistake("sampling.py", "sample",
            before="1, generator=generator)",
            after="1)",
            rule="every random draw uses the given generator",
            expect="same seeded generator", tests=(f"{MILESTONE}::test_seeded_generator_reproduces_draws",)),
    Mistake("sampling.py", "apply_top_k_top_p",
            before="(top_k.clamp(1, vocab) - 1)",
            after="top_k.clamp(1, vocab - 1)",
            rule="top_k keeps the k highest logits: the threshold is the k-th, not the (k+1)-th",
            expect="top_k keeps every token whose logit is >= the row's k-th highest", tests=TOP_K_TOP_P),
    Mistake("sampling.py", "apply_top_k_top_p",
            before="drop = (mass_before >= top_p.unsqueeze(1)) & (top_p.unsqueeze(1) < 1)",
            after="drop = mass_before >= top_p.unsqueeze(1)",
            rule="top_p = 1 is off and keeps every token, even where a float32 mass before a token rounds to 1",
            expect="top_p = 1 keeps every token", tests=TOP_K_TOP_P),
    Mistake("sampling.py", "apply_top_k_top_p",
            before="mass_before = probs.cumsum(dim=-1) - probs",
            after="mass_before = probs.cumsum(dim=-1)",
            rule="top_p keeps the token that crosses top_p: it looks at the mass strictly before a token",
            expect="mass strictly before", tests=TOP_K_TOP_P),
    Mistake("sampling.py", "apply_top_k_top_p",
            before="probs = torch.softmax(ordered, dim=-1)",
            after="probs = torch.softmax(logits.sort(dim=-1, descending=True).values, dim=-1)",
            rule="top_p is measured on the distribution that top_k left, renormalised",
            expect="distribution that top_k", tests=TOP_K_TOP_P),
    Mistake("sampling.py", "apply_top_k_top_p",
            before="ordered = ordered.masked_fill(ordered < kth, float(\"-inf\"))",
            after="ordered = ordered.masked_fill(torch.arange(vocab) >= top_k.unsqueeze(1), float(\"-inf\"))",
            rule="top_k keeps every token tied with the k-th highest logit, not exactly k of them",
            expect="ties with the k-th included", tests=TOP_K_TOP_P),
    Mistake("sampling.py", "apply_top_k_top_p",
            before="return logits.scatter_(1, order, ordered)",
            after="return logits.scatter(1, order, ordered)",
            rule="the filter works in place: the engine's samplers keep filtering the tensor they passed",
            expect="works in place", tests=TOP_K_TOP_P),
    Mistake("sampling.py", "apply_min_p",
            before="floor = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)",
            after="floor = min_p.unsqueeze(1)",
            rule="min_p is relative to the most likely token's probability",
            expect="at least min_p times the most likely token's", tests=MIN_P),
    Mistake("sampling.py", "apply_min_p",
            before="probs < floor",
            after="probs <= floor",
            rule="a token exactly at the floor survives, so min_p = 1 keeps the most likely token",
            expect="min_p = 1", tests=MIN_P),
    Mistake("sampling.py", "apply_min_p",
            before="probs = torch.softmax(logits, dim=-1)",
            after="probs = torch.softmax(logits, dim=0)",
            rule="the probabilities are each row's own softmax",
            expect="softmax of the row as given", tests=MIN_P),
    Mistake("sampling.py", "apply_min_p",
            before="return logits.masked_fill_(probs < floor, float(\"-inf\"))",
            after="return logits.masked_fill(probs < floor, float(\"-inf\"))",
            rule="the filter works in place: the engine's samplers keep filtering the tensor they passed",
            expect="works in place", tests=MIN_P),
    Mistake("sampling.py", "apply_min_p",
            before="""    probs = torch.softmax(logits, dim=-1)
    floor = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill_(probs < floor, float("-inf"))""",
            after="""    for row in range(logits.shape[0]):
        probs = torch.softmax(logits[row], dim=-1)
        logits[row].masked_fill_(probs < probs.max() * min_p[row], float("-inf"))
    return logits""",
            rule="one pass over the whole [R, V] matrix, no Python loop over rows",
            expect="same few operations on the whole [R, V] matrix",
            tests=(f"{MILESTONE}::test_filters_cost_a_fixed_number_of_operations",)),
    Mistake("sampling.py", "generate_recompute",
            before="""        out.append(token)
        if _is_stop(token, eos_token_id, stop_token_ids):
            break""",
            after="""        if _is_stop(token, eos_token_id, stop_token_ids):
            break
        out.append(token)""",
            rule="the stop token ends the output and is part of it",
            expect="is part of it", tests=(f"{MILESTONE}::test_stop_tokens",)),
    Mistake("sampling.py", "generate_recompute",
            before="len(tokens) < limit",
            after="len(tokens) <= limit",
            rule="the sequence may grow to the context limit, not past it",
            expect="leaves room for 3 new tokens", tests=(f"{MILESTONE}::test_context_limit",)),
    Mistake("sampling.py", "generate_recompute",
            before="token = _next_token(logits, options)",
            after="token = int(sample(logits[0, 0], **options))",
            rule="each new token comes from the logits at the last position",
            expect="logits at the last position", tests=(f"{MILESTONE}::test_greedy_matches_an_argmax_loop",)),
    Mistake("sampling.py", "generate_recompute",
            before="model(torch.tensor([tokens], device=device))",
            after="model(torch.tensor([tokens[-1:]], device=device))",
            rule="without a cache every step feeds the whole sequence so far",
            expect="whole sequence so far", tests=(f"{MILESTONE}::test_recompute_feeds_the_whole_sequence",)),
]

# What the learner must decide at each stub (one sentence each), and the chapter's design stubs.
DECIDES = {
    "sample": (
        "how to turn rows of logits into the distribution the active filters leave (robust at "
        "extreme temperatures and thresholds, greedy below the threshold) and draw from it with "
        "exactly one seeded multinomial in vocabulary order"
    ),
    "apply_top_k_top_p": (
        "how to find every row's k-th largest logit and its smallest top-p set at once, without a "
        "loop over rows, with settings that differ per row or are off, and what happens to ties "
        "at the threshold"
    ),
    "apply_min_p": (
        "how to state a per-row floor relative to the row's most likely token as one masked "
        "operation, leaving rows with min_p 0 untouched"
    ),
    "generate_recompute": (
        "what the model is fed at each step (the whole sequence so far), which position's "
        "logits choose the next token, and which of the stopping rules (length, stop tokens, "
        "context limit) ends the loop"
    ),
}
DESIGN = ("apply_top_k_top_p", "sample")
