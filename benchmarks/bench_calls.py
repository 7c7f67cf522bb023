"""Work our layer adds to one successful request, counted: Python and C function calls, per driver.

Run: ``python benchmarks/bench_calls.py [--repeats 15]``

A keep-alive HTTP/1.1 server (``_loopback.LoopbackServer``, its own process)
answers every POST 200 at once. For each driver (requests, httpx sync, httpx
async, aiohttp) one client per variant, each on its own warm connection,
makes the same POST; ``sys.setprofile`` counts every ``call`` (a Python
function entered or a generator/coroutine resumed) and ``c_call`` (a C
function) event of one request, from the call into the client to its answer
read, except the calls the event loop's own code makes (``LOOP_FILES``: its
turns, and the insides of what others call in it). The variants:

- bare: the library alone;
- floor: the cheapest layer the library lets one add (a do-nothing
  ``httpx.BaseTransport`` / ``AsyncBaseTransport`` wrapper, a do-nothing
  aiohttp middleware; requests has none: a ``HTTPAdapter`` subclass whose
  ``send`` calls its parent's);
- ours, no observers;
- ours + ``MetricsObserver`` + ``TracingObserver`` on the OpenTelemetry
  API's no-op provider (no SDK).

The request is ``POST /flush_cache``, a control route: it takes the control
lane (``adapters/control_lane.py``). Bare and the last two variants are counted again on
a data route, ``POST /generate``, which does not: on httpx it waits for the
pool in our ``DataQueue`` / ``SyncDataQueue`` (``adapters/data_queue.py``),
whose slot, taken and given back, is work of ours too.

"added" is the variant's count minus bare's. Each figure is the smallest of
``--repeats`` counts of one request (the collector off while counting), after
warm-up calls that fill every cache: unlike a timing, a count does not move
with machine noise (an event loop may take one more turn when the answer
is late, which the minimum drops). Targets: ours adds at most 30 calls with
no observers and at most 70 with both, on every driver.

A last column counts, per variant, the objects a request leaves in reference
cycles (``cyclic_garbage``: only the cycle collector frees them, and its
pauses stop the caller's thread): httpx builds such cycles on every request
itself, requests and aiohttp none.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import platform
import selectors
import sys
import time
from collections import Counter
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import aiohttp
import httpx
import requests
import requests.adapters
from _loopback import LoopbackServer
from opentelemetry import trace

from resilience.adapters.aiohttp import ResilientMiddleware
from resilience.adapters.httpx import AsyncResilientTransport, ResilientTransport
from resilience.adapters.requests import ResilientAdapter
from resilience.policy import EndpointPolicy, PolicyTable
from resilience.telemetry.metrics import MetricsObserver
from resilience.telemetry.tracing import TracingObserver

POLICIES = PolicyTable({"POST /flush_cache": EndpointPolicy(), "POST /generate": EndpointPolicy()})
BODY = b"{}"
BARE = "bare"
FLOOR = "floor: a do-nothing layer"
NONE = "ours, no observers"
BOTH = "ours + metrics + tracing (API, no SDK)"
DATA = {BARE: f"{BARE}, data route", NONE: f"{NONE}, data route", BOTH: f"{BOTH}, data route"}
"""Variant -> its name counted on the data route (``POST /generate``); ours' rows there are compared with that route's bare."""
TARGETS = {NONE: 30, BOTH: 70, DATA[NONE]: 30, DATA[BOTH]: 70}
"""Variant -> the most calls it may add to bare."""
WARMUP = 20
GARBAGE_REQUESTS = 200
"""Requests whose cyclic garbage is counted per variant (``cyclic_garbage``)."""
LOOP_FILES = tuple(str(Path(m.__file__).parent if m is asyncio else Path(m.__file__)) for m in (asyncio, selectors))
"""The event loop's own code: what it calls is not counted (a late answer's extra loop turn then reads the same); what
other code calls in it is (``loop.call_at``: one call, whatever it does inside)."""


@dataclass
class Variant:
    """One client: its driver, its name, one request (sync, or a coroutine factory), the smallest count seen."""

    driver: str
    name: str
    sync: Callable[[], None] | None = None
    coro: Callable[[], Coroutine[Any, Any, None]] | None = None
    count: int = 0
    garbage: float = 0.0
    """Objects one request leaves for the cycle collector (``cyclic_garbage``)."""


def cyclic_garbage(run: Callable[[], None], requests: int = GARBAGE_REQUESTS) -> float:
    """Objects per request that only the cycle collector frees (in reference cycles): ``requests`` requests, collector
    off, then what one collection finds unreachable, divided by ``requests``. Fewer means rarer and shorter collections
    of the caller's process, whose pauses every call on its thread waits out."""
    gc.collect()
    gc.disable()
    try:
        for _ in range(requests):
            run()
        return gc.collect() / requests
    finally:
        gc.enable()


