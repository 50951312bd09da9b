"""Chapter 37: speculative decoding inside the engine core.

Chapter 26 drafted and verified one request with contiguous caches. Here every running
request may carry draft tokens (`Request.spec_token_ids`), and one flattened step verifies
all of them at once:

    end of step t    a proposer guesses up to k tokens per running request -> spec_token_ids
    step t + 1       the scheduler budgets num_tokens_with_spec - num_computed_tokens;
                     the batch builder feeds [last real token, d1 .. dk] and samples every
                     one of those rows; the verifier keeps a prefix of the drafts plus one
                     token of the target's own; the K/V of rejected drafts is trimmed
                     (num_computed_tokens rolled back, Scheduler.trim)

Three proposers share one interface (`propose`): n-gram lookup in the request's own tokens,
a smaller draft model with a KV pool of its own, and heads on the target's last hidden
state (Medusa style). `Speculator` is the engine's `drafter` (serve.interfaces.Drafter), handed to
EngineCore when it is built: its `verify` takes the place of sampling in
EngineCore.sample_tokens, and it extends EngineCore.update through the update's hooks
(serve.update). It never sees the engine: what it needs of it comes once, in the
DrafterContext that `bind` receives.

Acceptance: a greedy request keeps the drafts that equal the target's argmax (Chapter 26's
accept_greedy), so its output is exactly the non-speculative engine's. A sampled request
goes through Chapter 26's rejection rule (accept_sampled) on probabilities warped by the
request's own temperature, top_k, top_p and min_p, so its output has exactly the
non-speculative distribution. A proposer that guesses deterministically has a point-mass
draft distribution (one-hot q); the rule then accepts a draft x with probability p(x) and
resamples from p with x removed.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from ..sampling import apply_min_p, apply_top_k_top_p
from ..speculative import accept_greedy, accept_sampled
from .batch import build_batch
from .blocks import BlockManager
from .interfaces import DrafterContext, SampledTokens, StopRule
from .request import Request, SamplingParams, Status
from .runner import ModelRunner
from .update import StepUpdate

if TYPE_CHECKING:
    from ..qwen3 import Qwen3ForCausalLM
    from .batch import Batch
    from .scheduler import SchedulerOutput

logger = logging.getLogger(__name__)


# --- the rules a learner writes -------------------------------------------------------------

def propose_ngram(token_ids: Sequence[int], k: int, max_n: int = 3, min_n: int = 1) -> list[int]:
    """Prompt lookup: guess the next tokens by finding the sequence's own tail earlier in it.  (Your engine: Chapter 37)

    token_ids: the request's tokens so far (prompt + output); k >= 0 guesses wanted;
    1 <= min_n <= max_n. For a size n, the tail is the last n tokens, and it recurs when the
    same n tokens also start at an earlier index (before the tail's own start). The answer
    comes from the LONGEST n in min_n..max_n whose tail recurs and, for that n, from the
    LATEST earlier occurrence: the (up to k) tokens that followed it. Returns a list of
    0..k ints: [] when k == 0, when the sequence is not longer than n for any n, or when no
    tail recurs. The continuation may run into the tail itself (a repeating pattern
    continues) but never past the end of token_ids.
    """
    if k <= 0:
        return []
    tokens = list(token_ids)
    for n in range(max_n, min_n - 1, -1):
        if len(tokens) <= n:
            continue
        tail = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):     # latest occurrence first
            if tokens[start:start + n] == tail:
                return tokens[start + n:start + n + k]
    return []


def warped_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a sampled request draws from, one row per logits row.  (Your engine: Chapter 37)

    logits: float [R, V]; params: a sampled request's SamplingParams (temperature at or
    above GREEDY_BELOW_TEMPERATURE; top_k 0, top_p 1 and min_p 0 mean "no cut"). Returns
    float64 [R, V] rows that sum to 1: each row holds, to 1e-12, the probability with which
    Chapter 8's `sample(logits, temperature, top_k, top_p, min_p)` draws each token, 0 for
    a token it can never draw. Example, one row of logits [2, 1, 0, -1]:
      temperature 1                [0.644, 0.237, 0.087, 0.032]
      temperature 1, top_k 2       [0.731, 0.269, 0, 0]
      temperature 0.5, top_k 2     [0.881, 0.119, 0, 0]
      temperature 1, top_p 0.7     [0.731, 0.269, 0, 0]   (0.644 alone falls short of 0.7)
      temperature 1, min_p 0.2     [0.731, 0.269, 0, 0]   (0.087 < 0.2 x 0.644)
    Verification rows of the target and a draft model's rows both go through this one
    function: rejection sampling preserves the distribution only when target and draft are
    warped by the same rules. Trap: `sample` computes in float64; rows computed in float32
    differ from what the non-speculative engine draws from.
    """
    scaled = logits.double() / params.temperature
    rows, vocab = scaled.shape
    top_k = torch.full((rows,), params.top_k if 0 < params.top_k < vocab else vocab, device=scaled.device)
    apply_top_k_top_p(scaled, top_k, scaled.new_full((rows,), params.top_p))
    apply_min_p(scaled, scaled.new_full((rows,), params.min_p))
    return torch.softmax(scaled, dim=-1)


def settle(request: Request, emitted: Sequence[int], stop: StopRule,
           trim: Callable[[Request, int], None]) -> tuple[list[int], Status | None]:
    """Commit a verified step's tokens to a request and give back what the drafts used.  (Your engine: Chapter 37)

    Called after the step's forward, when request.num_computed_tokens already counts every
    scheduled row (the real token AND the drafts fed behind it). emitted: the accepted
    drafts followed by the target's own token (1 .. k + 1 ints), in order; stop(request,
    index): the engine's stop rule (EngineCore.check_stop's contract); trim(request, n):
    gives back the request's blocks past its first n tokens (Scheduler.trim).
    Afterwards:
    - request.token_ids ends with emitted up to and including the first token that
      stop(request, -1) says ends the request (each token judged as the newest, with those
      before it appended); every token after that one is dropped;
    - num_computed_tokens is min(its value, num_tokens - 1): only rows of kept tokens hold
      valid K/V, and the newest token is never computed (Chapter 31's invariant);
    - the request holds no block past its first num_computed_tokens tokens (those that held
      only rejected drafts are back in the pool, unpublished: trim). EngineCore.update then
      publishes its full blocks; keys come from request.token_ids only, so a rejected
      draft is never published.
    Returns (the tokens appended, the stop status or None). It does not finish the request
    (the caller does, so it can report the output first); the stop rule may raise, and then
    the tokens appended before the failure stay appended.
    """
    kept: list[int] = []
    reason = None
    for token in emitted:
        request.append(token)
        kept.append(int(token))
        reason = stop(request, -1)
        if reason is not None:
            break
    request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens - 1)
    trim(request, request.num_computed_tokens)
    return kept, reason


