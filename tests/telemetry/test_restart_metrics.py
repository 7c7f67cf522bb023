"""cpr_restarts_total and cpr_restart_budget_* come from the RestartBudget's persisted record."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from resilience.barrier.journal import RestartBudget
from resilience.telemetry.metrics import MetricsObserver

ROOT = Path(__file__).resolve().parents[2]

CHILD = textwrap.dedent(
    """
    import sys
    from prometheus_client import generate_latest
    from resilience.barrier.journal import RestartBudget
    from resilience.telemetry.metrics import MetricsObserver

    observer = MetricsObserver()
    budget = RestartBudget(3, path=sys.argv[1], planned_run_seconds=3600, observers=[observer])
    observer.publish_restart_budget(budget)
    budget.record("nccl_timeout", step=300)
    sys.stdout.write(generate_latest(observer.registry).decode())
    """
)


def restart_samples(text: str) -> dict[str, float | dict[str, float]]:
    """cpr_restarts_total by cause, and the three budget gauges, from an exposition."""
    out: dict[str, float | dict[str, float]] = {}
    causes: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "cpr_restarts_total":
                causes[s.labels["cause"]] = s.value
            elif s.name.startswith("cpr_restart_budget_"):
                out[s.name] = s.value
    out["cpr_restarts_total"] = causes
    return out


def test_new_process_publishes_the_runs_true_count(tmp_path: Path) -> None:
    """Two restarts recorded here, a third in a fresh process on the same file: that process publishes 3 and 0 left."""
    path = tmp_path / "restarts.json"
    budget = RestartBudget(3, path=path, planned_run_seconds=3600)
    budget.record("oom", step=100)
    budget.record("oom", step=200)
    here = restart_samples(generate_latest(MetricsObserver(restart_budget=budget).registry).decode())
    assert here["cpr_restarts_total"] == {"oom": 2}
    assert here["cpr_restart_budget_remaining"] == 1

    child = subprocess.run(
        [sys.executable, "-c", CHILD, str(path)],
        capture_output=True, text=True, timeout=60, check=False, cwd=ROOT,
    )  # fmt: skip
    assert child.returncode == 0, child.stderr
    there = restart_samples(child.stdout)
    causes = there["cpr_restarts_total"]
    assert isinstance(causes, dict) and sum(causes.values()) == 3
    assert causes == {"oom": 2, "nccl_timeout": 1}
    assert there["cpr_restart_budget_limit"] == 3
    assert there["cpr_restart_budget_remaining"] == 0
    assert there["cpr_restart_budget_planned_run_seconds"] == 3600


def test_no_budget_publishes_nothing_and_can_be_detached(tmp_path: Path) -> None:
    """Without a budget no restart series exist; publish_restart_budget(None) stops publishing."""
    obs = MetricsObserver()
    assert "cpr_restart" not in generate_latest(obs.registry).decode()
    obs.publish_restart_budget(RestartBudget(2, path=tmp_path / "b.json"))
    text = generate_latest(obs.registry).decode()
    assert "cpr_restart_budget_remaining 2.0" in text
    assert "cpr_restarts_total{" not in text  # no restart yet: no cause series
    obs.publish_restart_budget(None)
    assert "cpr_restart" not in generate_latest(obs.registry).decode()
