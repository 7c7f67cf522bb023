"""Process-wide switches: the testing mode (no backoff sleeps, capped attempts)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

__all__ = ["TestingMode", "current_testing", "set_testing", "testing_mode"]


@dataclass(frozen=True, slots=True)
class TestingMode:
    """The testing switch's state."""

    active: bool = False
    attempts: int | None = None
    """Cap on attempts per call while active (None = the policy's own)."""


_lock = threading.Lock()
_mode = TestingMode()


def current_testing() -> TestingMode:
    """The testing mode in force."""
    return _mode


def set_testing(active: bool, *, attempts: int | None = None) -> TestingMode:
    """Turn testing mode on (no backoff sleeps, at most ``attempts`` attempts) or off; returns the previous mode."""
    global _mode
    if attempts is not None and attempts < 1:
        raise ValueError(f"attempts must be >= 1 or None, but was {attempts}")
    with _lock:
        previous = _mode
        _mode = TestingMode(active=active, attempts=attempts if active else None)
    return previous


@contextmanager
def testing_mode(*, attempts: int | None = None) -> Iterator[TestingMode]:
    """Testing mode for a block, for users' own test suites: ``with resilience.testing_mode(attempts=2): ...``.

    (Not ``resilience.testing``: that name is the package of test tools, the emulator and fault plans.)
    """
    global _mode
    previous = set_testing(True, attempts=attempts)
    try:
        yield _mode
    finally:
        with _lock:
            _mode = previous
