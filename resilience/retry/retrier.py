"""``Retrier``: runs one logical call's ``RetryCall`` with real I/O, sync (``run``) or async (``arun``): the same loop, line for line.

A driver supplies its transport's call (``Attempt``) and how to read what
it returned or raised (``Report``, ``Failed``); everything else is decided
in the core (``resilience.retry.call``), on an injectable clock and random
source.
"""

from __future__ import annotations

import asyncio
import inspect
import random
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from typing import Any, TypeVar, overload

from resilience.breaker import BreakerConfig, BreakerRegistry
from resilience.budget import RetryBudgetConfig, RetryBudgets
from resilience.clock import SYSTEM_CLOCK, Clock
from resilience.errors import ErrorTypes
from resilience.events import Observer, call_observer, hearing
from resilience.outcome import AttemptRecord, Delivery
from resilience.policy import ProbeContext
from resilience.retry.call import AskProbe, Raise, RetryCall, Return, Send, Step
from resilience.retry.spec import AttemptResult, CallSpec, Timeouts

__all__ = ["AsyncAttempt", "Attempt", "Retrier", "ask_probe", "ask_probe_async"]

R = TypeVar("R")
T = TypeVar("T")
Records = tuple[AttemptRecord, ...]
Attempt = Callable[[int, Timeouts, MutableMapping[str, str]], Any]
"""``send(n, (connect_s, read_s), headers)``: make attempt ``n``; ``AsyncAttempt`` returns its awaitable (``arun`` awaits it)."""
AsyncAttempt = Callable[[int, Timeouts, MutableMapping[str, str]], Awaitable[Any]]
Report = Callable[[Any], AttemptResult[R]] | None
"""``report(answer)``: the ``AttemptResult`` of what ``send`` returned (None: ``send`` returned one)."""
Failed = Callable[[BaseException], AttemptResult[R]] | None
"""``failed(exc)``: the ``AttemptResult`` of what ``send`` raised, or ``exc`` re-raised (None: every error re-raised).

Without ``report`` and ``failed``, ``send`` returns an ``AttemptResult`` itself, never raising for transport errors.
"""


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
        calls = tuple(call_observer(o) for o in self.observers)
        self._parts = (breakers, budgets, calls, hearing(calls), clock, rng, self.error_types)
        """What each ``RetryCall`` is built with after its spec (the observers as ``CallObserver``s: a plain callable wrapped)."""

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
        ``DriverConfig.retrier`` (``resilience.adapters.driver_config``), whose breakers
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
        """Start one call: the sans-IO decision object (``resilience.retry.call``) that ``run`` and ``arun`` drive."""
        return RetryCall(spec, *self._parts)

    def run(
        self,
        spec: CallSpec,
        send: Attempt,
        *,
        report: Report[R] = None,
        failed: Failed[R] = None,
        discard: Callable[[R], None] = lambda _r: None,
        on_probe_done: Callable[[], R] | None = None,
        never_sent: Callable[[BaseException], bool] = lambda _e: False,
    ) -> tuple[R, tuple[AttemptRecord, ...]]:
        """Run one logical call with blocking I/O; return the final response and the attempts taken.

        ``send``, ``report``, ``failed``: ``Attempt``, ``Report``, ``Failed``.
        ``discard`` releases a response that will not be returned.
        ``on_probe_done`` builds the response to return when a probe says an
        ambiguous request was applied.
        ``never_sent(exc)``: the driver's proof that an error its attempt
        raised (one never retried: a TLS failure, a bad URL) came before the
        request left; the attempt is then recorded as ``NOT_SENT``, else as
        ``AMBIGUOUS`` (default: no proof).
        Raises the transport's last error, or one of the ``error_types``, with
        the call's record as ``.attempts`` (``RetryCall.abandon``).
        """
        call: RetryCall[R] = RetryCall(spec, *self._parts)  # ``begin``, without the extra call
        try:
            step: Step[R] = call.next_step()
            while True:
                if type(step) is Send:
                    try:
                        answer = send(step.attempt, step.timeouts, step.headers)
                    except BaseException as exc:
                        if failed is None:
                            raise
                        step = call.attempt_done(failed(exc))
                    else:
                        step = call.attempt_done(answer if report is None else report(answer))
                    continue
                if type(step) is AskProbe:
                    step = call.probe_answered(ask_probe(step.probe, step.context), on_probe_done)
                    continue
                if step.discard is not None:
                    discard(step.discard)
                if type(step) is Return:
                    return step.response, step.attempts
                if type(step) is Raise:
                    raise step.error
                if step.delay_s > 0:
                    self.clock.sleep(step.delay_s)
                step = call.next_step()
        except BaseException as exc:
            _abandon(call, exc, never_sent)  # a no-op when the call ended on a verdict
            raise

    @overload
    async def arun(
        self, spec: CallSpec, send: AsyncAttempt, *, report: Report[R] = None, failed: Failed[R] = None,
        discard: Callable[[R], Awaitable[None] | None] = ..., on_probe_done: Callable[[], R] | None = None,
        never_sent: Callable[[BaseException], bool] = ..., finish: None = None,
    ) -> tuple[R, Records]: ...
    @overload
    async def arun(
        self, spec: CallSpec, send: AsyncAttempt, *, report: Report[R] = None, failed: Failed[R] = None,
        discard: Callable[[R], Awaitable[None] | None] = ..., on_probe_done: Callable[[], R] | None = None,
        never_sent: Callable[[BaseException], bool] = ..., finish: Callable[[R, Records], T],
    ) -> T: ...

    async def arun(
        self,
        spec: CallSpec,
        send: AsyncAttempt,
        *,
        report: Report[R] = None,
        failed: Failed[R] = None,
        discard: Callable[[R], Awaitable[None] | None] = lambda _r: None,
        on_probe_done: Callable[[], R] | None = None,
        never_sent: Callable[[BaseException], bool] = lambda _e: False,
        finish: Callable[[R, Records], T] | None = None,
    ) -> tuple[R, Records] | T:
        """``run`` for coroutines: the same decisions, awaited attempts, backoff slept with the clock's ``asleep``.

        ``finish(response, attempts)``, when given, is what ``arun`` returns
        instead of the pair (a driver stamps the record on its response).

        ``discard`` may return an awaitable (``aclose``, ``release``). A sync
        probe runs in a worker thread (it may do blocking I/O); a coroutine
        probe is awaited. Cancelling the calling task ends the call at once,
        neutral for the breaker (its slot goes back), and nothing more is sent.
        """
        call: RetryCall[R] = RetryCall(spec, *self._parts)  # ``begin``, without the extra call
        try:
            step: Step[R] = call.next_step()
            while True:
                if type(step) is Send:
                    try:
                        answer = await send(step.attempt, step.timeouts, step.headers)
                    except BaseException as exc:
                        if failed is None:
                            raise
                        step = call.attempt_done(failed(exc))
                    else:
                        step = call.attempt_done(answer if report is None else report(answer))
                    continue
                if type(step) is AskProbe:
                    step = call.probe_answered(await ask_probe_async(step.probe, step.context), on_probe_done)
                    continue
                if step.discard is not None:
                    await _maybe_await(discard(step.discard))
                if type(step) is Return:
                    return (step.response, step.attempts) if finish is None else finish(step.response, step.attempts)
                if type(step) is Raise:
                    raise step.error
                if step.delay_s > 0:
                    await getattr(self.clock, "asleep", asyncio.sleep)(step.delay_s)
                step = call.next_step()
        except BaseException as exc:
            _abandon(call, exc, never_sent)
            raise


