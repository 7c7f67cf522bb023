"""Barrier on one event loop: offload + onload across N engines, AsyncFanOut vs ThreadFanOut vs raw aiohttp.

Run: ``python benchmarks/bench_barrier_async.py [--latency 0.05] [--sizes 8,64,256,1024] [--repeats 7] [--gc on|freeze|off] [--quick]
[--variants floor,threads,gather,fanout,aorch,shared]``

N fake SGLang engines listen on 127.0.0.1 (``benchmarks/_engines.py``: one
asyncio loop in a child process, every control call answered after
``--latency`` seconds). One round is ``offload()`` then ``onload()``: pause,
flush, release, resume, continue, each phase sent to all N engines at once.
Each variant runs in a driver process of its own, so the garbage collector
walks only that variant's objects (in one shared process, every full
collection walked all six variants' clients, and the variant that pauses the
collector least paid most). The variants take turns, one round each at a time,
in an order shuffled every repeat:

- ``ThreadFanOut``: the sync ``Orchestrator`` with ``SGLangClient``s (requests);
- ``AsyncFanOut``: the sync ``Orchestrator`` with ``AsyncFanOut`` (its own loop
  thread) and ``AsyncSGLangClient``s (default transport);
- ``AsyncOrchestrator``: ``await offload()`` / ``await onload()`` with
  ``AsyncFanOut`` and ``AsyncSGLangClient``s, on the driver's own loop, built
  as a user builds it by default: ``AsyncOrchestrator(EngineGroup(
  [AsyncSGLangClient(u) for u in urls]))``, each client on its own default
  session, every other setting left at its default (the plain-default row);
- the same with one aiohttp session (and its ``ResilientMiddleware``) shared
  by all clients, to show what a shared session would change;
- the raw aiohttp floor: the same five phases' POSTs (same paths and bodies)
  as a bare ``asyncio.gather`` per phase on one ``aiohttp.ClientSession``
  (unlimited connector, connections warmed), no resilience, no orchestrator;
- between the two, to show where time goes: the five phases as a bare
  ``asyncio.gather`` of ``AsyncSGLangClient`` calls (client, middleware and
  retry core; no orchestrator), with the garbage collector paused for each
  phase as the orchestrators pause it (``pause_collector``, the same bound).
  Without the pause, its full collections walk every client's long-lived
  objects (about 130 each): at N = 1024 that doubled its CPU per engine call,
  a cost of the collector in a process holding 1024 clients, not of the calls.

Each is shown against two floors: ``5 x latency`` (every phase as long as one
engine's answer) and the raw-aiohttp round measured in the same run.
Targets: AsyncFanOut and AsyncOrchestrator within 1.15x of the raw-aiohttp
floor at every N; ThreadFanOut's row is kept for comparison (its speed-up
column), with no target. Every size needs about 6 x N file descriptors in the
drivers and as many in the engines' process: the benchmark raises its soft
limit (``RLIMIT_NOFILE``) toward the hard one when that is short, and says so
in the table's comment line. A variant whose module is not
importable is skipped and named under the table. Progress goes to stderr, the
markdown table to stdout; the engines' process and every client are closed
whatever happens. ``--profile`` writes a cProfile of the AsyncOrchestrator
rounds at the largest N (the loop runs in its driver's main thread, so the
profile sees all of it) to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import io
import multiprocessing
import os
import platform
import pstats
import random
import resource
import signal
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import aiohttp
from _engines import FakeEngines

from resilience.adapters.sglang import SGLangClient
from resilience.barrier import ALL_TAGS, EngineGroup, Orchestrator, PhaseDeadlines
from resilience.barrier.fanout import ThreadFanOut

PHASES = 5
"""Phases of one offload + onload round: pause, flush, release, resume, continue."""
DEADLINES = PhaseDeadlines(transition_s=600, pause_s=300, flush_s=300, release_s=300, resume_s=300, continue_s=300)
"""Generous: a benchmark measures time, it must not fail a phase on a slow machine."""
FLOOR = "raw aiohttp floor"
CLIENT_GATHER = "AsyncSGLangClient gather (no orchestrator)"
TARGET_VS_FLOOR = 1.15
AORCH = "AsyncOrchestrator"
SHARED = "AsyncOrchestrator, one shared session"
FDS_PER_ENGINE = 8
"""File descriptors a process may hold per engine: the engines' one connection per variant (six), a listening socket, a margin."""
RAW_PHASES: tuple[tuple[str, dict[str, Any] | None, dict[str, str] | None], ...] = (
    ("/pause_generation", {"mode": "abort"}, None),
    ("/flush_cache", None, {"timeout": "0.000"}),
    ("/release_memory_occupation", {"tags": list(ALL_TAGS)}, None),
    ("/resume_memory_occupation", {"tags": list(ALL_TAGS)}, None),
    ("/continue_generation", {"torch_empty_cache": True}, None),
)
"""What the orchestrator's round sends each engine, phase by phase (path, JSON body, query)."""


