"""Injectable time: a ``Clock`` protocol and the system clock (a fake one for tests: ``resilience.testing.FakeClock``)."""

from __future__ import annotations

import asyncio
import time
from typing import Protocol

__all__ = ["Clock", "SYSTEM_CLOCK", "SystemClock"]


class Clock(Protocol):
    """A monotonic clock with a sleep that matches it; the async retry driver sleeps with its ``asleep(seconds)``
    coroutine when it has one (both clocks here do), else ``asyncio.sleep``."""

    def monotonic(self) -> float:
        """Seconds on a monotonic scale; only differences mean anything."""

    def sleep(self, seconds: float) -> None:
        """Wait ``seconds`` (non-negative)."""


class SystemClock:
    """The real clock: ``time.monotonic`` and ``time.sleep``."""

    monotonic = staticmethod(time.monotonic)
    """Seconds from ``time.monotonic`` (the function itself: the retry core reads the clock several times a call)."""

    def sleep(self, seconds: float) -> None:
        """``time.sleep`` for positive values, nothing otherwise."""
        if seconds > 0:
            time.sleep(seconds)

    async def asleep(self, seconds: float) -> None:
        """``asyncio.sleep`` for positive values, nothing otherwise."""
        if seconds > 0:
            await asyncio.sleep(seconds)


SYSTEM_CLOCK = SystemClock()
"""The shared system clock."""
