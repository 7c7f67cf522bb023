"""Socket-free vLLM engines with vLLM 0.33.0's control semantics, and the same per-call faults as ``fake_engine``.

The barrier's five calls mean here what ``VLLMEngine`` sends (``resilience.adapters.vllm.engine``);
lines are ``vllm/v1/engine/core.py``'s and ``v1/executor/abstract.py``'s (0.33.0):

- ``pause_generation`` = ``/pause``: one shared state, repeated = overwritten (l.2225).
- ``flush_cache`` = ``/reset_prefix_cache``: harmless in any state.
- ``release_memory_occupation`` = ``/sleep``: pauses the scheduler itself (l.993), then both tags sleep;
  a second sleep is a no-op ("Executor is already sleeping.", abstract.py l.400). Never fatal.
- ``resume_memory_occupation(tags)`` = ``/wake_up``: a tag not asleep makes the whole call a no-op
  (abstract.py l.416-422); a wake that leaves nothing asleep resumes the scheduler (l.1053-1055), also
  on an engine with nothing asleep (a full wake of an awake engine ends a pause).
- ``continue_generation`` = ``/resume``: reopens scheduling for everyone, even while asleep (l.985, l.2235).

No route reports which tags sleep; the fake keeps them in ``released`` for the test to read.

What kills a real engine is recorded in ``crash``: scheduling reopened while a tag sleeps (a queued
request is scheduled onto slept memory: the illegal memory access of vllm#44395/#15483), and weights
pushed into slept weights. What breaks a promise is recorded in ``violations``: scheduling reopened
while a pause is held (``held``: the user holds the test took; ``sync_bodies``: weight-sync bodies
running; a ``/resume`` or a completing wake ends a pause for everyone), and a sleep or wake during a
weight-sync body.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from resilience.engine_contract import VLLM_RULES
from tests.barrier.fake_engine import AsyncFakeEngine, FakeEngine

VLLM = frozenset(("weights", "kv_cache"))
"""vLLM's sleep tags (``abstract.py`` l.36)."""


class _VLLMSemantics:
    """The state changes of the five calls on vLLM; mixed into ``FakeEngine``/``AsyncFakeEngine`` (their faults and locks)."""

    control_rules = VLLM_RULES
    tags = ("weights", "kv_cache")

    engine: str
    paused: bool
    flushed: bool
    released: set[str]
    sync_bodies: int
    violations: list[str]
    held: int
    """Set by the test: pauses it holds (user holds, weight-sync bodies); reopening scheduling meanwhile is a violation."""
    wakes_that_resumed: int
    _die: Callable[[str], None]
    _lock: threading.Lock

    def _reopen(self, why: str) -> None:
        """The scheduler is UNPAUSED (``resume_scheduler``): fatal with a tag asleep, a violation while the test holds a pause."""
        if self.released:
            self._die(f"{why} with {sorted(self.released)} asleep: a queued request was scheduled onto slept memory")
        if self.held or self.sync_bodies:
            self.violations.append(f"{why} reopened scheduling while a pause was held ({self.held} user, {self.sync_bodies} weight sync)")
        self.paused = False
        self.flushed = False

    def _pause(self) -> None:
        if not self.paused:
            self.flushed = False
        self.paused = True

    def _flush(self) -> None:
        if self.paused:
            self.flushed = True

    def _release(self, tags: Sequence[str] | None) -> Callable[[], None]:
        def apply() -> None:
            self.paused = True  # EngineCore.sleep pauses the scheduler first
            self.released |= VLLM  # a no-op when already asleep
            if self.sync_bodies:
                self.violations.append("sleep while a weight_sync body runs")

        return apply

    def _resume(self, tags: Sequence[str] | None) -> Callable[[], None]:
        def apply() -> None:
            if self.sync_bodies:
                self.violations.append("wake while a weight_sync body runs")
            if tags and not set(tags) <= self.released:
                pass  # "Tag %s is not in sleeping tags": nothing is woken, not even the other tags
            else:
                self.released -= set(tags) if tags else set(self.released)
            if not self.released:
                self.wakes_that_resumed += 1
                self._reopen("a wake that left nothing asleep")

        return apply

    def _continue(self) -> None:
        self._reopen("/resume")

    def push_weights(self) -> None:
        """A weight-sync body's update on this engine: loading into slept weights is an illegal memory access."""
        with self._lock:
            if not self.paused:
                self.violations.append("weights pushed while the engine serves")
            if "weights" in self.released:
                self._die("weights pushed into slept weights (illegal memory access)")


class FakeVLLMEngine(_VLLMSemantics, FakeEngine):
    """A vLLM engine with synchronous control calls (for ``ThreadFanOut``)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.held = 0
        self.wakes_that_resumed = 0


class AsyncFakeVLLMEngine(_VLLMSemantics, AsyncFakeEngine):
    """The same with ``async`` calls (for ``AsyncFanOut`` and ``AsyncOrchestrator``)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.held = 0
        self.wakes_that_resumed = 0
