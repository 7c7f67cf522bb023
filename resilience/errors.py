"""Errors: ``ConfigError`` for invalid values (with ``require``), and the errors the retry loop raises (``ErrorTypes``)."""

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
    "ResilienceError",
    "RetriesExhausted",
    "RetryBudgetExhausted",
    "finite_number",
    "integer",
    "require",
]


class ConfigError(ValueError):
    """An invalid value (policy, policy file, breaker or budget config, deadline, fault plan): the message names the
    field and the rule it broke. A ``ValueError``, so ``except ValueError`` keeps catching it."""


class ConfigConflict(ConfigError, TypeError):
    """Arguments that cannot be given together (``session=`` with ``policies=``), named in the message.

    Also a ``TypeError``, what Python raises for arguments that do not fit a signature.
    """


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
    """Base of the errors the retry loop raises itself; ``str(err)`` is the message alone, and it pickles whole.

    ``endpoint`` is the policy template, ``engine`` the target, ``attempts`` the
    record of every attempt taken (what ``resilience.outcome.attempts_of`` reads),
    ``last_status`` / ``last_error`` the last HTTP status and transport error,
    ``request`` / ``response`` the driver's request and last response (or None).
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
    """A non-idempotent request may have been acted on (a read timeout, a connection dropped after sending); it was
    not re-sent. Find out from the server's state before repeating it."""


class RetryBudgetExhausted(ResilienceError):
    """A retry was needed but the engine's retry budget is spent."""


class RetriesExhausted(ResilienceError):
    """Every attempt failed and the policy asks for an error instead of the last response."""


@dataclass(frozen=True, slots=True)
class ErrorTypes:
    """The classes the retry loop raises, one per kind: a driver passes its own subclasses (``resilience.adapters.*_errors``).

    Each field defaults to the class of its name (whose docstring says when it is raised), and a replacement must
    subclass that default, so ``except resilience.DeadlineExceeded`` catches it from every driver while, say, the
    httpx driver's also is an ``httpx.TimeoutException``. An invalid class raises ``ConfigError`` here.
    """

    deadline_exceeded: type[DeadlineExceeded] = DeadlineExceeded
    circuit_open: type[CircuitOpen] = CircuitOpen
    ambiguous: type[AmbiguousOutcome] = AmbiguousOutcome
    budget_exhausted: type[RetryBudgetExhausted] = RetryBudgetExhausted
    retries_exhausted: type[RetriesExhausted] = RetriesExhausted

    def __post_init__(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)
            base = field.default
            assert isinstance(base, type)
            require(
                isinstance(value, type) and issubclass(value, base), "ErrorTypes", field.name, f"a subclass of {base.__qualname__}", value
            )
