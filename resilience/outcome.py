"""What attempts and calls mean: ``Outcome``, ``CallOutcome``, ``Delivery``, ``AttemptRecord`` and ``attempts_of``.

A leaf module (standard library only). ``classify`` (``resilience.retry.spec``)
maps a status or delivery to an ``Outcome`` under an endpoint's policy.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import NamedTuple

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
    """The driver has proof it never left: connection refused, DNS failure, connect timeout, TLS handshake failure,
    a full local pool, an open breaker."""
    AMBIGUOUS = "ambiguous"
    """It may have reached the server and been acted on (read timeout, reset after sending, anything unproven)."""
    RESPONDED = "responded"
    """A response with a status came back (``AttemptRecord.status``). Which statuses prove nothing was applied is
    the reader's rule: a gateway's 502/503/504 may come after the request was handed on."""


class AttemptRecord(NamedTuple):
    """One attempt as it happened; ``.attempts`` on responses and errors is a tuple of these (immutable, by name)."""

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
    """The delivery record a driver wrote for the call that ended with ``error``; None when no driver wrote one.

    The one way to ask whether a failed call may have reached the engine, whatever the exception's library or
    class. The record is on the error (``error.attempts``) or on the response it carries (``.attempts`` for
    requests and aiohttp, ``.extensions["attempts"]`` for httpx). None (an error no driver wrote on, an interrupt):
    what the call did is unknown. The cause chain is not followed.
    """
    response = getattr(error, "response", None)
    extensions = getattr(response, "extensions", None)
    for value in (
        getattr(error, "attempts", None),
        getattr(response, "attempts", None),
        extensions.get("attempts") if isinstance(extensions, Mapping) else None,
    ):
        if isinstance(value, tuple) and value and all(isinstance(item, AttemptRecord) for item in value):
            return value
    return None
