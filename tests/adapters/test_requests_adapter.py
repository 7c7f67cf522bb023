"""ResilientAdapter against real loopback servers: retries, ambiguity, deadlines, breaker, budget."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest
import requests
from pytest_httpserver import HTTPServer

import resilience
from resilience import (
    AmbiguousOutcome,
    BreakerConfig,
    CircuitOpen,
    DeadlineExceeded,
    EndpointPolicy,
    PolicyTable,
    RetryBudgetConfig,
    RetryPolicy,
)
from resilience.adapters.requests import ResilientAdapter, resilient_session
from resilience.errors import RetryBudgetExhausted
from resilience.outcome import Delivery
from resilience.testing.clock import FakeClock
from tests.conftest import SHORT_TIMEOUT, free_port
from tests.servers import Hang, Reply, Reset, scripted

FAST = RetryPolicy(max_attempts=4, base_s=0.01, cap_s=0.05)


def table(**entries: EndpointPolicy) -> PolicyTable:
    return PolicyTable({k.replace("__", " /"): v for k, v in entries.items()})


def test_502_502_200_is_one_call_three_attempts(httpserver: HTTPServer) -> None:
    """An endpoint that retries absorbs two 502s: the caller sees one 200 and the attempts taken."""
    for code in (502, 502, 200):
        httpserver.expect_ordered_request("/pause_generation", method="POST").respond_with_data("ok" if code == 200 else "", status=code)
    clock = FakeClock()
    s = resilient_session(table(POST__pause_generation=EndpointPolicy(retry=FAST)), clock=clock)
    r = s.post(httpserver.url_for("/pause_generation"), json={})
    assert r.status_code == 200 and r.text == "ok"
    assert [a.status for a in r.attempts] == [502, 502, 200]  # type: ignore[attr-defined]
    assert len(clock.sleeps) == 2 and all(0 <= d <= 0.05 for d in clock.sleeps)
    httpserver.check_assertions()


def test_4xx_never_retried_and_500_not_by_default(httpserver: HTTPServer) -> None:
    """Client errors and plain 500s reach the caller after exactly one attempt."""
    httpserver.expect_request("/a").respond_with_data("bad", status=400)
    httpserver.expect_request("/b").respond_with_data("boom", status=500)
    s = resilient_session(retry_budget=None)
    assert s.get(httpserver.url_for("/a")).status_code == 400
    assert s.get(httpserver.url_for("/b")).status_code == 500
    assert len(httpserver.log) == 2


def test_non_idempotent_post_read_timeout_never_resent() -> None:
    """A POST whose read times out after sending is not re-sent when not idempotent: AmbiguousOutcome, one request seen."""
    policy = EndpointPolicy(idempotent=False, retry=FAST, attempt_timeout_s=SHORT_TIMEOUT, deadline_s=5)
    with scripted(Hang(3), Reply(200)) as srv:
        s = resilient_session(table(POST__release_memory_occupation=policy))
        with pytest.raises(AmbiguousOutcome) as info:
            s.post(f"{srv.url}/release_memory_occupation", json={"tags": None})
        assert srv.count == 1
    assert isinstance(info.value, requests.RequestException)
    assert info.value.endpoint == "POST /release_memory_occupation"
    assert len(info.value.attempts) == 1


def test_idempotent_post_read_timeout_is_retried() -> None:
    """The same hang on an idempotent endpoint is retried and succeeds."""
    policy = EndpointPolicy(idempotent=True, retry=FAST, attempt_timeout_s=SHORT_TIMEOUT, deadline_s=5)
    with scripted(Hang(3), Reply(200, b"paused")) as srv:
        r = resilient_session(table(POST__pause_generation=policy)).post(f"{srv.url}/pause_generation", json={})
        assert r.text == "paused" and srv.count == 2


def test_reset_after_send_on_non_idempotent_is_ambiguous() -> None:
    """A connection reset after the request was sent is ambiguous for a non-idempotent endpoint."""
    with scripted(Reset(), Reply(200)) as srv:
        s = resilient_session(table(POST__x=EndpointPolicy(idempotent=False, retry=FAST)))
        with pytest.raises(AmbiguousOutcome):
            s.post(f"{srv.url}/x", json={})
        assert srv.count == 1


def test_connection_refused_retried_until_server_comes_up() -> None:
    """Connection refused is retried for any method and succeeds once the server is up within the deadline."""
    port = free_port()
    servers = []

    def start_later() -> None:
        time.sleep(0.4)
        servers.append(scripted(Reply(200, b"up"), port=port))
        servers[0].__enter__()

    t = threading.Thread(target=start_later)
    t.start()
    try:
        policy = EndpointPolicy(idempotent=False, retry=RetryPolicy(max_attempts=50, base_s=0.05, cap_s=0.1), deadline_s=10)
        r = resilient_session(table(POST__resume=policy), breaker=None).post(f"http://127.0.0.1:{port}/resume", json={})
        assert r.text == "up"
        assert r.attempts[0].status is None  # type: ignore[attr-defined]
    finally:
        t.join()
        for cm in servers:
            cm.__exit__(None, None, None)


def test_always_502_ends_within_deadline_plus_one_attempt() -> None:
    """A server that always answers 502 ends the call within deadline + one attempt timeout."""
    policy = EndpointPolicy(retry=RetryPolicy(max_attempts=1000, base_s=0.02, cap_s=0.05), attempt_timeout_s=0.5, deadline_s=1.0)
    with scripted(Reply(502, b"")) as srv:
        s = resilient_session(table(GET__health=policy), breaker=None, retry_budget=None)
        t0 = time.monotonic()
        with pytest.raises(DeadlineExceeded) as info:
            s.get(f"{srv.url}/health")
        elapsed = time.monotonic() - t0
    assert elapsed < 1.0 + 0.5 + 0.5  # deadline + one attempt timeout + slack for a loaded machine
    assert info.value.last_status == 502


def test_retry_after_longer_than_deadline_stops_at_once() -> None:
    """A Retry-After past the remaining time raises DeadlineExceeded with the last status, no waiting."""
    with scripted(Reply(503, b"busy", {"Retry-After": "30"})) as srv:
        s = resilient_session(table(GET__x=EndpointPolicy(deadline_s=5, attempt_timeout_s=2)))
        t0 = time.monotonic()
        with pytest.raises(DeadlineExceeded) as info:
            s.get(f"{srv.url}/x")
        assert time.monotonic() - t0 < 2
        assert srv.count == 1
    assert info.value.last_status == 503
    assert isinstance(info.value, requests.Timeout)


def test_breaker_opens_fails_fast_half_opens_and_closes() -> None:
    """Consecutive failures open the breaker; open fails fast off the network; after the wait a success closes it."""
    clock = FakeClock()
    policy = EndpointPolicy(retry=RetryPolicy(max_attempts=1))
    with scripted(Reply(502, b""), Reply(502, b""), Reply(502, b""), Reply(200, b"ok")) as srv:
        s = resilient_session(table(GET__x=policy), breaker=BreakerConfig(failure_threshold=3, open_seconds=10), clock=clock)
        for _ in range(3):
            assert s.get(f"{srv.url}/x").status_code == 502
        with pytest.raises(CircuitOpen) as info:
            s.get(f"{srv.url}/x")
        assert srv.count == 3  # never touched the network
        assert isinstance(info.value, requests.ConnectionError)
        assert f"127.0.0.1:{srv.port}" in str(info.value)
        clock.advance(10)
        assert s.get(f"{srv.url}/x").text == "ok"
        assert s.get(f"{srv.url}/x").status_code == 200


def test_retry_budget_stops_retries_and_floor_allows_quiet_engine() -> None:
    """A spent budget stops retries; after a quiet second the floor allows one again."""
    clock = FakeClock()
    policy = EndpointPolicy(retry=RetryPolicy(max_attempts=10, base_s=0, cap_s=0), deadline_s=None)
    budget = RetryBudgetConfig(ratio=0.0, min_retries_per_second=1.0, max_tokens=2)
    with scripted(Reply(502, b"")) as srv:
        s = resilient_session(table(GET__x=policy), breaker=None, retry_budget=budget, clock=clock)
        with pytest.raises(RetryBudgetExhausted):
            s.get(f"{srv.url}/x")
        assert srv.count == 3  # first attempt + the two tokens
        clock.advance(1.0)
        with pytest.raises(RetryBudgetExhausted):
            s.get(f"{srv.url}/x")
        assert srv.count == 5  # one more retry from the floor


def test_errors_catchable_as_requests_exceptions_and_from_resilience() -> None:
    """Every error the adapter raises is the requests exception a plain-requests caller catches and the resilience class."""
    from resilience.adapters import requests_errors

    pairs = [
        (requests_errors.DeadlineExceeded, resilience.DeadlineExceeded, requests.Timeout),
        (requests_errors.CircuitOpen, resilience.CircuitOpen, requests.ConnectionError),
        (requests_errors.AmbiguousOutcome, resilience.AmbiguousOutcome, requests.RequestException),
        (requests_errors.RetryBudgetExhausted, RetryBudgetExhausted, requests.RequestException),
        (requests_errors.RetriesExhausted, resilience.RetriesExhausted, requests.exceptions.RetryError),
    ]
    for ours, core, native in pairs:
        assert issubclass(ours, core) and issubclass(ours, native), ours
        assert not issubclass(core, requests.RequestException), core  # the core belongs to no transport
    assert ResilientAdapter().retrier.error_types == requests_errors.ERROR_TYPES


def test_pickled_adapter_works() -> None:
    """The adapter survives pickling (Ray ships sessions) with its policies."""
    import pickle

    policy = EndpointPolicy(retry=FAST)
    adapter = pickle.loads(pickle.dumps(ResilientAdapter(table(GET__x=policy))))
    with scripted(Reply(502, b""), Reply(200, b"ok")) as srv:
        s = requests.Session()
        s.mount("http://", adapter)
        assert s.get(f"{srv.url}/x").text == "ok"


def test_flaky_gateway_absorbed_by_retries_never_opens_breaker() -> None:
    """The breaker judges calls, not attempts: a 502 that a retry absorbs does not count against a healthy engine."""
    policy = EndpointPolicy(retry=RetryPolicy(max_attempts=3, base_s=0, cap_s=0))
    with scripted(*[Reply(502, b""), Reply(200, b"ok")] * 10) as srv:
        s = resilient_session(table(GET__x=policy), breaker=BreakerConfig(failure_threshold=2, open_seconds=60))
        assert all(s.get(f"{srv.url}/x").text == "ok" for _ in range(10))
        assert srv.count == 20


def test_default_post_to_engine_up_in_0_6s_succeeds() -> None:
    """With the default policy (max_attempts=4), a POST to an engine that listens 0.6 s later succeeds: refusals are not counted."""
    port = free_port()
    servers = []

    def start_later() -> None:
        time.sleep(0.6)
        servers.append(scripted(Reply(200, b"up"), port=port))
        servers[0].__enter__()

    t = threading.Thread(target=start_later)
    t.start()
    try:
        r = resilient_session().post(f"http://127.0.0.1:{port}/release_memory_occupation", json={})
        assert r.text == "up"
        attempts = r.attempts  # type: ignore[attr-defined]
        assert attempts[0].delivery is Delivery.NOT_SENT and attempts[-1].status == 200
    finally:
        t.join()
        for cm in servers:
            cm.__exit__(None, None, None)


def test_pipe_body_gets_one_attempt_and_the_caller_its_502() -> None:
    """A body requests cannot rewind (a pipe: tell() fails) is sent once; the caller sees the 502, no rewind error."""
    read_fd, write_fd = os.pipe()
    os.write(write_fd, b"payload")
    os.close(write_fd)
    with scripted(Reply(502, b"bad gateway"), Reply(200)) as srv, os.fdopen(read_fd, "rb") as body:
        r = resilient_session(retry_budget=None).put(f"{srv.url}/weights", data=body)
        assert r.status_code == 502 and len(r.attempts) == 1  # type: ignore[attr-defined]
        assert srv.count == 1


def test_proxy_refusing_the_connection_is_not_sent() -> None:
    """A ProxyError wrapping a refused connection never left: retried (even for a non-idempotent POST) until the deadline."""
    policy = EndpointPolicy(
        idempotent=False, retry=RetryPolicy(max_attempts=2, base_s=0.02, cap_s=0.05), deadline_s=0.5, attempt_timeout_s=0.5
    )
    s = resilient_session(table(POST__release=policy), breaker=None, retry_budget=None)
    with socket.socket() as bound:  # bound, never listening: connections are refused, and nobody else can take the port
        bound.bind(("127.0.0.1", 0))
        proxy = f"http://127.0.0.1:{bound.getsockname()[1]}"
        with pytest.raises(requests.exceptions.ProxyError) as info:  # the deadline ends on a refusal: the refusal itself
            s.post("http://127.0.0.1:9/release", json={}, proxies={"http": proxy})
    attempts = info.value.attempts  # type: ignore[attr-defined]
    assert len(attempts) > 2 and {a.delivery for a in attempts} == {Delivery.NOT_SENT}