@dataclass
class Variant:
    """One way of running a round: ``run()`` is one timed offload + onload, sync or async."""

    name: str
    run: Callable[[], Any]
    is_async: bool
    close: Callable[[], Any]
    rounds: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)
    """The driver process's CPU seconds (all threads) per round."""


@dataclass(frozen=True, slots=True)
class Cell:
    """One measured (N, variant)."""

    n: int
    name: str
    rounds: tuple[float, ...]
    floor_ratio: float
    """Median over repeats of this round over the raw-aiohttp round of the same repeat."""
    cpu_per_call_s: float
    """Median over repeats of the driver's CPU seconds per round, over the round's engine calls (N x 5)."""

    @property
    def median_s(self) -> float:
        return statistics.median(self.rounds)


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


async def raw_floor(urls: list[str]) -> Variant:
    """A bare ``asyncio.gather`` per phase on one session: the transport's own floor."""
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))

    async def post(url: str, path: str, body: dict[str, Any] | None, params: dict[str, str] | None) -> None:
        async with session.post(url + path, json=body, params=params) as r:
            await r.read()
            if r.status != 200:
                raise RuntimeError(f"{url}{path}: status {r.status}")

    async def health(url: str) -> None:
        async with session.get(url + "/health") as r:
            await r.read()

    await asyncio.gather(*(health(u) for u in urls))  # one warm connection per engine

    async def round_() -> None:
        for path, body, params in RAW_PHASES:
            await asyncio.gather(*(post(u, path, body, params) for u in urls))

    return Variant(FLOOR, round_, True, session.close)


def thread_variant(urls: list[str]) -> Variant:
    """The sync Orchestrator on ThreadFanOut with requests-based SGLangClients."""
    clients = [SGLangClient(u) for u in urls]
    fanout = ThreadFanOut()
    orch = Orchestrator(EngineGroup(clients), fanout=fanout, deadlines=DEADLINES)
    _warm_sync(fanout, clients)

    def round_() -> None:
        orch.offload()
        orch.onload()

    def close() -> None:
        fanout.close()
        for c in clients:
            c.close()

    return Variant("ThreadFanOut", round_, False, close)


def _warm_sync(fanout: Any, engines: list[Any]) -> None:
    from resilience.deadline import Deadline

    for result in fanout.call([(e, {}) for e in engines], "health", Deadline(120)):
        if result.error is not None:
            raise RuntimeError(f"warm-up failed on {result.engine}: {result.error!r}")


def _async_api() -> tuple[Any, Any, Any]:
    """(AsyncFanOut, AsyncOrchestrator, AsyncSGLangClient); ImportError (named under the table) without them."""
    from resilience.adapters.sglang import AsyncSGLangClient
    from resilience.barrier import AsyncOrchestrator
    from resilience.barrier.async_fanout import AsyncFanOut

    return AsyncFanOut, AsyncOrchestrator, AsyncSGLangClient


async def _aclose_all(clients: list[Any]) -> None:
    for c in clients:
        close = getattr(c, "aclose", None) or c.close
        result = close()
        if asyncio.iscoroutine(result):
            await result


def async_fanout_variant(urls: list[str], loop: asyncio.AbstractEventLoop) -> Variant:
    """The sync Orchestrator on AsyncFanOut (its own loop thread) with AsyncSGLangClients."""
    async_fanout, _, client_cls = _async_api()
    fanout = async_fanout()
    clients = [client_cls(u) for u in urls]
    orch = Orchestrator(EngineGroup(clients), fanout=fanout, deadlines=DEADLINES)
    _warm_sync(fanout, clients)

    def round_() -> None:
        orch.offload()
        orch.onload()

    def close() -> None:
        # The clients' sessions live on the fan-out's loop: close them there, then the fan-out.
        runner = getattr(fanout, "run", None)
        if runner is not None:
            runner(_aclose_all(clients))
        fanout.close()

    return Variant("AsyncFanOut (sync Orchestrator)", round_, False, close)


