"""The success fast path: a call's first attempt, made without a ``RetryCall``.

Most control calls succeed on their first attempt. ``Retrier.run`` and
``Retrier.arun`` start each call here: the same deadlines, budget deposit,
breaker admission and attempt timeouts that ``RetryCall.begin`` and its first
``next_step`` would give, and the same events in the same order when
observers listen (``CallStarted``, ``AttemptStarted`` with the header carrier
they fill, then ``AttemptEnded`` and ``CallEnded``), without the objects a
success never reads (the ``RetryCall``, its record list, the ``Send`` and
``Return`` steps; the carrier too when nobody observes). When the first
attempt succeeds, ``finish`` gives the breaker its verdict and returns the
response with its one-record tuple, exactly as the ``RetryCall`` would have.
Anything else (no time left, a breaker that is not closed, a failed attempt,
an exception out of the attempt) hands the call to a ``RetryCall`` built from
this state (``take_over``), which decides from there as if it had run from
the start: one set of rules, the fast path only skips work.
``tests/core/retry/test_first_attempt.py`` proves the records, errors, events
and breaker verdicts are the same either way (``Retrier(fast_path=False)``
runs every call through a ``RetryCall`` from the start).
"""

from __future__ import annotations

import math
from typing import Any, Generic, TypeVar

from resilience.breaker import CircuitBreaker, Permit
from resilience.budget import RetryBudget
from resilience.clock import Clock
from resilience.deadline import Deadline
from resilience.errors import ErrorTypes
from resilience.events import Observer, emit
from resilience.outcome import AttemptRecord, CallOutcome, Outcome
from resilience.retry.call import RetryCall, _call_ids, attempt_ended, attempt_started, call_ended, call_started
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
    half-open probe slot). ``headers`` is the attempt's header carrier
    (observers add trace context to it; ``NO_HEADERS`` when nobody
    observes). The call's deadlines are kept as clock readings
    (``deadline_times``); their ``Deadline`` objects are built only by
    ``take_over``.
    """

    __slots__ = (
        "breaker",
        "budget",
        "call_id",
        "clock",
        "flight",
        "hard_at",
        "headers",
        "observers",
        "permit",
        "spec",
        "started",
        "timeouts",
        "window_at",
    )

    def __init__(
        self,
        spec: CallSpec,
        breaker: CircuitBreaker | None,
        budget: RetryBudget | None,
        clock: Clock,
        observers: tuple[Observer, ...] = (),
    ) -> None:
        self.spec = spec
        self.breaker = breaker
        self.budget = budget
        self.clock = clock
        self.observers = observers
        self.started = now = clock.monotonic()
        self.window_at, self.hard_at = window_at, hard_at = deadline_times(spec, now)
        self.call_id = 0
        if observers:  # as ``RetryCall.begin``
            self.call_id = next(_call_ids)
            left_s = None if window_at == math.inf else max(0.0, window_at - clock.monotonic())
            emit(observers, call_started(self.call_id, spec, left_s))
        if budget is not None:
            budget.deposit()
        self.permit: Permit | None = None
        self.timeouts: Timeouts | None = None
        self.headers: dict[str, str] = NO_HEADERS
        self.flight = now
        left = (window_at if hard_at is None else hard_at) - clock.monotonic()
        if left > 0:
            permit = breaker.admit_closed() if breaker is not None else None
            if breaker is None or permit is not None:
                self.permit = permit
                self.timeouts = timeouts = attempt_timeouts(spec, left)
                if observers:  # as ``RetryCall.next_step``
                    carrier: dict[str, str] = {}
                    self.headers = carrier
                    emit(observers, attempt_started(self.call_id, spec, 0, timeouts, carrier))
                    self.flight = clock.monotonic()

    def finish(self, result: AttemptResult[R]) -> tuple[R, tuple[AttemptRecord, ...]] | None:
        """The call's answer when the first attempt succeeded (the breaker told); None when the ``RetryCall`` must decide."""
        status = result.status
        response = result.response
        spec = self.spec
        if status is None or response is None or not is_success_status(spec.match.policy, status):
            return None  # not ``classify``'s SUCCESS: its first rule is ``is_success_status``
        error = None if result.error is None else type(result.error).__qualname__
        clock = self.clock
        record = AttemptRecord(0, status, Outcome.SUCCESS, result.delivery, error, clock.monotonic() - self.flight)
        observers = self.observers
        if observers:  # as ``RetryCall.attempt_done``
            emit(observers, attempt_ended(self.call_id, spec, 0, result, Outcome.SUCCESS, error, record.duration_s))
        if self.breaker is not None:
            self.breaker.record_success(self.permit)
        if observers:  # as ``RetryCall._end``
            duration = clock.monotonic() - self.started
            emit(observers, call_ended(self.call_id, spec, CallOutcome.SUCCESS, status, 1, duration, None, self.budget))
        return response, (record,)

    def take_over(self, rng: Any, errors: ErrorTypes, *, in_flight: bool) -> RetryCall[R]:
        """The ``RetryCall`` that decides from here: the same deadlines, deposit, admission, call id and observers.

        The first attempt is in flight when ``in_flight`` (sent, not yet reported to the ``RetryCall``).
        """
        window = Deadline.at(self.window_at, self.clock)
        call: RetryCall[R] = RetryCall(
            self.spec,
            window if self.hard_at is None else Deadline.at(self.hard_at, self.clock),
            window,
            self.breaker,
            self.budget,
            self.observers,
            self.clock,
            rng,
            errors,
            started=self.started,
            permit=self.permit,
            _in_flight=in_flight,
            _flight_started=self.flight,
            call_id=self.call_id,
        )
        return call

