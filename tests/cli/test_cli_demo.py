"""``cpr demo`` end to end: real engine processes, fault proxies and /metrics on 127.0.0.1, small sizes."""

from __future__ import annotations

import json
import os
import re
import signal
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
    ran = {way: r["steps_finished"] + r["failed_steps"] for way, r in (("old", old), ("ours", ours))}
    assert ran["old"] >= 1 and ran["ours"] == STEPS

    def with_rate(way: str, count: int) -> str:
        return f"{count} ({count / ran[way]:.1f}/step)"

    assert table["engine deaths"] == [with_rate("old", old["engine_deaths"]), with_rate("ours", ours["engine_deaths"])]
    assert table["restarts a controller would have triggered"] == [str(old["restarts"]), str(ours["restarts"])]
    assert table["502s seen"] == [with_rate("old", old["http_502_seen"]), with_rate("ours", ours["http_502_seen"])]
    assert table["502s absorbed by retries"] == [with_rate("old", old["http_502_absorbed"]), with_rate("ours", ours["http_502_absorbed"])]
    assert table["steps finished"] == [f"{old['steps_finished']} of {STEPS}", f"{STEPS} of {STEPS}"]
    # the rates' denominators are in the table, and the note under it says why the ways' figures differ
    assert table["steps run (the per-step rates below divide by these)"] == [f"{ran['old']} of {STEPS}", f"{STEPS} of {STEPS}"]
    assert table["calls re-sent after a reset or timeout"] == [
        with_rate("old", old["resent_after_error"]),
        with_rate("ours", ours["resent_after_error"]),
    ]
    assert table["wall time (s): total (per step run)"][1] == f"{ours['wall_s']:.1f} ({ours['wall_s'] / STEPS:.2f}/step)"
    assert data["rates_note"] and data["rates_note"] in " ".join(stdout.split())
    assert f"Ours finished each of its {STEPS} steps in {ours['wall_s'] / STEPS:.2f} s on average" in data["rates_note"]
    # the story's words follow what happened: a way that re-sent after resets is not "none retried"
    if old["resent_after_error"]:
        assert f"it re-sent {old['resent_after_error']} call" in data["story"]
    assert "none retried" not in data["story"]
    assert table["failed steps"] == [f"{old['failed_steps']} of {ran['old']} run", f"0 of {STEPS} run"]
    assert table["restart budget left"][1] == "3 of 3"
    # the story: one sentence per side, the baseline's engine deaths named by their cause (from the engines' logs)
    causes = data["engine_death_causes"]
    assert len(causes["old"]) == old["engine_deaths"] and causes["ours"] == []
    assert data["story"] in stdout.replace("\n", " ") or data["story"] in stdout
    assert data["story"].startswith(f"Old way met {old['http_502_seen'] / ran['old']:.1f} 502s per step")
    assert f"Ours met {ours['http_502_seen'] / STEPS:.1f} 502s per step, all absorbed by retries" in data["story"]
    if causes["old"]:
        assert causes["old"][0] in data["story"]
        assert not any(c.startswith("cause") for c in causes["old"])
    # the membership scene: one engine joined the offloaded group, one left, and the story says so
    membership = data["membership"]
    assert (membership["joins"], membership["leaves"], membership["engine_deaths"], membership["requests_lost"]) == (1, 1, 0, 0)
    assert membership["requests_sent"] > 0 and membership["failed_steps"] == 0
    assert "1 engine joined the offloaded group" in data["story"] and "1 engine left (retired" in data["story"]
    # the timeline's title says what killed an engine, not only the 502 the proxy answered
    old_step = data["timeline"]["steps"][0]
    assert len(old_step["causes"]) == len(old_step["died"])
    if old_step["died"]:
        assert all(c in causes["old"] for c in old_step["causes"])
    assert table["ambiguous faults (reset/timeout after the engine acted)"] == [
        with_rate("old", old["ambiguous_faults_seen"]),
        with_rate("ours", ours["ambiguous_faults_seen"]),
    ]
    assert table["engines quarantined (memory state unknown)"] == ["-", str(ours["engines_quarantined"])]
    assert table["engines reconciled (truth: emulator memory probe)"] == ["-", str(ours["engines_reconciled"])]
    assert ours["engines_reconciled"] == ours["engines_quarantined"]

    # one more step per way whose controller dies while training: the old way's fresh one releases again and kills every engine,
    # ours resumes from its journal
    assert (old["controller_restarts"], ours["controller_restarts"]) == (1, 1), data["controller_restart"]
    assert (old["controller_restart_deaths"], ours["controller_restart_deaths"]) == (4, 0)
    restart_row = table["controller killed while training; its successor"]
    assert restart_row == ["fresh: 4 engines died", "from the journal: 0 engines died"]

    assert old["engine_deaths"] + old["restarts"] > 0
    assert (ours["engine_deaths"], ours["restarts"], ours["failed_steps"], ours["requests_lost"]) == (0, 0, 0, 0)
    assert ours["http_502_seen"] > 0 and ours["http_502_absorbed"] == ours["http_502_seen"]
    # a 502 on a release or resume is settled by the clients' memory probe ("done": applied, no retry; "not done":
    # re-sent as probe_not_done), the others by a retry: the status_502 retries are at most the 502s absorbed
    assert 0 < data["metrics"]["per_way"]["ours"]["cpr_retries_total{reason=status_502}"] <= ours["http_502_absorbed"]
    assert data["metrics"]["per_way"]["old"]["cpr_restarts_total"] == old["restarts"]
    assert [s["way"] for s in data["timeline"]["steps"]] == ["old way", "ours"]
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_ctrl_c_after_ours_finished_writes_what_finished(tmp_path: Path) -> None:
    """SIGINT during the old way (ours done): exit 130, the table and report hold ours, no engine is left running."""
    args = ["demo", "--engines", "1", "--steps", "3", "--report", "r.json"]
    pipe = subprocess.PIPE
    proc = subprocess.Popen([*CPR, *args], cwd=tmp_path, stdout=pipe, stderr=pipe, stdin=subprocess.DEVNULL, text=True)
    assert proc.stderr is not None
    seen: list[str] = []
    try:
        for line in proc.stderr:  # plain progress lines (not a terminal); ends at EOF if cpr exits early
            seen.append(line)
            if line.startswith("ours: all 3 steps finished"):
                proc.send_signal(signal.SIGINT)  # the old way runs now (ours runs first)
                break
        stdout, rest = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    stderr = "".join(seen) + rest
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr
    assert "starting 1 emulated engine: 1 of 1 (engine 0 ready" in stderr  # engines started out of N, singular
    assert "cpr demo: interrupted; the report holds what finished (ours)" in stderr
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["interrupted"] is True
    assert list(data["ways"]) == ["ours"]
    assert data["ways"]["ours"]["steps_finished"] == 3
    assert data["table"]["columns"] == ["", "ours"]
    assert table_rows(stdout) == data["table"]["rows"]
    assert data["story"].startswith("Ours met ")
    pids = [int(p) for p in re.findall(r"engines ready: pids ([\d ]+)", stderr)[0].split()]
    assert len(pids) == 1
    for pid in pids:  # stopped by the demo itself (SIGTERM, then SIGKILL), not left to --exit-with-parent
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def _sigint_default() -> None:
    """In the child: SIGINT at its default, whatever the test runner's shell left (a background job ignores it)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _left_behind(parent: int) -> list[str]:
    """The command lines of processes started with ``--exit-with-parent PARENT`` (the zygote and engines) still running."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"--exit-with-parent" in argv and argv[argv.index(b"--exit-with-parent") + 1 : argv.index(b"--exit-with-parent") + 2] == [
            str(parent).encode()
        ]:
            found.append(f"{entry.name}: {b' '.join(argv).decode(errors='replace')}")
    return found