async def client_gather_variant(urls: list[str]) -> Variant:
    """The five phases as a bare ``asyncio.gather`` of ``AsyncSGLangClient`` calls: the client's cost without the orchestrator."""
    from resilience.adapters.sglang import AsyncSGLangClient
    from resilience.barrier.async_fanout import DEFAULT_GC_PAUSE_S, pause_collector

    clients = [AsyncSGLangClient(u) for u in urls]
    await asyncio.gather(*(c.health() for c in clients))

    async def phase(calls: Iterable[Awaitable[Any]]) -> None:
        pause = pause_collector(DEFAULT_GC_PAUSE_S)  # as each orchestrator phase (PhaseRun) pauses it
        try:
            await asyncio.gather(*calls)
        finally:
            pause.end()

    async def round_() -> None:
        await phase(c.pause_generation("abort") for c in clients)
        await phase(c.flush_cache() for c in clients)
        await phase(c.release_memory_occupation(None) for c in clients)
        await phase(c.resume_memory_occupation(None) for c in clients)
        await phase(c.continue_generation() for c in clients)

    async def close() -> None:
        await _aclose_all(clients)

    return Variant(CLIENT_GATHER, round_, True, close)


async def async_orchestrator_variant(urls: list[str]) -> Variant:
    """``AsyncOrchestrator`` with AsyncSGLangClients, on the driver's loop."""
    _, async_orch, client_cls = _async_api()
    clients = [client_cls(u) for u in urls]
    orch = async_orch(EngineGroup(clients), deadlines=DEADLINES)
    await asyncio.gather(*(c.health() for c in clients))

    async def round_() -> None:
        await orch.offload()
        await orch.onload()

    async def close() -> None:
        await _aclose_all(clients)

    return Variant(AORCH, round_, True, close)


async def shared_session_variant(urls: list[str]) -> Variant:
    """``AsyncOrchestrator`` whose clients share one aiohttp session (one connector, one middleware, one retry core)."""
    from resilience.adapters.aiohttp import ResilientMiddleware
    from resilience.adapters.sglang import SGLANG_POLICIES, AsyncSGLangClient
    from resilience.barrier import AsyncOrchestrator

    session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, limit_per_host=100),  # no overall cap: one connection per engine or more
        middlewares=(ResilientMiddleware(SGLANG_POLICIES),),
        timeout=aiohttp.ClientTimeout(total=None),  # as the clients' own sessions: each attempt bounded by its policy
    )
    clients = [AsyncSGLangClient(u, session=session) for u in urls]
    orch = AsyncOrchestrator(EngineGroup(clients), deadlines=DEADLINES)
    await asyncio.gather(*(c.health() for c in clients))

    async def round_() -> None:
        await orch.offload()
        await orch.onload()

    return Variant(SHARED, round_, True, session.close)


ROUND_TIMEOUT_S = 600.0
"""The longest the benchmark waits for one variant's process to build, warm up or run a round."""
BUILDERS: dict[str, Callable[[list[str], asyncio.AbstractEventLoop], Variant]] = {
    FLOOR: lambda urls, loop: loop.run_until_complete(raw_floor(urls)),
    "ThreadFanOut": lambda urls, loop: thread_variant(urls),
    CLIENT_GATHER: lambda urls, loop: loop.run_until_complete(client_gather_variant(urls)),
    "AsyncFanOut (sync Orchestrator)": async_fanout_variant,
    AORCH: lambda urls, loop: loop.run_until_complete(async_orchestrator_variant(urls)),
    SHARED: lambda urls, loop: loop.run_until_complete(shared_session_variant(urls)),
}
"""Each variant's builder, by the name its row has: run in the variant's own driver process."""
KEYS = {"floor": FLOOR, "threads": "ThreadFanOut", "gather": CLIENT_GATHER, "fanout": "AsyncFanOut (sync Orchestrator)", "aorch": AORCH,
        "shared": SHARED}  # fmt: skip
"""``--variants``' short names (those of ``profile_async.py``, and ``shared``)."""


