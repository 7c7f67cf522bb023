"""``cpr soak`` on a small fleet: completes, no deaths, a report with memory samples."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("rich")
pytest.importorskip("psutil")
pytest.importorskip("torch")

from tests.cli.cpr_testlib import run_cpr, table_rows


def test_soak_completes_with_zero_deaths_and_a_memory_report(tmp_path: Path) -> None:
    """2 engines, 5 steps ours: exit 0, zero deaths, RSS sampled after every step, JSON == table."""
    result = run_cpr("soak", "--engines", "2", "--steps", "5", "--seed", "3", "--report", "soak.json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    assert "starting 2 emulated engines: 2 of 2 (engine " in result.stderr  # engines started out of N
    data = json.loads((tmp_path / "soak.json").read_text())
    ours = data["ways"]["ours"]
    assert (ours["steps_finished"], ours["engine_deaths"], ours["failed_steps"]) == (5, 0, 0)
    assert [s["step"] for s in data["memory"]["samples"]] == [0, 1, 2, 3, 4, 5]
    assert all(s["self_mb"] > 0 and s["engines_mb"] > 0 for s in data["memory"]["samples"])
    assert isinstance(data["memory"]["engines"]["flat"], bool)
    assert table_rows(result.stdout) == data["table"]["rows"]
