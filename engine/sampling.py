"""Chapters 8, 16 and 17: choosing the next token, and generating a sequence."""
import torch

from .kv_cache import KVCache


def sample(logits, temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, generator=None):
    """Pick one token id per row of logits [B, V] (or [V]).  (Your engine: Chapter 8)

    temperature == 0: greedy, the argmax (the lowest id among exact ties). Otherwise divide
    by the temperature, then filter, then draw from the renormalised softmax with
    torch.multinomial(..., generator=generator) so a seeded generator reproduces a draw:
      top_k > 0  keeps the k highest logits;
      top_p < 1  keeps the smallest highest-probability set whose mass reaches top_p
                 (the most likely token always survives);
      min_p > 0  keeps tokens whose probability is at least min_p times the top one's.
    Returns int64 ids of shape [B] (a scalar tensor for a [V] input).
    """
    raise NotImplementedError("Your engine: Chapter 8: sample")


def _is_stop(token, eos_token_id, stop_token_ids):
    return token == eos_token_id or token in stop_token_ids


def _next_token(logits, options):
    return int(sample(logits[0, -1], **options))


@torch.inference_mode()
def generate_recompute(model, prompt_ids, max_new_tokens, eos_token_id=None, stop_token_ids=(), **options):
    """Generate by running the whole sequence through the model at every step.  (Your engine: Chapter 8)

    prompt_ids: a list of ints. Each step feeds all tokens so far as one [1, T] batch, takes
    the logits of the LAST position, and samples with sample(..., **options). Stops after
    max_new_tokens, after emitting eos_token_id or any of stop_token_ids (the stop token is
    part of the output), or when the sequence reaches the model's context_limit. Returns the
    new tokens only. Quadratic work, but obviously correct: Chapter 16's cache must match it.
    """
    raise NotImplementedError("Your engine: Chapter 8: generate_recompute")


@torch.inference_mode()
def generate_cached(model, prompt_ids, max_new_tokens, eos_token_id=None, stop_token_ids=(), **options):
    """Generate with a KV cache: one prefill, then one token per step.  (Your engine: Chapter 16)

    Same contract and same stopping rules as generate_recompute. Size a KVCache for the
    prompt plus max_new_tokens (capped at the context limit), prefill the whole prompt in
    one call, then feed only the newest token each step; the model continues positions from
    the cache. Greedy output must equal generate_recompute's token for token.
    """
    raise NotImplementedError("Your engine: Chapter 16: generate_cached")


def generate(model, prompt_ids, max_new_tokens, *, eos_token_id=None, stop_token_ids=(), use_cache=True,
             temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, generator=None):
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
