"""``DataQueue`` / ``SyncDataQueue`` (``adapters/data_queue.py``): at most the pool's ``max_connections`` requests inside the httpx pool.

Against a real streaming engine on loopback (``StreamServer``: ``/generate``
streams until the client goes away, or ``?events=N`` events, and control
routes answer at once), a refused port, and a raw socket that answers half a
response and closes. What is pinned: httpcore's pool never holds more than
the limit while more streams run; a request waiting past its pool timeout
gets ``httpx.PoolTimeout`` from our queue; a slot comes back, once, when a
response closes, when reading it fails, when the attempt fails, and when a
task is cancelled while it waits (also in the turn its slot arrived);
control calls never wait in the queue; slots freed in one loop turn let
their waiters in one per turn, oldest first; and where the limit cannot be
read there is no queue. The sync queue, with threads, is pinned the same way
(a thread that gave up on its pool timeout is passed over too).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpcore
import httpx
import pytest

import resilience
from resilience.adapters.control_lane import ControlLane
from resilience.adapters.data_queue import DataQueue, SyncDataQueue, _SlotStream, _SyncSlotStream
from resilience.adapters.driver_config import DriverConfig
from resilience.adapters.httpx import AsyncResilientTransport, ResilientTransport
from resilience.adapters.sglang import SGLANG_POLICIES
from resilience.testing.stream_server import StreamServer
from tests.conftest import LONG_TIMEOUT, free_port
from tests.servers import cut_off_stream

POOL = 2
"""The data pool's connection limit in these tests: two hanging streams fill it."""
GENERATE = {"text": "hi", "stream": True}
POOL_TIMEOUT_S = 0.3
"""A pool timeout that a request behind two hanging streams runs past."""


@pytest.fixture(scope="module")
def engine() -> Iterator[StreamServer]:
    with StreamServer(interval_s=0.05) as server:
        yield server


def _transport(lane: bool = True) -> AsyncResilientTransport:
    inner = httpx.AsyncHTTPTransport(limits=httpx.Limits(max_connections=POOL))
    config = DriverConfig(policies=SGLANG_POLICIES, control_lane=ControlLane() if lane else None)
    return AsyncResilientTransport(transport=inner, config=config)


def _queue(transport: AsyncResilientTransport) -> DataQueue:
    assert transport.queue is not None
    return transport.queue


def _pool_requests(transport: AsyncResilientTransport) -> int:
    """Requests inside the wrapped httpcore pool now: holding a connection, or in httpcore's own queue."""
    pool = transport.transport._pool  # type: ignore[attr-defined]
    assert type(pool) is httpcore.AsyncConnectionPool
    return len(pool._requests)


async def _idle(engine: StreamServer) -> None:
    """Every connection of the test before is closed (the tests share the module's engine)."""
    await asyncio.to_thread(engine.wait_for, "open_connections", 0)


async def eventually(condition: Callable[[], bool], limit_s: float = LONG_TIMEOUT) -> None:
    """Poll ``condition`` on the loop until it holds; fail after ``limit_s`` (a bound a healthy run never reaches)."""
    for _ in range(int(limit_s / 0.005)):
        if condition():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("condition never held")


async def _hanging(client: httpx.AsyncClient, engine: StreamServer) -> httpx.Response:
    """A ``/generate`` stream that lasts until it is closed: it holds a slot and a connection."""
    return await client.send(client.build_request("POST", f"{engine.url}/generate", json=GENERATE), stream=True)


async def _read(client: httpx.AsyncClient, url: str) -> bytes:
    """A request sent and its stream read to its end."""
    async with client.stream("POST", url, json=GENERATE) as response:
        return b"".join([part async for part in response.aiter_raw()])


