"""Soak of each HTTP driver: 1000 calls with a sprinkle of 502s; memory, tasks and connections must stay flat.

Run: ``python benchmarks/bench_async_soak.py [--calls 1000] [--fail-every 20] [--pool 8] [--concurrency 16] [--sync-threads 8] [--quick]``

A keep-alive HTTP/1.1 server (``_loopback.LoopbackServer``, its own process)
answers every ``--fail-every``-th request 502 and the others 200 at once.
Each driver makes ``--warmup`` calls, then ``--calls`` more, through a pool
of ``--pool`` connections (``httpx.Limits`` / ``aiohttp.TCPConnector(limit=...)``):
the async drivers ``--concurrency`` at a time (tasks gathered in batches),
more callers than connections on purpose; httpx sync from ``--sync-threads``
threads (default the pool size: with more threads than connections, httpcore's
sync pool can close a connection it already handed to a queued request, a
bug of the bare transport, encode/httpcore#1110). An exception a call raises
is counted by type, not fatal. Our drivers (httpx ``ResilientTransport`` and
``AsyncResilientTransport``, aiohttp ``ResilientMiddleware``) retry the 502s
with a 1-10 ms backoff; the bare clients beside them are the baseline (they
surface the 502s).

Measured per driver: the process's RSS after ``gc.collect()`` once warmed up
and at the end; ``len(asyncio.all_tasks())`` at the same two points (async
drivers); the most TCP connections from this process to the server seen at
once (``psutil``, sampled every 50 ms by a thread, and after every batch);
open file descriptors; calls answered 200. Targets: RSS flat within 5 %,
tasks not growing, open connections <= the pool size, every call of ours
answered 200. Progress goes to stderr, the markdown table to stdout; the
server process is stopped whatever happens.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import platform
import sys
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import aiohttp
import httpx
import psutil
from _loopback import LoopbackServer

from resilience.policy import EndpointPolicy, PolicyTable, RetryPolicy

POLICIES = PolicyTable({"POST /generate": EndpointPolicy(retry=RetryPolicy(base_s=0.001, cap_s=0.01))})
"""POST /generate, retried as idempotent: 502 retried up to 4 attempts, 1-10 ms backoff ceilings. A data route on
purpose: the soak holds the driver to the pool it was given, and control routes take the control lane's own
connections beside that pool (``adapters/control_lane.py``; ``tests/adapters/test_control_lane.py`` covers them)."""
RSS_TARGET = 0.05
BODY = b"{}"


@dataclass(frozen=True, slots=True)
class Row:
    """One driver's soak."""

    driver: str
    ours: bool
    calls: int
    ok: int
    errors: str
    """Exceptions raised to the caller, by type (e.g. ``2 ReadError``); empty = none."""
    rss_start: int
    rss_end: int
    tasks_start: int | None
    tasks_end: int | None
    max_connections: int
    pool: int
    fds_start: int
    fds_end: int
    seconds: float

    @property
    def rss_growth(self) -> float:
        return (self.rss_end - self.rss_start) / self.rss_start


class ConnectionSampler:
    """A thread counting this process's TCP connections to ``port`` every ``interval_s``; keeps the maximum."""

    def __init__(self, port: int, interval_s: float = 0.05) -> None:
        self.port = port
        self.interval_s = interval_s
        self.max = 0
        self._lock = threading.Lock()  # the sampler thread and the driver both count
        self._proc = psutil.Process()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="connection-sampler", daemon=True)

    def count(self) -> int:
        """Connections now (any state) from this process to the server port; updates the maximum."""
        n = sum(1 for c in self._proc.net_connections(kind="tcp") if c.raddr and c.raddr.port == self.port)
        with self._lock:
            self.max = max(self.max, n)
        return n

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.count()

    def __enter__(self) -> ConnectionSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def rss() -> int:
    gc.collect()
    return int(psutil.Process().memory_info().rss)


def fds() -> int:
    return int(psutil.Process().num_fds())


def _errors(statuses: list[int | str]) -> str:
    names = Counter(s for s in statuses if isinstance(s, str))
    return ", ".join(f"{n} {name}" for name, n in names.most_common())


def _batches(total: int, size: int) -> list[int]:
    return [min(size, total - i) for i in range(0, total, size)]


def soak_sync(name: str, ours: bool, client: httpx.Client, url: str, port: int, args: argparse.Namespace) -> Row:
    """``--concurrency`` threads sharing one ``httpx.Client``."""
    statuses: list[int | str] = []

    def call() -> None:
        try:
            statuses.append(client.post(url, content=BODY).status_code)
        except httpx.HTTPError as exc:
            statuses.append(type(exc).__name__)

    with client, ThreadPoolExecutor(args.sync_threads) as pool, ConnectionSampler(port) as sampler:

        def run(total: int) -> None:
            for size in _batches(total, args.sync_threads):
                for f in [pool.submit(call) for _ in range(size)]:
                    f.result()
                sampler.count()

        run(args.warmup)
        statuses.clear()
        rss0, fds0, t0 = rss(), fds(), time.perf_counter()
        run(args.calls)
        took = time.perf_counter() - t0
        rss1, fds1 = rss(), fds()
    return Row(name, ours, len(statuses), statuses.count(200), _errors(statuses), rss0, rss1, None, None, sampler.max, args.pool,
               fds0, fds1, took)  # fmt: skip


