"""The generated dashboard: reproducible byte for byte, and structurally sound for Grafana 11.6."""

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from grafana_testlib import DASHBOARD, GENERATOR, REPO, RULES, SCRIPT, load_generator


def _dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    return data


def _panels() -> list[dict[str, Any]]:
    return [panel for panel in _dashboard()["panels"] if panel["type"] != "row"]


def test_regeneration_reproduces_the_committed_json(tmp_path: Path) -> None:
    """generate() writes exactly the committed dashboard JSON, byte for byte."""
    written = load_generator().generate(tmp_path)
    assert [path.name for path in written] == [DASHBOARD.name]
    assert written[0].read_bytes() == DASHBOARD.read_bytes()


def test_regeneration_reproduces_the_committed_rules(tmp_path: Path) -> None:
    """generate_rules() writes exactly the committed alert rules, byte for byte."""
    written = load_generator().generate_rules(tmp_path)
    assert [path.name for path in written] == [RULES.name]
    assert written[0].read_bytes() == RULES.read_bytes()


def test_generation_is_deterministic_and_sorted() -> None:
    """Two generations agree, and the JSON is key-sorted with a 2-space indent and one trailing newline."""
    generator = load_generator()
    text = generator.dashboard_json()
    assert text == generator.dashboard_json()
    assert text == json.dumps(json.loads(text), sort_keys=True, indent=2) + "\n"


def test_check_flag_passes_on_the_committed_files() -> None:
    """`python -m grafana.dashboard --check` exits 0 on the committed outputs and writes nothing."""
    before = DASHBOARD.stat().st_mtime_ns, RULES.stat().st_mtime_ns
    result = subprocess.run([*GENERATOR, "--check"], cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    assert (DASHBOARD.stat().st_mtime_ns, RULES.stat().st_mtime_ns) == before


def test_check_flag_fails_on_a_stale_copy(tmp_path: Path) -> None:
    """`--check` exits 1 and names the file when a dashboard differs from a fresh generation."""
    stale = tmp_path / DASHBOARD.name
    stale.write_text(DASHBOARD.read_text(encoding="utf-8").replace("502 rate per endpoint", "502s"), encoding="utf-8")
    args = [*GENERATOR, "--check", "--out", str(tmp_path), "--rules-out", str(RULES.parent)]
    result = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 1
    assert str(stale) in result.stderr


def test_cli_writes_both_files(tmp_path: Path) -> None:
    """`python grafana/generate.py`, run from another folder, writes the dashboard and the rules where --out/--rules-out say."""
    args = [sys.executable, str(SCRIPT), "--out", str(tmp_path / "d"), "--rules-out", str(tmp_path / "r")]
    result = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "d" / DASHBOARD.name).read_bytes() == DASHBOARD.read_bytes()
    assert (tmp_path / "r" / RULES.name).read_bytes() == RULES.read_bytes()


def test_dashboard_identity() -> None:
    """The dashboard has a stable uid, a title, tags and the Grafana 11.6 schema version."""
    dashboard = _dashboard()
    assert dashboard["uid"] == "controlplane-resilience"
    assert dashboard["title"]
    assert "controlplane-resilience" in dashboard["tags"]
    assert dashboard["schemaVersion"] == 41
    assert "id" not in dashboard  # importable into any Grafana instance