def counted(run: Callable[[], None], names: Counter[str] | None = None) -> int:
    """Function calls (Python and C) made while ``run()`` runs, collector off; each callee's name counted in ``names`` too."""
    n = 0

    def profile(frame: Any, event: str, arg: Any) -> None:
        nonlocal n
        if event == "c_call":
            caller = frame
        elif event == "call":
            caller = frame.f_back
        else:
            return
        if caller is None or not caller.f_code.co_filename.startswith(LOOP_FILES):
            n += 1
            if names is not None:
                if event == "call":
                    code = frame.f_code
                    names[f"{Path(code.co_filename).name}:{code.co_qualname}"] += 1
                else:
                    names[f"C {getattr(arg, '__qualname__', arg)}"] += 1

    gc.collect()
    gc.disable()
    try:
        sys.setprofile(profile)
        try:
            run()
        finally:
            sys.setprofile(None)
    finally:
        gc.enable()
    return n


class _PassTransport(httpx.BaseTransport):
    def __init__(self, inner: httpx.BaseTransport) -> None:
        self.inner = inner

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        return self.inner.handle_request(request)


class _AsyncPassTransport(httpx.AsyncBaseTransport):
    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self.inner = inner

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        return await self.inner.handle_async_request(request)


class _PassAdapter(requests.adapters.HTTPAdapter):
    def send(self, *args: Any, **kwargs: Any) -> requests.Response:  # type: ignore[override]
        return super().send(*args, **kwargs)


async def _pass_middleware(request: aiohttp.ClientRequest, handler: Any) -> aiohttp.ClientResponse:
    return await handler(request)  # type: ignore[no-any-return]


def _check(status: int) -> None:
    if status != 200:
        raise RuntimeError(f"unexpected status {status}")


def observers_of(name: str) -> list[Any]:
    return [MetricsObserver(), TracingObserver(trace.NoOpTracerProvider())] if name == BOTH else []


def requests_variants(url: str, closers: list[Callable[[], Any]]) -> list[Variant]:
    adapters: dict[str, requests.adapters.HTTPAdapter] = {
        BARE: requests.adapters.HTTPAdapter(max_retries=0),
        FLOOR: _PassAdapter(max_retries=0),
        NONE: ResilientAdapter(POLICIES, observers=observers_of(NONE)),
        BOTH: ResilientAdapter(POLICIES, observers=observers_of(BOTH)),
    }
    out = []
    for name, adapter in adapters.items():
        s = requests.Session()
        s.trust_env = False
        s.mount("http://", adapter)
        closers.append(s.close)

        def one(s: requests.Session = s) -> None:
            _check(s.post(url, data=BODY, timeout=5).status_code)

        out.append(Variant("requests", name, sync=one))
    return out


def httpx_sync_variants(url: str, closers: list[Callable[[], Any]]) -> list[Variant]:
    transports: dict[str, httpx.BaseTransport] = {
        BARE: httpx.HTTPTransport(),
        FLOOR: _PassTransport(httpx.HTTPTransport()),
        NONE: ResilientTransport(POLICIES, observers=observers_of(NONE)),
        BOTH: ResilientTransport(POLICIES, observers=observers_of(BOTH)),
    }
    out = []
    for name, transport in transports.items():
        c = httpx.Client(transport=transport)
        closers.append(c.close)

        def one(c: httpx.Client = c) -> None:
            _check(c.post(url, content=BODY).status_code)

        out.append(Variant("httpx sync", name, sync=one))
    return out


def httpx_async_variants(url: str, closers: list[Callable[[], Any]]) -> list[Variant]:
    transports: dict[str, httpx.AsyncBaseTransport] = {
        BARE: httpx.AsyncHTTPTransport(),
        FLOOR: _AsyncPassTransport(httpx.AsyncHTTPTransport()),
        NONE: AsyncResilientTransport(POLICIES, observers=observers_of(NONE)),
        BOTH: AsyncResilientTransport(POLICIES, observers=observers_of(BOTH)),
    }
    out = []
    for name, transport in transports.items():
        c = httpx.AsyncClient(transport=transport)
        closers.append(c.aclose)

        async def one(c: httpx.AsyncClient = c) -> None:
            _check((await c.post(url, content=BODY)).status_code)

        out.append(Variant("httpx async", name, coro=one))
    return out


def aiohttp_variants(url: str, closers: list[Callable[[], Any]]) -> list[Variant]:
    """Built inside the running loop (aiohttp wants one)."""
    middlewares: dict[str, tuple[Any, ...]] = {
        BARE: (),
        FLOOR: (_pass_middleware,),
        NONE: (ResilientMiddleware(POLICIES, observers=observers_of(NONE)),),
        BOTH: (ResilientMiddleware(POLICIES, observers=observers_of(BOTH)),),
    }
    out = []
    for name, mws in middlewares.items():
        s = aiohttp.ClientSession(middlewares=mws)
        closers.append(s.close)

        async def one(s: aiohttp.ClientSession = s) -> None:
            async with s.post(url, data=BODY) as r:
                await r.read()
                _check(r.status)

        out.append(Variant("aiohttp", name, coro=one))
    return out


def runner(loop: asyncio.AbstractEventLoop, v: Variant) -> Callable[[], None]:
    """One request of ``v``, as a plain call."""
    if v.sync is not None:
        return v.sync
    coro = v.coro
    assert coro is not None

    def run() -> None:
        loop.run_until_complete(coro())

    return run