@pytest.mark.asyncio
async def test_never_more_than_max_connections_data_requests_inside_the_pool(engine: StreamServer) -> None:
    """Ten streams through a pool of two: httpcore holds at most two requests at a time, the others wait in our queue, all end."""
    await _idle(engine)
    transport = _transport()
    queue = _queue(transport)
    inside: list[int] = []
    waiting: list[int] = []
    async with httpx.AsyncClient(transport=transport) as client:
        tasks = [asyncio.create_task(_read(client, f"{engine.url}/generate?events=2")) for _ in range(10)]
        while not all(task.done() for task in tasks):
            inside.append(_pool_requests(transport))
            waiting.append(queue.waiting)
            await asyncio.sleep(0.005)
        bodies = await asyncio.gather(*tasks)
    assert all(body.endswith(b"data: [DONE]\n\n") for body in bodies)
    assert max(inside) == POOL
    assert max(waiting) == 10 - POOL
    assert queue.inside == 0 and queue.waiting == 0
    await _idle(engine)


@pytest.mark.asyncio
async def test_a_request_waiting_past_its_pool_timeout_gets_httpx_pool_timeout(engine: StreamServer) -> None:
    """Both slots held: a third request raises ``httpx.PoolTimeout`` from our queue after its pool timeout, as a bare pool's does."""
    await _idle(engine)
    transport = _transport()
    queue = _queue(transport)
    timeout = httpx.Timeout(LONG_TIMEOUT, pool=POOL_TIMEOUT_S)
    with resilience.set_testing(True, attempts=1):
        async with httpx.AsyncClient(transport=transport) as client:
            streams = [await _hanging(client, engine) for _ in range(POOL)]
            try:
                started = time.monotonic()
                with pytest.raises(httpx.PoolTimeout, match=r"no connection of the pool's 2 came free within the pool timeout"):
                    await client.post(f"{engine.url}/generate", json=GENERATE, timeout=timeout)
                assert POOL_TIMEOUT_S <= time.monotonic() - started < LONG_TIMEOUT
                assert queue.waiting == 0 and queue.inside == POOL and _pool_requests(transport) == POOL
            finally:
                for stream in streams:
                    await stream.aclose()
        assert queue.inside == 0
    bare = httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(limits=httpx.Limits(max_connections=POOL)))
    async with bare:
        streams = [await _hanging(bare, engine) for _ in range(POOL)]
        try:
            with pytest.raises(httpx.PoolTimeout):  # the same error from httpcore's own queue
                await bare.post(f"{engine.url}/generate", json=GENERATE, timeout=timeout)
        finally:
            for stream in streams:
                await stream.aclose()
    await _idle(engine)


@pytest.mark.asyncio
async def test_closing_a_stream_lets_the_oldest_waiter_in_once(engine: StreamServer) -> None:
    """Two slots held, two requests waiting: closing one stream lets the first waiter in, and closing it again frees nothing more."""
    await _idle(engine)
    transport = _transport()
    queue = _queue(transport)
    async with httpx.AsyncClient(transport=transport) as client:
        streams = [await _hanging(client, engine) for _ in range(POOL)]
        first = asyncio.create_task(_hanging(client, engine))
        await eventually(lambda: queue.waiting == 1)
        second = asyncio.create_task(_hanging(client, engine))
        await eventually(lambda: queue.waiting == 2)
        await streams[0].aclose()
        entered = await asyncio.wait_for(first, LONG_TIMEOUT)
        assert entered.status_code == 200 and not second.done()
        await streams[0].aclose()
        await asyncio.sleep(0.05)
        assert not second.done() and queue.waiting == 1 and queue.inside == POOL and _pool_requests(transport) == POOL
        await entered.aclose()
        last = await asyncio.wait_for(second, LONG_TIMEOUT)
        for response in (last, streams[1]):
            await response.aclose()
        assert queue.inside == 0 and queue.waiting == 0
    await _idle(engine)


