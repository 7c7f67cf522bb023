"""What a failed control call did to the engine: applied, not applied, or maybe (unknown).

The barrier folds this into its knowledge of the engine (``resilience.barrier.knowledge``):
a "maybe" makes the facts the call touches unknown.
"""

from __future__ import annotations

import sys

import requests

from resilience.barrier.fanout import EngineDied, EngineUnavailable, PhaseTimeout
from resilience.barrier.knowledge import CallOutcome
from resilience.errors import AmbiguousOutcome
from resilience.outcome import AttemptRecord, Delivery

__all__ = ["is_engine_dead", "outcome_of"]


def _attempts(error: BaseException) -> tuple[AttemptRecord, ...]:
    """The retry loop's record, on the error or on the response it carries."""
    response = getattr(error, "response", None)
    attempts: tuple[AttemptRecord, ...] = getattr(error, "attempts", None) or getattr(response, "attempts", None) or ()
    return attempts


def is_engine_dead(error: BaseException) -> bool:
    """True when the error says the engine is gone: its actor died, or every attempt of the call was refused before sending
    (a connection error of ``requests``, ``httpx`` or ``aiohttp`` with the retry loop's record).

    A ``CircuitOpen`` counts only when the call's own attempts were all refused (the breaker opened on them).
    """
    if isinstance(error, EngineDied):
        return True
    attempts = _attempts(error)
    connection_errors: tuple[type[BaseException], ...] = (
        ConnectionError, requests.ConnectionError, *_loaded("aiohttp", "ClientConnectionError"), *_loaded("httpx", "ConnectError")
    )
    if isinstance(error, connection_errors):
        return bool(attempts) and all(a.delivery is Delivery.NOT_SENT for a in attempts)
    return False


def _loaded(module: str, *names: str) -> tuple[type[BaseException], ...]:
    """Exception classes of an optional transport (httpx, aiohttp), if it is imported: an error can only be one of
    them if it is. The core never imports a transport itself."""
    mod = sys.modules.get(module)
    classes = (getattr(mod, name, None) for name in names) if mod is not None else ()
    return tuple(c for c in classes if isinstance(c, type) and issubclass(c, BaseException))


def outcome_of(error: BaseException | None) -> CallOutcome:
    """The effect of a call that ended with ``error`` (None: it succeeded).

    - no error: APPLIED;
    - ``PhaseTimeout``: MAYBE, unless the call surely never started (``maybe_sent=False``);
    - ``AmbiguousOutcome``, a dead or unavailable Ray actor (``EngineDied``,
      ``EngineUnavailable``: Ray says such a call may have run): MAYBE;
    - an error that records its attempts (the retry loop's, on the error or its
      response): MAYBE when any attempt may have been applied (read timeout,
      reset after sending), else NOT_APPLIED (every attempt was refused before
      sending or answered with an error status);
    - an error answer without a record (``response`` or ``status`` set): NOT_APPLIED;
    - a failure to connect (``requests.ConnectTimeout``, ``httpx.ConnectError``
      and ``ConnectTimeout``, ``aiohttp.ClientConnectorError``): NOT_APPLIED; any
      other transport error without a record (``requests`` timeouts and
      connection errors, ``httpx.TransportError``, aiohttp's connection and
      payload errors, ``OSError`` and ``TimeoutError``): MAYBE;
    - anything else (an error answer, bad input): NOT_APPLIED.
    """
    if error is None:
        return CallOutcome.APPLIED
    if isinstance(error, PhaseTimeout):
        return CallOutcome.MAYBE if error.maybe_sent else CallOutcome.NOT_APPLIED
    if isinstance(error, (AmbiguousOutcome, EngineDied, EngineUnavailable)):
        return CallOutcome.MAYBE
    attempts = _attempts(error)
    if attempts:
        return CallOutcome.MAYBE if any(a.delivery is Delivery.MAYBE_APPLIED for a in attempts) else CallOutcome.NOT_APPLIED
    if getattr(error, "response", None) is not None or isinstance(getattr(error, "status", None), int):
        return CallOutcome.NOT_APPLIED
    not_sent: tuple[type[BaseException], ...] = (
        requests.ConnectTimeout,
        *_loaded("httpx", "ConnectError", "ConnectTimeout"),
        *_loaded("aiohttp", "ClientConnectorError"),
    )
    if isinstance(error, not_sent):
        return CallOutcome.NOT_APPLIED
    transport_errors: tuple[type[BaseException], ...] = (
        requests.Timeout,
        requests.ConnectionError,
        OSError,
        *_loaded("httpx", "TransportError"),
        *_loaded("aiohttp", "ClientConnectionError", "ClientPayloadError"),
    )
    if isinstance(error, transport_errors):
        return CallOutcome.MAYBE
    return CallOutcome.NOT_APPLIED
