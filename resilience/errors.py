"""Errors raised by the retry loop.

Each subclasses the ``requests`` exception a plain-requests caller already
catches, so code written for ``requests`` keeps working, and each carries the
attempts taken (``.attempts``) and, where known, the last status.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import requests

if TYPE_CHECKING:
    from resilience.outcome import AttemptRecord

__all__ = [
    "AmbiguousOutcome",
    "CircuitOpen",
    "DeadlineExceeded",
    "PolicyError",
    "ResilienceError",
    "RetriesExhausted",
    "RetryBudgetExhausted",
]


class PolicyError(ValueError):
    """A policy (or policy file) is invalid; the message names the field and the rule."""


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
