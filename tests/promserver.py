"""A real Prometheus server on 127.0.0.1 for tests: start, poll its HTTP API, stop it by PID."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml

from tests.conftest import free_port, require_tool

POLL_LIMIT_S = 30.0
"""Upper bound on each wait: Prometheus' first scrape comes 5-8 s after it starts."""
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))
T = TypeVar("T")


def get_json(url: str) -> Any:
    """GET a JSON document, never through a proxy."""
    with _NO_PROXY.open(url, timeout=5) as response:
        return json.loads(response.read())


def poll(probe: Callable[[], T | None], what: str, log: Path) -> T:
    """Call ``probe`` until it returns a value (not None), for at most POLL_LIMIT_S seconds; fail with the server log."""
    deadline = time.monotonic() + POLL_LIMIT_S
    while True:
        try:
            value = probe()
        except OSError:  # not listening yet
            value = None
        if value is not None:
            return value
        if time.monotonic() > deadline:
            tail = log.read_text(encoding="utf-8", errors="replace")[-3000:] if log.exists() else ""
            pytest.fail(f"timed out after {POLL_LIMIT_S:.0f}s waiting for {what}; prometheus log:\n{tail}")
        time.sleep(0.1)  # a short step: each wait ends within 0.1 s of what it waits for


@contextmanager
def prometheus_server(
    tmp_path: Path, targets: Sequence[str], rule_files: Sequence[Path] = (), job: str = "cpr-exporter"
) -> Iterator[tuple[str, Path]]:
    """Run Prometheus scraping ``targets`` (host:port) every second with ``rule_files``; yields (base URL, log path)."""
    binary = require_tool("prometheus")
    config = {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(p) for p in rule_files],
        "scrape_configs": [{"job_name": job, "static_configs": [{"targets": list(targets)}]}],
    }
    config_path = tmp_path / "prometheus.yml"
    config_path.write_text(yaml.safe_dump(config), encoding="utf-8")
    port = free_port()
    log = tmp_path / "prometheus.log"
    with log.open("w", encoding="utf-8") as log_file:
        process = subprocess.Popen(
            [
                binary,
                f"--config.file={config_path}",
                f"--storage.tsdb.path={tmp_path / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--log.level=info",
            ],
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )
    base = f"http://127.0.0.1:{port}"
    try:
        poll(
            lambda: True if process.poll() is None and _NO_PROXY.open(f"{base}/-/ready", timeout=2).status == 200 else None, "/-/ready", log
        )
        yield base, log
    finally:
        process.terminate()  # SIGTERM to this server's PID only
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=5)
