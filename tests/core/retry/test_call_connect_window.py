"""``resilience.retry.call``: a call that never connects.

It is retried for ``connect_window_s``, then ends with the refusal itself, one warning, and an open breaker.
"""

from __future__ import annotations

import logging
from collections.abc import MutableMapping

import pytest

from resilience import CircuitOpen, EndpointPolicy, PolicyTable, RetryPolicy
from resilience.breaker import BreakerConfig, BreakerRegistry, BreakerState
from resilience.events import BreakerTransitioned, EngineRefused, Event
from resilience.outcome import Delivery
from resilience.retry.retrier import Retrier
from resilience.retry.spec import AttemptResult, CallSpec
from resilience.testing.clock import FakeClock

ENGINE = "http://127.0.0.1:1"
FAST = RetryPolicy(max_attempts=4, base_s=0.5, cap_s=0.5, jitter=0, connect_window_s=2.0)
POLICY = EndpointPolicy(retry=FAST, deadline_s=30, attempt_timeout_s=1)


def spec(policy: EndpointPolicy = POLICY, method: str = "POST") -> CallSpec:
    match = PolicyTable({f"{method} /x": policy}).match(method, "/x")
    return CallSpec(method, f"{ENGINE}/x", match, ENGINE, "127.0.0.1", 1)


def refused() -> AttemptResult[str]:
    return AttemptResult(error=ConnectionRefusedError("refused"), delivery=Delivery.NOT_SENT, error_kind="connect_error")


def ok() -> AttemptResult[str]:
    return AttemptResult(response="resp200", status=200)


class Script:
    """Plays results in order; once they run out, keeps refusing. Counts the attempts it was asked for."""

    def __init__(self, *results: AttemptResult[str]) -> None:
        self.results = list(results)
        self.calls = 0

    def __call__(self, n: int, timeouts: tuple[float | None, float | None], carrier: MutableMapping[str, str]) -> AttemptResult[str]:
        self.calls += 1
        return self.results.pop(0) if self.results else refused()


def retrier(clock: FakeClock, seen: list[Event] | None = None, breaker: BreakerConfig | None = None) -> Retrier:
    observers = [seen.append] if seen is not None else []
    return Retrier(clock=clock, observers=observers, breakers=BreakerRegistry(breaker or BreakerConfig(), clock=clock, observers=observers))


def test_refusals_stop_at_the_window_with_the_refusal_itself() -> None:
    """0.5 s apart under a 2 s window and a 30 s deadline: four refusals, then the ConnectionRefusedError with its attempts."""
    clock = FakeClock()
    with pytest.raises(ConnectionRefusedError) as info:
        retrier(clock).run(spec(), Script())
    attempts = info.value.attempts  # type: ignore[attr-defined]
    assert [a.delivery for a in attempts] == [Delivery.NOT_SENT] * 4
    assert clock.sleeps == [0.5, 0.5, 0.5]  # no attempt starts at 2.0 s: the window is over


def test_an_engine_that_comes_up_within_the_window_is_reached() -> None:
    """Refused three times, then listening: the call succeeds inside the window."""
    resp, records = retrier(FakeClock()).run(spec(), Script(refused(), refused(), refused(), ok()))
    assert resp == "resp200" and [r.delivery for r in records] == [Delivery.NOT_SENT] * 3 + [Delivery.RESPONDED]


def test_a_call_that_reached_the_engine_retries_refusals_until_the_deadline() -> None:
    """A 502 first (the engine is there, restarting): later refusals are retried past the window, until the deadline."""
    policy = EndpointPolicy(retry=FAST, deadline_s=10, attempt_timeout_s=1)
    with pytest.raises(ConnectionRefusedError) as info:
        retrier(FakeClock()).run(spec(policy, "GET"), Script(AttemptResult(status=502, response="r")))
    assert len(info.value.attempts) > 10  # type: ignore[attr-defined]  # 0.5 s apart over 10 s, far past the 2 s window


def test_no_window_retries_refusals_until_the_deadline() -> None:
    """``connect_window_s=None``: the deadline alone bounds refusals, as before the window existed."""
    policy = EndpointPolicy(retry=RetryPolicy(base_s=0.5, cap_s=0.5, jitter=0, connect_window_s=None), deadline_s=10, attempt_timeout_s=1)
    with pytest.raises(ConnectionRefusedError) as info:
        retrier(FakeClock()).run(spec(policy), Script())
    assert len(info.value.attempts) == 20  # type: ignore[attr-defined]


