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
