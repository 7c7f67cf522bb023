"""Smoke test of ``bench_smg_peer.py``: it runs the three ways behind a real smg and prints their table (no figure judged)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.smg.conftest import require_smg

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]


def test_bench_smg_peer_prints_one_column_per_way_and_ours_finishes_every_step() -> None:
    require_smg()
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_smg_peer.py"), "--engines", "1", "--steps", "2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in proc.stdout.splitlines() if line.startswith("| ")]
    rows = {r[0]: r[1:] for r in cells}
    assert rows[""] == ["smg's client", "ours direct", "ours via SmgFanOut"]
    assert rows["steps finished"][1:] == ["2/2", "2/2"]
    assert rows["engine deaths"][1:] == ["0", "0"]
