"""ResilientMiddleware against real aiohttp.web servers on 127.0.0.1: retries, ambiguity, timeouts, breaker, budget, cancellation."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import resilience
import resilience.errors
from resilience import BreakerConfig, EndpointPolicy, PolicyTable, RetryBudgetConfig, RetryPolicy
from resilience.adapters.aiohttp import ResilientMiddleware, caller_timeout, request_timeout
from resilience.adapters.aiohttp_errors import AmbiguousOutcome, CircuitOpen, DeadlineExceeded, RetryBudgetExhausted
from resilience.breaker import BreakerState, CircuitBreaker
from resilience.events import AttemptStarted, Event
from resilience.outcome import Delivery, attempts_of
from resilience.policy import ProbeAnswer, ProbeContext
from resilience.testing.clock import FakeClock
from tests.conftest import LONG_TIMEOUT, SHORT_TIMEOUT, free_port
from tests.servers import Action, Drop, Hang, Reply

FAST = RetryPolicy(max_attempts=4, base_s=0.01, cap_s=0.05)


def table(**entries: EndpointPolicy) -> PolicyTable:
    return PolicyTable({k.replace("__", " /"): v for k, v in entries.items()})


@dataclass(frozen=True)
class Late:
    """Answer ``status`` after ``seconds``."""

    seconds: float
    status: int = 200
    body: bytes = b"late"


@dataclass
class Hit:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    peer: tuple[str, int]


@dataclass
class WebScript:
    """What an ``aiohttp.web`` script server saw: every request, in order."""

    url: str
    port: int
    hits: list[Hit] = field(default_factory=list)

    @property
    def count(self) -> int:
        return len(self.hits)


@asynccontextmanager
async def serve(*script: Action | Late, port: int = 0) -> AsyncIterator[WebScript]:
    """An ``aiohttp.web`` server on 127.0.0.1 playing ``script`` (the last action repeats), stopped on exit.

    ``Reply`` answers, ``Late(s, ...)`` answers after ``s`` seconds, ``Hang(s)`` reads the request
    and answers nothing for ``s`` seconds (or until the server stops), ``Drop`` reads it and
    closes the connection unanswered.
    """
    todo = list(script)
    stop = asyncio.Event()
    seen = WebScript(url="", port=0)

    async def handle(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        peer = request.transport.get_extra_info("peername") if request.transport is not None else ("", 0)
        seen.hits.append(Hit(request.method, request.path, dict(request.headers), body, tuple(peer)))
        action = todo.pop(0) if len(todo) > 1 else todo[0]
        if isinstance(action, Reply):
            return web.Response(status=action.status, body=action.body, headers=action.headers)
        if isinstance(action, (Hang, Late)):
            try:
                await asyncio.wait_for(stop.wait(), action.seconds)
            except TimeoutError:
                pass
            if isinstance(action, Late):
                return web.Response(status=action.status, body=action.body)
        if request.transport is not None:  # None once the client gave up and closed it
            request.transport.close()
        return web.Response(status=500)  # never reaches the client: the connection is closed

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    runner = web.AppRunner(app, handle_signals=False, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    seen.port = int(runner.addresses[0][1])
    seen.url = f"http://127.0.0.1:{seen.port}"
    try:
        yield seen
    finally:
        stop.set()
        await runner.cleanup()


@contextmanager
def unanswered_listener() -> Iterator[int]:
    """A loopback port whose backlog is full: a new connection is never accepted (connect hangs until its timeout)."""
    with socket.socket() as listener, socket.socket() as filler:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        port = int(listener.getsockname()[1])
        filler.connect(("127.0.0.1", port))  # takes the one backlog slot; the next SYN is dropped
        yield port


def session(mw: ResilientMiddleware, **kwargs: object) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(middlewares=(mw,), **kwargs)  # type: ignore[arg-type]


def state(breaker: CircuitBreaker) -> BreakerState:
    """The breaker's state, read afresh (a function, so that mypy does not narrow a property across calls)."""
    return breaker.state


async def wait_for_hits(srv: WebScript, n: int) -> None:
    """Until the server has seen ``n`` requests (bounded by LONG_TIMEOUT)."""
    async with asyncio.timeout(LONG_TIMEOUT):
        while srv.count < n:
            await asyncio.sleep(0.01)


# -- retries and results ------------------------------------------------------


