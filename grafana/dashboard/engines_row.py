"""The engines row: what the barrier knows of each engine over time, how many are in each state, their weight
versions and the journal's commit latency (``cpr_engine_state``, ``cpr_engine_weight_version``,
``cpr_journal_commit_duration_seconds``: telemetry/engine_state.py, telemetry/journal_timing.py)."""

from grafana_foundation_sdk.builders import dashboard as dashboard_builders
from grafana_foundation_sdk.builders import statetimeline
from grafana_foundation_sdk.models import common, units
from grafana_foundation_sdk.models import dashboard as dashboard_models

from grafana.dashboard.panels import DATASOURCE, ENGINE, JOB, RATE, PanelIds, query, thresholds, timeseries_panel
from grafana.dashboard.promql import ENGINE_STATE_CODES, engine_state_code

__all__ = ["engines_row"]


def engines_row(builder: dashboard_builders.Dashboard, ids: PanelIds) -> dashboard_builders.Dashboard:
    """Row 7: each engine's state over time, engines per state, weight versions, journal commit latency."""
    codes = {state: code for state, code, _ in ENGINE_STATE_CODES}
    builder = builder.with_row(dashboard_builders.Row("Engines").id(ids()))
    builder = builder.with_panel(
        statetimeline.Panel()
        .id(ids())
        .title("Engine state over time")
        .description(
            "cpr_engine_state: what the barrier knows of each engine, read from the orchestrator at every scrape "
            "(serving, paused, flushed, released, in_flight, joining, unknown, unsettled, quarantined, fenced, dead, retired). "
            "Quarantined engines need reconcile or retire, fenced ones add or retire; engine=other folds the engines past "
            "the label bound."
        )
        .datasource(DATASOURCE)
        .with_target(query(engine_state_code([JOB, ENGINE]), "{{engine}}", "A"))
        .unit(units.NoUnit)
        .height(8)
        .span(12)
        .mappings(
            [
                dashboard_models.ValueMap(
                    options={
                        str(code): dashboard_models.ValueMappingResult(text=state, color=colour, index=i)
                        for i, (state, code, colour) in enumerate(ENGINE_STATE_CODES)
                    }
                )
            ]
        )
        .thresholds(thresholds((None, "green"), (1, "blue"), (codes["quarantined"], "red")))
        .show_value(common.VisibilityMode.AUTO)
        .merge_values(True)
    )
    builder = builder.with_panel(
        timeseries_panel(
            ids,
            "Engines by state",
            "How many engines the barrier knows in each state (sum of cpr_engine_state by state).",
            units.Short,
            [query(f"sum by (state) (cpr_engine_state{{{JOB}, {ENGINE}}})", "{{state}}", "A")],
            span=4,
        )
    )
    builder = builder.with_panel(
        timeseries_panel(
            ids,
            "Engines by weight version",
            "cpr_engine_weight_version: how many engines last reported each weight version to the barrier "
            "(read by WeightVersionCheck after an onload or a weight sync).",
            units.Short,
            [query(f"count by (version) (cpr_engine_weight_version{{{JOB}, {ENGINE}}})", "{{version}}", "A")],
            span=4,
        )
    )
    builder = builder.with_panel(
        timeseries_panel(
            ids,
            "Journal commit latency p50 / p99",
            "histogram_quantile over cpr_journal_commit_duration_seconds: one durable journal write (append: a commit, "
            "rewrite: a compaction). Every barrier phase waits for its commit.",
            units.Seconds,
            [
                query(
                    f"histogram_quantile({q}, sum by (op, le) (rate(cpr_journal_commit_duration_seconds_bucket{{{JOB}}}{RATE})))",
                    f"{{{{op}}}} p{name}",
                    ref,
                )
                for ref, q, name in (("A", "0.5", "50"), ("B", "0.99", "99"))
            ],
            span=4,
        )
    )
    return builder
