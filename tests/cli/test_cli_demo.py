"""``cpr demo`` end to end: real engine processes, fault proxies and /metrics on 127.0.0.1, small sizes."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
import requests

pytest.importorskip("rich")
pytest.importorskip("matplotlib")
pytest.importorskip("prometheus_client")
pytest.importorskip("torch")

from tests.cli.cpr_testlib import CPR, table_rows
from tests.conftest import free_port

STEPS = 4


def _scrape_while_running(proc: subprocess.Popen[str], url: str, timeout: float) -> str | None:
    """Poll ``url`` until it answers 200 or ``proc`` ends; return the body (None if it never answered)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end and proc.poll() is None:
        try:
            response = requests.get(url, timeout=2)
            if response.status_code == 200:
                return response.text
        except requests.RequestException:
            pass
        time.sleep(0.2)
    return None


def test_demo_old_way_fails_ours_does_not_and_the_report_matches_the_table(tmp_path: Path) -> None:
    """4 engines, 4 steps: the old way dies or restarts, ours does neither; /metrics is served; JSON == table."""
    port = free_port()
    args = ["demo", "--engines", "4", "--steps", str(STEPS), "--seed", "1", "--report", "r.json", "--timeline", "t.png"]
    proc = subprocess.Popen(
        [*CPR, *args, "--metrics-port", str(port)],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
    )
    try:
        scraped = _scrape_while_running(proc, f"http://127.0.0.1:{port}/metrics", timeout=60)
        stdout, stderr = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, stderr
    assert "Traceback" not in stderr
    assert f"metrics: http://127.0.0.1:{port}/metrics" in stderr
    assert scraped is not None and "# TYPE cpr_requests_total counter" in scraped

    data = json.loads((tmp_path / "r.json").read_text())
    rows = table_rows(stdout)
    assert rows == data["table"]["rows"]
    table = {row[0]: row[1:] for row in rows}
    old, ours = data["ways"]["old"], data["ways"]["ours"]
    assert table["engine deaths"] == [str(old["engine_deaths"]), str(ours["engine_deaths"])]
    assert table["restarts a controller would have triggered"] == [str(old["restarts"]), str(ours["restarts"])]
    assert table["502s seen"] == [str(old["http_502_seen"]), str(ours["http_502_seen"])]
    assert table["502s absorbed by retries"] == [str(old["http_502_absorbed"]), str(ours["http_502_absorbed"])]
    assert table["steps finished"] == [f"{old['steps_finished']} of {STEPS}", f"{STEPS} of {STEPS}"]
    assert table["restart budget left"][1] == "3 of 3"
    assert table["ambiguous faults (reset/timeout after the engine acted)"] == [
        str(old["ambiguous_faults_seen"]),
        str(ours["ambiguous_faults_seen"]),
    ]
    assert table["engines quarantined (memory state unknown)"] == ["-", str(ours["engines_quarantined"])]
    assert table["engines reconciled from their memory state"] == ["-", str(ours["engines_reconciled"])]
    assert ours["engines_reconciled"] == ours["engines_quarantined"]

    assert old["engine_deaths"] + old["restarts"] > 0
    assert (ours["engine_deaths"], ours["restarts"], ours["failed_steps"], ours["requests_lost"]) == (0, 0, 0, 0)
    assert ours["http_502_seen"] > 0 and ours["http_502_absorbed"] == ours["http_502_seen"]
    assert data["metrics"]["per_way"]["ours"]["cpr_retries_total{reason=status_502}"] == ours["http_502_absorbed"]
    assert data["metrics"]["per_way"]["old"]["cpr_restarts_total"] == old["restarts"]
    assert [s["way"] for s in data["timeline"]["steps"]] == ["old way", "ours"]
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
