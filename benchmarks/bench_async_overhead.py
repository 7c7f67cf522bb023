"""Per-call overhead of our four drivers (requests, httpx sync and async, aiohttp) vs the bare transport and the peer retry libraries.

Run: ``python benchmarks/bench_async_overhead.py [--calls 100] [--rounds 30] [--quick]``

A keep-alive HTTP/1.1 server (``_loopback.LoopbackServer``, asyncio, its own
process so its CPU does not share the driver's GIL) answers every POST 200
with a 2-byte body at once. Four transports, each with its own bare client
and the same client wrapped by every retry layer measured here:

- requests: a ``requests.Session`` on a bare ``HTTPAdapter`` (no retries), on
  our ``ResilientAdapter``, on an ``HTTPAdapter`` with urllib3's ``Retry``
  (the library's own retries), and the bare session's call decorated with
  tenacity's ``@retry`` and ``@stamina.retry``;
- httpx sync: ``httpx.Client`` on ``HTTPTransport`` (bare), on our
  ``ResilientTransport``, on httpx-retries' ``RetryTransport``, and the bare
  client's call decorated with tenacity's ``@retry`` and ``@stamina.retry``;
- httpx async: the same with ``AsyncClient``, ``AsyncHTTPTransport`` and our
  ``AsyncResilientTransport``;
- aiohttp: a bare ``ClientSession``, one with our ``ResilientMiddleware``,
  aiohttp-retry's ``RetryClient``, tenacity and stamina decorating the call;
  and two diagnostic rows that split ours: the middleware with a policy
  without attempt timeout or deadline (it then skips its timed send), and a
  pass-through middleware (what aiohttp's middleware chain itself costs).

Every variant has its own client and connection (warmed up first) and makes
``--calls`` sequential successful POSTs per round (body read, status
checked); the variants run interleaved in a shuffled order every round, all
async ones on one event loop in the driver's main thread. The table reports,
per variant, the median over rounds of the wall time per call and of the
process's CPU time per call (``time.process_time``: all threads), and the
median over rounds of its ratio to its transport's bare client measured in
the same round (paired, which cancels most of the machine's drift), with the
min-max of that ratio over the rounds: the run's noise. No observers are
attached to ours. Targets: ours <= 1.05x the bare transport (wall) on
requests, httpx sync and httpx async, <= 1.08x on aiohttp (issue #29's
targets, per transport: ``TARGETS``), and no
worse than the cheapest peer on the same transport within the noise: ours'
median ratio at most the upper quartile of that peer's round ratios (the
min-max is printed too; on a shared machine it spans far more than any layer
costs).

Progress goes to stderr, the markdown table to stdout; the server process is
stopped whatever happens. Ours is skipped (and said so) where its adapter is
not importable.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import aiohttp
import httpx
import requests
import requests.adapters
import stamina
import tenacity
from _loopback import LoopbackServer
from aiohttp_retry import ExponentialRetry, RetryClient
from httpx_retries import Retry, RetryTransport
from urllib3.util.retry import Retry as Urllib3Retry

from resilience.policy import EndpointPolicy, PolicyTable

POLICIES = PolicyTable({"POST /flush_cache": EndpointPolicy()})
"""The route every call takes, with the default policy (4 attempts, 502/503/504 retried, 10 s per attempt)."""
TARGETS = {"requests": 1.05, "httpx sync": 1.05, "httpx async": 1.05, "aiohttp": 1.08}
"""Transport -> ours, wall per call, at most this times that transport's bare client (issue #29)."""
PEER_ATTEMPTS = 3
"""Attempts the peers are configured with (they never retry here: every answer is 200)."""
BODY = b"{}"
UNTIMED = PolicyTable({"POST /flush_cache": EndpointPolicy(attempt_timeout_s=None, deadline_s=None)})
"""The same route with no per-attempt timeout and no deadline: the middleware then skips its timed send."""
DIAGNOSTIC = "diagnostic:"
"""Rows that explain ours (not peers, no target)."""

SyncRun = Callable[[int], None]
AsyncRun = Callable[[int], Awaitable[None]]


