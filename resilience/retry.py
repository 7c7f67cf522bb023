"""The retry loop of one logical call, independent of any transport.

Outermost first: deadline -> breaker check -> attempt (with its own
timeout) -> classify -> budget check -> backoff -> next attempt. Each arrow is
one named step below (``_admit``, ``_attempt``, ``_settle_ambiguous``,
``_exhausted``, ``_next_delay``), so a driver for another transport gets every
rule by supplying one function that makes a single attempt and reports what
it saw; everything else is decided here, without sockets, on an injectable
clock and random source.

The rules every driver gets:

- **Attempts.** ``RetryPolicy.max_attempts`` bounds the attempts that may have
  reached the server. Failures before sending (connection refused, connect
  timeout: ``Delivery.NOT_SENT``) are retried with backoff until the call's
  deadline, for any method; only a call with no deadline at all counts them
  against ``max_attempts`` too. When the deadline or the retry budget ends
  the retries on a refusal, the caller gets the refusal itself (the
  transport's own error, with ``.attempts``): an unreachable engine reads as
  one, never as a timeout. A body that cannot be replayed
  (``CallSpec.replayable=False``) gets exactly one attempt.
- **Timeouts** (one precedence rule): each attempt's (connect, read) timeout is
  the explicit table entry's ``attempt_timeout_s`` when it sets one; else the
  caller's own timeout (``CallSpec.request_timeout``, e.g. requests'
  ``timeout=``; ``(None, None)`` = wait as long as it takes); else the default
  policy's ``attempt_timeout_s``. A deadline caps attempt timeouts when it was
  set for this endpoint (an entry's ``deadline_s``) or by the caller (an outer
  ``Deadline``). The default policy's ``deadline_s`` never shortens a timeout
  the caller gave: it only bounds how long retries are started, and when it
  ends the caller gets what plain requests would have given (the last
  response or the transport's own error).
- **Ambiguity.** A non-idempotent attempt that may have been applied is never
  re-sent blindly: a table entry's ``on_ambiguous`` probes or raises
  ``AmbiguousOutcome``; a request no entry matches gets the transport's own
  error (a ``ReadTimeout``, say), exactly as plain requests would raise it.
- **Breaker.** It judges logical calls, not attempts: a call whose failures
  the retries absorbed counts as a success, so a flaky gateway in front of a
  healthy engine never opens it, while a dead engine does. Every attempt is
  admitted (``CircuitBreaker.admit``): a call that keeps retrying after the
  breaker went half-open needs a probe slot like any new call, and every exit
  (a verdict, a 4xx, an exception anywhere, KeyboardInterrupt in a backoff
  sleep) gives the breaker its verdict or its slot back.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable, MutableMapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Generic, NoReturn, TypeVar

from resilience import _config
from resilience.backoff import backoff_delay
from resilience.breaker import BreakerRegistry, CircuitBreaker, Permit
from resilience.budget import RetryBudget, RetryBudgets
from resilience.classification import classify
from resilience.clock import SYSTEM_CLOCK, Clock
from resilience.deadline import Deadline, current_deadline
from resilience.errors import (
    AmbiguousOutcome,
    CircuitOpen,
    DeadlineExceeded,
    ResilienceError,
    RetriesExhausted,
    RetryBudgetExhausted,
)
from resilience.events import (
    AttemptEnded,
    AttemptStarted,
    BreakerRejected,
    CallEnded,
    CallStarted,
    Observer,
    ProbeCompleted,
    RetryBudgetExhaustedEvent,
    RetryScheduled,
    emit,
)
from resilience.outcome import AttemptRecord, CallOutcome, Delivery, Outcome
from resilience.policy import EndpointMatch, ProbeAnswer, ProbeContext

__all__ = ["AttemptResult", "CallSpec", "Retrier", "attempt_timeouts", "call_deadlines"]

R = TypeVar("R")
_call_ids = itertools.count(1)
Timeouts = tuple[float | None, float | None]
Attempt = Callable[[int, Timeouts, MutableMapping[str, str]], "AttemptResult[R]"]


@dataclass(frozen=True, slots=True)
class AttemptResult(Generic[R]):
    """What the transport saw on one attempt."""

    response: R | None = None
    """The response object, when one came back."""
    status: int | None = None
    error: BaseException | None = None
    """The transport error, when no response came back."""
    delivery: Delivery = Delivery.RESPONDED
    error_kind: str | None = None
    """A bounded name for a transport error: ``connect_error``, ``connect_timeout``, ``read_timeout``, ``connection_reset``, ``error``."""
    retry_after: float | None = None
    """Seconds from a Retry-After header."""


@dataclass(frozen=True, slots=True)
class CallSpec:
    """One logical call as the loop needs to know it."""

    method: str
    url: str
    """Used only for probes and error messages; never put in events."""
    match: EndpointMatch
    engine: str
    server_address: str
    server_port: int
    request_timeout: Timeouts | None = None
    """The caller's own (connect, read) timeout; ``(None, None)`` = no limit; None = the caller said nothing."""
    request: Any = None
    """Attached to raised errors as ``request=`` (requests convention)."""
    replayable: bool = True
    """False when the body cannot be sent twice (a pipe, a generator): exactly one attempt."""


