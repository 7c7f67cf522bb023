"""A real Prometheus server scrapes a local prometheus-client exporter and evaluates the committed rules."""

import json
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml
from grafana_testlib import RULES, require_binary
from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

POLL_LIMIT_S = 30.0
"""Upper bound on each wait: Prometheus' first scrape comes 5-8 s after it starts."""
ENDPOINT = "POST /pause_generation"
ENGINE = "http://127.0.0.1:30000"
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))

T = TypeVar("T")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _get(url: str) -> Any:
    with _NO_PROXY.open(url, timeout=5) as response:
        return json.loads(response.read())


def _poll(probe: Callable[[], T | None], what: str, log: Path) -> T:
    """Call ``probe`` until it returns a value (not None), for at most POLL_LIMIT_S seconds."""
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
        time.sleep(0.5)


class Exporter:
    """A prometheus-client exporter on 127.0.0.1 publishing contract-shaped series from a fresh registry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.attempts = Counter(
            "cpr_attempts", "Attempts by endpoint, engine and status.", ["endpoint", "engine", "status"], registry=self.registry
        )
        self.restarts = Counter("cpr_restarts", "Restarts recorded, by cause.", ["cause"], registry=self.registry)
        self.limit = Gauge("cpr_restart_budget_limit", "Restarts the run may take.", registry=self.registry)
        self.remaining = Gauge("cpr_restart_budget_remaining", "Restarts left.", registry=self.registry)
        self.planned = Gauge("cpr_restart_budget_planned_run_seconds", "Planned run length.", registry=self.registry)
        self.server, self.thread = start_http_server(0, addr="127.0.0.1", registry=self.registry)
        self.port: int = self.server.server_port

    def close(self) -> None:
        """Stop serving and join the server thread."""
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


@pytest.fixture
def exporter() -> Iterator[Exporter]:
    """A running exporter, stopped after the test."""
    running = Exporter()
    try:
        yield running
    finally:
        running.close()


@pytest.fixture
def prometheus(tmp_path: Path, exporter: Exporter) -> Iterator[tuple[str, Path]]:
    """A Prometheus server scraping ``exporter`` every second with the committed rules; yields (base URL, log path)."""
    binary = require_binary("prometheus")
    config = {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(RULES)],
        "scrape_configs": [{"job_name": "cpr-exporter", "static_configs": [{"targets": [f"127.0.0.1:{exporter.port}"]}]}],
    }
    config_path = tmp_path / "prometheus.yml"
    config_path.write_text(yaml.safe_dump(config), encoding="utf-8")
    port = _free_port()
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
        _poll(
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


def test_prometheus_scrapes_502s_and_evaluates_the_rules(exporter: Exporter, prometheus: tuple[str, Path]) -> None:
    """Prometheus scrapes the exporter's 502 attempts, loads both rule groups healthy, and evaluates an alert."""
    base, log = prometheus
    exporter.limit.set(3)
    exporter.planned.set(86400)
    exporter.remaining.set(0)
    exporter.restarts.labels(cause="actor_failure").inc(3)
    five_oh_two = exporter.attempts.labels(endpoint=ENDPOINT, engine=ENGINE, status="502")
    exporter.attempts.labels(endpoint=ENDPOINT, engine=ENGINE, status="200").inc()
    query = urllib.parse.urlencode({"query": 'sum(rate(cpr_attempts_total{status="502"}[30s]))'})

    def rate_502() -> float | None:
        five_oh_two.inc()
        body = _get(f"{base}/api/v1/query?{query}")
        assert body["status"] == "success", body
        result = body["data"]["result"]
        value = float(result[0]["value"][1]) if result else 0.0
        return value if value > 0 else None

    assert _poll(rate_502, "a non-zero 502 rate", log) > 0

    def healthy_groups() -> dict[str, list[dict[str, Any]]] | None:
        groups = _get(f"{base}/api/v1/rules")["data"]["groups"]
        rules = {group["name"]: group["rules"] for group in groups}
        evaluated = all(rule["health"] != "unknown" for group_rules in rules.values() for rule in group_rules)
        return rules if rules and evaluated else None

    rules = _poll(healthy_groups, "every rule to be evaluated", log)
    assert set(rules) == {"cpr-restart-budget", "cpr-control-plane"}
    health = {rule["name"]: (rule["health"], rule.get("lastError", "")) for group_rules in rules.values() for rule in group_rules}
    assert len(health) == 7
    assert all(state == "ok" for state, _error in health.values()), health

    def exhausted_alert() -> dict[str, Any] | None:
        alerts = _get(f"{base}/api/v1/alerts")["data"]["alerts"]
        matching = [alert for alert in alerts if alert["labels"]["alertname"] == "CPRRestartBudgetExhausted"]
        return matching[0] if matching else None

    alert = _poll(exhausted_alert, "CPRRestartBudgetExhausted to go pending", log)
    assert alert["state"] == "pending"  # `for: 1m` has not elapsed yet
    assert alert["labels"]["job"] == "cpr-exporter"
    assert alert["labels"]["severity"] == "page"
