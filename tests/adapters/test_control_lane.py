"""The control lane (``adapters/control_lane.py``) on every driver, against a real streaming engine on loopback.

``StreamServer`` streams ``/generate`` until the client goes away and answers
control routes at once; each response names the TCP connection that served
it (``x-connection``), so the tests see which pool a request took. On each
driver: a control call completes while the data pool's limit is reached by
hanging streams (and, with the lane off, does not: the test can fail); data
routes never take the lane, which stays warm for the next control call; the
lane's sockets close with the session or client; an auth header arrives
unchanged and is never logged.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import pickle
import sys
from collections.abc import Iterator

import aiohttp
import httpx
import pytest
import requests

from resilience.adapters.aiohttp import ResilientMiddleware
from resilience.adapters.control_lane import ControlLane
from resilience.adapters.driver_config import DriverConfig
from resilience.adapters.httpx import AsyncResilientTransport, ResilientTransport
from resilience.adapters.instrument import SGLangInstrumentor
from resilience.adapters.requests import resilient_session
from resilience.adapters.sglang import SGLANG_POLICIES
from resilience.errors import ConfigError
from resilience.testing.stream_server import StreamServer

POOL = 2
"""The data pool's connection limit in these tests: two hanging streams fill it."""
SECRET = "Bearer lane-secret-7d1f"
CONTROL_TIMEOUT_S = 5.0
"""A control call on the lane answers in milliseconds; queued behind a hanging stream it would wait forever."""
GENERATE = {"text": "hi", "stream": True}


@pytest.fixture(scope="module")
def engine() -> Iterator[StreamServer]:
    with StreamServer(interval_s=0.2) as server:
        yield server


def _config(lane: bool = True) -> DriverConfig:
    return DriverConfig(policies=SGLANG_POLICIES, control_lane=ControlLane() if lane else None)


def _idle(engine: StreamServer) -> None:
    """Every connection of the test before is closed (the tests share the module's engine)."""
    engine.wait_for("open_connections", 0)


# ---- the knob ----


def test_which_routes_take_the_lane() -> None:
    """Table entries other than generation take it; generation and unmatched routes stay on the given pool."""
    lane = ControlLane()
    assert SGLANG_POLICIES.match("POST", "/generate").template in lane.data_paths  # a table entry, kept off by the data rule
    for method, path in (("POST", "/pause_generation"), ("POST", "/update_weights_from_disk"), ("GET", "/health")):
        assert lane.carries(SGLANG_POLICIES.match(method, path)), path
    for method, path in (("POST", "/generate"), ("POST", "/some/framework/route")):
        assert not lane.carries(SGLANG_POLICIES.match(method, path)), path


def test_bad_lane_settings_are_named() -> None:
    with pytest.raises(ConfigError, match=r"ControlLane.idle_connections must be an int >= 1, but was 0"):
        ControlLane(idle_connections=0)
    with pytest.raises(ConfigError, match=r"ControlLane.data_paths must be a frozenset"):
        ControlLane(data_paths={"generate"})  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"DriverConfig.control_lane must be a ControlLane or None, but was True"):
        DriverConfig(control_lane=True)  # type: ignore[arg-type]


def test_the_lane_travels_with_a_pickled_config() -> None:
    lane = ControlLane(idle_connections=3)
    assert pickle.loads(pickle.dumps(DriverConfig(control_lane=lane))).control_lane == lane
    assert pickle.loads(pickle.dumps(DriverConfig(control_lane=None))).control_lane is None


# ---- requests ----


def _closed(engine: StreamServer) -> None:
    """Every socket of the test is closed at the server (after dropping responses: requests' keep their socket object)."""
    gc.collect()
    engine.wait_for("open_connections", 0)


