"""``resilience.deadline``: deadlines shared through a contextvar, capped by the one in force, never negative."""

from __future__ import annotations

import threading

import pytest

from resilience import Deadline
from resilience.deadline import CURRENT_DEADLINE
from resilience.testing.clock import FakeClock


def test_deadline_context_caps_inner() -> None:
    """An outer deadline caps an inner, longer one; leaving restores the outer."""
    clock = FakeClock()
    with Deadline(5, clock=clock) as outer:
        with Deadline(60, clock=clock) as inner:
            assert inner.remaining() == pytest.approx(5)
            assert CURRENT_DEADLINE.get() is inner
        assert CURRENT_DEADLINE.get() is outer
        clock.advance(6)
        assert outer.expired()
    assert CURRENT_DEADLINE.get() is None


def test_deadline_not_shared_with_new_threads() -> None:
    """A plain new thread starts without the caller's deadline (fan-outs copy the context on purpose)."""
    seen: list[object] = []
    with Deadline(5):
        t = threading.Thread(target=lambda: seen.append(CURRENT_DEADLINE.get()))
        t.start()
        t.join()
    assert seen == [None]


def test_negative_deadline_rejected() -> None:
    """A deadline cannot be negative."""
    with pytest.raises(ValueError, match="must be >= 0"):
        Deadline(-1)


@pytest.mark.parametrize(
    ("seconds", "cap_s", "left"),
    [(5.0, None, 5.0), (5.0, 2.0, 2.0), (2.0, 5.0, 2.0), (None, 3.0, 3.0), (None, None, None), (0.0, 1.0, 0.0)],
)
def test_cap_ends_at_the_earlier_of_its_length_and_the_cap(seconds: float | None, cap_s: float | None, left: float | None) -> None:
    """``Deadline(s).cap(cap)``: the earlier end; None for both never ends."""
    clock = FakeClock()
    deadline = Deadline(seconds, clock=clock).cap(cap_s)
    assert (deadline.remaining() if deadline.bounded else None) == left


def test_a_capped_deadline_ends_on_its_clock() -> None:
    """``cap`` keeps the deadline's clock: the capped one ends when that clock reads the earlier end."""
    clock = FakeClock(100.0)
    deadline = Deadline(4.0, clock=clock).cap(10.0)
    assert deadline.remaining() == 4.0
    clock.advance(5.0)
    assert deadline.expired() and not Deadline(None, clock=clock).cap(None).bounded
