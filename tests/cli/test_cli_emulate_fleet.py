"""``cpr emulate --engines N``: N engines from one command, their URLs as a list, all stopped by one signal."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import pytest
import requests

from tests.cli.cpr_testlib import CPR, run_cpr
from tests.conftest import none_of_ours_listens, process_tree

N = 3


def test_emulate_engines_prints_progress_and_one_url_per_engine_then_stops_them_all(tmp_path: Path) -> None:
    """--engines 3: 'engines ready i/3' on stderr, three READY lines on distinct ports, each serves; SIGTERM ends all."""
    pytest.importorskip("torch")
    proc = subprocess.Popen(
        [*CPR, "emulate", "--engines", str(N), "--health-poll-seconds", "0.05"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stderr is not None
        lines = [proc.stdout.readline() for _ in range(N)]  # bounded by the test timeout; printed once all serve
        assert all(line.startswith("EMULATOR READY http://127.0.0.1:") for line in lines), lines
        urls = [line.split()[-1] for line in lines]
        assert len(set(urls)) == N
        with requests.Session() as session:
            session.trust_env = False
            pids = {session.get(url + "/_emulator/state", timeout=10).json()["pid"] for url in urls}
            assert len(pids) == N and proc.pid not in pids  # N processes of their own
            assert all(session.get(url + "/health", timeout=10).status_code == 200 for url in urls)
        tree = process_tree(proc.pid)
        assert pids <= set(tree)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert f"engines ready {N}/{N}" in proc.stderr.read()
        assert all(none_of_ours_listens(url, tree) for url in urls)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_emulate_engines_must_be_positive(tmp_path: Path) -> None:
    """--engines 0 is one error line naming the flag, exit 2."""
    result = run_cpr("emulate", "--engines", "0", cwd=tmp_path, timeout=60)
    assert result.returncode == 2
    assert "`--engines` must be >= 1" in result.stderr and result.stderr.count("\n") == 1


def test_emulate_help_says_what_each_engine_knob_means_with_its_unit_and_default(tmp_path: Path) -> None:
    """Every EngineConfig flag's help is its docstring, unit and default (not "EngineConfig.token_rate")."""
    result = run_cpr("emulate", "--help", cwd=tmp_path, timeout=60)
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())
    assert "EngineConfig." not in text
    assert "--token-rate TOKENS_PER_S Tokens per second that each running request decodes." in text
    assert "(in tokens per second; default: 200.0)" in text
    assert "--swap-seconds SECONDS How long release_memory_occupation / resume_memory_occupation hold the scheduler." in text
    assert "(in seconds; default: 0.05)" in text
    assert "--max-running-requests N Most requests in the running batch at once" in text
    assert "--api-key API_KEY SGLang's --api-key" in text and "``" not in text
    assert "--fault-plan FILE put a fault proxy on 127.0.0.1 in front of each engine" in text


def test_emulate_fault_plan_puts_a_proxy_in_front_of_each_engine(tmp_path: Path) -> None:
    """--fault-plan: the READY line is the proxy's URL, stderr names the engine behind it; the plan's 502 comes
    through the proxy and not from the engine's own URL; SIGTERM stops both (exit 0)."""
    pytest.importorskip("torch")
    (tmp_path / "plan.yaml").write_text("seed: 7\nrules:\n  - {path: /flush_cache, kind: status_before, status: 502, calls: [1]}\n")
    proc = subprocess.Popen(
        [*CPR, "emulate", "--fault-plan", "plan.yaml", "--health-poll-seconds", "0.05"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stderr is not None
        ready = proc.stdout.readline()
        assert ready.startswith("EMULATOR READY http://127.0.0.1:"), ready
        proxied = ready.split()[-1]
        err = [proc.stderr.readline().rstrip("\n") for _ in range(3)]  # written before the READY line
        assert err[1] == "fault plan plan.yaml: seed 7, 1 rule", err
        direct = err[2].split()[2]
        assert err[2] == f"engine 0: {direct} behind fault proxy {proxied}" and direct != proxied, err
        tree = process_tree(proc.pid)
        with requests.Session() as session:
            session.trust_env = False
            assert session.post(direct + "/flush_cache", timeout=10).status_code == 200  # the engine itself: no fault
            assert session.post(proxied + "/flush_cache", timeout=10).status_code == 502  # the plan's first call
            assert session.post(proxied + "/flush_cache", timeout=10).status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert none_of_ours_listens(proxied, tree) and none_of_ours_listens(direct, tree)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