@pytest.mark.asyncio
async def test_502_502_200_is_one_call_three_attempts_on_one_connection() -> None:
    """Two 502s are absorbed: the caller sees one 200 and the attempts; the discarded 502s were read, so the connection was reused."""
    async with serve(Reply(502, b"bad"), Reply(502, b"bad"), Reply(200, b"ok")) as srv:
        mw = ResilientMiddleware(table(POST__pause_generation=EndpointPolicy(retry=FAST)))
        async with session(mw) as s, s.post(f"{srv.url}/pause_generation", json={}) as r:
            assert r.status == 200 and await r.text() == "ok"
            attempts = r.attempts  # type: ignore[attr-defined]
        assert [a.status for a in attempts] == [502, 502, 200]
        assert all(a.delay_s is not None and 0 <= a.delay_s <= 0.05 for a in attempts[:2])
        assert srv.count == 3 and len({h.peer for h in srv.hits}) == 1


@pytest.mark.asyncio
@pytest.mark.parametrize("parts", [True, False], ids=["yarl's parts", "str(url)"])
async def test_the_route_key_is_yarls_parts_or_the_string_alike(monkeypatch: pytest.MonkeyPatch, parts: bool) -> None:
    """Either route key (yarl's ``_scheme``/``_netloc``/``_path``, or the string where yarl has none) routes alike, query aside."""
    from resilience.adapters import aiohttp as driver

    monkeypatch.setattr(driver, "_YARL_PARTS", parts)
    async with serve(Reply(200, b"ok"), Reply(200, b"ok"), Reply(200, b"ok")) as srv:
        mw = ResilientMiddleware(table(POST__pause_generation=EndpointPolicy(retry=FAST)))
        seen = []
        async with session(mw) as s:
            for path in ("/pause_generation?a=1", "/pause_generation?a=2", "/other"):
                async with s.post(f"{srv.url}{path}", json={}) as r:
                    assert r.status == 200
                    seen.append(r.endpoint)  # type: ignore[attr-defined]
        assert seen == ["POST /pause_generation", "POST /pause_generation", "POST *"]
        assert len(mw._routes.routes) == 2
        assert {route[2] for route in mw._routes.routes.values()} == {srv.url}  # (method, match, engine, ...)


@pytest.mark.asyncio
async def test_carrier_headers_are_set_on_each_attempt() -> None:
    """Headers an observer adds to AttemptStarted's carrier (trace context) go out on that attempt's request."""

    def tracer(event: Event) -> None:
        if isinstance(event, AttemptStarted):
            event.carrier["traceparent"] = f"00-{event.call_id:032x}-{event.attempt + 1:016x}-01"

    async with serve(Reply(503, b""), Reply(200, b"ok")) as srv:
        mw = ResilientMiddleware(table(GET__x=EndpointPolicy(retry=FAST)), observers=[tracer])
        async with session(mw) as s, s.get(f"{srv.url}/x") as r:
            assert r.status == 200
        sent = [h.headers.get("traceparent", "") for h in srv.hits]
        assert len(sent) == 2 and [t[-19:] for t in sent] == [f"{1:016x}-01", f"{2:016x}-01"]
        assert sent[0][:35] == sent[1][:35]  # one call, one trace id


@pytest.mark.asyncio
async def test_4xx_and_500_reach_the_caller_after_one_attempt() -> None:
    """Client errors and plain 500s are returned as they are, never retried."""
    async with serve(Reply(400, b"bad"), Reply(500, b"boom")) as srv:
        async with session(ResilientMiddleware(retry_budget=None)) as s:
            async with s.get(f"{srv.url}/a") as r1:
                assert r1.status == 400 and len(r1.attempts) == 1  # type: ignore[attr-defined]
            async with s.get(f"{srv.url}/b") as r2:
                assert r2.status == 500 and await r2.text() == "boom"
        assert srv.count == 2


@pytest.mark.asyncio
async def test_refused_then_up_is_retried_for_a_post() -> None:
    """Connection refused never reached the server: retried for any method until the server listens."""
    port = free_port()
    policy = EndpointPolicy(idempotent=False, retry=RetryPolicy(max_attempts=50, base_s=0.05, cap_s=0.1), deadline_s=10)
    async with session(ResilientMiddleware(table(POST__resume=policy), breaker=None)) as s:
        call = asyncio.create_task(s.post(f"http://127.0.0.1:{port}/resume", json={}))
        await asyncio.sleep(0.3)
        assert not call.done()
        async with serve(Reply(200, b"up"), port=port) as srv:
            r = await call
            assert r.status == 200 and await r.text() == "up"
            r.release()
            attempts = r.attempts  # type: ignore[attr-defined]
            assert attempts[0].delivery is Delivery.NOT_SENT and attempts[0].error_type == "ClientConnectorError"
            assert srv.count == 1


