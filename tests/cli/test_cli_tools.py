"""``cpr emulate``, ``cpr dashboards`` and the timeline drawing."""

from __future__ import annotations

import filecmp
import signal
import subprocess
from pathlib import Path

import pytest
import requests

from resilience.cli.timeline import Bar, Mark, StepTimeline, write_timeline
from tests.cli.cpr_testlib import CPR, run_cpr

REPO = Path(__file__).resolve().parents[2]


def test_emulate_serves_one_engine_until_terminated(tmp_path: Path) -> None:
    """cpr emulate --port 0 prints its READY line, serves /health, and exits on SIGTERM."""
    pytest.importorskip("torch")
    proc = subprocess.Popen(
        [*CPR, "emulate", "--port", "0", "--health-poll-seconds", "0.05"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # bounded by the test timeout; the engine prints it once it serves
        assert line.startswith("EMULATOR READY http://127.0.0.1:"), proc.stderr.read() if proc.stderr else line
        url = line.split()[-1]
        assert requests.get(url + "/health", timeout=10).status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) is not None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_dashboards_check_passes_and_out_writes_the_same_files(tmp_path: Path) -> None:
    """--check finds the committed grafana/ fresh; --out DIR writes identical dashboard and rules."""
    pytest.importorskip("grafana_foundation_sdk")
    check = run_cpr("dashboards", "--check", cwd=tmp_path, timeout=120)
    assert check.returncode == 0, check.stderr
    out = run_cpr("dashboards", "--out", str(tmp_path / "g"), cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stderr
    for rel in ("dashboards/controlplane-resilience.json", "rules/controlplane-resilience.rules.yml"):
        assert filecmp.cmp(tmp_path / "g" / rel, REPO / "grafana" / rel, shallow=False)


def _timelines() -> list[StepTimeline]:
    old = StepTimeline("old way", 1, False, "HTTPError: 502 from engine 1 /release_memory_occupation", 2, died=[1])
    old.bars.append(Bar(0, "flush", 0.0, 0.05, 2, (400, 200)))
    old.ticks.append(Mark(1, 0.06, "died", "/release_memory_occupation"))
    old.marks += [Mark(0, 0.0, "502", "/flush_cache"), Mark(0, 0.02, "retry", "/flush_cache"), Mark(1, 0.06, "died", "")]
    ours = StepTimeline("ours", 4, True, None, 2)
    ours.bars += [
        Bar(i, phase, 0.1 * k, 0.1 * k + 0.05, 1, (200,)) for i in range(2) for k, phase in enumerate(["pause", "flush", "release"])
    ]
    ours.marks.append(Mark(1, 0.2, "502", "/release_memory_occupation"))
    return [old, ours]


def test_timeline_html_is_self_contained(tmp_path: Path) -> None:
    """The HTML timeline inlines its SVG and lists the marks; it loads nothing from elsewhere."""
    pytest.importorskip("matplotlib")
    path = tmp_path / "t.html"
    write_timeline(path, _timelines())
    text = path.read_text()
    assert "<svg" in text and "<script" not in text and "<link" not in text and 'src="http' not in text
    assert "<td>502</td><td>/flush_cache</td>" in text and "<td>died</td>" in text


def test_timeline_png_is_written(tmp_path: Path) -> None:
    """The PNG timeline is a PNG."""
    pytest.importorskip("matplotlib")
    path = tmp_path / "t.png"
    write_timeline(path, _timelines())
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
