"""Chapters 8, 16 and 17: choosing the next token, and generating a sequence."""
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from .kv_cache import KVCache

if TYPE_CHECKING:
    from .qwen3 import Qwen3ForCausalLM

# Below this temperature a request is sampled greedily, as vLLM does (its _SAMPLING_EPS):
# dividing logits by 1e-39 overflows every one of them to +-inf, and the softmax of that is
# NaN, while the distribution it stands for is the argmax anyway.
GREEDY_BELOW_TEMPERATURE = 1e-5


def sample(logits: torch.Tensor, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
           min_p: float = 0.0, generator: torch.Generator | None = None) -> torch.Tensor:
    """Pick one token id per row of logits [B, V] (or [V]).  (Your engine: Chapter 8)

    logits: float [B, V] or [V]; temperature >= 0; top_k >= 0 (0: off); top_p in (0, 1];
    min_p in [0, 1]; generator: the torch.Generator every random draw uses.
    Returns int64 ids of shape [B] (a scalar tensor for a [V] input).
    temperature < GREEDY_BELOW_TEMPERATURE (0 included): greedy, the argmax, the lowest id
    among exact ties; the filters and the generator are ignored. Otherwise each row's id is
    drawn from softmax(logits / temperature) restricted to the tokens every active filter
    keeps, renormalised:
      top_k > 0  the k highest logits;
      top_p < 1  the smallest highest-probability set whose mass reaches top_p (the most
                 likely token always survives);
      min_p > 0  the tokens whose probability is at least min_p times the top one's;
    applied after the temperature, in this order, each to what the previous one kept.
    Traps that are the contract:
      - the draw is ONE torch.multinomial(probs, 1, generator=generator) over the [B, V]
        probabilities in vocabulary order (not sorted order): Chapters 17 and 31 compare
        seeded draws token for token with this one, so the same seed must give the same ids;
      - numerically robust for every valid setting: no finite logits, temperature at or above
        the threshold, top_p in (0, 1] or min_p in [0, 1] may produce NaN, an empty set or an
        error (temperature=1e-4 on logits near 100 draws a valid id; top_p=1e-39, below
        float32's smallest normal number, keeps exactly the most likely token).
    """
    squeeze = logits.dim() == 1
    rows = logits.reshape(-1, logits.shape[-1])
    if temperature < GREEDY_BELOW_TEMPERATURE:
        chosen = rows.float().argmax(dim=-1)
    else:
        scaled = rows.double() / temperature
        if top_k and top_k < scaled.shape[-1]:
            kth = scaled.topk(top_k, dim=-1).values[:, -1:]
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        probs = torch.softmax(scaled, dim=-1)
        if top_p < 1.0:
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
            drop_sorted = mass_before >= top_p                     # the set already reached top_p
            drop_sorted[:, 0] = False                              # the most likely token stays, always
            drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
            probs = probs.masked_fill(drop, 0.0)
        if min_p > 0.0:
            floor = probs.max(dim=-1, keepdim=True).values * min_p
            probs = probs.masked_fill(probs < floor, 0.0)
        chosen = torch.multinomial(probs / probs.sum(dim=-1, keepdim=True), 1, generator=generator)[:, 0]
    return chosen[0] if squeeze else chosen


def _is_stop(token: int, eos_token_id: int | None, stop_token_ids: Sequence[int]) -> bool:
    return token == eos_token_id or token in stop_token_ids


def _next_token(logits: torch.Tensor, options: dict) -> int:
    return int(sample(logits[0, -1], **options))


@torch.inference_mode()
def generate_recompute(model: nn.Module, prompt_ids: list[int], max_new_tokens: int, eos_token_id: int | None = None,
                       stop_token_ids: Sequence[int] = (), **options: Any) -> list[int]:
    """Generate by running the whole sequence through the model at every step.  (Your engine: Chapter 8)

    prompt_ids: a list of ints; options: as for sample. Returns the new tokens only: new
    token i is what sample(..., **options) draws from the model's logits at the LAST position
    of the prompt plus new tokens 0 .. i-1, every call fed that whole sequence as one [1, T]
    batch (no cache; the milestone records the calls). Stops after max_new_tokens, after
    emitting eos_token_id or any of stop_token_ids (the stop token is part of the output), or
    when the sequence reaches the model's context_limit. Quadratic work, but obviously
    correct: Chapter 16's cache must match it.
    """
    device = next(model.parameters()).device
    tokens, out = list(prompt_ids), list[int]()
    limit = getattr(model, "context_limit", 1 << 30)
    while len(out) < max_new_tokens and len(tokens) < limit:
        logits = model(torch.tensor([tokens], device=device))
        token = _next_token(logits, options)
        tokens.append(token)
        out.append(token)
        if _is_stop(token, eos_token_id, stop_token_ids):
            break
    return out


@torch.inference_mode()
def generate_cached(model: nn.Module, prompt_ids: list[int], max_new_tokens: int, eos_token_id: int | None = None,
                    stop_token_ids: Sequence[int] = (), **options: Any) -> list[int]:
    """Generate with a KV cache: one prefill, then one token per step.  (Your engine: Chapter 16)

    Same arguments, result and stopping rules as generate_recompute (new tokens only, a stop
    token included; max_new_tokens; the model's context_limit). Greedy output must equal
    generate_recompute's token for token.
    Cost contract: the prompt goes through the model in ONE call; every later call feeds
    exactly one token, the newest. The KVCache holds at most the prompt plus
    max_new_tokens tokens (never more than the context limit).
    """
    device = next(model.parameters()).device
    limit = getattr(model, "context_limit", 1 << 30)
    cache = KVCache.for_model(cast("Qwen3ForCausalLM", model), 1, min(len(prompt_ids) + max_new_tokens, limit))
    feed, out = list(prompt_ids), list[int]()
    while len(out) < max_new_tokens and cache.length + len(feed) < limit:
        logits = model(torch.tensor([feed], device=device), cache=cache)
        token = _next_token(logits, options)
        out.append(token)
        feed = [token]
        if _is_stop(token, eos_token_id, stop_token_ids):
            break
    return out


def generate(model: nn.Module, prompt_ids: list[int], max_new_tokens: int, *, eos_token_id: int | None = None,
             stop_token_ids: Sequence[int] = (), use_cache: bool = True, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, min_p: float = 0.0, generator: torch.Generator | None = None) -> list[int]:
    """Continue prompt_ids (list of ints) by up to max_new_tokens; returns the new tokens.

    use_cache=False recomputes the whole sequence each step (Chapter 8); the default keeps a
    KV cache (Chapter 16). Both stop at EOS, a stop token (included in the output), or the
    model's context limit.
    """
    if not prompt_ids:
        raise ValueError("generate needs a non-empty prompt")
    run = generate_cached if use_cache else generate_recompute
    return run(model, prompt_ids, max_new_tokens, eos_token_id, tuple(stop_token_ids), temperature=temperature,
               top_k=top_k, top_p=top_p, min_p=min_p, generator=generator)
