"""Errors: ``ConfigError`` for invalid values (with ``require``), and the errors the retry loop raises.

The retry loop's errors carry the attempts taken (``.attempts``: the delivery
record ``resilience.outcome.attempts_of`` reads) and, where known, the last
status. They belong to no transport library: each driver raises subclasses
that are also its library's own exceptions (``resilience.adapters.requests_errors``,
``httpx_errors``, ``aiohttp_errors``), passed to the loop as ``ErrorTypes``, so
code written for that library keeps catching what it caught.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

from resilience.outcome import AttemptRecord

__all__ = [
    "AmbiguousOutcome",
    "CircuitOpen",
    "ConfigConflict",
    "ConfigError",
    "DeadlineExceeded",
    "ErrorTypes",
    "PolicyError",
    "ResilienceError",
    "RetriesExhausted",
    "RetryBudgetExhausted",
    "finite_number",
    "integer",
    "require",
]


class ConfigError(ValueError):
    """An invalid value (policy, policy file, breaker or budget config, deadline, fault plan).

    The one error type for bad input; the message names the field and the rule
    it broke. A ``ValueError``, so ``except ValueError`` keeps catching it.
    """


class ConfigConflict(ConfigError, TypeError):
    """Arguments that cannot be given together (``session=`` with ``policies=``, ``config=`` with ``breaker=``).

    The message names every argument in the conflict. A ``ConfigError`` (bad
    input), and a ``TypeError``, what Python raises for arguments that do not
    fit a signature, so ``except TypeError`` keeps catching it too.
    """


PolicyError = ConfigError
"""The name policies have always raised; the same class as ``ConfigError``."""


def require(ok: bool, owner: str, name: str, rule: str, value: object) -> None:
    """Raise ``ConfigError("{owner}.{name} must be {rule}, but was {value!r}")`` unless ``ok``."""
    if not ok:
        raise ConfigError(f"{owner}.{name} must be {rule}, but was {value!r}")


def integer(value: object) -> bool:
    """An ``int`` that is not a ``bool`` (for ``require``)."""
    return isinstance(value, int) and not isinstance(value, bool)


def finite_number(value: object) -> bool:
    """An ``int`` or ``float``, not a ``bool``, neither infinite nor NaN (for ``require``)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


class ResilienceError(Exception):
    """Base of the errors the retry loop raises itself.

    ``endpoint`` is the policy template, ``engine`` the target, ``attempts``
    the record of every attempt taken (a breaker's refusal included),
    ``last_status`` the last HTTP status seen (or None), ``last_error`` the
    last transport error (or None), ``request`` / ``response`` the driver's
    request and the last response (or None), as requests names them.
    ``str(err)`` is the message alone; the error pickles with its attributes.
    """

    def __init__(
        self,
        message: str,
        *,
        endpoint: str = "",
        engine: str = "",
        attempts: tuple[AttemptRecord, ...] = (),
        last_status: int | None = None,
        last_error: BaseException | None = None,
        request: Any = None,
        response: Any = None,
    ) -> None:
        super().__init__(message)
        if request is None and response is not None:
            request = getattr(response, "request", None)
        self.request = request  # through httpx's ``request`` property on the httpx driver's classes
        self.response = response
        self.endpoint = endpoint
        self.engine = engine
        self.attempts = attempts
        self.last_status = last_status
        self.last_error = last_error


class DeadlineExceeded(ResilienceError):
    """The call's deadline ran out (or the next wait would pass it) before a success."""


class CircuitOpen(ResilienceError):
    """Not sent: the engine's circuit breaker is open."""


class AmbiguousOutcome(ResilienceError):
    """A non-idempotent request may have been acted on; it was not re-sent.

    The server might have done the work (a read timeout or a connection
    dropped after sending). Find out from the server's state before
    repeating it.
    """


class RetryBudgetExhausted(ResilienceError):
    """A retry was needed but the engine's retry budget is spent."""


class RetriesExhausted(ResilienceError):
    """Every attempt failed and the policy asks for an error instead of the last response."""


@dataclass(frozen=True, slots=True)
class ErrorTypes:
    """The classes the retry loop raises, one per kind: a driver passes its own subclasses.

    Each field defaults to the class of its name, and a replacement must
    subclass that default, so ``except resilience.DeadlineExceeded`` catches
    it from every driver while, say, the httpx driver's also is an
    ``httpx.TimeoutException``. An invalid class raises ``ConfigError`` here.
    """

    deadline_exceeded: type[DeadlineExceeded] = DeadlineExceeded
    """The call's deadline ended first (default ``DeadlineExceeded``)."""
    circuit_open: type[CircuitOpen] = CircuitOpen
    """The engine's breaker refused the attempt (default ``CircuitOpen``)."""
    ambiguous: type[AmbiguousOutcome] = AmbiguousOutcome
    """A non-idempotent call may have been applied (default ``AmbiguousOutcome``)."""
    budget_exhausted: type[RetryBudgetExhausted] = RetryBudgetExhausted
    """The engine's retry budget is spent (default ``RetryBudgetExhausted``)."""
    retries_exhausted: type[RetriesExhausted] = RetriesExhausted
    """Every attempt failed and the policy asks for an error (default ``RetriesExhausted``)."""

    def __post_init__(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)
            base = field.default
            assert isinstance(base, type)
            require(
                isinstance(value, type) and issubclass(value, base), "ErrorTypes", field.name, f"a subclass of {base.__qualname__}", value
            )
