"""A control call's latency while streaming generations fill the same client's pool: bare, mounted without the lane, mounted.

Run: ``.venv/bin/python benchmarks/bench_control_lane.py [--streams 1000] [--samples 200] [--queued-samples 8] [--quick]``

The field's finding (prime-rl #1111): on one shared pool a weight update took
8.58 s under 4,000 concurrent streams; a dedicated admin client took 55 ms.
Here one ``StreamServer`` (``resilience/testing/stream_server.py``, its own
process) streams ``/generate`` (``EVENTS`` events, one every ``INTERVAL_S``)
and answers ``POST /pause_generation`` at once. For each driver and client
kind, one client carries both: a stream load of workers that each send
``/generate``, read the stream to its end and start again, and control calls
(``POST /pause_generation``). Three clients per driver:

- ``bare``: the library alone (``requests.Session``, ``httpx.Client`` /
  ``AsyncClient``, ``aiohttp.ClientSession``);
- ``mounted, no lane``: our driver over ``SGLANG_POLICIES`` with
  ``DriverConfig(control_lane=None)``;
- ``mounted``: our driver with the default ``ControlLane()``.

The async drivers (httpx async, aiohttp) carry ``--streams`` streams (1,000)
through their default pool limit (100 connections): the rest wait in the
pool's queue, and so does a control call that shares the pool. The sync
drivers would need a thread per stream; they carry ``SYNC_STREAMS`` threads
through a pool of ``SYNC_POOL`` (requests: ``pool_maxsize=16,
pool_block=True``, its only pool that waits; httpx: ``Limits(max_connections=16)``),
the same shape at a size 2 cores can run. Idle: the same client, no streams.
A control call that waits in the queue takes seconds, so those rows take
``--queued-samples`` calls, started ``QUEUED_GAP_S`` apart; the others take
``--samples``, one after another. Goal: mounted p99 under load within 2x of
its idle p50. The last column is the floor under load that no pool can
lift: how long the measuring thread (sync: ``time.sleep(0)``, giving the GIL
to the streaming threads) or task (async: ``asyncio.sleep(0)``, a turn of the
loop the streams share) waits to run again, sampled just before each
control call of the ``mounted`` rows. Idle samples: half before the load,
half after it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor

import aiohttp
import httpx
import requests

from resilience.adapters.aiohttp import ResilientMiddleware
from resilience.adapters.control_lane import ControlLane
from resilience.adapters.driver_config import DriverConfig
from resilience.adapters.httpx import AsyncResilientTransport, ResilientTransport
from resilience.adapters.requests import resilient_session
from resilience.adapters.sglang import SGLANG_POLICIES
from resilience.testing.stream_server import StreamServer

INTERVAL_S = 0.5
"""Seconds between a stream's events."""
EVENTS = 2
"""Events per stream: each stream holds its connection about ``EVENTS * INTERVAL_S`` = 1 s."""
SYNC_STREAMS = 64
"""Streaming threads of the sync drivers."""
SYNC_POOL = 16
"""The sync drivers' pool limit: ``SYNC_STREAMS - SYNC_POOL`` threads wait in its queue."""
SAMPLE_GAP_S = 0.005
"""Seconds between the control calls of an idle-pool row under load, so that they spread over the streams' phases."""
QUEUED_GAP_S = 0.25
"""Seconds between the starts of the control calls that wait behind streams."""
TIMEOUT_S = 120.0
"""Every call's timeout: long enough that a queued control call ends by its answer, not by a pool timeout."""
MODES = ("bare", "mounted, no lane", "mounted")
CONTROL = "/pause_generation"
GENERATE = f"/generate?events={EVENTS}"
BODY = {"text": "hi", "stream": True}


def _config(lane: bool) -> DriverConfig:
    return DriverConfig(policies=SGLANG_POLICIES, control_lane=ControlLane() if lane else None)


