"""The retry loop of one logical call, independent of any transport.

Outermost first: deadline -> breaker check -> attempt (with its own
timeout) -> classify -> budget check -> backoff -> next attempt.

The breaker judges logical calls, not attempts: a call whose failures the
retries absorbed counts as a success, so a flaky gateway in front of a
healthy engine never opens it, while a dead engine (every call ends in
connection errors) does. It is checked before every attempt, so a call
stops as soon as another call opened it. The
transport (``resilience.adapters.requests``) supplies one function that makes
a single attempt and reports what it saw; everything else is decided here,
without sockets, on an injectable clock and random source.
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
from resilience.breaker import BreakerRegistry, BreakerState, CircuitBreaker
from resilience.budget import RetryBudgets
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
    CallOutcome,
    CallStarted,
    Observer,
    ProbeCompleted,
    RetryBudgetExhaustedEvent,
    RetryScheduled,
    emit,
)
from resilience.outcome import AttemptRecord, Delivery, Outcome, classify
from resilience.policy import EndpointMatch, ProbeAnswer, ProbeContext

__all__ = ["AttemptResult", "CallSpec", "Retrier"]

R = TypeVar("R")
_call_ids = itertools.count(1)


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
    request_timeout: tuple[float | None, float | None] | None = None
    """The caller's own (connect, read) timeout, when given."""
    request: Any = None
    """Attached to raised errors as ``request=`` (requests convention)."""


