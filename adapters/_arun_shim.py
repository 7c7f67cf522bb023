"""TEMPORARY: ``Retrier.arun`` as documented, until the core lands it on main (then this file goes).

Drives the core's sync steps with awaited attempts, discards and sleeps, and
maps the core's errors to the ``error_types`` given (a dict from core class to subclass).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, TypeVar

from resilience.errors import ResilienceError
from resilience.outcome import AttemptRecord, CallOutcome, Delivery, Outcome
from resilience.retry import AttemptResult, CallSpec, Retrier, attempt_timeouts

R = TypeVar("R")
Timeouts = tuple[float | None, float | None]


async def arun(
    retrier: Retrier,
    spec: CallSpec,
    attempt: Callable[[int, Timeouts, MutableMapping[str, str]], Awaitable[AttemptResult[R]]],
    *,
    discard: Callable[[R], Awaitable[None] | None],
    on_probe_done: Callable[[], R] | None = None,
    error_types: dict[type[ResilienceError], type[ResilienceError]],
) -> tuple[R, tuple[AttemptRecord, ...]]:
    r: Any = retrier
    pending: list[Awaitable[None]] = []

    def sync_discard(resp: R) -> None:
        out = discard(resp)
        if out is not None:
            pending.append(out)

    call = r._start(spec)
    try:
        try:
            n = 0
            while True:
                r._admit(call, sync_discard)
                timeouts = attempt_timeouts(spec, call.hard.remaining())
                t0 = r.clock.monotonic()
                try:
                    result = await attempt(n, timeouts, {})
                except BaseException as exc:
                    call.records.append(
                        AttemptRecord(n, None, Outcome.FATAL, Delivery.MAYBE_APPLIED, type(exc).__qualname__, r.clock.monotonic() - t0)
                    )
                    raise
                _, outcome = r._attempt(call, n, lambda *_, res=result: res)
                if outcome is Outcome.SUCCESS:
                    return r._succeed(call, result)  # type: ignore[no-any-return]
                if outcome is Outcome.FATAL:
                    return r._give_back(call, result, CallOutcome.FAILED)  # type: ignore[no-any-return]
                reason = result.error_kind or (f"status_{result.status}" if result.status is not None else "error")
                if outcome is Outcome.AMBIGUOUS and not spec.match.policy.idempotent:
                    if not spec.match.explicit and spec.match.policy.on_ambiguous == "raise":
                        return r._give_back(call, result, CallOutcome.AMBIGUOUS)  # type: ignore[no-any-return]
                    done = r._settle_ambiguous(call, n, result, reason, sync_discard, on_probe_done)
                    if done is not None:
                        return done  # type: ignore[no-any-return]
                    reason = "probe_not_done"
                if r._exhausted(call, n):
                    return r._exhaust(call, result, reason, sync_discard)  # type: ignore[no-any-return]
                delay = r._next_delay(call, n, result, reason, sync_discard)
                if delay is None:
                    return r._exhaust(call, result, reason, sync_discard)  # type: ignore[no-any-return]
                if result.response is not None:
                    out = discard(result.response)
                    if out is not None:
                        await out
                if delay > 0:
                    await asyncio.sleep(delay)
                n += 1
        except BaseException as exc:
            if not call.ended:
                r._end(call, CallOutcome.FAILED, type(exc).__qualname__, neutral=True)
            raise
        finally:
            for p in pending:
                await p
    except ResilienceError as exc:
        cls = error_types.get(type(exc))
        if cls is None:
            raise
        new = cls(
            str(exc),
            endpoint=exc.endpoint,
            engine=exc.engine,
            attempts=exc.attempts,
            last_status=exc.last_status,
            last_error=exc.last_error,
            request=exc.request,
            response=exc.response,
        )
        raise new from exc.__cause__
