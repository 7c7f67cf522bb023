"""The retry loop's errors as ``requests`` exceptions, for ``ResilientAdapter``.

Each class subclasses both the ``resilience`` error of its name (so
``except resilience.DeadlineExceeded`` catches it from every driver, with
``.attempts``, ``.endpoint``, ``.last_status``) and the ``requests`` exception
a plain-requests caller already catches for that failure (each class's
docstring names it; ``RetriesExhausted`` is the ``RetryError`` urllib3's own
retries end with).

``err.request`` is the ``PreparedRequest`` and ``err.response`` the last
response (or None), as on requests' own errors. ``str(err)`` is the message
alone (requests' errors are ``OSError``s; one argument never gets the
``[Errno]`` form).
"""

from __future__ import annotations

import requests

from resilience import errors
from resilience.errors import ErrorTypes

__all__ = ["ERROR_TYPES", "AmbiguousOutcome", "CircuitOpen", "DeadlineExceeded", "RetriesExhausted", "RetryBudgetExhausted"]


class DeadlineExceeded(errors.DeadlineExceeded, requests.exceptions.Timeout):
    """The call's deadline ran out (or the next wait would pass it) before a success; a ``requests.Timeout``."""


class CircuitOpen(errors.CircuitOpen, requests.exceptions.ConnectionError):
    """Not sent: the engine's circuit breaker is open; a ``requests.ConnectionError``."""


class AmbiguousOutcome(errors.AmbiguousOutcome, requests.exceptions.RequestException):
    """A non-idempotent request may have been acted on and was not re-sent; a ``requests.RequestException``."""


class RetryBudgetExhausted(errors.RetryBudgetExhausted, requests.exceptions.RequestException):
    """A retry was needed but the engine's retry budget is spent; a ``requests.RequestException``."""


class RetriesExhausted(errors.RetriesExhausted, requests.exceptions.RetryError):
    """Every attempt failed and the policy asks for an error; a ``requests.exceptions.RetryError``."""


ERROR_TYPES = ErrorTypes(
    deadline_exceeded=DeadlineExceeded,
    circuit_open=CircuitOpen,
    ambiguous=AmbiguousOutcome,
    budget_exhausted=RetryBudgetExhausted,
    retries_exhausted=RetriesExhausted,
)
"""What ``ResilientAdapter`` passes to its ``Retrier`` (``error_types=``)."""
