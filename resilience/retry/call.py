"""``RetryCall``: one logical call's retry loop as a decision object, with no I/O and no sleeps; the rules it applies.

A driver asks it what to do and does it. ``Retrier.run`` and ``Retrier.arun``
(``resilience.retry.retrier``) are this loop (``ask_probe`` is that module's; ``arun``
awaits the attempt, the sleep and the probe), the sync one as written there::

    step = call.next_step()              # Send or Raise
    while True:
        if type(step) is Send:           # make attempt step.attempt with step.timeouts and step.headers
            try:
                answer = send(step.attempt, step.timeouts, step.headers)
            except BaseException as exc:  # the driver's ``failed``: what its transport raised, or re-raised
                if failed is None:
                    raise
                step = call.attempt_done(failed(exc))
            else:                        # the driver's ``report``: what its transport answered
                step = call.attempt_done(answer if report is None else report(answer))
            continue
        if type(step) is AskProbe:       # was the ambiguous attempt applied?
            step = call.probe_answered(ask_probe(step.probe, step.context), on_probe_done)
            continue
        if step.discard is not None:     # Wait, Return, Raise: release the response not returned
            discard(step.discard)
        if type(step) is Return:         # the call is over
            return step.response, step.attempts
        if type(step) is Raise:          # the call is over
            raise step.error
        if step.delay_s > 0:             # Wait: a backoff, then ask again
            clock.sleep(step.delay_s)
        step = call.next_step()

A first-attempt success builds only what it hands back (the ``Send``, its
one ``AttemptRecord``, the ``Return``). Anything else that ends the call (an
exception in the attempt, a cancelled task, an interrupt in the sleep) ends
it through ``abandon``. Breakers and budgets never hold their short thread
locks across I/O, so one ``Retrier`` serves threads and asyncio tasks.
``resilience.retry.spec`` decides each attempt's timeouts and what its
result means; the rest is decided here, by these rules (for users, with the
reasons: ``docs/retry-rules.md``):

- **Attempts** (``_exhausted``, ``_retry_or_end``, ``_announce_refusal``).
  ``RetryPolicy.max_attempts`` counts attempts that may have reached the
  server. A failure before sending (``Delivery.NOT_SENT``) is retried for
  any method: for ``RetryPolicy.connect_window_s`` while the call has never
  connected, then until the deadline (a call with none counts it against
  ``max_attempts``). A refused call that the window, the deadline or the
  retry budget stops gets the refusal itself; its first refusal is logged
  once at WARNING and announced (``EngineRefused``), and a whole window
  refused opens the breaker. A body that cannot be replayed gets one
  attempt. Each backoff (``backoff_delay``, or a 429/503's Retry-After,
  capped) must fit the deadline and be paid from the engine's retry budget.
- **Ambiguity** (``attempt_done``, ``probe_answered``). A non-idempotent
  attempt that may have been applied is never re-sent blindly: a table
  entry's ``on_ambiguous`` probes or raises ``AmbiguousOutcome``; with no
  entry the transport's own error is raised, as plain requests would. A
  gateway status on a non-idempotent entry asks its probe too (a front end
  may answer 502 after handing the request on). "Done" returns as applied,
  "not done" re-sends, "unknown" does what the entry does without a probe.
- **Breaker** (``next_step``, ``_end``). It judges logical calls: failures
  the retries absorbed make a success (a flaky gateway never opens it, a
  dead engine does). Every attempt is admitted (after the breaker went
  half-open a retry needs a probe slot), and every exit gives the breaker
  its verdict or its slot back.
- **Errors** (``_fail``, ``_give_back``). The loop raises the ``Retrier``'s
  ``ErrorTypes``, which are also the transport's own exception types (the
  httpx driver's ``DeadlineExceeded`` is an ``httpx.TimeoutException``),
  each with the call's record as ``.attempts`` (``outcome.attempts_of``).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, final

from resilience import _config
from resilience.backoff import backoff_delay
from resilience.breaker import BreakerRegistry, Permit
from resilience.budget import RetryBudgets
from resilience.clock import Clock
from resilience.errors import ErrorTypes, ResilienceError
from resilience.events import (
    BreakerRejected,
    CallObserver,
    EngineRefused,
    Event,
    ProbeCompleted,
    RetryBudgetExhaustedEvent,
    RetryScheduled,
    emit,
)
from resilience.outcome import AttemptRecord, CallOutcome, Delivery, Outcome
from resilience.policy import ProbeAnswer, ProbeContext
from resilience.retry.spec import AttemptResult, CallSpec, Timeouts, attempt_timeouts, classify, deadline_times

__all__ = ["AskProbe", "Decision", "NextStep", "Raise", "RetryCall", "Return", "Send", "Step", "Wait"]

R = TypeVar("R")
_next_call_id = itertools.count(1).__next__
log = logging.getLogger("resilience.retry")
_events_log = logging.getLogger("resilience.events")
_INF = math.inf
_SUCCESS = Outcome.SUCCESS
_CALL_SUCCESS = CallOutcome.SUCCESS
_NOT_SENT = Delivery.NOT_SENT
"""The members ``attempt_done`` reads on every attempt, as module globals: CPython 3.11 specializes a global's load, not a
class attribute's, which costs about 0.1 us in a real call (``benchmarks/NOTES.md``, "Core v3, sixth pass")."""


