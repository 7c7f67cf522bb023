"""Our own code's CPU on a successful call, without sockets: the retry core alone, and each driver over a canned transport.

Run: ``python benchmarks/micro_success_path.py [--calls 20000] [--repeats 7] [--observers none|metrics|tracing|both] [--clock wall|cpu]``

No server and no network: what is left is what our layer adds to a call.

- ``core run`` / ``core arun``: ``Retrier.run`` / ``Retrier.arun`` (default
  breaker and budget, no observers) around an attempt that answers 200 at once;
- ``requests``: ``ResilientAdapter.send`` over an ``HTTPAdapter`` whose
  ``send`` returns a canned ``Response``, minus that canned ``send`` alone
  (without the control lane, whose own adapter would dial);
- ``httpx sync`` / ``httpx async``: ``ResilientTransport`` /
  ``AsyncResilientTransport`` over a transport that returns a canned
  ``httpx.Response``, minus that transport alone;
- ``aiohttp``: ``ResilientMiddleware`` called with a real ``ClientRequest``
  and a handler that returns a canned response, minus that handler alone
  (no timed send runs: the handler never calls ``ClientRequest.send``).

``--observers`` attaches, to every driver and the core (default ``none``):
``metrics`` (``MetricsObserver``), ``tracing`` (``TracingObserver`` on the
API's no-op provider: no SDK) or ``both``.

Each figure is the best (smallest) of ``--repeats`` timings of ``--calls``
sequential calls, in microseconds of wall time per call, on one thread;
``--clock cpu`` times the thread's CPU instead (``time.thread_time``), which
a loaded machine disturbs less (time spent waiting for a core is not counted). The
commands in ``benchmarks/NOTES.md`` run this at two commits with
``benchmarks/ab.py``. Measured by hand; not run by ``run_all.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import aiohttp
import httpx
import requests
import requests.adapters

from resilience.adapters.aiohttp import ResilientMiddleware
from resilience.adapters.driver_config import DriverConfig
from resilience.adapters.httpx import AsyncResilientTransport, ResilientTransport
from resilience.adapters.requests import ResilientAdapter
from resilience.adapters.requests_errors import ERROR_TYPES
from resilience.breaker import BreakerConfig
from resilience.budget import RetryBudgetConfig
from resilience.policy import EndpointPolicy, PolicyTable
from resilience.retry.retrier import Retrier
from resilience.retry.spec import AttemptResult, CallSpec, responded

POLICIES = PolicyTable({"POST /flush_cache": EndpointPolicy()})
CLOCK: list[Callable[[], float]] = [time.perf_counter]
"""What ``best`` times with (``--clock``)."""
OBSERVERS: list[Any] = []
"""What ``--observers`` attaches (set in ``main``)."""
URL = "http://127.0.0.1:9/flush_cache"
"""Never dialled: every transport here is canned."""


def best(repeats: int, calls: int, run: Callable[[int], Any]) -> float:
    """The smallest of ``repeats`` timings of ``run(calls)``, per call, in microseconds."""
    times = []
    for _ in range(repeats):
        t0 = CLOCK[0]()
        run(calls)
        times.append((CLOCK[0]() - t0) / calls * 1e6)
    return min(times)


def abest(loop: asyncio.AbstractEventLoop, repeats: int, calls: int, run: Callable[[int], Awaitable[None]]) -> float:
    return best(repeats, calls, lambda n: loop.run_until_complete(run(n)))


def core(repeats: int, calls: int, loop: asyncio.AbstractEventLoop) -> dict[str, float]:
    retrier = Retrier.from_configs(breaker=BreakerConfig(), retry_budget=RetryBudgetConfig(), observers=OBSERVERS, error_types=ERROR_TYPES)
    match = POLICIES.match("POST", "/flush_cache")
    response = object()
    headers: dict[str, str] = {}

    def spec() -> CallSpec:
        return CallSpec("POST", URL, match, "http://127.0.0.1:9", "127.0.0.1", 9, request_timeout=(5.0, 5.0))

    def attempt(n: int, t: Any, c: MutableMapping[str, str]) -> AttemptResult[object]:
        return responded(response, 200, headers)

    async def aattempt(n: int, t: Any, c: MutableMapping[str, str]) -> AttemptResult[object]:
        return responded(response, 200, headers)

    def run(n: int) -> None:
        for _ in range(n):
            retrier.run(spec(), attempt)

    async def arun(n: int) -> None:
        for _ in range(n):
            await retrier.arun(spec(), aattempt)

    return {"core run": best(repeats, calls, run), "core arun": abest(loop, repeats, calls, arun)}


class _CannedAdapter(requests.adapters.HTTPAdapter):
    """An ``HTTPAdapter`` whose ``send`` answers 200 without a socket."""

    def send(self, request: Any, *args: Any, **kwargs: Any) -> requests.Response:
        r = requests.Response()
        r.status_code = 200
        r._content = b"ok"
        r.request = request
        r.url = request.url
        return r


class _CannedResilient(ResilientAdapter, _CannedAdapter):
    """``ResilientAdapter`` whose attempts reach ``_CannedAdapter.send`` (its ``super().send``)."""


def requests_row(repeats: int, calls: int) -> float:
    prepared = requests.Request("POST", URL, data=b"{}").prepare()
    # no control lane: its adapter's own ``send`` would dial the (never dialled) URL instead of ``_CannedAdapter.send``
    bare, ours = _CannedAdapter(), _CannedResilient(config=DriverConfig(POLICIES, observers=OBSERVERS, control_lane=None))

    def loop(adapter: requests.adapters.HTTPAdapter) -> Callable[[int], None]:
        def run(n: int) -> None:
            for _ in range(n):
                adapter.send(prepared, timeout=5)

        return run

    return best(repeats, calls, loop(ours)) - best(repeats, calls, loop(bare))


class _Canned(httpx.BaseTransport):
    def handle_request(self, request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=b"ok", request=request)


class _ACanned(httpx.AsyncBaseTransport):
    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=b"ok", request=request)


def httpx_rows(repeats: int, calls: int, loop: asyncio.AbstractEventLoop) -> dict[str, float]:
    request = httpx.Client().build_request("POST", URL, content=b"{}")
    inner, ours = _Canned(), ResilientTransport(POLICIES, transport=_Canned(), observers=OBSERVERS)
    ainner, aours = _ACanned(), AsyncResilientTransport(POLICIES, transport=_ACanned(), observers=OBSERVERS)

    def loop_(t: httpx.BaseTransport) -> Callable[[int], None]:
        def run(n: int) -> None:
            for _ in range(n):
                t.handle_request(request)

        return run

    def aloop(t: httpx.AsyncBaseTransport) -> Callable[[int], Awaitable[None]]:
        async def run(n: int) -> None:
            for _ in range(n):
                await t.handle_async_request(request)

        return run

    sync = best(repeats, calls, loop_(ours)) - best(repeats, calls, loop_(inner))
    asynchronous = abest(loop, repeats, calls, aloop(aours)) - abest(loop, repeats, calls, aloop(ainner))
    return {"httpx sync": sync, "httpx async": asynchronous}


class _Response:
    status = 200
    headers: dict[str, str] = {}  # noqa: RUF012


def aiohttp_row(repeats: int, calls: int, loop: asyncio.AbstractEventLoop) -> float:
    async def build() -> tuple[aiohttp.ClientSession, aiohttp.ClientRequest]:
        session = aiohttp.ClientSession()
        request = aiohttp.ClientRequest("POST", aiohttp.client.URL(URL), data=b"{}", loop=loop, session=session)
        return session, request

    session, request = loop.run_until_complete(build())
    middleware = ResilientMiddleware(POLICIES, observers=OBSERVERS)

    async def handler(req: aiohttp.ClientRequest) -> Any:
        return _Response()

    async def ours(n: int) -> None:
        for _ in range(n):
            await middleware(request, handler)

    async def bare(n: int) -> None:
        for _ in range(n):
            await handler(request)

    try:
        return abest(loop, repeats, calls, ours) - abest(loop, repeats, calls, bare)
    finally:
        loop.run_until_complete(session.close())


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--calls", type=int, default=20000, help="sequential calls per timing (default 20000)")
    ap.add_argument("--repeats", type=int, default=7, help="timings; the best is shown (default 7)")
    ap.add_argument("--observers", choices=("none", "metrics", "tracing", "both"), default="none", help="observers on ours (default none)")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall", help="time wall (default) or this thread's CPU")
    args = ap.parse_args(argv)
    CLOCK[0] = time.thread_time if args.clock == "cpu" else time.perf_counter
    if args.observers in ("metrics", "both"):
        from resilience.telemetry.metrics import MetricsObserver

        OBSERVERS.append(MetricsObserver())
    if args.observers in ("tracing", "both"):
        from opentelemetry import trace

        from resilience.telemetry.tracing import TracingObserver

        OBSERVERS.append(TracingObserver(trace.NoOpTracerProvider()))
    loop = asyncio.new_event_loop()
    try:
        rows = core(args.repeats, args.calls, loop)
        rows["requests"] = requests_row(args.repeats, args.calls)
        rows.update(httpx_rows(args.repeats, args.calls, loop))
        rows["aiohttp"] = aiohttp_row(args.repeats, args.calls, loop)
    finally:
        loop.close()
    print(f"| our code on a successful call (observers: {args.observers}, clock: {args.clock}) | us per call |")
    print("|---|---:|")
    for name, value in rows.items():
        print(f"| ours: {name} | {value:.1f} |")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
