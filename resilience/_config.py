"""The process-wide testing switch (``set_testing``, as stamina's): no backoff sleeps, capped attempts."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from types import TracebackType

from resilience.errors import integer, require

__all__ = ["TestingMode", "TestingSwitch", "current_testing", "set_testing"]


@dataclass(frozen=True, slots=True)
class TestingMode:
    """The testing switch's state."""

    active: bool = False
    """True: the retry loop sleeps no backoff (default False)."""
    attempts: int | None = None
    """Cap on attempts per call while active (None = the policy's own)."""


_lock = threading.Lock()
_mode = TestingMode()


def current_testing() -> TestingMode:
    """The testing mode in force."""
    return _mode


@dataclass(frozen=True, slots=True)
class TestingSwitch:
    """What ``set_testing`` returns: the mode it replaced, and a context manager that restores it on exit."""

    mode: TestingMode
    """The mode set."""
    previous: TestingMode
    """The mode in force before, restored when a ``with`` block ends."""

    def __enter__(self) -> TestingMode:
        return self.mode

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        global _mode
        with _lock:
            _mode = self.previous


def set_testing(on: bool = True, *, attempts: int | None = None) -> TestingSwitch:
    """Turn testing mode on (no backoff sleeps, at most ``attempts`` attempts per call) or off.

    Takes effect at once; used as ``with set_testing(...):`` the previous mode comes back when the
    block ends. ``attempts`` (default None: the policy's ``max_attempts``) must be >= 1 and is
    ignored when ``on`` is False.
    """
    global _mode
    require(attempts is None or (integer(attempts) and attempts >= 1), "set_testing", "attempts", "an integer >= 1 or None", attempts)
    with _lock:
        previous = _mode
        _mode = TestingMode(active=on, attempts=attempts if on else None)
        return TestingSwitch(_mode, previous)