@final
@dataclass(slots=True, init=False)
class Send:
    """Make attempt ``attempt`` now, bounded by ``timeouts``, with ``headers`` added (trace context).

    Built as ``Send()``, then each field set: no ``__init__`` frame on every attempt (``bench_calls.py`` counts it).
    """

    attempt: int
    timeouts: Timeouts
    """(connect, read) seconds for this attempt; None = no limit."""
    headers: dict[str, str]


@final
@dataclass(slots=True)
class Wait(Generic[R]):
    """Release ``discard`` (a response not returned), sleep ``delay_s``, then ask ``next_step()``."""

    delay_s: float
    discard: R | None = None


@final
@dataclass(slots=True)
class AskProbe:
    """Ask ``probe(context)`` whether the ambiguous attempt was applied, then report with ``probe_answered``."""

    probe: Callable[[ProbeContext], Any]
    """The policy's probe: returns a ``ProbeAnswer`` (or its string), possibly as an awaitable."""
    context: ProbeContext


@final
@dataclass(slots=True, init=False)
class Return(Generic[R]):
    """The call is over: release ``discard`` when set, and return ``response``.

    Built as ``Return()``, then each field set, as ``Send`` is: every call ends with one.
    """

    response: R
    attempts: tuple[AttemptRecord, ...]
    discard: R | None


def _returned(response: R, attempts: tuple[AttemptRecord, ...], discard: R | None) -> Return[R]:
    """``Return`` with its three fields (a retried call's end; a first-attempt success builds its own inline)."""
    done: Return[R] = Return()
    done.response, done.attempts, done.discard = response, attempts, discard
    return done


@final
@dataclass(slots=True)
class Raise(Generic[R]):
    """The call is over: release ``discard`` when set (it may also be ``error.response``), and raise ``error``."""

    error: BaseException
    discard: R | None = None


Decision = Wait[R] | AskProbe | Return[R] | Raise[R]
"""What ``attempt_done`` and ``probe_answered`` answer."""
NextStep = Send | Raise[R]
"""What ``next_step`` answers."""
Step = Send | Wait[R] | AskProbe | Return[R] | Raise[R]
"""Any step (the classes are final: ``type(step) is`` tells them apart)."""
_new_record = tuple.__new__
"""Builds an ``AttemptRecord`` from all its fields in one C call (its ``NamedTuple.__new__`` is a Python function more)."""
NO_HEADERS: dict[str, str] = {}
"""The header carrier of an unobserved attempt: nobody adds to it (drivers only read it)."""


