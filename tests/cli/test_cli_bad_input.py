"""Bad input to every ``cpr`` subcommand: one clear line on stderr, a non-zero exit, never a traceback."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cli.cpr_testlib import error_lines, run_cpr


@pytest.fixture(scope="module")
def busy_port() -> Iterator[int]:
    """A port something listens on (closed after the module)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield int(s.getsockname()[1])


@pytest.fixture(scope="module")
def dead_pid() -> int:
    """The PID of a process that has exited and been reaped (nothing runs under it now)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """A folder holding a bad policy file, a bad fault plan and a plain file."""
    (tmp_path / "bad.toml").write_text('[endpoints."POST /x"]\nattempt_timeout_s = 60\ndeadline_s = 10\n')
    (tmp_path / "plan.toml").write_text('seed = 1\n[[rules]]\npath = "/flush_cache"\nkind = "status_before"\nprobability = 3\n')
    (tmp_path / "file.txt").write_text("not a folder\n")
    return tmp_path


CASES = [
    # (arguments, exit status, a fragment of the one stderr line)
    ([], 2, "usage: cpr"),
    (["frobnicate"], 2, "invalid choice: 'frobnicate'"),
    (["demo", "--bogus"], 2, "cpr demo: error: unrecognized arguments: --bogus"),
    (["demo", "--engines", "0"], 2, "--engines: must be an integer >= 1, but was 0"),
    (["demo", "--timeline", "t.gif"], 2, "must end in .png or .html or .htm"),
    (["demo", "--report", "no/such/dir/r.json"], 1, "folder 'no/such/dir' does not exist"),
    (["demo", "--metrics-port", "{busy}"], 1, "cannot serve /metrics on 127.0.0.1:{busy}"),
    (["demo", "--traces", "jaeger"], 2, "invalid choice: 'jaeger'"),
    (["demo", "--engines", "1000000"], 2, "cpr demo: error: --engines 1000000 is more than this machine holds: at most"),
    (["demo", "--engine", "vllm", "--engines", "1000000"], 2, "--engines 1000000 is more than this machine holds"),
    (["demo", "--router", "smg", "--engines", "1000000"], 2, "--engines 1000000 is more than this machine holds"),
    (["soak", "--engines", "1000000"], 2, "cpr soak: error: --engines 1000000 is more than this machine holds: at most"),
    (["soak", "--steps", "x"], 2, "--steps: must be an integer >= 1, but was 'x'"),
    (["soak", "--way", "sideways"], 2, "invalid choice: 'sideways'"),
    (["soak", "--restart-every", "-1"], 2, "--restart-every: must be an integer >= 0, but was -1"),
    (["soak", "--fault-plan", "plan.toml"], 1, "`probability` must be a number between 0 and 1, but was 3"),
    (["soak", "--fault-plan", "missing.toml"], 1, "cannot read fault plan"),
    (["probe"], 2, "the following arguments are required: URL"),
    (["probe", "engine-0:30000"], 2, "is not an http:// or https:// engine URL"),
    (["probe", "--timeout", "-1", "http://127.0.0.1:1"], 2, "--timeout: must be a finite number > 0"),
    (["probe", "http://127.0.0.1:{free}", "--timeout", "1"], 1, "cpr probe: 1 of 1 engine not healthy: http://127.0.0.1:{free}"),
    (["emulate", "--bogus"], 2, "cpr emulate: error: unrecognized arguments: --bogus"),
    (["emulate", "--token-rate", "-1"], 2, "`token_rate` must be a finite number >= 0"),
    (["emulate", "--port", "{busy}"], 1, "cpr emulate: error: cannot listen on 127.0.0.1:{busy}"),
    (["emulate", "--exit-with-parent", "{dead}"], 2, "cpr emulate: error: --exit-with-parent {dead}: no process with that PID is running"),
    (["emulate", "--exit-with-parent", "1"], 2, "--exit-with-parent 1: that process is not this engine's parent"),
    (["policies", "--file", "bad.toml"], 1, "EndpointPolicy.attempt_timeout_s must be <= deadline_s (10), but was 60"),
    (["policies", "--file", "missing.toml"], 1, "cannot read policy file"),
    (["policies", "--file", "file.txt"], 1, "unknown policy file type '.txt'"),
    (["policies", "--over-sglang"], 2, "--over-sglang needs --file"),
    (["dashboards", "--out", "file.txt"], 2, "is not a folder"),
    (["dashboards", "--chek"], 2, "unrecognized arguments: --chek"),
    # abbreviations are refused: --engine is not --engines (it is the engine kind), --step not --steps
    (["demo", "--engine", "2"], 2, "cpr demo: error: argument --engine: invalid choice: '2'"),
    (["demo", "--engin", "2"], 2, "cpr demo: error: unrecognized arguments: --engin 2"),
    (["soak", "--step", "3"], 2, "cpr soak: error: unrecognized arguments: --step 3"),
    (["probe", "--time", "3", "http://127.0.0.1:1"], 2, "cpr probe: error: unrecognized arguments: --time "),
    (["policies", "--fil", "bad.toml"], 2, "unrecognized arguments: --fil bad.toml"),
    (["journal", "show", "x", "--la", "2"], 2, "unrecognized arguments: --la 2"),
    (["emulate", "--fault-plan", "plan.toml"], 1, "cpr emulate: error: bad --fault-plan:"),
    (["emulate", "--fault-plan", "missing.toml"], 1, "cannot read fault plan"),
    (["emulate", "--fault-plan", "plan.toml", "--host", "0.0.0.0"], 2, "--fault-plan: not with --host"),
    (["emulate", "--engine", "2"], 2, "cpr emulate: error: argument --engine: invalid choice: '2'"),
    (["emulate", "--token-r", "5"], 2, "cpr emulate: error: unrecognized arguments: --token-r 5"),
    (["--vers"], 2, "unrecognized arguments: --vers"),
]


@pytest.mark.parametrize(("args", "code", "fragment"), CASES, ids=[" ".join(c[0]) or "(none)" for c in CASES])
def test_bad_input_is_one_line_and_non_zero(
    workdir: Path, busy_port: int, dead_pid: int, refusing_port: int, args: list[str], code: int, fragment: str
) -> None:
    """Each bad input: the documented exit status, one line on stderr naming the problem, no traceback."""
    free = refusing_port
    argv = [a.format(busy=busy_port, free=free, dead=dead_pid) for a in args]
    result = run_cpr(*argv, cwd=workdir, timeout=90)
    assert result.returncode == code, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    if args == []:
        assert fragment in result.stderr  # no subcommand: the help, on stderr
        return
    if args[0] == "probe" and code == 1:  # an unreachable engine is a result: its line on stdout, a summary on stderr
        assert "unreachable: connection refused" in result.stdout
    [line] = error_lines(result.stderr)
    assert fragment.format(busy=busy_port, free=free, dead=dead_pid) in line


def _low_fd_limit() -> None:
    """In the child: a soft limit of 256 file descriptors (the hard limit unchanged)."""
    import resource

    resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))


def test_demo_engines_beyond_the_descriptor_limit_are_refused_before_anything_starts(tmp_path: Path) -> None:
    """Under ``ulimit -n 256`` the demo holds (256 - 64) / 32 = 6 engines: 7 is refused, naming the limit; nothing starts."""
    from tests.cli.cpr_testlib import CPR

    for engines, args in ((7, ()), (10000, ("--engine", "vllm"))):
        proc = subprocess.run(
            [*CPR, "demo", "--engines", str(engines), *args],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
            stdin=subprocess.DEVNULL,
            preexec_fn=_low_fd_limit,
        )
        assert proc.returncode == 2, proc.stderr
        lines = error_lines(proc.stderr)
        assert len(lines) == 1, proc.stderr
        assert f"--engines {engines} is more than this machine holds: at most 6 (" in lines[0]
        assert "file descriptors: limit 256 (ulimit -n) less 64 / 32 per engine = 6" in lines[0]
        assert "starting" not in proc.stderr and "metrics:" not in proc.stdout  # refused before any engine or server
    assert not list(tmp_path.iterdir())  # no report either
