"""How far any change to the httpx async lane could go: its loaded p99 with the lane's waits cut by force, and the remedies.

Run: ``.venv/bin/python benchmarks/lane_upper_bound.py [--rounds 3] [--samples 1000] [--streams 1000]``

Issue 31's goal is a control call's p99 beside 1,000 streams within 2x of
its idle p50. ``bench_control_lane.py`` measures the httpx async lane at
6-9x, and the field's own fix (a second, dedicated client) no better. An
idle control call on the lane suspends 6 times, five of them anyio
``sleep(0)`` checkpoints inside httpcore (its locks and socket sends), and
each turn of a loop that carries 1,000 httpx streams can be long. This
script runs ``bench_control_lane.py``'s ``mounted`` row for httpx async
(the same load, samples and lag probe) five ways, taking turns, round by
round:

- ``lane``: as shipped;
- ``lane, no checkpoints``: anyio's ``checkpoint`` and
  ``cancel_shielded_checkpoint`` return at once inside the control call's
  task (a ``ContextVar``; the streams keep theirs): every suspension of
  httpcore's but the socket's own waits gone, more than any change to the
  lane could remove, and not safe to ship (a lock that never yields, a
  cancellation never seen);
- ``lane in threads``: the lane's requests sent by a plain ``httpx.HTTPTransport``
  (httpcore's sync pool, no checkpoints at all) on worker threads
  (``run_in_executor``), the answer read there whole and handed back: the
  loop's only work is the one wake-up a finished future costs;
- ``lane, gc.freeze() first``: as shipped, but with ``gc.collect()`` and
  ``gc.freeze()`` just before the round (``gc.unfreeze()`` after it): what
  ``docs/http-clients.md`` tells a user to try, since a third to a half of
  a slow call's wait is collection pauses over every object the process holds;
- ``control calls from another process``: the streams as before, the
  control calls made by our sync ``ResilientTransport`` in a second Python
  process (one call per line on its stdin; it times each call itself and
  writes the seconds back), the remedy docs/http-clients.md names: a loop
  and a collector of its own, sharing only the machine's CPUs.

If neither the second nor the third meets the goal, no lane in this process
does: the remainder is the loop's own turns under this load (the ``lag p99 /
idle p50`` column: one byte through a socket pair, the floor a response's
wake-up cannot beat; for the last row it is the streaming process's loop,
which that row's calls never wait for). If the last misses too, the
remainder is the machine's CPUs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import functools
import gc
import os
import statistics
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import anyio._backends._asyncio as anyio_asyncio
import bench_control_lane as bench
import httpx

from resilience.adapters.httpx import AsyncResilientTransport
from resilience.testing.stream_server import StreamServer

VARIANTS = ("lane", "lane, no checkpoints", "lane in threads", "lane, gc.freeze() first", "control calls from another process")
FROZEN = "lane, gc.freeze() first"
OTHER = "control calls from another process"
ROOT = Path(__file__).resolve().parents[1]
_OTHER_PROCESS = """
import sys, time
import bench_control_lane as bench
import httpx
from resilience.adapters.httpx import ResilientTransport
client = httpx.Client(transport=ResilientTransport(config=bench._config(True)), timeout=bench.TIMEOUT_S)
for _ in sys.stdin:
    started = time.perf_counter()
    with client.stream("POST", sys.argv[1] + bench.CONTROL, json=bench.BODY) as response:
        for _ in response.iter_raw():
            pass
    print(time.perf_counter() - started, flush=True)
client.close()
"""
"""The ``OTHER`` variant's control client (the ``mounted`` row's config, on the sync driver): one call per line read,
its own timing written back."""

_IN_CONTROL_CALL: contextvars.ContextVar[bool] = contextvars.ContextVar("in_control_call", default=False)
"""True inside a control call of the ``lane, no checkpoints`` variant (set in its task's context only)."""
_COUNTS = {"skipped": 0, "threaded": 0, "frozen": 0, "other process": 0}
"""Checkpoints skipped inside control calls, control calls sent on worker threads, the objects frozen before a round,
and control calls timed by the other process: proof that each variant ran as named (printed under the table)."""
_BACKEND: Any = anyio_asyncio.AsyncIOBackend
_CHECKPOINT = _BACKEND.checkpoint.__func__
_SHIELDED = _BACKEND.cancel_shielded_checkpoint.__func__


async def _checkpoint(cls: Any) -> None:
    if _IN_CONTROL_CALL.get():
        _COUNTS["skipped"] += 1
        return
    await _CHECKPOINT(cls)


async def _shielded(cls: Any) -> None:
    if _IN_CONTROL_CALL.get():
        _COUNTS["skipped"] += 1
        return
    await _SHIELDED(cls)


class _ThreadLane(httpx.AsyncBaseTransport):
    """A control call sent and read whole by httpcore's sync pool on a worker thread."""

    def __init__(self) -> None:
        self.sync = httpx.HTTPTransport()
        self.threads = ThreadPoolExecutor(8, thread_name_prefix="lane")

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        body = await request.aread()
        copy = httpx.Request(request.method, request.url, headers=request.headers, content=body, extensions=request.extensions)

        def send() -> tuple[int, httpx.Headers, bytes]:
            _COUNTS["threaded"] += 1
            response = self.sync.handle_request(copy)
            try:
                return response.status_code, response.headers, response.read()
            finally:
                response.close()

        status, headers, content = await asyncio.get_running_loop().run_in_executor(self.threads, send)
        return httpx.Response(status, headers=headers, stream=httpx.ByteStream(content))

    async def aclose(self) -> None:
        self.threads.shutdown()
        self.sync.close()


async def _other_process() -> asyncio.subprocess.Process:
    """The ``OTHER`` variant's control client, started."""
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        _OTHER_PROCESS,
        bench.url_of[0],
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": os.pathsep.join((str(ROOT), str(ROOT / "benchmarks")))},
    )


