"""``PerEngine``: one value per engine (a breaker, a budget), made on first lookup; a leaf module.

The retry core looks them up on every call, so a known engine's lookup is a
plain subscript; only an engine's first lookup takes the lock.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

__all__ = ["PerEngine"]

V = TypeVar("V")


class PerEngine(dict[str, V]):
    """``engine -> value``; a missing engine's value is ``make(engine)``, made once under a lock, then kept."""

    def __init__(self, make: Callable[[str], V]) -> None:
        super().__init__()
        self._make = make
        self._lock = threading.Lock()

    def __missing__(self, engine: str) -> V:
        with self._lock:  # two threads that miss at once get the same value
            value = self.get(engine)
            if value is None:
                value = self._make(engine)
                dict.__setitem__(self, engine, value)
            return value