@pytest.mark.asyncio
async def test_non_idempotent_post_read_timeout_sent_once_raises_ambiguous() -> None:
    """A POST whose read times out after sending is never re-sent: AmbiguousOutcome (an aiohttp.ClientError), one request seen."""
    policy = EndpointPolicy(idempotent=False, retry=FAST, attempt_timeout_s=SHORT_TIMEOUT, deadline_s=LONG_TIMEOUT)
    async with serve(Hang(LONG_TIMEOUT), Reply(200)) as srv:
        async with session(ResilientMiddleware(table(POST__release_memory_occupation=policy))) as s:
            with pytest.raises(AmbiguousOutcome) as info:
                await s.post(f"{srv.url}/release_memory_occupation", json={"tags": None})
        assert srv.count == 1
    err = info.value
    assert isinstance(err, aiohttp.ClientError) and isinstance(err, resilience.AmbiguousOutcome)
    assert err.endpoint == "POST /release_memory_occupation" and "read_timeout" in str(err)
    assert [(a.delivery, a.error_type) for a in err.attempts] == [(Delivery.AMBIGUOUS, "SocketTimeoutError")]


@pytest.mark.asyncio
async def test_drop_after_send_on_non_idempotent_is_ambiguous() -> None:
    """A connection closed after the request was read is ambiguous for a non-idempotent endpoint: not re-sent."""
    async with serve(Drop(), Reply(200)) as srv:
        async with session(ResilientMiddleware(table(POST__x=EndpointPolicy(idempotent=False, retry=FAST)))) as s:
            with pytest.raises(AmbiguousOutcome) as info:
                await s.post(f"{srv.url}/x", json={})
        assert srv.count == 1
    assert info.value.attempts[0].error_type == "ServerDisconnectedError"


@pytest.mark.asyncio
async def test_dropped_connections_on_a_get_cost_max_attempts_not_twice_that() -> None:
    """aiohttp re-runs a GET that ended on a dropped connection; the call already retried it: max_attempts requests, one failure."""
    mw = ResilientMiddleware(table(GET__x=EndpointPolicy(retry=FAST)), breaker=BreakerConfig(failure_threshold=2))
    async with serve(Drop()) as srv:
        async with session(mw) as s:
            with pytest.raises(aiohttp.ServerDisconnectedError) as info:
                await s.get(f"{srv.url}/x")
            assert srv.count == 4 and len(info.value.attempts) == 4  # type: ignore[attr-defined]
            assert mw.retrier.breakers is not None
            assert state(mw.retrier.breakers.by_engine[srv.url]) is BreakerState.CLOSED  # one failure of two
            with pytest.raises(aiohttp.ServerDisconnectedError):  # the next call is a call of its own
                await s.get(f"{srv.url}/x")
            assert srv.count == 8 and state(mw.retrier.breakers.by_engine[srv.url]) is BreakerState.OPEN


@pytest.mark.asyncio
async def test_idempotent_read_timeout_is_retried() -> None:
    """The same hang on an idempotent endpoint is retried and succeeds."""
    policy = EndpointPolicy(retry=FAST, attempt_timeout_s=SHORT_TIMEOUT, deadline_s=LONG_TIMEOUT)
    async with serve(Hang(LONG_TIMEOUT), Reply(200, b"paused")) as srv:
        async with session(ResilientMiddleware(table(POST__pause_generation=policy))) as s:
            async with s.post(f"{srv.url}/pause_generation", json={}) as r:
                assert await r.text() == "paused"
        assert srv.count == 2


@pytest.mark.asyncio
async def test_probe_confirmed_ambiguous_call_returns_an_applied_response() -> None:
    """When the probe says the ambiguous POST was applied, the caller gets a body-less 200 marked probe_confirmed, not a re-send."""
    seen: list[ProbeContext] = []

    def probe(context: ProbeContext) -> ProbeAnswer:
        seen.append(context)
        return ProbeAnswer.DONE

    policy = EndpointPolicy(idempotent=False, retry=FAST, on_ambiguous=probe)
    async with serve(Drop(), Reply(200)) as srv:
        async with session(ResilientMiddleware(table(POST__update=policy))) as s, s.post(f"{srv.url}/update", json={}) as r:
            assert r.status == 200 and r.reason == "Applied (confirmed by probe)" and r.probe_confirmed  # type: ignore[attr-defined]
            assert await r.read() == b"" and len(r.headers) == 0
            assert len(r.attempts) == 1  # type: ignore[attr-defined]
        assert srv.count == 1
    assert [c.endpoint for c in seen] == ["POST /update"]


