"""What attempts and calls mean: ``Outcome``, ``CallOutcome``, ``Delivery`` and ``AttemptRecord``.

A leaf module (standard library only): events, errors, the retry loop and the
transports all take these values from here. ``classify`` (in
``resilience.classification``) maps a status or delivery to an ``Outcome``
under an endpoint's policy.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["AttemptRecord", "CallOutcome", "Delivery", "Outcome", "attempts_of"]


class Outcome(enum.StrEnum):
    """What one attempt means for the retry loop."""

    SUCCESS = "success"
    """A 2xx (or a status the policy accepts)."""
    RETRYABLE = "retryable"
    """A status in the policy's retry set, or a failure before the request was sent."""
    AMBIGUOUS = "ambiguous"
    """The server may have acted: read timeout, or a connection dropped after sending."""
    FATAL = "fatal"
    """Anything else (4xx, other 5xx): never retried."""


class CallOutcome(enum.StrEnum):
    """How one logical call (all its attempts) ended; a bounded metric label."""

    SUCCESS = "success"
    """Succeeded on the first attempt."""
    RETRIED_SUCCESS = "retried_success"
    """Succeeded after one or more retries: failures absorbed."""
    FAILED = "failed"
    """Ended with a non-success status or transport error handed to the caller."""
    AMBIGUOUS = "ambiguous"
    """Ended with ``AmbiguousOutcome``: the server may or may not have acted."""
    DEADLINE_EXCEEDED = "deadline_exceeded"
    """The deadline ran out before a success."""
    CIRCUIT_OPEN = "circuit_open"
    """Rejected by an open circuit breaker without touching the network."""
    BUDGET_EXHAUSTED = "budget_exhausted"
    """A retry was needed but the engine's retry budget was spent."""


class Delivery(enum.StrEnum):
    """How far a request got."""

    NOT_SENT = "not_sent"
    """It surely never reached the server (connection refused, DNS, connect timeout, breaker)."""
    MAYBE_APPLIED = "maybe_applied"
    """It may have reached the server and been acted on (read timeout, reset after sending)."""
    RESPONDED = "responded"
    """A response with a status came back."""


@dataclass(frozen=True, slots=True)
class AttemptRecord:
    """One attempt as it happened; ``.attempts`` on responses and errors is a tuple of these."""

    attempt: int
    """0 for the first attempt, then the resend count."""
    status: int | None
    outcome: Outcome
    delivery: Delivery
    error_type: str | None
    """The transport error's class name, or None."""
    duration_s: float
    delay_s: float | None = None
    """The backoff slept after this attempt, or None when it was the last."""


def attempts_of(error: BaseException) -> tuple[AttemptRecord, ...] | None:
    """The driver's record of the attempts behind ``error`` (on the error, or on the response it carries); None: no record."""
    attempts = getattr(error, "attempts", None)
    if attempts is None:
        attempts = getattr(getattr(error, "response", None), "attempts", None)
    return tuple(attempts) if attempts is not None else None