def attempt_timeouts(spec: CallSpec, cap_s: float = math.inf) -> Timeouts:
    """The (connect, read) timeout of the next attempt, ``cap_s`` being what is left of a deadline that caps attempts.

    The explicit table entry's ``attempt_timeout_s`` when set, else the
    caller's own timeout, else the default policy's. None = no limit.
    """
    policy = spec.match.policy
    limit = policy.attempt_timeout_s
    if spec.match.explicit and limit is not None:
        pair: Timeouts = (limit, limit)
    elif spec.request_timeout is not None:
        pair = spec.request_timeout
    else:
        pair = (limit, limit)

    def capped(value: float | None) -> float | None:
        bound = min(math.inf if value is None else value, cap_s)
        return None if math.isinf(bound) else bound

    return capped(pair[0]), capped(pair[1])


def call_deadlines(spec: CallSpec, clock: Clock = SYSTEM_CLOCK) -> tuple[Deadline, Deadline]:
    """``(hard, window)``: the deadline that caps attempts, and the one after which no retry starts.

    The entry's ``deadline_s`` (or, when neither the entry nor the default sets
    one, the sum of the caller's timeouts) is hard, and so is an outer
    ``Deadline``. The default policy's ``deadline_s`` under a caller's own
    timeout is only a retry window: it never cuts an attempt the caller bounded.
    """
    policy = spec.match.policy
    outer = current_deadline()
    outer_left = outer.remaining() if outer is not None and outer.bounded else None
    seconds = policy.deadline_s
    if seconds is None and spec.request_timeout is not None:
        parts = [t for t in spec.request_timeout if t is not None]
        seconds = sum(parts) if parts else None
    own = Deadline(seconds, clock=clock).cap(outer_left)
    if spec.match.explicit or spec.request_timeout is None:
        return own, own
    return Deadline(None, clock=clock).cap(outer_left), own


@dataclass(slots=True)
class _Call(Generic[R]):
    spec: CallSpec
    call_id: int
    started: float
    hard: Deadline
    """Caps every attempt; DeadlineExceeded when it ends."""
    window: Deadline
    """No retry starts past it (the same object as ``hard`` unless the caller's timeout governs)."""
    breaker: CircuitBreaker | None
    budget: RetryBudget | None
    records: list[AttemptRecord]
    last: AttemptResult[R] | None = None
    permit: Permit | None = None
    ended: bool = False

    @property
    def sent(self) -> int:
        """Attempts that may have reached the server."""
        return sum(1 for r in self.records if r.delivery is not Delivery.NOT_SENT)


