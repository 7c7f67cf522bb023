"""Our layer's own CPU inside real calls: what each driver adds between the caller and the bare transport, measured in place.

Run: ``python benchmarks/insitu_own_time.py [--calls 3000] [--rounds 2]``

``micro_success_path.py`` times our code in a tight loop over a canned
transport, where every line of it stays in the CPU's caches. In a real call
the HTTP library's own few hundred microseconds of Python run between two
pieces of ours and evict them, so the same code costs more. This script
measures it where it runs: real sequential POSTs to the loopback server
(``_loopback.LoopbackServer``, its own process), with a thin timing layer
just above ours and another just below it (for requests: a subclass of our
adapter timing its ``send`` and ``HTTPAdapter.send`` timed around the
socket work; for httpx: a timing transport on each side of ours; for
aiohttp: a timing middleware on each side of ours). Our own time is the
outer layer's time less the inner one's, in this thread's CPU
(``time.thread_time_ns``), per call; the same two layers with nothing
between them give the "bare" row, which is what the timing layers
themselves cost. Whole-call CPU is shown beside it. No observers; the
benchmark's policy (one table entry, ``EndpointPolicy()``). Measured by
hand; not run by ``run_all.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import aiohttp
import httpx
import requests
from _loopback import LoopbackServer
from requests.adapters import HTTPAdapter

from resilience.adapters.aiohttp import ResilientMiddleware
from resilience.adapters.httpx import AsyncResilientTransport, ResilientTransport
from resilience.adapters.requests import ResilientAdapter
from resilience.policy import EndpointPolicy, PolicyTable

POLICIES = PolicyTable({"POST /flush_cache": EndpointPolicy()})
"""The route every call takes, as in ``bench_async_overhead.py``."""


class Clock:
    """Two accumulators of this thread's CPU nanoseconds: above our layer (``outer``) and below it (``inner``)."""

    def __init__(self) -> None:
        self.outer = 0
        self.inner = 0

    def reset(self) -> None:
        self.outer = self.inner = 0


CLOCK = Clock()


def _requests_pair(ours: bool) -> requests.Session:
    """A session whose adapter times its whole ``send`` (outer) and the bare ``HTTPAdapter.send`` under it (inner)."""
    base: type[HTTPAdapter] = ResilientAdapter if ours else HTTPAdapter

    class Timed(base):  # type: ignore[valid-type,misc]
        def send(self, request: Any, *args: Any, **kwargs: Any) -> Any:
            t = time.thread_time_ns()
            response = super().send(request, *args, **kwargs)
            CLOCK.outer += time.thread_time_ns() - t
            return response

    adapter = Timed(POLICIES) if ours else Timed()
    session = requests.Session()
    session.mount("http://", adapter)
    return session


def _bare_send(self: HTTPAdapter, *args: Any, **kwargs: Any) -> Any:
    t = time.thread_time_ns()
    response = _ORIGINAL_SEND(self, *args, **kwargs)
    CLOCK.inner += time.thread_time_ns() - t
    return response


_ORIGINAL_SEND = HTTPAdapter.send


class _TimedTransport(httpx.BaseTransport):
    def __init__(self, inner: httpx.BaseTransport, outer: bool) -> None:
        self.inner, self.outer = inner, outer

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        t = time.thread_time_ns()
        response = self.inner.handle_request(request)
        spent = time.thread_time_ns() - t
        if self.outer:
            CLOCK.outer += spent
        else:
            CLOCK.inner += spent
        return response


class _ATimedTransport(httpx.AsyncBaseTransport):
    def __init__(self, inner: httpx.AsyncBaseTransport, outer: bool) -> None:
        self.inner, self.outer = inner, outer

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        t = time.thread_time_ns()
        response = await self.inner.handle_async_request(request)
        spent = time.thread_time_ns() - t
        if self.outer:
            CLOCK.outer += spent
        else:
            CLOCK.inner += spent
        return response


async def _outer_mw(request: aiohttp.ClientRequest, handler: Any) -> aiohttp.ClientResponse:
    t = time.thread_time_ns()
    response = await handler(request)
    CLOCK.outer += time.thread_time_ns() - t
    return response  # type: ignore[no-any-return]


