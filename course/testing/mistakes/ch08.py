"""Chapter 8: sample() and generation by full recompute."""
from . import Mistake

MILESTONE = "tests/test_ch08_sampling_and_generate.py"
FREQUENCIES = f"{MILESTONE}::test_frequencies_match_the_filtered_softmax"

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
            before="scaled < kth",
            after="scaled <= kth",
            rule="top_k keeps the k highest logits, the k-th included",
            expect="top_k keeps the k highest logits", tests=(FREQUENCIES,)),
    Mistake("sampling.py", "sample",
            before="drop_sorted = mass_before >= top_p",
            after="drop_sorted = sorted_probs.cumsum(dim=-1) > top_p",
            rule="top_p keeps the token whose probability makes the mass reach top_p",
            expect="whose mass reaches top_p", tests=(FREQUENCIES,)),
    Mistake("sampling.py", "sample",
            before="floor = probs.max(dim=-1, keepdim=True).values * min_p",
            after="floor = min_p",
            rule="min_p is relative to the most likely token's probability",
            expect="times the top one's", tests=(FREQUENCIES,)),
    Mistake("sampling.py", "sample",
            before="1, generator=generator)",
            after="1)",
            rule="every random draw uses the given generator",
            expect="same seeded generator", tests=(f"{MILESTONE}::test_seeded_generator_reproduces_draws",)),
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
    "generate_recompute": (
        "what the model is fed at each step (the whole sequence so far), which position's "
        "logits choose the next token, and which of the stopping rules (length, stop tokens, "
        "context limit) ends the loop"
    ),
}
DESIGN = ("sample",)