# --- what a proposer provides ---------------------------------------------------------------

@dataclass
class Draft:
    """A proposer's guess for one request: the tokens and, when they were sampled from a
    distribution, that distribution's rows (float64 [len(tokens), V]); None means each
    token was chosen deterministically (a point mass, for the rejection rule)."""
    tokens: list[int]
    probs: torch.Tensor | None = None


class Proposer(Protocol):
    """Where drafts come from. `propose` gets the engine's DrafterContext, the requests that
    just gained tokens and are still running, each request's cap on guesses, and the
    target's hidden row of each request's newest token (heads read it); it returns one
    Draft per request, in order. `release(request_id)` forgets whatever the proposer keeps
    for a request that finished or lost its K/V (preemption); `bind(context)` sizes what it
    keeps for the engine being built."""

    name: str

    def propose(self, context: DrafterContext, requests: Sequence[Request], limits: Sequence[int],
                hidden: torch.Tensor | None) -> list[Draft]: ...

    def release(self, request_id: str) -> None: ...

    def bind(self, context: DrafterContext) -> None: ...


@dataclass
class NgramProposer:
    """Prompt lookup (propose_ngram): free, and strong wherever outputs copy their input."""
    max_n: int = 3
    min_n: int = 1
    name: str = "ngram"

    def __post_init__(self) -> None:
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError(f"NgramProposer needs 1 <= min_n <= max_n, got min_n={self.min_n}, max_n={self.max_n}")

    def propose(self, context: DrafterContext, requests: Sequence[Request], limits: Sequence[int],
                hidden: torch.Tensor | None) -> list[Draft]:
        return [Draft(propose_ngram(r.token_ids, limit, self.max_n, self.min_n)) for r, limit in zip(requests, limits)]

    def release(self, request_id: str) -> None:
        pass

    def bind(self, context: DrafterContext) -> None:
        pass


