"""``resilience.retry.call``: the loop's safety properties.

Breaker slots always come back, sent attempts stay bounded, ambiguous calls are not re-sent.
"""

from __future__ import annotations

import contextlib
from collections.abc import MutableMapping

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from resilience import BreakerConfig, CircuitOpen, EndpointPolicy, PolicyTable, RetryPolicy
from resilience.breaker import BreakerRegistry, BreakerState, CircuitBreaker
from resilience.outcome import Delivery
from resilience.retry.retrier import Retrier
from resilience.retry.spec import AttemptResult, CallSpec
from resilience.testing.clock import FakeClock

ENGINE = "http://127.0.0.1:1"
CONFIG = BreakerConfig(failure_threshold=1, open_seconds=1.0, half_open_max_calls=1)
POLICY = EndpointPolicy(retry=RetryPolicy(max_attempts=4, base_s=0.01, cap_s=0.01), deadline_s=30, attempt_timeout_s=1)


def spec(policy: EndpointPolicy = POLICY) -> CallSpec:
    return CallSpec("GET", f"{ENGINE}/x", PolicyTable({"GET /x": policy}).match("GET", "/x"), ENGINE, "127.0.0.1", 1)


class InterruptingClock(FakeClock):
    """A fake clock whose next sleep raises (a Ctrl-C during a backoff sleep)."""

    def __init__(self, error: BaseException) -> None:
        super().__init__()
        self.error: BaseException | None = error

    def sleep(self, seconds: float) -> None:
        if self.error is not None:
            error, self.error = self.error, None
            raise error
        super().sleep(seconds)


def half_open(clock: FakeClock) -> tuple[Retrier, CircuitBreaker]:
    registry = BreakerRegistry(CONFIG, clock=clock)
    breaker = registry.by_engine[ENGINE]
    breaker.record_failure()
    clock.advance(CONFIG.open_seconds)
    assert breaker.state is BreakerState.HALF_OPEN
    return Retrier(breakers=registry, clock=clock), breaker


def gateway(_n: int, _t: tuple[float | None, float | None], _c: MutableMapping[str, str]) -> AttemptResult[str]:
    return AttemptResult(response="502", status=502)


def test_keyboard_interrupt_in_backoff_sleep_returns_the_probe_slot() -> None:
    """The half-open probe interrupted during its backoff sleep gives its slot back: the engine is not refused forever."""
    clock = InterruptingClock(KeyboardInterrupt())
    retrier, breaker = half_open(clock)
    with pytest.raises(KeyboardInterrupt):
        retrier.run(spec(), gateway)
    assert breaker.state is BreakerState.HALF_OPEN
    assert breaker.admit() is not None  # the one slot is free again


def test_exception_in_discard_returns_the_probe_slot() -> None:
    """Any exception outside the attempt (here a failing discard) also gives the slot back."""
    retrier, breaker = half_open(FakeClock())

    def bad_discard(_r: str) -> None:
        raise RuntimeError("discard failed")

    with pytest.raises(RuntimeError):
        retrier.run(spec(), gateway, discard=bad_discard)
    assert breaker.admit() is not None


def test_call_admitted_while_closed_needs_a_probe_slot_after_half_open() -> None:
    """A call let in while closed, still retrying once the breaker went half-open, may not exceed half_open_max_calls."""
    clock = FakeClock()
    registry = BreakerRegistry(CONFIG, clock=clock)
    breaker = registry.by_engine[ENGINE]
    sent: list[int] = []

    def attempt(n: int, _t: tuple[float | None, float | None], _c: MutableMapping[str, str]) -> AttemptResult[str]:
        sent.append(n)
        if n == 0:  # meanwhile other calls open the breaker, the wait passes, and another call takes the one probe slot
            breaker.record_failure()
            clock.advance(CONFIG.open_seconds)
            assert breaker.admit() is not None
        return AttemptResult(response="502", status=502)

    with pytest.raises(CircuitOpen):
        Retrier(breakers=registry, clock=clock).run(spec(), attempt)
    assert sent == [0]  # the second attempt was refused, not sent as a second probe


def test_call_holding_the_probe_slot_keeps_it_for_its_retries() -> None:
    """A call that took the half-open slot retries on it, and its success closes the breaker."""
    retrier, breaker = half_open(FakeClock())
    results = iter([AttemptResult(response="502", status=502), AttemptResult(response="ok", status=200)])
    resp, records = retrier.run(spec(), lambda n, t, c: next(results))
    assert resp == "ok" and len(records) == 2
    assert breaker.state is BreakerState.CLOSED