@pytest.mark.asyncio
async def test_async_generator_body_gets_one_attempt() -> None:
    """A body that cannot be replayed (an async generator) is sent once; the caller sees the 502."""

    async def body() -> AsyncIterator[bytes]:
        yield b"weights-"
        yield b"part"

    async with serve(Reply(502, b"bad gateway"), Reply(200)) as srv:
        async with session(ResilientMiddleware(retry_budget=None)) as s, s.put(f"{srv.url}/weights", data=body()) as r:
            assert r.status == 502 and len(r.attempts) == 1  # type: ignore[attr-defined]
        assert srv.count == 1 and srv.hits[0].body == b"weights-part"


@pytest.mark.asyncio
async def test_bytes_body_is_sent_whole_on_every_attempt() -> None:
    """A bytes body is replayed: each attempt carries the whole body."""
    async with serve(Reply(503, b""), Reply(200)) as srv:
        mw = ResilientMiddleware(table(PUT__weights=EndpointPolicy(retry=FAST)))
        async with session(mw) as s, s.put(f"{srv.url}/weights", data=b"payload") as r:
            assert r.status == 200
        assert [h.body for h in srv.hits] == [b"payload", b"payload"]


@pytest.mark.asyncio
async def test_seekable_file_body_is_rewound_for_each_attempt(tmp_path: Path) -> None:
    """A file body is replayed from where the first attempt started reading."""
    path = tmp_path / "weights.bin"
    path.write_bytes(b"header:payload")
    async with serve(Reply(502, b""), Reply(200)) as srv:
        mw = ResilientMiddleware(table(PUT__weights=EndpointPolicy(retry=FAST)))
        with path.open("rb") as f:
            f.seek(len(b"header:"))
            async with session(mw) as s, s.put(f"{srv.url}/weights", data=f) as r:
                assert r.status == 200 and len(r.attempts) == 2  # type: ignore[attr-defined]
        assert [h.body for h in srv.hits] == [b"payload", b"payload"]


@pytest.mark.asyncio
async def test_closing_the_session_during_a_backoff_ends_the_call() -> None:
    """A session closed while a call waits to retry ends the call as aiohttp ends calls on a closed session, sending nothing more."""
    policy = EndpointPolicy(retry=RetryPolicy(max_attempts=10, base_s=0.3, cap_s=0.3, jitter=0), deadline_s=None)
    async with serve(Reply(502, b"")) as srv:
        s = session(ResilientMiddleware(table(GET__x=policy), breaker=None))
        call = asyncio.create_task(s.get(f"{srv.url}/x"))
        await wait_for_hits(srv, 1)
        await s.close()
        with pytest.raises(RuntimeError, match="Session is closed") as info:
            await call
        assert srv.count == 1
    records = attempts_of(info.value)  # the 502, then the attempt the closed session stopped before sending
    assert records is not None and [(r.status, r.delivery) for r in records] == [(502, Delivery.RESPONDED), (None, Delivery.NOT_SENT)]


# -- deadlines and timeouts ---------------------------------------------------


@pytest.mark.asyncio
async def test_retry_after_past_the_deadline_stops_at_once() -> None:
    """A Retry-After longer than the time left raises DeadlineExceeded (an asyncio.TimeoutError) with the 503, without waiting."""
    async with serve(Reply(503, b"busy", {"Retry-After": "30"})) as srv:
        async with session(ResilientMiddleware(table(GET__x=EndpointPolicy(deadline_s=5, attempt_timeout_s=2)))) as s:
            with pytest.raises(DeadlineExceeded) as info:
                await s.get(f"{srv.url}/x")
        assert srv.count == 1
    err = info.value
    assert err.last_status == 503 and len(err.attempts) == 1 and err.attempts[0].delay_s is None
    assert isinstance(err, asyncio.TimeoutError) and isinstance(err, aiohttp.ServerTimeoutError)


@pytest.mark.asyncio
async def test_retry_after_within_the_deadline_is_the_wait() -> None:
    """A short Retry-After on a 429 is the wait before the next attempt."""
    async with serve(Reply(429, b"", {"Retry-After": "0.2"}), Reply(200, b"ok")) as srv:
        async with session(ResilientMiddleware(table(GET__x=EndpointPolicy(retry=FAST, attempt_timeout_s=2, deadline_s=5)))) as s:
            async with s.get(f"{srv.url}/x") as r:
                assert r.status == 200
                assert [a.delay_s for a in r.attempts] == [0.2, None]  # type: ignore[attr-defined]
        assert srv.count == 2


