"""A closed output pipe ends ``cpr`` quietly with status 141 (what a shell reports for a program SIGPIPE ended)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from resilience.cli.app import CLOSED_PIPE_EXIT
from tests.cli.cpr_testlib import CPR


def _closed_pipe() -> int:
    """The write end of a real pipe whose reader has already gone: every write to it fails with EPIPE."""
    read, write = os.pipe()
    os.close(read)
    return write


def test_closed_pipe_status_is_128_plus_sigpipe() -> None:
    """141 = 128 + SIGPIPE, the status ``yes | head -1`` leaves in PIPESTATUS."""
    assert CLOSED_PIPE_EXIT == 141


def test_stdout_closed_exits_141_and_says_nothing_on_stderr(tmp_path: Path) -> None:
    """`cpr policies` into a pipe nobody reads: status 141, stderr empty (no rich SystemExit(1), no 'Exception ignored')."""
    pytest.importorskip("rich")
    write = _closed_pipe()
    try:
        result = subprocess.run(
            [*CPR, "policies"], cwd=tmp_path, stdout=write, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, timeout=60
        )
    finally:
        os.close(write)
    assert result.returncode == CLOSED_PIPE_EXIT
    assert result.stderr == ""


def test_stdout_and_stderr_closed_exit_141(tmp_path: Path) -> None:
    """`cpr policies >pipe 2>&1` with the reader gone: 141 (the error report itself cannot be written; it is not tried twice)."""
    pytest.importorskip("rich")
    write = _closed_pipe()
    try:
        result = subprocess.run([*CPR, "policies"], cwd=tmp_path, stdout=write, stderr=write, stdin=subprocess.DEVNULL, timeout=60)
    finally:
        os.close(write)
    assert result.returncode == CLOSED_PIPE_EXIT


def test_demo_into_head_exits_141(tmp_path: Path) -> None:
    """`cpr demo ... 2>&1 | head -2` (a real head): head gets the first two progress lines, cpr ends with 141 at its
    next line (once its engine serves) and writes no report."""
    pytest.importorskip("rich")
    pytest.importorskip("torch")
    bash, head = shutil.which("bash"), shutil.which("head")
    if bash is None or head is None:
        pytest.fail("this test needs bash and head")
    command = " ".join([*CPR, "demo", "--engines", "1", "--steps", "1", "--report", "r.json"])
    script = f'{command} 2>&1 | {head} -2; echo "status=${{PIPESTATUS[0]}}"'
    result = subprocess.run([bash, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=240, stdin=subprocess.DEVNULL)
    lines = result.stdout.splitlines()
    assert lines[0].startswith("metrics: http://127.0.0.1:"), result.stdout
    assert lines[1] == "starting 1 emulated engine: 0 of 1 ...", result.stdout
    assert lines[-1] == f"status={CLOSED_PIPE_EXIT}", result.stdout
    assert not (tmp_path / "r.json").exists()  # it stopped: no report of a demo that did not run
