"""The process-wide testing switch: no backoff sleeps, capped attempts.

``resilience.set_testing(True, attempts=2)`` turns it on until turned off;
``with resilience.set_testing(True, attempts=2): ...`` turns it on for a block
and restores what was in force before (as stamina's ``set_testing`` does).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from types import TracebackType

from resilience.errors import ConfigError

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


class TestingSwitch:
    """What ``set_testing`` returns: the mode it replaced, and a context manager that restores it on exit."""

    __slots__ = ("mode", "previous")

    def __init__(self, mode: TestingMode, previous: TestingMode) -> None:
        self.mode = mode
        """The mode set."""
        self.previous = previous
        """The mode in force before, restored when a ``with`` block ends."""

    def __enter__(self) -> TestingMode:
        return self.mode

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        global _mode
        with _lock:
            _mode = self.previous

    def __repr__(self) -> str:
        return f"TestingSwitch(mode={self.mode!r}, previous={self.previous!r})"


def set_testing(on: bool = True, *, attempts: int | None = None) -> TestingSwitch:
    """Turn testing mode on (no backoff sleeps, at most ``attempts`` attempts per call) or off.

    Takes effect at once; used as ``with set_testing(...):`` the previous mode comes back when the
    block ends. ``attempts`` (default None: the policy's ``max_attempts``) must be >= 1 and is
    ignored when ``on`` is False.
    """
    global _mode
    if attempts is not None and (isinstance(attempts, bool) or not isinstance(attempts, int) or attempts < 1):
        raise ConfigError(f"set_testing.attempts must be an integer >= 1 or None, but was {attempts!r}")
    with _lock:
        previous = _mode
        _mode = TestingMode(active=on, attempts=attempts if on else None)
        return TestingSwitch(_mode, previous)
