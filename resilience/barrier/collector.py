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
left (reference counting frees the rest at once, as always). A watchdog thread
ends every pause at its bound, whatever became of the loop that took it.

The pause is process-wide, as the collector is: while any phase holds it, no
thread's objects are collected automatically (an explicit ``gc.collect()``
still runs). A collector that was already disabled when the first phase came is
left alone, and stays disabled. Code that disables it itself while a phase holds
the pause finds it enabled again once the last phase lets go: disable it before,
or turn the pause off (``gc_pause_s=0``).
"""

from __future__ import annotations

import gc
import itertools
import math
import os
import threading
import time

from resilience.errors import ConfigError

__all__ = ["DEFAULT_GC_PAUSE_S", "CollectorPause", "check_gc_pause", "collector_paused_by_us", "pause_collector"]

DEFAULT_GC_PAUSE_S = 2.0
"""The longest one phase keeps the collector paused. It covers a phase's sends and answers at fan-out scale on
loopback (a 1024-engine phase takes about 0.3 s here); a longer phase (an engine taking seconds to release its
memory) waits for the rest with the collector running, as before, so cyclic garbage made meanwhile by anything
in the process waits at most this long."""

_cond = threading.Condition()
"""Guards everything below; the watchdog waits on it."""
_holds: dict[int, float] = {}
"""Each held pause, by id: the ``time.monotonic()`` reading at which it ends at the latest."""
_ids = itertools.count()
_ours = False
"""True while the collector is disabled because of a pause (it was enabled when the first one came)."""
_watchdog: threading.Thread | None = None
_wakes_at = math.inf
"""When the watchdog looks next (inf: when woken): a hold ending later than that needs no wake-up."""
_paused_at = 0.0
"""When the current pause began (read while ``_ours``): no hold taken during it ends later than this plus its bound."""


def _resume_if_free() -> None:
    global _ours
    if not _holds and _ours:
        _ours = False
        gc.enable()


def _watch() -> None:
    """The watchdog thread: ends every pause at its bound, whatever became of the loop or thread that took it."""
    global _wakes_at
    with _cond:
        while True:
            now = time.monotonic()
            for hold in [h for h, ends in _holds.items() if ends <= now]:
                del _holds[hold]
            _resume_if_free()
            _wakes_at = min(_holds.values(), default=math.inf)
            _cond.wait(None if math.isinf(_wakes_at) else _wakes_at - now)


def _take(max_s: float) -> tuple[int, float]:
    """Register a hold ending ``max_s`` from now, capped so that no pause outlasts its own start by more than ``max_s``.

    The order makes every interruption safe: the watchdog runs before anything is taken (if it cannot start, this
    raises and nothing is taken); the hold is registered before the collector is disabled (whatever lands after, the
    watchdog ends the hold and enables the collector again); ``_ours`` is set before ``gc.disable()``.
    """
    global _ours, _watchdog, _paused_at
    with _cond:
        if _watchdog is None:
            watchdog = threading.Thread(target=_watch, name="cpr-gc-pause-watchdog", daemon=True)
            watchdog.start()
            _watchdog = watchdog
        now = time.monotonic()
        if not _ours:
            _paused_at = now
        hold, ends = next(_ids), _paused_at + max_s  # holds back to back never chain a pause past its bound
        _holds[hold] = ends
        if len(_holds) == 1 and gc.isenabled():
            _ours = True
            gc.disable()
        if ends < _wakes_at:
            _cond.notify()
        return hold, ends


def _move(hold: int, ends: float | None) -> None:
    """End ``hold`` now (``ends`` None) or move its end to ``ends``."""
    with _cond:
        if hold not in _holds:
            return
        if ends is None:
            del _holds[hold]
            _resume_if_free()
        else:
            _holds[hold] = ends
            if ends < _wakes_at:
                _cond.notify()


def _after_fork_in_child() -> None:
    """A forked child has no watchdog and holds no pause of its parent's: start clean, the collector as it was before."""
    global _cond, _watchdog, _ours, _wakes_at
    _cond = threading.Condition()
    _holds.clear()
    _watchdog = None
    _wakes_at = math.inf
    if _ours:
        _ours = False
        gc.enable()


os.register_at_fork(after_in_child=_after_fork_in_child)


def collector_paused_by_us() -> bool:
    """True while some phase holds the collector paused (it was enabled before, and will be again)."""
    with _cond:
        return _ours


class CollectorPause:
    """One phase's hold on the pause (``pause_collector``); ``end()`` lets go of it, once, however often it is called."""

    __slots__ = ("_bound", "_hold")

    def __init__(self, hold: int | None, bound: float) -> None:
        self._hold = hold
        self._bound = bound

    @property
    def held(self) -> bool:
        """True until ``end()`` ran or the bound passed; False from the start for a pause of 0 s."""
        if self._hold is None:
            return False
        with _cond:
            return self._hold in _holds

    def end(self) -> None:
        """Let go of the pause (the collector runs again once no other phase holds it); idempotent, from any thread."""
        if self._hold is not None:
            _move(self._hold, None)
            self._hold = None

    def end_after(self, seconds: float) -> None:
        """Let go ``seconds`` from now instead (0 or less: now), never later than the bound it was taken with."""
        if self._hold is None or not seconds > 0:
            self.end()
        else:
            _move(self._hold, min(time.monotonic() + seconds, self._bound))


def pause_collector(max_s: float) -> CollectorPause:
    """Pause automatic garbage collection until the returned hold's ``end()``, or ``max_s`` seconds, whichever is first.

    ``max_s``: the bound in seconds; 0 (or less) pauses nothing and returns a
    hold that is already let go. A watchdog thread (one per process, started
    with the first pause) ends each pause at its bound, so a pause whose loop
    stopped, or whose task was never resumed, still ends. Holds taken while the
    collector is already paused end no later than that pause's start plus their
    own bound, so phases back to back never keep it paused longer than the
    longest bound among them; once it runs again, the next phase pauses it anew.
    When the watchdog cannot be started, nothing is paused.
    """
    if not max_s > 0:
        return CollectorPause(None, 0.0)
    try:
        hold, ends = _take(max_s)
    except RuntimeError:  # no thread for the watchdog ("can't start new thread", interpreter shutdown): no pause
        return CollectorPause(None, 0.0)
    return CollectorPause(hold, ends)


def check_gc_pause(owner: str, gc_pause_s: float) -> float:
    """``gc_pause_s`` as a float when it is a finite number >= 0 (a pause is always bounded); a ``ConfigError`` naming
    ``owner`` otherwise."""
    if isinstance(gc_pause_s, bool) or not isinstance(gc_pause_s, (int, float)) or not 0 <= gc_pause_s < math.inf:
        raise ConfigError(
            f"{owner} gc_pause_s must be a finite number of seconds >= 0 (0 = leave the collector alone), but was {gc_pause_s!r}"
        )
    return float(gc_pause_s)
