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

    draft: the draft model; cache: its KVCache, holding the committed tokens before `feed`;
    feed: the committed tokens that cache has not seen yet (a non-empty list of ints, ending
    with the last token emitted); k >= 1; temperature >= 0; generator: the torch.Generator
    every draw uses.
    Returns (tokens, probs): tokens, a list of k ints, guess i being what the draft would
    generate after feed and guesses 0 .. i-1 (greedy at temperature 0: exactly
    sampling.generate(draft, ...)'s tokens); probs, [k, vocab] float32, row i the
    distribution softmax(logits / temperature) that guess i was drawn from (one
    torch.multinomial draw per guess, in order), or None at temperature 0.
    Afterwards: the cache holds feed and guesses 0 .. k-2 (the last guess has not been fed),
    cache.length grew by len(feed) + k - 1; the draft ran exactly k forward calls.
    """
    raise NotImplementedError("Your engine: Chapter 26: propose")


def accept_greedy(target_logits: torch.Tensor, draft_tokens: Sequence[int]) -> list[int]:
    """Which guesses the target agrees with, and the token it adds.  (Your engine: Chapter 26)

    target_logits: [k + 1, vocab], the target's logits after feeding the last committed
    token followed by the k draft tokens: row i scores the slot of draft token i (row k the
    slot after the last guess). draft_tokens: k ints (k may be 0).
    Returns the emitted tokens, a list of 1 .. k + 1 ints: the longest prefix of the guesses
    that agrees with the target's greedy choice for its slot, then one token of the target's
    own. Every token returned is the target's argmax for its slot, so greedy output never
    depends on the draft.
    """
    raise NotImplementedError("Your engine: Chapter 26: accept_greedy")


def accept_sampled(target_probs: torch.Tensor, draft_probs: torch.Tensor, draft_tokens: Sequence[int],
                   generator: torch.Generator | None = None) -> list[int]:
    """Speculative sampling: accept or resample so the output follows the target.  (Your engine: Chapter 26)

    target_probs: [k + 1, vocab] float, rows as in accept_greedy, already softmaxed at the
    temperature; draft_probs: [k, vocab], the distributions the guesses were drawn from
    (draft_tokens[i] was drawn from row i); draft_tokens: k ints; generator: every random
    draw uses it.
    Returns the emitted tokens (1 .. k + 1 ints): the guesses accepted in order up to the
    first rejection, then one more token: a replacement for the rejected guess, or, when
    every guess is accepted, a token from the last target row. The contract the milestone
    measures: each emitted token is distributed exactly as the target alone would sample it
    after the tokens before it, whatever the draft proposed.
    Draw order is part of the contract (a seeded run repeats): for each guess in order one
    torch.rand((), generator=generator), then at most one torch.multinomial draw.
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

    target, draft: models sharing a vocabulary; prompt_ids: list of ints; max_new_tokens >= 1;
    k >= 1: guesses per round; eos_token_id / stop_token_ids: a stop token ends the output and
    is included; temperature 0 (greedy) or > 0 with `generator` for every draw.
    Returns the new tokens (list of ints), at most max_new_tokens. At temperature 0 it equals
    generate(target, prompt_ids, max_new_tokens, ...) token for token, whatever the draft.
    Cost contract (SpecStats counts it; `stats`, when given, is increased, not reset): one
    target forward for the prompt, then one target forward per round that checks all of that
    round's guesses at once; a round proposes min(k, tokens still wanted - 1) guesses, so no
    guess is proposed for a token that could not be emitted. stats.proposed / accepted /
    emitted / target_forwards / draft_forwards count guesses offered, guesses kept, tokens
    returned and forward calls.
    Each model keeps its own KVCache; after every round neither cache may hold a token that
    was not committed (a rejected guess's keys would poison the next round).
    """
    raise NotImplementedError("Your engine: Chapter 26: speculative_generate")