async def soak_async(name: str, ours: bool, call: Callable[[], Awaitable[int]], close: Callable[[], Awaitable[None]], port: int,
                     args: argparse.Namespace) -> Row:  # fmt: skip
    """Batches of ``--concurrency`` tasks gathered on the running loop."""
    statuses: list[int | str] = []

    async def guarded() -> int | str:
        try:
            return await call()
        except (TimeoutError, httpx.HTTPError, aiohttp.ClientError) as exc:
            return type(exc).__name__

    with ConnectionSampler(port) as sampler:

        async def run(total: int) -> None:
            for size in _batches(total, args.concurrency):
                statuses.extend(await asyncio.gather(*(asyncio.create_task(guarded()) for _ in range(size))))
                sampler.count()

        await run(args.warmup)
        statuses.clear()
        rss0, fds0, tasks0, t0 = rss(), fds(), len(asyncio.all_tasks()), time.perf_counter()
        await run(args.calls)
        took = time.perf_counter() - t0
        await asyncio.sleep(0)  # let finished tasks leave the loop's set
        rss1, fds1, tasks1 = rss(), fds(), len(asyncio.all_tasks())
    await close()
    return Row(name, ours, len(statuses), statuses.count(200), _errors(statuses), rss0, rss1, tasks0, tasks1, sampler.max, args.pool,
               fds0, fds1, took)  # fmt: skip


def httpx_limits(pool: int) -> httpx.Limits:
    return httpx.Limits(max_connections=pool, max_keepalive_connections=pool)


def run_all(server: LoopbackServer, args: argparse.Namespace, skipped: list[str]) -> list[Row]:
    """Soak every driver in turn, bare then ours per transport; a driver that fails is named in ``skipped``."""
    url, port = server.url + "/generate", server.port
    rows: list[Row] = []
    ours_httpx: Any = None
    try:
        import resilience.adapters.httpx as ours_httpx
    except ImportError as exc:
        skipped.append(f"ours on httpx (resilience.adapters.httpx: {exc})")
    ours_aiohttp: Any = None
    try:
        import resilience.adapters.aiohttp as ours_aiohttp
    except ImportError as exc:
        skipped.append(f"ours on aiohttp (resilience.adapters.aiohttp: {exc})")

    def sync_driver(name: str, ours: bool, make: Callable[[], httpx.Client]) -> None:
        progress(name)
        try:
            rows.append(soak_sync(name, ours, make(), url, port, args))
        except Exception as exc:  # one broken driver must not hide the others' rows
            skipped.append(f"{name} (failed: {exc!r})")

    def sync_transport() -> httpx.HTTPTransport:
        return httpx.HTTPTransport(limits=httpx_limits(args.pool))

    sync_driver("httpx sync, bare HTTPTransport", False, lambda: httpx.Client(transport=sync_transport()))
    if ours_httpx is not None:
        sync_driver(
            "httpx sync, ours: ResilientTransport",
            True,
            lambda: httpx.Client(transport=ours_httpx.ResilientTransport(POLICIES, transport=sync_transport())),
        )

    def httpx_client(ours: bool) -> tuple[Callable[[], Awaitable[int]], Callable[[], Awaitable[None]]]:
        transport: Any = httpx.AsyncHTTPTransport(limits=httpx_limits(args.pool))
        if ours:
            transport = ours_httpx.AsyncResilientTransport(POLICIES, transport=transport)
        client = httpx.AsyncClient(transport=transport)

        async def call() -> int:
            return (await client.post(url, content=BODY)).status_code

        return call, client.aclose

    def aiohttp_client(ours: bool) -> tuple[Callable[[], Awaitable[int]], Callable[[], Awaitable[None]]]:
        middlewares = (ours_aiohttp.ResilientMiddleware(POLICIES),) if ours else ()
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=args.pool), middlewares=middlewares)

        async def call() -> int:
            async with session.post(url, data=BODY) as r:
                await r.read()
                return r.status

        return call, session.close

    drivers: list[tuple[str, bool, Callable[[bool], tuple[Callable[[], Awaitable[int]], Callable[[], Awaitable[None]]]]]] = [
        ("httpx async, bare AsyncHTTPTransport", False, httpx_client)
    ]
    if ours_httpx is not None:
        drivers.append(("httpx async, ours: AsyncResilientTransport", True, httpx_client))
    drivers.append(("aiohttp, bare ClientSession", False, aiohttp_client))
    if ours_aiohttp is not None:
        drivers.append(("aiohttp, ours: ResilientMiddleware", True, aiohttp_client))

    async def async_rows() -> None:
        for name, ours, make in drivers:
            progress(name)
            call, close = make(ours)
            try:
                rows.append(await soak_async(name, ours, call, close, port, args))
            except Exception as exc:  # one broken driver must not hide the others' rows
                skipped.append(f"{name} (failed: {exc!r})")
                await close()

    asyncio.run(async_rows())
    return rows


