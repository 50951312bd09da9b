"""Chapter 34: the full sampler's penalties and log-probabilities (its top-k/top-p/min-p filters are
Chapter 8's: course/testing/mistakes/ch08.py)."""
from . import Mistake

MILESTONE = "tests/test_ch34_full_sampler.py"
PENALTIES = (f"{MILESTONE}::test_penalties_match_vllm_formulas_and_transformers",)
LOGPROBS = (f"{MILESTONE}::test_token_logprobs_rank_ties_and_top_lists",)

MISTAKES = [
    Mistake("serve/sampler.py", "apply_penalties",
            before="seen = prompt_mask | (output_counts > 0)",
            after="seen = prompt_mask",
            rule="the repetition penalty touches tokens seen in the prompt or the output",
            expect="seen in the prompt or the output", tests=PENALTIES),
    Mistake("serve/sampler.py", "apply_penalties",
            before="torch.where(logits > 0, logits / factor, logits * factor)",
            after="logits / factor",
            rule="the repetition penalty divides a positive logit but multiplies a negative one",
            expect="a negative one multiplied", tests=PENALTIES),
    Mistake("serve/sampler.py", "apply_penalties",
            before="torch.where(logits > 0, logits / factor, logits * factor)",
            after="(logits > 0) * logits / factor + (logits <= 0) * logits * factor",
            rule="a forbidden token (-inf) stays -inf: masks multiplied into -inf give NaN",
            expect="stays -inf", tests=PENALTIES),
    Mistake("serve/sampler.py", "apply_penalties",
            before="frequency.unsqueeze(1) * output_counts.to(logits.dtype)",
            after="frequency.unsqueeze(1) * (output_counts > 0).to(logits.dtype)",
            rule="the frequency penalty counts every occurrence of the token in the output",
            expect="once per occurrence", tests=PENALTIES),
    Mistake("serve/sampler.py", "apply_penalties",
            before="presence.unsqueeze(1) * (output_counts > 0).to(logits.dtype)",
            after="presence.unsqueeze(1) * seen.to(logits.dtype)",
            rule="the presence penalty looks at output tokens only, never at prompt-only tokens",
            expect="never for prompt-only tokens", tests=PENALTIES),
    Mistake("serve/sampler.py", "apply_penalties",
            before="presence.unsqueeze(1) * (output_counts > 0).to(logits.dtype)",
            after="presence.unsqueeze(1) * output_counts.to(logits.dtype)",
            rule="the presence penalty is subtracted once per token, whatever its count",
            expect="whatever its count", tests=PENALTIES),
    Mistake("serve/sampler.py", "token_logprobs",
            before="ranks = (logprobs > chosen).sum(dim=-1) + 1",
            after="ranks = (logprobs >= chosen).sum(dim=-1)",
            rule="ties share a rank: the rank counts tokens with a strictly greater logprob",
            expect="ties share a rank", tests=LOGPROBS),
    Mistake("serve/sampler.py", "token_logprobs",
            before="torch.log_softmax(logits.float(), dim=-1)",
            after="torch.log_softmax(logits, dim=-1)",
            rule="log-probabilities are computed in float32, whatever the logits' dtype",
            expect="computed in float32", tests=LOGPROBS),
    Mistake("serve/sampler.py", "token_logprobs",
            before="host_ids[p][:k], host_values[p][:k]",
            after="host_ids[p], host_values[p]",
            rule="each row lists exactly its own num_top entries, not the widest request's",
            expect="its own num_top", tests=LOGPROBS),
    Mistake("serve/sampler.py", "token_logprobs",
            before="torch.log_softmax(logits.float(), dim=-1)",
            after="logits.float()",
            rule="a logprob is the log of the normalised distribution (log_softmax), not the raw logit",
            expect="log_softmax of the row", tests=LOGPROBS),
]

DECIDES = {
    "apply_penalties":
        "how to apply three per-row penalties to a whole batch from masks and counts, choosing each logit's "
        "repetition rule by its sign without turning a forbidden token's -inf into NaN",
    "token_logprobs":
        "how to get every row's logprob, rank (ties shared) and top list in a fixed number of device operations "
        "and transfers, with no per-row work",
}

DESIGN = ("token_logprobs",)