def _driver(name: str, n: int, urls: list[str], gc_mode: str, profile: bool, conn: Connection) -> None:
    """One variant's driver process: build it, run one untimed round, then one timed round per ``"round"`` message.

    Answers ``("ready", None)``, ``("skip", why)`` or ``("failed", why)`` once
    built and warmed up, then ``("round", (wall, cpu))`` per round; any other
    message (or the parent's end closing) closes the variant and ends it.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent's Ctrl-C stops us through its pipe
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    profiler = cProfile.Profile() if profile else None
    variant: Variant | None = None
    try:
        try:
            variant = BUILDERS[name](urls, loop)
        except ImportError as exc:
            conn.send(("skip", f"{name} ({exc})"))
            return
        except Exception as exc:  # a broken variant is reported, the others still measured
            conn.send(("skip", f"{name} at N={n} (failed to start: {exc!r})"))
            return
        if gc_mode == "freeze":
            gc.collect()
            gc.freeze()
        elif gc_mode == "off":
            gc.disable()
        try:
            _run(loop, variant, None)  # one untimed round: lazy imports, first connections
        except Exception as exc:
            conn.send(("failed", f"{name} at N={n} (failed: {exc!r})"))
            return
        conn.send(("ready", None))
        while conn.poll(ROUND_TIMEOUT_S) and conn.recv() == "round":
            conn.send(("round", _run(loop, variant, profiler)))
    except (EOFError, OSError):
        pass  # the parent went away: close and end
    finally:
        gc.unfreeze()
        gc.enable()
        if variant is not None:
            _close(loop, variant)
        loop.run_until_complete(asyncio.sleep(0.05))
        loop.close()
        conn.close()
    if profiler is not None:
        buf = io.StringIO()
        pstats.Stats(profiler, stream=buf).sort_stats("tottime").print_stats(30)
        print(f"--- cProfile of {name} rounds at N={n} (sorted by own time) ---\n{buf.getvalue()}", file=sys.stderr)


class _Process:
    """A variant's driver process and our end of its pipe."""

    def __init__(self, ctx: Any, name: str, n: int, urls: list[str], gc_mode: str, profile: bool) -> None:
        self.name = name
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_driver, args=(name, n, urls, gc_mode, profile, child), name=f"bench-driver-{name}", daemon=True)
        self.proc.start()
        child.close()

    def ask(self, message: str | None) -> tuple[str, Any]:
        """Send ``message`` (None: send nothing) and wait (bounded) for the answer."""
        if message is not None:
            self.conn.send(message)
        if not self.conn.poll(ROUND_TIMEOUT_S):
            raise RuntimeError(f"{self.name}: no answer within {ROUND_TIMEOUT_S} s")
        try:
            answer: tuple[str, Any] = self.conn.recv()
        except EOFError:
            raise RuntimeError(f"{self.name}: its driver process exited (code {self.proc.exitcode})") from None
        return answer

    def stop(self) -> None:
        """Ask the process to close its variant, then wait, terminate and kill it by PID. Idempotent."""
        try:
            self.conn.send("stop")
        except (OSError, ValueError):
            pass
        self.conn.close()
        for end in (None, self.proc.terminate, self.proc.kill):
            if end is not None and self.proc.is_alive():
                end()
            self.proc.join(30.0 if end is None else 5.0)