class Retrier:
    """Runs logical calls: shared breakers, budgets, observers, clock and random source.

    ``breakers`` / ``budgets`` may be None to turn that strategy off.
    ``rng`` returns floats in [0, 1) for jitter.
    """

    def __init__(
        self,
        *,
        breakers: BreakerRegistry | None = None,
        budgets: RetryBudgets | None = None,
        observers: Sequence[Observer] = (),
        clock: Clock = SYSTEM_CLOCK,
        rng: Callable[[], float] = random.random,
    ) -> None:
        self.breakers = breakers
        self.budgets = budgets
        self.observers = tuple(observers)
        self.clock = clock
        self.rng = rng

    def run(
        self,
        spec: CallSpec,
        attempt: Attempt[R],
        *,
        discard: Callable[[R], None] = lambda _r: None,
        on_probe_done: Callable[[], R] | None = None,
    ) -> tuple[R, tuple[AttemptRecord, ...]]:
        """Run one logical call; return the final response and the attempts taken.

        ``attempt(n, (connect_timeout, read_timeout), carrier)`` makes attempt
        ``n`` and must not raise for transport errors (it reports them).
        ``discard`` releases a response that will not be returned.
        ``on_probe_done`` builds the response to return when a probe says an
        ambiguous request was applied.
        Raises the transport's last error, or a ``ResilienceError``.
        """
        call: _Call[R] = self._start(spec)
        try:
            return self._loop(call, attempt, discard, on_probe_done)
        except BaseException as exc:
            if not call.ended:  # an exception outside the verdicts (KeyboardInterrupt in a sleep, a failing discard)
                self._end(call, CallOutcome.FAILED, type(exc).__qualname__, neutral=True)
            raise

    def _loop(
        self,
        call: _Call[R],
        attempt: Attempt[R],
        discard: Callable[[R], None],
        on_probe_done: Callable[[], R] | None,
    ) -> tuple[R, tuple[AttemptRecord, ...]]:
        n = 0
        while True:
            self._admit(call, discard)
            result, outcome = self._attempt(call, n, attempt)
            if outcome is Outcome.SUCCESS:
                return self._succeed(call, result)
            if outcome is Outcome.FATAL:
                return self._give_back(call, result, CallOutcome.FAILED)
            reason = _reason(result)
            if outcome is Outcome.AMBIGUOUS and not call.spec.match.policy.idempotent:
                if not call.spec.match.explicit and call.spec.match.policy.on_ambiguous == "raise":
                    return self._give_back(call, result, CallOutcome.AMBIGUOUS)  # not re-sent; the transport's own error
                done = self._settle_ambiguous(call, n, result, reason, discard, on_probe_done)
                if done is not None:
                    return done
                reason = "probe_not_done"
            if self._exhausted(call, n):
                return self._exhaust(call, result, reason, discard)
            delay = self._next_delay(call, n, result, reason, discard)
            if delay is None:  # the default retry window ended, or the deadline or budget stopped a refused call
                return self._exhaust(call, result, reason, discard)
            if result.response is not None:
                discard(result.response)
            if delay > 0:
                self.clock.sleep(delay)
            n += 1

    # -- the steps -------------------------------------------------------

    def _start(self, spec: CallSpec) -> _Call[R]:
        hard, window = call_deadlines(spec, self.clock)
        call: _Call[R] = _Call(
            spec=spec,
            call_id=next(_call_ids),
            started=self.clock.monotonic(),
            hard=hard,
            window=window,
            breaker=self.breakers.get(spec.engine) if self.breakers is not None else None,
            budget=self.budgets.get(spec.engine) if self.budgets is not None else None,
            records=[],
        )
        if self.observers:
            emit(
                self.observers,
                CallStarted(
                    call_id=call.call_id,
                    method=spec.method,
                    endpoint=spec.match.endpoint,
                    engine=spec.engine,
                    deadline_s=window.remaining() if window.bounded else None,
                ),
            )
        if call.budget is not None:
            call.budget.deposit()
        return call

    def _admit(self, call: _Call[R], discard: Callable[[R], None]) -> None:
        """Before each attempt: time left, and the breaker's admission (a half-open breaker needs a probe slot)."""
        if call.hard.remaining() <= 0:
            self._fail(call, CallOutcome.DEADLINE_EXCEEDED, DeadlineExceeded, "deadline exceeded before attempt", discard)
        breaker = call.breaker
        if breaker is None:
            return
        permit = breaker.admit(call.permit)
        if permit is None:
            spec = call.spec
            if self.observers:
                emit(self.observers, BreakerRejected(call_id=call.call_id, endpoint=spec.match.endpoint, engine=spec.engine))
            self._fail(
                call, CallOutcome.CIRCUIT_OPEN, CircuitOpen, f"circuit open for {spec.engine} (retry in {breaker.retry_in():.2f}s)", discard
            )
        call.permit = permit

    def _attempt(self, call: _Call[R], n: int, attempt: Attempt[R]) -> tuple[AttemptResult[R], Outcome]:
        """Make attempt ``n``, classify it, record it and tell the observers."""
        spec = call.spec
        timeouts = attempt_timeouts(spec, call.hard.remaining())
        carrier: dict[str, str] = {}
        if self.observers:
            emit(
                self.observers,
                AttemptStarted(
                    call_id=call.call_id,
                    attempt=n,
                    method=spec.method,
                    endpoint=spec.match.endpoint,
                    engine=spec.engine,
                    server_address=spec.server_address,
                    server_port=spec.server_port,
                    timeout_s=timeouts[1],
                    carrier=carrier,
                ),
            )
        t0 = self.clock.monotonic()
        try:
            result = attempt(n, timeouts, carrier)
        except BaseException as exc:  # not a transport failure the loop handles: recorded, then run() ends the call
            call.records.append(
                AttemptRecord(n, None, Outcome.FATAL, Delivery.MAYBE_APPLIED, type(exc).__qualname__, self.clock.monotonic() - t0)
            )
            raise
        duration = self.clock.monotonic() - t0
        outcome = classify(spec.match.policy, status=result.status, delivery=result.delivery, retry_after=result.retry_after)
        error_type = type(result.error).__qualname__ if result.error is not None else None
        if self.observers:
            emit(
                self.observers,
                AttemptEnded(
                    call_id=call.call_id,
                    attempt=n,
                    method=spec.method,
                    endpoint=spec.match.endpoint,
                    engine=spec.engine,
                    status=result.status,
                    outcome=outcome,
                    error_type=error_type or (str(result.status) if outcome is not Outcome.SUCCESS else None),
                    sent=result.delivery is not Delivery.NOT_SENT,
                    duration_s=duration,
                ),
            )
        call.last = result
        call.records.append(AttemptRecord(n, result.status, outcome, result.delivery, error_type, duration))
        return result, outcome

    def _settle_ambiguous(
        self,
        call: _Call[R],
        n: int,
        result: AttemptResult[R],
        reason: str,
        discard: Callable[[R], None],
        on_probe_done: Callable[[], R] | None,
    ) -> tuple[R, tuple[AttemptRecord, ...]] | None:
        """A non-idempotent attempt may have been applied: the probe's answer, or ``AmbiguousOutcome``.

        Returns the call's result when the probe says it was done, None when
        the probe says it was not (the request may be sent again).
        """
        answer = self._probe(call, n, result)
        if answer is ProbeAnswer.DONE and on_probe_done is not None:
            if result.response is not None:
                discard(result.response)
            return self._succeed(call, AttemptResult(response=on_probe_done(), status=None))
        if answer is ProbeAnswer.NOT_DONE:
            return None
        spec = call.spec
        self._fail(
            call,
            CallOutcome.AMBIGUOUS,
            AmbiguousOutcome,
            f"{spec.match.endpoint} on {spec.engine} may have been applied ({reason}); not re-sent",
            discard,
        )

    def _exhausted(self, call: _Call[R], n: int) -> bool:
        """No attempt left: the body cannot be replayed, the testing cap, or ``max_attempts`` sent attempts.

        Failures before sending do not count while a deadline bounds the call,
        except in testing mode (no sleeps: they would spin until the deadline).
        """
        if not call.spec.replayable:
            return True
        testing = _config.current_testing()
        if testing.attempts is not None and n + 1 >= testing.attempts:
            return True
        counted = call.sent if call.window.bounded and not testing.active else n + 1
        return counted >= call.spec.match.policy.retry.max_attempts

    def _exhaust(
        self, call: _Call[R], result: AttemptResult[R], reason: str, discard: Callable[[R], None]
    ) -> tuple[R, tuple[AttemptRecord, ...]]:
        """Out of attempts: the last response (as plain requests), the transport's own error, or ``RetriesExhausted``."""
        if result.response is not None and not call.spec.match.policy.raise_on_exhausted:
            return self._give_back(call, result, CallOutcome.FAILED)
        spec = call.spec
        self._fail(
            call,
            CallOutcome.FAILED,
            RetriesExhausted,
            f"{spec.match.endpoint} on {spec.engine}: {len(call.records)} attempts failed (last: {reason})",
            discard,
            reraise_transport=True,
        )

    def _next_delay(self, call: _Call[R], n: int, result: AttemptResult[R], reason: str, discard: Callable[[R], None]) -> float | None:
        """The backoff before attempt ``n + 1``, once the deadline and the retry budget allow it; announced.

        None when the next wait would pass the default retry window (not a hard
        deadline), or when the deadline or the retry budget stops a call whose
        last attempt never left (a refusal): the call then ends as exhausted,
        as plain requests would, with the response or the transport's own error
        (a refusal stays a ``ConnectionError``, so nobody mistakes a dead engine
        for a slow one; the budget still announces itself as an event).
        """
        spec = call.spec
        retry = spec.match.policy.retry
        testing = _config.current_testing().active
        delay = 0.0
        if not testing:
            delay = backoff_delay(
                n + 1, base_s=retry.base_s, cap_s=retry.cap_s, multiplier=retry.multiplier, jitter=retry.jitter, rng=self.rng
            )
            if result.retry_after is not None and retry.respect_retry_after:
                delay = min(result.retry_after, retry.retry_after_max_s)
        refused = result.delivery is Delivery.NOT_SENT and result.error is not None
        left = call.window.remaining()
        if call.window.bounded and delay >= left:
            if call.window is not call.hard or refused:
                return None  # the caller gets what plain requests would: the response, or the refusal itself
            self._fail(
                call,
                CallOutcome.DEADLINE_EXCEEDED,
                DeadlineExceeded,
                f"deadline exceeded: next wait {delay:.3f}s >= {left:.3f}s left (last: {reason})",
                discard,
            )
        budget = call.budget
        if budget is not None and not budget.try_withdraw():
            if self.observers:
                emit(
                    self.observers,
                    RetryBudgetExhaustedEvent(call_id=call.call_id, endpoint=spec.match.endpoint, engine=spec.engine, tokens=budget.tokens),
                )
            if refused:
                return None
            self._fail(
                call,
                CallOutcome.BUDGET_EXHAUSTED,
                RetryBudgetExhausted,
                f"retry budget of {spec.engine} exhausted (last: {reason})",
                discard,
            )
        if self.observers:
            emit(
                self.observers,
                RetryScheduled(
                    call_id=call.call_id, attempt=n, endpoint=spec.match.endpoint, engine=spec.engine, reason=reason, delay_s=delay
                ),
            )
        call.records[-1] = replace(call.records[-1], delay_s=delay)
        return delay

    # -- helpers ---------------------------------------------------------

    def _probe(self, call: _Call[R], n: int, result: AttemptResult[R]) -> ProbeAnswer:
        probe = call.spec.match.policy.on_ambiguous
        if isinstance(probe, str):
            return ProbeAnswer.UNKNOWN
        spec = call.spec
        ctx = ProbeContext(spec.method, spec.url, spec.match.endpoint, spec.engine, n, result.error, result.status)
        try:
            answer = ProbeAnswer(probe(ctx))
        except Exception:  # a failing probe cannot tell: treat as unknown
            answer = ProbeAnswer.UNKNOWN
        if self.observers:
            emit(self.observers, ProbeCompleted(call_id=call.call_id, endpoint=spec.match.endpoint, engine=spec.engine, answer=str(answer)))
        return answer

    @staticmethod
    def _record_breaker(call: _Call[R], outcome: CallOutcome, neutral: bool) -> None:
        """One verdict per logical call: retries that absorbed a failure do not count against the engine.

        A success closes the count; a call that ended on transport errors or
        retryable statuses is a failure; a fatal status (4xx, 500), a refusal
        and an exception outside the transport are neutral: the slot goes back.
        """
        breaker, permit = call.breaker, call.permit
        if breaker is None or permit is None:
            return
        last = call.records[-1] if call.records else None
        if outcome in (CallOutcome.SUCCESS, CallOutcome.RETRIED_SUCCESS):
            breaker.record_success(permit)
        elif (
            neutral
            or outcome is CallOutcome.CIRCUIT_OPEN
            or (last is not None and last.outcome is Outcome.FATAL and last.status is not None)
        ):
            breaker.release_probe(permit)
        else:
            breaker.record_failure(permit)

    def _end(self, call: _Call[R], outcome: CallOutcome, error_type: str | None, *, neutral: bool = False) -> None:
        call.ended = True
        self._record_breaker(call, outcome, neutral)
        if not self.observers:
            return
        spec = call.spec
        emit(
            self.observers,
            CallEnded(
                call_id=call.call_id,
                method=spec.method,
                endpoint=spec.match.endpoint,
                engine=spec.engine,
                outcome=outcome,
                status=call.last.status if call.last is not None else None,
                attempts=len(call.records),
                duration_s=self.clock.monotonic() - call.started,
                error_type=error_type,
                retry_budget_tokens=call.budget.tokens if call.budget is not None else None,
            ),
        )

    def _succeed(self, call: _Call[R], result: AttemptResult[R]) -> tuple[R, tuple[AttemptRecord, ...]]:
        self._end(call, CallOutcome.RETRIED_SUCCESS if len(call.records) > 1 else CallOutcome.SUCCESS, None)
        assert result.response is not None
        return result.response, tuple(call.records)

    def _give_back(self, call: _Call[R], result: AttemptResult[R], outcome: CallOutcome) -> tuple[R, tuple[AttemptRecord, ...]]:
        if result.response is None:
            assert result.error is not None
            self._end(call, outcome, type(result.error).__qualname__)
            _attach(result.error, tuple(call.records))
            raise result.error
        self._end(call, outcome, str(result.status))
        return result.response, tuple(call.records)

    def _fail(
        self,
        call: _Call[R],
        outcome: CallOutcome,
        error: type[ResilienceError],
        message: str,
        discard: Callable[[R], None],
        *,
        reraise_transport: bool = False,
    ) -> NoReturn:
        last = call.last
        records = tuple(call.records)
        if reraise_transport and last is not None and last.response is None and last.error is not None:
            self._end(call, outcome, type(last.error).__qualname__)
            _attach(last.error, records)
            raise last.error
        self._end(call, outcome, error.__qualname__)
        response = last.response if last is not None else None
        if response is not None:
            discard(response)
        spec = call.spec
        exc = error(
            message,
            endpoint=spec.match.endpoint,
            engine=spec.engine,
            attempts=records,
            last_status=last.status if last is not None else None,
            last_error=last.error if last is not None else None,
            request=spec.request,
            response=response,
        )
        raise exc from (last.error if last is not None else None)


def _reason(result: AttemptResult[Any]) -> str:
    if result.status is not None:
        return f"status_{result.status}"
    return result.error_kind or "error"


def _attach(error: BaseException, records: tuple[AttemptRecord, ...]) -> None:
    try:
        error.attempts = records  # type: ignore[attr-defined]
    except AttributeError:
        pass
