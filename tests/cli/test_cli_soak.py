"""``cpr soak`` on a small fleet: completes, no deaths, a report with memory samples."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

pytest.importorskip("rich")
pytest.importorskip("psutil")
pytest.importorskip("torch")

from benchmarks.soak_notes import section
from resilience.cli.soak import memory_verdict, pss_bytes, seed_caption, soak_verdict
from resilience.testing.lab import ColocateReport
from tests.cli.cpr_testlib import run_cpr, table_rows


def test_soak_completes_with_zero_deaths_and_a_memory_report(tmp_path: Path) -> None:
    """2 engines, 5 steps ours (no kill before step 50): exit 0, zero deaths and losses, RSS sampled after every step, JSON == table."""
    result = run_cpr("soak", "--engines", "2", "--steps", "5", "--seed", "3", "--report", "soak.json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    assert "starting 2 emulated engines: 2 of 2 (engine " in result.stderr  # engines started out of N
    data = json.loads((tmp_path / "soak.json").read_text())
    ours = data["ways"]["ours"]
    assert (ours["steps_finished"], ours["engine_deaths"], ours["failed_steps"], ours["requests_lost"]) == (5, 0, 0, 0), ours["failures"]
    assert ours["controller_kills"] == 0 and data["restart_every"] == 50
    assert [s["step"] for s in data["memory"]["samples"]] == [0, 1, 2, 3, 4, 5]
    assert all(s["self_mb"] > 0 and 0 < s["engines_anon_mb"] <= s["engines_mb"] for s in data["memory"]["samples"])
    assert isinstance(data["memory"]["engines"]["flat"], bool)
    assert data["verdict"]["engines_flat"] is data["memory"]["engines_anon"]["flat"]  # judged on the anonymous PSS
    assert table_rows(result.stdout) == data["table"]["rows"]


def test_soak_kills_the_controller_mid_phase_and_resumes_from_the_journal_with_no_death(tmp_path: Path) -> None:
    """--restart-every 2 on 4 steps: two controllers killed inside a phase, each successor on the journal; no death,
    no failed step, no request lost, and the table says so."""
    result = run_cpr(
        "soak", "--engines", "2", "--steps", "4", "--seed", "3", "--restart-every", "2", "--report", "soak.json", cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    data = json.loads((tmp_path / "soak.json").read_text())
    ours = data["ways"]["ours"]
    assert (ours["controller_restarts"], ours["controller_kills"]) == (2, 2), ours["failures"]
    assert (ours["engine_deaths"], ours["failed_steps"], ours["requests_lost"]) == (0, 0, 0), ours["failures"]
    assert ours["probe_verdicts"] >= 2  # the first release of every engine is reset once sent: only the probe proves it
    assert "resumed from" in result.stderr  # the journal's recovery line, once per successor
    table = {row[0]: row[1:] for row in table_rows(result.stdout)}
    assert table["controller restarts: killed inside a phase, a new controller on the journal"] == ["2 (2 mid-phase)"]
    assert data["verdict"]["no_deaths"] and data["verdict"]["no_failed_steps"] and data["verdict"]["no_requests_lost"]
    notes = section(data, None, "2026-12-01")  # benchmarks/soak_notes.py: the NOTES.md section from this report
    assert "| engine deaths | 0 |" in notes and "| controller restarts (killed mid-phase) | 2 (2) |" in notes


def test_soak_old_way_dies_on_the_same_seed(tmp_path: Path) -> None:
    """--way old on 2 steps of the same plan: engines die (it re-sends the release whose reset came after sending); exit 1."""
    result = run_cpr("soak", "--engines", "2", "--steps", "2", "--seed", "3", "--way", "old", "--report", "old.json", cwd=tmp_path)
    assert result.returncode == 1, result.stderr
    old = json.loads((tmp_path / "old.json").read_text())["ways"]["old"]
    assert old["engine_deaths"] > 0
    failed = [line for line in result.stderr.splitlines() if " FAILED: " in line]  # the progress line of a failed step
    assert failed, result.stderr
    assert all(re.search(r"\bengine \d\b", line) and "http://" not in line and " on / " not in line for line in failed), failed
    assert "missed: no deaths" in " ".join(row[1] for row in table_rows(result.stdout))


def test_soak_caption_names_the_fault_plans_seed(tmp_path: Path) -> None:
    """--fault-plan with `seed: 7` and no --seed: the caption and the report say seed 7 (not the flag's default 0)."""
    pytest.importorskip("yaml")
    (tmp_path / "plan.yaml").write_text("seed: 7\nrules:\n  - {path: /flush_cache, kind: status_before, status: 502, calls: [1]}\n")
    result = run_cpr(
        "soak", "--engines", "1", "--steps", "1", "--restart-every", "0", "--fault-plan", "plan.yaml", "--report", "s.json", cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    assert "1 engine, 1 step, seed 7 (the fault plan's), controller killed never" in " ".join(result.stdout.split())
    data = json.loads((tmp_path / "s.json").read_text())
    assert (data["seed"], data["fault_plan_seed"]) == (7, 7)


def test_seed_caption_says_which_seed_is_whose() -> None:
    """Without a plan file one seed; with one, the plan's unless --seed differs, then both."""
    assert seed_caption(0, 0, from_file=False, given=False) == "seed 0"
    assert seed_caption(7, 7, from_file=True, given=False) == "seed 7 (the fault plan's)"
    assert seed_caption(7, 7, from_file=True, given=True) == "seed 7"
    assert seed_caption(3, 7, from_file=True, given=True) == "seed 3 (stragglers), fault plan seed 7"


def test_pss_reads_the_whole_and_the_anonymous_part_of_a_live_process() -> None:
    """This process's smaps_rollup: PSS and its anonymous part, both positive, the part no larger than the whole."""
    pss = pss_bytes(os.getpid())
    assert pss is not None
    whole, anon = pss
    assert 0 < anon <= whole


def test_engines_are_judged_flat_on_anonymous_pss_not_on_shared_library_pages() -> None:
    """Whole PSS that grows 20 % while the anonymous part stays flat (another process stopped mapping the same
    libraries) is flat; anonymous PSS that grows 20 % is not, whatever the whole does."""
    report = ColocateReport(way="ours", steps_planned=30)
    steps = [{"step": float(i), "engines_mb": 100.0 + (20.0 if i > 20 else 0.0), "engines_anon_mb": 80.0} for i in range(30)]
    memory = {"engines": memory_verdict(steps, "engines_mb"), "engines_anon": memory_verdict(steps, "engines_anon_mb")}
    assert memory["engines"]["flat"] is False
    assert soak_verdict(report, memory)["engines_flat"] is True
    leaking = [{**s, "engines_mb": 100.0, "engines_anon_mb": 80.0 + (16.0 if s["step"] > 20 else 0.0)} for s in steps]
    memory = {"engines": memory_verdict(leaking, "engines_mb"), "engines_anon": memory_verdict(leaking, "engines_anon_mb")}
    assert soak_verdict(report, memory)["engines_flat"] is False


def test_soak_churn_kills_restarts_adds_and_retires_engines_with_no_death_and_no_request_lost(tmp_path: Path) -> None:
    """--churn 2 on 6 steps of 2 engines (+2 spares): engines killed inside offloads come back as new processes, spares
    join, one leaves; no death, no request lost, no failed step, every restarted engine serving; JSON == table."""
    result = run_cpr("soak", "--churn", "2", "--engines", "2", "--steps", "6", "--report", "churn.json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    data = json.loads((tmp_path / "churn.json").read_text())
    report = data["report"]
    assert report["steps"] == 6 and report["kills"] == 3 and report["restarts"] == 3, report
    assert report["replaced"] == 3 and report["joins"] >= 4 and report["leaves"] == 1 and report["fenced"] == 3, report
    assert report["requests_sent"] > 0 and (report["engine_deaths"], report["requests_lost"], report["failed_steps"]) == (0, 0, 0)
    assert data["verdict"] == {"no_deaths": True, "no_requests_lost": True, "no_failed_steps": True, "restarted_back": True}
    table = {row[0]: row[1:] for row in table_rows(result.stdout)}
    assert table["requests lost / sent"] == [f"0 / {report['requests_sent']}"] and table["end criteria"] == ["met"]


def test_soak_churn_refuses_the_options_it_does_not_run(tmp_path: Path) -> None:
    result = run_cpr("soak", "--churn", "2", "--way", "old", "--report", "churn.json", cwd=tmp_path)
    assert result.returncode == 2 and "--churn" in result.stderr and "Traceback" not in result.stderr