def test_datasource_variable_drives_every_panel_and_query() -> None:
    """A prometheus datasource variable exists and every panel and query uses it."""
    variables = {variable["name"]: variable for variable in _dashboard()["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    expected = {"type": "prometheus", "uid": "${datasource}"}
    for panel in _panels():
        assert panel["datasource"] == expected, panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == expected, panel["title"]
    for variable in variables.values():
        if variable["type"] == "query":
            assert variable["datasource"] == expected, variable["name"]


def test_every_panel_has_targets_with_expr_and_unique_ref_ids() -> None:
    """Every non-row panel has at least one target; each has a non-empty expr and a refId unique in its panel."""
    panels = _panels()
    assert len(panels) >= 15
    for panel in panels:
        targets = panel["targets"]
        assert targets, panel["title"]
        assert all(target["expr"].strip() for target in targets), panel["title"]
        ref_ids = [target["refId"] for target in targets]
        assert len(ref_ids) == len(set(ref_ids)) and all(ref_ids), panel["title"]


def test_panel_ids_are_unique() -> None:
    """Panel ids (rows included) are unique positive integers."""
    ids = [panel["id"] for panel in _dashboard()["panels"]]
    assert all(isinstance(panel_id, int) and panel_id > 0 for panel_id in ids)
    assert len(ids) == len(set(ids))


def test_grid_positions_fit_the_grid_and_do_not_overlap() -> None:
    """Every panel has a gridPos inside the 24-column grid, and no two panels overlap."""
    cells: dict[tuple[int, int], str] = {}
    for panel in _dashboard()["panels"]:
        grid = panel["gridPos"]
        assert set(grid) == {"h", "w", "x", "y"}, panel["title"]
        assert grid["h"] > 0 and grid["w"] > 0 and grid["x"] >= 0 and grid["y"] >= 0
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                assert (x, y) not in cells, f"{panel['title']} overlaps {cells[(x, y)]}"
                cells[(x, y)] = panel["title"]


def test_every_panel_has_a_title_description_and_unit() -> None:
    """Every non-row panel has a title, a description and an explicit unit."""
    for panel in _panels():
        assert panel["title"] and panel["description"], panel["id"]
        assert panel["fieldConfig"]["defaults"]["unit"], panel["title"]


def test_dashboard_covers_what_the_design_asks_for() -> None:
    """The required views exist: 502s per endpoint and engine, retries, latency, breakers, phases, restart budget."""
    exprs: dict[str, str] = {panel["title"]: " ".join(target["expr"] for target in panel["targets"]) for panel in _panels()}
    units = {panel["title"]: panel["fieldConfig"]["defaults"]["unit"] for panel in _panels()}

    def panel_with(*needles: str) -> str:
        found = [title for title, expr in exprs.items() if all(needle in expr for needle in needles)]
        assert found, needles
        return found[0]

    assert units[panel_with('status="502"', "sum by (endpoint)")] == "reqps"
    assert units[panel_with('status="502"', "sum by (engine)")] == "reqps"
    panel_with('status=~"5..|connect_error|read_timeout|connection_reset|error"', "sum by (endpoint, status)")
    panel_with('outcome="retried_success"', "deadline_exceeded", "circuit_open", "budget_exhausted", "ambiguous")
    latency = panel_with("histogram_quantile(0.5,", "histogram_quantile(0.99,", "cpr_attempt_duration_seconds_bucket")
    assert units[latency] == "s"
    assert units[panel_with("histogram_quantile(0.99,", "cpr_barrier_phase_duration_seconds_bucket", "phase")] == "s"
    panel_with("cpr_breaker_state")
    panel_with("cpr_barrier_phase_failures_total")
    panel_with("cpr_restart_budget_remaining")
    panel_with("sum by (cause) (cpr_restarts_total")
    burn = panel_with("offset 5m", "offset 30m", "offset 1h", "offset 6h", "cpr_restart_budget_planned_run_seconds")
    steps = next(panel for panel in _panels() if panel["title"] == burn)["fieldConfig"]["defaults"]["thresholds"]["steps"]
    assert [step["value"] for step in steps] == [None, 6, 14.4]


def test_breaker_states_are_mapped_to_names() -> None:
    """The breaker panel maps 0/1/2 to closed/half_open/open."""
    (panel,) = [panel for panel in _panels() if panel["type"] == "state-timeline" and "cpr_breaker_state" in panel["targets"][0]["expr"]]
    options = panel["fieldConfig"]["defaults"]["mappings"][0]["options"]
    assert {value: option["text"] for value, option in options.items()} == {"0": "closed", "1": "half_open", "2": "open"}


def test_engine_states_are_mapped_to_every_state_word() -> None:
    """The engine-state timeline maps one number to each cpr_engine_state word the exporter publishes, and its query
    turns every one of those words into its number."""
    from resilience.telemetry.engine_state import ENGINE_STATES

    (panel,) = [panel for panel in _panels() if panel["type"] == "state-timeline" and "cpr_engine_state" in panel["targets"][0]["expr"]]
    options = panel["fieldConfig"]["defaults"]["mappings"][0]["options"]
    texts = {option["text"] for option in options.values()}
    assert texts and texts == set(ENGINE_STATES)
    expr = panel["targets"][0]["expr"]
    for value, option in options.items():
        assert f'state="{option["text"]}"}} > 0) * {value}' in expr, option
