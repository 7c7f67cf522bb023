"""Where a barrier round's CPU goes: one variant of ``bench_barrier_async`` alone, optionally under py-spy.

Run: ``python benchmarks/profile_async.py VARIANT [--n 256] [--rounds 8] [--gc on|freeze|off] [--gc-stats] [--pyspy]``

VARIANT is one of ``floor`` (raw aiohttp), ``threads`` (ThreadFanOut),
``gather`` (AsyncSGLangClient calls gathered, no orchestrator), ``fanout``
(sync Orchestrator on AsyncFanOut), ``aorch`` (AsyncOrchestrator). It starts
``--n`` fake engines (50 ms per control call), runs one untimed round and
``--rounds`` timed ones, and prints the median wall and driver CPU per round
and the CPU per engine call. With ``--pyspy`` it runs itself under ``py-spy
record`` (all threads, 400 Hz; ``pip install py-spy``) and splits the samples
taken in the rounds by where they fell: the asyncio loop, aiohttp's own code,
our retry core, the aiohttp middleware, the SGLang client, the orchestrator,
json, threads, other; each share is also shown as microseconds of the
measured CPU per engine call. With ``--gc-stats`` it also prints the garbage
collector's collections per round, by generation, and the time they took
(``gc.callbacks``). py-spy's default mode stops the process to sample it, and
the stop lands where it makes a system call: lines that call
``asyncio.get_running_loop()`` (a ``getpid()`` on Python 3.11) read several
times their cost; compare such lines with ``timeit`` before believing them.
Not run by ``run_all.py``: a tool for reading the ``bench_barrier_async`` table.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import gc
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_barrier_async as bench
from _engines import FakeEngines

VARIANTS = ("floor", "threads", "gather", "fanout", "aorch")
_RESULT = "profile_async result:"


def category(frame: str) -> str:
    """The part of the stack a py-spy frame (``func (path:line)``) belongs to."""
    match = re.search(r"\(([^:()]*)(?::\d+)?\)$", frame)
    path = match.group(1) if match else ""
    if "/site-packages/" in path:
        path = path.split("/site-packages/", 1)[1]
    root = str(Path(__file__).resolve().parents[1]) + "/"
    path = path.removeprefix(root)
    if path.startswith(("aiohttp/", "yarl/", "multidict/", "aiohappyeyeballs/", "propcache/", "frozenlist/", "aiosignal/")):
        return "aiohttp, yarl, multidict"
    if path.startswith(("requests/", "urllib3/", "http/", "email/")):
        return "requests, urllib3, http.client"
    if "asyncio/" in path or path.endswith(("selectors.py", "socket.py")):
        return "asyncio loop, selectors, sockets"
    if "json/" in path:
        return "json"
    if "threading.py" in path or "concurrent/" in path or "queue.py" in path:
        return "threads, futures"
    if path == "adapters/aiohttp.py" or path.endswith("resilience/adapters/aiohttp.py"):
        return "ours: aiohttp middleware"
    if re.search(r"adapters/(sglang|requests)", path):
        return "ours: SGLang client, requests adapter"
    if "barrier/" in path:
        return "ours: orchestrator, fan-out"
    if path.startswith(("resilience/", "adapters/", "telemetry/")):
        return "ours: retry core (retry, call, breaker, budget, deadline, policy, events)"
    return "other (dataclass __init__s, imports, ...)"


def split(raw: Path) -> collections.Counter[str]:
    """Samples taken inside a timed round, by the category of the frame on top."""
    counts: collections.Counter[str] = collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        frames = stack.split(";")
        in_round = any(f.startswith("_run (") and "bench_barrier_async" in f for f in frames) or any(
            f.startswith("AsyncFanOut._serve") or "ThreadPoolExecutor" in f or f.startswith("_worker (") for f in frames
        )
        if stack and in_round:
            counts[category(frames[-1])] += int(n)
    return counts


class GcStats:
    """Collections and the seconds they took, by generation, while ``on`` (a ``gc.callbacks`` entry)."""

    def __init__(self) -> None:
        self.count = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self.on = False
        self._t0 = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if not self.on:
            return
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            generation = info["generation"]
            self.count[generation] += 1
            self.seconds[generation] += time.perf_counter() - self._t0

    def line(self, rounds: int) -> str:
        return "collections per round: " + ", ".join(
            f"gen{g} {self.count[g] / rounds:.1f} ({self.seconds[g] / rounds * 1e3:.1f} ms)" for g in range(3)
        )


def measure(variant: str, n: int, rounds: int, gc_mode: str, stats: GcStats | None = None) -> tuple[float, float]:
    """(median wall, median driver CPU) seconds per round; ``stats`` (if given) counts the rounds' collections."""
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    with FakeEngines(n, 0.05) as engines:
        urls = list(engines.urls)
        builders = {
            "floor": lambda: loop.run_until_complete(bench.raw_floor(urls)),
            "threads": lambda: bench.thread_variant(urls),
            "gather": lambda: loop.run_until_complete(bench.client_gather_variant(urls)),
            "fanout": lambda: bench.async_fanout_variant(urls, loop),
            "aorch": lambda: loop.run_until_complete(bench.async_orchestrator_variant(urls)),
        }
        v = builders[variant]()
        try:
            if gc_mode == "freeze":
                gc.collect()
                gc.freeze()
            elif gc_mode == "off":
                gc.disable()
            bench._run(loop, v, None)
            if stats is not None:
                gc.callbacks.append(stats)
                stats.on = True
            results = [bench._run(loop, v, None) for _ in range(rounds)]
        finally:
            if stats is not None:
                stats.on = False
                gc.callbacks.remove(stats)
            gc.enable()
            bench._close(loop, v)
    loop.close()
    return statistics.median(w for w, _ in results), statistics.median(c for _, c in results)


