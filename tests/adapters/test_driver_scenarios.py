"""One scenario table, four drivers: requests, httpx, httpx async and aiohttp behave alike on a real loopback server.

Each scenario runs against a ``ScriptedServer`` on 127.0.0.1 (``tests/servers.py``)
and checks what the caller sees (status, attempts, the error's class, both the
resilience class and the library's own) and what the server saw (how many
requests arrived). The drivers share the sans-IO core, so a difference here is
a driver bug.

Two families run on every driver too: the delivery record each error carries
(``resilience.outcome.attempts_of``: refused, connect timeout, TLS handshake
and certificate, full pool, read timeout, reset, statuses, breaker refusal),
and one ``DriverConfig`` shared by all four (and its conflicts with the old
keywords, for the drivers and both SGLang clients).
"""

from __future__ import annotations

import logging
import pickle
import random
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import aiohttp
import httpx
import pytest
import requests
import trustme
from pytest_httpserver import HTTPServer

import resilience
from resilience.adapters.driver_config import DriverConfig
from resilience.adapters.sglang import SGLANG_POLICIES, AsyncSGLangClient, SGLangClient
from resilience.breaker import BreakerConfig, BreakerState
from resilience.budget import RetryBudgetConfig
from resilience.clock import SYSTEM_CLOCK
from resilience.errors import ConfigConflict, ConfigError, ResilienceError, RetryBudgetExhausted
from resilience.events import AttemptStarted, EngineRefused, Event
from resilience.outcome import AttemptRecord, Delivery, attempts_of
from resilience.policy import EndpointPolicy, PolicyTable, RetryPolicy
from tests.adapters.drivers import DRIVERS, Driver
from tests.servers import Hang, Late, Reply, Reset, ScriptedServer, scripted, silent_listener

QUICK = RetryPolicy(max_attempts=4, base_s=0.01, cap_s=0.05)
BRIEF = RetryPolicy(base_s=0.05, cap_s=0.2)
SLOW = RetryPolicy(max_attempts=4, base_s=5, cap_s=5, jitter=0)
POLICIES = PolicyTable(
    {
        "GET /flaky": EndpointPolicy(retry=QUICK, deadline_s=20, attempt_timeout_s=5),
        "POST /update": EndpointPolicy(idempotent=False, retry=QUICK, deadline_s=10, attempt_timeout_s=0.3),
        "GET /busy": EndpointPolicy(retry=QUICK, deadline_s=1.0, attempt_timeout_s=1.0),
        "GET /gateway": EndpointPolicy(retry=RetryPolicy(max_attempts=1), deadline_s=5, attempt_timeout_s=5),
        "GET /slow-gateway": EndpointPolicy(retry=SLOW, deadline_s=60, attempt_timeout_s=5),
        "POST /unsent": EndpointPolicy(idempotent=False, retry=QUICK, deadline_s=1.0, attempt_timeout_s=0.3),
        "GET /strict": EndpointPolicy(retry=RetryPolicy(max_attempts=2, base_s=0.01, cap_s=0.01), raise_on_exhausted=True),
        "GET /hold": EndpointPolicy(retry=RetryPolicy(max_attempts=1), deadline_s=10, attempt_timeout_s=5),
        # as a new user writes them: one names no timeout, the other names a short one
        "POST /release": EndpointPolicy(idempotent=False),
        "POST /release-named": EndpointPolicy(idempotent=False, attempt_timeout_s=0.5),
        "GET /read-named": EndpointPolicy(attempt_timeout_s=3),
        # a 20 s deadline, but a call that never connects gives up after its window
        "GET /starting": EndpointPolicy(retry=replace(BRIEF, connect_window_s=5.0), deadline_s=20, attempt_timeout_s=5),
        "GET /dead": EndpointPolicy(retry=replace(BRIEF, connect_window_s=1.0), deadline_s=20, attempt_timeout_s=5),
    }
)
"""``POST /unsent`` is not idempotent, and re-sent only on the driver's proof that no attempt left."""
REFUSALS: dict[str, type[BaseException]] = {
    "requests": requests.exceptions.ConnectionError,
    "httpx": httpx.ConnectError,
    "httpx-async": httpx.ConnectError,
    "aiohttp": aiohttp.ClientConnectorError,
}
"""What each library raises for a refused connection: the call ends with exactly that."""