def test_sigint_to_the_demo_pid_alone_stops_it_inside_a_step(tmp_path: Path) -> None:
    """SIGINT to cpr demo's PID only (its own session, as a supervisor sends it) inside a step: it exits 130, every
    engine stopped, instead of waiting out its stragglers and retrying (62 s before the lab's stop clock)."""
    args = ["demo", "--engines", "2", "--steps", "20", "--report", "r.json"]
    pipe = subprocess.PIPE
    proc = subprocess.Popen(
        [*CPR, *args],
        cwd=tmp_path,
        stdout=pipe,
        stderr=pipe,
        stdin=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
        preexec_fn=_sigint_default,
    )
    assert proc.stderr is not None
    seen: list[str] = []
    try:
        for line in proc.stderr:
            seen.append(line)
            if line.startswith("ours: step 2/20"):
                # not a wait for anything: it places the signal inside step 3's offload, where stragglers wait at
                # paused engines (the moment that took 62 s; sent at once, it lands in the quick rollout)
                time.sleep(0.4)
                proc.send_signal(signal.SIGINT)
                break
        _stdout, rest = proc.communicate(timeout=30)  # generous: it stops in about a second
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    stderr = "".join(seen) + rest
    assert proc.returncode == 130, stderr
    assert "cpr demo: interrupted" in stderr and "Traceback" not in stderr
    pids = [int(p) for p in re.findall(r"engines ready: pids ([\d ]+)", stderr)[0].split()]
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert _left_behind(proc.pid) == []