async def _clients(variant: str, driver: str, mode: str) -> bench.AsyncClients:
    """``bench.AsyncClients`` of the ``mounted`` httpx async row (``driver``, ``mode``), its lane or its control calls as
    ``variant`` says."""
    transport = AsyncResilientTransport(config=bench._config(True))
    threads = _ThreadLane() if variant == "lane in threads" else None
    if threads is not None:
        transport._sending(transport._data, threads.handle_async_request)
    client = httpx.AsyncClient(transport=transport, timeout=bench.TIMEOUT_S)
    other = await _other_process() if variant == OTHER else None

    async def send(path: str) -> None:
        token = _IN_CONTROL_CALL.set(variant == "lane, no checkpoints" and path == bench.CONTROL)
        try:
            async with client.stream("POST", f"{bench.url_of[0]}{path}", json=bench.BODY) as response:
                async for _ in response.aiter_raw():
                    pass
        finally:
            _IN_CONTROL_CALL.reset(token)

    async def elsewhere() -> float:
        """One control call made by the other process: its own timing of it."""
        assert other is not None and other.stdin is not None and other.stdout is not None
        other.stdin.write(b"\n")
        await other.stdin.drain()
        line = await other.stdout.readline()
        if not line:
            raise RuntimeError(f"the control process ended (exit {await other.wait()})")
        _COUNTS["other process"] += 1
        return float(line)

    async def close() -> None:
        await client.aclose()
        if threads is not None:
            await threads.aclose()
        if other is not None:
            assert other.stdin is not None
            other.stdin.close()
            await other.wait()

    return (elsewhere if other is not None else functools.partial(bench._atimed, send)), send, close


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=bench.ROUNDS, help=f"rounds of each variant, taking turns (default {bench.ROUNDS})")
    parser.add_argument("--samples", type=int, default=1000, help="idle and loaded control calls per round (default 1000)")
    parser.add_argument("--streams", type=int, default=1000, help="streams on the loop (default 1000)")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    _BACKEND.checkpoint = classmethod(_checkpoint)
    _BACKEND.cancel_shielded_checkpoint = classmethod(_shielded)
    results = {v: bench._Result("httpx async", v, "", [], []) for v in VARIANTS}
    with StreamServer(interval_s=bench.INTERVAL_S, events=bench.EVENTS) as server:
        bench.url_of[0] = server.url
        for number in range(args.rounds):
            for variant, result in results.items():
                print(f"{variant}, round {number + 1} of {args.rounds} ...", file=sys.stderr, flush=True)
                if variant == FROZEN:
                    gc.collect()
                    gc.freeze()
                    _COUNTS["frozen"] = max(_COUNTS["frozen"], gc.get_freeze_count())
                clients = functools.partial(_clients, variant)
                try:
                    row = asyncio.run(bench._async_row("httpx async", "mounted", args.streams, args.samples, 0, clients))
                finally:
                    gc.unfreeze()
                result.rounds.append(row)
    print(f"## How far the httpx async lane could go (`benchmarks/lane_upper_bound.py --rounds {args.rounds}`)\n")
    print(
        f"{args.streams} streams on one loop, {args.samples} control calls idle and loaded per round, {args.rounds} rounds "
        "taking turns; ratios are each round's loaded p99 over its own idle p50, the median of the rounds judged "
        "against the goal (<= 2x).\n"
    )
    print(
        "| lane | idle p50 ms | loaded p50 ms | loaded p99 ms | each round's loaded p99 / idle p50 | median "
        "| lag p99 / idle p50, median |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for variant, result in results.items():
        idle, loaded = result.pooled(0), result.pooled(1)
        assert idle and loaded, f"{variant}: no samples"
        ratios = result.ratios()
        floors = [bench._ms(r[2], 0.99) / bench._ms(r[0], 0.5) for r in result.rounds]
        print(
            f"| {variant} | {bench._ms(idle, 0.5):.2f} | {bench._ms(loaded, 0.5):.2f} | {bench._ms(loaded, 0.99):.2f} | "
            f"{' / '.join(f'{x:.1f}' for x in ratios)} | {statistics.median(ratios):.1f}x | {statistics.median(floors):.1f}x |"
        )
    print(
        f"\nCheckpoints skipped inside control calls: {_COUNTS['skipped']}; control calls sent on worker threads: "
        f"{_COUNTS['threaded']}; objects frozen before a round: {_COUNTS['frozen']}; control calls timed by the other "
        f"process: {_COUNTS['other process']}."
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
