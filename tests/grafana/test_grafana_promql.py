"""Every PromQL expression in the dashboard and the rules names only contract metrics, and parses."""

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from grafana_testlib import (
    AGGREGATORS,
    CONTRACT,
    DASHBOARD,
    FUNCTIONS,
    GRAFANA_VARIABLE,
    RULES,
    exposed_series_names,
    metric_names,
    promql_tokens,
    require_binary,
    substitute_grafana_variables,
)

from grafana.dashboard.external import SMG_METRICS


def _dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    return data


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title / refId, expr) for every query of every panel."""
    return [
        (f"{panel['title']} / {target['refId']}", target["expr"]) for panel in _dashboard()["panels"] for target in panel.get("targets", [])
    ]


def rule_queries() -> list[tuple[str, str]]:
    """(alert name, expr) for every rule in the committed rules file."""
    data = yaml.safe_load(RULES.read_text(encoding="utf-8"))
    return [(rule["alert"], rule["expr"]) for group in data["groups"] for rule in group["rules"]]


@pytest.mark.parametrize(
    ("expr", "metrics", "calls"),
    [
        ('sum by (endpoint) (rate(cpr_attempts_total{status="502"}[5m]))', {"cpr_attempts_total"}, {"sum", "rate"}),
        ("a unless a offset 1h and ignoring (cause) (b offset 1h) or c", {"a", "b", "c"}, set()),
        ("histogram_quantile(0.99, sum by (le) (rate(x_bucket[5m])))", {"x_bucket"}, {"histogram_quantile", "sum", "rate"}),
        ('x{l="by (y) z", m=~"$job"} > 14.4', {"x"}, set()),
        ("sum without (cause, job) (y[1h30m:1m]) / on (job) group_left (le) z", {"y", "z"}, {"sum"}),
        ("2 * 1e3 + 0x1F - .5", set(), set()),
        ("up == bool 1 # a comment naming not_a_metric", {"up"}, set()),
        ("count (q) by (job)", {"q"}, {"count"}),
    ],
)
def test_tokenizer_finds_metric_names(expr: str, metrics: set[str], calls: set[str]) -> None:
    """The tokenizer returns selected metric names and called functions, never labels, keywords or durations."""
    assert promql_tokens(expr) == (metrics, calls)


def test_dashboard_names_only_contract_metrics() -> None:
    """Every dashboard query selects only metrics (or histogram series) of the metric contract, or the smg gateway's
    series its row names (``grafana.dashboard.external``; ``tests/smg/test_smg_metrics.py`` reads them from a real smg)."""
    allowed = exposed_series_names() | SMG_METRICS
    queries = dashboard_queries()
    assert queries
    for where, expr in queries:
        names = metric_names(expr)
        assert names, f"{where}: no metric in {expr!r}"
        assert names <= allowed, f"{where}: {sorted(names - allowed)} not in the metric contract"


def test_rules_name_only_contract_metrics() -> None:
    """Every alert expression selects only metrics of the metric contract."""
    allowed = exposed_series_names()
    for alert, expr in rule_queries():
        names = metric_names(expr)
        assert names, alert
        assert names <= allowed, f"{alert}: {sorted(names - allowed)} not in the metric contract"


def test_every_call_is_a_promql_function() -> None:
    """Every identifier used as a call is a real PromQL function or aggregation (no typos)."""
    for where, expr in dashboard_queries() + rule_queries():
        calls = promql_tokens(expr)[1]
        assert calls <= FUNCTIONS | AGGREGATORS, f"{where}: unknown {sorted(calls - FUNCTIONS - AGGREGATORS)}"


def test_histograms_are_read_through_buckets() -> None:
    """Histograms are read only as _bucket series under histogram_quantile."""
    for where, expr in dashboard_queries() + rule_queries():
        for name in metric_names(expr):
            base = name.removesuffix("_bucket")
            if CONTRACT.get(base, ("", frozenset()))[0] == "histogram":
                assert "histogram_quantile" in expr and name.endswith("_bucket"), where


def test_variable_queries_name_contract_metrics_and_labels() -> None:
    """The dashboard's label_values() variables read contract metrics and labels they carry (or job)."""
    for variable in _dashboard()["templating"]["list"]:
        if variable["type"] != "query":
            continue
        metric, label = (part.strip() for part in variable["query"].removeprefix("label_values(").removesuffix(")").split(","))
        assert metric in CONTRACT, variable["name"]
        assert label == "job" or label in CONTRACT[metric][1], variable["name"]


def test_dashboard_variables_used_in_queries_are_defined() -> None:
    """Every $variable a query uses is a dashboard variable or a Grafana built-in."""
    defined = {variable["name"] for variable in _dashboard()["templating"]["list"]}
    for where, expr in dashboard_queries():
        for match in GRAFANA_VARIABLE.finditer(expr):
            name = match.group(1) or match.group(2)
            assert name in defined or name.startswith("__"), f"{where}: ${name} undefined"


def test_promtool_parses_every_dashboard_query(tmp_path: Path) -> None:
    """promtool accepts each dashboard query (Grafana variables substituted) as a recording rule."""
    promtool = require_binary("promtool")
    rules = [
        {"record": f"cpr_dashboard_check:query_{index}", "expr": substitute_grafana_variables(expr)}
        for index, (_where, expr) in enumerate(dashboard_queries())
    ]
    path = tmp_path / "dashboard-queries.rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard-queries", "rules": rules}]}), encoding="utf-8")
    result = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(rules)} rules found" in result.stdout


def test_promtool_rejects_a_broken_query(tmp_path: Path) -> None:
    """The promtool parse check is real: an unbalanced query fails it."""
    promtool = require_binary("promtool")
    path = tmp_path / "broken.rules.yml"
    broken = {"record": "cpr_dashboard_check:broken", "expr": "sum(rate(cpr_attempts_total[5m])"}
    path.write_text(yaml.safe_dump({"groups": [{"name": "broken", "rules": [broken]}]}), encoding="utf-8")
    result = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode != 0