@pytest.mark.asyncio
async def test_a_request_cancelled_while_waiting_leaves_no_slot_behind(engine: StreamServer) -> None:
    """A waiting request's task cancelled: the queue forgets it, and once the streams close both slots take requests again."""
    await _idle(engine)
    transport = _transport()
    queue = _queue(transport)
    async with httpx.AsyncClient(transport=transport) as client:
        streams = [await _hanging(client, engine) for _ in range(POOL)]
        waiter = asyncio.create_task(_read(client, f"{engine.url}/generate?events=1"))
        await eventually(lambda: queue.waiting == 1)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert queue.waiting == 0 and queue.inside == POOL
        for stream in streams:
            await stream.aclose()
        assert queue.inside == 0
        again = [await _hanging(client, engine) for _ in range(POOL)]  # both slots free: neither waits
        assert queue.inside == POOL and queue.waiting == 0
        for stream in again:
            await stream.aclose()
    await _idle(engine)


@pytest.mark.asyncio
async def test_a_slot_handed_to_a_task_being_cancelled_passes_to_the_next_waiter() -> None:
    """A slot that reaches a waiter in the turn its task is cancelled goes on to the next waiter (no socket: the turn is exact)."""
    queue = DataQueue(httpx.MockTransport(lambda request: httpx.Response(200, stream=httpx.ByteStream(b"x"))), limit=1)
    request = httpx.Request("POST", "http://127.0.0.1:9/generate")
    held = await queue.send(request)
    first = asyncio.create_task(queue.send(request))
    second = asyncio.create_task(queue.send(request))
    await asyncio.sleep(0)
    assert queue.waiting == 2 and queue.inside == 1
    await held.aclose()  # nothing in it yields: the slot is kept for first, handed next turn
    await asyncio.sleep(0)  # that turn: the slot is first's before first runs again
    assert queue.waiting == 1 and not first.done()
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    last = await asyncio.wait_for(second, LONG_TIMEOUT)
    assert queue.inside == 1 and queue.waiting == 0
    await last.aclose()
    assert queue.inside == 0


@pytest.mark.asyncio
async def test_a_cancelled_waiter_before_its_slot_came_is_passed_over() -> None:
    """A slot freed while the oldest waiter's task is cancelled, before the slot is handed on: the next waiter gets it."""
    queue = DataQueue(httpx.MockTransport(lambda request: httpx.Response(200, stream=httpx.ByteStream(b"x"))), limit=1)
    request = httpx.Request("POST", "http://127.0.0.1:9/generate")
    held = await queue.send(request)
    first = asyncio.create_task(queue.send(request))
    second = asyncio.create_task(queue.send(request))
    await asyncio.sleep(0)
    await held.aclose()  # kept for the waiters; nothing handed yet
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    last = await asyncio.wait_for(second, LONG_TIMEOUT)
    assert queue.inside == 1 and queue.waiting == 0
    await last.aclose()
    assert queue.inside == 0


class _Admissions(httpx.AsyncBaseTransport):
    """A transport in front of a real one that notes, for each request it gets, its ``n`` header and the loop turn.

    Requests ``n < held`` are answered here, with a body in memory: closing
    one never yields, so a test can give back several slots in one turn.
    """

    def __init__(self, inner: httpx.AsyncBaseTransport, held: int) -> None:
        self.inner = inner
        self.held = held
        self.turn = 0
        """Turns of the event loop since ``count_turns``."""
        self.entered: list[tuple[int, int]] = []
        """(request's ``n``, loop turn) of each request let in, in the order they came."""

    def count_turns(self) -> None:
        """Count one per turn of the running loop from now on (a callback that schedules itself for the next turn)."""
        loop = asyncio.get_running_loop()

        def tick() -> None:
            self.turn += 1
            loop.call_soon(tick)

        loop.call_soon(tick)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        n = int(request.headers["n"])
        self.entered.append((n, self.turn))
        if n < self.held:
            return httpx.Response(200, stream=httpx.ByteStream(b"held"))
        return await self.inner.handle_async_request(request)


