"""The success fast path: a call's first attempt, made without a ``RetryCall`` while nobody observes.

Most control calls succeed on their first attempt. For a ``Retrier`` with no
observers, ``Retrier.run`` and ``Retrier.arun`` start each call here: the
same deadlines, budget deposit, breaker admission and attempt timeouts that
``RetryCall.begin`` and its first ``next_step`` would give, without the
objects a success never reads (the ``RetryCall``, its record list, the
``Send`` and ``Return`` steps, the header carrier only observers fill). When
the first attempt succeeds, ``finish`` gives the breaker its verdict and
returns the response with its one-record tuple, exactly as the ``RetryCall``
would have. Anything else (no time left, a breaker that is not closed, a
failed attempt, an exception out of the attempt) hands the call to a
``RetryCall`` built from this state (``take_over``), which decides from there
as if it had run from the start: one set of rules, the fast path only skips
work. ``tests/core/retry/test_first_attempt.py`` proves the records, errors and
breaker verdicts are the same either way.
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar

from resilience.breaker import CircuitBreaker, Permit
from resilience.budget import RetryBudget
from resilience.clock import Clock
from resilience.deadline import Deadline
from resilience.errors import ErrorTypes
from resilience.outcome import AttemptRecord, Outcome
from resilience.retry.call import RetryCall
from resilience.retry.spec import AttemptResult, CallSpec, Timeouts, attempt_timeouts, deadline_times, is_success_status

__all__ = ["NO_HEADERS", "FirstAttempt"]

R = TypeVar("R")
NO_HEADERS: dict[str, str] = {}
"""The carrier of an unobserved attempt: nobody adds headers to it (drivers only read it)."""


class FirstAttempt(Generic[R]):
    """One call's state up to and through its first attempt; build it with the ``Retrier``'s parts.

    ``timeouts`` is the first attempt's (connect, read) when it may go out
    now, or None when the ``RetryCall`` must decide first (the deadline has
    passed, or the breaker is not closed: it may refuse, or take a
    half-open probe slot). The call's deadlines are kept as clock readings
    (``deadline_times``); their ``Deadline`` objects are built only by
    ``take_over``.
    """

    __slots__ = ("breaker", "budget", "clock", "hard_at", "permit", "spec", "started", "timeouts", "window_at")

    def __init__(self, spec: CallSpec, breaker: CircuitBreaker | None, budget: RetryBudget | None, clock: Clock) -> None:
        self.spec = spec
        self.breaker = breaker
        self.budget = budget
        self.clock = clock
        self.started = now = clock.monotonic()
        self.window_at, self.hard_at = window_at, hard_at = deadline_times(spec, now)
        if budget is not None:
            budget.deposit()
        self.permit: Permit | None = None
        self.timeouts: Timeouts | None = None
        left = (window_at if hard_at is None else hard_at) - now
        if left > 0:
            permit = breaker.admit_closed() if breaker is not None else None
            if breaker is None or permit is not None:
                self.permit = permit
                self.timeouts = attempt_timeouts(spec, left)

    def finish(self, result: AttemptResult[R]) -> tuple[R, tuple[AttemptRecord, ...]] | None:
        """The call's answer when the first attempt succeeded (the breaker told); None when the ``RetryCall`` must decide."""
        status = result.status
        response = result.response
        if status is None or response is None or not is_success_status(self.spec.match.policy, status):
            return None  # not ``classify``'s SUCCESS: its first rule is ``is_success_status``
        error = None if result.error is None else type(result.error).__qualname__
        record = AttemptRecord(0, status, Outcome.SUCCESS, result.delivery, error, self.clock.monotonic() - self.started)
        if self.breaker is not None:
            self.breaker.record_success(self.permit)
        return response, (record,)

    def take_over(self, rng: Any, errors: ErrorTypes, *, in_flight: bool) -> RetryCall[R]:
        """The ``RetryCall`` that decides from here: the same deadlines, deposit and admission; the attempt in flight when ``in_flight``.

        Only for a ``Retrier`` with no observers (no ``CallStarted`` was announced).
        """
        window = Deadline.at(self.window_at, self.clock)
        return RetryCall(
            self.spec,
            window if self.hard_at is None else Deadline.at(self.hard_at, self.clock),
            window,
            self.breaker,
            self.budget,
            (),
            self.clock,
            rng,
            errors,
            started=self.started,
            permit=self.permit,
            _in_flight=in_flight,
            _flight_started=self.started,
        )