STEPS = st.sampled_from(["502", "ok", "refused", "reset", "400", "raise_attempt", "interrupt_sleep"])


@settings(max_examples=150, deadline=None)
@given(script=st.lists(STEPS, min_size=1, max_size=6), max_calls=st.integers(1, 3))
def test_no_exit_path_leaks_a_half_open_slot(script: list[str], max_calls: int) -> None:
    """Whatever each attempt does (answers, fails, raises, or the sleep is interrupted), every slot comes back."""
    clock: FakeClock = InterruptingClock(KeyboardInterrupt()) if "interrupt_sleep" in script else FakeClock()
    registry = BreakerRegistry(BreakerConfig(failure_threshold=1, open_seconds=1.0, half_open_max_calls=max_calls), clock=clock)
    breaker = registry.by_engine[ENGINE]
    breaker.record_failure()
    clock.advance(1.0)
    steps = iter(script)

    def attempt(_n: int, _t: tuple[float | None, float | None], _c: MutableMapping[str, str]) -> AttemptResult[str]:
        step = next(steps, "ok")
        if step == "raise_attempt":
            raise ValueError("client-side bug")
        if step == "refused":
            return AttemptResult(error=ConnectionRefusedError(), delivery=Delivery.NOT_SENT, error_kind="connect_error")
        if step == "reset":
            return AttemptResult(error=ConnectionResetError(), delivery=Delivery.AMBIGUOUS, error_kind="connection_reset")
        if step == "400":
            return AttemptResult(response="400", status=400)
        return AttemptResult(response="ok" if step in ("ok", "interrupt_sleep") else "502", status=200 if step == "ok" else 502)

    with contextlib.suppress(KeyboardInterrupt, Exception):  # every way out is allowed; only the slots matter
        Retrier(breakers=registry, clock=clock).run(spec(), attempt)
    state = breaker.state
    assert state in (BreakerState.CLOSED, BreakerState.OPEN, BreakerState.HALF_OPEN)
    if state is BreakerState.HALF_OPEN:  # no verdict was given: every one of the max_calls slots is free again
        permits = [breaker.admit() for _ in range(max_calls)]
        assert all(p is not None for p in permits)


KINDS = st.sampled_from(["refused", "502", "reset", "ok"])


@settings(max_examples=200, deadline=None)
@given(script=st.lists(KINDS, min_size=1, max_size=30), max_attempts=st.integers(1, 5), idempotent=st.booleans())
def test_sent_attempts_bounded_and_ambiguous_never_resent(script: list[str], max_attempts: int, idempotent: bool) -> None:
    """Any mix of refusals, 502s and resets: at most max_attempts attempts reach the server, and a non-idempotent call
    is never sent again after an attempt that may have been applied (the ambiguous case, injected anywhere)."""
    policy = EndpointPolicy(
        idempotent=idempotent,
        retry_statuses_if_not_idempotent=True,
        retry=RetryPolicy(max_attempts=max_attempts, base_s=0.01, cap_s=0.01, jitter=0),
        deadline_s=1.0,
        attempt_timeout_s=1.0,
    )
    steps = iter(script)
    seen: list[Delivery] = []

    def attempt(_n: int, _t: tuple[float | None, float | None], _c: MutableMapping[str, str]) -> AttemptResult[str]:
        step = next(steps, "refused")
        result: AttemptResult[str]
        if step == "refused":
            result = AttemptResult(error=ConnectionRefusedError(), delivery=Delivery.NOT_SENT, error_kind="connect_error")
        elif step == "reset":
            result = AttemptResult(error=ConnectionResetError(), delivery=Delivery.AMBIGUOUS, error_kind="connection_reset")
        else:
            result = AttemptResult(response=step, status=200 if step == "ok" else 502)
        seen.append(result.delivery)
        return result

    with contextlib.suppress(Exception):
        Retrier(clock=FakeClock()).run(spec(policy), attempt)
    assert seen, "at least one attempt was made"
    assert sum(1 for d in seen if d is not Delivery.NOT_SENT) <= max_attempts
    if not idempotent and Delivery.AMBIGUOUS in seen:
        assert seen.index(Delivery.AMBIGUOUS) == len(seen) - 1