@pytest.mark.asyncio
async def test_slots_freed_in_one_turn_let_their_waiters_in_one_per_turn_oldest_first(engine: StreamServer) -> None:
    """Four slots given back in one loop turn, four requests waiting: each enters in a turn of its own, in the order they came."""
    await _idle(engine)
    inner = httpx.AsyncHTTPTransport(limits=httpx.Limits(max_connections=4))
    admissions = _Admissions(inner, held=4)
    queue = DataQueue(admissions, limit=4)

    async def send(n: int) -> httpx.Response:
        request = httpx.Request("POST", f"{engine.url}/generate?events=1", json=GENERATE, headers={"n": str(n)})
        return await queue.send(request)

    async def read(n: int) -> bytes:
        response = await send(n)
        try:
            return b"".join([part async for part in response.stream])
        finally:
            await response.stream.aclose()

    try:
        held = [await send(n) for n in range(4)]
        waiters = [asyncio.create_task(read(n)) for n in range(4, 8)]
        await eventually(lambda: queue.waiting == 4)
        admissions.count_turns()
        await asyncio.sleep(0)
        freed_at = admissions.turn
        for response in held:  # nothing in these closes yields: all four slots come back in this one turn
            await response.aclose()
        assert admissions.turn == freed_at
        bodies = await asyncio.wait_for(asyncio.gather(*waiters), LONG_TIMEOUT)
    finally:
        await inner.aclose()
    assert all(body.endswith(b"data: [DONE]\n\n") for body in bodies)
    later = admissions.entered[4:]
    assert [n for n, _ in later] == [4, 5, 6, 7]
    turns = [turn for _, turn in later]
    assert turns == sorted(set(turns)) and turns[0] > freed_at, turns
    assert queue.inside == 0 and queue.waiting == 0
    await _idle(engine)


@pytest.mark.asyncio
async def test_failed_attempts_give_their_slots_back() -> None:
    """Three calls to a refused port through two slots, two attempts each: every attempt's slot comes back."""
    transport = _transport()
    queue = _queue(transport)
    url = f"http://127.0.0.1:{free_port()}/generate"
    with resilience.set_testing(True, attempts=2):
        async with httpx.AsyncClient(transport=transport) as client:
            results = await asyncio.gather(*(client.post(url, json=GENERATE) for _ in range(3)), return_exceptions=True)
    assert all(isinstance(r, httpx.ConnectError) for r in results), results
    assert queue.inside == 0 and queue.waiting == 0


@pytest.fixture
def half_answer() -> Iterator[str]:
    """A server that answers each request with a stream's first chunk, then closes the connection."""
    with cut_off_stream() as url:
        yield url


class _Relayed(httpx.AsyncByteStream):
    """A stream of its own around another: not httpx's nor httpcore's, so ``DataQueue`` wraps it."""

    def __init__(self, inner: httpx.AsyncByteStream) -> None:
        self.inner = inner

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for part in self.inner:
            yield part

    async def aclose(self) -> None:
        await self.inner.aclose()


class _Relay(httpx.AsyncBaseTransport):
    """A transport of its own in front of httpx's, answering with ``_Relayed`` streams."""

    def __init__(self) -> None:
        self.inner = httpx.AsyncHTTPTransport()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self.inner.handle_async_request(request)
        assert isinstance(response.stream, httpx.AsyncByteStream)
        return httpx.Response(response.status_code, headers=response.headers, stream=_Relayed(response.stream))

    async def aclose(self) -> None:
        await self.inner.aclose()


@pytest.mark.asyncio
async def test_a_read_that_fails_gives_the_slot_back_before_the_close(half_answer: str) -> None:
    """The engine drops a stream halfway: the failed read gives the slot back at once, and the response's close gives none more.

    Through httpx's own pool the stream read is httpcore's, no wrapper of ours (``DataQueue.hold``): httpcore closes it
    when the read fails, and that close gives the slot back.
    """
    transport = _transport()
    queue = _queue(transport)
    async with httpx.AsyncClient(transport=transport) as client:
        async with client.stream("POST", f"{half_answer}/generate", json=GENERATE) as response:
            assert queue.inside == 1
            inner = response.stream._stream  # type: ignore[union-attr]  # inside httpx's BoundAsyncStream
            assert type(inner).__name__ == "AsyncResponseStream" and not isinstance(inner, _SlotStream)  # httpx's own, unwrapped
            with pytest.raises(httpx.TransportError):
                async for _ in response.aiter_raw():
                    pass
            assert queue.inside == 0
        assert queue.inside == 0 and queue.waiting == 0


