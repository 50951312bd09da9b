"""Chapter 31: turning the sampled rows' logits into tokens.

The interface every sampler of the engine keeps (Chapter 34 replaces this one):

    sampler(logits [L, vocab], requests, generators) -> (tokens, logprobs)

`requests` are the requests that have sampling rows this step, in row order; `tokens` is
one list of new token ids per request; `logprobs` is None or one entry per request;
`generators` maps a request id to its own torch.Generator (requests with a seed).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from ..sampling import sample
from .request import Request


class SimpleSampler:
    """Greedy rows in one argmax; every other row through Chapter 8's `sample`.

    One row per request (Chapter 37's verification rows need the full sampler). Unseeded
    sampled requests draw from `generator` (the engine's, seeded by EngineConfig.seed)."""

    def __init__(self, generator: torch.Generator | None = None) -> None:
        self.generator = generator

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, requests: Sequence[Request],
                 generators: Mapping[str, torch.Generator]) -> tuple[list[list[int]], None]:
        if logits.shape[0] != len(requests):
            raise ValueError(f"SimpleSampler takes one row per request: {logits.shape[0]} rows for "
                             f"{len(requests)} requests")
        greedy = logits.argmax(dim=-1).tolist()          # one device read for the whole step
        tokens = []
        for row, request in enumerate(requests):
            p = request.params
            if p.greedy:
                tokens.append([greedy[row]])
                continue
            generator = generators.get(request.request_id, self.generator)
            chosen = sample(logits[row:row + 1], temperature=p.temperature, top_k=p.top_k, top_p=p.top_p,
                            min_p=p.min_p, generator=generator)
            tokens.append([int(chosen[0])])
        return tokens, None
