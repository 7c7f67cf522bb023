"""A real Prometheus server scrapes a local prometheus-client exporter and evaluates the committed rules."""

import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from grafana_testlib import RULES
from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from tests.promserver import get_json, poll, prometheus_server

ENDPOINT = "POST /pause_generation"
ENGINE = "http://127.0.0.1:30000"


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
    with prometheus_server(tmp_path, [f"127.0.0.1:{exporter.port}"], [RULES]) as running:
        yield running


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
        body = get_json(f"{base}/api/v1/query?{query}")
        assert body["status"] == "success", body
        result = body["data"]["result"]
        value = float(result[0]["value"][1]) if result else 0.0
        return value if value > 0 else None

    assert poll(rate_502, "a non-zero 502 rate", log) > 0

    def healthy_groups() -> dict[str, list[dict[str, Any]]] | None:
        groups = get_json(f"{base}/api/v1/rules")["data"]["groups"]
        rules = {group["name"]: group["rules"] for group in groups}
        evaluated = all(rule["health"] != "unknown" for group_rules in rules.values() for rule in group_rules)
        return rules if rules and evaluated else None

    rules = poll(healthy_groups, "every rule to be evaluated", log)
    assert set(rules) == {"cpr-restart-budget", "cpr-control-plane", "cpr-engines"}
    health = {rule["name"]: (rule["health"], rule.get("lastError", "")) for group_rules in rules.values() for rule in group_rules}
    assert len(health) == 9
    assert all(state == "ok" for state, _error in health.values()), health

    def exhausted_alert() -> dict[str, Any] | None:
        alerts = get_json(f"{base}/api/v1/alerts")["data"]["alerts"]
        matching = [alert for alert in alerts if alert["labels"]["alertname"] == "CPRRestartBudgetExhausted"]
        return matching[0] if matching else None

    alert = poll(exhausted_alert, "CPRRestartBudgetExhausted to go pending", log)
    assert alert["state"] == "pending"  # `for: 1m` has not elapsed yet
    assert alert["labels"]["job"] == "cpr-exporter"
    assert alert["labels"]["severity"] == "page"