class RetryCall(Generic[R]):
    """One logical call's state, built with the ``Retrier``'s parts (``Retrier.begin(spec)``); one driver steps it.

    Building it starts the call: its deadlines (clock readings: ``hard_at``
    caps every attempt, no retry starts past ``window_at``; ``inf`` = never),
    a deposit in the budget, ``call_started`` when heard.
    """

    __slots__ = (
        "_flight_started", "_next", "_released", "_unreachable", "_warned", "breaker", "budget", "call_id", "clock", "ended",
        "errors", "hard_at", "hearing", "in_flight", "last", "observers", "permit", "records", "rng", "spec", "started",
        "window_at", "window_only",
    )

    def __init__(
        self,
        spec: CallSpec,
        breakers: BreakerRegistry | None,
        budgets: RetryBudgets | None,
        observers: tuple[CallObserver, ...],
        hearing: tuple[tuple[CallObserver, ...], ...],
        clock: Clock,
        rng: Callable[[], float],
        errors: ErrorTypes,
    ) -> None:
        self.spec = spec
        self.breaker = None if breakers is None else breakers.by_engine[spec.engine]
        self.budget = budget = None if budgets is None else budgets.by_engine[spec.engine]
        self.observers = observers
        self.hearing = hearing
        """Per moment (``call_started``, ``attempt_started``, ``attempt_ended``, ``call_ended``), the observers that hear it."""
        self.clock = clock
        self.rng = rng
        self.errors = errors
        self.started = now = clock.monotonic()
        window_at, hard_at = deadline_times(spec, now)
        self.window_at = window_at
        self.window_only = hard_at is not None
        """The window only bounds retries: the caller bounded the attempts, and no entry named ``deadline_s``."""
        self.hard_at = window_at if hard_at is None else hard_at
        self.records: list[AttemptRecord] | None = None
        """Every attempt so far, once there are two or a failure (a first-attempt success never builds the list)."""
        self.last: AttemptResult[R] | None = None
        self.permit: Permit | None = None
        self.ended = False
        self.in_flight = False
        """An attempt asked for by ``next_step`` has not been reported yet; it started at ``_flight_started``."""
        self._flight_started = now
        self._next = 0
        self._released = False
        """The last response was already handed out for release (in a ``Wait``)."""
        self._warned = False
        """The call's first refusal was announced (logged and ``EngineRefused``)."""
        self._unreachable = False
        """The connect window ended the call: refused for all of it, so the breaker opens."""
        self.call_id = 0
        """Announced with every event of the call (0 when nobody observes)."""
        if observers:
            self.call_id = call_id = _next_call_id()
        if hearing[0]:
            left = window_at - now  # seconds the whole call may take from its start (an outer deadline may have passed)
            deadline_s = None if window_at == _INF else (left if left > 0 else 0.0)
            method, endpoint, engine = spec.method, spec.match.endpoint, spec.engine
            for observer in hearing[0]:
                try:
                    observer.call_started(call_id, method, endpoint, engine, deadline_s)
                except Exception:  # an observer must never break a control call
                    _failed(observer, "call_started")
        if budget is not None and not budget.full:  # a full budget: a deposit changes nothing
            budget.deposit()

    @property
    def sent(self) -> int:
        """Attempts that may have reached the server."""
        return sum(1 for r in self.attempts if r.delivery is not Delivery.NOT_SENT)

    @property
    def attempts(self) -> tuple[AttemptRecord, ...]:
        """Every attempt so far."""
        return () if self.records is None else tuple(self.records)

    # -- the steps -------------------------------------------------------

    def next_step(self) -> NextStep[R]:
        """Before each attempt: time left and the breaker's admission, then the attempt's timeouts and headers."""
        spec = self.spec
        clock = self.clock
        n = self._next
        left = self.hard_at - (self.started if n == 0 else clock.monotonic())  # the first attempt goes as the call starts
        if left <= 0:
            last = self.last
            if last is not None and _refused(last):
                # A backoff after a refusal that overslept the deadline (a busy machine): end as when the wait did
                # not fit (``_retry_or_end``), so a refusal stays a connection error, whatever the scheduler did.
                refusal = self._exhaust(_reason(last))
                assert isinstance(refusal, Raise)  # no response to hand back: the refusal itself is raised
                return refusal
            return self._fail(CallOutcome.DEADLINE_EXCEEDED, self.errors.deadline_exceeded, "deadline exceeded before attempt")
        breaker = self.breaker
        if breaker is not None:
            permit = breaker.closed_permit if self.permit is None else None  # a closed breaker's shared permit
            if permit is None:
                permit = breaker.admit(self.permit)
            if permit is None:
                self._emit(BreakerRejected)
                message = f"circuit open for {spec.engine} (retry in {breaker.retry_in():.2f}s)"
                # the error's record ends with the refused attempt (not sent); events count only attempts made
                refused = AttemptRecord(n, None, Outcome.RETRYABLE, Delivery.NOT_SENT, self.errors.circuit_open.__qualname__, 0.0)
                return self._fail(CallOutcome.CIRCUIT_OPEN, self.errors.circuit_open, message, refused)
            self.permit = permit
        timeouts = attempt_timeouts(spec, left)
        headers = NO_HEADERS
        self.in_flight = True
        hearing = self.hearing[1]
        if hearing:  # as for the other three moments: nobody hears it, nothing is built (the driver reads NO_HEADERS)
            headers = {}
            call_id, method, endpoint, engine, timeout_s = self.call_id, spec.method, spec.match.endpoint, spec.engine, timeouts[1]
            address, port = spec.server_address, spec.server_port
            for observer in hearing:
                try:
                    observer.attempt_started(call_id, n, method, endpoint, engine, address, port, timeout_s, headers)
                except Exception:
                    _failed(observer, "attempt_started")
        if n or self.observers:  # the first attempt of an unobserved call starts as the call does
            self._flight_started = clock.monotonic()
        step = Send()  # no ``__init__`` (see ``Send``)
        step.attempt, step.timeouts, step.headers = n, timeouts, headers
        return step

    def attempt_done(self, result: AttemptResult[R]) -> Decision[R]:
        """What the transport saw on the attempt ``next_step`` asked for: classified, recorded, announced, decided."""
        if not self.in_flight:
            raise RuntimeError("attempt_done() without a Send from next_step()")
        self.in_flight = False
        spec = self.spec
        policy = spec.match.policy
        n = self._next
        duration = self.clock.monotonic() - self._flight_started
        status = result.status
        outcome = classify(policy, status=status, delivery=result.delivery, retry_after=result.retry_after)
        error_type = type(result.error).__qualname__ if result.error is not None else None
        if self.hearing[2]:
            shown = error_type or (str(status) if outcome is not _SUCCESS else None)  # a failed status names itself
            sent = result.delivery is not _NOT_SENT
            call_id, method, endpoint, engine = self.call_id, spec.method, spec.match.endpoint, spec.engine
            for observer in self.hearing[2]:
                try:
                    observer.attempt_ended(call_id, n, method, endpoint, engine, status, outcome, shown, sent, duration)
                except Exception:
                    _failed(observer, "attempt_ended")
        self.last = result
        self._released = False
        record = _new_record(AttemptRecord, (n, status, outcome, result.delivery, error_type, duration, None))  # all 7 fields
        if outcome is _SUCCESS and self.records is None:  # the common case: one record, no list
            self.ended = True
            if self.breaker is not None and self.permit is not self.breaker.calm:  # calm: a success changes nothing
                self.breaker.record_success(self.permit)  # as ``_end`` decides for a success
            if self.hearing[3]:
                self._announce_end(_CALL_SUCCESS, None)
            assert result.response is not None
            done: Return[R] = Return()  # no ``__init__`` (see ``Send``)
            done.response, done.attempts, done.discard = result.response, (record,), None
            return done
        if self.records is None:
            self.records = [record]
        else:
            self.records.append(record)
        if outcome is Outcome.SUCCESS:
            return self._succeed(result.response)
        gateway_probe = _gateway_probe(spec, result)
        if gateway_probe is not None:  # a gateway status on a non-idempotent endpoint: the front end may have handed it on first
            return AskProbe(gateway_probe, self._probe_context(result))
        if outcome is Outcome.FATAL:
            return self._give_back(result, CallOutcome.FAILED)
        if outcome is Outcome.AMBIGUOUS and not policy.idempotent:
            probe = spec.match.probe
            if probe is None:
                if not spec.match.explicit:
                    return self._give_back(result, CallOutcome.AMBIGUOUS)  # not re-sent; the transport's own error
                return self._ambiguous(_reason(result))
            return AskProbe(probe, self._probe_context(result))
        return self._retry_or_end(_reason(result))

    def _probe_context(self, result: AttemptResult[R]) -> ProbeContext:
        spec = self.spec
        url = str(spec.url)
        return ProbeContext(spec.method, url, spec.match.endpoint, spec.engine, self._next, result.error, result.status, spec.body)

    def probe_answered(self, answer: object, on_done: Callable[[], R] | None = None) -> Decision[R]:
        """The probe's verdict (a ``ProbeAnswer``, its string, or whatever a failing probe left: unknown): the module's "Ambiguity".

        ``on_done`` builds the response to return when the answer is "done"
        (the driver's stand-in for the lost answer; called only then); without
        one, "done" cannot be returned and ends as ambiguous.
        """
        try:
            verdict = ProbeAnswer(answer if isinstance(answer, str) else "")
        except ValueError:
            verdict = ProbeAnswer.UNKNOWN
        self._emit(ProbeCompleted, answer=str(verdict))
        last = self.last
        assert last is not None  # a probe is asked only about a reported attempt
        if verdict is ProbeAnswer.DONE and on_done is not None:
            return self._succeed(on_done(), discard=last.response)
        if verdict is ProbeAnswer.NOT_DONE:
            return self._retry_or_end("probe_not_done")
        if last.status is not None:  # a gateway status: the endpoint's own choice, as without a probe
            if self.spec.match.policy.retry_statuses_if_not_idempotent:
                return self._retry_or_end(_reason(last))
            return self._give_back(last, CallOutcome.FAILED)
        return self._ambiguous(_reason(last))

    def abandon(self, exc: BaseException, *, delivery: Delivery = Delivery.AMBIGUOUS) -> None:
        """Something outside the verdicts ended the call (an exception in the attempt, a cancelled task, an interrupt).

        An attempt in flight is recorded with ``delivery``: ambiguous
        unless the driver has proof it never left (``NOT_SENT``: a TLS
        handshake that failed, say); the call ends as failed but neutral for
        the breaker (its slot goes back); nothing more on a call already ended.
        An ``Exception`` without a record gets the call's as ``.attempts``
        (an interrupt is not the transport's answer: none).
        """
        if self.in_flight:
            self.in_flight = False
            duration = self.clock.monotonic() - self._flight_started
            record = AttemptRecord(self._next, None, Outcome.FATAL, delivery, type(exc).__qualname__, duration)
            if self.records is None:
                self.records = []
            self.records.append(record)
        if not self.ended:
            self._end(CallOutcome.FAILED, type(exc).__qualname__, neutral=True)
        if isinstance(exc, Exception) and self.records and not getattr(exc, "attempts", None):
            _attach(exc, self.attempts)

    # -- decisions -------------------------------------------------------

    def _connect_window_left(self) -> float | None:
        """Seconds left of ``connect_window_s`` while every attempt failed before sending; None when the window does not apply."""
        window = self.spec.match.policy.retry.connect_window_s
        if window is None or any(r.delivery is not Delivery.NOT_SENT for r in self.attempts):
            return None
        return max(0.0, window - (self.clock.monotonic() - self.started))

    def _announce_refusal(self, result: AttemptResult[R]) -> None:
        """The call's first refusal, once: a WARNING naming the engine and how long the call keeps trying, and ``EngineRefused``."""
        self._warned = True
        window = None if self.window_at == _INF else max(0.0, self.window_at - self.clock.monotonic())
        bounds = [b for b in (self._connect_window_left(), window) if b is not None]
        retry_for = min(bounds) if bounds else None
        error_type = type(result.error).__qualname__
        shown = "no limit (no deadline)" if retry_for is None else f"{retry_for:.1f} s"
        message = "%s refused %s (%s); retrying for up to %s, then the call fails with this error"
        log.warning(message, self.spec.engine, self.spec.match.endpoint, error_type, shown)
        self._emit(EngineRefused, error_type=error_type, retry_for_s=retry_for)

    def _exhausted(self) -> bool:
        """No attempt left: the body cannot be replayed, the testing cap, or ``max_attempts`` (the module's "Attempts").

        Testing mode counts failures before sending too (no sleeps: they would spin until the deadline).
        """
        if not self.spec.replayable:
            return True
        n = self._next
        testing = _config.current_testing()
        if testing.attempts is not None and n + 1 >= testing.attempts:
            return True
        counted = self.sent if self.window_at != _INF and not testing.active else n + 1
        return counted >= self.spec.match.policy.retry.max_attempts

    def _exhaust(self, reason: str) -> Return[R] | Raise[R]:
        """Out of attempts: the last response (as plain requests), the transport's own error, or retries-exhausted."""
        last = self.last
        assert last is not None
        if last.response is not None and not self.spec.match.policy.raise_on_exhausted:
            return self._give_back(last, CallOutcome.FAILED)
        if last.response is None and last.error is not None:  # the transport's own error, as plain requests would raise it
            return self._give_back(last, CallOutcome.FAILED)
        spec = self.spec
        message = f"{spec.match.endpoint} on {spec.engine}: {len(self.attempts)} attempts failed (last: {reason})"
        return self._fail(CallOutcome.FAILED, self.errors.retries_exhausted, message)

    def _ambiguous(self, reason: str) -> Raise[R]:
        spec = self.spec
        message = f"{spec.match.endpoint} on {spec.engine} may have been applied ({reason}); not re-sent"
        return self._fail(CallOutcome.AMBIGUOUS, self.errors.ambiguous, message)

    def _retry_or_end(self, reason: str) -> Decision[R]:
        """Another attempt after a backoff that the deadline and the retry budget allow (announced), or the end.

        The call ends as exhausted (as plain requests would: the module's
        "Attempts") when no attempt is left, or when the wait would pass a
        window that only bounds retries, ``connect_window_s`` of a call never
        connected, or, after a refusal, the deadline or the retry budget (which
        still announces itself); else a deadline or budget raises its own error.
        """
        result = self.last
        assert result is not None
        if self._exhausted():
            return self._exhaust(reason)
        spec = self.spec
        n = self._next
        retry = spec.match.policy.retry
        delay = 0.0
        if not _config.current_testing().active:
            delay = backoff_delay(
                n + 1, base_s=retry.base_s, cap_s=retry.cap_s, multiplier=retry.multiplier, jitter=retry.jitter, rng=self.rng
            )
            if result.retry_after is not None and retry.respect_retry_after:
                delay = min(result.retry_after, retry.retry_after_max_s)
        refused = _refused(result)
        if refused:
            window_left = self._connect_window_left()
            if window_left is not None and delay >= window_left:
                self._unreachable = True  # refused for the whole connect window: a dead or mistyped engine
                return self._exhaust(reason)
        left = max(0.0, self.window_at - self.clock.monotonic())
        if self.window_at != _INF and delay >= left:
            if self.window_only or refused:
                return self._exhaust(reason)  # the caller gets what plain requests would: the response, or the refusal itself
            message = f"deadline exceeded: next wait {delay:.3f}s >= {left:.3f}s left (last: {reason})"
            return self._fail(CallOutcome.DEADLINE_EXCEEDED, self.errors.deadline_exceeded, message)
        budget = self.budget
        if budget is not None and not budget.try_withdraw():
            if self.observers:  # reading the balance refills it: only when announced
                self._emit(RetryBudgetExhaustedEvent, tokens=budget.tokens)
            if refused:
                return self._exhaust(reason)
            message = f"retry budget of {spec.engine} exhausted (last: {reason})"
            return self._fail(CallOutcome.BUDGET_EXHAUSTED, self.errors.budget_exhausted, message)
        self._emit(RetryScheduled, attempt=n, reason=reason, delay_s=delay)
        records = self.records
        assert records is not None
        records[-1] = records[-1]._replace(delay_s=delay)
        self._next += 1
        if refused and not self._warned:
            self._announce_refusal(result)
        self._released = result.response is not None
        return Wait(delay, result.response)

    # -- endings ---------------------------------------------------------

    def _succeed(self, response: R | None, discard: R | None = None) -> Return[R]:
        self._end(CallOutcome.RETRIED_SUCCESS if len(self.attempts) > 1 else CallOutcome.SUCCESS, None)
        assert response is not None
        return _returned(response, self.attempts, discard)

    def _give_back(self, result: AttemptResult[R], outcome: CallOutcome) -> Return[R] | Raise[R]:
        """End with what the transport saw: its response, or its own error (with ``.attempts``)."""
        if result.response is None:
            assert result.error is not None
            self._end(outcome, type(result.error).__qualname__)
            _attach(result.error, self.attempts)
            return Raise(result.error)
        self._end(outcome, str(result.status))
        return _returned(result.response, self.attempts, None)

    def _fail(self, outcome: CallOutcome, error: type[ResilienceError], message: str, refused: AttemptRecord | None = None) -> Raise[R]:
        """End with one of the loop's own errors; ``refused``: a breaker's refusal, added to its record."""
        last = self.last
        records = self.attempts if refused is None else (*self.attempts, refused)
        self._end(outcome, error.__qualname__)
        response = last.response if last is not None else None
        spec = self.spec
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
        if last is not None and last.error is not None:
            exc.__cause__ = last.error  # as ``raise exc from last.error``
            exc.__suppress_context__ = True
        return Raise(exc, discard=None if self._released else response)

    def _end(self, outcome: CallOutcome, error_type: str | None, *, neutral: bool = False) -> None:
        """The call's one breaker verdict (the module's "Breaker"), then ``call_ended`` when heard.

        A success records one; a fatal status (4xx, 500), the breaker's own
        refusal and an exception outside the transport (``neutral``) give the
        slot back; a call refused for its whole connect window is unreachable.
        """
        self.ended = True
        breaker, permit = self.breaker, self.permit
        if breaker is not None and permit is not None:
            last = self.records[-1] if self.records else None  # None on a first-attempt success too: it succeeded
            fatal_status = last is not None and last.outcome is Outcome.FATAL and last.status is not None
            if outcome in (CallOutcome.SUCCESS, CallOutcome.RETRIED_SUCCESS):
                breaker.record_success(permit)
            elif neutral or outcome is CallOutcome.CIRCUIT_OPEN or fatal_status:
                breaker.release_probe(permit)
            elif self._unreachable:
                breaker.record_unreachable(permit, window_s=self.spec.match.policy.retry.connect_window_s)
            else:
                breaker.record_failure(permit)
        if self.hearing[3]:
            self._announce_end(outcome, error_type)

    def _emit(self, kind: Callable[..., Event], **values: object) -> None:
        """Announce one of the call's other events (``call_id``, ``endpoint`` and ``engine`` filled in), when anyone observes."""
        if self.observers:
            spec = self.spec
            emit(self.observers, kind(call_id=self.call_id, endpoint=spec.match.endpoint, engine=spec.engine, **values))

    def _announce_end(self, outcome: CallOutcome, error_type: str | None) -> None:
        last = self.last
        status = last.status if last is not None else None
        attempts = len(self.records) if self.records is not None else (0 if last is None else 1)
        duration = self.clock.monotonic() - self.started
        tokens = self.budget.tokens if self.budget is not None else None  # the balance after the call
        spec = self.spec
        call_id, method, endpoint, engine = self.call_id, spec.method, spec.match.endpoint, spec.engine
        for observer in self.hearing[3]:
            try:
                observer.call_ended(call_id, method, endpoint, engine, outcome, status, attempts, duration, error_type, tokens)
            except Exception:
                _failed(observer, "call_ended")


