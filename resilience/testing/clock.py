"""``FakeClock``: a ``resilience.clock.Clock`` that moves only when told, for tests of whatever takes a clock."""

from __future__ import annotations

import asyncio
import threading

__all__ = ["FakeClock"]


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