def test_requests_control_call_passes_a_full_pool(engine: StreamServer, caplog: pytest.LogCaptureFixture) -> None:
    _idle(engine)
    caplog.set_level(logging.DEBUG)
    session = resilient_session(config=_config(), pool_maxsize=POOL, pool_block=True)
    streams = [session.post(f"{engine.url}/generate", json=GENERATE, stream=True, timeout=30) for _ in range(POOL)]
    try:
        assert [s.status_code for s in streams] == [200] * POOL
        engine.wait_for("open_streams", POOL)
        control = session.post(f"{engine.url}/pause_generation", json={}, headers={"Authorization": SECRET}, timeout=CONTROL_TIMEOUT_S)
        assert control.status_code == 200 and control.json() == {"success": True}
        assert control.headers["x-connection"] not in {s.headers["x-connection"] for s in streams}
        assert control.connection is session.get_adapter(engine.url)  # a re-send by an auth handler runs the loop again
        assert SECRET in engine.counts().authorizations
        assert "lane-secret" not in caplog.text
    finally:
        for s in streams:
            s.close()
        session.close()
    del streams, control
    _closed(engine)


def _requests_round(session: requests.Session, url: str) -> list[str]:
    """control, data, control, data: the connection that served each."""
    served = []
    for path in ("/pause_generation", "/generate?events=1", "/continue_generation", "/generate?events=1"):
        response = session.post(f"{url}{path}", json=GENERATE, timeout=5)
        assert response.status_code == 200 and (b"[DONE]" in response.content) == ("generate" in path)
        served.append(response.headers["x-connection"])
    return served


def test_requests_lane_is_warm_never_carries_data_and_closes_with_the_session(engine: StreamServer) -> None:
    _idle(engine)
    session = resilient_session(config=_config())
    control, data, control_again, data_again = _requests_round(session, engine.url)
    assert control == control_again  # the lane kept its connection open
    assert data == data_again != control
    assert engine.counts().open_connections == 2
    session.close()
    _closed(engine)  # the lane's socket too


def test_requests_without_lane_shares_the_pool(engine: StreamServer) -> None:
    """The comparison's other side: lane off, control calls take the data pool's connection."""
    _idle(engine)
    with resilient_session(config=_config(lane=False)) as session:
        assert len(set(_requests_round(session, engine.url))) == 1
    _closed(engine)


# ---- httpx, sync ----


def _httpx_client(lane: bool = True) -> httpx.Client:
    inner = httpx.HTTPTransport(limits=httpx.Limits(max_connections=POOL))
    return httpx.Client(transport=ResilientTransport(transport=inner, config=_config(lane)))


def test_httpx_control_call_passes_a_full_pool(engine: StreamServer, caplog: pytest.LogCaptureFixture) -> None:
    _idle(engine)
    caplog.set_level(logging.DEBUG)
    client = _httpx_client()
    streams = [client.send(client.build_request("POST", f"{engine.url}/generate", json=GENERATE), stream=True) for _ in range(POOL)]
    try:
        engine.wait_for("open_streams", POOL)
        control = client.post(f"{engine.url}/pause_generation", json={}, headers={"Authorization": SECRET}, timeout=CONTROL_TIMEOUT_S)
        assert control.status_code == 200 and control.json() == {"success": True}
        assert control.headers["x-connection"] not in {s.headers["x-connection"] for s in streams}
        assert SECRET in engine.counts().authorizations
        assert "lane-secret" not in caplog.text
    finally:
        for s in streams:
            s.close()
        client.close()
    engine.wait_for("open_connections", 0)


def test_httpx_without_lane_the_control_call_queues(engine: StreamServer) -> None:
    """Lane off: the control call waits for a pooled connection and fails on httpx's pool timeout."""
    _idle(engine)
    client = _httpx_client(lane=False)
    streams = [client.send(client.build_request("POST", f"{engine.url}/generate", json=GENERATE), stream=True) for _ in range(POOL)]
    try:
        engine.wait_for("open_streams", POOL)
        with pytest.raises(httpx.TimeoutException):
            client.post(f"{engine.url}/pause_generation", json={}, timeout=httpx.Timeout(5.0, pool=0.3))
    finally:
        for s in streams:
            s.close()
        client.close()
    engine.wait_for("open_connections", 0)


