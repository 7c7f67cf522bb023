"""A control call's latency while streams fill its client's pool (bare, mounted without the lane, mounted) or another client's.

Run: ``.venv/bin/python benchmarks/bench_control_lane.py [--streams 1000] [--samples 1000] [--queued-samples 8] [--rounds 3]
[--drivers ...] [--quick]``

The field's finding (prime-rl #1111): on one shared pool a weight update took
8.58 s under 4,000 concurrent streams; a dedicated admin client took 55 ms.
Here one ``StreamServer`` (``resilience/testing/stream_server.py``, its own
process) streams ``/generate`` (``EVENTS`` events, one every ``INTERVAL_S``)
and answers ``POST /pause_generation`` at once. For each driver and client
kind, one client carries both: a stream load of workers that each send
``/generate``, read the stream to its end and start again, and control calls
(``POST /pause_generation``). Three clients per driver, and a fourth row:

- ``bare``: the library alone (``requests.Session``, ``httpx.Client`` /
  ``AsyncClient``, ``aiohttp.ClientSession``);
- ``mounted, no lane``: our driver over ``SGLANG_POLICIES`` with
  ``DriverConfig(control_lane=None)``;
- ``mounted``: our driver with the default ``ControlLane()``;
- ``dedicated client``: the field's own fix (prime-rl's "dedicated admin
  client"), the library alone again: the stream load on one ``bare`` client,
  the control calls on a second, separate one of the same library with its
  own pool, in the same process. What one process can achieve at all: where
  it too misses the goal, the remainder is the process (the event loop's
  turns, the GIL, the library's garbage), not a shared pool.

The async drivers (httpx async, aiohttp) carry ``--streams`` streams (1,000)
through their default pool limit (100 connections): the rest wait in the
pool's queue, and so does a control call that shares the pool (mounted httpx
async: in ``DataQueue``, ours, ahead of the pool, so that httpcore's queue
stays empty, and which lets one waiting request in per loop turn;
``adapters/data_queue.py``). The sync
drivers would need a thread per stream; they carry ``SYNC_STREAMS`` threads
through a pool of ``SYNC_POOL`` (requests: ``pool_maxsize=16,
pool_block=True``, its only pool that waits; httpx: ``Limits(max_connections=16)``;
mounted httpx sync: the waiting threads in ``SyncDataQueue``, ours, ahead of the pool),
the same shape at a size 2 cores can run. Idle: the same client, no streams.
A control call that waits in the queue takes seconds, so those rows take
``--queued-samples`` calls, started ``QUEUED_GAP_S`` apart. Every other
call, idle ones included, comes ``SAMPLE_GAP_S`` after the one before,
beside a lag sample: ``--samples`` idle calls, and loaded ones for at most
``LOADED_WINDOW_S``. (A call made straight after another finds warm caches
and an engine that never went to sleep: with no streams at all it took a
third of the time at p50 on this 2-CPU machine, so an idle baseline taken
back to back, as before, made every ratio 2-3x too high.) Goal: mounted p99 under load within 2x of
its idle p50. One round of 1,000 calls cannot resolve a p99 on this machine
(1.5-3.2x on unchanged code), so the ``mounted`` and ``dedicated client``
rows run ``--rounds`` times (``ROUNDS``), taking turns, each round with a
fresh client, idle calls and load; the goal is judged on the median of the
rounds' own ratios, every one printed. The last two columns are the floor under load that no pool
can lift, and its p99 over the idle p50: how long the measuring thread (sync: ``time.sleep(0)``, giving the GIL
to the streaming threads) or task (async: one byte through a socket pair,
awaited through the loop's selector as a response is, so behind every
callback of the loop's turn) waits to run again, sampled just before each
control call of the ``mounted`` and ``dedicated client`` rows. Idle samples:
half before the load, half after it. A last line compares the two: mounted
p99 under load over the dedicated client's.

A second table says where the loaded time of the ``mounted`` and
``dedicated client`` rows goes
(``_Phases``, Linux only): per call, the measuring thread on a CPU, waiting
for one, asleep (the engine's answer, the GIL), the streaming threads on a
CPU, the engine process waiting for a CPU, GC pauses and httpcore's pool
scans; the mean over the slowest 1% of the calls and over the fastest half.
The machine is shared: each row carries the 1-minute load average at its end.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import os
import socket
import statistics
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import aiohttp
import httpcore
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
LOADED_WINDOW_S = 60.0
"""At most this many seconds of a ``mounted`` row's loaded calls: where the loop is saturated (an httpx data pool
walking a long queue of its own, a loaded machine), a call can take seconds, and ``--samples`` of them would not end;
the row says how many ran."""
QUEUED_GAP_S = 0.25
"""Seconds between the starts of the control calls that wait behind streams."""
TIMEOUT_S = 120.0
"""Every call's timeout: long enough that a queued control call ends by its answer, not by a pool timeout."""
MODES = ("bare", "mounted, no lane", "mounted", "dedicated client")
SAMPLED = ("mounted", "dedicated client")
"""The rows whose loaded control calls have a pool of their own: ``--samples`` of them, each beside a lag sample."""
ROUNDS = 3
"""Rounds of each ``SAMPLED`` row by default: the goal is judged on the median of their ratios."""
CONTROL = "/pause_generation"
GENERATE = f"/generate?events={EVENTS}"
BODY = {"text": "hi", "stream": True}