class DraftModelProposer:
    """A smaller causal LM guesses k tokens per request, one batched forward per guess.

    It shares the target's scheduling decisions (it drafts for exactly the requests the
    target just advanced) but not its memory: it has its own ModelRunner and its own
    BlockManager (no prefix caching), in which each request has a shadow Request holding
    the same tokens. Keeping the pools apart means the target's preemption, swapping,
    prefix sharing and trimming never have to know the draft exists: when a request loses
    its K/V, or when the draft pool is full, the draft simply recomputes (or skips
    drafting, which only costs speed). A sampled request's guesses are drawn from the
    draft's distribution warped by the request's own parameters, with the request's own
    generator, so seeded requests reproduce.
    """

    name = "draft-model"
    runner: ModelRunner            # the draft's own pool and forward, built by bind()
    blocks: BlockManager

    def __init__(self, draft: Qwen3ForCausalLM, num_blocks: int | None = None, block_size: int | None = None,
                 backend: str | None = None) -> None:
        """num_blocks, block_size, backend: the draft pool's; None takes the target engine's
        (the draft has fewer layers, so an equal pool takes fewer bytes)."""
        self.draft, self.pool = draft, (num_blocks, block_size, backend)
        self.shadows: dict[str, Request] = {}

    def bind(self, context: DrafterContext) -> None:
        """Build the draft's pool for the engine being built, or refuse a draft that guesses
        in another vocabulary."""
        if self.draft.cfg.vocab_size != context.vocab_size:
            raise ValueError(f"the draft model's vocabulary ({self.draft.cfg.vocab_size}) differs from the target's "
                             f"({context.vocab_size}): its guesses would be other tokens")
        num_blocks, block_size, backend = self.pool
        num_blocks = num_blocks or context.num_blocks
        block_size = block_size or context.block_size
        self.runner = ModelRunner(self.draft, num_blocks, block_size, backend or context.attention_backend)
        self.blocks = BlockManager(num_blocks, block_size, enable_prefix_caching=False)

    def release(self, request_id: str) -> None:
        shadow = self.shadows.pop(request_id, None)
        if shadow is not None:
            self.blocks.free(shadow)

    def _shadow(self, request: Request) -> Request:
        shadow = self.shadows.get(request.request_id)
        if shadow is None:
            shadow = self.shadows[request.request_id] = Request(request.request_id, list(request.token_ids),
                                                                request.params)
        # The draft's K/V are valid for the tokens it computed, as long as the target still
        # has them: a prefix the target and the draft agree on.
        agree = 0
        limit = min(shadow.num_computed_tokens, request.num_tokens - 1)     # feed at least the newest token
        while agree < limit and shadow.token_ids[agree] == request.token_ids[agree]:
            agree += 1
        shadow.token_ids = list(request.token_ids)
        shadow.spec_token_ids = []
        shadow.num_computed_tokens = agree
        return shadow

    @torch.inference_mode()
    def propose(self, context: DrafterContext, requests: Sequence[Request], limits: Sequence[int],
                hidden: torch.Tensor | None) -> list[Draft]:
        work = []                 # (request, shadow, limit) that have room in the draft pool
        for request, limit in zip(requests, limits):
            if limit <= 0:
                continue
            shadow = self._shadow(request)
            # Room for the catch-up rows and the limit - 1 guesses fed back (the last is never fed).
            if self.blocks.allocate_slots(shadow, request.num_tokens - shadow.num_computed_tokens + limit - 1):
                work.append((request, shadow, limit))
        guesses: dict[str, list[int]] = {r.request_id: [] for r, _, _ in work}
        rows: dict[str, list[torch.Tensor]] = {r.request_id: [] for r, _, _ in work}
        active = work
        while active:
            scheduled = [(s, s.num_tokens_with_spec - s.num_computed_tokens) for _, s, _ in active]
            batch = build_batch(scheduled, self.blocks.req_blocks, self.blocks.block_size, self.runner.device)
            logits = self.runner.execute(batch)
            for row, (request, shadow, _) in enumerate(active):
                shadow.num_computed_tokens = shadow.num_tokens_with_spec
                params = request.params
                if params.greedy:
                    token = int(logits[row].argmax())
                else:
                    probs = warped_probs(logits[row:row + 1], params)
                    generator = context.generator_for(request.request_id)
                    token = int(torch.multinomial(probs, 1, generator=generator))
                    rows[request.request_id].append(probs[0])
                guesses[request.request_id].append(token)
                shadow.spec_token_ids.append(token)
            active = [(r, s, limit) for r, s, limit in active if len(guesses[r.request_id]) < limit]
        drafts = []
        for request in requests:
            tokens = guesses.get(request.request_id, [])
            kept = self.shadows.get(request.request_id)
            if kept is not None:                       # the guesses' K/V are not the request's (yet)
                kept.num_computed_tokens = min(kept.num_computed_tokens, kept.num_tokens)
                kept.spec_token_ids = []
            drawn = rows.get(request.request_id)
            drafts.append(Draft(tokens, torch.stack(drawn) if drawn else None))
        return drafts