@pytest.mark.asyncio
async def test_a_read_that_fails_through_another_transport_gives_the_slot_back_before_the_close(half_answer: str) -> None:
    """The same through a transport whose streams are not httpcore's: our ``_SlotStream`` around them gives the slot back."""
    relay = _Relay()
    queue = DataQueue(relay, limit=1)
    try:
        response = await queue.send(httpx.Request("POST", f"{half_answer}/generate", json=GENERATE))
        assert queue.inside == 1 and isinstance(response.stream, _SlotStream)
        with pytest.raises(httpx.TransportError):
            async for _ in response.aiter_raw():
                pass
        assert queue.inside == 0
        await response.aclose()
        assert queue.inside == 0 and queue.waiting == 0
    finally:
        await relay.aclose()


@pytest.mark.asyncio
@pytest.mark.parametrize("lane", [True, False], ids=["lane", "no lane"])
async def test_control_calls_never_wait_in_the_queue(engine: StreamServer, lane: bool) -> None:
    """Slots held and a data request waiting: a control call answers from the lane; with the lane off it waits like data."""
    await _idle(engine)
    transport = _transport(lane)
    queue = _queue(transport)
    timeout = httpx.Timeout(LONG_TIMEOUT, pool=POOL_TIMEOUT_S)
    async with httpx.AsyncClient(transport=transport) as client:
        streams = [await _hanging(client, engine) for _ in range(POOL)]
        waiter = asyncio.create_task(_hanging(client, engine))
        try:
            await eventually(lambda: queue.waiting == 1)
            if lane:
                control = await client.post(f"{engine.url}/pause_generation", json={}, timeout=timeout)
                assert control.status_code == 200 and control.json() == {"success": True}
            else:
                with resilience.set_testing(True, attempts=1), pytest.raises(httpx.PoolTimeout, match="pool timeout"):
                    await client.post(f"{engine.url}/pause_generation", json={}, timeout=timeout)
            assert queue.waiting == 1 and queue.inside == POOL and _pool_requests(transport) == POOL
        finally:
            for stream in streams:
                await stream.aclose()
            await (await asyncio.wait_for(waiter, LONG_TIMEOUT)).aclose()
    assert queue.inside == 0
    await _idle(engine)


# ---- threads: ``SyncDataQueue`` ahead of the sync ``ResilientTransport``'s pool ----


def _sync_transport(lane: bool = True) -> ResilientTransport:
    inner = httpx.HTTPTransport(limits=httpx.Limits(max_connections=POOL))
    config = DriverConfig(policies=SGLANG_POLICIES, control_lane=ControlLane() if lane else None)
    return ResilientTransport(transport=inner, config=config)


def _sync_queue(transport: ResilientTransport) -> SyncDataQueue:
    assert transport.queue is not None
    return transport.queue


def _sync_pool_requests(transport: ResilientTransport) -> int:
    """Requests inside the wrapped httpcore pool now: holding a connection, or in httpcore's own queue."""
    pool = transport.transport._pool  # type: ignore[attr-defined]
    assert type(pool) is httpcore.ConnectionPool
    return len(pool._requests)


def _sync_eventually(condition: Callable[[], bool], limit_s: float = LONG_TIMEOUT) -> None:
    """Poll ``condition`` until it holds; fail after ``limit_s`` (a bound a healthy run never reaches)."""
    for _ in range(int(limit_s / 0.005)):
        if condition():
            return
        time.sleep(0.005)
    raise AssertionError("condition never held")