def test_caller_timeout_reads_client_timeout() -> None:
    """connect: the smaller of sock_connect/connect (else total); read: sock_read (else total); aiohttp's default: nothing said."""
    assert caller_timeout(aiohttp.client.DEFAULT_TIMEOUT) is None
    assert caller_timeout(aiohttp.ClientTimeout(total=None, sock_connect=1, connect=3, sock_read=2)) == (1, 2)
    assert caller_timeout(aiohttp.ClientTimeout(total=7)) == (7, 7)
    assert caller_timeout(aiohttp.ClientTimeout(total=None)) == (None, None)


@pytest.mark.asyncio
async def test_session_client_timeout_bounds_each_attempt() -> None:
    """The session's ClientTimeout(sock_read=...) is the caller's read timeout: a hang costs one short attempt, then a retry."""
    async with serve(Hang(LONG_TIMEOUT), Reply(200, b"ok")) as srv:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=LONG_TIMEOUT, sock_read=SHORT_TIMEOUT)
        async with session(ResilientMiddleware(breaker=None), timeout=timeout) as s, asyncio.timeout(LONG_TIMEOUT):
            async with s.get(f"{srv.url}/state") as r:
                assert await r.text() == "ok"
                first = r.attempts[0]  # type: ignore[attr-defined]
        assert first.delivery is Delivery.AMBIGUOUS and first.error_type == "SocketTimeoutError"
        assert srv.count == 2


@pytest.mark.asyncio
async def test_per_request_client_timeout_is_the_callers_timeout() -> None:
    """A per-request timeout= is the caller's word, as requests' timeout= is: it beats the default policy's shorter attempt timeout."""
    default = PolicyTable(default=lambda method: EndpointPolicy(attempt_timeout_s=SHORT_TIMEOUT, retry=FAST))
    async with serve(Late(SHORT_TIMEOUT + 0.3), Late(SHORT_TIMEOUT + 0.3), Reply(200, b"retried")) as srv:
        async with session(ResilientMiddleware(default, breaker=None)) as s, asyncio.timeout(LONG_TIMEOUT):
            timeout = aiohttp.ClientTimeout(total=None, sock_connect=LONG_TIMEOUT, sock_read=LONG_TIMEOUT)
            async with s.get(f"{srv.url}/state", timeout=timeout) as r:
                assert await r.text() == "late" and len(r.attempts) == 1  # type: ignore[attr-defined]
            async with s.get(f"{srv.url}/state") as r:  # no timeout of its own: the policy's 0.5 s cuts the late answer
                assert await r.text() == "retried" and len(r.attempts) == 2  # type: ignore[attr-defined]
        assert srv.count == 3


@pytest.mark.asyncio
async def test_request_timeout_is_found_through_a_chain_of_middlewares() -> None:
    """request_timeout() reads the request's own ClientTimeout wherever the middleware sits in the chain, else the session's."""
    seen: list[aiohttp.ClientTimeout] = []

    async def spy(request: aiohttp.ClientRequest, handler: aiohttp.ClientHandlerType) -> aiohttp.ClientResponse:
        seen.append(request_timeout(request, handler))
        return await handler(request)

    async def passthrough(request: aiohttp.ClientRequest, handler: aiohttp.ClientHandlerType) -> aiohttp.ClientResponse:
        return await handler(request)

    own = aiohttp.ClientTimeout(total=None, sock_connect=1.5, sock_read=2.5)
    default = aiohttp.ClientTimeout(total=9)
    async with serve(Reply(200)) as srv:
        for chain in ((spy,), (spy, passthrough), (passthrough, spy), (passthrough, spy, passthrough)):
            async with aiohttp.ClientSession(middlewares=chain, timeout=default) as s:
                async with s.get(f"{srv.url}/x", timeout=own) as r:
                    assert r.status == 200
                async with s.get(f"{srv.url}/x") as r:
                    assert r.status == 200
    assert len(seen) == 8
    assert all(t is own for t in seen[0::2]) and all(t is default for t in seen[1::2])


