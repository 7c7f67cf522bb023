"""Emulated fleet start time and memory: engines forked from one zygote against one fresh interpreter per engine.

Run: ``.venv/bin/python benchmarks/bench_fleet.py [--sizes 8,64,256] [--spawn-sizes 8] [--spawn-64]``

Each cell starts ``EmulatedFleet(N, EngineConfig(), start_method=...)`` on 127.0.0.1,
times ``start()`` (until every engine answered READY), sends one ``/model_info`` to
every engine, then reads the memory of every process the fleet runs (the engines,
and the zygote they are forked from) with psutil: PSS summed (each shared page
split between the processes that map it: the sum is what the fleet really costs),
USS summed (pages only that process maps: the least the fleet frees when it goes)
and RSS summed (counts every shared page once per process: what ``ps`` and ``top``
add up to, not what the fleet costs). Each engine then serves one ``/generate`` and
one pause, release, resume, continue cycle, and the PSS is read again (pages an
engine writes stop being shared). Then the fleet is stopped, whatever happened.

Targets (issue 15): 256 engines start in <= 20 s and hold in <= 4 GB (PSS).

The one-process-per-engine way (``start_method="spawn"``) costs about 240 MB per
engine, so it is measured at N=8 by default; ``--spawn-64`` adds N=64 (about
15 GiB and minutes on 2 cores: run it on a quiet machine). Before each cell the
benchmark checks that the machine has memory to spare for it and skips it
(saying so) otherwise. Progress goes to stderr, the markdown table to stdout.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import psutil
import requests

from resilience.testing.emulator import EmulatedFleet, EngineConfig
from resilience.testing.emulator.fleet import StartMethod

_MIB = 1024 * 1024
_START_TIMEOUT_S = 900.0
"""Generous: a benchmark measures the start, it must not fail it on a loaded machine."""
_NEED_MIB = {"zygote": 20, "spawn": 300}
"""MiB of available memory a cell needs per engine (a margin over what each way costs) before it is started."""
_SPARE_MIB = 2048
"""MiB the machine keeps available on top of a cell's need (other processes share it)."""


@dataclass(frozen=True, slots=True)
class Cell:
    """One measured (start method, N) cell."""

    method: str
    n: int
    start_s: float
    pss_mib: float
    uss_mib: float
    rss_mib: float
    used_pss_mib: float
    processes: int


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def fleet_memory(pids: Sequence[int]) -> tuple[float, float, float]:
    """PSS, USS and RSS in MiB, each summed over ``pids``."""
    pss = uss = rss = 0
    for pid in pids:
        info = psutil.Process(pid).memory_full_info()
        pss += info.pss
        uss += info.uss
        rss += info.rss
    return pss / _MIB, uss / _MIB, rss / _MIB


