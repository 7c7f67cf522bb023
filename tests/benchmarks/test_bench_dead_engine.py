"""Smoke test of ``bench_dead_engine.py``: it runs, and its rows say what a dead engine's calls end with (no figure judged)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_dead_engine_prints_the_refusal_and_then_circuit_open() -> None:
    """A plain session call ends with requests' ConnectionError after some attempts; a second SGLang call gets CircuitOpen, none sent."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_dead_engine.py"), "--calls", "session,second"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in proc.stdout.splitlines() if line.startswith("| `")]
    labels = ["`resilient_session().get(url, timeout=2)`", "`SGLangClient(url).pause_generation() again, right after`"]
    assert [r[0] for r in rows] == labels
    session, second = rows
    assert session[1].startswith("ConnectionError:") and int(session[2]) >= 2
    assert second[1].startswith("CircuitOpen: circuit open for http://127.0.0.1:") and second[2] == "0"
    assert proc.stderr.count("WARNING resilience.retry:") == 2  # one per refused call: the session's and the first pause