@pytest.mark.asyncio
async def test_session_total_timeout_bounds_the_whole_call_with_its_retries() -> None:
    """ClientTimeout(total=...) covers every attempt and backoff: the call ends as aiohttp's TimeoutError before its attempts run out."""
    policy = EndpointPolicy(retry=RetryPolicy(max_attempts=10, base_s=0.2, cap_s=0.2, jitter=0), deadline_s=None)
    async with serve(Reply(502, b"")) as srv:
        mw = ResilientMiddleware(table(GET__x=policy), breaker=BreakerConfig(failure_threshold=1))
        async with session(mw, timeout=aiohttp.ClientTimeout(total=0.5)) as s:
            with pytest.raises(asyncio.TimeoutError) as info:
                await s.get(f"{srv.url}/x")
        assert 1 <= srv.count < 10
    assert not isinstance(info.value, resilience.ResilienceError)
    assert mw.retrier.breakers is not None and state(mw.retrier.breakers.by_engine[srv.url]) is BreakerState.CLOSED  # ended neutrally


@pytest.mark.asyncio
async def test_entry_attempt_timeout_beats_a_longer_session_timeout() -> None:
    """An entry's attempt_timeout_s bounds each attempt even when the session allows far longer (the middleware's own clock)."""
    policy = EndpointPolicy(retry=FAST, attempt_timeout_s=SHORT_TIMEOUT, deadline_s=LONG_TIMEOUT)
    async with serve(Hang(LONG_TIMEOUT), Reply(200, b"ok")) as srv:
        timeout = aiohttp.ClientTimeout(total=None, sock_read=60, sock_connect=60)
        async with session(ResilientMiddleware(table(GET__state=policy)), timeout=timeout) as s, asyncio.timeout(LONG_TIMEOUT):
            async with s.get(f"{srv.url}/state") as r:
                assert await r.text() == "ok"
                assert r.attempts[0].error_type == "SocketTimeoutError"  # type: ignore[attr-defined]
        assert srv.count == 2


@pytest.mark.asyncio
async def test_read_limit_runs_from_sending_not_from_the_connect_limit() -> None:
    """Once sent, an attempt waits ``sock_read`` from then on, past where the shorter connect limit would have ended it."""
    policy = EndpointPolicy(retry=RetryPolicy(max_attempts=1), attempt_timeout_s=None, deadline_s=None)
    async with serve(Late(0.3, 200, b"ok")) as srv:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=0.1, sock_read=LONG_TIMEOUT)
        async with session(ResilientMiddleware(table(GET__state=policy)), timeout=timeout) as s, asyncio.timeout(2 * LONG_TIMEOUT):
            async with s.get(f"{srv.url}/state") as r:
                assert await r.text() == "ok"
                assert len(r.attempts) == 1  # type: ignore[attr-defined]
        assert srv.count == 1


@pytest.mark.asyncio
async def test_attempts_on_one_loop_each_keep_their_own_limit() -> None:
    """One loop watches every attempt's limit: a short limit started after a long one still cuts its attempt, the long one is not cut.

    Concurrent calls on one loop, one session each: a long read limit first, then a short one whose attempt
    hangs past it, then the long one's server answers late but within its limit.
    """
    once = RetryPolicy(max_attempts=1)
    long_policy = EndpointPolicy(retry=once, attempt_timeout_s=LONG_TIMEOUT, deadline_s=None)
    short_policy = EndpointPolicy(retry=once, attempt_timeout_s=0.2, deadline_s=None)
    async with serve(Late(0.6, 200, b"ok")) as slow, serve(Hang(LONG_TIMEOUT)) as hang:
        async with (
            session(ResilientMiddleware(table(GET__a=long_policy), breaker=None, retry_budget=None)) as long_s,
            session(ResilientMiddleware(table(GET__b=short_policy), breaker=None, retry_budget=None)) as short_s,
            asyncio.timeout(2 * LONG_TIMEOUT),
        ):

            async def long_call() -> bytes:
                async with long_s.get(f"{slow.url}/a") as r:
                    return await r.read()

            started = asyncio.create_task(long_call())
            await wait_for_hits(slow, 1)  # the long limit is armed first
            with pytest.raises(aiohttp.SocketTimeoutError) as info:
                await short_s.get(f"{hang.url}/b")
            assert not started.done()  # cut at its own limit, not at the long one's
            assert await started == b"ok"
    assert [a.error_type for a in info.value.attempts] == ["SocketTimeoutError"]  # type: ignore[attr-defined]


