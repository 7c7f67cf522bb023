"""The retry loop's errors as ``aiohttp`` exceptions, for ``ResilientMiddleware``.

Each class subclasses the core's error (so ``except resilience.DeadlineExceeded``
keeps working, with ``.attempts``, ``.endpoint``, ``.last_status``) and the
``aiohttp`` exception an aiohttp caller already catches (the bases:
``docs/http-clients.md``).

Some aiohttp bases are ``OSError``s (``DeadlineExceeded``'s
``ServerTimeoutError`` is an ``asyncio.TimeoutError``, what ``except
asyncio.TimeoutError`` around an aiohttp call catches today); ``str(err)`` is
the message alone (one positional argument, never ``OSError``'s ``[Errno]`` form).
"""

from __future__ import annotations

import aiohttp

from resilience import errors

__all__ = ["AmbiguousOutcome", "CircuitOpen", "DeadlineExceeded", "RetriesExhausted", "RetryBudgetExhausted"]


class DeadlineExceeded(errors.DeadlineExceeded, aiohttp.ServerTimeoutError):
    """The call's deadline ran out (or the next wait would pass it) before a success."""


class CircuitOpen(errors.CircuitOpen, aiohttp.ClientConnectionError):
    """Not sent: the engine's circuit breaker is open."""


class AmbiguousOutcome(errors.AmbiguousOutcome, aiohttp.ClientError):
    """A non-idempotent request may have been acted on; it was not re-sent."""


class RetryBudgetExhausted(errors.RetryBudgetExhausted, aiohttp.ClientError):
    """A retry was needed but the engine's retry budget is spent."""


class RetriesExhausted(errors.RetriesExhausted, aiohttp.ClientError):
    """Every attempt failed and the policy asks for an error instead of the last response."""
