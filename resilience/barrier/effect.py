"""What a control call did to the engine, read from the driver's record only: applied, not applied, or maybe.

The barrier never looks at an exception's library or type to decide this:
every driver (the requests, httpx and aiohttp transports, the SGLang clients,
the Ray adapter) attaches the record of its attempts to the errors it raises
(``resilience.outcome.attempts_of``: ``AttemptRecord``s with a ``Delivery``).
The only errors judged by what they are are the barrier's own:
``PhaseTimeout``, ``EngineSkipped`` and ``EngineDied``.

The barrier folds the ``Effect`` into its knowledge of the engine
(``resilience.barrier.knowledge``): a "maybe" makes the facts the call
touches unknown.
"""

from __future__ import annotations

from typing import Final

from resilience.barrier.fanout import EngineNotDriven, PhaseTimeout
from resilience.barrier.knowledge import Doubt, Effect
from resilience.barrier.types import EngineSkipped
from resilience.engine_contract import EngineDied
from resilience.outcome import AttemptRecord, Delivery, attempts_of

__all__ = ["ANSWERED_FOR", "GATEWAY_STATUSES", "doubt_of", "effect_of", "is_engine_dead"]

GATEWAY_STATUSES: Final = frozenset({502, 503, 504})
"""Statuses a proxy or gateway may answer *after* it forwarded the request: the engine may have applied the call."""


def effect_of(error: BaseException | None) -> Effect:
    """The effect of a call that ended with ``error`` (None: it returned).

    - no error: APPLIED;
    - the barrier's own ``PhaseTimeout(maybe_sent=False)`` (the call never
      started), ``EngineSkipped`` and ``EngineNotDriven`` (nothing was sent): NOT_APPLIED;
    - no driver record at all (``EngineDied``, ``EngineUnavailable``, a
      ``PhaseTimeout`` of a call that may have started, any error no driver
      wrote, such as a fan-out's or an engine's own bug; an empty record,
      which ``attempts_of`` reads as none): MAYBE. This is the
      conservative reading: without the driver's word that the request never
      left, it may have been applied;
    - any attempt ``MAYBE_APPLIED`` (read timeout, reset after sending): MAYBE;
    - any attempt ``RESPONDED`` with a gateway status (502, 503, 504: a proxy
      may answer it after forwarding), whatever the transport's retry policy
      did with it: MAYBE;
    - any attempt ``RESPONDED`` with a status that is not an error (below 400:
      the engine answered, and the driver raised anyway): MAYBE;
    - otherwise every attempt was ``NOT_SENT`` (refused, connect timeout, DNS,
      TLS, a full local pool, an open breaker) or answered with the engine's own error status (4xx, other 5xx):
      NOT_APPLIED.
    """
    if error is None:
        return Effect.APPLIED
    if isinstance(error, (EngineSkipped, EngineNotDriven)) or (isinstance(error, PhaseTimeout) and not error.maybe_sent):
        return Effect.NOT_APPLIED
    attempts = attempts_of(error)
    if attempts is None:
        return Effect.MAYBE
    return Effect.MAYBE if any(_may_have_applied(a) for a in attempts) else Effect.NOT_APPLIED


ANSWERED_FOR: Final = frozenset({502, 503})
"""Gateway statuses after which the request is not on its way any more: the gateway answered for it (it never forwarded
it, or the engine had answered). After a 504, a reset or a read timeout it may still be (``MemoryProbeCheck``'s rule)."""


def doubt_of(method: str, error: BaseException | None, since: float) -> Doubt:
    """Why a call that ended with ``error`` and had a "maybe" effect leaves its tags unknown, and whether its request may
    still be on its way: yes unless every attempt that may have reached the engine was answered 502 or 503 (None: the
    call's answer was never read, an interruption)."""
    if error is None:
        return Doubt(method, True, "interrupted before its answer was read", since)
    attempts = attempts_of(error)
    if attempts is None:
        return Doubt(method, True, f"no delivery record ({type(error).__name__})", since)
    maybe = [a for a in attempts if _may_have_applied(a)]
    in_transit = [a for a in maybe if not (a.delivery is Delivery.RESPONDED and a.status in ANSWERED_FOR)]
    if not in_transit:
        return Doubt(method, False, f"HTTP {maybe[-1].status if maybe else '?'} from a gateway", since)
    last = in_transit[-1]
    if last.delivery is Delivery.MAYBE_APPLIED:
        what = f"sent, then no answer ({last.error_type or 'reset or read timeout'})"
    else:
        what = f"HTTP {last.status}" if last.status is not None else "an answer with no status"
    return Doubt(method, True, what, since)


def _may_have_applied(attempt: AttemptRecord) -> bool:
    """One attempt may have reached the engine and been acted on."""
    if attempt.delivery is Delivery.NOT_SENT:
        return False
    if attempt.delivery is Delivery.MAYBE_APPLIED:
        return True
    status = attempt.status
    return status is None or status < 400 or status in GATEWAY_STATUSES


def is_engine_dead(error: BaseException) -> bool:
    """True when the error says the engine is gone: ``EngineDied`` (its actor died), or a driver record with at least
    one real attempt whose every attempt was ``NOT_SENT`` (refused before sending, each time).

    A breaker's refusal is recorded as a ``NOT_SENT`` entry with ``error_type="CircuitOpen"``; it proves nothing
    was sent, not that the engine is gone (the breaker may have opened on gateway 502s), so it is left out here.
    """
    if isinstance(error, EngineDied):
        return True
    attempts = [a for a in attempts_of(error) or () if a.error_type != "CircuitOpen"]
    return bool(attempts) and all(a.delivery is Delivery.NOT_SENT for a in attempts)