@dataclass
class Variant:
    """One client measured: its transport, its name, and how to make ``n`` sequential calls."""

    transport: str
    client: str
    run: SyncRun | AsyncRun
    is_async: bool
    wall: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)
    wall_ratio: list[float] = field(default_factory=list)
    cpu_ratio: list[float] = field(default_factory=list)

    @property
    def bare(self) -> bool:
        return self.client.startswith("bare")

    @property
    def diagnostic(self) -> bool:
        return self.client.startswith(DIAGNOSTIC)

    @property
    def ours(self) -> bool:
        return self.client.startswith("ours")


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _check(status: int) -> None:
    if status != 200:
        raise RuntimeError(f"unexpected status {status}")


def _tenacity(exc: type[BaseException]) -> Any:
    """tenacity's decorator (sync or async alike): PEER_ATTEMPTS attempts on ``exc``, jittered exponential waits."""
    return tenacity.retry(
        stop=tenacity.stop_after_attempt(PEER_ATTEMPTS),
        wait=tenacity.wait_exponential_jitter(multiplier=0.1, max=5),
        retry=tenacity.retry_if_exception_type(exc),
        reraise=True,
    )


def _sync_loop(call: Callable[[], None]) -> SyncRun:
    def run(n: int) -> None:
        for _ in range(n):
            call()

    return run


def _async_loop(call: Callable[[], Awaitable[None]]) -> AsyncRun:
    async def run(n: int) -> None:
        for _ in range(n):
            await call()

    return run


def requests_variants(url: str, skipped: list[str], closers: list[Callable[[], Any]]) -> list[Variant]:
    """Bare, ours, urllib3's Retry, tenacity and stamina on ``requests.Session``."""

    def session(adapter: requests.adapters.HTTPAdapter) -> requests.Session:
        s = requests.Session()
        s.trust_env = False
        s.mount("http://", adapter)
        closers.append(s.close)
        return s

    sessions: dict[str, requests.Session] = {
        "bare HTTPAdapter": session(requests.adapters.HTTPAdapter(max_retries=0)),
        "urllib3 Retry on HTTPAdapter": session(requests.adapters.HTTPAdapter(max_retries=Urllib3Retry(total=PEER_ATTEMPTS - 1))),
    }
    try:
        from resilience.adapters.requests import ResilientAdapter

        sessions["ours: ResilientAdapter"] = session(ResilientAdapter(POLICIES))
    except ImportError as exc:
        skipped.append(f"ours on requests (resilience.adapters.requests: {exc})")

    def plain(s: requests.Session) -> Callable[[], None]:
        def call() -> None:
            _check(s.post(url, data=BODY, timeout=5).status_code)

        return call

    bare = sessions["bare HTTPAdapter"]

    def raising() -> None:
        bare.post(url, data=BODY, timeout=5).raise_for_status()

    variants = [Variant("requests", name, _sync_loop(plain(s)), False) for name, s in sessions.items()]
    variants.append(Variant("requests", "tenacity @retry", _sync_loop(_tenacity(requests.RequestException)(raising)), False))
    stamina_retry = stamina.retry(on=requests.RequestException, attempts=PEER_ATTEMPTS)
    variants.append(Variant("requests", "stamina @retry", _sync_loop(stamina_retry(raising)), False))
    return variants


def httpx_sync_variants(url: str, skipped: list[str], closers: list[Callable[[], Any]]) -> list[Variant]:
    """Bare, ours, httpx-retries, tenacity and stamina on ``httpx.Client``."""
    clients: dict[str, httpx.Client] = {
        "bare HTTPTransport": httpx.Client(transport=httpx.HTTPTransport()),
        "httpx-retries RetryTransport": httpx.Client(
            transport=RetryTransport(transport=httpx.HTTPTransport(), retry=Retry(total=PEER_ATTEMPTS - 1))
        ),
    }
    try:
        from resilience.adapters.httpx import ResilientTransport

        clients["ours: ResilientTransport"] = httpx.Client(transport=ResilientTransport(POLICIES))
    except ImportError as exc:
        skipped.append(f"ours on httpx sync (resilience.adapters.httpx: {exc})")
    closers.extend(c.close for c in clients.values())

    def plain(client: httpx.Client) -> Callable[[], None]:
        def call() -> None:
            _check(client.post(url, content=BODY).status_code)

        return call

    bare = clients["bare HTTPTransport"]

    def raising() -> None:
        bare.post(url, content=BODY).raise_for_status()

    variants = [Variant("httpx sync", name, _sync_loop(plain(c)), False) for name, c in clients.items()]
    variants.append(Variant("httpx sync", "tenacity @retry", _sync_loop(_tenacity(httpx.HTTPError)(raising)), False))
    variants.append(
        Variant("httpx sync", "stamina @retry", _sync_loop(stamina.retry(on=httpx.HTTPError, attempts=PEER_ATTEMPTS)(raising)), False)
    )
    return variants


