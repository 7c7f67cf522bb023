"""Our layer's own CPU inside real calls: what each driver adds between the caller and the bare transport, measured in place.

Run: ``python benchmarks/insitu_own_time.py [--calls 3000] [--rounds 2] [--aiohttp-ab]``

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

``--aiohttp-ab`` measures aiohttp alone, with one piece of ours turned off
per row (``AB_VARIANTS``: no attempt timeout or deadline, no breaker, no
budget, no control lane, all four off, the core replaced by one plain
attempt; and in ours' place a pass-through middleware, one three coroutine
frames deep, one writing on aiohttp's request and response what ours
writes, and one asking ``request_timeout``), the rows interleaved in a
shuffled order every round, so each row's difference to "ours" is what
that piece costs in place. ``--against REV`` adds a row of ours with the
driver's file as commit ``REV`` has it (``ours_at``): an in-process A/B of
a change to ``adapters/aiohttp.py``. Both
columns count: a piece's work outside our frames (aiohttp's ``send``
wrapped by the attempt timer, the lane's connector, the loop's timer
handles) shows in the whole call only. The last column counts the garbage
collections (all generations) per 1000 calls of the row.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import random
import subprocess
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import aiohttp
import httpx
import requests
from _loopback import LoopbackServer
from requests.adapters import HTTPAdapter

from resilience.adapters.aiohttp import ResilientMiddleware, request_timeout
from resilience.adapters.driver_config import DriverConfig
from resilience.adapters.httpx import AsyncResilientTransport, ResilientTransport
from resilience.adapters.requests import ResilientAdapter
from resilience.policy import EndpointPolicy, PolicyTable

POLICIES = PolicyTable({"POST /flush_cache": EndpointPolicy()})
"""The route every call takes, as in ``bench_async_overhead.py``."""
UNTIMED = PolicyTable({"POST /flush_cache": EndpointPolicy(attempt_timeout_s=None, deadline_s=None)})
"""The same route with no attempt timeout and no deadline (the middleware then arms no attempt timer)."""


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


async def _pass_through(request: aiohttp.ClientRequest, handler: Any) -> aiohttp.ClientResponse:
    return await handler(request)  # type: ignore[no-any-return]


async def _three_frames(request: aiohttp.ClientRequest, handler: Any) -> aiohttp.ClientResponse:
    """A pass-through three coroutine frames deep, as ours is (``__call__``, ``Retrier.arun``, ``_Attempts.run``)."""
    return await _two_frames(request, handler)


async def _two_frames(request: aiohttp.ClientRequest, handler: Any) -> aiohttp.ClientResponse:
    return await _pass_through(request, handler)


async def _writing(request: aiohttp.ClientRequest, handler: Any) -> aiohttp.ClientResponse:
    """A pass-through that writes on aiohttp's objects what ours writes: ``request.send`` set and deleted, two response attributes."""
    request.send = request.send  # type: ignore[method-assign]
    response = await handler(request)
    del request.send
    response.attempts = ()  # type: ignore[attr-defined]
    response.endpoint = "POST /flush_cache"  # type: ignore[attr-defined]
    return response  # type: ignore[no-any-return]


async def _asking_timeout(request: aiohttp.ClientRequest, handler: Any) -> aiohttp.ClientResponse:
    """A pass-through that asks ``request_timeout`` (the caller's ``ClientTimeout``, from the handler chain) as ours does."""
    request_timeout(request, handler)
    return await handler(request)  # type: ignore[no-any-return]


class _OneAttempt:
    """A stand-in for ``Retrier`` whose ``arun`` makes one attempt and returns its response: ours without the core."""

    async def arun(self, spec: Any, send: Any, **_: Any) -> tuple[Any, tuple[()]]:
        timeouts = (10.0, 10.0) if spec.request_timeout is None else spec.request_timeout
        return (await send(0, timeouts, {})).response, ()


def _without_core() -> ResilientMiddleware:
    middleware = ResilientMiddleware(POLICIES)
    middleware.retrier = _OneAttempt()  # type: ignore[assignment]
    return middleware


