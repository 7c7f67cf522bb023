"""The retry loop of one logical call, independent of any transport.

Outermost first: deadline -> breaker check -> attempt (with its own
timeout) -> classify -> budget check -> backoff -> next attempt. Each arrow is
one named step of ``RetryCall`` (``resilience.retry_call``), a decision
object that does no I/O and never sleeps: it answers "send attempt n with
these timeouts and headers", "wait d seconds", "ask the probe", "return this
response" or "raise this error". ``Retrier.run`` drives it with blocking
calls (the requests and sync httpx drivers), ``Retrier.arun`` with
coroutines (httpx async, aiohttp); a driver supplies one function that makes
a single attempt and reports what it saw. Everything else is decided in the
core, without sockets, on an injectable clock and random source.

The rules every driver gets:

- **Attempts.** ``RetryPolicy.max_attempts`` bounds the attempts that may have
  reached the server. Failures before sending (connection refused, connect
  timeout: ``Delivery.NOT_SENT``) are retried with backoff, for any method:
  for ``RetryPolicy.connect_window_s`` while the call has never connected,
  until the call's deadline once it has; only a call with no deadline at all
  counts them against ``max_attempts`` too. When the window, the deadline or
  the retry budget ends the retries on a refusal, the caller gets the
  refusal itself (the transport's own error, with ``.attempts``): an
  unreachable engine reads as one, never as a timeout. A call's first
  refusal is logged once at WARNING (``resilience.retry``) and announced as
  ``EngineRefused``; a call refused for its whole window opens the engine's
  breaker at once. A body that cannot be replayed
  (``CallSpec.replayable=False``) gets exactly one attempt.
- **Timeouts** (one precedence rule): each attempt's (connect, read) timeout is
  the matched table entry's ``attempt_timeout_s`` when the entry *names* it
  (``EndpointPolicy.named``: given in Python or in a policy file, not left at
  its default); else the caller's own timeout (``CallSpec.request_timeout``,
  e.g. requests' ``timeout=``; ``(None, None)`` = wait as long as it takes);
  else the policy's ``attempt_timeout_s`` (an entry's default or the default
  policy's). A deadline caps attempt timeouts when it was named for this
  endpoint (an entry's ``deadline_s``), when the caller gave no timeout, or
  when the caller set it (an outer ``Deadline``). A ``deadline_s`` nobody
  named never shortens a timeout the caller gave: it only bounds how long
  retries are started, and when it ends the caller gets what plain requests
  would have given (the last response or the transport's own error).
- **Ambiguity.** A non-idempotent attempt that may have been applied is never
  re-sent blindly: a table entry's ``on_ambiguous`` probes or raises
  ``AmbiguousOutcome``; a request no entry matches gets the transport's own
  error (a ``ReadTimeout``, say), exactly as plain requests would raise it.
  A gateway status (the policy's retry statuses) on a non-idempotent entry
  that has a probe asks the probe too before anything is re-sent: a front end
  may answer 502 after handing the request on. "Done" returns as applied,
  "not done" re-sends, "unknown" does what the entry does without a probe.
- **Breaker.** It judges logical calls, not attempts: a call whose failures
  the retries absorbed counts as a success, so a flaky gateway in front of a
  healthy engine never opens it, while a dead engine does. Every attempt is
  admitted (``CircuitBreaker.admit``): a call that keeps retrying after the
  breaker went half-open needs a probe slot like any new call, and every exit
  (a verdict, a 4xx, an exception anywhere, KeyboardInterrupt in a backoff
  sleep, a cancelled task) gives the breaker its verdict or its slot back.
- **Errors.** The loop's own errors are the classes of the ``Retrier``'s
  ``ErrorTypes``: subclasses of ``resilience.errors``' classes that are also
  the transport's own exception types (the httpx driver's
  ``DeadlineExceeded`` is an ``httpx.TimeoutException``).
"""

from __future__ import annotations

import asyncio
import inspect
import random
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from typing import Any, TypeVar

from resilience.breaker import BreakerConfig, BreakerRegistry
from resilience.budget import RetryBudgetConfig, RetryBudgets
from resilience.call import AttemptResult, CallSpec, Timeouts, attempt_timeouts, call_deadlines
from resilience.clock import SYSTEM_CLOCK, Clock
from resilience.errors import ErrorTypes
from resilience.events import Observer
from resilience.outcome import AttemptRecord, Delivery
from resilience.policy import ProbeContext
from resilience.retry_call import Probe, Raise, RetryCall, Return, Send, Wait

