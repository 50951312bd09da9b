"""Chapter 31: what happens to a step's tokens after sampling, written once.

EngineCore.update is the one place where a step's results reach its requests: computed
rows counted, tokens appended, full blocks published, first_token_time stamped, stop rules
applied, finished requests freed, outputs made, the step counted. The ways of running a
step differ only in a few named hooks, the methods of StepUpdate, each of which sees one
request and what the step decided for it, never the engine:

    advance(request, n)              count the step's n computed rows
    commit(request, tokens, stop)    put the new tokens in the request, apply the stop rule
    report(request, output)          the RequestOutput for the tokens kept
    after_update(plan, advanced)     anything the mode does once the step is applied

StepUpdate is Chapter 31's synchronous step. serve.overlap.AsyncStepper (Chapter 33)
counts rows when it launches a step and writes tokens over placeholders when they arrive.
serve.spec_decode.Speculator (Chapter 37) commits accepted drafts and gives back the blocks
of rejected ones, then proposes the next drafts. Each extends StepUpdate; none copies the
update. What a token does to a request's guide (Chapter 35) is part of the stop rule the
engine hands to `commit` (`guided`), so it holds in every mode that takes guides.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from .interfaces import SampledTokens, StopRule
from .request import Status

if TYPE_CHECKING:
    from .request import Request, RequestOutput
    from .scheduler import SchedulerOutput


class StepUpdate:
    """The update's hooks as Chapter 31's synchronous step needs them."""

    # The words an error raised inside `commit` is reported with.
    doing = "checking its stop rules"

    def advance(self, request: Request, n: int) -> None:
        """The step computed the request's next n tokens."""
        request.num_computed_tokens += n

    def commit(self, request: Request, tokens: list[int], stop: StopRule) -> tuple[list[int], Status | None]:
        """Append the tokens one at a time, applying the stop rule after each: the first
        that ends the request is kept, the rest dropped. Returns (tokens kept, status)."""
        kept: list[int] = []
        for token in tokens:
            request.append(token)
            kept.append(int(token))
            reason = stop(request, -1)
            if reason is not None:
                return kept, reason
        return kept, None

    def report(self, request: Request, output: RequestOutput) -> RequestOutput:
        return output

    def after_update(self, plan: SchedulerOutput, advanced: list[tuple[Request, list[int]]]) -> None:
        """Called once per step after every request is updated; advanced: the requests that
        gained tokens and still run, with the tokens they gained."""


def guided(check_stop: StopRule) -> StopRule:
    """Chapter 35: the stop rule of an engine built with vocab_bytes. The token at `index`
    first moves the request's guide on (before the stop rules: they ask the guide whether
    anything may follow), then check_stop applies, and a guide that admits no further byte
    ends the request as FINISHED_STOPPED with stop_reason "guided". A request without a
    guide gets check_stop's answer alone."""
    def stop(request: Request, index: int) -> Status | None:
        guide = request.guide
        if guide is not None:
            guide.advance(request.token_ids[index])
        reason = check_stop(request, index)
        if reason is None and guide is not None and guide.finished:
            request.stop_reason = "guided"
            return Status.FINISHED_STOPPED
        return reason
    return stop


__all__ = ["SampledTokens", "StepUpdate", "guided"]
