"""Chapter 13: parity. Is our model the same model as someone else's?

Two checks, from fine to coarse. Logit parity runs both models on the same prompts and
measures how far apart the logits are, position by position. Greedy parity generates from
both and reports the first token where they part, with the context that led there and how
close the call was in each model: a divergence at a near-tie is rounding; one where a model
was sure of its choice is a bug.

The models may be ours or transformers' (whose forward returns an object with .logits);
`logits_of` hides the difference, so the harness needs nothing else from either.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

# Greedy generation as the parity check calls it: (model, prompt_ids, max_new_tokens) -> new ids.
GenerateFn = Callable[[nn.Module, Sequence[int], int], Sequence[int]]


def _device_of(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


@torch.inference_mode()
def logits_of(model: nn.Module, token_ids: Sequence[int]) -> torch.Tensor:
    """Logits [T, vocab] (float64, on the CPU) of one sequence (a list of ints), for our
    model or a transformers model alike."""
    ids = torch.tensor([list(token_ids)], device=_device_of(model))
    out = model(ids)
    out = getattr(out, "logits", out)
    return out[0].double().cpu()


def greedy_tokens(model: nn.Module, prompt_ids: Sequence[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation by full recompute (argmax, lowest id on ties), through
    logits_of, so it works for either kind of model."""
    tokens = list(prompt_ids)
    for _ in range(max_new_tokens):
        tokens.append(int(logits_of(model, tokens)[-1].argmax()))
    return tokens[len(prompt_ids):]


@dataclass
class LogitParity:
    """Logit agreement of two models over a set of prompts."""
    max_abs: float                  # largest |a - b| over every prompt, position and token
    mean_abs: float                 # mean |a - b| over the same
    argmax_agreement: float         # fraction of positions where both pick the same token
    per_position: list[list[float]] = field(default_factory=list)   # per prompt: [max |a - b| at each position]
    worst: tuple[int, int] = (0, 0)  # (prompt index, position) of max_abs

    def first_position_over(self, atol: float) -> list[int | None]:
        """Per prompt, the first position whose logits differ by more than atol (or None)."""
        return [next((t for t, d in enumerate(row) if d > atol), None) for row in self.per_position]

    def __str__(self) -> str:
        return (f"max |diff| {self.max_abs:.3g} (prompt {self.worst[0]}, position {self.worst[1]}), "
                f"mean |diff| {self.mean_abs:.3g}, argmax agreement {self.argmax_agreement:.1%}")


def compare_logits(model_a: nn.Module, model_b: nn.Module, prompts: Sequence[Sequence[int]]) -> LogitParity:
    """Logit parity of two models on a list of prompts.  (Your engine: Chapter 13)

    model_a, model_b: two models over the same vocabulary; prompts: lists of token ids (any
    lengths; each runs alone, so no padding). Logits come from logits_of ([T, vocab]
    float64 per prompt). Returns a LogitParity:
      max_abs, mean_abs: the max and the mean of |a - b| over every prompt, position and
        vocabulary entry (the mean weighs every logit equally, so long prompts count more);
      argmax_agreement: the fraction of positions, over all prompts, where the argmaxes agree;
      per_position: per prompt, the list of per-position maxima of |a - b| (the curve to plot);
      worst: (prompt index, position) of the largest difference.
    """
    per_position, total, count, agree, positions = [], 0.0, 0, 0, 0
    best, worst = -1.0, (0, 0)
    for index, prompt in enumerate(prompts):
        a, b = logits_of(model_a, prompt), logits_of(model_b, prompt)
        diff = (a - b).abs()
        row = diff.max(dim=-1).values
        per_position.append(row.tolist())
        total += float(diff.sum())
        count += diff.numel()
        agree += int((a.argmax(-1) == b.argmax(-1)).sum())
        positions += a.shape[0]
        if float(row.max()) > best:
            best, worst = float(row.max()), (index, int(row.argmax()))
    return LogitParity(max_abs=best, mean_abs=total / count, argmax_agreement=agree / positions,
                       per_position=per_position, worst=worst)