__all__ = ["AsyncAttempt", "Attempt", "AttemptResult", "CallSpec", "Retrier", "attempt_timeouts", "call_deadlines"]

R = TypeVar("R")
Attempt = Callable[[int, Timeouts, MutableMapping[str, str]], AttemptResult[R]]
"""``attempt(n, (connect_s, read_s), headers)``: make attempt ``n``; report transport errors, never raise them."""
AsyncAttempt = Callable[[int, Timeouts, MutableMapping[str, str]], Awaitable[AttemptResult[R]]]
"""The coroutine form of ``Attempt``."""


class Retrier:
    """Runs logical calls: shared breakers, budgets, observers, clock, random source and error classes.

    ``breakers`` / ``budgets`` may be None to turn that strategy off.
    ``rng`` returns floats in [0, 1) for jitter. ``error_types``: the classes
    the loop raises (default ``ErrorTypes()``, the requests-flavoured ones).
    One ``Retrier`` serves threads and asyncio tasks at once.
    """

    def __init__(
        self,
        *,
        breakers: BreakerRegistry | None = None,
        budgets: RetryBudgets | None = None,
        observers: Sequence[Observer] = (),
        clock: Clock = SYSTEM_CLOCK,
        rng: Callable[[], float] = random.random,
        error_types: ErrorTypes | None = None,
    ) -> None:
        self.breakers = breakers
        self.budgets = budgets
        self.observers = tuple(observers)
        self.clock = clock
        self.rng = rng
        self.error_types = error_types if error_types is not None else ErrorTypes()

    @classmethod
    def from_configs(
        cls,
        *,
        breaker: BreakerConfig | None,
        retry_budget: RetryBudgetConfig | None,
        observers: Sequence[Observer] = (),
        clock: Clock = SYSTEM_CLOCK,
        rng: Callable[[], float] = random.random,
        error_types: ErrorTypes | None = None,
    ) -> Retrier:
        """A ``Retrier`` with one breaker and one budget per engine, built from their configs (None = that strategy off).

        A ``Retrier`` of its own state; the drivers build theirs with
        ``DriverConfig.retrier`` (``resilience.driver_config``), whose breakers
        and budgets every driver built from one config shares.
        """
        observers = tuple(observers)
        return cls(
            breakers=None if breaker is None else BreakerRegistry(breaker, clock=clock, observers=observers),
            budgets=None if retry_budget is None else RetryBudgets(retry_budget, clock=clock),
            observers=observers,
            clock=clock,
            rng=rng,
            error_types=error_types,
        )

    def begin(self, spec: CallSpec) -> RetryCall[Any]:
        """The sans-IO decision object for one call (``resilience.retry_call``); ``run`` and ``arun`` drive it."""
        return RetryCall.begin(
            spec,
            breaker=self.breakers.get(spec.engine) if self.breakers is not None else None,
            budget=self.budgets.get(spec.engine) if self.budgets is not None else None,
            observers=self.observers,
            clock=self.clock,
            rng=self.rng,
            errors=self.error_types,
        )

    def run(
        self,
        spec: CallSpec,
        attempt: Attempt[R],
        *,
        discard: Callable[[R], None] = lambda _r: None,
        on_probe_done: Callable[[], R] | None = None,
        never_sent: Callable[[BaseException], bool] = lambda _e: False,
    ) -> tuple[R, tuple[AttemptRecord, ...]]:
        """Run one logical call with blocking I/O; return the final response and the attempts taken.

        ``attempt(n, (connect_timeout, read_timeout), carrier)`` makes attempt
        ``n`` and must not raise for transport errors (it reports them).
        ``discard`` releases a response that will not be returned.
        ``on_probe_done`` builds the response to return when a probe says an
        ambiguous request was applied.
        ``never_sent(exc)``: the driver's proof that an error its attempt
        raised (one never retried: a TLS failure, a bad URL) came before the
        request left; the attempt is then recorded as ``NOT_SENT``, else as
        ``MAYBE_APPLIED`` (default: no proof).
        Raises the transport's last error, or one of the ``error_types``; an
        ``Exception`` raised out of an attempt carries the call's record as
        ``.attempts`` too (``resilience.outcome.attempts_of``).
        """
        call: RetryCall[R] = self.begin(spec)
        try:
            step: Send | Wait[R] | Probe | Return[R] | Raise[R] = call.next_step()
            while True:
                if isinstance(step, Send):
                    step = call.attempt_done(attempt(step.attempt, step.timeouts, step.headers))
                elif isinstance(step, Wait):
                    if step.discard is not None:
                        discard(step.discard)
                    if step.delay_s > 0:
                        self.clock.sleep(step.delay_s)
                    step = call.next_step()
                elif isinstance(step, Probe):
                    answer = _ask_probe(step.probe, step.context)
                    step = call.probe_answered(answer, on_probe_done)
                else:
                    if step.discard is not None:
                        discard(step.discard)
                    if isinstance(step, Return):
                        return step.response, step.attempts
                    raise step.error
        except BaseException as exc:
            _abandon(call, exc, never_sent)  # a no-op when the call ended on a verdict
            raise

    async def arun(
        self,
        spec: CallSpec,
        attempt: AsyncAttempt[R],
        *,
        discard: Callable[[R], Awaitable[None] | None] = lambda _r: None,
        on_probe_done: Callable[[], R] | None = None,
        never_sent: Callable[[BaseException], bool] = lambda _e: False,
    ) -> tuple[R, tuple[AttemptRecord, ...]]:
        """``run`` for coroutines: the same decisions, awaited attempts, backoff slept with the clock's ``asleep``.

        ``discard`` may return an awaitable (``aclose``, ``release``). A sync
        probe runs in a worker thread (it may do blocking I/O); a coroutine
        probe is awaited. Cancelling the calling task ends the call at once,
        neutral for the breaker (its slot goes back), and nothing more is sent.
        """
        asleep: Callable[[float], Awaitable[None]] = getattr(self.clock, "asleep", asyncio.sleep)
        call: RetryCall[R] = self.begin(spec)
        try:
            step: Send | Wait[R] | Probe | Return[R] | Raise[R] = call.next_step()
            while True:
                if isinstance(step, Send):
                    step = call.attempt_done(await attempt(step.attempt, step.timeouts, step.headers))
                elif isinstance(step, Wait):
                    if step.discard is not None:
                        await _maybe_await(discard(step.discard))
                    if step.delay_s > 0:
                        await asleep(step.delay_s)
                    step = call.next_step()
                elif isinstance(step, Probe):
                    answer = await _ask_probe_async(step.probe, step.context)
                    step = call.probe_answered(answer, on_probe_done)
                else:
                    if step.discard is not None:
                        await _maybe_await(discard(step.discard))
                    if isinstance(step, Return):
                        return step.response, step.attempts
                    raise step.error
        except BaseException as exc:
            _abandon(call, exc, never_sent)
            raise