def test_a_deadline_shorter_than_the_window_ends_it_first() -> None:
    """A 1 s deadline under a 2 s window: still the refusal itself, and the breaker only counts a failure."""
    clock = FakeClock()
    policy = EndpointPolicy(retry=FAST, deadline_s=1, attempt_timeout_s=1)
    r = retrier(clock)
    with pytest.raises(ConnectionRefusedError):
        r.run(spec(policy), Script())
    assert r.breakers is not None and r.breakers.by_engine[ENGINE].state is BreakerState.CLOSED


def test_the_first_refusal_is_logged_once_and_announced(caplog: pytest.LogCaptureFixture) -> None:
    """One WARNING per call, naming the engine, the endpoint and the seconds it keeps trying; one ``EngineRefused``."""
    seen: list[Event] = []
    with caplog.at_level(logging.WARNING, logger="resilience.retry"), pytest.raises(ConnectionRefusedError):
        retrier(FakeClock(), seen).run(spec(), Script())
    warnings = [r for r in caplog.records if r.name == "resilience.retry"]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING
    assert warnings[0].getMessage() == (
        f"{ENGINE} refused POST /x (ConnectionRefusedError); retrying for up to 2.0 s, then the call fails with this error"
    )
    refusals = [e for e in seen if isinstance(e, EngineRefused)]
    assert len(refusals) == 1
    assert refusals[0].engine == ENGINE and refusals[0].retry_for_s == pytest.approx(2.0)
    assert refusals[0].error_type == "ConnectionRefusedError" and refusals[0].endpoint == "POST /x"


def test_a_refusal_that_ends_the_call_at_once_is_not_announced(caplog: pytest.LogCaptureFixture) -> None:
    """``retry_before_send=False``: the error is the news; no warning that promises retries."""
    policy = EndpointPolicy(retry=RetryPolicy(retry_before_send=False))
    with caplog.at_level(logging.WARNING, logger="resilience.retry"), pytest.raises(ConnectionRefusedError):
        retrier(FakeClock()).run(spec(policy), Script())
    assert not [r for r in caplog.records if r.name == "resilience.retry"]


def test_refused_for_a_whole_window_opens_the_breaker_and_the_next_call_fails_fast() -> None:
    """After one call refused for its window, the next fails with CircuitOpen and no attempt, until a half-open one connects."""
    clock = FakeClock()
    seen: list[Event] = []
    r = retrier(clock, seen, BreakerConfig(open_seconds=5))
    with pytest.raises(ConnectionRefusedError):
        r.run(spec(), Script())
    transitions = [e for e in seen if isinstance(e, BreakerTransitioned)]
    assert [(t.from_state, t.to_state) for t in transitions] == [("closed", "open")]
    assert transitions[0].reason == "connections refused for 2 s: nothing listens"
    second = Script(ok())
    with pytest.raises(CircuitOpen):
        r.run(spec(), second)
    assert second.calls == 0
    clock.advance(5)
    resp, _ = r.run(spec(), Script(refused(), ok()))  # the half-open probe call connects
    assert resp == "resp200"
    assert r.breakers is not None and r.breakers.by_engine[ENGINE].state is BreakerState.CLOSED


def test_a_half_open_call_refused_for_its_window_opens_it_again() -> None:
    """The probe call gets its own window; refused throughout, the breaker is open again."""
    clock = FakeClock()
    r = retrier(clock, breaker=BreakerConfig(open_seconds=5))
    with pytest.raises(ConnectionRefusedError):
        r.run(spec(), Script())
    clock.advance(5)
    with pytest.raises(ConnectionRefusedError):
        r.run(spec(), Script())
    assert r.breakers is not None and r.breakers.by_engine[ENGINE].state is BreakerState.OPEN


def test_open_on_unreachable_off_counts_one_failure() -> None:
    """``BreakerConfig(open_on_unreachable=False)``: such a call is one failure among the threshold's five."""
    r = retrier(FakeClock(), breaker=BreakerConfig(open_on_unreachable=False))
    with pytest.raises(ConnectionRefusedError):
        r.run(spec(), Script())
    assert r.breakers is not None and r.breakers.by_engine[ENGINE].state is BreakerState.CLOSED


@pytest.mark.parametrize("value", [0, -1.0, float("nan"), float("inf"), "5", True])
def test_invalid_connect_window_is_rejected(value: object) -> None:
    """A window must be a finite number > 0 or None, and the error names the field."""
    with pytest.raises(ValueError, match=r"RetryPolicy\.connect_window_s must be a number > 0 or None, but was"):
        RetryPolicy(connect_window_s=value)  # type: ignore[arg-type]


def test_invalid_open_on_unreachable_is_rejected() -> None:
    """The breaker switch is a boolean."""
    with pytest.raises(ValueError, match=r"BreakerConfig\.open_on_unreachable must be true or false, but was 'no'"):
        BreakerConfig(open_on_unreachable="no")  # type: ignore[arg-type]
