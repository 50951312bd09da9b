"""Chapter 23: chunked prefill. A long prompt enters the cache C tokens at a time.

One forward call over a 4,000-token prompt is the most efficient way to fill its cache,
and the worst thing a server can do to everyone else: while that call runs, no other
request gets a token. Splitting the prompt into chunks of C tokens bounds how long any
single call takes, so a server can put one chunk and everyone's decode token into each
step (Chapter 24 does exactly that).

Nothing new is needed in the model. Since Chapter 16, a call continues from the cache's
length: a chunk's queries sit at slots start .. start + C - 1, they see every key already
in the cache plus the earlier keys of their own chunk, and the causal rule does the rest.
A chunked prefill is therefore the one-shot prefill computed in pieces, and its logits
agree with the one-shot ones up to float rounding.
"""
from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from .kv_cache import KVCache
from .sampling import sample

if TYPE_CHECKING:
    from .qwen3 import Qwen3ForCausalLM


def chunk_spans(num_tokens: int, chunk_size: int) -> list[tuple[int, int]]:
    """[(start, end), ...] covering 0 .. num_tokens in pieces of chunk_size (the last may be short)."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be at least 1, got {chunk_size}")
    return [(start, min(start + chunk_size, num_tokens)) for start in range(0, num_tokens, chunk_size)]


@torch.inference_mode()
def prefill_chunked(model: Qwen3ForCausalLM, cache: KVCache, prompt_ids: Sequence[int], chunk_size: int,
                    keep_logits: bool = False) -> torch.Tensor:
    """Feed prompt_ids (list of ints) into `cache` with one model call per chunk.
    (Your engine: Chapter 23)

    model; cache: a KVCache with room for the prompt after what it already holds (a cache
    that holds a prefix simply continues it); prompt_ids: a non-empty list of ints;
    chunk_size >= 1. Calls the model ceil(len(prompt_ids) / chunk_size) times, on
    consecutive pieces of at most chunk_size tokens, in order.
    Afterwards the cache holds the prompt after its earlier contents (cache.length grew by
    len(prompt_ids)), exactly as a one-shot model(prompt) through the same cache leaves it.
    Returns the logits of the prompt's last position, [vocab] float32; with
    keep_logits=True those of every prompt position, [len(prompt_ids), vocab], equal to a
    one-shot call's to float tolerance. Only the last row is needed for generation; keeping
    the others costs memory a real engine never spends.
    Errors: ValueError, before any model call, for an empty prompt or chunk_size < 1.
    """
    raise NotImplementedError("Your engine: Chapter 23: prefill_chunked")


@torch.inference_mode()
def generate_chunked(model: Qwen3ForCausalLM, prompt_ids: Sequence[int], max_new_tokens: int, chunk_size: int, *,
                     eos_token_id: int | None = None, stop_token_ids: Iterable[int] = (), temperature: float = 0.0,
                     top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
                     generator: torch.Generator | None = None) -> list[int]:
    """Chapter 17's generate with the prompt prefilled in chunks of chunk_size tokens.
    (Your engine: Chapter 23)

    Same arguments (plus chunk_size >= 1), result, contract and stop rules as generate
    (max_new_tokens; eos_token_id or a stop token, included in the output; the model's
    context_limit), and for greedy decoding the same tokens, whatever chunk_size is.
    Cost contract: the prompt goes in ceil(len(prompt) / chunk_size) calls through
    prefill_chunked, then one call per new token; one KVCache, never larger than prompt plus
    output (nor the context limit).
    Errors: ValueError for an empty prompt.
    """
    raise NotImplementedError("Your engine: Chapter 23: generate_chunked")


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def serve_two(model: Qwen3ForCausalLM, running_prompt: Sequence[int], long_prompt: Sequence[int],
              chunk_size: int | None = None, decode_steps: int = 16) -> dict[str, Any]:
    """Play the chapter's scene: request A is decoding when request B arrives with a long
    prompt; time A's tokens until B has its first.  (Your engine: Chapter 23)

    running_prompt (A's), long_prompt (B's): non-empty lists of ints; chunk_size >= 1, or
    None for B's whole prompt at once; decode_steps >= 1 steps are played.
    Calls: A's prompt in one call before the clock starts; then per step, B's next chunk
    (while any is left) before one call feeding A's newest token. Each request has its own
    KVCache; decoding is greedy, so A's tokens are solo generate's. Model call widths:
    [len(A), chunk, 1, chunk, 1, ..., rest, 1, 1, ...]. B's first token is never fed.
    Returns a dict of wall-clock seconds since B's arrival (the clock's start):
      a_token_times  when each of A's decode_steps tokens came out (increasing);
      a_gaps         the wait before each (the first from B's arrival): running sums of
                     a_gaps are a_token_times;
      a_max_gap      max(a_gaps), A's stall;
      b_first_token  when B's first token came out, between A's tokens of the step before
                     and of its own step; None when B's prefill needs more than decode_steps;
      b_steps        how many steps carried B's prefill.
    Errors: ValueError for chunk_size < 1.
    """
    raise NotImplementedError("Your engine: Chapter 23: serve_two")
