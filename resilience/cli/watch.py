"""Say what a slow colocate step is waiting for, while it waits (``cpr demo``'s progress).

The loop reports only when a step is over, and a failed baseline step is long (dead engines restarted, each
importing torch): :class:`StepWatch` looks at the fleet once a second and, past ``quiet_s``, tells the display
which engines are dead (and why), which are restarting, or that the step waits for the engines' answers.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from types import TracebackType

from resilience.cli.story import death_causes
from resilience.testing.colocate import StepProgress
from resilience.testing.emulator import EmulatedFleet

__all__ = ["StepWatch"]


class StepWatch:
    """A context manager and progress callback: while a step runs past ``quiet_s`` (default 2 s), ``say(text)`` gets
    what it waits for ("" once it ended), the ``fleet`` looked at every ``period_s`` (default 1 s)."""

    def __init__(self, fleet: EmulatedFleet, say: Callable[[str], None], *, quiet_s: float = 2.0, period_s: float = 1.0) -> None:
        self.fleet = fleet
        self.say = say
        self.quiet_s = quiet_s
        self.period_s = period_s
        self._lock = threading.Lock()
        self._step = 1
        self._since = time.monotonic()
        self._pids = self._current_pids()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpr-step-watch", daemon=True)

    def _current_pids(self) -> list[int]:
        return [e.pid for e in self.fleet.engines]

    def __enter__(self) -> StepWatch:
        self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def __call__(self, p: StepProgress) -> None:
        """The step ``p.step`` ended: the next one starts now, against the fleet as it is now."""
        with self._lock:
            self._step = p.step + 1
            self._since = time.monotonic()
            self._pids = self._current_pids()

    def waiting_for(self) -> str:
        """What the current step waits for, in words (computed from the fleet now; no clock in it, so it repeats)."""
        with self._lock:
            step, pids = self._step, list(self._pids)
        engines = self.fleet.engines
        dead = [e for e in engines if not e.alive()]
        restarted = [e for e, pid in zip(engines, pids, strict=True) if e.alive() and e.pid != pid]
        if dead:
            what = ", ".join(f"engine {e.index} died ({self._cause(e.log())})" for e in dead)
            return f"step {step} waits: {what}"
        if restarted:
            what = ", ".join(f"engine {e.index} (died: {self._cause(e.log())})" for e in restarted)
            return f"step {step} waits: restarting {what}, as a global restart would; each loads from scratch"
        return f"step {step} waits for the engines' answers"

    @staticmethod
    def _cause(log: str) -> str:
        causes = death_causes(log)
        return causes[-1] if causes else "cause not logged"

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            with self._lock:
                slow = time.monotonic() - self._since > self.quiet_s
            if slow:
                try:
                    self.say(self.waiting_for())
                except Exception:  # a display problem must never break the run
                    continue