def test_httpx_lane_is_warm_never_carries_data_and_closes_with_the_client(engine: StreamServer) -> None:
    _idle(engine)
    with _httpx_client() as client:
        first = client.post(f"{engine.url}/pause_generation", json={})
        data = client.post(f"{engine.url}/generate?events=1", json=GENERATE)
        second = client.post(f"{engine.url}/continue_generation", json={})
        again = client.post(f"{engine.url}/generate?events=1", json=GENERATE)
        assert b"[DONE]" in data.content and b"[DONE]" in again.content
        assert first.headers["x-connection"] == second.headers["x-connection"]
        assert data.headers["x-connection"] == again.headers["x-connection"] != first.headers["x-connection"]
        assert engine.counts().open_connections == 2
    engine.wait_for("open_connections", 0)


def test_httpx_transport_of_another_kind_gets_no_lane() -> None:
    """A transport whose settings cannot be copied (a proxy, a mock, a class of its own) keeps everything on it."""
    assert ResilientTransport(transport=httpx.MockTransport(lambda r: httpx.Response(200)), config=_config()).lane is None
    assert ResilientTransport(transport=httpx.HTTPTransport(proxy="http://127.0.0.1:9"), config=_config()).lane is None
    assert ResilientTransport(config=_config(lane=False)).lane is None
    assert ResilientTransport(config=_config()).lane is not None


# ---- httpx, async ----


def _async_httpx_client(lane: bool = True) -> httpx.AsyncClient:
    inner = httpx.AsyncHTTPTransport(limits=httpx.Limits(max_connections=POOL))
    return httpx.AsyncClient(transport=AsyncResilientTransport(transport=inner, config=_config(lane)))


@pytest.mark.asyncio
async def test_async_httpx_control_call_passes_a_full_pool(engine: StreamServer) -> None:
    _idle(engine)
    async with _async_httpx_client() as client:
        streams = [
            await client.send(client.build_request("POST", f"{engine.url}/generate", json=GENERATE), stream=True) for _ in range(POOL)
        ]
        try:
            await asyncio.to_thread(engine.wait_for, "open_streams", POOL)
            control = await client.post(
                f"{engine.url}/pause_generation", json={}, headers={"Authorization": SECRET}, timeout=CONTROL_TIMEOUT_S
            )
            assert control.status_code == 200 and control.json() == {"success": True}
            assert control.headers["x-connection"] not in {s.headers["x-connection"] for s in streams}
            assert SECRET in engine.counts().authorizations
        finally:
            for s in streams:
                await s.aclose()
    await asyncio.to_thread(engine.wait_for, "open_connections", 0)


@pytest.mark.asyncio
async def test_async_httpx_lane_is_warm_never_carries_data_and_closes_with_the_client(engine: StreamServer) -> None:
    _idle(engine)
    client = _async_httpx_client()
    first = await client.post(f"{engine.url}/pause_generation", json={})
    data = await client.post(f"{engine.url}/generate?events=1", json=GENERATE)
    second = await client.post(f"{engine.url}/continue_generation", json={})
    assert b"[DONE]" in data.content
    assert first.headers["x-connection"] == second.headers["x-connection"] != data.headers["x-connection"]
    assert engine.counts().open_connections == 2
    await client.aclose()
    await asyncio.to_thread(engine.wait_for, "open_connections", 0)


# ---- aiohttp ----


def _aiohttp_session(lane: bool = True) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=POOL), middlewares=(ResilientMiddleware(config=_config(lane)),))