async def _inner_mw(request: aiohttp.ClientRequest, handler: Any) -> aiohttp.ClientResponse:
    t = time.thread_time_ns()
    response = await handler(request)
    CLOCK.inner += time.thread_time_ns() - t
    return response  # type: ignore[no-any-return]


def measure(calls: int, run: Callable[[int], None]) -> tuple[float, float]:
    """(whole call, our own) CPU microseconds per call, after a warm-up of 300 calls."""
    run(300)
    CLOCK.reset()
    t = time.thread_time_ns()
    run(calls)
    total = time.thread_time_ns() - t
    return total / calls / 1e3, (CLOCK.outer - CLOCK.inner) / calls / 1e3


def rows(url: str, calls: int) -> dict[tuple[str, str], tuple[float, float]]:
    out: dict[tuple[str, str], tuple[float, float]] = {}
    for ours in (False, True):
        who = "ours" if ours else "bare (the timing layers alone)"
        session = _requests_pair(ours)

        def rq(n: int, s: requests.Session = session) -> None:
            for _ in range(n):
                _ = s.post(url, data=b"{}", timeout=10).content

        out[("requests", who)] = measure(calls, rq)
        session.close()

        inner = _TimedTransport(httpx.HTTPTransport(), outer=False)
        middle: httpx.BaseTransport = ResilientTransport(POLICIES, transport=inner) if ours else inner
        client = httpx.Client(transport=_TimedTransport(middle, outer=True))

        def hs(n: int, c: httpx.Client = client) -> None:
            for _ in range(n):
                c.post(url, content=b"{}").read()

        out[("httpx sync", who)] = measure(calls, hs)
        client.close()

    async def async_rows() -> None:
        for ours in (False, True):
            who = "ours" if ours else "bare (the timing layers alone)"
            ainner = _ATimedTransport(httpx.AsyncHTTPTransport(), outer=False)
            amiddle: httpx.AsyncBaseTransport = AsyncResilientTransport(POLICIES, transport=ainner) if ours else ainner
            aclient = httpx.AsyncClient(transport=_ATimedTransport(amiddle, outer=True))

            async def hx(n: int, c: httpx.AsyncClient = aclient) -> None:
                for _ in range(n):
                    (await c.post(url, content=b"{}")).read()

            await hx(300)
            CLOCK.reset()
            t = time.thread_time_ns()
            await hx(calls)
            out[("httpx async", who)] = ((time.thread_time_ns() - t) / calls / 1e3, (CLOCK.outer - CLOCK.inner) / calls / 1e3)
            await aclient.aclose()

            middlewares = (_outer_mw, ResilientMiddleware(POLICIES), _inner_mw) if ours else (_outer_mw, _inner_mw)
            session = aiohttp.ClientSession(middlewares=middlewares)

            async def ah(n: int, s: aiohttp.ClientSession = session) -> None:
                for _ in range(n):
                    async with s.post(url, data=b"{}") as response:
                        await response.read()

            await ah(300)
            CLOCK.reset()
            t = time.thread_time_ns()
            await ah(calls)
            out[("aiohttp", who)] = ((time.thread_time_ns() - t) / calls / 1e3, (CLOCK.outer - CLOCK.inner) / calls / 1e3)
            await session.close()

    asyncio.run(async_rows())
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--calls", type=int, default=3000, help="timed sequential calls per driver and round (default 3000)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds; the smallest figure of each cell is shown (default 2)")
    args = ap.parse_args(argv)
    HTTPAdapter.send = _bare_send  # type: ignore[method-assign]
    best: dict[tuple[str, str], tuple[float, float]] = {}
    with LoopbackServer() as server:
        url = server.url + "/flush_cache"
        for r in range(args.rounds):
            print(f"round {r + 1}/{args.rounds}", file=sys.stderr, flush=True)
            for key, (total, own) in rows(url, args.calls).items():
                old = best.get(key)
                best[key] = (total, own) if old is None else (min(old[0], total), min(old[1], own))
    print("| transport | between the timing layers | whole call, CPU (us) | own CPU between the layers (us) |")
    print("|---|---|---:|---:|")
    order = ("requests", "httpx sync", "httpx async", "aiohttp")
    for (transport, who), (total, own) in sorted(best.items(), key=lambda kv: (order.index(kv[0][0]), kv[0][1] == "ours")):
        print(f"| {transport} | {who} | {total:.1f} | {own:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
