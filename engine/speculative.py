"""Chapter 26: speculative decoding for one request with contiguous caches.

A small draft model guesses the next k tokens one at a time (cheap forwards); the target
model then scores all k guesses in ONE forward over k + 1 tokens. Every guess that matches
what the target would have produced is kept, plus one token from the target itself, so each
target forward yields between 1 and k + 1 tokens. Rejected guesses are forgotten by moving
each cache's length back (KVCache.truncate): their stale keys stay in memory and are simply
overwritten by the next step.

Greedy speculative decoding emits exactly the target's own greedy tokens. With sampling,
the accept/reject rule of `accept_sampled` keeps the target's distribution exactly.
"""
from __future__ import annotations

import copy
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
from torch import nn

from .kv_cache import KVCache

if TYPE_CHECKING:
    from .qwen3 import Qwen3ForCausalLM


@dataclass
class SpecStats:
    """Counters of one speculative run (or several: they accumulate)."""
    proposed: int = 0            # draft tokens offered to the target
    accepted: int = 0            # of those, kept
    emitted: int = 0             # tokens returned (accepted drafts + one target token per verify)
    target_forwards: int = 0     # prefill + verify calls of the target
    draft_forwards: int = 0      # prefill + proposal calls of the draft

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def tokens_per_target_forward(self) -> float:
        """Emitted tokens per target forward; plain decoding gets exactly 1."""
        return self.emitted / self.target_forwards if self.target_forwards else 0.0


def truncated_draft(target: Qwen3ForCausalLM, num_layers: int = 1) -> Qwen3ForCausalLM:
    """A draft model made of the target's first `num_layers` layers, its final norm and
    its LM head. The modules are shared, not copied: the draft costs no extra weight memory,
    and since it starts from the same embedding and ends with the same head, its guesses
    agree with the target far more often than an unrelated model's would."""
    cfg = replace(target.cfg, num_hidden_layers=num_layers)
    draft = copy.copy(target)                       # same class, same attributes; then rewire
    draft._modules = dict(target._modules)
    draft.cfg = cfg
    backbone = copy.copy(target.model)
    backbone._modules = dict(target.model._modules)
    backbone.cfg = cfg
    backbone.layers = nn.ModuleList(list(target.model.layers)[:num_layers])
    draft.model = backbone
    return draft


def _last_logits(model: Qwen3ForCausalLM, feed: Sequence[int], cache: KVCache) -> torch.Tensor:
    device = next(model.parameters()).device
    return model(torch.tensor([feed], device=device), cache=cache)[0]


@torch.inference_mode()
def propose(draft: Qwen3ForCausalLM, cache: KVCache, feed: Sequence[int], k: int, temperature: float = 0.0,
            generator: torch.Generator | None = None) -> tuple[list[int], torch.Tensor | None]:
    """Let the draft guess the next k tokens.  (Your engine: Chapter 26)

    feed: the committed tokens the draft's cache has not seen yet (at least one: the last
    token emitted). Run the draft on `feed`, take the token after it, then feed each guess
    back one at a time until k guesses exist. That is k forwards; the k-th guess is never
    fed, so on return the cache holds everything before the guesses plus guesses 1..k-1.
    Greedy (temperature 0): each guess is the argmax. Otherwise draw each guess from
    softmax(logits / temperature) with torch.multinomial(..., generator=generator).
    Returns (tokens: list of k ints, probs: [k, vocab] float32 rows the guesses came from,
    or None when greedy; the sampled acceptance rule needs them).
    """
    raise NotImplementedError("Your engine: Chapter 26: propose")


def accept_greedy(target_logits: torch.Tensor, draft_tokens: Sequence[int]) -> list[int]:
    """Which guesses the target agrees with, and the token it adds.  (Your engine: Chapter 26)

    target_logits: [k + 1, vocab], the target's logits after feeding the last committed
    token followed by the k draft tokens: row i predicts the token that follows draft
    token i (row 0 predicts the first draft token's slot). draft_tokens: k ints.
    Keep draft tokens from the front while each equals the target's argmax for its slot;
    at the first mismatch, the target's own argmax replaces it; if all k match, the last
    row gives a bonus token. Returns the emitted tokens: accepted guesses + one target
    token (length 1 .. k + 1). Every token returned is the target's greedy choice.
    """
    raise NotImplementedError("Your engine: Chapter 26: accept_greedy")


def accept_sampled(target_probs: torch.Tensor, draft_probs: torch.Tensor, draft_tokens: Sequence[int],
                   generator: torch.Generator | None = None) -> list[int]:
    """Speculative sampling: accept or resample so the output follows the target.  (Your engine: Chapter 26)

    target_probs: [k + 1, vocab] (rows as in accept_greedy, after temperature);
    draft_probs: [k, vocab], the distributions the guesses were drawn from.
    For guess i = x: accept with probability min(1, p(x) / q(x)), drawing
    u = torch.rand((), generator=generator) for each guess in order. At the first rejection,
    draw the replacement from the leftover mass max(p - q, 0), renormalised, and stop. If
    all k are accepted, draw a bonus token from the last target row. Every draw uses
    `generator`, so a seeded run repeats. Each emitted token is then distributed exactly
    as the target alone would have sampled it (the chapter proves why).
    Returns the emitted tokens (length 1 .. k + 1).
    """
    raise NotImplementedError("Your engine: Chapter 26: accept_sampled")


def _stop_index(tokens: Sequence[int], eos_token_id: int | None, stop_token_ids: Iterable[int]) -> int | None:
    for i, token in enumerate(tokens):
        if token == eos_token_id or token in stop_token_ids:
            return i
    return None


@torch.inference_mode()
def speculative_generate(target: Qwen3ForCausalLM, draft: Qwen3ForCausalLM, prompt_ids: Sequence[int],
                         max_new_tokens: int, k: int = 4, *, eos_token_id: int | None = None,
                         stop_token_ids: Iterable[int] = (), temperature: float = 0.0,
                         generator: torch.Generator | None = None, stats: SpecStats | None = None) -> list[int]:
    """Generate with draft-and-verify; same contract as sampling.generate.  (Your engine: Chapter 26)

    Both models keep their own KVCache (size: prompt + max_new_tokens + k + 1). Prefill
    the target on the prompt and take its first token. Then repeat: the draft catches up
    on the committed tokens it has not seen and proposes k guesses (fewer near the end:
    never more than the tokens still wanted minus one); the target runs ONE forward on
    [last committed token] + guesses; accept_greedy (temperature 0) or accept_sampled
    decides what is emitted; truncate both caches to the committed length (the target
    keeps the last committed token and the accepted guesses, the draft never more than the
    target). Stop at max_new_tokens or at a stop token (included), cutting anything after.
    `stats` (a SpecStats), when given, accumulates the counters.
    Greedy output equals generate(target, ...) token for token.
    """
    raise NotImplementedError("Your engine: Chapter 26: speculative_generate")