@pytest.mark.asyncio
async def test_aiohttp_control_call_passes_a_full_pool(engine: StreamServer, caplog: pytest.LogCaptureFixture) -> None:
    _idle(engine)
    caplog.set_level(logging.DEBUG)
    async with _aiohttp_session() as session:
        streams = [await session.post(f"{engine.url}/generate", json=GENERATE) for _ in range(POOL)]
        try:
            await asyncio.to_thread(engine.wait_for, "open_streams", POOL)
            control = await session.post(
                f"{engine.url}/pause_generation",
                json={},
                headers={"Authorization": SECRET},
                timeout=aiohttp.ClientTimeout(total=CONTROL_TIMEOUT_S),
            )
            assert control.status == 200 and await control.json() == {"success": True}
            assert control.headers["x-connection"] not in {s.headers["x-connection"] for s in streams}
            assert session.connector is not None and session.connector.limit == POOL  # the session's own connector is back
            assert SECRET in engine.counts().authorizations
            assert "lane-secret" not in caplog.text
        finally:
            for s in streams:
                s.close()
    await asyncio.to_thread(engine.wait_for, "open_connections", 0)


@pytest.mark.asyncio
async def test_aiohttp_without_lane_the_control_call_queues(engine: StreamServer) -> None:
    _idle(engine)
    async with _aiohttp_session(lane=False) as session:
        streams = [await session.post(f"{engine.url}/generate", json=GENERATE) for _ in range(POOL)]
        try:
            await asyncio.to_thread(engine.wait_for, "open_streams", POOL)
            with pytest.raises((aiohttp.ServerTimeoutError, asyncio.TimeoutError)):
                await session.post(f"{engine.url}/pause_generation", json={}, timeout=aiohttp.ClientTimeout(total=0.5))
        finally:
            for s in streams:
                s.close()
    await asyncio.to_thread(engine.wait_for, "open_connections", 0)


@pytest.mark.asyncio
async def test_aiohttp_lane_is_warm_never_carries_data_and_closes_with_the_session(engine: StreamServer) -> None:
    _idle(engine)
    session = _aiohttp_session()
    first = await session.post(f"{engine.url}/pause_generation", json={})
    await first.read()
    data = await session.post(f"{engine.url}/generate?events=1", json=GENERATE)
    assert b"[DONE]" in await data.read()
    second = await session.post(f"{engine.url}/continue_generation", json={})
    await second.read()
    again = await session.post(f"{engine.url}/generate?events=1", json=GENERATE)
    await again.read()
    assert first.headers["x-connection"] == second.headers["x-connection"]
    assert data.headers["x-connection"] == again.headers["x-connection"] != first.headers["x-connection"]
    assert engine.counts().open_connections == 2
    await session.close()
    await asyncio.to_thread(engine.wait_for, "open_connections", 0)


@pytest.mark.asyncio
async def test_aiohttp_concurrent_control_and_data_calls_keep_their_pools(engine: StreamServer) -> None:
    """Many control and data calls at once on one session: each control call on the lane, each data call on the session's pool."""
    _idle(engine)
    async with _aiohttp_session() as session:

        async def call(path: str) -> str:
            async with session.post(f"{engine.url}{path}", json=GENERATE) as response:
                await response.read()
                return response.headers["x-connection"]

        paths = ["/pause_generation", "/generate?events=1"] * 6
        seen = await asyncio.gather(*(call(p) for p in paths))
        control = {c for p, c in zip(paths, seen, strict=True) if "generate?" not in p}
        data = {c for p, c in zip(paths, seen, strict=True) if "generate?" in p}
        assert control and data and not control & data
        assert len(data) <= POOL  # the data pool's limit held; the lane never lent it a connection
    await asyncio.to_thread(engine.wait_for, "open_connections", 0)


@pytest.mark.asyncio
async def test_aiohttp_inner_middleware_that_yields_never_lends_the_lane_to_data(engine: StreamServer) -> None:
    """A middleware inside ours that yields before calling on: a data call that finds the lane armed still takes the session's pool.

    (The control call whose arming it found then takes the session's pool too: ``AiohttpLane``.)
    """
    _idle(engine)

    async def yields(request: aiohttp.ClientRequest, handler: aiohttp.ClientHandlerType) -> aiohttp.ClientResponse:
        await asyncio.sleep(0)  # another request's task runs while the session's connector is the lane
        return await handler(request)

    connector = aiohttp.TCPConnector(limit=POOL)
    async with aiohttp.ClientSession(connector=connector, middlewares=(ResilientMiddleware(config=_config()), yields)) as session:

        async def call(path: str) -> str:
            async with session.post(f"{engine.url}{path}", json=GENERATE) as response:
                await response.read()
                return response.headers["x-connection"]

        paths = ["/pause_generation", "/generate?events=1"] * 6
        seen = await asyncio.gather(*(call(p) for p in paths))
        data = {c for p, c in zip(paths, seen, strict=True) if "generate?" in p}
        assert len(data) <= POOL  # the data pool's limit held: no data call took a lane connection
        assert session.connector is connector
    await asyncio.to_thread(engine.wait_for, "open_connections", 0)