def _config(lane: bool) -> DriverConfig:
    return DriverConfig(policies=SGLANG_POLICIES, control_lane=ControlLane() if lane else None)


def _ms(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return 1000 * ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _goal_ratio(idle: list[float], loaded: list[float]) -> float:
    """The goal's ratio: loaded p99 over idle p50."""
    return _ms(loaded, 0.99) / _ms(idle, 0.5)


# ---- where a loaded control call's time goes ----

PHASES = (
    "wall",
    "on CPU",
    "waiting for a CPU",
    "asleep",
    "other threads on CPU",
    "engine waiting for a CPU",
    "GC pauses",
    "httpcore pool scans",
)
"""The breakdown's columns (``_Phases.between``), seconds each."""
_SCAN = "_assign_requests_to_connections"
"""httpcore's pool method that hands waiting requests connections: it walks the whole queue on every call."""


def _schedstat(path: str) -> tuple[float, float]:
    """(seconds on a CPU, seconds runnable but waiting for one) of a thread or process, from Linux's ``schedstat``."""
    with open(path, encoding="ascii") as f:
        on_cpu, waiting, _ = f.read().split()
    return int(on_cpu) / 1e9, int(waiting) / 1e9


@dataclass(slots=True)
class _Mark:
    """One instant as the breakdown reads it: clocks and counters, seconds."""

    wall: float
    on_cpu: float
    waiting: float
    process_cpu: float
    engine_waiting: float
    gc: float
    scans: float


class _Phases:
    """Where each loaded control call of a ``mounted`` row spends its wall time (Linux only: ``/proc/.../schedstat``).

    Between two marks around a call: the measuring thread on a CPU (the call
    itself and, async, every other callback the loop ran meanwhile), waiting
    for a CPU (runnable, but the OS ran something else: this machine's other
    work), asleep (the rest: waiting for the engine's answer, and in a sync
    driver for the GIL), other threads of this process on a CPU (sync: the
    streaming threads, who held the GIL), the engine process waiting for a
    CPU, and, overlapping those, GC pauses (``gc.callbacks``) and httpcore's
    pool scans (``_assign_requests_to_connections`` of every pool in the
    process, wrapped while the benchmark runs: the data pool's queue).
    """

    def __init__(self, engine_pid: int) -> None:
        self.engine = f"/proc/{engine_pid}/schedstat"
        self.available = os.path.exists("/proc/thread-self/schedstat") and os.path.exists(self.engine)
        self.gc_s = 0.0
        self.scans_s = 0.0
        self._gc_started = 0.0
        self._lock = threading.Lock()

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
        else:
            self.gc_s += time.perf_counter() - self._gc_started

    def _add_scan(self, seconds: float) -> None:
        with self._lock:
            self.scans_s += seconds

    @contextmanager
    def installed(self) -> Iterator[None]:
        """Count GC pauses and httpcore's pool scans while inside."""
        wrapped: list[tuple[Any, Any]] = []
        for pool_class in (httpcore.ConnectionPool, httpcore.AsyncConnectionPool):
            original = getattr(pool_class, _SCAN, None)
            if original is None:  # an httpcore without it: no scan column, the rest stands
                continue

            def timed(pool: Any, _original: Any = original) -> Any:
                started = time.perf_counter()
                try:
                    return _original(pool)
                finally:
                    self._add_scan(time.perf_counter() - started)

            setattr(pool_class, _SCAN, timed)
            wrapped.append((pool_class, original))
        gc.callbacks.append(self._on_gc)
        try:
            yield
        finally:
            gc.callbacks.remove(self._on_gc)
            for pool_class, original in wrapped:
                setattr(pool_class, _SCAN, original)

    def mark(self) -> _Mark:
        on_cpu, waiting = _schedstat("/proc/thread-self/schedstat")
        _, engine_waiting = _schedstat(self.engine)
        return _Mark(time.perf_counter(), on_cpu, waiting, time.process_time(), engine_waiting, self.gc_s, self.scans_s)

    @staticmethod
    def between(a: _Mark, z: _Mark) -> tuple[float, ...]:
        """``PHASES`` from ``a`` to ``z``."""
        wall, on_cpu, waiting = z.wall - a.wall, z.on_cpu - a.on_cpu, z.waiting - a.waiting
        others = z.process_cpu - a.process_cpu - on_cpu
        return (
            wall,
            on_cpu,
            waiting,
            max(0.0, wall - on_cpu - waiting),
            max(0.0, others),
            z.engine_waiting - a.engine_waiting,
            z.gc - a.gc,
            z.scans - a.scans,
        )


phases_of: list[_Phases | None] = [None]
"""The breakdown of this run (set once the server is up; None: not measured here)."""


# ---- the sync drivers: threads ----


def _sync_clients(driver: str, mode: str) -> tuple[Callable[[str], None], Callable[[str], None], Callable[[], None]]:
    """(the control calls' send, the streams' send, close all) of a row: one client, or for ``dedicated client`` two bare ones."""
    if mode != "dedicated client":
        send, close = _sync_client(driver, mode)
        return send, send, close
    control, close_control = _sync_client(driver, "bare")
    streams, close_streams = _sync_client(driver, "bare")

    def close_both() -> None:
        close_streams()
        close_control()

    return control, streams, close_both


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


Row = tuple[list[float], list[float], list[float], list[tuple[float, ...]], list[tuple[float, ...]]]
"""(idle seconds, loaded seconds, scheduling lags under load, ``PHASES`` of each idle call, of each loaded call: mounted
rows only)."""


def _sync_sample(send: Callable[[str], None], times: list[float], lags: list[float], phases: list[tuple[float, ...]]) -> None:
    """One control call as every row but the queued ones takes it: after ``SAMPLE_GAP_S``, beside a lag sample."""
    time.sleep(SAMPLE_GAP_S)
    lags.append(_sync_lag())
    phases.append(_phased(lambda: times.append(_timed(send))))


def _sync_row(driver: str, mode: str, streams: int, samples: int, queued: int) -> Row:
    """The control calls of one sync row's client (``Row``)."""
    send, stream, close = _sync_clients(driver, mode)
    try:
        idle: list[float] = []
        idle_lags: list[float] = []
        idle_phases: list[tuple[float, ...]] = []
        for _ in range(samples // 2):
            _sync_sample(send, idle, idle_lags, idle_phases)
        stop = threading.Event()

        def worker() -> None:
            while not stop.is_set():
                try:
                    stream(GENERATE)
                except (requests.RequestException, httpx.HTTPError):
                    if not stop.is_set():
                        raise

        threads = [threading.Thread(target=worker, daemon=True) for _ in range(streams)]
        for t in threads:
            t.start()
        time.sleep(2 * EVENTS * INTERVAL_S)  # every pooled connection streaming, the rest queued
        loaded: list[float] = []
        lags: list[float] = []
        phases: list[tuple[float, ...]] = []
        if mode in SAMPLED:
            window = time.monotonic() + LOADED_WINDOW_S
            for _ in range(samples):  # spread over the streams' phases; each control call beside a lag sample
                if time.monotonic() > window:
                    break
                _sync_sample(send, loaded, lags, phases)
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
        for _ in range(samples - samples // 2):  # half before the load, half after
            _sync_sample(send, idle, idle_lags, idle_phases)
        return idle, loaded, lags, idle_phases, phases
    finally:
        close()


def _phased(call: Callable[[], None]) -> tuple[float, ...]:
    """``call()``, and its ``PHASES`` (empty where the breakdown is not measured)."""
    breakdown = phases_of[0]
    if breakdown is None:
        call()
        return ()
    before = breakdown.mark()
    call()
    return breakdown.between(before, breakdown.mark())


async def _aphased(call: Callable[[], Awaitable[None]]) -> tuple[float, ...]:
    """``_phased`` for a coroutine."""
    breakdown = phases_of[0]
    if breakdown is None:
        await call()
        return ()
    before = breakdown.mark()
    await call()
    return breakdown.between(before, breakdown.mark())


def _timed(send: Callable[[str], None]) -> float:
    started = time.perf_counter()
    send(CONTROL)
    return time.perf_counter() - started


# ---- the async drivers: one event loop ----


AsyncClients = tuple[Callable[[], Coroutine[Any, Any, float]], Callable[[str], Awaitable[None]], Callable[[], Awaitable[None]]]
"""(one control call, returning its seconds; the streams' send; close all) of an async row."""


async def _async_clients(driver: str, mode: str) -> AsyncClients:
    """``_sync_clients`` for an async driver, its control send already timed (``_atimed``)."""
    if mode != "dedicated client":
        send, close = await _async_client(driver, mode)
        return functools.partial(_atimed, send), send, close
    control, close_control = await _async_client(driver, "bare")
    streams, close_streams = await _async_client(driver, "bare")

    async def close_both() -> None:
        await close_streams()
        await close_control()

    return functools.partial(_atimed, control), streams, close_both


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


async def _async_lag(pair: tuple[socket.socket, socket.socket]) -> float:
    """How long the loop takes to hand a task a socket that is ready: the turn a control call's answer waits for.

    One byte written to a socket pair, then awaited through the loop's
    selector, as a response is: the loop runs every callback already ready,
    and those the same poll found, first. (``asyncio.sleep(0)``, measured
    before, queues its task ahead of the next poll's I/O and so missed them.)
    """
    loop = asyncio.get_running_loop()
    writer, reader = pair
    ready: asyncio.Future[None] = loop.create_future()

    def on_ready() -> None:
        if not ready.done():
            ready.set_result(None)

    loop.add_reader(reader.fileno(), on_ready)
    started = time.perf_counter()
    writer.send(b"x")
    try:
        await ready
    finally:
        loop.remove_reader(reader.fileno())
    lag = time.perf_counter() - started
    reader.recv(1)
    return lag


async def _async_row(
    driver: str, mode: str, streams: int, samples: int, queued: int, clients: Callable[[str, str], Awaitable[AsyncClients]] = _async_clients
) -> Row:
    """The control calls of one async row's clients (``Row``), built by ``clients`` (default ``_async_clients``)."""
    control, stream, close = await clients(driver, mode)
    pair = socket.socketpair()

    async def sample(times: list[float], lags: list[float], phases: list[tuple[float, ...]]) -> None:
        """``_sync_sample`` on the loop."""

        async def timed() -> None:
            times.append(await control())

        await asyncio.sleep(SAMPLE_GAP_S)
        lags.append(await _async_lag(pair))
        phases.append(await _aphased(timed))

    try:
        idle: list[float] = []
        idle_lags: list[float] = []
        idle_phases: list[tuple[float, ...]] = []
        for _ in range(samples // 2):
            await sample(idle, idle_lags, idle_phases)
        stop = asyncio.Event()

        async def worker() -> None:
            while not stop.is_set():
                await stream(GENERATE)

        tasks = [asyncio.create_task(worker()) for _ in range(streams)]
        await asyncio.sleep(2 * EVENTS * INTERVAL_S)
        loaded: list[float] = []
        lags: list[float] = []
        phases: list[tuple[float, ...]] = []
        if mode in SAMPLED:
            window = time.monotonic() + LOADED_WINDOW_S
            for _ in range(samples):
                if time.monotonic() > window:
                    break
                await sample(loaded, lags, phases)
        else:
            calls = []
            for _ in range(queued):
                calls.append(asyncio.create_task(control()))
                await asyncio.sleep(QUEUED_GAP_S)
            loaded = list(await asyncio.gather(*calls))
        stop.set()
        for task in tasks:
            task.cancel()  # a cancelled stream closes its connection: the next row starts with none open
        await asyncio.gather(*tasks, return_exceptions=True)
        for _ in range(samples - samples // 2):
            await sample(idle, idle_lags, idle_phases)
        return idle, loaded, lags, idle_phases, phases
    finally:
        for end in pair:
            end.close()
        await close()


DRIVERS = ("requests", "httpx sync", "httpx async", "aiohttp")
SYNC_DRIVERS = ("requests", "httpx sync")


def _means(phases: list[tuple[float, ...]]) -> str:
    """The ``PHASES`` of some calls as mean milliseconds per call, table cells (``-`` for no calls: a row of one call
    has no fastest half)."""
    if not phases:
        return " | ".join("-" for _ in PHASES)
    return " | ".join(f"{1000 * sum(p[i] for p in phases) / len(phases):.2f}" for i in range(len(PHASES)))


@dataclass(slots=True)
class _Result:
    """One client's rows of a driver: a queued row runs once, a sampled one (``SAMPLED``) ``--rounds`` times."""

    driver: str
    mode: str
    load: str
    averages: list[float]
    """The 1-minute load average at each round's end."""
    rounds: list[Row]

    def pooled(self, field: int) -> list[Any]:
        """One ``Row`` field over every round."""
        return [value for row in self.rounds for value in row[field]]

    def ratios(self) -> list[float]:
        """Each round's loaded p99 over its own idle p50: the goal's ratio, round by round."""
        return [_goal_ratio(row[0], row[1]) for row in self.rounds]


def _order(rounds: int) -> Iterator[tuple[str, int]]:
    """(client, round) in the order they run: the queued rows once, then the sampled ones alternating, round by round,
    so that a slow stretch of the machine falls on both alike."""
    for mode in MODES:
        if mode not in SAMPLED:
            yield mode, 0
    for number in range(rounds):
        for mode in SAMPLED:
            yield mode, number


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=1000, help="streams of the async drivers (default 1000)")
    parser.add_argument("--samples", type=int, default=1000, help="control calls per idle or lane row and round (default 1000)")
    parser.add_argument("--queued-samples", type=int, default=8, help="control calls per row that queues behind streams (default 8)")
    parser.add_argument(
        "--rounds", type=int, default=ROUNDS, help=f"rounds of each mounted and dedicated client row (default {ROUNDS})"
    )
    parser.add_argument("--drivers", nargs="+", choices=DRIVERS, default=list(DRIVERS), help="the drivers to run (default all)")
    parser.add_argument("--quick", action="store_true", help="100 streams, 40 samples, 3 queued, 1 round: a check of the chain")
    args = parser.parse_args(argv)
    if args.quick:
        args.streams, args.samples, args.queued_samples, args.rounds = 100, 40, 3, 1
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    load_before = os.getloadavg()
    results: dict[tuple[str, str], _Result] = {}
    with StreamServer(interval_s=INTERVAL_S, events=EVENTS) as server:
        url_of[0] = server.url
        breakdown = _Phases(server.pid)
        phases_of[0] = breakdown if breakdown.available else None
        with breakdown.installed():
            for driver in (d for d in DRIVERS if d in args.drivers):
                for mode, number in _order(args.rounds):
                    told = f", round {number + 1} of {args.rounds}" if mode in SAMPLED else ""
                    print(f"{driver}, {mode}{told} ...", file=sys.stderr, flush=True)
                    if driver in SYNC_DRIVERS:
                        row = _sync_row(driver, mode, SYNC_STREAMS, args.samples, args.queued_samples)
                        load = f"{SYNC_STREAMS} threads, pool {SYNC_POOL}"
                    else:
                        row = asyncio.run(_async_row(driver, mode, args.streams, args.samples, args.queued_samples))
                        load = f"{args.streams} tasks, pool 100"
                    result = results.setdefault((driver, mode), _Result(driver, mode, load, [], []))
                    result.averages.append(os.getloadavg()[0])
                    result.rounds.append(row)
    load_after = os.getloadavg()
    flags = "".join(
        [
            " --quick" if args.quick else "",
            f" --rounds {args.rounds}" if args.rounds != ROUNDS and not args.quick else "",
            "" if args.drivers == list(DRIVERS) else f" --drivers {' '.join(repr(d) for d in args.drivers)}",
        ]
    )
    print("## Control calls beside streaming generation: the control lane\n")
    print(
        f"`.venv/bin/python benchmarks/bench_control_lane.py{flags}`: a `POST /pause_generation`'s "
        f"latency through the same client that streams `/generate` ({EVENTS} events, {INTERVAL_S} s apart) to one loopback "
        f"`StreamServer`. Async drivers: {args.streams} streams on one event loop through the library's default pool "
        f"(100 connections); sync drivers: {SYNC_STREAMS} streaming threads through a pool of {SYNC_POOL} (1,000 would need "
        f"1,000 threads). Queued rows: {args.queued_samples} calls started {QUEUED_GAP_S} s apart; the others "
        f"calls {SAMPLE_GAP_S * 1000:.0f} ms apart, idle and loaded alike ({args.samples} idle: half before the load, half "
        f"after; loaded: {args.samples}, or as many as {LOADED_WINDOW_S:.0f} s allow), in {args.rounds} round(s) of a fresh "
        "client and load each, the `mounted` and `dedicated client` rows taking turns. "
        f"{os.cpu_count()} CPUs shared with other work: load average {load_before[0]:.2f} before, {load_after[0]:.2f} "
        "after, and the 1-minute load average at each round's end in its row. Goal: mounted p99 under load <= 2x its "
        "idle p50, judged on the median over the rounds of each round's own ratio (one round of 1,000 calls swung "
        "1.5-3.2x on unchanged code; every round's ratio is in its row, and the pooled figures beside them). "
        "`dedicated client`: the field's own fix, the library alone with the streams on one client and the control calls "
        "on a second one of its own (prime-rl's dedicated admin client), in the same process: what one process achieves "
        "at all. "
        "Scheduling lag: how long the measuring thread (`time.sleep(0)`: a turn of the GIL) or task (one byte through a "
        "socket pair, awaited through the loop's selector as a response is) waited just before each control call of the "
        "`mounted` and `dedicated client` rows: the floor under load that no pool lifts; its p99 over the idle p50 is "
        "the goal's ratio for a call that did nothing but wait for one turn of the loop. "
        "Each call waits for the one before (a closed loop): a "
        "stall of the loop is one slow call, not the many that would have arrived meanwhile, so read `loaded max` "
        "beside p99.\n"
    )
    print(
        "| driver | client | load | load avg | loaded calls | idle p50 ms | idle p99 ms | loaded p50 ms | loaded p99 ms | loaded max ms "
        "| loaded p99 / idle p50 | each round's loaded p99 / idle p50 | median of rounds | loaded p99 / idle p99 "
        "| scheduling lag p99 ms | lag p99 / idle p50 |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for result in results.values():
        idle, loaded, lags = result.pooled(0), result.pooled(1), result.pooled(2)
        assert idle and loaded and (lags or result.mode not in SAMPLED), f"{result.driver}, {result.mode}: no samples"
        ratios = result.ratios()
        lag = f"{_ms(lags, 0.99):.2f} | {_ms(lags, 0.99) / _ms(idle, 0.5):.1f}x" if lags else "- | -"
        print(
            f"| {result.driver} | {result.mode} | {result.load} | {' / '.join(f'{a:.2f}' for a in result.averages)} | "
            f"{len(loaded)} | {_ms(idle, 0.5):.2f} | {_ms(idle, 0.99):.2f} | {_ms(loaded, 0.5):.2f} | {_ms(loaded, 0.99):.2f} | "
            f"{1000 * max(loaded):.2f} | {_goal_ratio(idle, loaded):.1f}x | {' / '.join(f'{r:.1f}' for r in ratios)} | "
            f"{statistics.median(ratios):.1f}x | {_ms(loaded, 0.99) / _ms(idle, 0.99):.1f}x | {lag} |"
        )
    lane = [(r.driver, statistics.median(r.ratios())) for r in results.values() if r.mode == "mounted"]
    met = [f"{d} ({m:.2f}x)" for d, m in lane if m <= 2]
    missed = [f"{d} ({m:.2f}x)" for d, m in lane if m > 2]
    print(
        f"\nGoal met (median over {args.rounds} round(s) of mounted p99 under load / idle p50 <= 2): "
        f"{', '.join(met) or 'none'}; missed: {', '.join(missed) or 'none'}."
    )
    beside = [
        f"{d} {_ms(r.pooled(1), 0.99) / _ms(results[d, 'dedicated client'].pooled(1), 0.99):.1f}x"
        for (d, m), r in results.items()
        if m == "mounted" and (d, "dedicated client") in results
    ]
    dedicated = [f"{r.driver} {statistics.median(r.ratios()):.1f}x" for r in results.values() if r.mode == "dedicated client"]
    print(f"Mounted p99 under load / dedicated client's p99 under load (pooled): {', '.join(beside)}.")
    print(
        "Dedicated client, median over the rounds of p99 under load / its idle p50 (the goal's ratio, for the field's "
        f"fix): {', '.join(dedicated)}."
    )
    measured = [(r.driver, r.mode, r.pooled(3), r.pooled(4)) for r in results.values() if r.mode in SAMPLED and r.pooled(4)]
    if not measured:
        print("\nWhere the time goes: not measured here (it reads Linux's `/proc/.../schedstat`).")
        return 0
    print(
        "\n### Where a control call's time goes (`mounted` and `dedicated client` rows)\n\n"
        "Mean milliseconds per call, for the slowest 1% of each such row's calls and for its fastest half, idle and "
        "loaded. `wall` = `on CPU` (the measuring thread: the call itself and, async, every other callback the loop ran "
        "meanwhile) + `waiting for a CPU` (runnable, but the OS ran other work: this machine's load) + `asleep` (waiting "
        "for the engine's answer; sync: for the GIL too). `other threads on CPU`: this process's other threads meanwhile "
        "(sync: the streaming threads, holding the GIL). `engine waiting for a CPU`: the engine process, runnable but not "
        "running (counted when the wait ends, so it can exceed `wall`). `GC pauses` and `httpcore pool scans` "
        "(httpcore's `_assign_requests_to_connections`, every pool in the process: the data pool walks its queue of "
        "waiting requests on each call; in httpx's `mounted` rows that queue stays empty, the rest waiting in our "
        "`DataQueue` or `SyncDataQueue` ahead of the pool; in its `dedicated client` rows the streams' client walks all "
        "of its waiting streams) overlap the others. From Linux's `schedstat`.\n"
    )
    print("| driver | client | calls | " + " | ".join(f"{name} ms" for name in PHASES) + " |")
    print("|---|---|---|" + "---:|" * len(PHASES))
    for driver, mode, idle_phases, loaded_phases in measured:
        for when, phases in (("idle", idle_phases), ("loaded", loaded_phases)):
            ordered = sorted(phases)
            slowest = ordered[int(0.99 * len(ordered)) :]
            fastest = ordered[: len(ordered) // 2]
            print(f"| {driver} | {mode} | {when}, slowest 1% ({len(slowest)}) | {_means(slowest)} |")
            print(f"| {driver} | {mode} | {when}, fastest half ({len(fastest)}) | {_means(fastest)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
