"""Python's automatic garbage collection paused while a fan-out phase runs on an event loop, for a bounded time.

Every object a phase's calls allocate (tasks, coroutines, requests, answers,
records) stays alive until its call ends, so the collections those allocations
trigger during the phase walk them all and free nothing; worse, each young
collection promotes them, and the promotions trigger full collections, which
walk every object in the process. With 1024 engines, the collector took about a
third of the driver's CPU in a barrier round (``benchmarks/NOTES.md``, "Fan-out
at scale, third pass"). ``AsyncFanOut`` and ``AsyncOrchestrator`` therefore
pause it (``gc.disable()``) from the moment a phase's tasks are created until
they all answered, or ``max_s`` seconds have passed, whichever comes first; then
it runs again, and its next collection frees whatever cyclic garbage the phase
left (reference counting frees the rest at once, as always).

The pause is process-wide, as the collector is: while any phase holds it, no
thread's objects are collected automatically (an explicit ``gc.collect()``
still runs). A collector that was already disabled when the first phase came is
left alone, and stays disabled. Code that disables it itself while a phase holds
the pause finds it enabled again once the last phase lets go: disable it before,
or turn the pause off (``gc_pause_s=0``).
"""

from __future__ import annotations

import asyncio
import gc
import threading

from resilience.errors import ConfigError

__all__ = ["DEFAULT_GC_PAUSE_S", "CollectorPause", "check_gc_pause", "collector_paused_by_us", "pause_collector"]

DEFAULT_GC_PAUSE_S = 2.0
"""The longest one phase keeps the collector paused. It covers a phase's sends and answers at fan-out scale on
loopback (a 1024-engine phase takes about 0.3 s here); a longer phase (an engine taking seconds to release its
memory) waits for the rest with the collector running, as before, so cyclic garbage made meanwhile by anything
in the process waits at most this long."""

_lock = threading.Lock()
_holders = 0
_ours = False
"""True while the collector is disabled because of a pause (it was enabled when the first holder came)."""


def _take() -> None:
    global _holders, _ours
    with _lock:
        if _holders == 0 and gc.isenabled():
            gc.disable()
            _ours = True
        _holders += 1


def _give() -> None:
    global _holders, _ours
    with _lock:
        _holders -= 1
        if _holders == 0 and _ours:
            _ours = False
            gc.enable()


def collector_paused_by_us() -> bool:
    """True while some phase holds the collector paused (it was enabled before, and will be again)."""
    with _lock:
        return _ours


class CollectorPause:
    """One phase's hold on the pause (``pause_collector``); ``end()`` lets go of it, once, however often it is called."""

    __slots__ = ("_held", "_timer")

    def __init__(self, held: bool, timer: asyncio.TimerHandle | None) -> None:
        self._held = held
        self._timer = timer

    @property
    def held(self) -> bool:
        """True until ``end()`` ran (or the bound passed); False from the start for a pause of 0 s."""
        return self._held

    def end(self) -> None:
        """Let go of the pause (the collector runs again once no other phase holds it); idempotent."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._held:
            self._held = False
            _give()


def pause_collector(max_s: float, loop: asyncio.AbstractEventLoop) -> CollectorPause:
    """Pause automatic garbage collection until the returned hold's ``end()``, or ``max_s`` seconds (a timer on ``loop``).

    ``max_s``: the bound in seconds; 0 (or less) pauses nothing and returns a
    hold that is already let go. Call it on ``loop``'s thread.
    """
    if not max_s > 0:
        return CollectorPause(False, None)
    _take()
    pause = CollectorPause(True, None)
    pause._timer = loop.call_later(max_s, pause.end)
    return pause


def check_gc_pause(owner: str, gc_pause_s: float) -> float:
    """``gc_pause_s`` as a float when it is a number >= 0; a ``ConfigError`` naming ``owner`` otherwise."""
    if isinstance(gc_pause_s, bool) or not isinstance(gc_pause_s, (int, float)) or not gc_pause_s >= 0:
        raise ConfigError(f"{owner} gc_pause_s must be a number of seconds >= 0 (0 = leave the collector alone), but was {gc_pause_s!r}")
    return float(gc_pause_s)
