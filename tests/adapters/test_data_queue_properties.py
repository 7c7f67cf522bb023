"""``DataQueue`` and ``SyncDataQueue`` under random traffic: no slot is ever lost or given twice, whatever each request meets.

Each example runs a random set of data requests through one
``AsyncResilientTransport`` over a pool of 1-3 connections, at once: streams
read to their end or left after their first event (a real ``StreamServer``),
answers cut off halfway (the read fails), a refused port (every attempt
fails before sending), pool timeouts shorter than the wait, and tasks
cancelled at a random moment (waiting for a slot, sending, reading). The
caller keeps going: every outcome is caught and the next example reuses
nothing but the servers. What must hold: httpcore's pool never holds more
requests than its limit, and once every task has ended the queue holds no
slot and no waiter. The sync queue meets the same requests from threads
(no cancellation: a thread cannot be cancelled). ``CPR_DATA_QUEUE_EXAMPLES``
sets the number of examples (default 12 each, a few seconds).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

import httpcore
import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import resilience
from resilience.adapters.driver_config import DriverConfig
from resilience.adapters.httpx import AsyncResilientTransport, ResilientTransport
from resilience.adapters.sglang import SGLANG_POLICIES
from resilience.testing.stream_server import StreamServer
from tests.conftest import LONG_TIMEOUT, free_port
from tests.servers import cut_off_stream

EXAMPLES = int(os.environ.get("CPR_DATA_QUEUE_EXAMPLES", "12"))
"""Random examples; more with ``CPR_DATA_QUEUE_EXAMPLES``."""
GENERATE = {"text": "hi", "stream": True}
KINDS = ("read to the end", "left after one event", "cut off halfway", "refused", "short pool timeout")


@pytest.fixture(scope="module")
def engine() -> Iterator[StreamServer]:
    with StreamServer(interval_s=0.02) as server:
        yield server


@pytest.fixture(scope="module")
def cut_off() -> Iterator[str]:
    """A server that answers each request with a stream's first chunk, then closes the connection."""
    with cut_off_stream() as url:
        yield url


def _url(kind: str, urls: dict[str, str]) -> str:
    """Where a request of ``kind`` goes (a stream that is left early reads three events; one with a short pool timeout, one)."""
    engine = urls["engine"]
    return {
        "read to the end": f"{engine}/generate?events=2",
        "left after one event": f"{engine}/generate?events=3",
        "short pool timeout": f"{engine}/generate?events=1",
        "cut off halfway": f"{urls['cut off']}/generate",
    }.get(kind, f"{urls['refused']}/generate")


def _timeout(kind: str) -> httpx.Timeout:
    return httpx.Timeout(LONG_TIMEOUT, pool=0.01 if kind == "short pool timeout" else LONG_TIMEOUT)


async def _one(client: httpx.AsyncClient, kind: str, urls: dict[str, str]) -> str:
    """One data request of ``kind``; what it met."""
    async with client.stream("POST", _url(kind, urls), json=GENERATE, timeout=_timeout(kind)) as response:
        async for _ in response.aiter_raw():
            if kind == "left after one event":
                break
    return str(response.status_code)


def _sync_one(client: httpx.Client, kind: str, urls: dict[str, str]) -> str:
    """``_one`` from a thread."""
    with client.stream("POST", _url(kind, urls), json=GENERATE, timeout=_timeout(kind)) as response:
        for _ in response.iter_raw():
            if kind == "left after one event":
                break
    return str(response.status_code)


def _verdict(plan: Sequence[object], outcomes: Sequence[object], pool: tuple[int, int], queue: tuple[int, int]) -> None:
    """Every request ended on an answer, an httpx error or its cancellation; the pool's most requests at once were within
    its limit (``pool``: most, limit); the queue holds no slot and no waiter (``queue``: inside, waiting)."""
    assert len(outcomes) == len(plan) > 0
    unexpected = [o for o in outcomes if isinstance(o, BaseException) and not isinstance(o, (httpx.HTTPError, asyncio.CancelledError))]
    assert not unexpected, unexpected
    assert pool[0] <= pool[1], pool
    assert queue == (0, 0), (queue, plan, outcomes)


async def _example(plan: list[tuple[str, float | None]], limit: int, urls: dict[str, str]) -> None:
    inner = httpx.AsyncHTTPTransport(limits=httpx.Limits(max_connections=limit))
    transport = AsyncResilientTransport(transport=inner, config=DriverConfig(policies=SGLANG_POLICIES))
    queue = transport.queue
    assert queue is not None
    pool = inner._pool
    assert type(pool) is httpcore.AsyncConnectionPool
    most = 0
    async with httpx.AsyncClient(transport=transport) as client:
        tasks = [asyncio.create_task(_one(client, kind, urls)) for kind, _ in plan]
        cancels = [
            asyncio.get_running_loop().call_later(delay, task.cancel)
            for task, (_, delay) in zip(tasks, plan, strict=True)
            if delay is not None
        ]
        for _ in range(int(LONG_TIMEOUT / 0.002)):
            most = max(most, len(pool._requests))
            if all(task.done() for task in tasks):
                break
            await asyncio.sleep(0.002)
        outcomes = await asyncio.gather(*tasks, return_exceptions=True)
        for cancel in cancels:
            cancel.cancel()
    _verdict(plan, outcomes, (most, limit), (queue.inside, queue.waiting))


@given(
    plan=st.lists(st.tuples(st.sampled_from(KINDS), st.none() | st.floats(0.0, 0.08)), min_size=1, max_size=10),
    limit=st.integers(1, 3),
)
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_no_slot_is_lost_or_given_twice(engine: StreamServer, cut_off: str, plan: list[tuple[str, float | None]], limit: int) -> None:
    """Random requests, failures and cancellations through a small pool: the pool stays within its limit, the queue ends empty."""
    urls = {"engine": engine.url, "cut off": cut_off, "refused": f"http://127.0.0.1:{free_port()}"}
    with resilience.set_testing(True, attempts=2):
        asyncio.run(_example(plan, limit, urls))


def _sync_example(plan: list[str], limit: int, urls: dict[str, str]) -> None:
    inner = httpx.HTTPTransport(limits=httpx.Limits(max_connections=limit))
    transport = ResilientTransport(transport=inner, config=DriverConfig(policies=SGLANG_POLICIES))
    queue = transport.queue
    assert queue is not None
    pool = inner._pool
    assert type(pool) is httpcore.ConnectionPool
    most = 0
    with httpx.Client(transport=transport) as client, ThreadPoolExecutor(len(plan)) as threads:
        futures = [threads.submit(_sync_one, client, kind, urls) for kind in plan]
        for _ in range(int(LONG_TIMEOUT / 0.002)):
            most = max(most, len(pool._requests))
            if all(future.done() for future in futures):
                break
            time.sleep(0.002)
        outcomes = [future.exception() or future.result() for future in futures]
    _verdict(plan, outcomes, (most, limit), (queue.inside, queue.waiting))


@given(plan=st.lists(st.sampled_from(KINDS), min_size=1, max_size=10), limit=st.integers(1, 3))
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_sync_no_slot_is_lost_or_given_twice(engine: StreamServer, cut_off: str, plan: list[str], limit: int) -> None:
    """The same from threads: the pool stays within its limit, the queue ends empty."""
    urls = {"engine": engine.url, "cut off": cut_off, "refused": f"http://127.0.0.1:{free_port()}"}
    with resilience.set_testing(True, attempts=2):
        _sync_example(plan, limit, urls)
