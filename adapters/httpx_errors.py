"""The retry loop's errors as ``httpx`` exceptions, for ``ResilientTransport`` and ``AsyncResilientTransport``.

Each class subclasses both the ``resilience`` error of its name (so
``except resilience.DeadlineExceeded`` catches it from every driver) and the
``httpx`` exception an httpx caller already catches for that failure (each
class's docstring names it).

``err.request`` is the ``httpx.Request`` of the call (the transport always
passes it, and ``httpx.Client`` sets it again, as for its own errors): the core
error's ``__init__`` assigns it through httpx's ``request`` property.
"""

from __future__ import annotations

import httpx

from resilience import errors
from resilience.errors import ErrorTypes

__all__ = ["ERROR_TYPES", "AmbiguousOutcome", "CircuitOpen", "DeadlineExceeded", "RetriesExhausted", "RetryBudgetExhausted"]


class DeadlineExceeded(errors.DeadlineExceeded, httpx.TimeoutException):
    """The call's deadline ran out (or the next wait would pass it) before a success; an ``httpx.TimeoutException``."""


class CircuitOpen(errors.CircuitOpen, httpx.ConnectError):
    """Not sent: the engine's circuit breaker is open; an ``httpx.ConnectError``."""


class AmbiguousOutcome(errors.AmbiguousOutcome, httpx.TransportError):
    """A non-idempotent request may have been acted on and was not re-sent; an ``httpx.TransportError``."""


class RetryBudgetExhausted(errors.RetryBudgetExhausted, httpx.TransportError):
    """A retry was needed but the engine's retry budget is spent; an ``httpx.TransportError``."""


class RetriesExhausted(errors.RetriesExhausted, httpx.TransportError):
    """Every attempt failed and the policy asks for an error; an ``httpx.TransportError``."""


ERROR_TYPES = ErrorTypes(
    deadline_exceeded=DeadlineExceeded,
    circuit_open=CircuitOpen,
    ambiguous=AmbiguousOutcome,
    budget_exhausted=RetryBudgetExhausted,
    retries_exhausted=RetriesExhausted,
)
"""What both httpx transports pass to ``Retrier(error_types=...)``."""
