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
    tokens, rows = [], []
    step = list(feed)
    for _ in range(k):
        logits = _last_logits(draft, step, cache)[-1].float()
        if temperature == 0:
            token = int(logits.argmax())
        else:
            probs = torch.softmax(logits / temperature, dim=-1)
            token = int(torch.multinomial(probs, 1, generator=generator))
            rows.append(probs)
        tokens.append(token)
        step = [token]
    return tokens, (torch.stack(rows) if rows else None)


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
    choices = target_logits.argmax(dim=-1).tolist()
    emitted = []
    for guess, wanted in zip(draft_tokens, choices):
        if guess != wanted:
            break
        emitted.append(guess)
    emitted.append(choices[len(emitted)])
    return emitted


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
    emitted = []
    for i, guess in enumerate(draft_tokens):
        p, q = target_probs[i], draft_probs[i]
        u = torch.rand((), generator=generator, device=p.device)
        if u * q[guess] <= p[guess]:                   # u <= p/q without dividing by q
            emitted.append(guess)
            continue
        leftover = (p - q).clamp_min(0.0)
        total = leftover.sum()
        if total <= 0:                                 # p == q: cannot happen after a rejection
            leftover, total = p, p.sum()
        emitted.append(int(torch.multinomial(leftover / total, 1, generator=generator)))
        return emitted
    emitted.append(int(torch.multinomial(target_probs[len(draft_tokens)], 1, generator=generator)))
    return emitted


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
    stats = stats if stats is not None else SpecStats()
    stop_token_ids = tuple(stop_token_ids)
    capacity = len(prompt_ids) + max_new_tokens + k + 1
    t_cache = KVCache.for_model(target, 1, capacity)
    d_cache = KVCache.for_model(draft, 1, capacity)

    def pick(logits_rows: torch.Tensor) -> torch.Tensor:
        if temperature == 0:
            return logits_rows.argmax(dim=-1)
        return torch.softmax(logits_rows.float() / temperature, dim=-1)

    committed = list(prompt_ids)
    logits = _last_logits(target, committed, t_cache)
    stats.target_forwards += 1
    if temperature == 0:
        first = int(logits[-1].argmax())
    else:
        first = int(torch.multinomial(pick(logits[-1]), 1, generator=generator))
    out = [first]
    committed.append(first)
    while len(out) < max_new_tokens and _stop_index(out, eos_token_id, stop_token_ids) is None:
        # t_cache holds committed[:-1]: the newest token is fed with the guesses.
        guesses_wanted = min(k, max_new_tokens - len(out) - 1)
        guesses: list[int] = []
        draft_probs: torch.Tensor | None = None
        if guesses_wanted > 0:
            guesses, draft_probs = propose(draft, d_cache, committed[d_cache.length:], guesses_wanted,
                                           temperature, generator)
            stats.draft_forwards += guesses_wanted
        before = t_cache.length
        verify = _last_logits(target, [committed[-1]] + guesses, t_cache)
        stats.target_forwards += 1
        if temperature == 0:
            emitted = accept_greedy(verify, guesses)
        else:
            if draft_probs is None:             # no guesses this round: an empty [0, vocab]
                draft_probs = verify.new_empty((0, verify.shape[-1]))
            emitted = accept_sampled(pick(verify), draft_probs, guesses, generator)
        stats.proposed += len(guesses)
        stats.accepted += len(emitted) - 1
        # Keep the last committed token and the accepted guesses; the final emitted token
        # is not in any cache yet (it is fed next round).
        t_cache.truncate(before + len(emitted))
        d_cache.truncate(min(d_cache.length, t_cache.length))
        out.extend(emitted)
        committed.extend(emitted)
    stop = _stop_index(out, eos_token_id, stop_token_ids)
    out = out[:stop + 1] if stop is not None else out[:max_new_tokens]
    stats.emitted += len(out)
    return out