def measure_size(
    n: int, latency_s: float, repeats: int, skipped: list[str], profile: bool, gc_mode: str = "on", names: tuple[str, ...] = tuple(BUILDERS)
) -> list[Cell]:
    """Start N engines, one driver process per variant, time ``repeats`` interleaved rounds each, stop everything.

    Each variant runs in a process of its own (spawned, so it holds only its own
    objects and the imports), so the garbage collector's work in one variant's
    round does not grow with the other variants' clients and sessions: in one
    shared process, each full collection walked all six variants' objects, and
    the floor, which does not pause the collector, paid for everyone's. Only one
    variant runs at a time; the order is shuffled every repeat.

    ``gc_mode``: ``on`` (Python's default), ``freeze`` (``gc.freeze()`` once the
    variant is built: its clients, sessions and the imports leave the
    collector's generations) or ``off`` (``gc.disable()`` for the rounds).
    ``profile``: cProfile the AsyncOrchestrator rounds (printed to stderr by its process). ``names``: the variants
    measured (default all; the floor always is, every ratio is to it).
    """
    ctx = multiprocessing.get_context("spawn")
    procs: list[_Process] = []
    variants: list[Variant] = []
    with FakeEngines(n, latency_s) as engines:
        urls = list(engines.urls)
        try:
            chosen = [name for name in BUILDERS if name == FLOOR or name in names]
            procs = [_Process(ctx, name, n, urls, gc_mode, profile and name == AORCH) for name in chosen]
            live: list[_Process] = []
            for proc in procs:
                kind, detail = proc.ask(None)
                if kind == "ready":
                    live.append(proc)
                    variants.append(Variant(proc.name, lambda: None, False, lambda: None))
                elif proc.name in (FLOOR, "ThreadFanOut"):
                    raise RuntimeError(f"{proc.name} could not run: {detail}")
                else:
                    _note(skipped, detail)
            by_name = {v.name: v for v in variants}
            rng = random.Random(n)
            order = list(live)
            for i in range(repeats):
                rng.shuffle(order)
                for proc in order:
                    kind, (wall, cpu) = proc.ask("round")
                    by_name[proc.name].rounds.append(wall)
                    by_name[proc.name].cpu.append(cpu)
                progress(f"N={n} repeat {i + 1}/{repeats}: " + ", ".join(f"{v.name} {v.rounds[-1]:.3f} s" for v in variants))
        finally:
            for proc in procs:
                proc.stop()
    floor = next(v for v in variants if v.name == FLOOR)
    return [
        Cell(
            n,
            v.name,
            tuple(v.rounds),
            statistics.median(r / f for r, f in zip(v.rounds, floor.rounds, strict=True)),
            statistics.median(v.cpu) / (n * PHASES),
        )
        for v in variants
    ]


def _note(skipped: list[str], line: str) -> None:
    if line not in skipped:
        skipped.append(line)


def _close(loop: asyncio.AbstractEventLoop, v: Variant) -> None:
    try:
        result = v.close()
        if asyncio.iscoroutine(result):
            loop.run_until_complete(result)
    except Exception as exc:  # closing must not hide the measurement (or the error that ended it)
        progress(f"closing {v.name} failed: {exc!r}")


def _run(loop: asyncio.AbstractEventLoop, v: Variant, profiler: cProfile.Profile | None) -> tuple[float, float]:
    """One round of ``v``: (wall, driver CPU) seconds."""
    c0, t0 = time.process_time(), time.perf_counter()
    if profiler is not None:
        profiler.enable()
    try:
        if v.is_async:
            coro: Awaitable[Any] = v.run()
            loop.run_until_complete(coro)
        else:
            v.run()
    finally:
        if profiler is not None:
            profiler.disable()
    return time.perf_counter() - t0, time.process_time() - c0


