"""The orchestrator's view of one engine: an explicit state machine, owned pause holds, released tags.

States follow the offload/onload cycle: serving -> paused -> flushed ->
released -> resumed -> serving. A rollback may go paused/flushed -> serving.
``dead`` is terminal (the engine stopped answering). Every other transition
is refused with ``IllegalEngineTransition``: it would be a bug in the
orchestrator.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Final

__all__ = ["EngineState", "EngineTracker", "IllegalEngineTransition"]


class EngineState(enum.StrEnum):
    """Where an engine is in the colocate cycle."""

    SERVING = "serving"
    PAUSED = "paused"
    FLUSHED = "flushed"
    RELEASED = "released"
    RESUMED = "resumed"
    DEAD = "dead"


S = EngineState
_ALLOWED: Final = frozenset(
    {
        (S.SERVING, S.PAUSED),
        (S.PAUSED, S.FLUSHED),
        (S.FLUSHED, S.RELEASED),
        (S.RELEASED, S.RESUMED),
        (S.RESUMED, S.SERVING),
        (S.PAUSED, S.SERVING),
        (S.FLUSHED, S.SERVING),
        (S.FLUSHED, S.PAUSED),
        (S.RESUMED, S.PAUSED),
        (S.RESUMED, S.RELEASED),
        (S.RELEASED, S.PAUSED),
    }
    | {(s, S.DEAD) for s in S if s is not S.DEAD}
)


class IllegalEngineTransition(RuntimeError):
    """A state change outside the table (a bug)."""


@dataclass
class EngineTracker:
    """One engine's state, holds and released tags. Thread-safe."""

    name: str
    state: EngineState = EngineState.SERVING
    holds: set[str] = field(default_factory=set)
    released: set[str] = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def move(self, to: EngineState) -> EngineState | None:
        """Go to ``to``; returns the previous state, or None when already there (idempotent)."""
        with self._lock:
            if self.state is to:
                return None
            if (self.state, to) not in _ALLOWED:
                raise IllegalEngineTransition(f"engine {self.name}: {self.state} -> {to} is not allowed")
            previous, self.state = self.state, to
            return previous

    def hold(self, reason: str) -> bool:
        """Take a pause hold; False when this reason already held it."""
        with self._lock:
            if reason in self.holds:
                return False
            self.holds.add(reason)
            return True

    def unhold(self, reason: str) -> bool:
        """Release a hold; False when this reason did not hold it."""
        with self._lock:
            if reason not in self.holds:
                return False
            self.holds.discard(reason)
            return True

    def mark_released(self, tags: Iterable[str]) -> None:
        """Record tags as released."""
        with self._lock:
            self.released.update(tags)

    def mark_resumed(self, tags: Iterable[str]) -> None:
        """Record tags as occupied again."""
        with self._lock:
            self.released.difference_update(tags)

    @property
    def may_continue(self) -> bool:
        """No hold remains and all memory (KV cache, CUDA graphs, weights) is back."""
        with self._lock:
            return not self.holds and not self.released and self.state is not EngineState.DEAD
