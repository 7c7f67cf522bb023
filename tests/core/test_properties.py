"""Property-based tests: backoff bounds, the breaker state machine, the policy validator."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from resilience import BreakerConfig, BreakerState, FakeClock, PolicyError, RetryPolicy
from resilience.backoff import backoff_delay
from resilience.breaker import CircuitBreaker


@given(
    n=st.integers(1, 60),
    base=st.floats(0, 10, allow_nan=False),
    extra=st.floats(0, 100, allow_nan=False),
    mult=st.floats(1, 10, allow_nan=False),
    jitter=st.floats(0, 1),
    u=st.floats(0, 1, exclude_max=True),
)
def test_backoff_within_bounds(n: int, base: float, extra: float, mult: float, jitter: float, u: float) -> None:
    """Every delay lies in [(1 - jitter) * ceiling, ceiling] with ceiling = min(cap, base * mult**(n-1))."""
    cap = base + extra
    delay = backoff_delay(n, base_s=base, cap_s=cap, multiplier=mult, jitter=jitter, rng=lambda: u)
    ceiling = min(cap, base * mult ** (n - 1)) if mult ** (n - 1) < 1e300 else cap
    assert (1 - jitter) * ceiling - 1e-9 <= delay <= ceiling + 1e-9
    assert 0 <= delay <= cap + 1e-9


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
            allowed = b.allow()
            if before is BreakerState.OPEN and b.retry_in() > 0:
                assert not allowed
            if before is BreakerState.CLOSED:
                assert allowed
        assert b.state in set(BreakerState)


@given(
    attempts=st.integers(-3, 10),
    base=st.floats(-1, 5, allow_nan=False),
    cap=st.floats(-1, 5, allow_nan=False),
    status=st.integers(0, 800),
)
def test_validator_accepts_exactly_valid_policies(attempts: int, base: float, cap: float, status: int) -> None:
    """The validator rejects a policy if and only if one of its rules is broken."""
    valid = attempts >= 1 and base >= 0 and cap >= 0 and cap >= base and 100 <= status <= 599
    try:
        RetryPolicy(max_attempts=attempts, base_s=base, cap_s=cap, statuses=frozenset({status}))
    except PolicyError:
        assert not valid
    else:
        assert valid