def raise_fd_limit(needed: int) -> str:
    """Raise this process's soft ``RLIMIT_NOFILE`` to ``needed`` (at most the hard limit) when it is lower; what was done.

    The engines' child process inherits the raised limit. Empty when the soft limit was already enough.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return ""
    target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    short = "" if target >= needed else f", short of the {needed} needed: the largest N may fail to connect"
    return f"soft file-descriptor limit raised from {soft} to {target} (hard {hard}){short}"


def table(cells: list[Cell], latency_s: float, repeats: int, skipped: list[str], gc_mode: str = "on", fds: str = "") -> str:
    ideal = PHASES * latency_s
    out = [
        "## Barrier on one event loop: AsyncFanOut vs ThreadFanOut vs raw aiohttp (`benchmarks/bench_barrier_async.py`)",
        "",
        f"<!-- python {platform.python_version()}, {platform.machine()}, {os.cpu_count()} CPUs, load average at the end "
        f"{os.getloadavg()[0]:.1f}; latency {latency_s * 1e3:.0f} ms per control call; {repeats} interleaved rounds per cell, "
        f"one driver process per variant; garbage collector {gc_mode}; file descriptors: "
        f"{fds or f'soft limit {resource.getrlimit(resource.RLIMIT_NOFILE)[0]}, enough'} -->",
        "",
        f"| N | variant | median round (s) | min-max (s) | ratio to {PHASES} x L ({ideal:.3f} s) | ratio to raw aiohttp | "
        "speed-up over ThreadFanOut | driver CPU per engine call (us) |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for c in cells:
        threads = next((t for t in cells if t.n == c.n and t.name == "ThreadFanOut"), None)
        speedup = f"{threads.median_s / c.median_s:.2f}x" if threads else "-"
        out.append(
            f"| {c.n} | {c.name} | {c.median_s:.3f} | {min(c.rounds):.3f}-{max(c.rounds):.3f} | {c.median_s / ideal:.2f}x "
            f"| {c.floor_ratio:.2f}x | {speedup} | {c.cpu_per_call_s * 1e6:.0f} |"
        )
    out.append("")
    out.append(
        "Ratio to raw aiohttp: the median over rounds of each round over the raw-aiohttp round of the same repeat (paired). "
        "The floor sends the same POSTs (paths, bodies, query) but nothing else: no orchestrator, no retry core, no "
        "per-engine state. The AsyncOrchestrator row is what a user gets by default: `AsyncOrchestrator(EngineGroup("
        "[AsyncSGLangClient(u) for u in urls]))`, each client on its own session, nothing else set. The gather row "
        "pauses the garbage collector for each phase, as the orchestrators do, so that it differs from them only by the orchestrator. "
        "Driver CPU per engine call: the variant's driver process's CPU time in a round (all its threads; "
        f"`time.process_time`) over the N x {PHASES} calls the round makes; on 2 cores, N x {PHASES} x that is time the "
        "round cannot overlap with anything else the driver does."
    )
    out.append("")
    verdicts = []
    for name in ("AsyncFanOut (sync Orchestrator)", AORCH):
        mine = [c for c in cells if c.name == name]
        if not mine:
            continue
        floor_cells = ", ".join(
            f"N={c.n}: {c.floor_ratio:.2f}x ({'met' if c.floor_ratio <= TARGET_VS_FLOOR else 'MISSED'})" for c in mine
        )
        verdicts.append(f"{name} within {TARGET_VS_FLOOR}x of raw aiohttp: {floor_cells}")
    for line in verdicts:
        out.append(f"Target: {line}.")
    for line in skipped:
        out.append(f"Not measured: {line}.")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    """Parse the flags, measure every N, print the table."""
    doc = __doc__ or ""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--latency", type=float, default=0.05, help="seconds each fake engine sleeps before a control answer (default 0.05)")
    ap.add_argument("--sizes", default="8,64,256,1024", help="engine counts, comma-separated (default 8,64,256,1024)")
    ap.add_argument("--repeats", type=int, default=7, help="timed rounds per variant and N, interleaved; medians shown (default 7)")
    ap.add_argument("--profile", action="store_true", help="cProfile the AsyncOrchestrator rounds at the largest N, to stderr")
    ap.add_argument(
        "--gc",
        choices=("on", "freeze", "off"),
        default="on",
        help="the garbage collector during the rounds: on (default, as users run), freeze (gc.freeze() after setup), off",
    )
    ap.add_argument(
        "--variants",
        default=",".join(KEYS),
        help=f"the variants measured, comma-separated, of {', '.join(KEYS)} (default all; the floor always runs)",
    )
    ap.add_argument("--quick", action="store_true", help="small run for development: sizes 4,16, 2 repeats")
    args = ap.parse_args(argv)
    keys = [k.strip() for k in args.variants.split(",") if k.strip()]
    if unknown := [k for k in keys if k not in KEYS]:
        ap.error(f"--variants: unknown {', '.join(unknown)} (known: {', '.join(KEYS)})")
    names = tuple(KEYS[k] for k in keys)
    if args.quick:
        args.sizes, args.repeats = "4,16", 2
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    if args.latency < 0 or args.repeats < 1 or not sizes or min(sizes) < 1:
        ap.error("--latency must be >= 0, --repeats >= 1, --sizes positive integers")
    cells: list[Cell] = []
    skipped: list[str] = []
    fds = raise_fd_limit(max(sizes) * FDS_PER_ENGINE)
    if fds:
        progress(fds)
    for n in sizes:
        progress(f"N={n}: starting {n} fake engines, latency {args.latency * 1e3:.0f} ms")
        cells += measure_size(n, args.latency, args.repeats, skipped, args.profile and n == max(sizes), args.gc, names)
    print(table(cells, args.latency, args.repeats, skipped, args.gc, fds))


if __name__ == "__main__":
    main()
