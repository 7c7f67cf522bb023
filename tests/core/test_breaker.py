"""``resilience.breaker``: the circuit breaker's state machine (scripted, and as a property) and its config checks."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from resilience import BreakerConfig
from resilience.breaker import BreakerState, CircuitBreaker
from resilience.errors import ConfigError
from resilience.events import BreakerTransitioned, Event
from resilience.testing.clock import FakeClock


def test_consecutive_failures_open_then_half_open_then_close() -> None:
    """Consecutive failures open the breaker; after the wait one probe passes; its success closes it."""
    clock = FakeClock()
    seen: list[Event] = []
    b = CircuitBreaker("http://e:1", BreakerConfig(failure_threshold=3, open_seconds=2), clock=clock, observers=[seen.append])
    for _ in range(3):
        assert b.admit()
        b.record_failure()
    assert b.state is BreakerState.OPEN
    assert not b.admit()
    clock.advance(2)
    assert b.admit()  # the half-open probe
    assert not b.admit()  # only one at a time
    b.record_success()
    assert b.state is BreakerState.CLOSED
    assert [(e.from_state, e.to_state) for e in seen if isinstance(e, BreakerTransitioned)] == [
        ("closed", "open"),
        ("open", "half_open"),
        ("half_open", "closed"),
    ]


def test_half_open_failure_reopens() -> None:
    """A failed half-open probe opens the breaker again for a full wait."""
    clock = FakeClock()
    b = CircuitBreaker("e", BreakerConfig(failure_threshold=1, open_seconds=1), clock=clock)
    b.record_failure()
    clock.advance(1)
    assert b.admit()
    b.record_failure()
    assert b.state is BreakerState.OPEN
    assert b.retry_in() == pytest.approx(1)


def test_failure_rate_trigger() -> None:
    """The failure-rate window opens the breaker even without a long consecutive run."""
    b = CircuitBreaker("e", BreakerConfig(failure_threshold=0, failure_rate_threshold=0.5, window_size=4, minimum_calls=4))
    for ok in (True, False, True, False):
        (b.record_success if ok else b.record_failure)()
    assert b.state is BreakerState.OPEN


def test_breaker_config_validated() -> None:
    """Invalid breaker settings name the field."""
    with pytest.raises(ConfigError, match=r"BreakerConfig\.failure_rate_threshold must be within"):
        BreakerConfig(failure_rate_threshold=0)


@settings(max_examples=200)
@given(ops=st.lists(st.sampled_from(["ok", "fail", "allow", "wait"]), max_size=60), threshold=st.integers(1, 5))
def test_breaker_state_machine_invariants(ops: list[str], threshold: int) -> None:
    """Whatever happens, an open breaker rejects until the wait, and only allowed transitions occur."""
    clock = FakeClock()
    b = CircuitBreaker("e", BreakerConfig(failure_threshold=threshold, open_seconds=1, minimum_calls=20, window_size=20), clock=clock)
    for op in ops:
        before = b.state
        if op == "ok":
            b.record_success()
        elif op == "fail":
            b.record_failure()
        elif op == "wait":
            clock.advance(1)
        else:
            allowed = b.admit()
            if before is BreakerState.OPEN and b.retry_in() > 0:
                assert not allowed
            if before is BreakerState.CLOSED:
                assert allowed
        assert b.state in set(BreakerState)


@settings(max_examples=200, deadline=None)
@given(
    ops=st.lists(st.sampled_from(["admit", "ok", "fail", "wait"]), max_size=60),
    window=st.integers(min_value=1, max_value=5),
)
def test_a_success_into_a_clean_window_skips_nothing_that_counts(ops: list[str], window: int) -> None:
    """``record_success`` without the lock (closed, the window all successes) ends where the locked path would.

    The twin never takes the shortcut (``_clean_full`` out of reach); both see the same calls, in the
    same order, with the permit a first admission's ``closed_permit`` (or ``admit``) handed out.
    """
    config = BreakerConfig(
        failure_threshold=3, window_size=window, minimum_calls=min(2, window), failure_rate_threshold=0.5, open_seconds=1.0
    )
    clock = FakeClock()
    fast, twin = CircuitBreaker("e", config, clock=clock), CircuitBreaker("e", config, clock=clock)
    assert hasattr(twin, "_clean_full")  # a renamed field would make the twin take the shortcut too
    twin._clean_full = 10**9
    permits: dict[int, object] = {}
    for op in ops:
        if op == "wait":
            clock.advance(1.5)
        elif op == "admit":
            for i, b in enumerate((fast, twin)):
                permits[i] = b.closed_permit or b.admit()
        else:
            for i, b in enumerate((fast, twin)):
                permit = permits.get(i)
                (b.record_success if op == "ok" else b.record_failure)(permit)  # type: ignore[arg-type]
        assert (fast.state, list(fast._window), fast._consecutive) == (twin.state, list(twin._window), twin._consecutive)


def test_a_clean_closed_window_counts_a_success_without_the_lock() -> None:
    """Once the window holds only successes, ``closed_permit`` and ``record_success`` do not wait for the lock; a failure ends that."""
    import threading

    breaker = CircuitBreaker("e", BreakerConfig(window_size=2, minimum_calls=1), clock=FakeClock())
    for _ in range(2):
        breaker.record_success(breaker.closed_permit)
    done = threading.Event()
    with breaker._lock:  # held: the locked path would wait here
        worker = threading.Thread(target=lambda: (breaker.record_success(breaker.closed_permit), done.set()))
        worker.start()
        worker.join(timeout=10)
        assert done.is_set()
    breaker.record_failure(breaker.closed_permit)
    assert breaker._clean == 0 and list(breaker._window) == [True, False]


def test_closed_permit_and_calm_follow_the_state_and_the_window() -> None:
    """``closed_permit`` is the closed breaker's permit (None otherwise); ``calm`` is it only while the window holds only successes."""
    clock = FakeClock()
    config = BreakerConfig(window_size=2, minimum_calls=1, failure_threshold=2, failure_rate_threshold=1.0, open_seconds=1)
    breaker = CircuitBreaker("e", config, clock=clock)
    permit = breaker.closed_permit
    assert permit is not None and breaker.admit() is permit and breaker.calm is None
    breaker.record_success(permit)
    assert breaker.calm is None  # one success in a window of two
    breaker.record_success(permit)
    assert breaker.calm is permit
    breaker.record_failure(permit)
    assert breaker.calm is None and breaker.closed_permit is permit
    breaker.record_failure(permit)
    assert breaker.state is BreakerState.OPEN and breaker.closed_permit is None and breaker.calm is None
    clock.advance(1)
    probe = breaker.admit()
    assert breaker.state is BreakerState.HALF_OPEN and breaker.closed_permit is None
    breaker.record_success(probe)
    assert breaker.state is BreakerState.CLOSED and breaker.closed_permit is breaker.admit() is not permit and breaker.calm is None