@pytest.mark.asyncio
async def test_connect_that_never_completes_is_not_sent_and_retried_until_the_deadline() -> None:
    """A connection never accepted times out before sending: NOT_SENT (even for a POST), retried, then aiohttp's own error."""
    policy = EndpointPolicy(
        idempotent=False, retry=RetryPolicy(max_attempts=2, base_s=0.01, cap_s=0.02), attempt_timeout_s=0.2, deadline_s=0.7
    )
    with unanswered_listener() as port:
        async with session(ResilientMiddleware(table(POST__release=policy), breaker=None, retry_budget=None)) as s:
            with pytest.raises(aiohttp.ConnectionTimeoutError) as info:
                await s.post(f"http://127.0.0.1:{port}/release", json={})
    attempts = info.value.attempts  # type: ignore[attr-defined]
    assert len(attempts) > 2  # more than max_attempts: none of them reached the server
    assert {(a.delivery, a.error_type) for a in attempts} == {(Delivery.NOT_SENT, "ConnectionTimeoutError")}


# -- breaker and budget ---------------------------------------------------------


@pytest.mark.asyncio
async def test_breaker_opens_fails_fast_then_half_opens_and_closes() -> None:
    """Failed calls open the breaker; open fails fast with CircuitOpen (an aiohttp.ClientConnectionError) off the network."""
    clock = FakeClock()
    mw = ResilientMiddleware(
        table(GET__x=EndpointPolicy(retry=RetryPolicy(max_attempts=1))),
        breaker=BreakerConfig(failure_threshold=2, open_seconds=10),
        clock=clock,
    )
    async with serve(Reply(502, b""), Reply(502, b""), Reply(200, b"ok")) as srv:
        async with session(mw) as s:
            for _ in range(2):
                async with s.get(f"{srv.url}/x") as r:
                    assert r.status == 502
            with pytest.raises(CircuitOpen) as info:
                await s.get(f"{srv.url}/x")
            assert srv.count == 2
            assert isinstance(info.value, aiohttp.ClientConnectionError) and f"127.0.0.1:{srv.port}" in str(info.value)
            clock.advance(10)
            async with s.get(f"{srv.url}/x") as r:
                assert await r.text() == "ok"
    assert mw.retrier.breakers is not None and mw.retrier.breakers.by_engine[f"http://127.0.0.1:{srv.port}"].state is BreakerState.CLOSED


@pytest.mark.asyncio
async def test_retry_budget_stops_retries() -> None:
    """A spent retry budget stops the retries: RetryBudgetExhausted (an aiohttp.ClientError) after the tokens are used."""
    clock = FakeClock()
    policy = EndpointPolicy(retry=RetryPolicy(max_attempts=10, base_s=0, cap_s=0), deadline_s=None)
    budget = RetryBudgetConfig(ratio=0.0, min_retries_per_second=1.0, max_tokens=2)
    async with serve(Reply(502, b"")) as srv:
        async with session(ResilientMiddleware(table(GET__x=policy), breaker=None, retry_budget=budget, clock=clock)) as s:
            with pytest.raises(RetryBudgetExhausted) as info:
                await s.get(f"{srv.url}/x")
            assert srv.count == 3  # the first attempt and two tokens
            assert isinstance(info.value, aiohttp.ClientError) and info.value.last_status == 502


# -- cancellation ---------------------------------------------------------------


class PausingClock(FakeClock):
    """A fake clock (time moves only when told) whose backoff sleeps really wait on the loop, so a test can cancel one."""

    async def asleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        await asyncio.sleep(seconds)


async def _half_open(mw: ResilientMiddleware, clock: FakeClock, s: aiohttp.ClientSession, url: str) -> CircuitBreaker:
    """Open the engine's breaker with one failed call, then let its wait pass: one probe slot free."""
    async with s.get(f"{url}/fail") as r:
        assert r.status == 502
    assert mw.retrier.breakers is not None
    breaker = mw.retrier.breakers.by_engine[url]  # the engine is scheme://host:port
    assert state(breaker) is BreakerState.OPEN
    clock.advance(10)
    assert state(breaker) is BreakerState.HALF_OPEN
    return breaker


def _cancel_table() -> PolicyTable:
    return table(
        GET__fail=EndpointPolicy(retry=RetryPolicy(max_attempts=1)),
        GET__slow=EndpointPolicy(retry=RetryPolicy(max_attempts=5, base_s=30, cap_s=30, jitter=0), deadline_s=None),
        POST__hang=EndpointPolicy(idempotent=False, retry=FAST, attempt_timeout_s=None, deadline_s=None),
    )