def _ms(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return 1000 * ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


# ---- the sync drivers: threads ----


def _sync_client(driver: str, mode: str) -> tuple[Callable[[str], None], Callable[[], None]]:
    """(send one request to a path and read it whole, close) for a sync driver's client."""
    if driver == "requests":
        if mode == "bare":
            session = requests.Session()
            adapter = requests.adapters.HTTPAdapter(pool_maxsize=SYNC_POOL, pool_block=True)
            session.mount("http://", adapter)
        else:
            session = resilient_session(config=_config(mode == "mounted"), pool_maxsize=SYNC_POOL, pool_block=True)

        def send(path: str) -> None:
            with session.post(f"{url_of[0]}{path}", json=BODY, timeout=TIMEOUT_S, stream=True) as response:
                for _ in response.iter_content(None):
                    pass

        return send, session.close
    limits = httpx.Limits(max_connections=SYNC_POOL)
    inner = httpx.HTTPTransport(limits=limits)
    transport: httpx.BaseTransport = inner if mode == "bare" else ResilientTransport(transport=inner, config=_config(mode == "mounted"))
    client = httpx.Client(transport=transport, timeout=TIMEOUT_S)

    def send_httpx(path: str) -> None:
        with client.stream("POST", f"{url_of[0]}{path}", json=BODY) as response:
            for _ in response.iter_raw():
                pass

    return send_httpx, client.close


url_of: list[str] = [""]
"""The engine's URL (set once the server is up)."""


def _sync_lag() -> float:
    """How long this thread waits to run again after giving the GIL up (``time.sleep(0)``): the scheduling floor."""
    started = time.perf_counter()
    time.sleep(0)
    return time.perf_counter() - started


def _sync_row(driver: str, mode: str, streams: int, samples: int, queued: int) -> tuple[list[float], list[float], list[float]]:
    """(idle seconds, loaded seconds, scheduling lags under load) of the control calls of one sync client."""
    send, close = _sync_client(driver, mode)
    try:
        idle = [_timed(send) for _ in range(samples // 2)]
        stop = threading.Event()

        def worker() -> None:
            while not stop.is_set():
                try:
                    send(GENERATE)
                except (requests.RequestException, httpx.HTTPError):
                    if not stop.is_set():
                        raise

        threads = [threading.Thread(target=worker, daemon=True) for _ in range(streams)]
        for t in threads:
            t.start()
        time.sleep(2 * EVENTS * INTERVAL_S)  # every pooled connection streaming, the rest queued
        loaded, lags = [], []
        if mode == "mounted":
            for _ in range(samples):  # spread over the streams' phases; each control call beside a lag sample
                time.sleep(SAMPLE_GAP_S)
                lags.append(_sync_lag())
                loaded.append(_timed(send))
        else:
            with ThreadPoolExecutor(queued) as pool:
                futures = []
                for _ in range(queued):
                    futures.append(pool.submit(_timed, send))
                    time.sleep(QUEUED_GAP_S)
                loaded = [f.result() for f in futures]
        stop.set()
        for t in threads:
            t.join(TIMEOUT_S)
        idle += [_timed(send) for _ in range(samples - samples // 2)]  # half before the load, half after
        return idle, loaded, lags
    finally:
        close()


def _timed(send: Callable[[str], None]) -> float:
    started = time.perf_counter()
    send(CONTROL)
    return time.perf_counter() - started


# ---- the async drivers: one event loop ----


async def _async_client(driver: str, mode: str) -> tuple[Callable[[str], Awaitable[None]], Callable[[], Awaitable[None]]]:
    if driver == "httpx async":
        transport: httpx.AsyncBaseTransport | None = None
        if mode != "bare":
            transport = AsyncResilientTransport(config=_config(mode == "mounted"))
        client = httpx.AsyncClient(transport=transport, timeout=TIMEOUT_S)

        async def send(path: str) -> None:
            async with client.stream("POST", f"{url_of[0]}{path}", json=BODY) as response:
                async for _ in response.aiter_raw():
                    pass

        return send, client.aclose
    middlewares = () if mode == "bare" else (ResilientMiddleware(config=_config(mode == "mounted")),)
    session = aiohttp.ClientSession(middlewares=middlewares, timeout=aiohttp.ClientTimeout(total=TIMEOUT_S))

    async def send_aiohttp(path: str) -> None:
        async with session.post(f"{url_of[0]}{path}", json=BODY) as response:
            async for _ in response.content.iter_any():
                pass

    return send_aiohttp, session.close


async def _atimed(send: Callable[[str], Awaitable[None]]) -> float:
    started = time.perf_counter()
    await send(CONTROL)
    return time.perf_counter() - started


async def _async_lag() -> float:
    """How long a task waits for its next turn on the loop (``asyncio.sleep(0)``): the scheduling floor."""
    started = time.perf_counter()
    await asyncio.sleep(0)
    return time.perf_counter() - started


async def _async_row(driver: str, mode: str, streams: int, samples: int, queued: int) -> tuple[list[float], list[float], list[float]]:
    send, close = await _async_client(driver, mode)
    try:
        idle = [await _atimed(send) for _ in range(samples // 2)]
        stop = asyncio.Event()

        async def worker() -> None:
            while not stop.is_set():
                await send(GENERATE)

        tasks = [asyncio.create_task(worker()) for _ in range(streams)]
        await asyncio.sleep(2 * EVENTS * INTERVAL_S)
        loaded, lags = [], []
        if mode == "mounted":
            for _ in range(samples):
                await asyncio.sleep(SAMPLE_GAP_S)
                lags.append(await _async_lag())
                loaded.append(await _atimed(send))
        else:
            calls = []
            for _ in range(queued):
                calls.append(asyncio.create_task(_atimed(send)))
                await asyncio.sleep(QUEUED_GAP_S)
            loaded = list(await asyncio.gather(*calls))
        stop.set()
        for task in tasks:
            task.cancel()  # a cancelled stream closes its connection: the next row starts with none open
        await asyncio.gather(*tasks, return_exceptions=True)
        idle += [await _atimed(send) for _ in range(samples - samples // 2)]
        return idle, loaded, lags
    finally:
        await close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=1000, help="streams of the async drivers (default 1000)")
    parser.add_argument("--samples", type=int, default=200, help="control calls per idle or lane row (default 200)")
    parser.add_argument("--queued-samples", type=int, default=8, help="control calls per row that queues behind streams (default 8)")
    parser.add_argument("--quick", action="store_true", help="100 streams, 40 samples, 3 queued: a check of the chain")
    args = parser.parse_args(argv)
    if args.quick:
        args.streams, args.samples, args.queued_samples = 100, 40, 3
    load_before = os.getloadavg()
    rows: list[tuple[str, str, str, list[float], list[float], list[float]]] = []
    with StreamServer(interval_s=INTERVAL_S, events=EVENTS) as server:
        url_of[0] = server.url
        for driver in ("requests", "httpx sync"):
            for mode in MODES:
                print(f"{driver}, {mode} ...", file=sys.stderr, flush=True)
                idle, loaded, lags = _sync_row(driver, mode, SYNC_STREAMS, args.samples, args.queued_samples)
                rows.append((driver, mode, f"{SYNC_STREAMS} threads, pool {SYNC_POOL}", idle, loaded, lags))
        for driver in ("httpx async", "aiohttp"):
            for mode in MODES:
                print(f"{driver}, {mode} ...", file=sys.stderr, flush=True)
                idle, loaded, lags = asyncio.run(_async_row(driver, mode, args.streams, args.samples, args.queued_samples))
                rows.append((driver, mode, f"{args.streams} tasks, pool 100", idle, loaded, lags))
    load_after = os.getloadavg()
    print("## Control calls beside streaming generation: the control lane\n")
    print(
        f"`.venv/bin/python benchmarks/bench_control_lane.py{' --quick' if args.quick else ''}`: a `POST /pause_generation`'s "
        f"latency through the same client that streams `/generate` ({EVENTS} events, {INTERVAL_S} s apart) to one loopback "
        f"`StreamServer`. Async drivers: {args.streams} streams on one event loop through the library's default pool "
        f"(100 connections); sync drivers: {SYNC_STREAMS} streaming threads through a pool of {SYNC_POOL} (1,000 would need "
        f"1,000 threads). Queued rows: {args.queued_samples} calls started {QUEUED_GAP_S} s apart; the others "
        f"{args.samples} calls {SAMPLE_GAP_S * 1000:.0f} ms apart (idle: half before the load, half after). "
        f"{os.cpu_count()} CPUs shared with other work: load average {load_before[0]:.2f} before, {load_after[0]:.2f} "
        "after. Goal: mounted p99 under load <= 2x its idle p50. Scheduling lag: how long the measuring thread (`time.sleep(0)`) "
        "or task (`asyncio.sleep(0)`) waited for its next turn just before each control call of the `mounted` rows: the "
        "floor under load that no pool lifts.\n"
    )
    print(
        "| driver | client | load | idle p50 ms | idle p99 ms | loaded p50 ms | loaded p99 ms "
        "| loaded p99 / idle p50 | loaded p99 / idle p99 | scheduling lag p99 ms |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for driver, mode, load, idle, loaded, lags in rows:
        assert idle and loaded and (lags or mode != "mounted"), f"{driver}, {mode}: no samples"
        ratio = _ms(loaded, 0.99) / statistics.median(idle) / 1000
        ratio99 = _ms(loaded, 0.99) / _ms(idle, 0.99)
        print(
            f"| {driver} | {mode} | {load} | {_ms(idle, 0.5):.2f} | {_ms(idle, 0.99):.2f} | {_ms(loaded, 0.5):.2f} | "
            f"{_ms(loaded, 0.99):.2f} | {ratio:.1f}x | {ratio99:.1f}x | {f'{_ms(lags, 0.99):.2f}' if lags else '-'} |"
        )
    lane = [(d, _ms(loaded, 0.99) / statistics.median(idle) / 1000) for d, m, _, idle, loaded, _ in rows if m == "mounted"]
    met = [d for d, r in lane if r <= 2]
    missed = [f"{d} ({r:.1f}x)" for d, r in lane if r > 2]
    print(f"\nGoal met (mounted p99 under load <= 2x idle p50): {', '.join(met) or 'none'}; missed: {', '.join(missed) or 'none'}.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