@dataclass(slots=True)
class _Call(Generic[R]):
    spec: CallSpec
    call_id: int
    started: float
    records: list[AttemptRecord]
    last: AttemptResult[R] | None = None
    breaker: CircuitBreaker | None = None
    admitted: bool = False


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
        attempt: Callable[[int, tuple[float | None, float | None], MutableMapping[str, str]], AttemptResult[R]],
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
        policy = spec.match.policy
        retry = policy.retry
        testing = _config.current_testing()
        max_attempts = retry.max_attempts if testing.attempts is None else min(retry.max_attempts, testing.attempts)
        deadline = self._deadline(spec)
        call: _Call[R] = _Call(spec, next(_call_ids), self.clock.monotonic(), [])
        observers = self.observers
        if observers:
            emit(
                observers,
                CallStarted(
                    call.call_id, spec.method, spec.match.endpoint, spec.engine, None if not deadline.bounded else deadline.remaining()
                ),
            )
        budget = self.budgets.get(spec.engine) if self.budgets is not None else None
        if budget is not None:
            budget.deposit()
        breaker = self.breakers.get(spec.engine) if self.breakers is not None else None
        call.breaker = breaker
        n = 0
        while True:
            remaining = deadline.remaining()
            if remaining <= 0:
                self._fail(call, CallOutcome.DEADLINE_EXCEEDED, DeadlineExceeded, "deadline exceeded before attempt", discard)
            if breaker is not None and not self._admit(call, breaker):
                if observers:
                    emit(observers, BreakerRejected(call.call_id, spec.match.endpoint, spec.engine))
                self._fail(
                    call,
                    CallOutcome.CIRCUIT_OPEN,
                    CircuitOpen,
                    f"circuit open for {spec.engine} (retry in {breaker.retry_in():.2f}s)",
                    discard,
                )
            timeouts = self._timeouts(spec, remaining)
            carrier: dict[str, str] = {}
            if observers:
                emit(
                    observers,
                    AttemptStarted(
                        call.call_id,
                        n,
                        spec.method,
                        spec.match.endpoint,
                        spec.engine,
                        spec.server_address,
                        spec.server_port,
                        timeouts[1],
                        carrier,
                    ),
                )
            t0 = self.clock.monotonic()
            try:
                result = attempt(n, timeouts, carrier)
            except BaseException as exc:  # not a transport failure the loop handles: end the call, re-raise
                call.records.append(
                    AttemptRecord(n, None, Outcome.FATAL, Delivery.MAYBE_APPLIED, type(exc).__qualname__, self.clock.monotonic() - t0)
                )
                self._end(call, CallOutcome.FAILED, type(exc).__qualname__)
                raise
            duration = self.clock.monotonic() - t0
            outcome = classify(policy, status=result.status, delivery=result.delivery, retry_after=result.retry_after)
            error_type = type(result.error).__qualname__ if result.error is not None else None
            if observers:
                shown = error_type or (str(result.status) if outcome is not Outcome.SUCCESS else None)
                emit(
                    observers,
                    AttemptEnded(
                        call.call_id,
                        n,
                        spec.method,
                        spec.match.endpoint,
                        spec.engine,
                        result.status,
                        outcome,
                        shown,
                        result.delivery is not Delivery.NOT_SENT,
                        duration,
                    ),
                )
            call.last = result
            call.records.append(AttemptRecord(n, result.status, outcome, result.delivery, error_type, duration))

            if outcome is Outcome.SUCCESS:
                return self._succeed(call, result)
            if outcome is Outcome.FATAL:
                return self._give_back(call, result, CallOutcome.FAILED)
            reason = self._reason(result)
            if outcome is Outcome.AMBIGUOUS and not policy.idempotent:
                answer = self._probe(call, n, result)
                if answer is ProbeAnswer.DONE and on_probe_done is not None:
                    if result.response is not None:
                        discard(result.response)
                    return self._succeed(call, AttemptResult(response=on_probe_done(), status=None))
                if answer is not ProbeAnswer.NOT_DONE:
                    self._fail(
                        call,
                        CallOutcome.AMBIGUOUS,
                        AmbiguousOutcome,
                        f"{spec.match.endpoint} on {spec.engine} may have been applied ({reason}); not re-sent",
                        discard,
                    )
                reason = "probe_not_done"
            if n + 1 >= max_attempts:
                if result.response is not None and not policy.raise_on_exhausted:
                    return self._give_back(call, result, CallOutcome.FAILED)
                self._fail(
                    call,
                    CallOutcome.FAILED,
                    RetriesExhausted,
                    f"{spec.match.endpoint} on {spec.engine}: {n + 1} attempts failed (last: {reason})",
                    discard,
                    reraise_transport=True,
                )
            delay = (
                0.0
                if testing.active
                else backoff_delay(
                    n + 1, base_s=retry.base_s, cap_s=retry.cap_s, multiplier=retry.multiplier, jitter=retry.jitter, rng=self.rng
                )
            )
            if result.retry_after is not None and retry.respect_retry_after and not testing.active:
                delay = min(result.retry_after, retry.retry_after_max_s)
            if deadline.bounded and delay >= deadline.remaining():
                self._fail(
                    call,
                    CallOutcome.DEADLINE_EXCEEDED,
                    DeadlineExceeded,
                    f"deadline exceeded: next wait {delay:.3f}s >= {deadline.remaining():.3f}s left (last: {reason})",
                    discard,
                )
            if budget is not None and not budget.try_withdraw():
                if observers:
                    emit(observers, RetryBudgetExhaustedEvent(call.call_id, spec.match.endpoint, spec.engine, budget.tokens))
                self._fail(
                    call,
                    CallOutcome.BUDGET_EXHAUSTED,
                    RetryBudgetExhausted,
                    f"retry budget of {spec.engine} exhausted (last: {reason})",
                    discard,
                )
            if observers:
                emit(observers, RetryScheduled(call.call_id, n, spec.match.endpoint, spec.engine, reason, delay))
            call.records[-1] = _with_delay(call.records[-1], delay)
            if result.response is not None:
                discard(result.response)
            if delay > 0:
                self.clock.sleep(delay)
            n += 1

    # -- helpers ---------------------------------------------------------

    def _deadline(self, spec: CallSpec) -> Deadline:
        policy_s = spec.match.policy.deadline_s
        if policy_s is None and spec.request_timeout is not None:
            parts = [t for t in spec.request_timeout if t is not None]
            policy_s = sum(parts) if parts else None
        own = Deadline(policy_s, clock=self.clock)
        outer = current_deadline()
        if outer is None or not outer.bounded:
            return own
        return own.cap(outer.remaining())

    @staticmethod
    def _timeouts(spec: CallSpec, remaining: float) -> tuple[float | None, float | None]:
        limit = spec.match.policy.attempt_timeout_s
        cap = min(limit if limit is not None else math.inf, remaining)
        connect, read = spec.request_timeout if spec.request_timeout is not None else (None, None)

        def pick(user: float | None) -> float | None:
            value = min(cap, user) if user is not None else cap
            return None if math.isinf(value) else value

        return pick(connect), pick(read)

    @staticmethod
    def _reason(result: AttemptResult[Any]) -> str:
        if result.status is not None:
            return f"status_{result.status}"
        return result.error_kind or "error"

    def _probe(self, call: _Call[R], n: int, result: AttemptResult[R]) -> ProbeAnswer:
        probe = call.spec.match.policy.on_ambiguous
        if probe == "raise" or isinstance(probe, str):
            return ProbeAnswer.UNKNOWN
        spec = call.spec
        ctx = ProbeContext(spec.method, spec.url, spec.match.endpoint, spec.engine, n, result.error, result.status)
        try:
            answer = ProbeAnswer(probe(ctx))
        except Exception:  # a failing probe cannot tell: treat as unknown
            answer = ProbeAnswer.UNKNOWN
        if self.observers:
            emit(self.observers, ProbeCompleted(call.call_id, spec.match.endpoint, spec.engine, str(answer)))
        return answer

    @staticmethod
    def _admit(call: _Call[R], breaker: CircuitBreaker) -> bool:
        """The breaker lets the call in once (taking a half-open probe slot); later attempts only need it not open."""
        if not call.admitted:
            call.admitted = breaker.allow()
            return call.admitted
        return breaker.state is not BreakerState.OPEN

    @staticmethod
    def _record_breaker(call: _Call[R], outcome: CallOutcome) -> None:
        """One verdict per logical call: retries that absorbed a failure do not count against the engine.

        A success closes the count; a call that ended on transport errors or
        retryable statuses is a failure; a fatal status (4xx, 500) is neutral.
        """
        breaker = call.breaker
        if breaker is None or not call.admitted:
            return
        last = call.records[-1] if call.records else None
        if outcome in (CallOutcome.SUCCESS, CallOutcome.RETRIED_SUCCESS):
            breaker.record_success()
        elif outcome is CallOutcome.CIRCUIT_OPEN or (last is not None and last.outcome is Outcome.FATAL and last.status is not None):
            breaker.release_probe()
        else:
            breaker.record_failure()

    def _end(self, call: _Call[R], outcome: CallOutcome, error_type: str | None) -> None:
        self._record_breaker(call, outcome)
        if not self.observers:
            return
        spec = call.spec
        tokens = self.budgets.get(spec.engine).tokens if self.budgets is not None else None
        status = call.last.status if call.last is not None else None
        emit(
            self.observers,
            CallEnded(
                call.call_id,
                spec.method,
                spec.match.endpoint,
                spec.engine,
                outcome,
                status,
                len(call.records),
                self.clock.monotonic() - call.started,
                error_type,
                tokens,
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


def _with_delay(record: AttemptRecord, delay: float) -> AttemptRecord:
    return replace(record, delay_s=delay)


def _attach(error: BaseException, records: tuple[AttemptRecord, ...]) -> None:
    try:
        error.attempts = records  # type: ignore[attr-defined]
    except AttributeError:
        pass