def _gateway_probe(spec: CallSpec, result: AttemptResult[Any]) -> Callable[[ProbeContext], Any] | None:
    """The probe to ask about a gateway status (the policy's retry statuses) on a non-idempotent table entry; None = none.

    The status may come from a front end that handed the request on (it was
    applied) or from one that did not; the probe tells which before anything is re-sent.
    """
    policy = spec.match.policy
    probe = spec.match.probe
    if probe is None or result.status not in policy.retry.statuses or policy.idempotent or not spec.match.explicit:
        return None
    return probe


def _refused(result: AttemptResult[Any]) -> bool:
    """The attempt never left (a refused connection, say): a deadline or budget that stops the call then ends it with that error."""
    return result.delivery is Delivery.NOT_SENT and result.error is not None


def _reason(result: AttemptResult[Any]) -> str:
    if result.status is not None:
        return f"status_{result.status}"
    return result.error_kind or "error"


def _attach(error: BaseException, records: tuple[AttemptRecord, ...]) -> None:
    with contextlib.suppress(AttributeError):  # an exception class with __slots__
        error.attempts = records  # type: ignore[attr-defined]


def _failed(observer: CallObserver, moment: str) -> None:
    """Log (never raise) an observer's failure, as ``resilience.events.emit`` does."""
    _events_log.exception("observer %r failed on %s", observer, moment)