@pytest.fixture(params=DRIVERS)
def driver_name(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def driver(driver_name: str) -> Iterator[Driver]:
    d = Driver(driver_name, POLICIES)
    yield d
    d.close()


def test_a_run_of_502s_is_absorbed(driver: Driver) -> None:
    with scripted(Reply(502), Reply(502), Reply(200)) as server:
        answer = driver.call("GET", f"{server.url}/flaky")
        assert answer.status == 200 and [a.status for a in answer.attempts] == [502, 502, 200]
        assert server.count == 3


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _up_later(port: int, after_s: float, servers: list[ScriptedServer]) -> threading.Thread:
    def come_up() -> None:
        time.sleep(after_s)
        servers.append(ScriptedServer([Reply(200)], port=port).start())

    starter = threading.Thread(target=come_up)
    starter.start()
    return starter


def test_refused_then_up_within_the_connect_window(driver: Driver) -> None:
    """Connections refused until the server comes up 0.4 s later, inside the 5 s window: the call succeeds, refusals not sent."""
    port = _closed_port()
    servers: list[ScriptedServer] = []
    starter = _up_later(port, 0.4, servers)
    try:
        answer = driver.call("GET", f"http://127.0.0.1:{port}/starting")
    finally:
        starter.join()
        for s in servers:
            s.stop()
    assert answer.status == 200
    assert answer.attempts[0].delivery is Delivery.NOT_SENT and answer.attempts[-1].status == 200
    assert len(answer.attempts) >= 2


def test_a_dead_port_fails_with_the_refusal_after_the_window(driver: Driver, refusing_port: int, caplog: pytest.LogCaptureFixture) -> None:
    """Nothing listens: the library's own connection error after the 1 s window (of a 20 s deadline), with every attempt not sent.

    The first refusal is logged once at WARNING, naming the engine and how long the call keeps trying.
    """
    engine = f"http://127.0.0.1:{refusing_port}"
    with caplog.at_level(logging.WARNING, logger="resilience.retry"), pytest.raises(REFUSALS[driver.name]) as info:
        driver.call("GET", f"{engine}/dead")
    assert not isinstance(info.value, ResilienceError)  # the refusal itself, not a deadline or a breaker error
    attempts = info.value.attempts  # type: ignore[attr-defined]
    assert len(attempts) >= 2 and all(a.delivery is Delivery.NOT_SENT for a in attempts)
    assert attempts[-1].delay_s is None and sum(a.delay_s or 0 for a in attempts) < 1.0  # no attempt was started past the window
    warnings = [r.getMessage() for r in caplog.records if r.name == "resilience.retry"]
    assert len(warnings) == 1 and warnings[0].startswith(f"{engine} refused GET /dead (")
    assert "retrying for up to 1.0 s" in warnings[0]


def test_after_a_whole_window_refused_the_next_call_fails_fast_until_a_half_open_attempt_connects(driver_name: str) -> None:
    """One call refused for its window opens the breaker: the next gets CircuitOpen unsent; once up, the half-open call closes it."""
    seen: list[Event] = []
    driver = Driver(driver_name, POLICIES, breaker=BreakerConfig(open_seconds=0.5), observers=[seen.append])
    port = _closed_port()
    url = f"http://127.0.0.1:{port}/dead"
    servers: list[ScriptedServer] = []
    try:
        with pytest.raises(REFUSALS[driver_name]):
            driver.call("GET", url)
        with pytest.raises(resilience.CircuitOpen) as info:
            driver.call("GET", url)
        assert isinstance(info.value, driver.native)
        assert [(a.delivery, a.error_type) for a in info.value.attempts] == [(Delivery.NOT_SENT, "CircuitOpen")]  # nothing was sent
        assert [e.engine for e in seen if isinstance(e, EngineRefused)] == [f"http://127.0.0.1:{port}"]  # one per refused call
        servers.append(ScriptedServer([Reply(200)], port=port).start())
        breaker = driver.breakers.by_engine[f"http://127.0.0.1:{port}"]
        for _ in range(200):  # the 0.5 s open wait, polled
            if breaker.state is BreakerState.HALF_OPEN:
                break
            time.sleep(0.02)
        assert driver.call("GET", url).status == 200
        assert breaker.state is BreakerState.CLOSED
    finally:
        driver.close()
        for s in servers:
            s.stop()


def test_read_timeout_after_sending_a_non_idempotent_post_is_sent_once(driver: Driver) -> None:
    """The POST may have been applied: never re-sent, and the caller gets AmbiguousOutcome, also the library's own error."""
    with scripted(Hang(3.0)) as server:
        with pytest.raises(resilience.AmbiguousOutcome) as info:
            driver.call("POST", f"{server.url}/update", json={"weights": 1})
        assert server.count == 1
    assert isinstance(info.value, driver.native)
    assert len(info.value.attempts) == 1 and info.value.attempts[0].delivery is Delivery.AMBIGUOUS


def test_retry_after_past_the_deadline_ends_the_call_at_once(driver: Driver) -> None:
    """503 with Retry-After: 30 under a 1 s deadline: no 30 s wait, DeadlineExceeded (a timeout in the library's terms)."""
    with scripted(Reply(503, headers={"Retry-After": "30"})) as server:
        with pytest.raises(resilience.DeadlineExceeded) as info:
            driver.call("GET", f"{server.url}/busy")
        assert server.count == 1
    assert isinstance(info.value, driver.native)
    # decided at once from the 30 s wait it would need (a loop that slept first would fail "before attempt")
    assert "next wait 30.000s" in str(info.value) and info.value.attempts[0].delay_s is None


def test_breaker_opens_on_a_dead_engine_and_refuses_without_sending(driver_name: str) -> None:
    driver = Driver(driver_name, POLICIES, breaker=BreakerConfig(failure_threshold=2, minimum_calls=2, window_size=2, open_seconds=60))
    try:
        with scripted(Reply(502)) as server:
            for _ in range(2):
                assert driver.call("GET", f"{server.url}/gateway").status == 502  # exhausted: the last response, as plain clients
            with pytest.raises(resilience.CircuitOpen) as info:
                driver.call("GET", f"{server.url}/gateway")
            assert server.count == 2
        assert isinstance(info.value, driver.native)
    finally:
        driver.close()


def test_retry_budget_stops_a_retry_storm(driver_name: str) -> None:
    driver = Driver(driver_name, POLICIES, retry_budget=RetryBudgetConfig(ratio=0, min_retries_per_second=0, max_tokens=1))
    try:
        with scripted(Reply(502)) as server:
            with pytest.raises(RetryBudgetExhausted) as info:
                driver.call("GET", f"{server.url}/flaky")
            assert server.count == 2  # the first attempt and the one retry the budget allowed
        assert isinstance(info.value, driver.native)
        assert [a.status for a in info.value.attempts] == [502, 502]
    finally:
        driver.close()


def test_a_callers_timeout_is_honoured_on_a_default_policy_call(driver: Driver) -> None:
    """A request no entry matches, with the caller's 0.3 s timeout: not overruled by the default 10 s attempt timeout."""
    with scripted(Hang(5.0)) as server:
        with pytest.raises(driver.native) as info:
            driver.call("GET", f"{server.url}/unlisted", timeout=0.3)
    # every attempt ended on the caller's read timeout; under a 10 s attempt timeout the server's close after 5 s would end it
    kinds = [a.error_type or "" for a in info.value.attempts]  # type: ignore[attr-defined]
    assert kinds and all("Timeout" in kind for kind in kinds), kinds


def test_an_entry_that_names_no_timeout_keeps_the_callers_short_one(driver: Driver) -> None:
    """``EndpointPolicy(idempotent=False)``, the caller's 0.5 s, an answer after 2 s: AmbiguousOutcome, sent once, not a 200.

    The entry's default 10 s attempt timeout is not its author's word, so the caller's timeout bounds the attempt.
    """
    with scripted(Late(2.0)) as server:
        with pytest.raises(resilience.AmbiguousOutcome) as info:
            driver.call("POST", f"{server.url}/release", json={}, timeout=0.5)
        assert server.count == 1
    assert isinstance(info.value, driver.native)
    [attempt] = info.value.attempts
    assert attempt.delivery is Delivery.AMBIGUOUS and "Timeout" in (attempt.error_type or "")


def test_an_entry_that_names_its_timeout_wins_over_the_callers_longer_one(driver: Driver) -> None:
    """``attempt_timeout_s=0.5`` named by the entry, the caller's 5 s, an answer after 2 s: the entry's limit ends the attempt."""
    with scripted(Late(2.0)) as server:
        with pytest.raises(resilience.AmbiguousOutcome) as info:
            driver.call("POST", f"{server.url}/release-named", json={}, timeout=5)
        assert server.count == 1
    assert isinstance(info.value, driver.native)
    assert [a.delivery for a in info.value.attempts] == [Delivery.AMBIGUOUS]


@pytest.mark.parametrize(
    ("method", "path", "caller_s", "attempt_s"),
    [
        ("POST", "/release", 60.0, 60.0),  # the caller's 60 s on a slow release is no longer cut to the unnamed 10 s
        ("GET", "/read-named", 60.0, 3.0),  # a named 3 s still wins over it
    ],
)
def test_the_attempt_gets_the_timeout_the_rule_chose(driver_name: str, method: str, path: str, caller_s: float, attempt_s: float) -> None:
    """Each attempt's read timeout (``AttemptStarted.timeout_s``): the caller's over an unnamed entry, a named entry's over the caller's."""
    seen: list[Event] = []
    driver = Driver(driver_name, POLICIES, observers=[seen.append])
    try:
        with scripted(Reply(200)) as server:
            assert driver.call(method, f"{server.url}{path}", json={} if method == "POST" else None, timeout=caller_s).status == 200
    finally:
        driver.close()
    assert [e.timeout_s for e in seen if isinstance(e, AttemptStarted)] == [pytest.approx(attempt_s)]


@pytest.mark.parametrize("driver_name", ["httpx-async", "aiohttp"])
def test_cancelling_the_calling_task_in_a_backoff_sends_nothing_more_and_frees_the_slot(driver_name: str) -> None:
    """The half-open probe call is cancelled during its 5 s backoff: one request only, the breaker's probe slot is free."""
    driver = Driver(driver_name, POLICIES, breaker=BreakerConfig(failure_threshold=1, minimum_calls=1, window_size=1, open_seconds=0))
    try:
        with scripted(Reply(502)) as server:
            breaker = driver.breakers.by_engine[f"http://127.0.0.1:{server.port}"]
            breaker.record_failure()
            assert breaker.state is BreakerState.HALF_OPEN
            future = driver.start("GET", f"{server.url}/slow-gateway")
            for _ in range(200):
                if server.count:
                    break
                time.sleep(0.02)
            time.sleep(0.2)
            future.cancel()
            time.sleep(0.3)
            assert server.count == 1
            assert breaker.state is BreakerState.HALF_OPEN and breaker.admit() is not None
    finally:
        driver.close()


# -- the delivery record of every error (issue 19): what ``attempts_of`` reads, per driver -------------------------


def _record(error: BaseException) -> tuple[AttemptRecord, ...]:
    """``attempts_of(error)``, which a driver's error must always have: a non-empty record."""
    records = attempts_of(error)
    assert records, f"{type(error).__qualname__} carries no delivery record: {error!r}"
    return records


def test_a_refusal_until_the_deadline_is_recorded_as_never_sent(driver: Driver) -> None:
    """Nothing listens: the caller gets the library's own connection error, every attempt recorded NOT_SENT."""
    with pytest.raises(driver.native) as info:
        driver.call("POST", f"http://127.0.0.1:{_closed_port()}/unsent", json={"n": 1})
    records = _record(info.value)
    assert len(records) >= 2 and all(r.delivery is Delivery.NOT_SENT and r.status is None for r in records), records


def test_a_connect_timeout_is_recorded_as_never_sent_and_a_non_idempotent_call_is_resent(driver: Driver) -> None:
    """A listener whose backlog is full drops the SYN: connect timeouts, NOT_SENT, so even a POST is sent again."""
    with silent_listener(full=True) as port:
        with pytest.raises(driver.native) as info:
            driver.call("POST", f"http://127.0.0.1:{port}/unsent", json={"n": 1})
    records = _record(info.value)
    assert len(records) >= 2 and all(r.delivery is Delivery.NOT_SENT for r in records), records
    assert not isinstance(info.value, resilience.AmbiguousOutcome)


def test_a_tls_handshake_that_times_out_is_recorded_as_never_sent(driver: Driver) -> None:
    """TCP connects but the TLS handshake never completes: not sent (requests' urllib3 calls it a read timeout)."""
    with silent_listener(full=False) as port:
        with pytest.raises(driver.native) as info:
            driver.call("POST", f"https://127.0.0.1:{port}/unsent", json={"n": 1})
    records = _record(info.value)
    assert len(records) >= 2 and all(r.delivery is Delivery.NOT_SENT for r in records), records
    assert not isinstance(info.value, resilience.AmbiguousOutcome)


@pytest.fixture(scope="module")
def untrusted_tls() -> Iterator[HTTPServer]:
    """An HTTPS server on 127.0.0.1 whose certificate comes from a CA no client trusts."""
    ca = trustme.CA()
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(context)
    server = HTTPServer(host="127.0.0.1", port=0, ssl_context=context)
    server.start()
    try:
        yield server
    finally:
        server.clear()
        server.stop()


def test_a_tls_certificate_refused_is_raised_at_once_and_recorded_as_never_sent(driver: Driver, untrusted_tls: HTTPServer) -> None:
    """A certificate that fails verification: the library's own error at once (never retried), one attempt, NOT_SENT."""
    untrusted_tls.expect_request("/unsent").respond_with_data("never")
    with pytest.raises(driver.native) as info:
        driver.call("POST", untrusted_tls.url_for("/unsent"), json={"n": 1})
    assert len(untrusted_tls.log) == 0
    records = _record(info.value)
    assert [r.delivery for r in records] == [Delivery.NOT_SENT], records


def test_a_read_timeout_after_sending_is_recorded_as_ambiguous(driver: Driver) -> None:
    """The server read the POST and never answered: AmbiguousOutcome, one attempt, AMBIGUOUS."""
    with scripted(Hang(3.0)) as server:
        with pytest.raises(resilience.AmbiguousOutcome) as info:
            driver.call("POST", f"{server.url}/update", json={"n": 1})
        assert server.count == 1
    assert [r.delivery for r in _record(info.value)] == [Delivery.AMBIGUOUS]


def test_a_reset_after_sending_is_recorded_as_ambiguous(driver: Driver) -> None:
    """The server read the POST and reset the connection: never re-sent, one attempt, AMBIGUOUS."""
    with scripted(Reset()) as server:
        with pytest.raises(driver.native) as info:
            driver.call("POST", f"{server.url}/update", json={"n": 1})
        assert server.count == 1
    records = _record(info.value)
    assert [r.delivery for r in records] == [Delivery.AMBIGUOUS], records


def test_statuses_are_recorded_as_responded_with_the_status(driver: Driver) -> None:
    """Every attempt answered 503: RetriesExhausted, each attempt RESPONDED with its status."""
    with scripted(Reply(503)) as server:
        with pytest.raises(resilience.RetriesExhausted) as info:
            driver.call("GET", f"{server.url}/strict")
        assert server.count == 2
    assert isinstance(info.value, driver.native)
    assert [(r.delivery, r.status) for r in _record(info.value)] == [(Delivery.RESPONDED, 503)] * 2


def test_a_breaker_refusal_is_recorded_as_never_sent(driver_name: str) -> None:
    """An open breaker refuses before any attempt: CircuitOpen still carries a record, one NOT_SENT attempt."""
    driver = Driver(driver_name, POLICIES, breaker=BreakerConfig(failure_threshold=1, minimum_calls=1, window_size=1, open_seconds=60))
    try:
        with scripted(Reply(200)) as server:
            driver.breakers.by_engine[f"http://127.0.0.1:{server.port}"].record_failure()
            with pytest.raises(resilience.CircuitOpen) as info:
                driver.call("POST", f"{server.url}/update", json={"n": 1})
            assert server.count == 0
        records = _record(info.value)
        assert [(r.delivery, r.status, r.error_type) for r in records] == [(Delivery.NOT_SENT, None, type(info.value).__qualname__)]
    finally:
        driver.close()


@pytest.mark.parametrize("driver_name", ["httpx", "httpx-async", "aiohttp"])
def test_a_full_local_pool_is_recorded_as_never_sent(driver_name: str) -> None:
    """One connection allowed and held by a hanging call: the next call waits for the pool, then fails NOT_SENT.

    Not for requests: it hands urllib3 no pool timeout, so a full pool (``pool_block=True``) waits for a
    connection as long as it takes and never fails (``resilience.adapters.requests``' docstring). The control
    lane is off: a route the table names would otherwise take connections of its own (``test_control_lane.py``).
    """
    driver = Driver(driver_name, config=DriverConfig(policies=POLICIES, control_lane=None), pool=1)
    try:
        with scripted(Hang(2.0)) as server, ThreadPoolExecutor(max_workers=1) as pool:
            holder = pool.submit(driver.call, "GET", f"{server.url}/hold")
            for _ in range(250):
                if server.count:
                    break
                time.sleep(0.02)
            assert server.count == 1
            with pytest.raises(driver.native) as info:
                driver.call("POST", f"{server.url}/unsent", json={"n": 1})
            assert server.count == 1  # the POST never reached the server
            with pytest.raises(driver.native):
                holder.result(timeout=30)  # the held call ends when the server gives up on it
        records = _record(info.value)
        assert len(records) >= 2 and all(r.delivery is Delivery.NOT_SENT for r in records), records
    finally:
        driver.close()


def test_an_error_pickles_with_its_record(driver_name: str) -> None:
    """The loop's own error keeps its record through pickling (errors travel pickled: Ray, multiprocessing)."""
    driver = Driver(driver_name, POLICIES, retry_budget=RetryBudgetConfig(ratio=0, min_retries_per_second=0, max_tokens=1))
    try:
        with scripted(Reply(502)) as server:
            with pytest.raises(RetryBudgetExhausted) as info:
                driver.call("GET", f"{server.url}/flaky")
    finally:
        driver.close()
    error = info.value
    for attr in ("request", "response", "last_error"):  # the library's live objects (an aiohttp request holds a loop)
        setattr(error, attr, None)
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is type(error) and str(copy) == str(error)
    assert attempts_of(copy) == attempts_of(error) and [r.status for r in _record(copy)] == [502, 502]


# -- one driver configuration (issue 20 §2) ------------------------------------------------------------------------


def test_one_config_shares_each_engines_breaker_across_every_driver(driver_name: str) -> None:
    """Four drivers of four libraries built from one DriverConfig: a breaker opened through one refuses on all."""
    config = DriverConfig(policies=POLICIES, breaker=BreakerConfig(failure_threshold=2, minimum_calls=2, window_size=2, open_seconds=60))
    drivers = {name: Driver(name, config=config) for name in DRIVERS}
    try:
        with scripted(Reply(502)) as server:
            for _ in range(2):
                assert drivers[driver_name].call("GET", f"{server.url}/gateway").status == 502
            for name, other in drivers.items():
                with pytest.raises(resilience.CircuitOpen) as info:
                    other.call("GET", f"{server.url}/gateway")
                assert isinstance(info.value, other.native), name
            assert server.count == 2
        assert all(d.layer.driver_config is config and d.layer.retrier.breakers is config.breakers for d in drivers.values())
    finally:
        for d in drivers.values():
            d.close()


def _layer(name: str, **kwargs: object) -> object:
    """The resilience object of driver ``name``, built with ``kwargs`` (no client, no loop needed)."""
    if name == "requests":
        from resilience.adapters.requests import ResilientAdapter

        return ResilientAdapter(**kwargs)  # type: ignore[arg-type]
    if name in ("httpx", "httpx-async"):
        from resilience.adapters.httpx import AsyncResilientTransport, ResilientTransport

        return (ResilientTransport if name == "httpx" else AsyncResilientTransport)(**kwargs)  # type: ignore[arg-type]
    from resilience.adapters.aiohttp import ResilientMiddleware

    return ResilientMiddleware(**kwargs)  # type: ignore[arg-type]


def test_config_and_its_parts_together_are_refused_naming_them(driver_name: str) -> None:
    """config= with any keyword it holds raises ConfigConflict (a ConfigError and a TypeError) naming each."""
    config = DriverConfig(policies=POLICIES)
    with pytest.raises(ConfigConflict, match=r"got config= and breaker=, rng=: the DriverConfig already holds those") as info:
        _layer(driver_name, config=config, breaker=None, rng=lambda: 0.5)
    assert isinstance(info.value, ConfigError) and isinstance(info.value, TypeError)
    with pytest.raises(ConfigConflict, match=r"got config= and policies=: the DriverConfig already holds that"):
        _layer(driver_name, config=config, policies=POLICIES)
    with pytest.raises(ConfigError, match=r"config must be a DriverConfig"):
        _layer(driver_name, config=object())


def test_keywords_alone_build_a_config_of_their_own(driver_name: str) -> None:
    """The old keywords still work: each layer then has its own config and its own per-engine state."""
    first, second = _layer(driver_name, policies=POLICIES, breaker=None), _layer(driver_name, policies=POLICIES)
    assert first.driver_config.policies is POLICIES and first.driver_config.breakers is None  # type: ignore[attr-defined]
    assert second.driver_config.breakers is not None and second.driver_config is not first.driver_config  # type: ignore[attr-defined]


def test_a_pickled_config_keeps_its_settings_with_fresh_state() -> None:
    """Pickled (Ray ships sessions), a config arrives with the same settings and breakers of its own."""
    breaker = BreakerConfig(failure_threshold=3, minimum_calls=3, window_size=3)
    config = DriverConfig(policies=POLICIES, breaker=breaker, retry_budget=None)
    config.breakers.by_engine["http://127.0.0.1:1"].record_failure()  # type: ignore[union-attr]
    copy = pickle.loads(pickle.dumps(config))
    assert copy.breaker_config == breaker and copy.budgets is None and copy.policies.match("GET", "/flaky").explicit
    assert copy.breakers is not config.breakers and copy.breakers.states() == {}
    # the default random source is this process's own (a pickled one would replay the same jitter in every copy)
    assert copy.rng is random.random and copy.clock is SYSTEM_CLOCK


@pytest.mark.parametrize("client", ["sync", "async"])
def test_sglang_clients_refuse_a_session_with_settings_of_their_own_session(client: str) -> None:
    """Both SGLang clients refuse session= with policies= (or config=, or a driver knob), the same way, naming them."""
    url = "http://127.0.0.1:30000"
    session: object = requests.Session() if client == "sync" else httpx.AsyncClient()
    cls = SGLangClient if client == "sync" else AsyncSGLangClient
    try:
        with pytest.raises(ConfigConflict, match=rf"{cls.__name__} got session= and policies=: those configure only"):
            cls(url, session=session, policies=SGLANG_POLICIES)  # type: ignore[arg-type]
        with pytest.raises(ConfigConflict, match=r"got session= and config=, breaker=:"):
            cls(url, session=session, config=DriverConfig(), breaker=None)  # type: ignore[arg-type]
        with pytest.raises(ConfigConflict, match=rf"{cls.__name__} got config= and observers=: the DriverConfig already holds that"):
            cls(url, config=DriverConfig(policies=SGLANG_POLICIES), observers=[print])
        with pytest.raises(ConfigConflict, match=r"got config= and retry_budget=:"):
            cls(url, config=DriverConfig(policies=SGLANG_POLICIES), retry_budget=None)
    finally:
        if isinstance(session, requests.Session):
            session.close()


def test_sglang_clients_built_from_one_config_share_it() -> None:
    """A DriverConfig handed to both SGLang clients and a mounted session: one set of per-engine breakers."""
    from resilience.adapters.sglang import mount_sglang

    config = DriverConfig(policies=SGLANG_POLICIES)
    sync = SGLangClient("http://127.0.0.1:30000", config=config)
    asynchronous = AsyncSGLangClient("http://127.0.0.1:30000", config=config)
    session = requests.Session()
    try:
        mounted = mount_sglang(session, ["http://127.0.0.1:30001"], config=config)
        adapter = sync.session.get_adapter("http://127.0.0.1:30000/")
        assert adapter.driver_config is config and mounted.driver_config is config  # type: ignore[attr-defined]
        assert asynchronous._own.middleware.driver_config is config
        with pytest.raises(ConfigConflict, match=r"mount_sglang got config= and policies="):
            mount_sglang(session, ["http://127.0.0.1:30001"], config=config, policies=SGLANG_POLICIES)
    finally:
        sync.close()
        session.close()
