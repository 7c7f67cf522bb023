"""Telemetry of a real emulated run: the exporter counts exactly the injected 502s, and a real Prometheus scrapes it."""

from __future__ import annotations

import urllib.parse
from pathlib import Path

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from resilience.adapters.sglang import SGLANG_POLICIES
from resilience.telemetry import MetricsObserver, start_metrics_server
from resilience.testing import fast_policies
from resilience.testing.colocate import ColocateConfig, run_colocate
from resilience.testing.emulator import EmulatedFleet
from resilience.testing.faults import FaultPlan
from tests.promserver import get_json, poll, prometheus_server
from tests.sglang.conftest import FAST_ENGINE

RULES = Path(__file__).resolve().parents[2] / "grafana" / "rules" / "controlplane-resilience.rules.yml"
RUN = ColocateConfig(steps=6, seed=5, rollout_requests=1, stragglers=1, max_new_tokens=4, train_s=0.0)


def attempts_with_status(observer: MetricsObserver, status: str) -> float:
    """Sum of cpr_attempts_total samples with this status label, parsed from the exposition text."""
    text = generate_latest(observer.registry).decode()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "cpr_attempts_total" and sample.labels.get("status") == status
    )


def test_chaos_run_metrics_count_injected_502s_and_prometheus_scrapes_them(tmp_path: Path) -> None:
    """Under a seeded fault plan cpr_attempts_total{status="502"} equals the injected 502s; Prometheus scrapes them and loads the rules."""
    observer = MetricsObserver()
    server = start_metrics_server(0, registry=observer.registry)
    try:
        with prometheus_server(tmp_path, [f"127.0.0.1:{server.port}"], [RULES]) as (base, log):
            with EmulatedFleet(3, FAST_ENGINE, fault_plan=FaultPlan.seed_like(5)) as fleet:
                report = run_colocate(fleet, RUN, "ours", observers=[observer], policies=fast_policies(SGLANG_POLICIES))
                injected = sum(e.proxy.injected_count(502) for e in fleet.engines if e.proxy)
            assert report.failed_steps == 0 and injected > 0
            assert attempts_with_status(observer, "502") == injected
            # the counter itself, not increase(): with a fleet that starts in seconds the whole run can fall
            # between two scrapes, and increase() over one sample of a series is 0
            query = urllib.parse.urlencode({"query": 'sum(cpr_attempts_total{status="502"})'})

            def seen_502s() -> float | None:
                result = get_json(f"{base}/api/v1/query?{query}")["data"]["result"]
                value = float(result[0]["value"][1]) if result else 0.0
                return value if value == injected else None  # a scrape during the run saw fewer: wait for the next

            assert poll(seen_502s, f"the {injected} injected 502s in Prometheus", log) == injected
            groups = get_json(f"{base}/api/v1/rules")["data"]["groups"]
            assert {g["name"] for g in groups} == {"cpr-restart-budget", "cpr-control-plane", "cpr-engines"}
    finally:
        server.close()