class DraftHeads(nn.Module):
    """Heads on the target's last hidden state (Medusa style, with the newest token's
    embedding as a second input, as multi-token-prediction heads have). For the row that
    chose token x from hidden state h, head i guesses the token i + 1 places after x:

        logits_i = lm_head(h + SiLU(W_i h + U_i embed(x)))

    The embedding table and the LM head are the target's, frozen and shared; W_i and U_i
    start at zero, so an untrained head repeats the target's own guess for x's slot."""

    def __init__(self, embed: nn.Module, lm_head: nn.Module, hidden_size: int, num_heads: int) -> None:
        super().__init__()
        self.embed, self.lm_head = embed, lm_head
        self.from_hidden = nn.ModuleList(nn.Linear(hidden_size, hidden_size, bias=False) for _ in range(num_heads))
        self.from_token = nn.ModuleList(nn.Linear(hidden_size, hidden_size, bias=False) for _ in range(num_heads))
        for layer in [*self.from_hidden, *self.from_token]:
            nn.init.zeros_(layer.weight)

    @property
    def num_heads(self) -> int:
        return len(self.from_hidden)

    def trainable(self) -> list[nn.Parameter]:
        return [*self.from_hidden.parameters(), *self.from_token.parameters()]

    def forward(self, hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """hidden [R, D], tokens [R] (the token each row chose) -> logits [R, num_heads, V]."""
        token = self.embed(tokens)
        return torch.stack([self.lm_head(hidden + nn.functional.silu(w(hidden) + u(token)))
                            for w, u in zip(self.from_hidden, self.from_token)], dim=1)


def train_heads(model: Qwen3ForCausalLM, prompts: Sequence[Sequence[int]], num_heads: int, new_tokens: int = 32,
                steps: int = 100, lr: float = 1e-2, eos_token_id: int | None = None, seed: int = 0) -> DraftHeads:
    """Fit DraftHeads to the model's OWN greedy continuations of `prompts`: generate them
    with the engine core (batched), take the final hidden state and the token it chose at
    every output position, and train head i by cross-entropy (full batch, Adam) to predict
    the greedy token i + 1 places after the chosen one. The target is frozen (only W_i and
    U_i get gradients; the optimizer never sees the target's parameters). On the tiny model, 128 prompts and 100 steps
    take seconds of CPU; the chapter measures how often the heads are then right."""
    from .config import EngineConfig
    from .engine import EngineCore
    torch.manual_seed(seed)
    device = next(model.parameters()).device
    longest = max(len(p) for p in prompts) + new_tokens
    config = EngineConfig(num_blocks=len(prompts) * -(-longest // 16), block_size=16)
    finals = EngineCore(model, config, eos_token_id).generate(prompts, SamplingParams(max_tokens=new_tokens))
    features, chosen, targets = [], [], []
    with torch.inference_mode():
        for prompt, final in zip(prompts, finals):
            sequence = list(prompt) + list(final.output_token_ids)  # type: ignore[union-attr]
            hidden = model.model(torch.tensor([sequence], device=device))[0]
            for i in range(len(prompt) - 1, len(sequence) - 1 - num_heads):   # positions whose next token is generated
                features.append(hidden[i].clone())
                chosen.append(sequence[i + 1])
                targets.append(sequence[i + 2:i + 2 + num_heads])
    if not features:
        raise ValueError("train_heads: the prompts and new_tokens leave no position to learn from")
    dtype = model.lm_head.weight.dtype
    x = torch.stack(features).to(dtype)
    x_tokens = torch.tensor(chosen, device=device)
    y = torch.tensor(targets, device=device)
    heads = DraftHeads(model.model.embed_tokens, model.lm_head, model.cfg.hidden_size, num_heads)
    for layer in [*heads.from_hidden, *heads.from_token]:   # only the new weights: the target's stay as they are
        layer.to(device=device, dtype=dtype)
    optimizer = torch.optim.Adam(heads.trainable(), lr=lr)
    with torch.enable_grad():
        for _ in range(steps):
            logits = heads(x, x_tokens)
            loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return heads.eval()


@dataclass
class HeadProposer:
    """Guesses read off the target's own last hidden state by trained DraftHeads: no extra
    forward of any model, one small matmul per head. Guesses are argmaxes (point masses)."""
    heads: DraftHeads
    name: str = "heads"

    @torch.inference_mode()
    def propose(self, context: DrafterContext, requests: Sequence[Request], limits: Sequence[int],
                hidden: torch.Tensor | None) -> list[Draft]:
        if hidden is None or not requests:
            return [Draft([]) for _ in requests]
        newest = torch.tensor([r.token_ids[-1] for r in requests], device=hidden.device)
        dtype = next(self.heads.from_hidden.parameters()).dtype
        guesses = self.heads(hidden.to(dtype), newest).argmax(dim=-1).tolist()
        return [Draft(row[:limit]) for row, limit in zip(guesses, limits)]

    def release(self, request_id: str) -> None:
        pass

    def bind(self, context: DrafterContext) -> None:
        pass


# --- the drafter the engine calls -----------------------------------------------------------

@dataclass
class VerifyStats:
    """Counters over every step the Speculator ran."""
    proposed: int = 0          # draft tokens the target verified
    accepted: int = 0          # of those, kept
    emitted: int = 0           # tokens appended to requests
    verify_rows: int = 0       # sampled rows (one per request per step, plus one per draft)
    verifications: int = 0     # (request, step) pairs that sampled: plain decoding emits 1 token each

    @property
    def tokens_per_verification(self) -> float:
        return self.emitted / self.verifications if self.verifications else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0


def refuse_with_drafter(request_id: str, lora: object, features: object) -> None:
    """Raise ValueError, naming the request, for adapter and image requests: speculation
    refuses them whatever their sampling parameters (those the verifier does not honour are
    refused by serve.request.FIELD_RULES)."""
    if lora is not None or features:
        raise ValueError(f"request {request_id!r}: speculative decoding does not take adapter or image requests "
                         f"(Chapter 43): the drafts would be guessed without them")


@dataclass
class Speculator(StepUpdate):
    """engine.drafter: proposes up to `k` drafts per running request and verifies them.

    It extends Chapter 31's update through its hooks: `verify` replaces sampling, `commit`
    is `settle` (accepted drafts kept, rejected drafts' blocks given back), and
    `after_update` proposes the next step's drafts. What it uses of the engine is the
    DrafterContext `bind` gives it.

    Hand it to the engine when it is built: EngineCore(model, config, drafter=Speculator(proposer, k))."""
    proposer: Any
    k: int = 4
    stats: VerifyStats = field(default_factory=VerifyStats)
    draft_probs: dict[str, torch.Tensor] = field(default_factory=dict)   # request id -> q rows of its drafts
    # The last step's target hidden rows (heads read them) and each request's first row there.
    hidden: torch.Tensor | None = field(default=None, repr=False)
    first_row: dict[str, int] = field(default_factory=dict, repr=False)
    context: DrafterContext = field(init=False, repr=False)      # set by bind

    doing = "settling its verified tokens"

    def __post_init__(self) -> None:
        if isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 1:
            raise ValueError(f"Speculator: k (draft tokens per step) must be an integer >= 1, got {self.k!r}")

    def bind(self, context: DrafterContext) -> None:
        """Called by EngineCore when it is built with this drafter: refuses an engine that
        schedules asynchronously (ASYNC_REFUSAL), then the proposer sizes what it keeps (a
        draft model's pool) for that engine."""
        if context.async_scheduling:
            raise ValueError(ASYNC_REFUSAL)
        self.context = context
        self.proposer.bind(context)

    def check_request(self, request_id: str, params: SamplingParams, lora: object, features: object) -> None:
        refuse_with_drafter(request_id, lora, features)

    def forget(self, request_id: str) -> None:
        self.draft_probs.pop(request_id, None)
        self.proposer.release(request_id)

    def verify_one(self, request: Request, logits: torch.Tensor, drafts: list[int],
                   probs: torch.Tensor | None) -> list[int]:
        """The tokens this step emits for one request: accepted drafts, then one of the target's."""
        if request.params.greedy:
            return accept_greedy(logits, drafts)
        target = warped_probs(logits, request.params)
        if probs is None:            # deterministic guesses: a point mass on each
            probs = torch.zeros(len(drafts), target.shape[-1], dtype=target.dtype, device=target.device)
            probs[range(len(drafts)), drafts] = 1.0
        return accept_sampled(target, probs.to(target), drafts, self.context.generator_for(request.request_id))

    def verify(self, plan: SchedulerOutput, batch: Batch, logits: torch.Tensor) -> SampledTokens:
        """Each request's emitted tokens (accepted drafts, then the target's own) from its
        verification rows; a request whose verification raises fails alone."""
        for request in plan.preempted:                 # their K/V are gone: so is the draft's
            self.forget(request.request_id)
        self.hidden = self.context.last_hidden()
        self.first_row = {}
        sampled = SampledTokens(doing="verifying its draft tokens")
        row = 0
        for (request, _), count in zip(plan.scheduled, batch.sample_counts):
            first, row = row, row + count
            drafts = request.spec_token_ids[:max(0, count - 1)]     # the budget may have cut some
            probs = self.draft_probs.pop(request.request_id, None)
            request.spec_token_ids = []
            if count == 0:                              # a mid-prompt chunk
                continue
            try:
                emitted = self.verify_one(request, logits[first:row], drafts,
                                          None if probs is None else probs[:len(drafts)])
            except Exception as exc:
                sampled.failed[request.request_id] = exc
                continue
            sampled.tokens[request.request_id] = emitted
            self.first_row[request.request_id] = first
            self.stats.proposed += len(drafts)
            self.stats.accepted += len(emitted) - 1
            self.stats.verify_rows += count
            self.stats.verifications += 1
        return sampled

    def commit(self, request: Request, tokens: list[int], stop: StopRule) -> tuple[list[int], Status | None]:
        kept, reason = settle(request, tokens, stop, self.context.trim)
        self.stats.emitted += len(kept)
        return kept, reason

    def after_update(self, plan: SchedulerOutput, advanced: list[tuple[Request, list[int]]]) -> None:
        """Set next step's spec_token_ids: never more guesses than tokens the request may
        still emit minus one (the target always adds one), nor past max_model_len."""
        if not advanced:
            return
        requests = [r for r, _ in advanced]
        limits = [max(0, min(self.k, r.params.max_tokens - r.num_output_tokens - 1,
                             self.context.max_model_len - r.num_tokens - 1)) for r in requests]
        newest = [self.first_row[r.request_id] + len(kept) - 1 for r, kept in advanced]
        rows = self.hidden[newest] if self.hidden is not None else None
        for request, draft in zip(requests, self.proposer.propose(self.context, requests, limits, rows)):
            request.spec_token_ids = [int(t) for t in draft.tokens]
            if draft.probs is not None and draft.tokens:
                self.draft_probs[request.request_id] = draft.probs
        self.hidden = None


# Why an engine that schedules asynchronously takes no drafter (Chapter 33 with Chapter 37).
ASYNC_REFUSAL = ("speculative decoding needs synchronous scheduling (EngineConfig(async_scheduling=False)): "
                 "the drafts for step t + 1 are guessed from the tokens step t accepts, which the asynchronous "
                 "engine has not read when it plans step t + 1, and a rejected draft rolls back rows that the "
                 "step already in flight was planned on")


__all__ = ["propose_ngram", "warped_probs", "settle", "Draft", "Proposer", "NgramProposer", "DraftModelProposer",
           "DraftHeads", "train_heads", "HeadProposer", "VerifyStats", "Speculator", "refuse_with_drafter",
           "ASYNC_REFUSAL"]
