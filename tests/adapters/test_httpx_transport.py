"""ResilientTransport and AsyncResilientTransport against real loopback servers.

Every scenario runs on both drivers (``drive`` is parametrized sync/async):
the sync client is called from the test's event loop, which nothing else uses.
"""

from __future__ import annotations

import asyncio
import ssl
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import pytest_asyncio
import trustme
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pytest_httpserver import HTTPServer

import resilience
import resilience.errors
from resilience import BreakerConfig, EndpointPolicy, PolicyTable, RetryBudgetConfig, RetryPolicy
from resilience.adapters.httpx import AsyncResilientTransport, ResilientTransport, transport_failure
from resilience.adapters.httpx_errors import AmbiguousOutcome, CircuitOpen, DeadlineExceeded, RetriesExhausted, RetryBudgetExhausted
from resilience.adapters.routing import engine_of
from resilience.breaker import BreakerState
from resilience.events import AttemptStarted, Event, RetryScheduled
from resilience.outcome import Delivery
from resilience.policy import ProbeAnswer, ProbeContext
from resilience.testing.clock import FakeClock
from tests.conftest import LONG_TIMEOUT, SHORT_TIMEOUT, free_port
from tests.servers import Hang, Reply, Reset, ScriptedServer, scripted

FAST = RetryPolicy(max_attempts=4, base_s=0.01, cap_s=0.05)
ZERO = RetryPolicy(max_attempts=4, base_s=0, cap_s=0)


def table(**entries: EndpointPolicy) -> PolicyTable:
    return PolicyTable({k.replace("__", " /"): v for k, v in entries.items()})


class Recorder:
    """An observer keeping every event; it also puts a carrier header on each attempt."""

    def __init__(self) -> None:
        self.events: list[Event] = []

    def __call__(self, event: Event) -> None:
        self.events.append(event)
        if isinstance(event, AttemptStarted):
            event.carrier["x-carrier"] = f"attempt-{event.attempt}"

    def of(self, kind: type[Any]) -> list[Any]:
        return [e for e in self.events if isinstance(e, kind)]


