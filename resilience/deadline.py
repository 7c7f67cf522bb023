"""``Deadline``: a monotonic time budget shared through a contextvar; a call's deadline is the earlier of its policy's
and the one in context (an orchestrator phase's, a user's ``with Deadline(5):``)."""

from __future__ import annotations

import contextvars
import math
from types import TracebackType

from resilience.clock import SYSTEM_CLOCK, Clock
from resilience.errors import ConfigError

__all__ = ["CURRENT_DEADLINE", "Deadline"]

CURRENT_DEADLINE: contextvars.ContextVar[Deadline | None] = contextvars.ContextVar("resilience_deadline", default=None)
"""The deadline in force in this context (``CURRENT_DEADLINE.get()``), or None; ``with Deadline(...):`` sets it."""


class Deadline:
    """A point on a monotonic clock after which work must stop: ``seconds`` from now, or never for None.

    Used as a context manager it is the current deadline for the block, capped by any deadline already in force.
    """

    __slots__ = ("_clock", "_expires_at", "_token")

    def __init__(self, seconds: float | None, *, clock: Clock = SYSTEM_CLOCK) -> None:
        if seconds is not None and (math.isnan(seconds) or seconds < 0):
            raise ConfigError(f"Deadline seconds must be >= 0 or None, but was {seconds}")
        self._clock = clock
        self._expires_at = math.inf if seconds is None else clock.monotonic() + seconds
        self._token: contextvars.Token[Deadline | None] | None = None

    @property
    def bounded(self) -> bool:
        """False for a deadline that never ends."""
        return not math.isinf(self._expires_at)

    def remaining(self) -> float:
        """Seconds left (``inf`` when unbounded, never negative)."""
        return max(0.0, self._expires_at - self._clock.monotonic())

    def expired(self) -> bool:
        """True once no time is left."""
        return self.remaining() <= 0.0

    def cap(self, seconds: float | None) -> Deadline:
        """A deadline ending at the earlier of this one and ``seconds`` from now."""
        if seconds is None:
            return self
        capped = Deadline(None, clock=self._clock)  # an unbounded deadline reads no clock
        capped._expires_at = min(self._expires_at, self._clock.monotonic() + seconds)
        return capped

    def __enter__(self) -> Deadline:
        outer = CURRENT_DEADLINE.get()
        if outer is not None and outer._expires_at < self._expires_at:
            self._expires_at = outer._expires_at
        self._token = CURRENT_DEADLINE.set(self)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if self._token is not None:
            CURRENT_DEADLINE.reset(self._token)
            self._token = None

    def __repr__(self) -> str:
        left = self.remaining()
        return "Deadline(unbounded)" if math.isinf(left) else f"Deadline(remaining={left:.3f}s)"
