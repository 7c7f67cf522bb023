"""SGLang's ``model_update_lock``: an asyncio reader-writer lock that lets a waiting writer go first.

Follows ``sglang/srt/utils/aio_rwlock.py``: every ``/generate`` holds the reader side from after the pause gate until
its answer; a weight update (when the engine is not paused) takes the writer side, so it waits for every in-flight
generation and, while it waits or runs, blocks new ones. ``pause_generation(mode="abort")`` polls
:meth:`RWLock.is_locked` to know when every generation has answered.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

__all__ = ["RWLock"]


class RWLock:
    """Shared readers, one exclusive writer; new readers wait while a writer waits (no writer starvation)."""

    def __init__(self) -> None:
        self._cond = asyncio.Condition()
        self.readers = 0
        """Readers holding the lock now (in-flight generations)."""
        self.writer_active = False
        """Whether a writer (a weight update) holds the lock now."""
        self.waiting_writers = 0
        """Writers queued for the lock."""

    @asynccontextmanager
    async def reader_lock(self) -> AsyncIterator[None]:
        """Hold the shared side for the ``async with`` block."""
        async with self._cond:
            await self._cond.wait_for(lambda: not self.writer_active and self.waiting_writers == 0)
            self.readers += 1
        try:
            yield
        finally:
            async with self._cond:
                self.readers -= 1
                if self.readers == 0:
                    self._cond.notify_all()

    @asynccontextmanager
    async def writer_lock(self) -> AsyncIterator[None]:
        """Hold the exclusive side for the ``async with`` block."""
        async with self._cond:
            self.waiting_writers += 1
            try:
                await self._cond.wait_for(lambda: not self.writer_active and self.readers == 0)
                self.writer_active = True
            finally:
                self.waiting_writers -= 1
                self._cond.notify_all()  # readers held back by a writer that gave up may go
        try:
            yield
        finally:
            async with self._cond:
                self.writer_active = False
                self._cond.notify_all()

    def is_locked(self) -> bool:
        """Whether a reader or a writer holds the lock."""
        return self.writer_active or self.readers > 0