def measure(method: StartMethod, n: int) -> Cell:
    """Start N engines the given way, touch each once, read the memory, stop them all."""
    shown = {0}

    def on_progress(ready: int, total: int) -> None:
        if ready == total or ready * 10 // total > max(shown):
            shown.add(ready * 10 // total)
            progress(f"{method} N={n}: engines ready {ready}/{total}")

    fleet = EmulatedFleet(n, EngineConfig(), start_method=method, startup_timeout=_START_TIMEOUT_S, progress=on_progress)
    try:
        t0 = time.perf_counter()
        fleet.start()
        start_s = time.perf_counter() - t0
        pids = [*fleet.pids, *([fleet.zygote_pid] if fleet.zygote_pid is not None else [])]
        with requests.Session() as session:
            session.trust_env = False
            for url in fleet.urls:
                session.get(url + "/model_info", timeout=60).raise_for_status()
            pss, uss, rss = fleet_memory(pids)
            for url in fleet.urls:
                use_once(session, url)
        used_pss, _, _ = fleet_memory(pids)
    finally:
        fleet.stop()
    cell = Cell(method, n, start_s, pss, uss, rss, used_pss, len(pids))
    progress(f"{method} N={n}: started in {start_s:.1f} s; PSS {pss:.0f} MiB, USS {uss:.0f} MiB, RSS {rss:.0f} MiB; used {used_pss:.0f}")
    return cell


def use_once(session: requests.Session, url: str) -> None:
    """One generate and one offload/onload cycle (pause, release, resume, continue), as a colocate step does."""
    body = {"text": "hello", "sampling_params": {"max_new_tokens": 4}}
    session.post(url + "/generate", json=body, timeout=60).raise_for_status()
    for route, payload in (
        ("/pause_generation", {"mode": "abort"}),
        ("/release_memory_occupation", {}),
        ("/resume_memory_occupation", {}),
        ("/continue_generation", {}),
    ):
        session.post(url + route, json=payload, timeout=60).raise_for_status()


def room_for(method: str, n: int) -> str | None:
    """None when the machine has memory for the cell, else why it is skipped."""
    available = psutil.virtual_memory().available / _MIB
    need = _NEED_MIB[method] * n + _SPARE_MIB
    if available < need:
        return f"{method} at N={n}: {available:.0f} MiB available, the cell needs about {need} MiB"
    return None


def table(cells: Sequence[Cell], skipped: Sequence[str]) -> str:
    out = [
        "## Emulated fleet: start time and memory (`benchmarks/bench_fleet.py`)",
        "",
        f"<!-- python {platform.python_version()}, {platform.machine()}, {os.cpu_count()} CPUs, "
        f"load average at the end {os.getloadavg()[0]:.1f} -->",
        "",
        "| start method | N | start (s) | PSS, all processes (MiB) | PSS per engine (MiB) | USS, all (MiB) | RSS, all (MiB) "
        "| PSS after one use (MiB) | processes |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in cells:
        out.append(
            f"| {c.method} | {c.n} | {c.start_s:.1f} | {c.pss_mib:.0f} | {c.pss_mib / c.n:.1f} | {c.uss_mib:.0f} | "
            f"{c.rss_mib:.0f} | {c.used_pss_mib:.0f} | {c.processes} |"
        )
    out.append("")
    out.append(
        "PSS splits each shared page between the processes mapping it, so its sum is what the fleet costs; RSS counts "
        "the zygote's shared pages (torch, FastAPI, the app) once per engine. `processes` includes the zygote. Memory is "
        "read after one `/model_info` per engine; *after one use* is read again once every engine served one `/generate` "
        "and one pause, release, resume, continue cycle (pages the engines write stop being shared)."
    )
    at_256 = [c for c in cells if c.method == "zygote" and c.n == 256]
    if at_256:
        c = at_256[0]
        verdict = "met" if c.start_s <= 20 and c.pss_mib <= 4096 else "MISSED"
        out.append("")
        result = f"{c.start_s:.1f} s, {c.pss_mib:.0f} MiB ({verdict}); {c.used_pss_mib:.0f} MiB after one use"
        out.append(f"Target: 256 engines start in <= 20 s and hold in <= 4 GB (PSS). Result: {result}.")
    for line in skipped:
        out.append(f"Not measured: {line}.")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    """Parse the flags, measure every cell (zygote first, then spawn), print the table."""
    doc = __doc__ or ""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--sizes", default="8,64,256", help="fleet sizes forked from the zygote, comma-separated (default 8,64,256)")
    ap.add_argument("--spawn-sizes", default="8", help="sizes with one interpreter per engine (default 8; at most 8)")
    ap.add_argument("--spawn-64", action="store_true", help="also one interpreter per engine at N=64 (about 15 GiB)")
    args = ap.parse_args(argv)
    try:
        sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
        spawn_sizes = [int(s) for s in args.spawn_sizes.split(",") if s.strip()]
    except ValueError:
        ap.error("--sizes and --spawn-sizes are comma-separated integers")
    if args.spawn_64 and 64 not in spawn_sizes:
        spawn_sizes.append(64)
    if min([*sizes, *spawn_sizes, 1]) < 1:
        ap.error("sizes must be positive integers")
    too_big = [n for n in spawn_sizes if n > 8 and not (n == 64 and args.spawn_64)]
    if too_big:
        ap.error(f"--spawn-sizes {too_big}: more than 8 spawned engines need --spawn-64 (and only N=64 is offered)")

    cells: list[Cell] = []
    skipped: list[str] = []
    plan: list[tuple[StartMethod, int]] = [("zygote", n) for n in sizes] + [("spawn", n) for n in spawn_sizes]
    for method, n in plan:
        why = room_for(method, n)
        if why is not None:
            progress(f"skipping {why}")
            skipped.append(why)
            continue
        progress(f"{method} N={n}: starting")
        cells.append(measure(method, n))
    print(table(cells, skipped))


if __name__ == "__main__":
    main()