def _sync_hanging(client: httpx.Client, engine: StreamServer) -> httpx.Response:
    """A ``/generate`` stream that lasts until it is closed: it holds a slot and a connection."""
    return client.send(client.build_request("POST", f"{engine.url}/generate", json=GENERATE), stream=True)


def _sync_read(client: httpx.Client, url: str) -> bytes:
    """A request sent and its stream read to its end."""
    with client.stream("POST", url, json=GENERATE) as response:
        return b"".join(response.iter_raw())


def test_sync_never_more_than_max_connections_data_requests_inside_the_pool(engine: StreamServer) -> None:
    """Ten streaming threads through a pool of two: httpcore holds at most two requests at a time, the others wait in our queue."""
    engine.wait_for("open_connections", 0)
    transport = _sync_transport()
    queue = _sync_queue(transport)
    inside: list[int] = []
    waiting: list[int] = []
    with httpx.Client(transport=transport) as client, ThreadPoolExecutor(10) as threads:
        futures = [threads.submit(_sync_read, client, f"{engine.url}/generate?events=2") for _ in range(10)]
        while not all(future.done() for future in futures):
            inside.append(_sync_pool_requests(transport))
            waiting.append(queue.waiting)
            time.sleep(0.005)
        bodies = [future.result() for future in futures]
    assert all(body.endswith(b"data: [DONE]\n\n") for body in bodies)
    assert max(inside) == POOL
    assert max(waiting) == 10 - POOL
    assert queue.inside == 0 and queue.waiting == 0
    engine.wait_for("open_connections", 0)


def test_sync_a_request_waiting_past_its_pool_timeout_gets_httpx_pool_timeout(engine: StreamServer) -> None:
    """Both slots held: a third request raises ``httpx.PoolTimeout`` from our queue after its pool timeout, as httpcore's does."""
    engine.wait_for("open_connections", 0)
    transport = _sync_transport()
    queue = _sync_queue(transport)
    timeout = httpx.Timeout(LONG_TIMEOUT, pool=POOL_TIMEOUT_S)
    with resilience.set_testing(True, attempts=1), httpx.Client(transport=transport) as client:
        streams = [_sync_hanging(client, engine) for _ in range(POOL)]
        try:
            started = time.monotonic()
            with pytest.raises(httpx.PoolTimeout, match=r"no connection of the pool's 2 came free within the pool timeout"):
                client.post(f"{engine.url}/generate", json=GENERATE, timeout=timeout)
            assert POOL_TIMEOUT_S <= time.monotonic() - started < LONG_TIMEOUT
            assert queue.waiting == 0 and queue.inside == POOL and _sync_pool_requests(transport) == POOL
        finally:
            for stream in streams:
                stream.close()
    assert queue.inside == 0
    engine.wait_for("open_connections", 0)


def test_sync_closing_a_stream_lets_the_oldest_waiter_in_once(engine: StreamServer) -> None:
    """Two slots held, two threads waiting: closing one stream lets the first waiter in, and closing it again frees nothing more."""
    engine.wait_for("open_connections", 0)
    transport = _sync_transport()
    queue = _sync_queue(transport)
    with httpx.Client(transport=transport) as client, ThreadPoolExecutor(2) as threads:
        streams = [_sync_hanging(client, engine) for _ in range(POOL)]
        first = threads.submit(_sync_hanging, client, engine)
        _sync_eventually(lambda: queue.waiting == 1)
        second = threads.submit(_sync_hanging, client, engine)
        _sync_eventually(lambda: queue.waiting == 2)
        streams[0].close()
        entered = first.result(LONG_TIMEOUT)
        assert entered.status_code == 200 and not second.done()
        streams[0].close()
        time.sleep(0.05)
        assert not second.done() and queue.waiting == 1 and queue.inside == POOL and _sync_pool_requests(transport) == POOL
        entered.close()
        last = second.result(LONG_TIMEOUT)
        for response in (last, streams[1]):
            response.close()
        assert queue.inside == 0 and queue.waiting == 0
    engine.wait_for("open_connections", 0)