async def eventually(condition: Callable[[], bool], limit_s: float = LONG_TIMEOUT) -> None:
    """Poll ``condition`` on the loop until it holds; fail after ``limit_s`` (a bound a healthy run never reaches)."""
    for _ in range(int(limit_s / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition never held")


class SeenTransport(httpx.HTTPTransport):
    """A real HTTPTransport that keeps the timeout extension of every request it sends."""

    def __init__(self) -> None:
        super().__init__()
        self.timeouts: list[dict[str, float | None]] = []
        self.closed = False

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self.timeouts.append(dict(request.extensions["timeout"]))
        return super().handle_request(request)

    def close(self) -> None:
        self.closed = True
        super().close()


class AsyncSeenTransport(httpx.AsyncHTTPTransport):
    """``SeenTransport`` for the async driver."""

    def __init__(self) -> None:
        super().__init__()
        self.timeouts: list[dict[str, float | None]] = []
        self.closed = False

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.timeouts.append(dict(request.extensions["timeout"]))
        return await super().handle_async_request(request)

    async def aclose(self) -> None:
        self.closed = True
        await super().aclose()


@dataclass
class Caller:
    """One client over a resilient transport, sync or async, behind one awaitable ``request``."""

    kind: str
    transport: ResilientTransport | AsyncResilientTransport
    client: httpx.Client | httpx.AsyncClient

    async def request(self, method: str, url: str, *, chunks: Sequence[bytes] | None = None, **kwargs: Any) -> httpx.Response:
        """Send a request; ``chunks`` becomes a streaming (non-replayable) body of the driver's kind."""
        if isinstance(self.client, httpx.Client):
            if chunks is not None:
                kwargs["content"] = iter(chunks)
            return self.client.request(method, url, **kwargs)
        if chunks is not None:

            async def body() -> AsyncIterator[bytes]:
                for chunk in chunks:
                    yield chunk

            kwargs["content"] = body()
        return await self.client.request(method, url, **kwargs)

    def breaker(self, url: str) -> Any:
        engine = engine_of(url)[0]
        assert self.transport.retrier.breakers is not None
        return self.transport.retrier.breakers.by_engine[engine]


@dataclass
class Drive:
    """Builds ``Caller``s of one kind and closes them all at the end of the test."""

    kind: str
    made: list[Caller] = field(default_factory=list)

    def __call__(self, policies: PolicyTable | None = None, *, inner: Any = None, **kwargs: Any) -> Caller:
        caller: Caller
        if self.kind == "sync":
            sync = ResilientTransport(policies, transport=inner, **kwargs)
            caller = Caller("sync", sync, httpx.Client(transport=sync))
        else:
            asynchronous = AsyncResilientTransport(policies, transport=inner, **kwargs)
            caller = Caller("async", asynchronous, httpx.AsyncClient(transport=asynchronous))
        self.made.append(caller)
        return caller

    def seen_transport(self) -> SeenTransport | AsyncSeenTransport:
        return SeenTransport() if self.kind == "sync" else AsyncSeenTransport()

    async def close(self) -> None:
        for caller in self.made:
            if isinstance(caller.client, httpx.Client):
                caller.client.close()
            else:
                await caller.client.aclose()


@pytest_asyncio.fixture(params=["sync", "async"])
async def drive(request: pytest.FixtureRequest) -> AsyncIterator[Drive]:
    d = Drive(request.param)
    try:
        yield d
    finally:
        await d.close()


@pytest.fixture
def later_server() -> Iterator[Any]:
    """``start(port, delay)``: a scripted server that starts listening on ``port`` after ``delay`` seconds; always stopped."""
    servers: list[ScriptedServer] = []
    threads: list[threading.Thread] = []

    def start(port: int, delay: float, *script: Any) -> None:
        def run() -> None:
            time.sleep(delay)
            servers.append(ScriptedServer(script, port=port).start())

        thread = threading.Thread(target=run)
        thread.start()
        threads.append(thread)

    yield start
    for thread in threads:
        thread.join()
    for server in servers:
        server.stop()


# -- the scenarios, on both drivers ------------------------------------------


@pytest.mark.asyncio
async def test_502_502_200_is_one_call_three_attempts(drive: Drive, httpserver: HTTPServer) -> None:
    """Two 502s are absorbed: the caller sees one 200, the attempts on the response, a carrier header on every attempt."""
    for code in (502, 502, 200):
        httpserver.expect_ordered_request("/pause_generation", method="POST").respond_with_data("ok" if code == 200 else "", status=code)
    seen = Recorder()
    caller = drive(table(POST__pause_generation=EndpointPolicy(retry=FAST)), observers=[seen])
    r = await caller.request("POST", httpserver.url_for("/pause_generation"), json={})
    assert r.status_code == 200 and r.text == "ok"
    attempts = r.extensions["attempts"]
    assert [a.status for a in attempts] == [502, 502, 200]
    assert r.extensions["endpoint"] == "POST /pause_generation"
    delays = [e.delay_s for e in seen.of(RetryScheduled)]
    assert len(delays) == 2 and all(0 <= d <= 0.05 for d in delays)
    assert [req.headers.get("x-carrier") for req, _ in httpserver.log] == ["attempt-0", "attempt-1", "attempt-2"]
    assert "x-carrier" not in r.request.headers  # each attempt's carrier went on a copy: the caller's request keeps its own headers
    httpserver.check_assertions()


@pytest.mark.asyncio
async def test_refused_then_up_succeeds_for_a_post(drive: Drive, later_server: Any) -> None:
    """Refusals never reached the server: a default-policy POST to an engine that listens 0.4 s later succeeds."""
    port = free_port()
    later_server(port, 0.4, Reply(200, b"up"))
    caller = drive(breaker=None)
    r = await caller.request("POST", f"http://127.0.0.1:{port}/release_memory_occupation", json={})
    assert r.text == "up"
    attempts = r.extensions["attempts"]
    assert len(attempts) >= 2 and attempts[0].delivery is Delivery.NOT_SENT and attempts[0].error_type == "ConnectError"
    assert attempts[-1].status == 200


@pytest.mark.asyncio
async def test_refused_past_the_deadline_raises_the_connect_error_itself(drive: Drive, refusing_port: int) -> None:
    """When the deadline ends the retries on a refusal, the caller gets httpx's own ConnectError, with the attempts."""
    # Only the 10 s waits move the fake clock: the 35 s deadline passes between refusals, never mid-connect, however long
    # a refusal takes on a busy machine (each connect's timeout is at least 5 s: LONG_TIMEOUT, or what is left at the last).
    retry = RetryPolicy(max_attempts=2, connect_window_s=None, base_s=10, cap_s=10, jitter=0)
    policy = EndpointPolicy(idempotent=False, retry=retry, attempt_timeout_s=LONG_TIMEOUT, deadline_s=35)
    caller = drive(table(POST__release=policy), breaker=None, retry_budget=None, clock=FakeClock())
    with pytest.raises(httpx.ConnectError) as info:
        await caller.request("POST", f"http://127.0.0.1:{refusing_port}/release", json={})
    assert not isinstance(info.value, resilience.ResilienceError)
    attempts = info.value.attempts  # type: ignore[attr-defined]
    assert len(attempts) > 2 and {a.delivery for a in attempts} == {Delivery.NOT_SENT}
    assert len(attempts) == 4  # refused at 0, 10, 20 and 30 s: the next wait would pass the deadline


@pytest.mark.asyncio
async def test_read_timeout_on_non_idempotent_post_is_sent_once_and_ambiguous(drive: Drive) -> None:
    """A POST whose answer never comes is not re-sent: one request reaches the server, AmbiguousOutcome is an httpx error."""
    policy = EndpointPolicy(idempotent=False, retry=FAST, attempt_timeout_s=SHORT_TIMEOUT, deadline_s=5)
    with scripted(Hang(5), Reply(200)) as srv:
        caller = drive(table(POST__release_memory_occupation=policy))
        url = f"{srv.url}/release_memory_occupation"
        with pytest.raises(httpx.TransportError) as info:
            await caller.request("POST", url, json={"tags": None})
        assert srv.count == 1
    err = info.value
    assert isinstance(err, AmbiguousOutcome) and isinstance(err, resilience.AmbiguousOutcome)
    assert err.endpoint == "POST /release_memory_occupation" and len(err.attempts) == 1
    assert err.attempts[0].error_type == "ReadTimeout" and isinstance(err.last_error, httpx.ReadTimeout)
    assert str(err.request.url) == url


@pytest.mark.asyncio
async def test_default_post_read_timeout_is_httpx_own_error_sent_once(drive: Drive) -> None:
    """A POST no entry matches gets httpx's own ReadTimeout when its answer is lost, as plain httpx would; never re-sent."""
    with scripted(Hang(5), Reply(200)) as srv:
        caller = drive()
        with pytest.raises(httpx.ReadTimeout) as info:
            await caller.request("POST", f"{srv.url}/generate", json={}, timeout=SHORT_TIMEOUT)
        assert srv.count == 1
    assert len(info.value.attempts) == 1  # type: ignore[attr-defined]


@pytest.mark.asyncio
async def test_reset_after_send_is_ambiguous_and_idempotent_one_retried(drive: Drive) -> None:
    """A connection reset after sending: a non-idempotent POST raises AmbiguousOutcome, an idempotent one is retried."""
    with scripted(Reset(), Reply(200, b"again")) as srv:
        caller = drive(table(POST__x=EndpointPolicy(idempotent=False, retry=FAST), POST__y=EndpointPolicy(retry=FAST)))
        with pytest.raises(AmbiguousOutcome) as info:
            await caller.request("POST", f"{srv.url}/x", json={})
        assert srv.count == 1
        assert info.value.attempts[0].delivery is Delivery.AMBIGUOUS
    with scripted(Reset(), Reply(200, b"again")) as srv:
        r = await caller.request("POST", f"{srv.url}/y", json={})
        assert r.text == "again" and srv.count == 2


@pytest.mark.asyncio
async def test_probe_confirmed_ambiguous_call_returns_200(drive: Drive) -> None:
    """A probe that says "applied" turns the lost answer into a 200 built for the request; nothing re-sent."""
    asked: list[ProbeContext] = []

    def probe(ctx: ProbeContext) -> ProbeAnswer:
        asked.append(ctx)
        return ProbeAnswer.DONE

    policy = EndpointPolicy(idempotent=False, retry=FAST, attempt_timeout_s=SHORT_TIMEOUT, deadline_s=5, on_ambiguous=probe)
    with scripted(Hang(5), Reply(200)) as srv:
        caller = drive(table(POST__release=policy))
        r = await caller.request("POST", f"{srv.url}/release", json={})
        assert srv.count == 1
    assert r.status_code == 200 and r.reason_phrase == "Applied (confirmed by probe)" and r.content == b""
    assert str(r.request.url) == f"{srv.url}/release"
    assert len(asked) == 1 and asked[0].endpoint == "POST /release"
    assert len(r.extensions["attempts"]) == 1


@pytest.mark.asyncio
async def test_retry_after_past_the_deadline_stops_at_once(drive: Drive) -> None:
    """A Retry-After longer than the time left raises DeadlineExceeded (an httpx.TimeoutException) at once, with the status."""
    with scripted(Reply(503, b"busy", {"Retry-After": "30"})) as srv:
        seen = Recorder()
        caller = drive(table(GET__x=EndpointPolicy(deadline_s=5, attempt_timeout_s=2)), observers=[seen])
        with pytest.raises(httpx.TimeoutException) as info:
            await caller.request("GET", f"{srv.url}/x")
        assert srv.count == 1
    assert isinstance(info.value, DeadlineExceeded) and isinstance(info.value, resilience.DeadlineExceeded)
    assert info.value.last_status == 503
    assert seen.of(RetryScheduled) == []  # no wait was started


@pytest.mark.asyncio
async def test_retry_after_is_clamped_by_the_policy(drive: Drive) -> None:
    """A Retry-After within the deadline is honoured up to retry_after_max_s; the retry then succeeds."""
    retry = RetryPolicy(max_attempts=3, base_s=0, cap_s=0, retry_after_max_s=0.05)
    with scripted(Reply(429, b"slow down", {"Retry-After": "20"}), Reply(200, b"ok")) as srv:
        seen = Recorder()
        caller = drive(table(GET__x=EndpointPolicy(retry=retry, deadline_s=5, attempt_timeout_s=2)), observers=[seen])
        r = await caller.request("GET", f"{srv.url}/x")
        assert r.text == "ok" and srv.count == 2
    assert [e.delay_s for e in seen.of(RetryScheduled)] == [0.05]


@pytest.mark.asyncio
async def test_breaker_opens_fails_fast_as_connect_error_and_closes(drive: Drive) -> None:
    """Failed calls open the breaker; CircuitOpen is an httpx.ConnectError sent nowhere; after the wait a success closes it."""
    clock = FakeClock()
    with scripted(Reply(502, b""), Reply(502, b""), Reply(502, b""), Reply(200, b"ok")) as srv:
        caller = drive(
            table(GET__x=EndpointPolicy(retry=RetryPolicy(max_attempts=1))),
            breaker=BreakerConfig(failure_threshold=3, open_seconds=10),
            clock=clock,
        )
        for _ in range(3):
            assert (await caller.request("GET", f"{srv.url}/x")).status_code == 502
        with pytest.raises(httpx.ConnectError) as info:
            await caller.request("GET", f"{srv.url}/x")
        assert srv.count == 3
        err = info.value
        assert isinstance(err, CircuitOpen) and isinstance(err, resilience.CircuitOpen)
        assert f"127.0.0.1:{srv.port}" in str(err) and str(err.request.url) == f"{srv.url}/x"
        assert caller.breaker(srv.url).state is BreakerState.OPEN
        clock.advance(10)
        assert (await caller.request("GET", f"{srv.url}/x")).text == "ok"
        assert caller.breaker(srv.url).state is BreakerState.CLOSED


@pytest.mark.asyncio
async def test_retry_budget_exhausted_is_an_httpx_transport_error(drive: Drive) -> None:
    """A spent retry budget stops the retries: RetryBudgetExhausted, an httpx.TransportError; the floor allows one later."""
    clock = FakeClock()
    policy = EndpointPolicy(retry=RetryPolicy(max_attempts=10, base_s=0, cap_s=0), deadline_s=None)
    budget = RetryBudgetConfig(ratio=0.0, min_retries_per_second=1.0, max_tokens=2)
    with scripted(Reply(502, b"")) as srv:
        caller = drive(table(GET__x=policy), breaker=None, retry_budget=budget, clock=clock)
        with pytest.raises(httpx.TransportError) as info:
            await caller.request("GET", f"{srv.url}/x")
        assert isinstance(info.value, RetryBudgetExhausted) and isinstance(info.value, resilience.errors.RetryBudgetExhausted)
        assert srv.count == 3  # the first attempt and two tokens
        clock.advance(1.0)
        with pytest.raises(RetryBudgetExhausted):
            await caller.request("GET", f"{srv.url}/x")
        assert srv.count == 5


@pytest.mark.asyncio
async def test_retries_exhausted_when_the_policy_asks(drive: Drive) -> None:
    """raise_on_exhausted turns the last 502 into RetriesExhausted, an httpx.TransportError carrying the status."""
    with scripted(Reply(502, b"")) as srv:
        caller = drive(table(GET__x=EndpointPolicy(retry=RetryPolicy(max_attempts=2, base_s=0, cap_s=0), raise_on_exhausted=True)))
        with pytest.raises(httpx.TransportError) as info:
            await caller.request("GET", f"{srv.url}/x")
        assert srv.count == 2
    assert isinstance(info.value, RetriesExhausted) and info.value.last_status == 502


@pytest.mark.asyncio
async def test_callers_read_timeout_is_not_overruled(drive: Drive) -> None:
    """A caller's 0.3 s read timeout on a default-policy GET bounds every attempt (not the policy's 10 s); then httpx's ReadTimeout."""
    inner = drive.seen_transport()
    with scripted(Hang(5)) as srv:
        caller = drive(inner=inner, rng=lambda: 0.0)
        with pytest.raises(httpx.ReadTimeout) as info:
            await caller.request("GET", f"{srv.url}/slow", timeout=httpx.Timeout(5.0, read=0.3))
        assert srv.count == 4  # the default GET policy: max_attempts=4
    assert len(info.value.attempts) == 4  # type: ignore[attr-defined]
    assert inner.timeouts == [{"connect": 5.0, "read": 0.3, "write": 0.3, "pool": 5.0}] * 4


@pytest.mark.asyncio
async def test_table_entry_timeout_wins_and_caps_write_and_pool(drive: Drive, httpserver: HTTPServer) -> None:
    """An entry's attempt_timeout_s is each attempt's connect and read timeout; write and pool never exceed them."""
    httpserver.expect_request("/flush").respond_with_data("ok")
    inner = drive.seen_transport()
    caller = drive(table(POST__flush=EndpointPolicy(attempt_timeout_s=2.0, deadline_s=None)), inner=inner)
    r = await caller.request("POST", httpserver.url_for("/flush"), timeout=httpx.Timeout(30.0, write=1.0))
    assert r.text == "ok"
    assert inner.timeouts == [{"connect": 2.0, "read": 2.0, "write": 1.0, "pool": 2.0}]


@pytest.mark.asyncio
async def test_each_call_keeps_its_own_route_engine_and_timeouts(drive: Drive) -> None:
    """Calls repeated over one transport (its routes remembered) keep their own endpoint, engine and attempt timeouts.

    The query string does not change the route, the method's case does not
    either, another method or port does; the caller's own request keeps its
    timeout extension (each attempt gets a copy).
    """
    recorder = Recorder()
    inner = drive.seen_transport()
    caller = drive(table(POST__flush=EndpointPolicy(attempt_timeout_s=2.0, deadline_s=None)), inner=inner, observers=[recorder])
    with scripted(Reply(200, b"a")) as one, scripted(Reply(200, b"b")) as two:
        asked = [
            ("POST", f"{one.url}/flush?x=1", "POST /flush", one.port),
            ("post", f"{one.url}/flush?x=2", "POST /flush", one.port),
            ("GET", f"{one.url}/flush", "GET *", one.port),
            ("POST", f"{two.url}/flush", "POST /flush", two.port),
            ("POST", f"{one.url}/other", "POST *", one.port),
        ]
        for method, url, endpoint, port in asked * 2:
            r = await caller.request(method, url, timeout=30.0)
            assert r.extensions["endpoint"] == endpoint
            started = recorder.of(AttemptStarted)[-1]
            assert (started.endpoint, started.server_port, started.engine) == (endpoint, port, engine_of(url)[0])
            assert r.request.extensions["timeout"] == {"connect": 30.0, "read": 30.0, "write": 30.0, "pool": 30.0}
            explicit = endpoint == "POST /flush"
            expected = {"connect": 2.0, "read": 2.0, "write": 2.0, "pool": 2.0} if explicit else r.request.extensions["timeout"]
            assert inner.timeouts[-1] == expected
        assert (one.count, two.count) == (8, 2)


@pytest.mark.asyncio
async def test_mounts_per_host_leave_other_hosts_plain(drive: Drive, httpserver: HTTPServer) -> None:
    """Mounted on one host with mounts=, the transport retries that host's 502s; another host gets plain httpx (its 502, once)."""
    httpserver.expect_ordered_request("/x").respond_with_data("", status=502)
    httpserver.expect_ordered_request("/x").respond_with_data("resilient")
    base = httpserver.url_for("/").rstrip("/")
    client: httpx.Client | httpx.AsyncClient
    with scripted(Reply(502, b"plain"), Reply(200)) as other:
        if drive.kind == "sync":
            client = httpx.Client(mounts={base: ResilientTransport(table(GET__x=EndpointPolicy(retry=FAST)))})
            with client:
                r1, r2 = client.get(f"{base}/x"), client.get(f"{other.url}/x")
        else:
            client = httpx.AsyncClient(mounts={base: AsyncResilientTransport(table(GET__x=EndpointPolicy(retry=FAST)))})
            async with client:
                r1, r2 = await client.get(f"{base}/x"), await client.get(f"{other.url}/x")
        assert other.count == 1
    assert r1.text == "resilient" and len(r1.extensions["attempts"]) == 2
    assert r2.status_code == 502 and "attempts" not in r2.extensions


@pytest.mark.asyncio
async def test_streaming_body_is_sent_once(drive: Drive) -> None:
    """A generator body cannot be replayed: one attempt, the caller gets the 502 and the server the whole body, once."""
    with scripted(Reply(502, b"bad gateway"), Reply(200)) as srv:
        caller = drive(retry_budget=None)
        r = await caller.request("PUT", f"{srv.url}/weights", chunks=[b"pay", b"load"], headers={"Content-Length": "7"})
        assert r.status_code == 502 and len(r.extensions["attempts"]) == 1
        assert srv.count == 1 and srv.seen[0].body == b"payload"


@pytest.mark.asyncio
async def test_unsupported_protocol_is_raised_unretried(drive: Drive) -> None:
    """A URL httpx cannot send (ftp://) raises UnsupportedProtocol after one attempt, never retried."""
    seen = Recorder()
    caller = drive(observers=[seen])
    with pytest.raises(httpx.UnsupportedProtocol):
        await caller.request("GET", "ftp://127.0.0.1:9/x")
    assert len(seen.of(AttemptStarted)) == 1


@pytest.mark.asyncio
async def test_closing_the_client_closes_the_wrapped_transport(drive: Drive, httpserver: HTTPServer) -> None:
    """Client.close()/aclose() reach the wrapped transport through the resilient one."""
    httpserver.expect_request("/x").respond_with_data("ok")
    inner = drive.seen_transport()
    caller = drive(inner=inner)
    assert (await caller.request("GET", httpserver.url_for("/x"))).text == "ok"
    assert not inner.closed
    await drive.close()
    assert inner.closed


@pytest.fixture(scope="module")
def tls_server() -> Iterator[tuple[HTTPServer, ssl.SSLContext]]:
    """A loopback HTTPS server with a certificate from a throwaway CA, and a client context trusting that CA."""
    ca = trustme.CA()
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1", "localhost").configure_cert(server_ctx)
    client_ctx = ssl.create_default_context()
    ca.configure_trust(client_ctx)
    server = HTTPServer(host="127.0.0.1", port=0, ssl_context=server_ctx)
    server.start()
    try:
        yield server, client_ctx
    finally:
        server.clear()
        server.stop()


@pytest.mark.asyncio
async def test_untrusted_certificate_fails_at_once_unretried(drive: Drive, tls_server: tuple[HTTPServer, ssl.SSLContext]) -> None:
    """verify= on the wrapped transport works; a certificate that fails verification raises ConnectError after one attempt."""
    server, trusted = tls_server
    server.expect_request("/secure").respond_with_data("tls ok")
    inner = httpx.HTTPTransport(verify=trusted) if drive.kind == "sync" else httpx.AsyncHTTPTransport(verify=trusted)
    assert (await drive(inner=inner).request("GET", server.url_for("/secure"))).text == "tls ok"
    before = len(server.log)
    seen = Recorder()
    with pytest.raises(httpx.ConnectError) as info:
        await drive(observers=[seen]).request("GET", server.url_for("/secure"))
    assert len(seen.of(AttemptStarted)) == 1 and len(server.log) == before
    assert "CERTIFICATE_VERIFY_FAILED" in str(info.value)


# -- async only ----------------------------------------------------------------


@pytest.mark.asyncio
async def test_cancelled_task_in_backoff_sends_nothing_more_and_returns_the_breaker_slot() -> None:
    """Cancelling the calling task during a backoff sleep ends the call: no more requests, the half-open probe slot is free again."""
    seen = Recorder()
    policies = table(
        GET__fail=EndpointPolicy(retry=RetryPolicy(max_attempts=1)),
        GET__x=EndpointPolicy(retry=RetryPolicy(max_attempts=5, base_s=20, cap_s=20, jitter=0.0), deadline_s=60, attempt_timeout_s=5),
    )
    breaker_config = BreakerConfig(failure_threshold=1, open_seconds=0.2)
    transport = AsyncResilientTransport(policies, breaker=breaker_config, observers=[seen])  # the system clock: a real 20 s sleep
    with scripted(Reply(502, b"")) as srv:
        async with httpx.AsyncClient(transport=transport) as client:
            breaker = Caller("async", transport, client).breaker(srv.url)
            assert (await client.get(f"{srv.url}/fail")).status_code == 502  # one failed call opens it
            assert breaker.state is BreakerState.OPEN
            await eventually(lambda: breaker.state is BreakerState.HALF_OPEN)
            task = asyncio.create_task(client.get(f"{srv.url}/x"))
            await eventually(lambda: bool(seen.of(RetryScheduled)))  # the call took the probe slot, saw its 502 and sleeps 20 s
            await asyncio.sleep(0.05)
            assert srv.count == 2
            assert breaker.admit() is None  # the sleeping call holds the only probe slot
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await asyncio.sleep(0.2)
            assert srv.count == 2  # nothing more sent
            assert breaker.state is BreakerState.HALF_OPEN  # a cancelled call is no verdict
            permit = breaker.admit()
            assert permit is not None and permit.probe  # the slot came back
            breaker.release_probe(permit)


# -- errors and classification -------------------------------------------------


def test_error_classes_are_both_httpx_and_resilience_errors() -> None:
    """Each error is the resilience error of its name and the httpx exception a caller catches, and carries its request."""
    pairs = [
        (DeadlineExceeded, resilience.DeadlineExceeded, httpx.TimeoutException),
        (CircuitOpen, resilience.CircuitOpen, httpx.ConnectError),
        (AmbiguousOutcome, resilience.AmbiguousOutcome, httpx.TransportError),
        (RetryBudgetExhausted, resilience.errors.RetryBudgetExhausted, httpx.TransportError),
        (RetriesExhausted, resilience.RetriesExhausted, httpx.TransportError),
    ]
    request = httpx.Request("POST", "http://127.0.0.1:9/x")
    for ours, core, httpx_base in pairs:
        err = ours("m", endpoint="POST /x", engine="http://127.0.0.1:9", request=request)
        assert isinstance(err, core) and isinstance(err, httpx_base) and isinstance(err, httpx.HTTPError)
        assert err.request is request and err.endpoint == "POST /x" and str(err) == "m"
        assert not issubclass(httpx_base, core)


def test_transport_failure_classification() -> None:
    """Connect-phase errors were never sent; read/write failures and anything else may have been applied."""
    cases = {
        httpx.ConnectError("x"): (Delivery.NOT_SENT, "connect_error"),
        httpx.ConnectTimeout("x"): (Delivery.NOT_SENT, "connect_timeout"),
        httpx.PoolTimeout("x"): (Delivery.NOT_SENT, "connect_timeout"),
        httpx.ProxyError("x"): (Delivery.NOT_SENT, "connect_error"),
        httpx.ReadTimeout("x"): (Delivery.AMBIGUOUS, "read_timeout"),
        httpx.WriteTimeout("x"): (Delivery.AMBIGUOUS, "read_timeout"),
        httpx.ReadError("x"): (Delivery.AMBIGUOUS, "connection_reset"),
        httpx.WriteError("x"): (Delivery.AMBIGUOUS, "connection_reset"),
        httpx.RemoteProtocolError("x"): (Delivery.AMBIGUOUS, "connection_reset"),
        httpx.CloseError("x"): (Delivery.AMBIGUOUS, "error"),
    }
    assert len(cases) == 10
    for exc, expected in cases.items():
        assert transport_failure(exc) == expected, exc


def test_bad_arguments_name_what_is_wrong() -> None:
    """A transport of the wrong kind or a policies dict is refused with a message naming the argument."""
    with pytest.raises(resilience.ConfigError, match=r"ResilientTransport.transport must be an httpx.BaseTransport"):
        ResilientTransport(transport=httpx.AsyncHTTPTransport())  # type: ignore[arg-type]
    with pytest.raises(resilience.ConfigError, match=r"AsyncResilientTransport.transport must be an httpx.AsyncBaseTransport"):
        AsyncResilientTransport(transport=httpx.HTTPTransport())  # type: ignore[arg-type]
    with pytest.raises(resilience.ConfigError, match=r"ResilientTransport.policies must be a PolicyTable"):
        ResilientTransport({"GET /x": EndpointPolicy()})  # type: ignore[arg-type]
    request = httpx.Request("GET", "http://127.0.0.1:9/x", extensions={"timeout": {"connect": 1, "read": "soon"}})
    with ResilientTransport() as transport, pytest.raises(resilience.ConfigError, match=r"\['timeout'\]\['read'\] must be a number"):
        transport.handle_request(request)


# -- the safety property ---------------------------------------------------------


_LOST = {"read_timeout": httpx.ReadTimeout, "reset": httpx.ReadError, "dropped": httpx.RemoteProtocolError}


class FaultTransport(httpx.BaseTransport):
    """A real transport that plays one fault per attempt: refuse before sending, or send for real and lose the answer."""

    def __init__(self, faults: list[str]) -> None:
        self.inner = httpx.HTTPTransport()
        self.faults = faults

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        fault = self.faults.pop(0) if self.faults else "answer"
        if fault == "refuse":
            raise httpx.ConnectError("refused (injected)")
        response = self.inner.handle_request(request)
        if fault == "answer":
            return response
        response.read()
        response.close()
        raise _LOST[fault]("lost (injected)")

    def close(self) -> None:
        self.inner.close()


class AsyncFaultTransport(httpx.AsyncBaseTransport):
    """``FaultTransport`` for the async driver."""

    def __init__(self, faults: list[str]) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.faults = faults

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        fault = self.faults.pop(0) if self.faults else "answer"
        if fault == "refuse":
            raise httpx.ConnectError("refused (injected)")
        response = await self.inner.handle_async_request(request)
        if fault == "answer":
            return response
        await response.aread()
        await response.aclose()
        raise _LOST[fault]("lost (injected)")

    async def aclose(self) -> None:
        await self.inner.aclose()


def _post_once(kind: str, url: str, policies: PolicyTable | None, faults: list[str]) -> None:
    """One POST through the transport of ``kind`` whose wrapped transport plays ``faults``; raises what the caller would see."""
    options: dict[str, Any] = {"breaker": None, "retry_budget": None, "clock": FakeClock()}
    if kind == "sync":
        with httpx.Client(transport=ResilientTransport(policies, transport=FaultTransport(faults), **options)) as client:
            client.post(url, json={})
        return

    async def main() -> None:
        transport = AsyncResilientTransport(policies, transport=AsyncFaultTransport(faults), **options)
        async with httpx.AsyncClient(transport=transport) as client:
            await client.post(url, json={})

    asyncio.run(main())


FAULTS = st.lists(st.sampled_from(["refuse", "read_timeout", "reset", "dropped", "answer"]), min_size=1, max_size=6)


@pytest.mark.parametrize("kind", ["sync", "async"])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(faults=FAULTS, explicit=st.booleans(), statuses=st.lists(st.sampled_from([200, 502, 503]), min_size=6, max_size=6))
def test_non_idempotent_post_reaches_the_server_at_most_once(
    kind: str, httpserver: HTTPServer, faults: list[str], explicit: bool, statuses: list[int]
) -> None:
    """Whatever each attempt meets (refusal, lost answer, 502/503, 200), a non-idempotent POST reaches the server at most once,
    and a lost answer surfaces as AmbiguousOutcome (a table entry) or httpx's own error (no entry), never as a re-send."""
    httpserver.clear()
    for status in statuses:
        httpserver.expect_ordered_request("/release").respond_with_data("", status=status)
    policies = table(POST__release=EndpointPolicy(idempotent=False, retry=ZERO, attempt_timeout_s=5, deadline_s=5)) if explicit else None
    try:
        _post_once(kind, httpserver.url_for("/release"), policies, list(faults))
        lost = False
    except AmbiguousOutcome:
        assert explicit
        lost = True
    except (httpx.ReadTimeout, httpx.ReadError, httpx.RemoteProtocolError) as exc:
        assert not explicit and not isinstance(exc, resilience.ResilienceError)
        lost = True
    sent = len(httpserver.log)
    assert sent <= 1
    first_sent = next((f for f in faults if f != "refuse"), "answer")
    assert lost == (first_sent != "answer")
    if lost:
        assert sent == 1