@pytest.mark.asyncio
async def test_aiohttp_connector_of_another_class_is_asked_once_and_gets_no_lane(
    engine: StreamServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A session connector that is not a plain ``TCPConnector`` gets no lane; that answer is kept on it, not worked out per call."""
    from resilience.adapters.control_pools import AiohttpLane

    _idle(engine)
    asked: list[object] = []
    real_of = AiohttpLane.of

    def of(session: aiohttp.ClientSession, lane: ControlLane | None) -> AiohttpLane | None:
        asked.append(session)
        return real_of(session, lane)

    monkeypatch.setattr(AiohttpLane, "of", staticmethod(of))

    class Connector(aiohttp.TCPConnector):
        pass

    connector = Connector(limit=POOL)
    async with aiohttp.ClientSession(connector=connector, middlewares=(ResilientMiddleware(config=_config()),)) as session:
        seen = set()
        for _ in range(3):
            async with session.post(f"{engine.url}/pause_generation", json={}) as response:
                assert response.status == 200
                seen.add(response.headers["x-connection"])
        assert len(asked) == 1 and getattr(connector, "_resilience_control_lane", "unset") is None
        async with session.post(f"{engine.url}/generate?events=1", json=GENERATE) as data:
            await data.read()
        assert data.headers["x-connection"] in seen  # one pool for everything
    await asyncio.to_thread(engine.wait_for, "open_connections", 0)


# ---- the instrumentor: frameworks' own clients ----


@pytest.mark.asyncio
async def test_instrumented_clients_get_the_lane(engine: StreamServer) -> None:
    """A framework's own httpx client and aiohttp session, built after ``instrument()``: the pause passes their full pools."""
    _idle(engine)
    instrumentor = SGLangInstrumentor([engine.url]).instrument()
    try:
        client = httpx.Client(limits=httpx.Limits(max_connections=POOL))
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=POOL))
        held = [client.send(client.build_request("POST", f"{engine.url}/generate", json=GENERATE), stream=True) for _ in range(POOL)]
        held_aiohttp = [await session.post(f"{engine.url}/generate", json=GENERATE) for _ in range(POOL)]
        await asyncio.to_thread(engine.wait_for, "open_streams", 2 * POOL)
        paused = client.post(f"{engine.url}/pause_generation", json={}, timeout=CONTROL_TIMEOUT_S)
        assert paused.status_code == 200 and paused.extensions["attempts"]  # through our transport, on its lane
        async with session.post(f"{engine.url}/pause_generation", json={}, timeout=aiohttp.ClientTimeout(total=CONTROL_TIMEOUT_S)) as r:
            assert r.status == 200 and r.attempts  # type: ignore[attr-defined]
        for s in held:
            s.close()
        for a in held_aiohttp:
            a.close()
        client.close()
        await session.close()
    finally:
        instrumentor.uninstrument()
    await asyncio.to_thread(engine.wait_for, "open_connections", 0)


def test_stream_server_names_its_process() -> None:
    """``pid`` is the child's process id while it runs (what the benchmark reads its CPU use by), 0 before and after."""
    server = StreamServer(interval_s=0.2)
    assert server.pid == 0
    with server:
        assert server.pid > 0 and os.path.exists(f"/proc/{server.pid}") == (sys.platform == "linux")
    assert server.pid == 0