def table(rows: list[Row], args: argparse.Namespace, served: tuple[int, int, int], skipped: list[str]) -> str:
    mib = 1 / (1024 * 1024)
    out = [
        f"## Soak of each HTTP driver: {args.calls} calls with 502s (`benchmarks/bench_async_soak.py`)",
        "",
        f"<!-- python {platform.python_version()}, {platform.machine()}, {os.cpu_count()} CPUs, load average at the end "
        f"{os.getloadavg()[0]:.1f}; {args.calls} calls per driver after {args.warmup} warm-up, {args.concurrency} at a time "
        f"({args.sync_threads} threads for httpx sync), "
        f"pool {args.pool}; server: {served[0]} requests, {served[1]} answered 502, {served[2]} connections accepted -->",
        "",
        "| driver | calls answered 200 | errors raised | RSS after warm-up -> end (MiB) | RSS growth | asyncio tasks (warm -> end) "
        "| max open connections (pool) | fds (warm -> end) | s | targets |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        tasks = f"{r.tasks_start} -> {r.tasks_end}" if r.tasks_start is not None else "-"
        checks = [
            ("RSS", abs(r.rss_growth) <= RSS_TARGET),
            ("tasks", r.tasks_start is None or r.tasks_end is None or r.tasks_end <= r.tasks_start),
            ("connections", r.max_connections <= r.pool),
        ]
        if r.ours:
            checks.append(("all 200", r.ok == r.calls))
            verdict = ", ".join(f"{name} {'met' if ok else 'MISSED'}" for name, ok in checks)
        else:
            verdict = "baseline (502s surface)"
        out.append(
            f"| {r.driver} | {r.ok} / {r.calls} | {r.errors or '-'} | {r.rss_start * mib:.1f} -> {r.rss_end * mib:.1f} "
            f"| {r.rss_growth * 100:+.1f} % "
            f"| {tasks} | {r.max_connections} ({r.pool}) | {r.fds_start} -> {r.fds_end} | {r.seconds:.1f} | {verdict} |"
        )
    out.append("")
    out.append(
        f"Every {args.fail_every}th request is answered 502. Targets (ours): RSS flat within {RSS_TARGET * 100:.0f} % "
        "(after gc.collect(), warm-up excluded), asyncio tasks not growing, open connections to the server never above the "
        "pool size, every call answered 200 (the 502s retried). RSS is the whole driver process's: the drivers run one after "
        "another in it, so each row starts from where the previous one left off."
    )
    for line in skipped:
        out.append(f"Not measured: {line}.")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    """Parse the flags, soak each driver in turn, print the table."""
    doc = __doc__ or ""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--calls", type=int, default=1000, help="measured calls per driver (default 1000)")
    ap.add_argument("--warmup", type=int, default=200, help="calls per driver before the first sample (default 200)")
    ap.add_argument("--fail-every", type=int, default=20, help="the server answers every n-th request 502 (default 20: 5 %%)")
    ap.add_argument("--pool", type=int, default=8, help="connections in each driver's pool (default 8)")
    ap.add_argument("--concurrency", type=int, default=16, help="async calls in flight at once (default 16)")
    ap.add_argument(
        "--sync-threads",
        type=int,
        default=0,
        help="threads calling the httpx sync client at once (default 0 = the pool size: with more threads than connections "
        "httpcore's sync pool can close a connection it already gave a queued request, encode/httpcore#1110)",
    )
    ap.add_argument("--quick", action="store_true", help="small run for development: 100 calls after 40 warm-up")
    args = ap.parse_args(argv)
    if args.quick:
        args.calls, args.warmup = 100, 40
    if args.calls < 1 or args.warmup < 0 or args.pool < 1 or args.concurrency < 1 or args.fail_every < 2 or args.sync_threads < 0:
        ap.error("--calls, --pool, --concurrency must be >= 1, --warmup and --sync-threads >= 0, --fail-every >= 2")
    args.sync_threads = args.sync_threads or args.pool
    skipped: list[str] = []
    with LoopbackServer(fail_every=args.fail_every) as server:
        rows = run_all(server, args, skipped)
        served = server.counts()
    print(table(rows, args, served, skipped))
    bad = [r.driver for r in rows if r.ours and r.ok != r.calls]
    if bad:
        progress(f"calls that did not end 200 on: {', '.join(bad)}")


if __name__ == "__main__":
    main()
