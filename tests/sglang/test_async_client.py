"""AsyncSGLangClient against emulated engines, over aiohttp and httpx; and its parity with SGLangClient.

Both transports run every scenario: the client's own aiohttp session (``ResilientMiddleware``),
and an ``httpx.AsyncClient`` the caller passes with ``AsyncResilientTransport`` mounted.
Engines: two shared by the module, plus at most two more per test (auth, faults, parity).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import inspect
import json
import pickle
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import httpx
import pytest
from pytest_httpserver import HTTPServer

from resilience.adapters.httpx import AsyncResilientTransport
from resilience.adapters.sglang import (
    AsyncSGLangClient,
    ControlResult,
    FlushResult,
    GenerateResult,
    Health,
    ModelInfo,
    SGLangAuthError,
    SGLangClient,
    SGLangError,
    SGLangProtocolError,
    SGLangWeightsReleased,
)
from resilience.deadline import CURRENT_DEADLINE
from resilience.engine_contract import ALL_TAGS, AsyncControlPlaneEngine
from resilience.errors import DeadlineExceeded
from resilience.events import Event, Observer, RetryScheduled
from resilience.outcome import Delivery, attempts_of
from resilience.policy import PolicyTable
from resilience.testing.emulator import EmulatedFleet
from resilience.testing.faults import FaultPlan, FaultRule
from tests.sglang.conftest import FAST_ENGINE, FAST_SGLANG

TRANSPORTS = ("aiohttp", "httpx")
API_KEY = "sk-async-api-51c2"
ADMIN_KEY = "sk-async-admin-8e07"


@asynccontextmanager
async def open_client(
    kind: str,
    url: str,
    events: list[Event] | None = None,
    policies: PolicyTable = FAST_SGLANG,
    client_class: type[AsyncSGLangClient] = AsyncSGLangClient,
    **kwargs: Any,
) -> AsyncIterator[AsyncSGLangClient]:
    """An AsyncSGLangClient over ``kind``: its own aiohttp session (the default), or an httpx.AsyncClient it is given."""
    observers: list[Observer] = [events.append] if events is not None else []
    if kind == "aiohttp":
        async with client_class(url, policies=policies, observers=observers, flush_poll_s=0.05, **kwargs) as client:
            yield client
        assert client.session is None  # aclose closed its own session
        return
    transport = AsyncResilientTransport(policies, observers=observers)
    async with httpx.AsyncClient(transport=transport) as session:
        async with client_class(url, session=session, flush_poll_s=0.05, **kwargs) as client:
            yield client
        assert client.session is session and not session.is_closed  # a session the caller passed stays open


@pytest.fixture(scope="module")
def fleet() -> Iterator[EmulatedFleet]:
    """Two engines shared by the scenarios below (each test leaves its engine unpaused, nothing released)."""
    with EmulatedFleet(2, FAST_ENGINE) as fleet:
        yield fleet


def engine_for(fleet: EmulatedFleet, kind: str) -> int:
    return TRANSPORTS.index(kind)


def calls_to(fleet: EmulatedFleet, i: int, path: str) -> list[dict[str, Any]]:
    return [c for c in fleet.engines[i].record()["calls"] if c["path"] == path]


async def until_idle(client: AsyncSGLangClient, seconds: float = 15.0) -> None:
    """Wait (bounded) until the engine runs and queues nothing: a request the test before aborted may still count as
    running for a moment after its answer, and ``until_running`` would take it for the one this test starts next."""
    deadline = asyncio.get_running_loop().time() + seconds
    while any(rank["num_running_reqs"] or rank["num_waiting_reqs"] for rank in (await client.loads())["loads"]):
        assert asyncio.get_running_loop().time() < deadline, "the engine never became idle"
        await asyncio.sleep(0.02)


async def until_running(client: AsyncSGLangClient, seconds: float = 15.0) -> None:
    """Wait (bounded) until the engine runs a request: a generation task started just before may still be on its way."""
    deadline = asyncio.get_running_loop().time() + seconds
    while not any(rank["num_running_reqs"] for rank in (await client.loads())["loads"]):
        assert asyncio.get_running_loop().time() < deadline, "the generation never started running"
        await asyncio.sleep(0.02)


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", TRANSPORTS)
async def test_offload_onload_round_trip_typed(fleet: EmulatedFleet, kind: str) -> None:
    """pause(retract) -> flush -> release -> resume -> continue, typed results; a retracted request finishes after it.

    After its own retract pause the client flushes with ``?timeout=0`` (a timed flush would count the
    re-queued request as work and time out), so the flush succeeds on the first ask.
    """
    i = engine_for(fleet, kind)
    async with open_client(kind, fleet.urls[i]) as client:
        flushes_before = len(calls_to(fleet, i, "/flush_cache"))
        await until_idle(client)
        straggler = asyncio.create_task(client.generate("straggler", sampling_params={"max_new_tokens": 400}))
        await until_running(client)
        paused = await client.pause_generation(mode="retract")
        assert paused == ControlResult(client.engine, "POST /pause_generation", "Generation paused successfully.", 1)
        assert client.paused_mode == "retract"
        assert (await client.health()).paused_by_us
        flushed = await client.flush_cache(deadline_s=10)
        assert isinstance(flushed, FlushResult) and flushed.polls == 1 and flushed.message.startswith("Cache flushed")
        released = await client.release_memory_occupation(tags=None)
        assert released.endpoint == "POST /release_memory_occupation" and client.released_tags == frozenset(ALL_TAGS)
        resumed = await client.resume_memory_occupation(tags=["kv_cache", "weights", "cuda_graph"])
        assert resumed.endpoint == "POST /resume_memory_occupation" and client.released_tags == frozenset()
        continued = await client.continue_generation(torch_empty_cache=True)
        assert continued.message == "Generation continued successfully." and client.paused_mode is None
        result = await asyncio.wait_for(straggler, 30)
        assert not result.aborted and len(result.output_ids) == 400
    new_flushes = calls_to(fleet, i, "/flush_cache")[flushes_before:]
    assert [c["query"] for c in new_flushes] == ["timeout=0.000"]
    assert fleet.engines[i].alive()


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", TRANSPORTS)
async def test_502_run_is_absorbed_through_the_fault_proxy(kind: str) -> None:
    """Two 502s from the proxy on pause, one on release: the calls succeed, each retry an event, the engine sees each call once."""
    plan = FaultPlan(
        seed=3,
        rules=(
            FaultRule("/pause_generation", "status_before", calls=frozenset({1, 2})),
            FaultRule("/release_memory_occupation", "status_before", calls=frozenset({1})),
        ),
    )
    events: list[Event] = []
    with EmulatedFleet(1, FAST_ENGINE, fault_plan=plan) as faulty:
        async with open_client(kind, faulty.urls[0], events) as client:
            paused = await client.pause_generation(mode="abort")
            await client.flush_cache()
            released = await client.release_memory_occupation(tags=None)
            await client.resume_memory_occupation(tags=None)
            await client.continue_generation()
        record = faulty.engines[0].record()["calls"]
        assert faulty.engines[0].alive()
    assert (paused.attempts, released.attempts) == (3, 2)
    retries = [e for e in events if isinstance(e, RetryScheduled)]
    assert [(e.endpoint, e.reason) for e in retries] == [("POST /pause_generation", "status_502")] * 2 + [
        ("POST /release_memory_occupation", "status_502")
    ]
    assert [c["path"] for c in record if c["path"] in ("/pause_generation", "/release_memory_occupation")] == [
        "/pause_generation",
        "/release_memory_occupation",
    ]


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", TRANSPORTS)
async def test_flush_cache_polls_while_not_idle(fleet: EmulatedFleet, kind: str) -> None:
    """A flush that must not wait on the engine asks again on each "not idle" 400 until the generation ends."""
    i = engine_for(fleet, kind)
    async with open_client(kind, fleet.urls[i]) as client:
        before = len(calls_to(fleet, i, "/flush_cache"))
        await until_idle(client)
        running = asyncio.create_task(client.generate("busy", sampling_params={"max_new_tokens": 400}))
        await until_running(client)
        flushed = await client.flush_cache(deadline_s=20, wait_for_idle=False)
        await asyncio.wait_for(running, 30)
    assert flushed.polls >= 2 and flushed.message.startswith("Cache flushed")
    flushes = calls_to(fleet, i, "/flush_cache")[before:]
    assert len(flushes) == flushed.polls and all(c["query"] == "timeout=0.000" for c in flushes)


class StalledBetweenPolls(AsyncSGLangClient):
    """A client whose loop stalls a whole second after each "not idle" answer, as on an overloaded machine."""

    async def _pause_between_polls(self, seconds: float) -> None:
        await asyncio.sleep(seconds + 1.0)


@pytest.mark.asyncio
@pytest.mark.parametrize("stalled", [False, True], ids=["polling", "stalled-past-the-deadline"])
@pytest.mark.parametrize("kind", TRANSPORTS)
async def test_flush_cache_gives_up_at_its_deadline(fleet: EmulatedFleet, kind: str, stalled: bool) -> None:
    """A flush that never sees idle ends at its deadline with an error naming engine, endpoint and status.

    Stalled: the deadline ends during the pause between polls (CI once saw a bare ``DeadlineExceeded`` when the pause
    outlasted the flush's last 50 ms): the same "still not idle" error, the deadline as its cause, nothing sent after.
    """
    i = engine_for(fleet, kind)
    async with open_client(kind, fleet.urls[i], client_class=StalledBetweenPolls if stalled else AsyncSGLangClient) as client:
        before = len(calls_to(fleet, i, "/flush_cache"))
        await until_idle(client)
        running = asyncio.create_task(client.generate("long", sampling_params={"max_new_tokens": 4000}))
        await until_running(client)
        with pytest.raises(SGLangError) as info:
            await client.flush_cache(deadline_s=0.5 if stalled else 1.0, wait_for_idle=False)
        await client.abort_request(abort_all=True)
        assert (await asyncio.wait_for(running, 30)).aborted
    text = str(info.value)
    assert client.engine in text and "POST /flush_cache" in text and "HTTP 400" in text and "still not idle" in text
    if stalled:
        assert "after 1 tries" in text and isinstance(info.value.__cause__, DeadlineExceeded)
        assert len(calls_to(fleet, i, "/flush_cache")) - before == 1


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", TRANSPORTS)
async def test_cancelled_flush_sends_nothing_more(fleet: EmulatedFleet, kind: str) -> None:
    """Cancelling the task of a polling flush ends it at once: CancelledError, no flush sent after, no deadline left behind."""
    i = engine_for(fleet, kind)
    async with open_client(kind, fleet.urls[i]) as client:
        before = len(calls_to(fleet, i, "/flush_cache"))
        await until_idle(client)
        running = asyncio.create_task(client.generate("long", sampling_params={"max_new_tokens": 4000}))
        await until_running(client)
        flushing = asyncio.create_task(client.flush_cache(deadline_s=20, wait_for_idle=False))
        while len(calls_to(fleet, i, "/flush_cache")) - before < 2:  # bounded by the flush's own deadline
            assert not flushing.done(), flushing
            await asyncio.sleep(0.05)
        flushing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await flushing
        sent = len(calls_to(fleet, i, "/flush_cache")) - before
        await asyncio.sleep(0.3)
        assert CURRENT_DEADLINE.get() is None
        assert len(calls_to(fleet, i, "/flush_cache")) - before == sent >= 2
        await client.abort_request(abort_all=True)
        assert (await asyncio.wait_for(running, 30)).aborted


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", TRANSPORTS)
async def test_generate_and_generate_stream(fleet: EmulatedFleet, kind: str) -> None:
    """generate answers typed; generate_stream yields growing cumulative results ending with the finish reason."""
    i = engine_for(fleet, kind)
    async with open_client(kind, fleet.urls[i]) as client:
        whole = await client.generate("same prompt", sampling_params={"max_new_tokens": 6})
        chunks = [chunk async for chunk in client.generate_stream("same prompt", sampling_params={"max_new_tokens": 6})]
        by_ids = await client.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 2})
        with pytest.raises(ValueError, match="exactly one of text or input_ids"):
            await client.generate()
    assert isinstance(whole, GenerateResult) and whole.finish_reason == "length" and len(whole.output_ids) == 6
    assert len(chunks) == 6 and [len(c.output_ids) for c in chunks] == [1, 2, 3, 4, 5, 6]
    assert chunks[-1].text == whole.text and chunks[-1].output_ids == whole.output_ids and chunks[-1].finish_reason == "length"
    assert all(c.finish_reason is None for c in chunks[:-1])
    assert len(by_ids.output_ids) == 2


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", TRANSPORTS)
async def test_typed_reads(fleet: EmulatedFleet, kind: str) -> None:
    """Reads come back typed; the weight version follows update_weight_version."""
    i = engine_for(fleet, kind)
    async with open_client(kind, fleet.urls[i]) as client:
        health = await client.health()
        assert isinstance(health, Health) and health.healthy and health.status == 200
        assert await client.ready() and await client.models() == ["emulated/sglang-model"]
        assert "num_running_reqs" in str(await client.loads())
        assert (await client.update_weight_version(f"v-{kind}")).success
        info = await client.model_info()
        assert isinstance(info, ModelInfo) and info.weight_version == f"v-{kind}"
        assert "version" in await client.server_info()


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", TRANSPORTS)
async def test_a_weight_update_into_released_weights_is_refused_unsent(fleet: EmulatedFleet, kind: str) -> None:
    """As SGLangClient: after its own release of the weights, a weight route is refused unsent (it would kill the engine)."""
    i = engine_for(fleet, kind)
    before = len(calls_to(fleet, i, "/update_weights_from_disk"))
    async with open_client(kind, fleet.urls[i]) as client:
        await client.pause_generation("retract")
        await client.release_memory_occupation(["weights"])
        with pytest.raises(SGLangWeightsReleased) as info:
            await client.update_weights_from_disk("emulated/sglang-model")
        assert client.engine in str(info.value) and "POST /update_weights_from_disk" in str(info.value)
        assert len(calls_to(fleet, i, "/update_weights_from_disk")) == before and fleet.engines[i].alive()
        await client.resume_memory_occupation(["weights"])
        assert (await client.update_weights_from_disk("emulated/sglang-model")).success
        await client.continue_generation()


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", TRANSPORTS)
async def test_wrong_key_is_refused_and_never_shown(kind: str) -> None:
    """A wrong key raises SGLangAuthError naming which key was refused; no key appears in repr, str or args."""
    config = dataclasses.replace(FAST_ENGINE, api_key=API_KEY, admin_api_key=ADMIN_KEY)
    events: list[Event] = []
    with EmulatedFleet(1, config) as fleet:
        url = fleet.urls[0]
        async with open_client(kind, url, events, api_key="sk-wrong-api", admin_api_key="sk-wrong-admin") as client:
            with pytest.raises(SGLangAuthError) as read_refused:
                await client.model_info()
            with pytest.raises(SGLangAuthError) as admin_refused:
                await client.pause_generation(mode="abort")
            with pytest.raises(SGLangAuthError) as stream_refused:
                async for _ in client.generate_stream("x", sampling_params={"max_new_tokens": 1}):
                    pass
            assert (await client.health()).healthy  # probes take no key
        async with open_client(kind, url, events, api_key=API_KEY, admin_api_key=ADMIN_KEY) as good:
            assert (await good.pause_generation(mode="abort")).attempts == 1
            assert (await good.continue_generation()).endpoint == "POST /continue_generation"
    assert (read_refused.value.key, admin_refused.value.key, stream_refused.value.key) == ("api_key", "admin_api_key", "api_key")
    assert read_refused.value.status == 401 and "GET /model_info" in str(read_refused.value)
    errors = (read_refused.value, admin_refused.value, stream_refused.value)
    assert len(events) >= 10 and not [e for e in events if isinstance(e, RetryScheduled)]  # a refusal is never retried
    shown = [repr(client), repr(good), str(client), *(str(e) + repr(e.args) for e in errors), *map(repr, events)]
    for secret in (API_KEY, ADMIN_KEY, "sk-wrong-api", "sk-wrong-admin"):
        assert not any(secret in text for text in shown), secret
    assert "api_key=***" in repr(client)


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", TRANSPORTS)
async def test_malformed_answer_shows_endpoint_status_and_excerpt(httpserver: HTTPServer, kind: str) -> None:
    """A 200 that is not JSON, or a bad SSE chunk, raises SGLangProtocolError naming endpoint, status and an excerpt."""
    httpserver.expect_request("/model_info").respond_with_data("<html>gateway page</html>", status=200)
    httpserver.expect_request("/generate").respond_with_data(
        'data: {"text": "a", "output_ids": [1], "meta_info": {}}\n\ndata: <html>oops</html>\n\n', content_type="text/event-stream"
    )
    async with open_client(kind, httpserver.url_for("/").rstrip("/")) as client:
        with pytest.raises(SGLangProtocolError) as info:
            await client.model_info()
        seen: list[GenerateResult] = []
        with pytest.raises(SGLangProtocolError) as stream_info:
            async for chunk in client.generate_stream("x"):
                seen.append(chunk)
    text = str(info.value)
    assert "GET /model_info" in text and "HTTP 200" in text and "not JSON" in text and "gateway page" in text
    shipped = pickle.loads(pickle.dumps(info.value))  # errors travel pickled (Ray): aiohttp's response stays behind
    assert type(shipped) is SGLangProtocolError and str(shipped) == text and shipped.status == 200
    for error in (info.value, shipped, stream_info.value):  # the delivery record survives pickling, aiohttp's or httpx's
        assert [(r.delivery, r.status) for r in attempts_of(error) or ()] == [(Delivery.RESPONDED, 200)], error
    assert info.value.status == 200 and info.value.body_excerpt == "<html>gateway page</html>"
    assert [c.text for c in seen] == ["a"]
    assert "POST /generate" in str(stream_info.value) and "bad SSE chunk" in str(stream_info.value) and "oops" in str(stream_info.value)


@pytest.mark.filterwarnings("ignore:Unclosed client session")
def test_own_session_lifetime_pool_and_loop(httpserver: HTTPServer) -> None:
    """The own session opens lazily in the running loop with the pool asked for; another open loop is refused; it reopens."""
    httpserver.expect_request("/ready").respond_with_data("ok")
    client = AsyncSGLangClient(httpserver.url_for("/").rstrip("/"), policies=FAST_SGLANG, limit_per_host=3)
    assert client.session is None
    shipped = pickle.loads(pickle.dumps(client))  # an unopened client travels (a Ray actor's argument)
    assert repr(shipped) == repr(client) and shipped.session is None

    async def use(close: bool) -> tuple[int, int]:
        assert await client.ready()
        session = client.session
        assert isinstance(session, aiohttp.ClientSession) and isinstance(session.connector, aiohttp.TCPConnector)
        sizes = session.connector.limit_per_host, session.connector.limit
        if close:
            await client.aclose()
            assert session.closed and client.session is None
        return sizes

    assert asyncio.run(use(close=True)) == (3, 3)
    first = asyncio.new_event_loop()
    try:
        assert first.run_until_complete(use(close=False)) == (3, 3)
        with pytest.raises(RuntimeError, match="opened its session in another event loop, which is still open"):
            asyncio.run(use(close=True))
        first.run_until_complete(use(close=False))  # still its loop
    finally:
        first.close()
    assert asyncio.run(use(close=True)) == (3, 3)  # the first loop is closed: a new session in this one
    assert len(httpserver.log) == 4


# -- parity with SGLangClient -------------------------------------------------------------------------

Step = tuple[str, tuple[Any, ...], dict[str, Any]]

PARITY_STEPS: tuple[Step, ...] = (
    ("health", (), {}),
    ("health_generate", (), {}),
    ("ready", (), {}),
    ("models", (), {}),
    ("server_info", (), {}),
    ("loads", (), {}),
    ("update_weight_version", ("v-parity",), {}),
    ("model_info", (), {}),
    ("generate", ("parity",), {"sampling_params": {"max_new_tokens": 5}, "rid": "parity-1"}),
    ("generate_stream", ("parity",), {"sampling_params": {"max_new_tokens": 3}, "rid": "parity-2"}),
    ("abort_request", ("no-such-rid",), {}),
    ("end_weight_update", (), {}),  # refused: no session open
    ("init_weights_update_group", ("127.0.0.1", 29500, 1, 2), {}),
    ("begin_weight_update", (), {}),
    ("update_weights_from_tensor", (["t0"],), {"weight_version": "v-tensor"}),
    ("update_weights_from_distributed", (["w"], ["bfloat16"], [[2, 2]]), {"weight_version": "v-dist"}),
    ("end_weight_update", (), {}),
    ("update_weights_from_disk", ("/ckpt/step-1",), {"weight_version": "v-disk"}),
    ("pause_generation", (), {"mode": "retract"}),
    ("health", (), {}),
    ("flush_cache", (), {"deadline_s": 10}),
    ("release_memory_occupation", (), {"tags": ["kv_cache"]}),
    ("resume_memory_occupation", (), {"tags": ["kv_cache"]}),
    ("continue_generation", (), {}),
    ("model_info", (), {}),
)

_VOLATILE = frozenset({"e2e_latency", "timestamp", "latency_s", "last_gen_throughput", "gen_throughput", "port", "pid"})
"""Measured timings and addresses, which differ between two engines answering the same calls."""


def public_methods(cls: type) -> set[str]:
    return {name for name, member in inspect.getmembers(cls, callable) if not name.startswith("_")} - {"close", "aclose"}


def normalize(value: Any, engine: str) -> Any:
    """``value`` with the engine's address replaced and timings dropped, for comparing two engines' answers."""
    if isinstance(value, str):
        return value.replace(engine, "<engine>").replace(engine.rsplit(":", 1)[1], "<port>")
    if isinstance(value, dict):
        return {k: normalize(v, engine) for k, v in value.items() if k not in _VOLATILE}
    if isinstance(value, (list, tuple)):
        return [normalize(v, engine) for v in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: getattr(value, f.name) for f in dataclasses.fields(value) if f.name not in _VOLATILE}
        return (type(value).__name__, normalize(fields, engine))
    return value


def outcome(call: Callable[[], Any], engine: str) -> Any:
    try:
        result = call()
        return ("ok", normalize(list(result) if isinstance(result, Iterator) else result, engine))
    except SGLangError as exc:
        return ("error", type(exc).__name__, normalize(str(exc), engine))


async def async_outcome(call: Callable[[], Any], engine: str) -> Any:
    try:
        result = call()
        result = [x async for x in result] if inspect.isasyncgen(result) else await result
        return ("ok", normalize(result, engine))
    except SGLangError as exc:
        return ("error", type(exc).__name__, normalize(str(exc), engine))


def test_sync_and_async_clients_give_identical_results(fleet: EmulatedFleet) -> None:
    """The same calls on two identical engines: SGLangClient and AsyncSGLangClient answer the same, method by method."""
    sync_methods, async_methods = public_methods(SGLangClient), public_methods(AsyncSGLangClient)
    assert len(sync_methods) >= 20 and sync_methods == async_methods
    assert {name for name, _, _ in PARITY_STEPS} == sync_methods, sync_methods ^ {name for name, _, _ in PARITY_STEPS}
    for name in async_methods:
        method = getattr(AsyncSGLangClient, name)
        assert inspect.iscoroutinefunction(method) or inspect.isasyncgenfunction(method), name
        assert inspect.signature(method) == inspect.signature(getattr(SGLangClient, name)).replace(
            return_annotation=inspect.signature(method).return_annotation
        ), name

    with EmulatedFleet(2, FAST_ENGINE) as pair:
        sync_url, async_url = pair.urls
        sync_client = SGLangClient(sync_url, policies=FAST_SGLANG, flush_poll_s=0.05)
        sync_results = [
            outcome(functools.partial(getattr(sync_client, name), *args, **kwargs), sync_client.engine)
            for name, args, kwargs in PARITY_STEPS
        ]

        async def run_async() -> list[Any]:
            async with open_client("aiohttp", async_url) as client:
                return [
                    await async_outcome(functools.partial(getattr(client, name), *args, **kwargs), client.engine)
                    for name, args, kwargs in PARITY_STEPS
                ]

        async_results = asyncio.run(run_async())
    assert len(sync_results) == len(PARITY_STEPS) and sum(r[0] == "ok" for r in sync_results) >= 20
    assert [r[0] for r in sync_results].count("error") == 1  # the end_weight_update without a session
    for step, mine, theirs in zip(PARITY_STEPS, sync_results, async_results, strict=True):
        assert mine == theirs, (step[0], json.dumps(mine, default=str)[:500], json.dumps(theirs, default=str)[:500])


def test_satisfies_the_async_engine_contract() -> None:
    """The barrier's AsyncControlPlaneEngine: the five calls are coroutines taking the contract's keywords."""
    client: AsyncControlPlaneEngine = AsyncSGLangClient("http://127.0.0.1:9")
    for name in ("pause_generation", "flush_cache", "release_memory_occupation", "resume_memory_occupation", "continue_generation"):
        method = getattr(client, name)
        contract = inspect.signature(getattr(AsyncControlPlaneEngine, name))
        assert inspect.iscoroutinefunction(method), name
        assert set(contract.parameters) - {"self"} <= set(inspect.signature(method).parameters), name


def test_bad_arguments_are_named() -> None:
    """A bad URL, a session of the wrong kind, or own-session knobs with a passed session: each error says what is wrong."""
    with pytest.raises(ValueError, match="AsyncSGLangClient base_url must start with http"):
        AsyncSGLangClient("127.0.0.1:30000")
    events: list[Event] = []
    with httpx.Client() as sync_session, pytest.raises(TypeError, match=r"an httpx\.AsyncClient, but was a httpx\.Client"):
        AsyncSGLangClient("http://127.0.0.1:9", session=sync_session)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="session= and observers=, retry_budget="):
        AsyncSGLangClient("http://127.0.0.1:9", session=httpx.AsyncClient(), observers=[events.append], retry_budget=None)
    with pytest.raises(TypeError, match="breakr"):  # a misspelt middleware knob fails at once, not at the first call
        AsyncSGLangClient("http://127.0.0.1:9", breakr=None)
    with pytest.raises(ValueError, match="limit_per_host must be an int >= 1, but was 0"):
        AsyncSGLangClient("http://127.0.0.1:9", limit_per_host=0)
    with pytest.raises(ValueError, match="pause mode must be"):
        asyncio.run(AsyncSGLangClient("http://127.0.0.1:9").pause_generation(mode="sideways"))  # type: ignore[arg-type]
