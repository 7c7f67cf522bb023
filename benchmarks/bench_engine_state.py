"""Per-engine state metrics: series and scrape time against fleet size, and the journal's commit time, timed vs not.

Run: ``python benchmarks/bench_engine_state.py [--scrapes 200] [--commits 300]``

For each fleet size an ``Orchestrator`` is built over that many ``SGLangClient``
objects (loopback URLs; nothing is sent: a scrape reads only the
orchestrator's knowledge) and watched by a ``MetricsObserver``
(``EngineStateCollector``, the default bound of 256 engines). The table gives
the ``cpr_engine_state`` series a scrape holds, the exposition's size, and the
mean time of one whole scrape (``generate_latest`` of the observer's
registry), side by side. The journal table commits the same records through a
``FileJournalStore`` (fsync on) bare and wrapped in the ``TimedJournalStore``
the metric comes from, alternating, and gives the mean append of each plus
what the histogram itself measured.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from resilience.adapters.sglang import SGLangClient
from resilience.barrier import EngineGroup, Orchestrator
from resilience.barrier.journal_store import FileJournalStore
from resilience.telemetry.metrics import MetricsObserver

SIZES = (8, 64, 256, 1024)
RECORD = b'{"engine": "http://127.0.0.1:30000", "state": "released", "tags": ["kv_cache", "weights"]}'


def scrape_row(n: int, scrapes: int) -> tuple[int, int, int, float]:
    """(engines, cpr_engine_state series, exposition bytes, mean scrape ms) for a fleet of ``n``."""
    clients = [SGLangClient(f"http://127.0.0.1:{20000 + i}") for i in range(n)]
    try:
        orch = Orchestrator(EngineGroup(clients))
        metrics = MetricsObserver()
        metrics.watch(orch)
        text = generate_latest(metrics.registry)
        series = sum(1 for f in text_string_to_metric_families(text.decode()) for s in f.samples if s.name == "cpr_engine_state")
        assert series > 0
        t0 = time.perf_counter()
        for _ in range(scrapes):
            generate_latest(metrics.registry)
        return n, series, len(text), (time.perf_counter() - t0) / scrapes * 1000
    finally:
        for client in clients:
            client.close()


def commit_rows(commits: int) -> tuple[float, float, float]:
    """(bare mean ms, timed mean ms, the histogram's own mean ms) over ``commits`` appends each, alternating."""
    metrics = MetricsObserver()
    with tempfile.TemporaryDirectory() as tmp:
        bare = FileJournalStore(Path(tmp) / "bare.journal")
        timed = metrics.timed_journal_store(FileJournalStore(Path(tmp) / "timed.journal"))
        bare_s: list[float] = []
        timed_s: list[float] = []
        try:
            for _ in range(commits):
                t0 = time.perf_counter()
                bare.append(RECORD)
                bare_s.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                timed.append(RECORD)
                timed_s.append(time.perf_counter() - t0)
        finally:
            bare.close()
            timed.close()
    text = generate_latest(metrics.registry).decode()
    got = {
        s.name: s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name.startswith("cpr_journal_commit_duration_seconds") and s.labels.get("op") == "append" and "le" not in s.labels
    }
    assert got["cpr_journal_commit_duration_seconds_count"] == commits
    own = got["cpr_journal_commit_duration_seconds_sum"] / commits * 1000
    return statistics.fmean(bare_s) * 1000, statistics.fmean(timed_s) * 1000, own


def main(argv: list[str] | None = None) -> None:
    """Measure and print two markdown tables."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scrapes", type=int, default=200, help="scrapes timed per fleet size (default 200)")
    ap.add_argument("--commits", type=int, default=300, help="journal appends per store (default 300)")
    args = ap.parse_args(argv)
    rows = [scrape_row(n, args.scrapes) for n in SIZES]
    bare, timed, own = commit_rows(args.commits)
    print("## Per-engine state metrics and the journal's commit time (`benchmarks/bench_engine_state.py`)\n")
    print(f"<!-- {args.scrapes} scrapes per fleet size; {args.commits} fsynced appends per store -->\n")
    print("| engines | cpr_engine_state series | exposition bytes | one scrape, ms |")
    print("|---:|---:|---:|---:|")
    for n, series, size, ms in rows:
        print(f"| {n} | {series} | {size} | {ms:.2f} |")
    print("\nEngines past the bound (256) are folded into `engine=\"other\"`, one series per (kind, state) they are in.\n")
    print("| journal append (FileJournalStore, fsync) | mean ms |")
    print("|---|---:|")
    print(f"| bare store | {bare:.3f} |")
    print(f"| through TimedJournalStore | {timed:.3f} |")
    print(f"| what cpr_journal_commit_duration_seconds measured (sum / count) | {own:.3f} |")


if __name__ == "__main__":
    main()
