"""Chapter 31: what happens to a step's tokens after sampling, written once.

EngineCore.update is the one place where a step's results reach its requests: computed
rows counted, tokens appended, full blocks published, first_token_time stamped, stop rules
applied, finished requests freed, outputs made, the step counted. The three ways of running
a step differ only in a few named hooks, the methods of StepUpdate:

    advance(engine, request, n)          count the step's n computed rows
    commit(engine, request, tokens)      put the new tokens in the request, apply the stop rules
    report(engine, request, kept, lp)    the RequestOutput for the tokens kept
    after_update(engine, plan, advanced) anything the mode does once the step is applied

StepUpdate is Chapter 31's synchronous step. GuidedUpdate (Chapter 35) advances each
request's guide as its tokens arrive. serve.overlap.AsyncStepper (Chapter 33) counts rows
when it launches a step and writes tokens over placeholders when they arrive.
serve.spec_decode.Speculator (Chapter 37) commits accepted drafts and gives back the blocks
of rejected ones, then proposes the next drafts. Each extends StepUpdate; none copies the
update.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .request import Status

if TYPE_CHECKING:
    from .engine import EngineCore
    from .request import Request, RequestOutput
    from .sampler import TokenLogprobs
    from .scheduler import SchedulerOutput


@dataclass
class SampledTokens:
    """A step's results by request id, before EngineCore.update applies them.

    tokens: the new tokens of each request that sampled (one; with speculation, its accepted
    drafts then one token of the target's); logprobs: what the sampler reported for them
    (Chapter 34); failed: the error of each request whose sampling or verification failed,
    and `doing`, the words its error message uses for that work."""
    tokens: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, Any] = field(default_factory=dict)
    failed: dict[str, Exception] = field(default_factory=dict)
    doing: str = "sampling"


class StepUpdate:
    """The update's hooks as Chapter 31's synchronous step needs them."""

    # The words an error raised inside `commit` is reported with.
    doing = "checking its stop rules"

    def advance(self, engine: EngineCore, request: Request, n: int) -> None:
        """The step computed the request's next n tokens."""
        request.num_computed_tokens += n

    def commit(self, engine: EngineCore, request: Request, tokens: list[int]) -> tuple[list[int], Status | None]:
        """Append the tokens one at a time, applying the stop rules after each: the first
        that ends the request is kept, the rest dropped. Returns (tokens kept, status)."""
        kept: list[int] = []
        for token in tokens:
            request.append(token)
            kept.append(int(token))
            reason = self.stop_after(engine, request, int(token))
            if reason is not None:
                return kept, reason
        return kept, None

    def stop_after(self, engine: EngineCore, request: Request, token: int) -> Status | None:
        """The stop rules for the token just appended."""
        return engine.check_stop(request)

    def report(self, engine: EngineCore, request: Request, kept: list[int],
               logprobs: list[TokenLogprobs] | None) -> RequestOutput:
        return engine.make_output(request, kept, logprobs)

    def after_update(self, engine: EngineCore, plan: SchedulerOutput,
                     advanced: list[tuple[Request, list[int]]]) -> None:
        """Called once per step after every request is updated; advanced: the requests that
        gained tokens and still run, with the tokens they gained."""


class GuidedUpdate(StepUpdate):
    """Chapter 35: an engine built with vocab_bytes feeds every new token of a guided request
    to its guide (before the stop rules: they ask the guide whether anything may follow),
    and ends the request, stop_reason "guided", once the guide admits no further byte."""

    doing = "advancing its guide or checking its stop rules"

    def stop_after(self, engine: EngineCore, request: Request, token: int) -> Status | None:
        guide = request.guide
        if guide is not None:
            guide.advance(token)
        reason = engine.check_stop(request)
        if reason is None and guide is not None and guide.finished:
            request.stop_reason = "guided"
            return Status.FINISHED_STOPPED
        return reason


__all__ = ["SampledTokens", "StepUpdate", "GuidedUpdate"]
