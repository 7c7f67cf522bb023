"""The Prometheus alert rules: promtool accepts them, their unit tests pass, and every alert is tested both ways."""

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from grafana_testlib import RULE_TESTS, RULES, load_generator, require_binary

EXPECTED_ALERTS = {
    "CPRRestartBudgetBurnFast": "page",
    "CPRRestartBudgetBurnSlow": "ticket",
    "CPRRestartBudgetExhausted": "page",
    "CPRRestartBudgetNearlyExhausted": "ticket",
    "CPRControlPlane502Rate": "ticket",
    "CPRBreakerOpen": "ticket",
    "CPRBarrierPhaseFailures": "ticket",
    "CPREngineQuarantined": "page",
    "CPREnginesNotServingAfterOnload": "page",
}


def _rules() -> list[dict[str, Any]]:
    data = yaml.safe_load(RULES.read_text(encoding="utf-8"))
    return [rule for group in data["groups"] for rule in group["rules"]]


def test_promtool_check_rules() -> None:
    """`promtool check rules` accepts the committed rule file."""
    promtool = require_binary("promtool")
    result = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(EXPECTED_ALERTS)} rules found" in result.stdout


@pytest.mark.parametrize("test_file", RULE_TESTS, ids=[path.name for path in RULE_TESTS])
def test_promtool_test_rules(test_file: Path) -> None:
    """`promtool test rules` passes for each unit-test file."""
    promtool = require_binary("promtool")
    result = subprocess.run(
        [promtool, "test", "rules", test_file.name], cwd=test_file.parent, capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_rule_files_are_tested() -> None:
    """There are unit-test files, and each loads the committed rule file."""
    assert len(RULE_TESTS) >= 2
    for path in RULE_TESTS:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
        assert [(path.parent / rule_file).resolve() for rule_file in data["rule_files"]] == [RULES.resolve()]


def test_every_alert_has_a_firing_and_a_silent_test() -> None:
    """Each alert has at least one promtool case where it fires and one where it stays silent."""
    firing: set[str] = set()
    silent: set[str] = set()
    for path in RULE_TESTS:
        for case in yaml.safe_load(path.read_text(encoding="utf-8"))["tests"]:
            for check in case.get("alert_rule_test", []):
                (firing if check.get("exp_alerts") else silent).add(check["alertname"])
    assert firing >= set(EXPECTED_ALERTS), sorted(set(EXPECTED_ALERTS) - firing)
    assert silent >= set(EXPECTED_ALERTS), sorted(set(EXPECTED_ALERTS) - silent)


def test_alerts_have_severity_for_and_annotations() -> None:
    """Every alert carries the expected severity, a `for:` duration, a summary and a description."""
    rules = _rules()
    assert {rule["alert"]: rule["labels"]["severity"] for rule in rules} == EXPECTED_ALERTS
    for rule in rules:
        assert rule["for"], rule["alert"]
        assert set(rule["annotations"]) == {"summary", "description"}, rule["alert"]
        assert all(text.strip() for text in rule["annotations"].values()), rule["alert"]


def test_rules_yaml_round_trips_the_generator_model() -> None:
    """The hand-emitted YAML parses back to exactly the generator's AlertRule values."""
    generator = load_generator()
    expected = [
        {
            "alert": rule.alert,
            "expr": rule.expr,
            "for": rule.for_,
            "labels": {"severity": rule.severity},
            "annotations": {"summary": rule.summary, "description": rule.description},
        }
        for group in generator.ALERT_GROUPS
        for rule in group.rules
    ]
    assert _rules() == expected


def test_burn_rate_alerts_use_the_sre_multiwindow_pairs() -> None:
    """Fast burn: 1h and 5m over 14.4; slow burn: 6h and 30m over 6; the budget gauges divide both sides."""
    exprs = {rule["alert"]: rule["expr"] for rule in _rules()}
    for alert, windows, threshold in (
        ("CPRRestartBudgetBurnFast", (("1h", 3600), ("5m", 300)), "14.4"),
        ("CPRRestartBudgetBurnSlow", (("6h", 21600), ("30m", 1800)), "6"),
    ):
        expr = exprs[alert]
        assert expr.count(f") > {threshold}") == 2
        for window, seconds in windows:
            assert f"increase(cpr_restarts_total[{window}])" in expr
            assert f"/ ({seconds} / cpr_restart_budget_planned_run_seconds)" in expr
        assert expr.count("/ cpr_restart_budget_limit") == 2


def test_missing_tool_skips_locally_and_fails_on_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    """A missing promtool/prometheus skips the test, unless CI=true, where it fails."""
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="not found"):
        require_binary("cpr-no-such-tool")
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI=true"):
        require_binary("cpr-no-such-tool")
