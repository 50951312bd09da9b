"""Chapters 8, 16 and 17: choosing the next token, and generating a sequence.

The filters (apply_top_k_top_p, apply_min_p) work on a whole [R, V] batch with one value
per row: `sample` uses them with the same value on every row, and the engine's samplers
(Chapter 34's full sampler, Chapter 37's verifier) with each request's own.
"""
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


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep, in every row, its top_k highest logits, then the smallest set of its most
    likely tokens whose probability reaches top_p; every other logit becomes -inf, in
    place.  (Your engine: Chapter 8)

    logits [R, V] float32 or float64, already divided by the temperature; top_k [R] int64
    on logits' device, a value >= V meaning off (callers pass V for top_k = 0); top_p [R]
    in (0, 1], logits' dtype and device, 1 meaning off. Each row uses its own values.
    Returns `logits`.
    - top_k first: a token survives when its logit is >= its row's k-th highest logit, so
      every token tied with the k-th survives (transformers' TopKLogitsWarper);
    - top_p then, on the distribution top_k left (the softmax of the survivors): with the
      row's tokens ordered from most to least likely, a token survives when the
      probability mass strictly before it is < top_p. So the most likely token always
      survives, top_p = 1 keeps every token top_k kept, and a top_p below every
      probability (1e-39) keeps exactly one token.
    Surviving logits keep their values; -inf stays -inf. Cost: a fixed number of tensor
    operations whatever R is (no Python loop over rows, nothing read on the host).
    """
    ordered, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    kth = ordered.gather(1, (top_k.clamp(1, vocab) - 1).unsqueeze(1))
    ordered = ordered.masked_fill(ordered < kth, float("-inf"))
    probs = torch.softmax(ordered, dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    # 1 means off: a float32 mass before a very unlikely token can round up to exactly 1.
    drop = (mass_before >= top_p.unsqueeze(1)) & (top_p.unsqueeze(1) < 1)
    drop[:, 0] = False                                     # the most likely token stays, always
    ordered = ordered.masked_fill(drop, float("-inf"))
    return logits.scatter_(1, order, ordered)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Forbid (-inf), in every row, each token whose probability is below min_p times the
    probability of the row's most likely token, in place.  (Your engine: Chapter 8)

    logits [R, V] float32 or float64, already divided by the temperature (and filtered by
    whatever ran before: a -inf token has probability 0); min_p [R] in [0, 1], logits'
    dtype and device, 0 meaning off. Probabilities are the softmax of the row as given.
    A token exactly at the floor survives, so the most likely token always does; min_p = 0
    changes nothing. Surviving logits keep their values. Returns `logits`. Cost: a fixed
    number of tensor operations whatever R is (no Python loop over rows, nothing read on
    the host).
    """
    probs = torch.softmax(logits, dim=-1)
    floor = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill_(probs < floor, float("-inf"))


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
    applied after the temperature, in this order, each to what the previous one kept
    (apply_top_k_top_p's and apply_min_p's rules, with the same value on every row).
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
        scaled = rows.double() / temperature          # float64: a tiny temperature stays finite
        count, vocab = scaled.shape
        if top_p < 1.0:
            apply_top_k_top_p(scaled, scaled.new_full((count,), top_k if 0 < top_k < vocab else vocab,
                                                      dtype=torch.int64), scaled.new_full((count,), top_p))
        elif 0 < top_k < vocab:
            # top_k alone needs each row's k-th highest logit only: one topk, not a sort of the row
            kth = scaled.topk(top_k, dim=-1).values[:, -1:]
            scaled.masked_fill_(scaled < kth, float("-inf"))
        if min_p > 0.0:
            apply_min_p(scaled, scaled.new_full((count,), min_p))
        chosen = torch.multinomial(torch.softmax(scaled, dim=-1), 1, generator=generator)[:, 0]
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