def test_sync_a_waiter_that_timed_out_is_passed_over(engine: StreamServer) -> None:
    """A thread gave up on its pool timeout, another waits behind it: the next slot freed goes to the one still waiting."""
    engine.wait_for("open_connections", 0)
    transport = _sync_transport()
    queue = _sync_queue(transport)
    short = httpx.Timeout(LONG_TIMEOUT, pool=POOL_TIMEOUT_S)
    with resilience.set_testing(True, attempts=1), httpx.Client(transport=transport) as client, ThreadPoolExecutor(2) as threads:
        streams = [_sync_hanging(client, engine) for _ in range(POOL)]
        gone = threads.submit(client.post, f"{engine.url}/generate", json=GENERATE, timeout=short)
        _sync_eventually(lambda: queue.waiting == 1)
        later = threads.submit(_sync_hanging, client, engine)
        _sync_eventually(lambda: queue.waiting == 2)
        with pytest.raises(httpx.PoolTimeout):
            gone.result(LONG_TIMEOUT)
        assert queue.waiting == 1
        streams[0].close()
        entered = later.result(LONG_TIMEOUT)
        assert queue.inside == POOL and queue.waiting == 0
        for response in (entered, streams[1]):
            response.close()
    assert queue.inside == 0
    engine.wait_for("open_connections", 0)


def test_sync_failed_attempts_give_their_slots_back() -> None:
    """Three threads call a refused port through two slots, two attempts each: every attempt's slot comes back."""
    transport = _sync_transport()
    queue = _sync_queue(transport)
    url = f"http://127.0.0.1:{free_port()}/generate"

    def call(client: httpx.Client) -> BaseException | None:
        try:
            client.post(url, json=GENERATE)
        except httpx.HTTPError as exc:
            return exc
        return None

    with resilience.set_testing(True, attempts=2), httpx.Client(transport=transport) as client, ThreadPoolExecutor(3) as threads:
        results = list(threads.map(call, [client] * 3))
    assert all(isinstance(r, httpx.ConnectError) for r in results), results
    assert queue.inside == 0 and queue.waiting == 0


def test_sync_a_read_that_fails_gives_the_slot_back_before_the_close(half_answer: str) -> None:
    """The engine drops a stream halfway: the failed read gives the slot back at once, and the response's close gives none more."""
    transport = _sync_transport()
    queue = _sync_queue(transport)
    with httpx.Client(transport=transport) as client:
        with client.stream("POST", f"{half_answer}/generate", json=GENERATE) as response:
            assert queue.inside == 1
            inner = response.stream._stream  # type: ignore[union-attr]  # inside httpx's BoundSyncStream
            assert type(inner).__name__ == "ResponseStream" and not isinstance(inner, _SyncSlotStream)  # httpx's own, unwrapped
            with pytest.raises(httpx.TransportError):
                for _ in response.iter_raw():
                    pass
            assert queue.inside == 0
        assert queue.inside == 0 and queue.waiting == 0


class _SyncRelayed(httpx.SyncByteStream):
    """``_Relayed`` for threads."""

    def __init__(self, inner: httpx.SyncByteStream) -> None:
        self.inner = inner

    def __iter__(self) -> Iterator[bytes]:
        yield from self.inner

    def close(self) -> None:
        self.inner.close()


def test_sync_a_read_that_fails_through_another_transport_gives_the_slot_back_before_the_close(half_answer: str) -> None:
    """The same through a transport whose streams are not httpcore's: our ``_SyncSlotStream`` gives the slot back."""
    inner = httpx.HTTPTransport()

    def relay(request: httpx.Request) -> httpx.Response:
        response = inner.handle_request(request)
        assert isinstance(response.stream, httpx.SyncByteStream)
        return httpx.Response(response.status_code, headers=response.headers, stream=_SyncRelayed(response.stream))

    relayed = httpx.MockTransport(relay)
    queue = SyncDataQueue(relayed, limit=1)
    try:
        response = queue.send(httpx.Request("POST", f"{half_answer}/generate", json=GENERATE))
        assert queue.inside == 1 and isinstance(response.stream, _SyncSlotStream)
        with pytest.raises(httpx.TransportError):
            for _ in response.iter_raw():
                pass
        assert queue.inside == 0
        response.close()
        assert queue.inside == 0 and queue.waiting == 0
    finally:
        inner.close()


