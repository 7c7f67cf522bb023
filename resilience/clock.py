"""Injectable time: a ``Clock`` protocol, the system clock and a fake clock for tests."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Protocol

__all__ = ["Clock", "FakeClock", "SYSTEM_CLOCK", "SystemClock"]


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


class FakeClock:
    """A clock that only moves when told: ``sleep`` advances it and records the sleep."""

    def __init__(self, start: float = 1000.0) -> None:
        self._now = start
        self._lock = threading.Lock()
        self.sleeps: list[float] = []
        """Every sleep asked for, in order."""

    def monotonic(self) -> float:
        """The fake current time."""
        with self._lock:
            return self._now

    def sleep(self, seconds: float) -> None:
        """Record the sleep and advance time by it."""
        if seconds < 0:
            raise ValueError(f"sleep seconds must be >= 0, but was {seconds}")
        with self._lock:
            self.sleeps.append(seconds)
            self._now += seconds

    async def asleep(self, seconds: float) -> None:
        """``sleep`` for coroutines: records and advances, then yields to the loop once."""
        self.sleep(seconds)
        await asyncio.sleep(0)

    def advance(self, seconds: float) -> None:
        """Move time forward without recording a sleep."""
        with self._lock:
            self._now += seconds
