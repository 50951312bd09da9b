"""Chapter 21: static batching. Several prompts decode together, one forward call per step.

A decode step reads every weight once whatever the batch size (Chapter 18), so B requests
in one call cost little more than one. The catch is shape: a batch is a rectangle
[B, T] and prompts have different lengths. We pad every prompt on the LEFT to the longest,
so that all rows end at the same column: the last column holds each row's last real token,
and every new token of a decode step lands in the same cache slot for all rows.

Three things keep the padding invisible:
  * positions: row b with p_b pad tokens gives its real tokens RoPE positions 0, 1, ...
    starting at column p_b, exactly as if it ran alone;
  * a mask: no query may attend to a pad slot (the `allowed` argument of the model);
  * the cache: one KVCache row per prompt; the pad slots hold keys nobody reads.
With those, each row's greedy output equals its solo `generate`, token for token.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from .kv_cache import KVCache
from .sampling import sample

if TYPE_CHECKING:
    from .qwen3 import Qwen3ForCausalLM


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int = 0,
             device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pack prompts (lists of ints, lengths L_b) into a left-padded batch.  (Your engine: Chapter 21)

    Returns (input_ids, positions, pad_lens):
      input_ids  int64 [B, L] with L = max L_b; row b is pad_id repeated p_b = L - L_b
                 times, then the prompt;
      positions  int64 [B, L]: the real tokens of row b get 0 .. L_b - 1 (the positions
                 they would have alone); pad columns get 0 (they are masked, so the value never
                 reaches the output, but it is fixed: equal prompts give equal batches);
      pad_lens   int64 [B]: p_b.
    All on `device`. Raise ValueError for an empty batch or an empty prompt.
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("static batching needs at least one prompt and no empty prompts")
    width = max(len(p) for p in prompts)
    pad_lens = torch.tensor([width - len(p) for p in prompts], dtype=torch.long, device=device)
    input_ids = torch.tensor([[pad_id] * (width - len(p)) + list(p) for p in prompts], dtype=torch.long,
                             device=device)
    columns = torch.arange(width, device=device)[None, :]
    positions = (columns - pad_lens[:, None]).clamp(min=0)
    return input_ids, positions, pad_lens


def padding_mask(pad_lens: torch.Tensor, num_slots: int) -> torch.Tensor:
    """Which cache slots each row may attend to: bool [B, 1, 1, num_slots].  (Your engine: Chapter 21)

    Slot j of row b is a real token exactly when j >= pad_lens[b]. The result goes to the
    model's `allowed` argument, which is broadcast to [B, 1, Tq, Tk] and intersected with
    the causal rule, so one mask over the key slots serves the prefill (Tq = L) and every
    decode step (Tq = 1) alike; it just grows by one slot per step.
    A pad query (a pad column during prefill) sees no allowed key at all; attention returns
    zeros for it rather than NaN, and nothing real ever reads its output.
    """
    slots = torch.arange(num_slots, device=pad_lens.device)
    return (slots[None, :] >= pad_lens[:, None])[:, None, None, :]


def padding_waste(prompt_lens: Iterable[int], output_lens: Sequence[int] | None = None) -> dict[str, float]:
    """Fractions of a static batch's token slots that hold no real token.

    prompt_lens: each row's prompt length; output_lens: how many tokens each row actually
    generated (None: prompts only). The batch runs for max(output_lens) decode steps, and a
    row that finished early still occupies its slot in every step after. Returns a dict
    with prefill_waste (pad share of the [B, L] prefill), decode_waste (share of decode
    rows that were already finished) and total (both together, over all slots processed).
    """
    prompt_lens = list(prompt_lens)
    width, rows = max(prompt_lens), len(prompt_lens)
    prefill_slots, prefill_real = rows * width, sum(prompt_lens)
    if output_lens is None:
        output_lens = [0] * rows
    steps = max(output_lens) if output_lens else 0
    decode_slots, decode_real = rows * steps, sum(output_lens)
    return {
        "prefill_waste": 1 - prefill_real / prefill_slots,
        "decode_waste": (1 - decode_real / decode_slots) if decode_slots else 0.0,
        "total": 1 - (prefill_real + decode_real) / (prefill_slots + decode_slots),
    }


@torch.inference_mode()
def generate_batch(model: Qwen3ForCausalLM, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                   eos_token_id: int | None = None, stop_token_ids: Iterable[int] = (), pad_id: int = 0,
                   temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
                   generator: torch.Generator | None = None) -> list[list[int]]:
    """Generate for every prompt at once; returns one list of new tokens per prompt.
    (Your engine: Chapter 21)

    prompts: B non-empty lists of ints, of any lengths; max_new_tokens; eos_token_id,
    stop_token_ids, the sampling options and generator as for sampling.generate; pad_id: the
    id fed in pad columns and for finished rows (its value never changes a real row).
    Returns B lists of ints, list b being prompt b's new tokens.
    Per row, the same stop rules as solo generate: max_new_tokens, eos_token_id or a stop token
    (kept in the output), or the row's own sequence (its prompt plus output, not the padded
    width) reaching the model's context_limit; a finished row gets no more output.
    Cost contract: ONE model call for the prefill of all rows, then one call per decode step
    for all rows, stopping as soon as every row has finished.
    Equality contract: with greedy decoding each row equals generate(model, prompt, ...) alone,
    token for token, whatever the other prompts are.
    """
    device = next(model.parameters()).device
    options: dict[str, Any] = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                                   generator=generator)
    stops = set(stop_token_ids) | ({eos_token_id} if eos_token_id is not None else set())
    limit = getattr(model, "context_limit", 1 << 30)
    input_ids, positions, pad_lens = left_pad(prompts, pad_id, device)
    lengths = [len(p) for p in prompts]
    outputs: list[list[int]] = [[] for _ in prompts]
    done = [max_new_tokens <= 0 or n >= limit for n in lengths]
    width = input_ids.shape[1]
    cache = KVCache.for_model(model, len(prompts), width + max(max_new_tokens, 0))
    feed, next_pos = input_ids, positions
    while not all(done):
        allowed = padding_mask(pad_lens, cache.length + feed.shape[1])
        logits = model(feed, positions=next_pos, cache=cache, allowed=allowed)
        tokens = sample(logits[:, -1], **options).tolist()
        for row, token in enumerate(tokens):
            if done[row]:
                continue
            outputs[row].append(token)
            sequence = lengths[row] + len(outputs[row])
            if len(outputs[row]) >= max_new_tokens or token in stops or sequence >= limit:
                done[row] = True
        feed = torch.tensor([[pad_id if done[r] else tokens[r]] for r in range(len(prompts))], device=device)
        next_pos = (next_pos[:, -1:] + 1)
    return outputs
