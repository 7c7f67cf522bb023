"""``CountingProbe``: a ``MemoryProbe`` that counts its answers, so a run can say how its reconciles were made."""

from __future__ import annotations

import threading

from resilience.engine_contract import MemoryProbe

__all__ = ["CountingProbe"]


class CountingProbe:
    """Wraps a ``MemoryProbe`` (``inner``) and counts what it proved; thread-safe (the barrier
    asks only for engines whose released tags are unknown, so :attr:`proved` counts the reconciles it made possible)."""

    def __init__(self, inner: MemoryProbe) -> None:
        self.inner = inner
        """The probe that answers."""
        self.proved = 0
        """Answers that proved the released tags (not None)."""
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"CountingProbe({self.inner!r}, proved={self.proved})"

    def released_tags(self, engine: str) -> frozenset[str] | None:
        """The inner probe's answer, counted when it proves the tags."""
        answer = self.inner.released_tags(engine)
        if answer is not None:
            with self._lock:
                self.proved += 1
        return answer
