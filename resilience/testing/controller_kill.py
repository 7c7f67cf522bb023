"""A controller that dies mid-phase, in-process: the soak's stand-in for ``SIGKILL`` of the process driving the barrier.

:class:`KillSwitchFanOut` is a ``ThreadFanOut`` that, armed, kills its controller inside the n-th phase it runs:
the phase's calls are sent, and after ``after_s`` seconds (or once every call answered) :class:`ControllerKilled`
is raised on the controller's thread with nothing read back. Just before, ``on_kill`` lets the caller copy the
journal as a killed process leaves it; the next controller starts on that copy, so nothing the dying orchestrator
does while it unwinds reaches it. The caller waits for the calls already sent (:meth:`KillSwitchFanOut.drain`):
a dead process sends nothing more, but what it sent still lands.

In-process, because a soak kills every few steps over 1000 steps at seeded instants inside a phase; a subprocess
per kill would pay its start each time. The real-process kill is the crash rig's (``tests/barrier/crash_rig.py``).
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable
from concurrent.futures import Future, wait
from dataclasses import dataclass

from resilience.barrier.fanout import Calls, EngineResult, ThreadFanOut, _run_into
from resilience.deadline import Deadline

__all__ = ["ControllerKilled", "KillPoint", "KillSwitchFanOut"]


class ControllerKilled(BaseException):
    """The controller died here (raised on its thread by :class:`KillSwitchFanOut`); not an ``Exception``, like ``SystemExit``."""

    def __init__(self, method: str, engines: int, landed: int) -> None:
        super().__init__(f"the controller was killed during {method} ({landed} of {engines} calls had answered)")
        self.method = method
        """The control method whose phase it died in."""
        self.engines = engines
        """Calls the phase sent."""
        self.landed = landed
        """Calls that had answered when it died."""


@dataclass(frozen=True, slots=True)
class KillPoint:
    """Where an armed :class:`KillSwitchFanOut` kills its controller."""

    phase: int
    """Which phase, counted from the arming: 0 is the next phase the fan-out runs."""
    after_s: float
    """Seconds after the phase's calls were handed to the pool (capped by their answers: a phase that answered
    sooner dies right after it answered, with nothing read back)."""

    def __post_init__(self) -> None:
        if isinstance(self.phase, bool) or not isinstance(self.phase, int) or self.phase < 0:
            raise ValueError(f"KillPoint.phase must be an int >= 0, but was {self.phase!r}")
        if not isinstance(self.after_s, (int, float)) or isinstance(self.after_s, bool) or not 0 <= self.after_s <= 60:
            raise ValueError(f"KillPoint.after_s must be a number of seconds in [0, 60], but was {self.after_s!r}")


class KillSwitchFanOut(ThreadFanOut):
    """A ``ThreadFanOut`` that, once :meth:`arm`-ed, kills its controller inside a chosen phase.

    ``on_kill``: called on the controller's thread at the instant of the kill, before
    :class:`ControllerKilled` is raised (take the journal's copy there); default None.
    """

    def __init__(self, on_kill: Callable[[], None] | None = None) -> None:
        super().__init__()
        self.on_kill = on_kill
        self._armed: KillPoint | None = None
        self._seen = 0
        self._sent: list[Future[EngineResult]] = []
        self._guard = threading.Lock()
        self.kills = 0
        """Times this fan-out killed its controller."""

    def arm(self, point: KillPoint) -> None:
        """Kill the controller at ``point`` (phases counted from now); replaces an earlier arming."""
        with self._guard:
            self._armed, self._seen = point, 0

    def disarm(self) -> KillPoint | None:
        """Cancel the arming; returns the point that had not been reached (None when none was armed)."""
        with self._guard:
            point, self._armed = self._armed, None
            return point

    @property
    def armed(self) -> bool:
        """Whether a kill is still to come."""
        return self._armed is not None

    def call(self, calls: Calls, method: str, deadline: Deadline) -> list[EngineResult]:
        """``ThreadFanOut.call``, unless this is the armed phase: then send, wait ``after_s`` at most, and die."""
        with self._guard:
            point = self._armed
            hit = point is not None and calls and self._seen == point.phase
            if point is not None and calls:
                self._seen += 1
            if hit:
                self._armed = None
        if not hit or point is None:
            return super().call(calls, method, deadline)
        pool = self._executor()
        futures: list[Future[EngineResult]] = [Future() for _ in calls]
        for (engine, kwargs), future in zip(calls, futures, strict=True):
            pool.submit(_run_into, future, contextvars.copy_context(), engine, method, kwargs, deadline)
        with self._guard:
            self._sent.extend(futures)
        wait(futures, timeout=point.after_s)
        landed = sum(1 for f in futures if f.done())
        self.kills += 1
        if self.on_kill is not None:
            self.on_kill()
        raise ControllerKilled(method, len(calls), landed)

    def drain(self, timeout_s: float) -> int:
        """Wait up to ``timeout_s`` for the calls a killed phase sent; returns how many are still running after it."""
        with self._guard:
            sent, self._sent = self._sent, []
        wait(sent, timeout=timeout_s)
        return sum(1 for f in sent if not f.done())
