"""``cpr demo --router smg`` end to end: a real smg in front of an emulated engine, the three ways in one table and report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.cli.cpr_testlib import run_cpr, table_rows
from tests.smg.conftest import require_smg

pytest.importorskip("torch")


def test_demo_router_smg_prints_the_three_ways_and_ours_finishes_every_step(tmp_path: Path) -> None:
    require_smg()
    proc = run_cpr("demo", "--router", "smg", "--engines", "1", "--steps", "1", "--report", "r.json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r[0]: r[1:] for r in table_rows(proc.stdout)}
    assert rows["steps finished"][1:] == ["1/1", "1/1"]
    assert rows["engine deaths"][1:] == ["0", "0"]
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["router"] == "smg"
    assert set(report["ways"]) == {"smg", "ours", "ours-smg"}
    assert report["table"]["rows"] == [[label, *cells] for label, cells in rows.items()]
