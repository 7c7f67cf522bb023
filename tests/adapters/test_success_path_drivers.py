"""Every driver, on the one retry loop: the answer, the delivery record and the events of a short call.

The same calls to a real local server through each driver, without observers
and with one: a first-attempt success has one record and announces
``CallStarted``, ``AttemptStarted``, ``AttemptEnded``, ``CallEnded`` (the
loop builds nothing more for it, but an observer still hears every moment);
a retried 502 and a handed-back 404 give their records too.
"""

from __future__ import annotations

from typing import Any

import pytest

from resilience.events import AttemptEnded, AttemptStarted, CallEnded, CallStarted, Event, RetryScheduled
from resilience.outcome import Delivery, Outcome
from resilience.policy import EndpointPolicy, PolicyTable, RetryPolicy
from tests.adapters.drivers import DRIVERS, Driver
from tests.servers import Reply, scripted

POLICIES = PolicyTable(
    {
        "GET /ok": EndpointPolicy(retry=RetryPolicy(max_attempts=3, base_s=0.01, cap_s=0.02)),
        "POST /ok": EndpointPolicy(idempotent=False, retry=RetryPolicy(max_attempts=3, base_s=0.01, cap_s=0.02)),
    }
)
OK = (0, 200, Outcome.SUCCESS, Delivery.RESPONDED, None, True)
ONE_ATTEMPT = [CallStarted, AttemptStarted, AttemptEnded, CallEnded]


def shape(attempts: tuple[Any, ...]) -> list[tuple[Any, ...]]:
    """A record without its measured durations (and whether a backoff followed)."""
    return [(a.attempt, a.status, a.outcome, a.delivery, a.error_type, a.delay_s is None) for a in attempts]


@pytest.mark.parametrize("observed", [False, True], ids=["unobserved", "observed"])
@pytest.mark.parametrize("driver_name", DRIVERS)
@pytest.mark.parametrize(
    ("method", "replies", "record", "kinds"),
    [
        ("GET", [Reply(200)], [OK], ONE_ATTEMPT),
        ("POST", [Reply(200)], [OK], ONE_ATTEMPT),
        (
            "GET",
            [Reply(502), Reply(200)],
            [(0, 502, Outcome.RETRYABLE, Delivery.RESPONDED, None, False), (1, *OK[1:])],
            [CallStarted, AttemptStarted, AttemptEnded, RetryScheduled, AttemptStarted, AttemptEnded, CallEnded],
        ),
        ("GET", [Reply(404)], [(0, 404, Outcome.FATAL, Delivery.RESPONDED, None, True)], ONE_ATTEMPT),
    ],
    ids=["GET 200", "POST 200", "GET 502 then 200", "GET 404"],
)
def test_a_short_call_gives_its_answer_record_and_events(
    driver_name: str, method: str, replies: list[Reply], record: list[tuple[Any, ...]], kinds: list[type], observed: bool
) -> None:
    seen: list[Event] = []
    driver = Driver(driver_name, POLICIES, observers=(seen.append,) if observed else ())
    try:
        with scripted(*replies) as server:
            answer = driver.call(method, f"{server.url}/ok", json={"a": 1} if method == "POST" else None, timeout=5)
            assert server.count == len(replies)
    finally:
        driver.close()
    assert answer.status == replies[-1].status
    assert shape(answer.attempts) == record
    assert [type(e) for e in seen] == (kinds if observed else [])
    if observed:
        assert len({e.call_id for e in seen if hasattr(e, "call_id")}) == 1
        ended = seen[-1]
        assert isinstance(ended, CallEnded) and ended.attempts == len(record) and ended.status == replies[-1].status


@pytest.mark.parametrize("driver_name", DRIVERS)
def test_an_observer_attached_to_a_shared_config_gets_every_call_announced(driver_name: str) -> None:
    """A driver with an observer never misses a call: every call is announced, with the caller's timeout."""
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
