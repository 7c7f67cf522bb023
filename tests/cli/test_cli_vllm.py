"""``cpr demo``, ``cpr soak`` and ``cpr probe`` with ``--engine vllm``, end to end and briefly, on emulated vLLM engines on 127.0.0.1."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("rich")
pytest.importorskip("fastapi")

from tests.cli.cpr_testlib import run_cpr, table_rows

STEPS = 3


def test_vllm_demo_ours_finishes_every_step_and_the_report_matches_the_table(tmp_path: Path) -> None:
    """2 engines, 3 steps, seed 1: ours finishes every step without an engine death or a garbage completion; the old
    way (no retry) fails steps on the first 502s; the JSON report holds the table printed."""
    done = run_cpr("demo", "--engine", "vllm", "--engines", "2", "--steps", str(STEPS), "--seed", "1", "--report", "r.json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["engine"] == "vllm" and data["table"]["columns"] == ["", "old way (SkyRL)", "ours"]
    rows = table_rows(done.stdout)
    assert rows == data["table"]["rows"]
    ours, old = data["ways"]["ours"], data["ways"]["old"]
    assert ours["steps_finished"] == STEPS and ours["engine_deaths"] == 0 and ours["garbage_completions"] == 0
    assert ours["http_502_seen"] > 0 and ours["http_502_absorbed"] > 0
    assert old["failed_steps"] > 0 and old["http_502_absorbed"] == 0


def test_vllm_demo_refuses_the_sglang_demos_options(tmp_path: Path) -> None:
    done = run_cpr("demo", "--engine", "vllm", "--timeline", "t.png", cwd=tmp_path, timeout=60)
    assert done.returncode == 2 and "does not take --timeline" in done.stderr


def test_vllm_soak_runs_ours_and_meets_its_end_criteria(tmp_path: Path) -> None:
    """``cpr soak --engine vllm``: ours on emulated vLLM engines under the demo's vLLM faults, no controller kills."""
    done = run_cpr("soak", "--engine", "vllm", "--engines", "2", "--steps", "3", "--report", "s.json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    data = json.loads((tmp_path / "s.json").read_text())
    assert data["engine"] == "vllm" and data["restart_every"] == 0
    ours = data["ways"]["ours"]
    assert ours["steps_finished"] == 3 and ours["engine_deaths"] == 0 and ours["requests_lost"] == 0
    refused = run_cpr("soak", "--engine", "vllm", "--restart-every", "5", cwd=tmp_path, timeout=60)
    assert refused.returncode == 2 and "--restart-every takes only 0" in refused.stderr


def test_vllm_probe_says_paused_asleep_and_dev_mode_off(tmp_path: Path) -> None:
    """An asleep engine, one without dev mode, and a dead URL: /health is 200 for the first two (vLLM's /health does not
    see a pause or a sleep), the control routes' 404 is named as dev mode off, the dead one fails the probe."""
    from resilience.adapters.vllm import VLLMClient
    from resilience.testing.emulator import EmulatedFleet
    from resilience.testing.emulator.vllm import VLLMEngineConfig

    with EmulatedFleet(1, VLLMEngineConfig(dev_mode=True, enable_sleep_mode=True)) as on, EmulatedFleet(1, VLLMEngineConfig()) as off:
        with VLLMClient(on.urls[0]) as client:
            client.sleep(1)
        done = run_cpr("probe", "--engine", "vllm", on.urls[0], off.urls[0], "http://127.0.0.1:9", cwd=tmp_path, timeout=60)
    assert done.returncode == 1, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("OK") and "asleep" in lines[0] and "weights 'default'" in lines[0]
    assert lines[1].startswith("OK") and "dev mode off" in lines[1]
    assert lines[2].startswith("FAIL") and "connection refused" in lines[2]
    assert "1 of 3 engines not healthy" in done.stderr
