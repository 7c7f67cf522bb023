"""A socket-free SGLang engine with SGLang 0.5.23's crash semantics, and per-call fault injection.

What kills a real engine (``sglang/srt/managers/scheduler_components/weight_updater.py``,
torch_memory_saver) is recorded in ``crash`` instead:

- release while serving or before a flush (the scheduler asserts it is idle);
- release of a tag already released (torch_memory_saver: ``exit(1)``);
- resume of a tag not released (``offload_tags.remove``: ``KeyError``, the server dies);
- continue while memory is released (the next prefill writes into freed KV);
- weights pushed into released weight memory.

Faults are armed per (method): the next call of that method on this engine
gets it. No sleeps: a "late" call blocks until the test lets it land.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable, Sequence
from typing import Any

from resilience.barrier.engine import ALL_TAGS
from resilience.barrier.fanout import EngineDied, EngineUnavailable
from resilience.errors import AmbiguousOutcome

ALL = frozenset(ALL_TAGS)
LATE_LIMIT_S = 5.0
"""A late call lands on its own after this long if the test never lets it (a safety net, not a timing)."""


class Fault(enum.StrEnum):
    """What goes wrong with one call."""

    AMBIGUOUS_APPLIED = "ambiguous_applied"
    """Applied, then the answer is lost (read timeout after sending): ``AmbiguousOutcome``."""
    AMBIGUOUS_NOT_APPLIED = "ambiguous_not_applied"
    """Not applied, but the caller cannot tell: ``AmbiguousOutcome``."""
    FAILED = "failed"
    """Refused with an error answer: not applied."""
    LATE_APPLIED = "late_applied"
    """Still running at the phase deadline; applied when it lands."""
    LATE_FAILED = "late_failed"
    """Still running at the phase deadline; refused when it lands."""
    ACTOR_DIED = "actor_died"
    """Applied, then the Ray actor holding the engine died (``EngineDied``)."""
    ACTOR_UNAVAILABLE = "actor_unavailable"
    """Not applied; Ray cannot reach the actor (``EngineUnavailable``)."""


class Refused(Exception):
    """The engine answered with an error (HTTP 500): nothing was applied."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.status = 500


class FakeEngine:
    """One engine: paused, flushed, released tags; ``crash`` says why it would have died (None: alive)."""

    def __init__(self, name: str) -> None:
        self.engine = name
        self.base_url = name
        self._lock = threading.Lock()
        self.paused = False
        self.flushed = False
        self.released: set[str] = set()
        self.crash: str | None = None
        self.violations: list[str] = []
        self.sync_bodies = 0
        self.faults: dict[str, Fault] = {}
        self.fired: list[str] = []
        """``method:fault`` of every fault that hit a call (read by the test for coverage statistics)."""
        self.landings: list[threading.Event] = []

    def __repr__(self) -> str:
        return f"FakeEngine({self.engine!r})"

    # -- the test's side ---------------------------------------------------------------------

    def arm(self, method: str, fault: Fault) -> None:
        """The next call of ``method`` gets ``fault``."""
        with self._lock:
            self.faults[method] = fault

    def disarm(self) -> None:
        """Drop faults not used."""
        with self._lock:
            self.faults.clear()

    def land(self) -> None:
        """Let every late call land."""
        with self._lock:
            landings, self.landings = self.landings, []
        for event in landings:
            event.set()

    @property
    def serving(self) -> bool:
        """Not paused, nothing released."""
        with self._lock:
            return not self.paused and not self.released

    def snapshot(self) -> tuple[bool, bool, frozenset[str]]:
        """(paused, flushed, released) at once."""
        with self._lock:
            return self.paused, self.flushed, frozenset(self.released)

    def push_weights(self) -> None:
        """What a weight sync body does to each engine."""
        with self._lock:
            if not self.paused:
                self.violations.append("weights pushed while the engine serves")
            if "weights" in self.released:
                self._die("weights pushed into released memory")

    # -- the engine's side -------------------------------------------------------------------------

    def _die(self, why: str) -> None:
        if self.crash is None:
            self.crash = why

    def _call(self, method: str, apply: Callable[[], None]) -> dict[str, Any]:
        with self._lock:
            fault = self.faults.pop(method, None)
            if fault is not None:
                self.fired.append(f"{method}:{fault}")
            if self.crash is not None:
                raise EngineDied(f"{self.engine} is down: {self.crash}")
            landing = None
            if fault in (Fault.LATE_APPLIED, Fault.LATE_FAILED):
                landing = threading.Event()
                self.landings.append(landing)
        if landing is not None:
            landing.wait(LATE_LIMIT_S)
        if fault in (Fault.AMBIGUOUS_NOT_APPLIED,):
            raise AmbiguousOutcome(f"{self.engine} {method}: read timeout (not applied)", engine=self.engine)
        if fault is Fault.ACTOR_UNAVAILABLE:
            raise EngineUnavailable(f"{self.engine} {method}: actor unavailable")
        if fault in (Fault.FAILED, Fault.LATE_FAILED):
            raise Refused(f"{self.engine} {method}: HTTP 500")
        with self._lock:
            if self.crash is not None:
                raise EngineDied(f"{self.engine} is down: {self.crash}")
            apply()
        if fault is Fault.AMBIGUOUS_APPLIED:
            raise AmbiguousOutcome(f"{self.engine} {method}: read timeout (applied)", engine=self.engine)
        if fault is Fault.ACTOR_DIED:
            raise EngineDied(f"{self.engine}: actor died after {method}")
        return {"engine": self.engine, "method": method}

    def pause_generation(self, mode: str = "abort") -> dict[str, Any]:
        def apply() -> None:
            if not self.paused:
                self.flushed = False
            self.paused = True

        return self._call("pause_generation", apply)

    def flush_cache(self, deadline_s: float | None = None) -> dict[str, Any]:
        def apply() -> None:
            if self.paused:
                self.flushed = True

        return self._call("flush_cache", apply)

    def release_memory_occupation(self, tags: Sequence[str] | None = None) -> dict[str, Any]:
        wanted = set(tags) if tags else set(ALL)

        def apply() -> None:
            if not self.paused or not self.flushed:
                self._die("release while not idle (scheduler assert)")
            elif wanted & self.released:
                self._die(f"double release of {sorted(wanted & self.released)} (torch_memory_saver exit(1))")
            else:
                self.released |= wanted
            if self.sync_bodies:
                self.violations.append("release while a weight_sync body runs")

        return self._call("release_memory_occupation", apply)

    def resume_memory_occupation(self, tags: Sequence[str] | None = None) -> dict[str, Any]:
        wanted = set(tags) if tags else set(ALL)

        def apply() -> None:
            if wanted - self.released:
                self._die(f"resume of unreleased {sorted(wanted - self.released)} (KeyError in the scheduler)")
            else:
                self.released -= wanted
            if self.sync_bodies:
                self.violations.append("resume while a weight_sync body runs")

        return self._call("resume_memory_occupation", apply)

    def continue_generation(self, torch_empty_cache: bool = True) -> dict[str, Any]:
        def apply() -> None:
            if self.released:
                self._die(f"continue with {sorted(self.released)} released (prefill into freed memory)")
            self.paused = False
            self.flushed = False

        return self._call("continue_generation", apply)