@dataclass
class Divergence:
    """Where greedy generation from two models first parts."""
    prompt_index: int
    step: int                       # index of the first differing generated token (0 = first new token)
    expected: int                   # model a's token there
    got: int                        # model b's token there
    context: list[int]              # the tokens both models saw before choosing: prompt + agreed tokens
    margin_a: float                 # in model a: logit[expected] - logit[got] (how sure a was)
    margin_b: float                 # in model b: logit[got] - logit[expected] (how sure b was)

    def __str__(self) -> str:
        tail = self.context[-8:]
        return (f"prompt {self.prompt_index}, step {self.step}: expected token {self.expected}, got {self.got} "
                f"after ...{tail} (margins: a {self.margin_a:.3g}, b {self.margin_b:.3g})")


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first position where two token lists differ (a shorter list differs
    where it ends), or None when they are equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def greedy_parity(model_a: nn.Module, model_b: nn.Module, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                  generate_a: GenerateFn | None = None, generate_b: GenerateFn | None = None) -> list[Divergence]:
    """Greedy-generate from both models and report every prompt where they part.  (Your engine: Chapter 13)

    model_a, model_b: two models over the same vocabulary; prompts: lists of ints;
    max_new_tokens >= 1; generate_a / generate_b: functions (model, prompt_ids,
    max_new_tokens) -> new token ids, default greedy_tokens (full recompute, no stop token).
    Returns a list of Divergence, one per prompt whose two outputs differ, in prompt order
    (empty: token-for-token parity). A Divergence names the prompt, the first step where the
    outputs differ (as first_difference counts), a's token (expected) and b's (got), the
    context both models saw before that step (the prompt plus the tokens they agreed on), and
    how sure each model was at that context, measured with logits_of:
    margin_a = a's logit of expected minus a's logit of got, margin_b = b's logit of got
    minus b's logit of expected (both positive when each model clearly preferred its own).
    Errors: ValueError naming the prompt when one output simply stops before the other
    (a different stopping rule is not a numerical divergence).
    """
    generate_a = generate_a or greedy_tokens
    generate_b = generate_b or greedy_tokens
    found = []
    for index, prompt in enumerate(prompts):
        out_a = list(generate_a(model_a, prompt, max_new_tokens))
        out_b = list(generate_b(model_b, prompt, max_new_tokens))
        step = first_difference(out_a, out_b)
        if step is None:
            continue
        if step >= min(len(out_a), len(out_b)):
            raise ValueError(f"prompt {index}: one model stopped after {step} tokens, the other went on; "
                             "compare with the same stopping rule (no EOS) on both sides")
        context = list(prompt) + out_a[:step]
        expected, got = out_a[step], out_b[step]
        la, lb = logits_of(model_a, context)[-1], logits_of(model_b, context)[-1]
        found.append(Divergence(prompt_index=index, step=step, expected=expected, got=got, context=context,
                                margin_a=float(la[expected] - la[got]), margin_b=float(lb[got] - lb[expected])))
    return found


def parity_report(model_a: nn.Module, model_b: nn.Module, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                  atol: float) -> dict[str, Any]:
    """Both checks in one dict (what `python run.py parity` prints): logit statistics, the
    first position over atol per prompt, and the greedy divergences as strings."""
    logits = compare_logits(model_a, model_b, prompts)
    divergences = greedy_parity(model_a, model_b, prompts, max_new_tokens)
    return dict(prompts=len(prompts), max_abs=logits.max_abs, mean_abs=logits.mean_abs,
                argmax_agreement=logits.argmax_agreement, logits_ok=logits.max_abs <= atol,
                first_position_over_atol=logits.first_position_over(atol),
                greedy_divergences=[str(d) for d in divergences], greedy_ok=not divergences)
