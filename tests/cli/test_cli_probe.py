"""``cpr probe`` against emulated engines on 127.0.0.1: one healthy, one killed, one paused (its /health hangs)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

pytest.importorskip("rich")
pytest.importorskip("torch")

from resilience.testing.emulator import EmulatedFleet, EngineConfig
from tests.cli.cpr_testlib import run_cpr, table_rows

HEALTHY, KILLED, PAUSED = range(3)
TIMEOUT = 1
"""The probe's --timeout: far below the 20 s a paused engine's /health hangs."""


@pytest.fixture(scope="module")
def fleet() -> Iterator[EmulatedFleet]:
    """Three engines: engine 1 killed, engine 2 paused (SGLang's default 20 s /health hang); stopped by PID after."""
    with EmulatedFleet(3, EngineConfig(health_poll_seconds=0.05)) as fleet:
        fleet.engines[KILLED].kill()
        response = requests.post(fleet.urls[PAUSED] + "/pause_generation", json={"mode": "abort"}, timeout=10)
        assert response.status_code == 200
        yield fleet


def _line(stdout: str, url: str) -> str:
    lines = [line for line in stdout.splitlines() if f"  {url}  " in line]
    assert len(lines) == 1, stdout
    return lines[0]


def test_probe_says_per_engine_what_is_wrong_and_fails(fleet: EmulatedFleet, tmp_path: Path) -> None:
    """One line per engine (healthy / unreachable / paused), a table of checks, exit 1, bounded by the timeout."""
    t0 = time.monotonic()
    result = run_cpr("probe", *fleet.urls, "--timeout", str(TIMEOUT), cwd=tmp_path, timeout=60)
    assert time.monotonic() - t0 < 20  # ended well before a paused /health answers
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert _line(result.stdout, fleet.urls[HEALTHY]).startswith("OK")
    assert "weights 'default'" in _line(result.stdout, fleet.urls[HEALTHY])
    killed = _line(result.stdout, fleet.urls[KILLED])
    assert killed.startswith("FAIL") and "unreachable: connection refused" in killed
    paused = _line(result.stdout, fleet.urls[PAUSED])
    assert paused.startswith("FAIL") and f"no answer in {TIMEOUT} s (paused?)" in paused and "not ready (503" in paused
    rows = {row[0]: row for row in table_rows(result.stdout)}
    assert set(rows) == {"GET /health", "GET /ready", "GET /model_info", "GET /v1/loads", "GET /server_info"}
    assert {len(row) for row in rows.values()} == {1 + 3}  # a check and one cell per engine: no policy column
    assert "1 of 3 engines healthy" in result.stdout


def test_probe_shows_each_policy_once(fleet: EmulatedFleet, tmp_path: Path) -> None:
    """The policy SGLANG_POLICIES applies is printed once per distinct policy, not repeated on every row."""
    result = run_cpr("probe", fleet.urls[HEALTHY], fleet.urls[HEALTHY], "--timeout", str(TIMEOUT), cwd=tmp_path, timeout=60)
    assert result.returncode == 0, result.stderr
    lines = [line.strip() for line in result.stdout.splitlines() if line.startswith("  GET /")]
    assert len(lines) == 2, result.stdout  # /health has its own policy; the four reads share one
    health = next(line for line in lines if line.startswith("GET /health:"))
    assert "25 s/attempt" in health  # the policy SGLANG_POLICIES applies to /health
    assert sum(line.count("/ready") + line.count("/server_info") for line in lines) == 2
    described = [line.split(": ", 1)[1] for line in lines]
    assert all(result.stdout.count(d) == 1 for d in described)
    assert "2 of 2 engines healthy" in result.stdout


def test_probe_exits_0_when_every_engine_is_healthy(fleet: EmulatedFleet, tmp_path: Path) -> None:
    """Exit 0 only when all probed engines are healthy."""
    result = run_cpr("probe", fleet.urls[HEALTHY], "--timeout", str(TIMEOUT), cwd=tmp_path, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 of 1 engine healthy" in result.stdout


def test_probe_only_reads(fleet: EmulatedFleet, tmp_path: Path) -> None:
    """The probe sends only GETs: it never pauses, flushes or releases."""
    run_cpr("probe", fleet.urls[HEALTHY], "--timeout", str(TIMEOUT), cwd=tmp_path, timeout=60)
    calls = fleet.engines[HEALTHY].record()["calls"]
    assert calls and {c["method"] for c in calls} == {"GET"}


def test_probe_heading_is_one_whole_line(refusing_port: int, tmp_path: Path) -> None:
    """The heading does not wrap mid-phrase at a one-engine table's width: it is a line of its own."""
    result = run_cpr("probe", f"http://127.0.0.1:{refusing_port}", "--timeout", "1", cwd=tmp_path, timeout=60)
    assert result.returncode == 1, result.stderr
    assert "cpr probe: 1 engine, one attempt per check, 1 s timeout" in result.stdout.splitlines()


def test_probe_shows_no_credentials_or_query_tokens(refusing_port: int, tmp_path: Path) -> None:
    """A URL with user:password@ and ?token=: its lines, table and summary name host:port only."""
    url = f"http://ops:hunter2@127.0.0.1:{refusing_port}/?token=tok-123"
    result = run_cpr("probe", url, "--timeout", "1", cwd=tmp_path, timeout=60)
    assert result.returncode == 1, result.stderr
    for text in (result.stdout, result.stderr):
        assert "hunter2" not in text and "tok-123" not in text and "ops:" not in text
    assert f"127.0.0.1:{refusing_port}" in result.stdout
