"""``cpr emulate --engine vllm``: vLLM engines from one command, with vLLM's flags and ``VLLM_SERVER_DEV_MODE``."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest
import requests

from tests.cli.cpr_testlib import CPR, run_cpr
from tests.conftest import none_of_ours_listens, process_tree

N = 2


def test_emulate_vllm_engines_serve_vllm_routes_with_dev_mode_from_the_environment(tmp_path: Path) -> None:
    """--engine vllm --engines 2 --enable-sleep-mode: two READY lines, vLLM's /version, dev routes mounted by the env; SIGTERM ends all."""
    pytest.importorskip("torch")  # the shared zygote imports it
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}
    argv = [
        *CPR,
        "emulate",
        "--engine",
        "vllm",
        "--engines",
        str(N),
        "--enable-sleep-mode",
        "--weight-transfer-config",
        '{"backend": "nccl"}',
    ]
    proc = subprocess.Popen(
        argv, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, env=env
    )
    try:
        assert proc.stdout is not None and proc.stderr is not None
        lines = [proc.stdout.readline() for _ in range(N)]  # bounded by the test timeout; printed once all serve
        assert all(line.startswith("EMULATOR READY http://127.0.0.1:") for line in lines), lines
        urls = [line.split()[-1] for line in lines]
        with requests.Session() as session:
            session.trust_env = False
            for url in urls:
                assert session.get(url + "/version", timeout=10).json() == {"version": "0.33.0"}
                state = session.get(url + "/_emulator/state", timeout=10).json()
                assert (state["engine"], state["dev_mode"], state["sleep_mode"]) == ("vllm", True, True)
                assert session.post(url + "/start_weight_update", timeout=10).json() == {"message": "Weight update started"}
            pids = {session.get(url + "/_emulator/state", timeout=10).json()["pid"] for url in urls}
        tree = process_tree(proc.pid)
        assert len(pids) == N and pids <= set(tree)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert f"engines ready {N}/{N}" in proc.stderr.read()
        assert all(none_of_ours_listens(url, tree) for url in urls)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("--weight-transfer-config", "nccl"), "argument --weight-transfer-config"),
        (("--enable-memory-saver",), "unrecognized arguments: --enable-memory-saver"),  # an SGLang flag, not vLLM's
        (("--max-num-seqs", "0"), "`max_num_seqs` must be an integer >= 1"),
        (("--port", "70000"), "--port"),
    ],
)
def test_emulate_vllm_bad_flags_are_one_error_line(tmp_path: Path, args: tuple[str, ...], needle: str) -> None:
    """A bad vLLM flag is one line on stderr naming it, exit 2."""
    result = run_cpr("emulate", "--engine", "vllm", *args, cwd=tmp_path, timeout=60)
    assert result.returncode == 2
    assert needle in result.stderr and result.stderr.count("\n") == 1, result.stderr