AB_VARIANTS: dict[str, Callable[[], Any] | None] = {
    "bare (the timing layers alone)": None,
    "a pass-through middleware": lambda: _pass_through,
    "a pass-through, three coroutine frames deep": lambda: _three_frames,
    "a pass-through writing what ours writes on aiohttp's objects": lambda: _writing,
    "a pass-through asking request_timeout()": lambda: _asking_timeout,
    "ours": lambda: ResilientMiddleware(POLICIES),
    "ours, no attempt timeout or deadline": lambda: ResilientMiddleware(UNTIMED),
    "ours, no breaker": lambda: ResilientMiddleware(POLICIES, breaker=None),
    "ours, no budget": lambda: ResilientMiddleware(POLICIES, retry_budget=None),
    "ours, no control lane": lambda: ResilientMiddleware(config=DriverConfig(POLICIES, control_lane=None)),
    "ours, all four off": lambda: ResilientMiddleware(
        config=DriverConfig(UNTIMED, breaker=None, retry_budget=None, control_lane=None)
    ),
    "ours, the core replaced by one plain attempt": _without_core,
}
"""``--aiohttp-ab``'s rows: what goes between the timing middlewares (None: nothing)."""


def ours_at(rev: str) -> Callable[[], Any]:
    """``ResilientMiddleware`` from ``adapters/aiohttp.py`` as commit ``rev`` has it, loaded beside this checkout's as a module of its own.

    Only the driver's file comes from ``rev``; everything it imports (the core,
    the lane) is this checkout's. ``--against`` adds it as a row, so two
    versions of the driver run interleaved in one process.
    """
    root = Path(__file__).resolve().parents[1]
    show = ["git", "-C", str(root), "show", f"{rev}:adapters/aiohttp.py"]
    source = subprocess.run(show, check=True, capture_output=True, text=True).stdout
    module = types.ModuleType(f"_aiohttp_driver_at_{rev}")
    sys.modules[module.__name__] = module
    exec(compile(source, f"{rev}:adapters/aiohttp.py", "exec"), module.__dict__)
    return lambda: module.ResilientMiddleware(POLICIES)


async def aiohttp_ab(url: str, calls: int, rounds: int) -> dict[str, list[tuple[float, float, float]]]:
    """Per ``AB_VARIANTS`` row, (whole call, own) CPU microseconds per call and garbage collections per 1000 calls in each round.

    The rows are interleaved, shuffled per round.
    """
    sessions = {}
    for name, make in AB_VARIANTS.items():
        middle = () if make is None else (make(),)
        sessions[name] = aiohttp.ClientSession(middlewares=(_outer_mw, *middle, _inner_mw))

    async def ah(n: int, s: aiohttp.ClientSession) -> None:
        for _ in range(n):
            async with s.post(url, data=b"{}") as response:
                await response.read()

    out: dict[str, list[tuple[float, float, float]]] = {name: [] for name in sessions}
    try:
        for s in sessions.values():
            await ah(300, s)
        order = list(sessions)
        for r in range(rounds):
            print(f"round {r + 1}/{rounds}", file=sys.stderr, flush=True)
            random.shuffle(order)
            for name in order:
                CLOCK.reset()
                collected = sum(g["collections"] for g in gc.get_stats())
                t = time.thread_time_ns()
                await ah(calls, sessions[name])
                spent = time.thread_time_ns() - t
                collected = sum(g["collections"] for g in gc.get_stats()) - collected
                out[name].append((spent / calls / 1e3, (CLOCK.outer - CLOCK.inner) / calls / 1e3, collected * 1000 / calls))
    finally:
        for s in sessions.values():
            await s.close()
    return out


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
    ap.add_argument("--aiohttp-ab", action="store_true", help="aiohttp alone, one piece of ours off per row (AB_VARIANTS)")
    ap.add_argument("--against", metavar="REV", help="with --aiohttp-ab: also a row of ours with adapters/aiohttp.py at commit REV")
    args = ap.parse_args(argv)
    if args.aiohttp_ab:
        if args.against:
            AB_VARIANTS[f"ours, adapters/aiohttp.py at {args.against}"] = ours_at(args.against)
        with LoopbackServer() as server:
            ab = asyncio.run(aiohttp_ab(server.url + "/flush_cache", args.calls, args.rounds))
        print(
            "| aiohttp, between the timing layers | whole call, CPU (us): min / median | own CPU (us): min / median "
            "| garbage collections per 1000 calls |"
        )
        print("|---|---:|---:|---:|")
        for name, figures in ab.items():
            wholes, owns = sorted(f[0] for f in figures), sorted(f[1] for f in figures)
            collections = sum(f[2] for f in figures) / len(figures)
            print(
                f"| {name} | {wholes[0]:.1f} / {wholes[len(wholes) // 2]:.1f} | {owns[0]:.1f} / {owns[len(owns) // 2]:.1f} "
                f"| {collections:.1f} |"
            )
        return 0
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