def main(argv: list[str] | None = None) -> None:
    """Measure one variant; with ``--pyspy``, profile it and print the split."""
    doc = __doc__ or ""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("variant", choices=VARIANTS)
    ap.add_argument("--n", type=int, default=256, help="fake engines (default 256)")
    ap.add_argument("--rounds", type=int, default=8, help="timed rounds (default 8)")
    ap.add_argument("--gc", choices=("on", "freeze", "off"), default="on", help="the garbage collector in the rounds (default on)")
    ap.add_argument("--gc-stats", action="store_true", help="print the collector's collections per round and their time")
    ap.add_argument("--pyspy", action="store_true", help="run under py-spy and split the samples by category")
    args = ap.parse_args(argv)
    if args.n < 1 or args.rounds < 1:
        ap.error("--n and --rounds must be >= 1")
    calls = args.n * bench.PHASES
    if not args.pyspy:
        stats = GcStats() if args.gc_stats else None
        wall, cpu = measure(args.variant, args.n, args.rounds, args.gc, stats)
        print(f"{_RESULT} {wall} {cpu}")
        print(f"{args.variant} N={args.n} gc {args.gc}: wall {wall:.3f} s, driver CPU {cpu:.3f} s per round, "
              f"{cpu / calls * 1e6:.0f} us CPU per engine call")  # fmt: skip
        if stats is not None:
            print(stats.line(args.rounds))
        return
    pyspy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "samples.txt"
        cmd = [pyspy, "record", "--format", "raw", "-r", "400", "-o", str(raw), "--", sys.executable, __file__, args.variant,
               "--n", str(args.n), "--rounds", str(args.rounds), "--gc", args.gc]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ}, timeout=900)
        line = next((x for x in proc.stdout.splitlines() if x.startswith(_RESULT)), None)
        if proc.returncode != 0 or line is None or not raw.is_file():
            raise SystemExit(f"py-spy run failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
        wall, cpu = (float(x) for x in line.removeprefix(_RESULT).split())
        counts = split(raw)
    total = sum(counts.values())
    per_call_us = cpu / calls * 1e6
    print(f"{args.variant} N={args.n} gc {args.gc} (under py-spy): wall {wall:.3f} s, driver CPU {cpu:.3f} s per round, "
          f"{per_call_us:.0f} us CPU per engine call; {total} samples in the rounds")  # fmt: skip
    print()
    print("| where | share of samples | us per engine call |")
    print("|---|---:|---:|")
    for name, n in counts.most_common():
        print(f"| {name} | {n / total * 100:.1f} % | {n / total * per_call_us:.1f} |")


if __name__ == "__main__":
    main()