def _abandon(call: RetryCall[Any], exc: BaseException, never_sent: Callable[[BaseException], bool]) -> None:
    """End ``call`` on ``exc`` (see ``RetryCall.abandon``) and write its record on ``exc`` when it is an error without one.

    Interrupts (``KeyboardInterrupt``, ``SystemExit``, ``CancelledError``) get
    no record: they are not the transport's answer. ``never_sent`` is asked
    only about an exception raised out of an attempt in flight.
    """
    in_flight = call.in_flight
    try:
        unsent = in_flight and isinstance(exc, Exception) and never_sent(exc)
    except Exception:
        unsent = False  # a predicate that fails proves nothing
    call.abandon(exc, delivery=Delivery.NOT_SENT if unsent else Delivery.MAYBE_APPLIED)
    if isinstance(exc, Exception) and call.records and not getattr(exc, "attempts", None):
        try:
            exc.attempts = call.attempts  # type: ignore[attr-defined]
        except AttributeError:  # an exception class with __slots__
            pass


def _ask_probe(probe: Callable[[ProbeContext], Any], context: ProbeContext) -> object:
    """The probe's answer; a probe that fails (or answers with an awaitable here) cannot tell: unknown."""
    try:
        answer = probe(context)
    except Exception:
        return None
    if inspect.isawaitable(answer):
        if inspect.iscoroutine(answer):
            answer.close()
        return None
    return answer


async def _ask_probe_async(probe: Callable[[ProbeContext], Any], context: ProbeContext) -> object:
    """The probe's answer on an event loop: a coroutine probe awaited, a sync one in a worker thread; a failing one: unknown."""
    try:
        if inspect.iscoroutinefunction(probe):
            return await probe(context)
        answer = await asyncio.to_thread(probe, context)
        if inspect.isawaitable(answer):
            return await answer
        return answer
    except Exception:
        return None


async def _maybe_await(value: Awaitable[None] | None) -> None:
    if value is not None and inspect.isawaitable(value):
        await value
