"""``--router smg`` on ``cpr emulate`` and ``cpr probe``: engines behind a real smg gateway, and a probe through its list.

Also: ``docs/cli.md`` names every option each subcommand's parser takes (a new flag without its line there fails).
"""

from __future__ import annotations

import argparse
import re
import signal
import subprocess
from pathlib import Path

import psutil
import pytest
import requests

from resilience.cli.app import build_parser
from resilience.cli.emulate import _parser as emulate_parser
from tests.cli.cpr_testlib import CPR, error_lines, run_cpr
from tests.smg.conftest import require_smg

DOC = Path(__file__).resolve().parents[2] / "docs" / "cli.md"


def test_emulate_behind_smg_then_probe_through_it_then_one_signal_stops_all(tmp_path: Path) -> None:
    """``cpr emulate --engines 2 --router smg``: one READY line (the gateway), two ready workers; ``cpr probe --router
    smg`` checks both at their own URLs (exit 0); SIGINT stops the gateway and the engines (exit 0)."""
    require_smg()
    pytest.importorskip("torch")
    command = [*CPR, "emulate", "--engines", "2", "--router", "smg", "--health-poll-seconds", "0.05"]
    pipe = subprocess.PIPE
    proc = subprocess.Popen(command, cwd=tmp_path, stdout=pipe, stderr=pipe, stdin=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout is not None and proc.stderr is not None
        line = proc.stdout.readline()  # bounded by the test timeout; printed once the gateway's workers are ready
        assert line.startswith("EMULATOR READY http://127.0.0.1:"), line
        gateway = line.split()[-1]
        with requests.Session() as session:
            session.trust_env = False
            workers = session.get(gateway + "/workers", timeout=10).json()["workers"]
        assert [w["status"] for w in workers] == ["ready", "ready"]
        tree = [proc.pid, *(c.pid for c in psutil.Process(proc.pid).children(recursive=True))]
        assert len(tree) >= 4  # the command, its two engines (or their zygote's children) and smg

        probed = run_cpr("probe", "--router", "smg", gateway, cwd=tmp_path, timeout=60)
        assert probed.returncode == 0, probed.stdout + probed.stderr
        assert f"OK    gateway {gateway}  2 workers: 2 ready" in probed.stdout
        for w in workers:
            assert f"OK    {w['url'].rstrip('/')}  healthy" in probed.stdout
        assert "cpr probe --router smg: 2 engines" in probed.stdout

        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
        assert "in front of 2 engines" in proc.stderr.read()
        assert not [pid for pid in tree if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_probe_router_smg_on_an_engine_says_it_is_no_gateway(tmp_path: Path, refusing_port: int) -> None:
    """A URL that lists no workers is named, and the probe fails (exit 1) with nothing else to check."""
    done = run_cpr("probe", "--router", "smg", f"http://127.0.0.1:{refusing_port}", "--timeout", "1", cwd=tmp_path, timeout=60)
    assert done.returncode == 1
    assert f"FAIL  gateway http://127.0.0.1:{refusing_port}  GET /workers: " in done.stdout
    assert error_lines(done.stderr) == ["cpr probe: no worker to check behind 1 gateway"]


def test_emulate_vllm_refuses_smg_in_one_line(tmp_path: Path) -> None:
    done = run_cpr("emulate", "--engine", "vllm", "--router", "smg", cwd=tmp_path, timeout=60)
    assert done.returncode == 2
    [line] = error_lines(done.stderr)
    assert "--router: smg is for SGLang engines only" in line


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {o for action in parser._actions for o in action.option_strings if o.startswith("--") and o != "--help"}


def _row(command: str) -> str:
    rows = [line for line in DOC.read_text().splitlines() if line.startswith(f"| `cpr {command}")]
    assert len(rows) == 1, f"docs/cli.md has {len(rows)} rows for cpr {command}"
    return rows[0]


@pytest.mark.parametrize("command", ["demo", "soak", "probe", "policies", "dashboards"])
def test_cli_page_names_every_option_of_each_subcommand(command: str) -> None:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    options = _options(sub.choices[command])
    assert options, command
    missing = [o for o in sorted(options) if not re.search(re.escape(o) + r"\b", _row(command))]
    assert not missing, f"docs/cli.md's cpr {command} row lacks {missing}"


def test_cli_page_names_emulates_own_options() -> None:
    """``cpr emulate``'s own flags (the engine's config flags are the emulator page's)."""
    row = _row("emulate")
    for option in ("--port", "--engines", "--fault-plan", "--router", "--engine"):
        assert option in _options(emulate_parser()) | {"--engine"}
        assert re.search(re.escape(option) + r"\b", row), option
