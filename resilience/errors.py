"""Errors: ``ConfigError`` for invalid values (with ``require``), and the errors the retry loop raises.

Each retry-loop error subclasses the ``requests`` exception a plain-requests caller already
catches, so code written for ``requests`` keeps working, and each carries the
attempts taken (``.attempts``) and, where known, the last status.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import requests

from resilience.outcome import AttemptRecord

__all__ = [
    "AmbiguousOutcome",
    "CircuitOpen",
    "ConfigError",
    "DeadlineExceeded",
    "ErrorTypes",
    "PolicyError",
    "ResilienceError",
    "RetriesExhausted",
    "RetryBudgetExhausted",
    "require",
]


class ConfigError(ValueError):
    """An invalid value (policy, policy file, breaker or budget config, deadline, fault plan).

    The one error type for bad input; the message names the field and the rule
    it broke. A ``ValueError``, so ``except ValueError`` keeps catching it.
    """


PolicyError = ConfigError
"""The name policies have always raised; the same class as ``ConfigError``."""


def require(ok: bool, owner: str, name: str, rule: str, value: object) -> None:
    """Raise ``ConfigError("{owner}.{name} must be {rule}, but was {value!r}")`` unless ``ok``."""
    if not ok:
        raise ConfigError(f"{owner}.{name} must be {rule}, but was {value!r}")


class ResilienceError(requests.exceptions.RequestException):
    """Base of the errors the retry loop raises itself.

    ``endpoint`` is the policy template, ``engine`` the target, ``attempts``
    the record of every attempt taken, ``last_status`` the last HTTP status
    seen (or None).
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
        **kwargs: Any,
    ) -> None:
        super().__init__(message, **kwargs)
        self.endpoint = endpoint
        self.engine = engine
        self.attempts = attempts
        self.last_status = last_status
        self.last_error = last_error


class DeadlineExceeded(ResilienceError, requests.exceptions.Timeout):
    """The call's deadline ran out (or the next wait would pass it) before a success."""


class CircuitOpen(ResilienceError, requests.exceptions.ConnectionError):
    """Not sent: the engine's circuit breaker is open."""


class AmbiguousOutcome(ResilienceError):
    """A non-idempotent request may have been acted on; it was not re-sent.

    The server might have done the work (a read timeout or a connection
    dropped after sending). Find out from the server's state before
    repeating it.
    """


class RetryBudgetExhausted(ResilienceError):
    """A retry was needed but the engine's retry budget is spent."""


class RetriesExhausted(ResilienceError, requests.exceptions.RetryError):
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
