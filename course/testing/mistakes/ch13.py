"""Chapter 13: the parity harness (logit statistics, where greedy generation parts)."""
from . import Mistake

MILESTONE = "tests/test_ch13_parity.py"
LOGITS = f"{MILESTONE}::test_planted_divergence_in_the_logits"
GREEDY = f"{MILESTONE}::test_planted_divergence_found_at_the_right_token"

MISTAKES = [
    Mistake("parity.py", "compare_logits",
            before="row = diff.max(dim=-1).values",
            after="row = diff.max(dim=0).values",
            rule="per_position holds one maximum per position of each prompt (over the vocabulary)",
            expect="one entry per position", tests=(f"{MILESTONE}::test_identical_models_report_parity",)),
    Mistake("parity.py", "compare_logits",
            before="(index, int(row.argmax()))",
            after="(index, int(diff.argmax()))",
            rule="worst is (prompt index, position) of the largest difference",
            expect="worst is (prompt index, position)", tests=(LOGITS,)),
    Mistake("parity.py", "compare_logits",
            before="""        total += float(diff.sum())
        count += diff.numel()""",
            after="""        total += float(diff.mean())
        count += 1""",
            rule="mean_abs weighs every logit equally, not every prompt",
            expect="weighs every logit of every prompt equally", tests=(LOGITS,)),
    Mistake("parity.py", "compare_logits",
            before="positions += a.shape[0]",
            after="positions += a.numel()",
            rule="argmax_agreement is a fraction of positions, not of logits",
            expect="fraction of all positions", tests=(LOGITS,)),
    Mistake("parity.py", "greedy_parity",
            before="context = list(prompt) + out_a[:step]",
            after="context = list(prompt) + out_a[:step + 1]",
            rule="the context is the prompt plus the tokens both models agreed on",
            expect="tokens both agreed on", tests=(GREEDY,)),
    Mistake("parity.py", "greedy_parity",
            before="margin_b=float(lb[got] - lb[expected])",
            after="margin_b=float(lb[expected] - lb[got])",
            rule="margin_b is b's logit of its own token (got) minus expected",
            expect="prefers its own token", tests=(GREEDY,)),
    Mistake("parity.py", "greedy_parity",
            before="prompt_index=index",
            after="prompt_index=len(found)",
            rule="a divergence names the prompt's index in the list, not its rank among divergences",
            expect="transformers' generate parts at prompt 1", tests=(GREEDY,)),
    Mistake("parity.py", "greedy_parity",
            before="""        if step >= min(len(out_a), len(out_b)):
            raise""",
            after="""        if step > min(len(out_a), len(out_b)):
            raise""",
            rule="an output that stops before the other is a ValueError naming the prompt, not a divergence",
            expect="stopping rule is not a divergence",
            tests=(f"{MILESTONE}::test_an_output_that_stops_early_is_an_error",)),
]

# What the learner must decide at each stub (one sentence each), and the chapter's design stubs.
DECIDES = {
    "compare_logits": (
        "how to fold prompts of different lengths into one max, one mean that weighs every "
        "logit equally, an argmax agreement over positions and a per-position curve, while "
        "remembering where the worst difference was"
    ),
    "greedy_parity": (
        "what evidence to keep when two greedy runs part (the first differing step, the context "
        "both saw, each model's margin at that context) and how to tell a different stopping "
        "rule from a numerical divergence"
    ),
}
DESIGN = ("greedy_parity",)