@pytest.mark.asyncio
async def test_cancel_during_backoff_sends_nothing_more_and_returns_the_probe_slot() -> None:
    """A task cancelled in its backoff sleep re-raises CancelledError, sends no more attempts, and gives the half-open slot back."""
    clock = PausingClock()
    mw = ResilientMiddleware(_cancel_table(), breaker=BreakerConfig(failure_threshold=1, open_seconds=10), clock=clock)
    async with serve(Reply(502, b""), Reply(502, b""), Reply(200, b"ok")) as srv, session(mw) as s:
        breaker = await _half_open(mw, clock, s, srv.url)
        call = asyncio.create_task(s.get(f"{srv.url}/slow"))  # takes the only probe slot, gets a 502, sleeps 30 s
        await wait_for_hits(srv, 2)
        async with asyncio.timeout(LONG_TIMEOUT):
            while not clock.sleeps:  # the 502 was read: the call is in its 30 s backoff
                await asyncio.sleep(0.01)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        await asyncio.sleep(0.2)
        assert srv.count == 2 and clock.sleeps == [30]  # nothing more sent
        assert state(breaker) is BreakerState.HALF_OPEN  # neither a failure (would reopen) nor a success
        async with s.get(f"{srv.url}/x") as r:  # the slot came back: this call is let in (else CircuitOpen)
            assert r.status == 200
        assert state(breaker) is BreakerState.CLOSED


@pytest.mark.asyncio
async def test_cancel_during_an_attempt_sends_nothing_more_and_returns_the_probe_slot() -> None:
    """A task cancelled while its attempt waits for the answer re-raises CancelledError and gives the half-open slot back."""
    clock = FakeClock()
    mw = ResilientMiddleware(_cancel_table(), breaker=BreakerConfig(failure_threshold=1, open_seconds=10), clock=clock)
    async with serve(Reply(502, b""), Hang(LONG_TIMEOUT), Reply(200, b"ok")) as srv, session(mw) as s:
        breaker = await _half_open(mw, clock, s, srv.url)
        call = asyncio.create_task(s.post(f"{srv.url}/hang", json={}))
        await wait_for_hits(srv, 2)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        await asyncio.sleep(0.2)
        assert srv.count == 2
        assert state(breaker) is BreakerState.HALF_OPEN
        async with s.get(f"{srv.url}/x") as r:
            assert r.status == 200
        assert state(breaker) is BreakerState.CLOSED


# -- errors and safety ----------------------------------------------------------


def test_errors_are_aiohttp_and_resilience_errors_with_readable_messages() -> None:
    """Each error is both the core's class and the aiohttp class a caller catches; str() is the message."""
    pairs = [
        (DeadlineExceeded, resilience.DeadlineExceeded, aiohttp.ServerTimeoutError),
        (CircuitOpen, resilience.CircuitOpen, aiohttp.ClientConnectionError),
        (AmbiguousOutcome, resilience.AmbiguousOutcome, aiohttp.ClientError),
        (RetryBudgetExhausted, resilience.errors.RetryBudgetExhausted, aiohttp.ClientError),
    ]
    for cls, core, aio in pairs:
        err = cls("POST /x on http://127.0.0.1:1 failed", endpoint="POST /x", engine="http://127.0.0.1:1", attempts=(), request=None)
        assert isinstance(err, core) and isinstance(err, aio)
        assert str(err) == "POST /x on http://127.0.0.1:1 failed" and err.endpoint == "POST /x"


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(before=st.lists(st.sampled_from([502, 503]), max_size=3), probe=st.sampled_from(["raise", "unknown"]))
def test_ambiguous_attempt_is_never_resent(before: list[int], probe: str) -> None:
    """Property: on every call one attempt may have been applied (a drop after the server read it); it is never sent again."""

    async def scenario() -> None:
        def unknown(context: ProbeContext) -> ProbeAnswer:
            return ProbeAnswer.UNKNOWN

        policy = EndpointPolicy(
            idempotent=False,
            retry=RetryPolicy(max_attempts=10, base_s=0, cap_s=0),
            retry_statuses_if_not_idempotent=True,
            on_ambiguous="raise" if probe == "raise" else unknown,
        )
        script: list[Action] = [*(Reply(code, b"") for code in before), Drop(), Reply(200, b"ok")]
        async with serve(*script) as srv:
            async with session(ResilientMiddleware(table(POST__release=policy), breaker=None, retry_budget=None)) as s:
                with pytest.raises(AmbiguousOutcome) as info:
                    await s.post(f"{srv.url}/release", json={})
            assert srv.count == len(before) + 1
        assert [a.status for a in info.value.attempts] == [*before, None]

    asyncio.run(scenario())
