"""Backoff bounds, Retry-After parsing and deadlines shared through a contextvar."""

from __future__ import annotations

import threading

import pytest

from resilience import Deadline, FakeClock, current_deadline
from resilience.backoff import backoff_delay, parse_retry_after


def test_full_jitter_bounds() -> None:
    """Full jitter draws within [0, min(cap, base * mult**(n-1))]."""
    assert backoff_delay(1, base_s=0.5, cap_s=10, multiplier=2, jitter=1.0, rng=lambda: 0.0) == 0.0
    assert backoff_delay(3, base_s=0.5, cap_s=10, multiplier=2, jitter=1.0, rng=lambda: 0.999) == pytest.approx(1.998)
    assert backoff_delay(30, base_s=0.5, cap_s=10, multiplier=2, jitter=0.0) == 10


def test_retry_after_forms() -> None:
    """Retry-After takes delta-seconds or an HTTP date; junk is ignored."""
    assert parse_retry_after("3") == 3.0
    assert parse_retry_after("nonsense") is None
    assert parse_retry_after(None) is None
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT", now=lambda: 1445412470.0) == pytest.approx(10.0)


def test_deadline_context_caps_inner() -> None:
    """An outer deadline caps an inner, longer one; leaving restores the outer."""
    clock = FakeClock()
    with Deadline(5, clock=clock) as outer:
        with Deadline(60, clock=clock) as inner:
            assert inner.remaining() == pytest.approx(5)
            assert current_deadline() is inner
        assert current_deadline() is outer
        clock.advance(6)
        assert outer.expired()
    assert current_deadline() is None


def test_deadline_not_shared_with_new_threads() -> None:
    """A plain new thread starts without the caller's deadline (fan-outs copy the context on purpose)."""
    seen: list[object] = []
    with Deadline(5):
        t = threading.Thread(target=lambda: seen.append(current_deadline()))
        t.start()
        t.join()
    assert seen == [None]


def test_negative_deadline_rejected() -> None:
    """A deadline cannot be negative."""
    with pytest.raises(ValueError, match="must be >= 0"):
        Deadline(-1)