def _abandon(call: RetryCall[Any], exc: BaseException, never_sent: Callable[[BaseException], bool]) -> None:
    """End ``call`` on ``exc`` (``RetryCall.abandon``), asking ``never_sent`` only about an error raised out of an attempt in flight."""
    try:
        unsent = call.in_flight and isinstance(exc, Exception) and never_sent(exc)
    except Exception:
        unsent = False  # a predicate that fails proves nothing
    call.abandon(exc, delivery=Delivery.NOT_SENT if unsent else Delivery.AMBIGUOUS)


def ask_probe(probe: Callable[[ProbeContext], Any], context: ProbeContext) -> object:
    """Ask ``probe`` from blocking code (``run``, the ledger): its answer, for ``RetryCall.probe_answered``.

    A probe that fails (or answers with an awaitable here) cannot tell: unknown (None).
    """
    try:
        answer = probe(context)
    except Exception:
        return None
    if inspect.isawaitable(answer):
        if inspect.iscoroutine(answer):
            answer.close()
        return None
    return answer


async def ask_probe_async(probe: Callable[[ProbeContext], Any], context: ProbeContext) -> object:
    """``ask_probe`` on an event loop (``arun``, the ledger): a coroutine probe awaited, a sync one in a worker thread.

    A probe that fails cannot tell: unknown (None).
    """
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