def httpx_async_variants(url: str, skipped: list[str], closers: list[Callable[[], Any]]) -> list[Variant]:
    """Bare, ours, httpx-retries, tenacity and stamina on ``httpx.AsyncClient``."""
    clients: dict[str, httpx.AsyncClient] = {
        "bare AsyncHTTPTransport": httpx.AsyncClient(transport=httpx.AsyncHTTPTransport()),
        "httpx-retries RetryTransport": httpx.AsyncClient(
            transport=RetryTransport(transport=httpx.AsyncHTTPTransport(), retry=Retry(total=PEER_ATTEMPTS - 1))
        ),
    }
    try:
        from resilience.adapters.httpx import AsyncResilientTransport

        clients["ours: AsyncResilientTransport"] = httpx.AsyncClient(transport=AsyncResilientTransport(POLICIES))
    except ImportError as exc:
        skipped.append(f"ours on httpx async (resilience.adapters.httpx: {exc})")
    closers.extend(c.aclose for c in clients.values())

    def plain(client: httpx.AsyncClient) -> Callable[[], Awaitable[None]]:
        async def call() -> None:
            _check((await client.post(url, content=BODY)).status_code)

        return call

    bare = clients["bare AsyncHTTPTransport"]

    async def raising() -> None:
        (await bare.post(url, content=BODY)).raise_for_status()

    variants = [Variant("httpx async", name, _async_loop(plain(c)), True) for name, c in clients.items()]
    variants.append(Variant("httpx async", "tenacity @retry", _async_loop(_tenacity(httpx.HTTPError)(raising)), True))
    variants.append(
        Variant("httpx async", "stamina @retry", _async_loop(stamina.retry(on=httpx.HTTPError, attempts=PEER_ATTEMPTS)(raising)), True)
    )
    return variants


def aiohttp_variants(url: str, skipped: list[str], closers: list[Callable[[], Any]]) -> list[Variant]:
    """Bare, ours, aiohttp-retry, tenacity and stamina on ``aiohttp.ClientSession`` (call inside the running loop)."""
    bare = aiohttp.ClientSession()
    retry_client = RetryClient(client_session=aiohttp.ClientSession(), retry_options=ExponentialRetry(attempts=PEER_ATTEMPTS))
    closers.extend([bare.close, retry_client.close])
    ours: aiohttp.ClientSession | None = None
    untimed: aiohttp.ClientSession | None = None

    async def noop(request: aiohttp.ClientRequest, handler: Any) -> aiohttp.ClientResponse:
        return await handler(request)  # type: ignore[no-any-return]

    passthrough = aiohttp.ClientSession(middlewares=(noop,))
    closers.append(passthrough.close)
    try:
        from resilience.adapters.aiohttp import ResilientMiddleware

        ours = aiohttp.ClientSession(middlewares=(ResilientMiddleware(POLICIES),))
        untimed = aiohttp.ClientSession(middlewares=(ResilientMiddleware(UNTIMED),))
        closers.extend([ours.close, untimed.close])
    except ImportError as exc:
        skipped.append(f"ours on aiohttp (resilience.adapters.aiohttp: {exc})")

    def plain(session: aiohttp.ClientSession | RetryClient) -> Callable[[], Awaitable[None]]:
        async def call() -> None:
            async with session.post(url, data=BODY) as r:
                await r.read()
                _check(r.status)

        return call

    async def raising() -> None:
        async with bare.post(url, data=BODY) as r:
            await r.read()
            r.raise_for_status()

    variants = [Variant("aiohttp", "bare ClientSession", _async_loop(plain(bare)), True)]
    if ours is not None and untimed is not None:
        variants.append(Variant("aiohttp", "ours: ResilientMiddleware", _async_loop(plain(ours)), True))
        untimed_name = f"{DIAGNOSTIC} ours, policy without attempt timeout or deadline"
        variants.append(Variant("aiohttp", untimed_name, _async_loop(plain(untimed)), True))
    passthrough_name = f"{DIAGNOSTIC} a pass-through middleware (aiohttp's own cost)"
    variants.append(Variant("aiohttp", passthrough_name, _async_loop(plain(passthrough)), True))
    variants.append(Variant("aiohttp", "aiohttp-retry RetryClient", _async_loop(plain(retry_client)), True))
    variants.append(Variant("aiohttp", "tenacity @retry", _async_loop(_tenacity(aiohttp.ClientError)(raising)), True))
    variants.append(
        Variant("aiohttp", "stamina @retry", _async_loop(stamina.retry(on=aiohttp.ClientError, attempts=PEER_ATTEMPTS)(raising)), True)
    )
    return variants