@pytest.mark.parametrize("lane", [True, False], ids=["lane", "no lane"])
def test_sync_control_calls_never_wait_in_the_queue(engine: StreamServer, lane: bool) -> None:
    """Slots held and a data request waiting: a control call answers from the lane; with the lane off it waits like data."""
    engine.wait_for("open_connections", 0)
    transport = _sync_transport(lane)
    queue = _sync_queue(transport)
    timeout = httpx.Timeout(LONG_TIMEOUT, pool=POOL_TIMEOUT_S)
    with httpx.Client(transport=transport) as client, ThreadPoolExecutor(1) as threads:
        streams = [_sync_hanging(client, engine) for _ in range(POOL)]
        waiter = threads.submit(_sync_hanging, client, engine)
        try:
            _sync_eventually(lambda: queue.waiting == 1)
            if lane:
                control = client.post(f"{engine.url}/pause_generation", json={}, timeout=timeout)
                assert control.status_code == 200 and control.json() == {"success": True}
            else:
                with resilience.set_testing(True, attempts=1), pytest.raises(httpx.PoolTimeout, match="pool timeout"):
                    client.post(f"{engine.url}/pause_generation", json={}, timeout=timeout)
            assert queue.waiting == 1 and queue.inside == POOL and _sync_pool_requests(transport) == POOL
        finally:
            for stream in streams:
                stream.close()
            waiter.result(LONG_TIMEOUT).close()
    assert queue.inside == 0
    engine.wait_for("open_connections", 0)


_FLAVOURS: dict[str, tuple[Any, Any, Any]] = {
    "async": (httpx.AsyncHTTPTransport, httpcore.AsyncConnectionPool, AsyncResilientTransport),
    "sync": (httpx.HTTPTransport, httpcore.ConnectionPool, ResilientTransport),
}
"""Flavour -> (httpx's transport, httpcore's pool, ours over them)."""


def _flavoured(flavour: str, kind: str) -> Any:
    """An httpx transport of ``flavour`` and ``kind`` (``http2``: a plain one whose pool speaks HTTP/2; ``http2=True`` on
    the transport would need the ``h2`` package)."""
    transport_class, pool_class, _ = _FLAVOURS[flavour]
    if kind == "http2":
        transport = transport_class()
        transport._pool = pool_class(max_connections=POOL, http2=True)
        return transport
    if kind == "subclass":
        return type("Subclass", (transport_class,), {})()
    if kind == "mock":
        return httpx.MockTransport(lambda request: httpx.Response(200))
    limits = {
        "default": {},
        "limited": {"limits": httpx.Limits(max_connections=POOL)},
        "no limit": {"limits": httpx.Limits(max_connections=None)},
    }
    return transport_class(**limits.get(kind, {"proxy": "http://127.0.0.1:9"}))


@pytest.mark.parametrize("flavour", ["async", "sync"])
@pytest.mark.parametrize(
    ("kind", "limit"),
    [("default", 100), ("limited", POOL), ("no limit", None), ("http2", None), ("proxy", None), ("subclass", None), ("mock", None)],
)
def test_a_queue_only_where_the_pool_limit_can_be_read(flavour: str, kind: str, limit: int | None) -> None:
    """A plain ``(Async)HTTPTransport`` with a limit (httpx's default: 100) and HTTP/1 gets a queue of that size (read from
    httpcore: fails loudly if it moves); a proxy, a subclass, a mock, HTTP/2 or no limit get none."""
    queue = _FLAVOURS[flavour][2](transport=_flavoured(flavour, kind), config=DriverConfig(policies=SGLANG_POLICIES)).queue
    assert (queue.limit if queue is not None else None) == limit
