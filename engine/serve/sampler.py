"""Chapters 31 and 34: turning the sampled rows' logits into tokens.

The interface every sampler of the engine keeps (serve.interfaces.TokenSampler):

    sampler(logits [L, vocab], requests, generators) -> (tokens, logprobs)

`requests` are the requests that have sampling rows this step, in row order; `tokens` is
one list of new token ids per request; `logprobs` is None or one entry per request;
`generators` maps a request id to its own torch.Generator (requests with a seed).

Chapter 31's SimpleSampler loops over rows. Chapter 34's Sampler treats the step as one
[R, vocab] matrix: every per-request parameter becomes a column of numbers ([R] tensors),
and each rule is a handful of tensor operations on the whole matrix (min_p, top_k and top_p
are Chapter 8's filters, sampling.apply_min_p and apply_top_k_top_p), in vLLM's order:

    guide mask -> allowed_token_ids -> bad words -> min_tokens -> logit_bias -> penalties
    -> (greedy rows: argmax) -> temperature -> min_p -> top_k -> top_p -> typical_p -> draw

Log-probabilities are those of the RAW model distribution (log_softmax of the logits as
the model produced them, before any rule), as vLLM reports them by default.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from ..sampling import apply_min_p, apply_top_k_top_p, sample
from .request import Request, SamplingParams


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


# --- Chapter 34: the full sampler ---------------------------------------------------------------

@dataclass
class TokenLogprobs:
    """Log-probabilities at one position of a sequence (an output token, or a prompt token
    with prompt_logprobs), under the raw model distribution.

    token_id, logprob, rank   the token that sits at this position, its log-probability and
                              its rank (1 = the most likely; tokens with an equal logprob
                              share the best rank)
    top_token_ids, top_logprobs  the k most likely tokens there, most likely first (k is
                              the request's logprobs or prompt_logprobs; their ranks are
                              1 .. k)
    """
    token_id: int
    logprob: float
    rank: int
    top_token_ids: list[int]
    top_logprobs: list[float]


def check_token_ids(request_id: str, params: SamplingParams, vocab_size: int) -> None:
    """Raise ValueError (naming the request and the field) when a parameter that names
    tokens names one outside 0 .. vocab_size - 1, or leaves no token to draw."""
    fields: list[tuple[str, Sequence[int]]] = [
        ("logit_bias", list((params.logit_bias or {}).keys())),
        ("allowed_token_ids", params.allowed_token_ids or ()),
        ("bad_words_token_ids", [t for word in params.bad_words_token_ids for t in word])]
    for name, ids in fields:
        outside = [t for t in ids if not 0 <= t < vocab_size]
        if outside:
            raise ValueError(f"request {request_id!r}: {name} names token {outside[0]}, outside the "
                             f"vocabulary (0..{vocab_size - 1})")
    if params.allowed_token_ids is not None and not params.allowed_token_ids:
        raise ValueError(f"request {request_id!r}: allowed_token_ids is empty, so no token could be drawn")
    for name in ("logprobs", "prompt_logprobs"):
        wanted = getattr(params, name)
        if wanted is not None and wanted > vocab_size:
            raise ValueError(f"request {request_id!r}: {name}={wanted} exceeds the vocabulary of {vocab_size}")


def apply_penalties(logits: torch.Tensor, prompt_mask: torch.Tensor, output_counts: torch.Tensor,
                    repetition: torch.Tensor, presence: torch.Tensor, frequency: torch.Tensor) -> torch.Tensor:
    """vLLM's three penalties on a whole batch, in place; returns `logits`.  (Your engine: Chapter 34)

    logits [R, V] float32; prompt_mask [R, V] bool (token occurs in row r's prompt);
    output_counts [R, V] (any number dtype: how often the token occurs in row r's OUTPUT);
    repetition, presence, frequency [R] float32, one value per row (1, 0, 0 = off).
    - repetition rho: every token of the prompt OR the output moves down, by the factor rho
      towards zero when its logit is positive and away from zero otherwise (rho 2: 3.0 ->
      1.5, -1.0 -> -2.0); unseen tokens keep their logit;
    - frequency f and presence p look at the output only: a token produced 3 times loses
      3f + p, one produced once f + p, a prompt-only token nothing. They come off the
      repetition-penalised value.
    Rows whose values are neutral come out unchanged; a forbidden token (-inf) stays -inf,
    never NaN.
    """
    raise NotImplementedError("Your engine: Chapter 34: apply_penalties")


def apply_typical_p(logits: torch.Tensor, typical_p: torch.Tensor) -> torch.Tensor:
    """Locally typical sampling (Meister et al., 2022), as transformers' TypicalLogitsWarper:
    in every row, rank the tokens by how far their surprise (-log p) lies from the row's
    entropy, nearest first, and keep the shortest run of that ranking whose probability
    reaches typical_p (tokens as far as the last one kept stay too); the rest become -inf,
    in place. typical_p [R] in (0, 1], 1 = off. Returns `logits`."""
    log_probs = torch.log_softmax(logits, dim=-1)
    probs = log_probs.exp()
    entropy = -(log_probs * probs).nansum(dim=-1, keepdim=True)     # 0 * -inf is NaN: a forbidden token adds 0
    distance, order = (-log_probs - entropy).abs().sort(dim=-1)
    mass = probs.gather(1, order).cumsum(dim=-1)
    last = (mass < typical_p.unsqueeze(1)).sum(dim=-1, keepdim=True).clamp_(max=logits.shape[-1] - 1)
    drop_sorted = (distance > distance.gather(1, last)) & (typical_p < 1).unsqueeze(1)
    return logits.masked_fill_(torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted), float("-inf"))


def filter_top_k_top_p(logits: torch.Tensor, top_k: Sequence[int], top_p: Sequence[float]) -> torch.Tensor:
    """apply_top_k_top_p on the rows that need it, without sorting a whole vocabulary where
    top_k bounds the row: such a row's survivors are among its top_k highest logits, so
    apply_top_k_top_p runs on the [rows, largest top_k] matrix of those candidates (from
    one topk) and the rest of the row becomes -inf. A row whose k-th logit is tied with
    tokens outside the candidates, or with no top_k but a top_p, is filtered over its
    whole vocabulary. top_k: ints (>= V: off), top_p: floats. In place; returns `logits`."""
    vocab = logits.shape[1]
    device = logits.device
    bounded = [row for row, k in enumerate(top_k) if k < vocab]
    whole = [row for row, (k, p) in enumerate(zip(top_k, top_p)) if k >= vocab and p < 1]
    if bounded:
        rows = torch.tensor(bounded, device=device)
        ks = torch.tensor([top_k[row] for row in bounded], device=device)
        ps = torch.tensor([top_p[row] for row in bounded], dtype=torch.float32, device=device)
        width = max(top_k[row] for row in bounded)
        # One candidate more than the widest top_k: if it ties a row's k-th logit, so may tokens beyond it.
        candidates, token_ids = (logits if len(bounded) == len(top_k) else logits[rows]).topk(width + 1, dim=-1)
        kth = candidates.gather(1, (ks - 1).unsqueeze(1))
        spill = (candidates[:, width] >= kth[:, 0]).tolist()
        kept = apply_top_k_top_p(candidates[:, :width], ks, ps)
        filtered = torch.full((len(bounded), vocab), float("-inf"), device=device)
        filtered.scatter_(1, token_ids[:, :width], kept)
        exact = [i for i, tied in enumerate(spill) if not tied]
        logits[rows[exact]] = filtered[exact]
        whole += [bounded[i] for i, tied in enumerate(spill) if tied]
    if whole:
        rows = torch.tensor(whole, device=device)
        logits[rows] = apply_top_k_top_p(logits[rows],
                                         torch.tensor([min(top_k[row], vocab) for row in whole], device=device),
                                         torch.tensor([top_p[row] for row in whole], device=device))
    return logits


def random_sample(probs: torch.Tensor, generators: Sequence[torch.Generator | None],
                  shared: torch.Generator | None) -> torch.Tensor:
    """One token per row of probs [R, V], drawn from that row's distribution: the argmax
    of probs / q with q ~ Exponential(1) i.i.d., which picks token i with probability
    probs[i] (the "exponential race"). Row r's noise comes from generators[r] when it is
    a Generator, so a seeded request's draw depends only on its own generator; rows with
    None share one draw from `shared` (None: torch's default generator)."""
    uniform = torch.empty_like(probs)
    unseeded = [row for row, g in enumerate(generators) if g is None]
    if unseeded:
        uniform[unseeded] = torch.rand((len(unseeded), probs.shape[1]), device=probs.device, dtype=probs.dtype,
                                       generator=shared)
    for row, generator in enumerate(generators):
        if generator is not None:
            uniform[row] = torch.rand(probs.shape[1], device=probs.device, dtype=probs.dtype, generator=generator)
    # -log(1 - u) is Exponential(1) (four times faster than exponential_ on a CPU); a draw of
    # exactly 0 becomes the smallest positive number, which keeps the ratio finite.
    noise = uniform.neg_().log1p_().neg_().clamp_(min=torch.finfo(probs.dtype).tiny)
    return (probs / noise).argmax(dim=-1)


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_top: Sequence[int]) -> list[TokenLogprobs]:
    """The raw log-probabilities of given tokens, with their ranks and each row's top list.  (Your engine: Chapter 34)

    logits [P, V] float (raw model logits, no sampling rule applied); token_ids [P] int64
    on the same device; num_top: P ints (0: none). Returns P TokenLogprobs, in row order:
    - logprob: token_ids[p]'s log-probability under row p's distribution, to float32
      precision even from bfloat16 logits;
    - rank: its place in the row, most likely first, tied tokens sharing their group's best
      place (logprobs -1, -1, -2: ranks 1, 1, 3);
    - top_token_ids / top_logprobs: row p's num_top[p] most likely tokens, most likely first.
    Cost: a fixed number of device operations and device-to-host transfers, whatever P is
    (nothing done per row on the device, no per-row .item()).
    """
    raise NotImplementedError("Your engine: Chapter 34: token_logprobs")


@dataclass
class SamplingTensors:
    """A step's per-request parameters as [R] tensors on the logits' device."""
    temperature: torch.Tensor      # float32; 1.0 on greedy rows (they are never divided)
    greedy: torch.Tensor           # bool
    min_p: torch.Tensor            # float32
    typical_p: torch.Tensor        # float32
    repetition: torch.Tensor       # float32
    presence: torch.Tensor         # float32
    frequency: torch.Tensor        # float32

    @classmethod
    def from_requests(cls, requests: Sequence[Request], device: torch.device) -> SamplingTensors:
        params = [r.params for r in requests]

        def column(values: list[float] | list[int] | list[bool], dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        return cls(temperature=column([1.0 if p.greedy else p.temperature for p in params], torch.float32),
                   greedy=column([p.greedy for p in params], torch.bool),
                   min_p=column([p.min_p for p in params], torch.float32),
                   typical_p=column([p.typical_p for p in params], torch.float32),
                   repetition=column([p.repetition_penalty for p in params], torch.float32),
                   presence=column([p.presence_penalty for p in params], torch.float32),
                   frequency=column([p.frequency_penalty for p in params], torch.float32))


def penalty_inputs(requests: Sequence[Request], vocab_size: int, device: torch.device
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """prompt_mask [R, V] bool and output_counts [R, V] float32 for apply_penalties, built
    from each request's token lists by two scatters (rows that need no penalty stay empty)."""
    prompts = [r.prompt_token_ids if r.params.repetition_penalty != 1 else [] for r in requests]
    outputs = [r.output_token_ids if r.params.needs_penalties else [] for r in requests]

    def scatter(lists: list[list[int]]) -> torch.Tensor:
        width = max([1] + [len(ids) for ids in lists])
        ids = torch.tensor([ids + [0] * (width - len(ids)) for ids in lists], dtype=torch.int64, device=device)
        real = torch.tensor([[1.0] * len(ids) + [0.0] * (width - len(ids)) for ids in lists], device=device)
        return torch.zeros((len(lists), vocab_size), device=device).scatter_add_(1, ids.reshape(len(lists), width),
                                                                                 real.reshape(len(lists), width))

    return scatter(prompts) > 0, scatter(outputs)


def bad_word_bans(request: Request) -> list[int]:
    """Tokens a request may not draw now because they would complete one of its bad words:
    a one-token word always, a longer word when its other tokens end the output so far."""
    output = request.output_token_ids
    banned = []
    for word in request.params.bad_words_token_ids:
        head = list(word[:-1])
        if not head or output[len(output) - len(head):] == head:
            banned.append(word[-1])
    return banned


def apply_token_rules(logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
    """The rules that name tokens, in place: the guide's mask (Chapter 35), allowed_token_ids,
    bad words, min_tokens (EOS and stop tokens forbidden until min_tokens outputs exist)
    and logit_bias. A Python loop collects (row, token) pairs; one indexed write per rule
    applies them. Returns `logits`."""
    device = logits.device
    guided = [(row, r.guide) for row, r in enumerate(requests) if r.guide is not None]
    if guided:
        allowed = torch.stack([guide.allowed() for _, guide in guided]).to(device)
        rows = torch.tensor([row for row, _ in guided], device=device)
        logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
    keep_rows, keep_cols, ban_rows, ban_cols = [], [], [], []
    bias_rows, bias_cols, bias_values = [], [], []
    for row, request in enumerate(requests):
        params = request.params
        if params.allowed_token_ids is not None:
            keep_rows.append(row)
            keep_cols.append(list(params.allowed_token_ids))
        banned = bad_word_bans(request)
        if request.num_output_tokens < params.min_tokens:
            banned += list(params.stop_token_ids)
            if request.eos_token_id is not None and not params.ignore_eos:
                banned.append(request.eos_token_id)
        ban_rows += [row] * len(banned)
        ban_cols += banned
        for token, bias in (params.logit_bias or {}).items():
            bias_rows.append(row)
            bias_cols.append(token)
            bias_values.append(float(bias))
    if keep_rows:
        forbidden = torch.ones((len(keep_rows), logits.shape[1]), dtype=torch.bool, device=device)
        for i, cols in enumerate(keep_cols):
            forbidden[i, cols] = False
        rows = torch.tensor(keep_rows, device=device)
        logits[rows] = logits[rows].masked_fill(forbidden, float("-inf"))
    if ban_rows:
        logits[torch.tensor(ban_rows, device=device), torch.tensor(ban_cols, device=device)] = float("-inf")
    if bias_rows:
        logits.index_put_((torch.tensor(bias_rows, device=device), torch.tensor(bias_cols, device=device)),
                          torch.tensor(bias_values, device=device), accumulate=True)
    return logits


class Sampler:
    """Chapter 34's full sampler: every SamplingParams rule of vLLM, for the whole batch at
    once (serve.interfaces.TokenSampler).

    generator: where unseeded sampled rows draw (the engine passes its own, seeded by
    EngineConfig.seed); a seeded request draws only from generators[its id], one vocabulary
    of exponential noise per sampled token, so its tokens depend on its seed and its own
    history, never on its neighbours, preemption or chunking.
    Returns (tokens, logprobs): one [token] per request, and None when no request asked for
    logprobs, else one entry per request: None, or [TokenLogprobs] for its new token.
    A row where every token is forbidden raises ValueError naming the request.
    """

    def __init__(self, generator: torch.Generator | None = None) -> None:
        self.generator = generator

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, requests: Sequence[Request],
                 generators: Mapping[str, torch.Generator]) -> tuple[list[list[int]], list[list[TokenLogprobs] | None]
                                                                    | None]:
        if logits.shape[0] != len(requests):
            raise ValueError(f"Sampler takes one row per request: {logits.shape[0]} rows for {len(requests)} requests")
        rows, vocab = logits.shape
        params = SamplingTensors.from_requests(requests, logits.device)
        processed = apply_token_rules(logits.float().clone(), requests)
        if any(r.params.needs_penalties for r in requests):
            apply_penalties(processed, *penalty_inputs(requests, vocab, logits.device),
                            params.repetition, params.presence, params.frequency)
        # Only the rules that forbid tokens can leave a row with nothing to draw.
        can_die = any(r.guide is not None or r.params.allowed_token_ids is not None
                      or r.params.bad_words_token_ids or r.params.min_tokens for r in requests)
        dead = torch.isneginf(processed).all(dim=-1) if can_die else torch.zeros(rows, dtype=torch.bool,
                                                                                   device=logits.device)
        tokens = processed.argmax(dim=-1)
        if not all(r.params.greedy for r in requests):
            processed.div_(params.temperature.unsqueeze(1))
            if any(r.params.repetition_penalty < 1 for r in requests):
                # Dividing a large logit by a tiny penalty (or temperature) can overflow to +inf,
                # whose softmax is NaN; the largest float keeps it the favourite instead.
                processed.clamp_(max=torch.finfo(processed.dtype).max)
            if any(r.params.min_p > 0 for r in requests):
                apply_min_p(processed, params.min_p)
            if any(0 < r.params.top_k < vocab or r.params.top_p < 1 for r in requests):
                sampled = [r.params for r in requests]          # greedy rows need no filter
                filter_top_k_top_p(processed, [p.top_k if 0 < p.top_k < vocab and not p.greedy else vocab
                                               for p in sampled], [1.0 if p.greedy else p.top_p for p in sampled])
            if any(r.params.typical_p < 1 for r in requests):
                apply_typical_p(processed, params.typical_p)
            probs = torch.softmax(processed, dim=-1)
            draws = self._draw(probs, requests, generators)
            tokens = torch.where(params.greedy, tokens, draws)
        chosen, dead_rows = torch.stack([tokens, dead.long()]).tolist()
        if any(dead_rows):
            stuck = [r.request_id for r, d in zip(requests, dead_rows) if d]
            raise ValueError(f"every token is forbidden for request(s) {stuck} (allowed_token_ids, bad words, "
                             f"min_tokens and the guide leave nothing to draw)")
        wanting = [row for row, r in enumerate(requests) if r.params.logprobs is not None]
        if not wanting:
            return [[t] for t in chosen], None
        index = torch.tensor(wanting, device=logits.device)
        found = token_logprobs(logits[index], tokens[index], [requests[row].params.logprobs or 0 for row in wanting])
        per_request: list[list[TokenLogprobs] | None] = [None] * rows
        for row, entry in zip(wanting, found):
            per_request[row] = [entry]
        return [[t] for t in chosen], per_request

    def _draw(self, probs: torch.Tensor, requests: Sequence[Request],
              generators: Mapping[str, torch.Generator]) -> torch.Tensor:
        """Draw every sampled row; greedy rows take no noise from their generators."""
        sampled = [row for row, r in enumerate(requests) if not r.params.greedy]
        own = [generators.get(requests[row].request_id) for row in sampled]
        if len(sampled) == len(requests):
            return random_sample(probs, own, self.generator)
        draws = torch.zeros(len(requests), dtype=torch.int64, device=probs.device)
        draws[sampled] = random_sample(probs[sampled], own, self.generator)
        return draws