def measure(loop: asyncio.AbstractEventLoop, v: Variant, n: int) -> tuple[float, float]:
    """(wall, CPU) seconds per call over ``n`` sequential calls."""
    c0, t0 = time.process_time(), time.perf_counter()
    if v.is_async:
        loop.run_until_complete(v.run(n))  # type: ignore[arg-type]
    else:
        v.run(n)
    return (time.perf_counter() - t0) / n, (time.process_time() - c0) / n


def _upper_quartile(values: list[float]) -> float:
    """The 75th percentile (the largest value when there are fewer than two)."""
    return statistics.quantiles(values, n=4)[2] if len(values) >= 2 else max(values)


def table(variants: list[Variant], rounds: int, calls: int, elapsed: float, skipped: list[str]) -> str:
    out = [
        "## HTTP drivers: per-call overhead vs the bare transport and the peers (`benchmarks/bench_async_overhead.py`)",
        "",
        f"<!-- python {platform.python_version()}, {platform.machine()}, {os.cpu_count()} CPUs, load average at the end "
        f"{os.getloadavg()[0]:.1f}; {rounds} rounds x {calls} calls per variant, interleaved; {elapsed:.1f} s -->",
        "",
        "| transport | client | wall per call, median (us) | min-max round (us) | CPU per call (us) | wall ratio to bare "
        "| min-max ratio over rounds | CPU ratio to bare | target |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    verdicts = []
    for transport in dict.fromkeys(v.transport for v in variants):
        group = [v for v in variants if v.transport == transport]
        ours = next((v for v in group if v.ours), None)
        ours_ratio = statistics.median(ours.wall_ratio) if ours else None
        limit = TARGETS[transport]
        peers = [v for v in group if not v.bare and not v.ours and not v.diagnostic]
        cheapest = min(peers, key=lambda p: statistics.median(p.wall_ratio)) if peers else None
        for v in group:
            ratio = statistics.median(v.wall_ratio)
            if v.bare or v.diagnostic:
                target = "-"
            elif v.ours:
                target = f"<= {limit:.2f}x: {'met' if ratio <= limit else 'MISSED'}"
            elif ours_ratio is not None and v is cheapest:
                target = f"cheapest peer; ours within its noise: {'yes' if ours_ratio <= _upper_quartile(v.wall_ratio) else 'NO'}"
            else:
                target = "-"
            out.append(
                f"| {v.transport} | {v.client} | {statistics.median(v.wall) * 1e6:.0f} | {min(v.wall) * 1e6:.0f}-{max(v.wall) * 1e6:.0f} "
                f"| {statistics.median(v.cpu) * 1e6:.0f} | {ratio:.2f}x | {min(v.wall_ratio):.2f}-{max(v.wall_ratio):.2f} "
                f"| {statistics.median(v.cpu_ratio):.2f}x | {target} |"
            )
        if ours is not None and ours_ratio is not None:
            verdict = f"{transport}: ours {ours_ratio:.2f}x of at most {limit:.2f}x ({'met' if ours_ratio <= limit else 'MISSED'})"
            if cheapest is not None:
                c_ratio, c_q3 = statistics.median(cheapest.wall_ratio), _upper_quartile(cheapest.wall_ratio)
                within = ours_ratio <= c_q3
                spread = f"{min(cheapest.wall_ratio):.2f}-{max(cheapest.wall_ratio):.2f}"
                verdict += (
                    f", cheapest peer {cheapest.client} {c_ratio:.2f}x (upper quartile {c_q3:.2f}, rounds {spread}): "
                    f"{'within its noise' if within else 'NOT within its noise'}"
                )
            verdicts.append(verdict)
    out.append("")
    out.append(
        "Ratios are the median over rounds of each variant's time over its transport's bare client in the same round; "
        "CPU is the whole driver process's (`time.process_time`), server excluded. Peers are configured with "
        f"{PEER_ATTEMPTS} attempts; no call is retried here (every answer is 200), so this is each layer's cost on the "
        "success path."
    )
    out.append("")
    if verdicts:
        out.append(
            "Target: ours <= the bare transport times "
            + ", ".join(f"{limit:.2f} on {transport}" for transport, limit in TARGETS.items())
            + " (wall), and no worse than the cheapest peer within the noise "
            "(ours' median ratio at most the upper quartile of that peer's round ratios). " + "; ".join(verdicts) + "."
        )
    for line in skipped:
        out.append(f"Not measured: {line}.")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    """Parse the flags, run the interleaved rounds, print the table."""
    doc = __doc__ or ""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--calls", type=int, default=100, help="sequential calls per variant per round (default 100)")
    ap.add_argument("--rounds", type=int, default=30, help="interleaved rounds; medians over them are shown (default 30)")
    ap.add_argument("--warmup", type=int, default=50, help="untimed calls per variant first (default 50)")
    ap.add_argument("--quick", action="store_true", help="small run for development: 30 calls, 3 rounds, 10 warm-up")
    args = ap.parse_args(argv)
    if args.quick:
        args.calls, args.rounds, args.warmup = 30, 3, 10
    if args.calls < 1 or args.rounds < 1 or args.warmup < 0:
        ap.error("--calls and --rounds must be >= 1, --warmup >= 0")

    skipped: list[str] = []
    closers: list[Callable[[], Any]] = []
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        with LoopbackServer() as server:
            url = server.url + "/flush_cache"
            variants = requests_variants(url, skipped, closers) + httpx_sync_variants(url, skipped, closers)
            variants += httpx_async_variants(url, skipped, closers)

            async def make_aiohttp() -> list[Variant]:
                return aiohttp_variants(url, skipped, closers)

            variants += loop.run_until_complete(make_aiohttp())
            progress(f"{len(variants)} variants; warming up ({args.warmup} calls each)")
            for v in list(variants):
                try:
                    measure(loop, v, max(1, args.warmup))
                except Exception as exc:  # a broken layer is reported, the others still measured
                    if v.bare:
                        raise
                    skipped.append(f"{v.transport}, {v.client} (failed: {exc!r})")
                    variants.remove(v)
            bare = {v.transport: v for v in variants if v.bare}
            rng = random.Random(1)
            order = list(variants)
            started = time.perf_counter()
            for i in range(args.rounds):
                rng.shuffle(order)
                this_round: dict[str, tuple[float, float]] = {}
                for v in order:
                    this_round[v.client + "@" + v.transport] = measure(loop, v, args.calls)
                for v in variants:
                    wall, cpu = this_round[v.client + "@" + v.transport]
                    b_wall, b_cpu = this_round[bare[v.transport].client + "@" + v.transport]
                    v.wall.append(wall)
                    v.cpu.append(cpu)
                    v.wall_ratio.append(wall / b_wall)
                    v.cpu_ratio.append(cpu / b_cpu)
                progress(f"round {i + 1}/{args.rounds} done")
            elapsed = time.perf_counter() - started
    finally:
        for close in closers:
            result = close()
            if asyncio.iscoroutine(result):
                loop.run_until_complete(result)
        loop.run_until_complete(asyncio.sleep(0.05))  # let aiohttp's transports finish closing
        loop.close()
    print(table(variants, args.rounds, args.calls, elapsed, skipped))


if __name__ == "__main__":
    main()
