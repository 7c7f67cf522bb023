"""``resilience.backoff``: full-jitter bounds (a table and a property) and Retry-After parsing."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

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