def count(loop: asyncio.AbstractEventLoop, v: Variant, repeats: int) -> int:
    """The smallest count of one request over ``repeats``, after ``WARMUP`` uncounted ones."""
    run = runner(loop, v)
    for _ in range(WARMUP):
        run()
    return min(counted(run) for _ in range(repeats))


def detail(loop: asyncio.AbstractEventLoop, variants: list[Variant], driver: str, name: str) -> str:
    """Where ``name``'s added calls go on ``driver``: each callee counted in one request, minus bare's on its route (smallest of 5 each)."""

    def names_of(v: Variant) -> Counter[str]:
        run = runner(loop, v)
        best: tuple[int, Counter[str]] | None = None
        for _ in range(5):
            names: Counter[str] = Counter()
            n = counted(run, names)
            if best is None or n < best[0]:
                best = (n, names)
        assert best is not None
        return best[1]

    chosen = {v.name: v for v in variants if v.driver == driver}
    diff = names_of(chosen[name])
    diff.subtract(names_of(chosen[DATA[BARE] if name in DATA.values() else BARE]))
    rows = [f"{k}: {c:+d}" for k, c in sorted(diff.items(), key=lambda kv: (-kv[1], kv[0])) if c]
    return f"{driver}, {name}: {sum(diff.values()):+d} calls\n" + "\n".join(rows)


def table(variants: list[Variant], repeats: int, elapsed: float) -> str:
    out = [
        "## Work added to one successful request, counted (`benchmarks/bench_calls.py`)",
        "",
        f"<!-- python {platform.python_version()}, {platform.machine()}, {os.cpu_count()} CPUs; the smallest of {repeats} "
        f"counts of one request per variant, after {WARMUP} warm-up requests; {elapsed:.1f} s -->",
        "",
        "| driver | variant | function calls per request | added to bare | target | objects left for the cycle collector per request |",
        "|---|---|---:|---:|---|---:|",
    ]
    bare = {(v.driver, v.name): v.count for v in variants if v.name in (BARE, DATA[BARE])}
    verdicts = []
    for v in variants:
        added = v.count - bare[v.driver, DATA[BARE] if v.name in DATA.values() else BARE]
        target = "-"
        if v.name in TARGETS:
            limit = TARGETS[v.name]
            verdict = "met" if added <= limit else "MISSED"
            target = f"<= {limit}: {verdict}"
            verdicts.append(f"{v.driver}, {v.name}: {added} ({verdict})")
        shown = "-" if v.name in (BARE, DATA[BARE]) else added
        out.append(f"| {v.driver} | {v.name} | {v.count} | {shown} | {target} | {v.garbage:.1f} |")
    out += [
        "",
        "A call is a `sys.setprofile` `call` event (a Python function entered, or a generator or coroutine resumed) or a "
        "`c_call` event (a C function), counted from the call into the client to the answer read; the event loop's own "
        "turns are in every async row alike. The floor is the cheapest layer each library lets one add (a pass-through "
        "transport or middleware; for requests an `HTTPAdapter` subclass calling its parent's `send`). The last column: what "
        f"{GARBAGE_REQUESTS} requests left in reference cycles, counted by one collection with the collector off meanwhile, per "
        "request (httpx builds cycles of its own on every request; the rest is ours).",
        "",
        "Targets: " + "; ".join(verdicts) + ".",
    ]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    doc = __doc__ or ""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=15, help="counts of one request per variant; the smallest is kept (default 15)")
    ap.add_argument("--detail", choices=["requests", "httpx sync", "httpx async", "aiohttp"], default=None,
                    help="also print (stderr) each callee ours adds on this driver, by name, with and without observers")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    closers: list[Callable[[], Any]] = []
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    started = time.perf_counter()
    try:
        with LoopbackServer() as server:
            variants: list[Variant] = []
            for url in (server.url + "/flush_cache", server.url + "/generate"):
                made = requests_variants(url, closers) + httpx_sync_variants(url, closers) + httpx_async_variants(url, closers)

                async def make_aiohttp(url: str = url) -> list[Variant]:
                    return aiohttp_variants(url, closers)

                made += loop.run_until_complete(make_aiohttp())
                if variants:  # the data route: only ours, renamed
                    made = [replace(v, name=DATA[v.name]) for v in made if v.name in DATA]
                variants += made
            drivers = list(dict.fromkeys(v.driver for v in variants))
            variants.sort(key=lambda v: drivers.index(v.driver))
            for v in variants:
                v.count = count(loop, v, args.repeats)
                v.garbage = cyclic_garbage(runner(loop, v), GARBAGE_REQUESTS if args.repeats > 2 else 20)
            if args.detail is not None:
                for name in (NONE, BOTH, DATA[NONE], DATA[BOTH]):
                    print(detail(loop, variants, args.detail, name), file=sys.stderr)
            for close in closers:
                result = close()
                if asyncio.iscoroutine(result):
                    loop.run_until_complete(result)
    finally:
        loop.close()
    print(table(variants, args.repeats, time.perf_counter() - started))


if __name__ == "__main__":
    main()
