"""Every driver on the success fast path gives what it gives through the full ``RetryCall`` (``Retrier.fast_path=False``).

The same calls to the same real local server, once through a driver on the
fast path (a first attempt that succeeds builds no ``RetryCall``) and once
through the same driver whose retrier runs every call through a
``RetryCall``, each without observers and with one: the status, the delivery
record (all but the measured durations), the error, and the events announced
(all but call ids and durations) must be the same.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

import resilience.retry.call as retry_call
from resilience.events import AttemptEnded, AttemptStarted, CallEnded, CallStarted, Event
from resilience.policy import EndpointPolicy, PolicyTable, RetryPolicy
from tests.adapters.drivers import DRIVERS, Driver
from tests.servers import Reply, scripted

POLICIES = PolicyTable(
    {
        "GET /ok": EndpointPolicy(retry=RetryPolicy(max_attempts=3, base_s=0.01, cap_s=0.02)),
        "POST /ok": EndpointPolicy(idempotent=False, retry=RetryPolicy(max_attempts=3, base_s=0.01, cap_s=0.02)),
    }
)


def shape(attempts: tuple[Any, ...]) -> list[tuple[Any, ...]]:
    """A record without its measured durations."""
    return [(a.attempt, a.status, a.outcome, a.delivery, a.error_type, a.delay_s is None) for a in attempts]


@pytest.fixture
def built(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[object]]:
    """Every ``RetryCall`` constructed while the test runs."""
    made: list[object] = []
    original: Callable[..., None] = retry_call.RetryCall.__init__

    def counting(self: Any, *args: Any, **kwargs: Any) -> None:
        made.append(self)
        original(self, *args, **kwargs)

    monkeypatch.setattr(retry_call.RetryCall, "__init__", counting)
    yield made


def event_shape(events: list[Event]) -> list[tuple[Any, ...]]:
    """Each event's type and fields, without its call id, durations, jittered delays, engine port and carrier."""
    dropped = {"call_id", "duration_s", "delay_s", "carrier", "deadline_s", "engine", "server_port"}  # measured; a fresh server
    return [(type(e).__name__, *(v for k, v in sorted(vars_of(e).items()) if k not in dropped)) for e in events]


def vars_of(event: Event) -> dict[str, Any]:
    return {name: getattr(event, name) for name in event.__slots__}  # type: ignore[union-attr]


@pytest.mark.parametrize("observed", [False, True], ids=["unobserved", "observed"])
@pytest.mark.parametrize("driver_name", DRIVERS)
@pytest.mark.parametrize(
    ("method", "replies"),
    [("GET", [Reply(200)]), ("POST", [Reply(200)]), ("GET", [Reply(502), Reply(200)]), ("GET", [Reply(404)])],
    ids=["GET 200", "POST 200", "GET 502 then 200", "GET 404"],
)
def test_the_fast_path_gives_the_answer_record_and_events_the_retry_call_gives(
    driver_name: str, method: str, replies: list[Reply], observed: bool, built: list[object]
) -> None:
    answers = []
    events: list[list[Event]] = []
    for fast in (True, False):
        seen: list[Event] = []
        driver = Driver(driver_name, POLICIES, observers=(seen.append,) if observed else ())
        driver.layer.retrier.fast_path = fast
        try:
            with scripted(*replies) as server:
                answer = driver.call(method, f"{server.url}/ok", json={"a": 1} if method == "POST" else None, timeout=5)
                assert server.count == len(replies)
            answers.append((answer.status, shape(answer.attempts)))
        finally:
            driver.close()
        events.append(seen)
        if fast:
            first_succeeded = 200 <= replies[0].status < 300
            assert len(built) == (0 if first_succeeded else 1)  # the fast path builds one only when the first attempt failed
    assert answers[0] == answers[1]
    assert len(built) == (0 if 200 <= replies[0].status < 300 else 1) + 1
    assert event_shape(events[0]) == event_shape(events[1])
    if observed:
        kinds = [type(e) for e in events[0]]
        assert kinds[0] is CallStarted and kinds[-1] is CallEnded
        assert kinds.count(AttemptStarted) == kinds.count(AttemptEnded) == len(replies)


@pytest.mark.parametrize("driver_name", DRIVERS)
def test_an_observer_attached_to_a_shared_config_gets_every_call_announced(driver_name: str) -> None:
    """A driver with an observer never skips an event on the fast path: every call is announced, with the caller's timeout."""
    seen: list[Event] = []
    driver = Driver(driver_name, POLICIES, observers=(seen.append,))
    try:
        with scripted(Reply(200), Reply(200), Reply(200)) as server:
            for _ in range(3):
                assert driver.call("GET", f"{server.url}/ok", timeout=5).status == 200
    finally:
        driver.close()
    assert sum(isinstance(e, CallEnded) for e in seen) == 3
    starts = [e for e in seen if isinstance(e, AttemptStarted)]
    assert len(starts) == 3 and all(e.timeout_s == 5 for e in starts)
