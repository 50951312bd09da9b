"""Chapter 31: one step's work as one flattened, unpadded batch.

The scheduler hands over [(request, n), ...]. Their new tokens are concatenated into one
sequence of N rows: the linear layers see an [N, D] matrix and never ask which request a
row came from. Attention does ask, and reads the answer from BatchMeta: where each
request's rows start, how long its context is, and where its blocks live in the pool.

    request          a (3-token chunk)   b (decode)   c (new, 4 tokens)
    input_ids        a6 a7 a8            b41          c0 c1 c2 c3
    positions        6  7  8             41           0  1  2  3
    query_start_loc  0                   3            4               8
    seq_lens         9                   42           4
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .request import Request


@dataclass
class BatchMeta:
    """What attention needs to find each request's rows and blocks.

    query_start_loc [R + 1]  request r's rows are query_start_loc[r] : query_start_loc[r + 1]
    seq_lens [R]             request r's context length after this step (computed + new)
    block_table [R, W]       request r's physical blocks in logical order (zero-padded)
    slot_mapping [N]         flat pool slot of each new token (block * block_size + offset);
                             -1 for padding rows
    The *_cpu lists are host copies, so a kernel launcher can read sizes without waiting
    for the device.
    """
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    block_size: int
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    max_query_len: int
    max_seq_len: int

    @property
    def decode_only(self) -> bool:
        """Every request has exactly one new row (CUDA graphs and decode kernels like that)."""
        return self.max_query_len == 1

    @property
    def num_reqs(self) -> int:
        return len(self.query_start_loc_cpu) - 1


@dataclass
class Batch:
    """A step's inputs.

    input_ids, positions [N]   the new tokens and their positions
    meta                       BatchMeta for attention
    logits_indices [L]         rows whose logits are needed: first the sampling rows, in
                               request order, then (Chapter 34) prompt-logprob rows
    sample_counts              per scheduled request, how many of its rows are sampled
                               (0 for a mid-prompt chunk, 1 normally, more when verifying drafts)
    request_ids                the scheduled requests' ids, in row order
    prompt_spans               (request, first position, prompt tokens) for prompt logprobs
    Step inputs of Chapter 43 (ModelRunner.prepare_features sets them; None: not this step):
    lora_ids [N] int64         each row's adapter slot (0: none)
    mrope_positions [3, N]     int64 positions on M-RoPE's three axes, in place of positions
    embeds [N, D]              the rows' input embeddings, image rows placed
    """
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: BatchMeta
    logits_indices: torch.Tensor
    sample_counts: list[int]
    request_ids: list[str]
    prompt_spans: list[tuple[Request, int, list[int]]] = field(default_factory=list)
    lora_ids: torch.Tensor | None = None
    mrope_positions: torch.Tensor | None = None
    embeds: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def has_step_inputs(self) -> bool:
        """True when a Chapter 43 step input is set (the step needs the eager forward)."""
        return self.lora_ids is not None or self.mrope_positions is not None or self.embeds is not None

    @property
    def num_sample_rows(self) -> int:
        """How many leading rows of the logits are sampling rows (the rest are prompt rows)."""
        return sum(self.sample_counts)


def build_batch(scheduled: Sequence[tuple[Request, int]], block_tables: Mapping[str, Sequence[int]], block_size: int,
                device: torch.device | str = "cpu", pad_to: int | None = None) -> Batch:
    """Flatten [(request, n), ...] into one Batch.  (Your engine: Chapter 31)

    scheduled: (request, n) pairs, in order; request r computes its next n tokens, those at
    positions c .. c + n - 1 with c = request.num_computed_tokens, taken from token_ids
    followed by spec_token_ids (draft tokens, Chapter 37). block_tables: request id -> its
    physical block ids in logical order. pad_to (Chapter 33's CUDA graphs): pad with one-row
    dummy requests (token 0, position 0, slot -1, seq_len 0, empty block table) up to pad_to
    requests. Returns a Batch, all tensors on `device`:
      input_ids, positions: int64 [N], N = sum of n (plus dummies), request by request;
      meta.query_start_loc: int32 [R + 1], 0 first, request r's rows between entries r, r + 1;
      meta.seq_lens: int32 [R], c + n (the context length after this step);
      meta.block_table: int32 [R, W], each row zero-padded, W >= 1;
      meta.slot_mapping: int64 [N], the pool slot each row's K/V is written to (-1 for
        dummies), numbered as write_kv numbers them: a token's slot lies in the physical
        block its request's table lists for the logical block its position falls in, at the
        position's place within that block. Example, block_size 4, table [7, 2]: positions
        0 .. 5 go to slots 28, 29, 30, 31, 8, 9;
      meta.query_start_loc_cpu / seq_lens_cpu: the same as host lists; max_query_len,
        max_seq_len their maxima;
      logits_indices: int64 [L], the rows whose logits are needed: first every sampling row,
        then every prompt-logprob row; sample_counts: one int per request (how many of its
        rows are sampled); request_ids; prompt_spans: (request, c, the prompt tokens those
        rows predict) per request with params.prompt_logprobs set (Chapter 34).
    A row is sampled exactly when the token after it is not known yet (position >=
    num_tokens - 1): one row for a decode, the last row of the chunk that ends a prompt, none
    for a chunk in the middle of a prompt, and every row from the last real token on when
    draft tokens are scheduled. Prompt-logprob rows are the rows whose next token is a prompt
    token. Raises ValueError naming the request when fewer than n tokens exist from c.
    Trap: it runs every step, before the model can start, and on a GPU every tensor
    operation is a copy to the device or a kernel launch of its own: the number of tensor
    operations it makes (torch calls, element writes included) is the same for a batch of
    two rows as for one of two hundred; it does not grow with the requests or the rows.
    """
    raise NotImplementedError("Your engine: Chapter 31: build_batch")
