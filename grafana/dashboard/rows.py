"""The dashboard's rows, one function each: ``row(builder, ids)`` adds a row and its panels and returns the builder."""

from grafana_foundation_sdk.builders import bargauge, stat, statetimeline
from grafana_foundation_sdk.builders import common as common_builders
from grafana_foundation_sdk.builders import dashboard as dashboard_builders
from grafana_foundation_sdk.models import common, units
from grafana_foundation_sdk.models import dashboard as dashboard_models

from grafana.dashboard.engines_row import engines_row
from grafana.dashboard.panels import DATASOURCE, ENDPOINT, ENGINE, JOB, RATE, PanelIds, last_value, query, thresholds, timeseries_panel
from grafana.dashboard.promql import FAILURE_STATUS_RE, FAST_BURN, SLOW_BURN, SURFACED_OUTCOMES, burn_rate
from grafana.dashboard.smg_row import smg_row

__all__ = ["ROWS", "barrier_row", "breakers_row", "failures_row", "latency_row", "restart_budget_row", "retries_row"]


def restart_budget_row(builder: dashboard_builders.Dashboard, ids: PanelIds) -> dashboard_builders.Dashboard:
    """Row 1: the restart budget (what a page is about)."""
    builder = builder.with_row(dashboard_builders.Row("Restart budget").id(ids()))
    builder = builder.with_panel(
        stat.Panel()
        .id(ids())
        .title("Restarts remaining")
        .description("cpr_restart_budget_remaining: global restarts the run may still take. 0 = the next failure ends the run.")
        .datasource(DATASOURCE)
        .with_target(query(f"min by (job) (cpr_restart_budget_remaining{{{JOB}}})", "{{job}}", "A", instant=True))
        .unit(units.Short)
        .decimals(0)
        .height(6)
        .span(4)
        .color_mode(common.BigValueColorMode.BACKGROUND)
        .graph_mode(common.BigValueGraphMode.NONE)
        .reduce_options(last_value())
        .thresholds(thresholds((None, "red"), (1, "orange"), (2, "green")))
    )
    builder = builder.with_panel(
        stat.Panel()
        .id(ids())
        .title("Restart limit")
        .description("cpr_restart_budget_limit: restarts the run may take in all (e.g. max_global_restart=3).")
        .datasource(DATASOURCE)
        .with_target(query(f"max by (job) (cpr_restart_budget_limit{{{JOB}}})", "{{job}}", "A", instant=True))
        .unit(units.Short)
        .decimals(0)
        .height(6)
        .span(4)
        .color_mode(common.BigValueColorMode.NONE)
        .graph_mode(common.BigValueGraphMode.NONE)
        .reduce_options(last_value())
    )
    builder = builder.with_panel(
        bargauge.Panel()
        .id(ids())
        .title("Restarts by cause (whole run)")
        .description("cpr_restarts_total by cause, read from the budget's persisted record: every restart of the run.")
        .datasource(DATASOURCE)
        .with_target(query(f"sum by (cause) (cpr_restarts_total{{{JOB}}})", "{{cause}}", "A", instant=True))
        .unit(units.Short)
        .decimals(0)
        .min(0)
        .height(6)
        .span(4)
        .orientation(common.VizOrientation.HORIZONTAL)
        .reduce_options(last_value())
        .thresholds(thresholds((None, "orange")))
    )
    burn_targets = [
        query(burn_rate(label, seconds, (JOB,)), f"{{{{job}}}} {label}", ref)
        for ref, (label, seconds) in zip("ABCD", (FAST_BURN[1], SLOW_BURN[1], FAST_BURN[0], SLOW_BURN[0]), strict=True)
    ]
    builder = builder.with_panel(
        timeseries_panel(
            ids,
            "Restart-budget burn rate",
            "(restarts in window / limit) / (window / planned run length). 1 = on pace to use exactly the whole "
            "budget by the planned end. Pages when 1h and 5m both exceed 14.4; tickets when 6h and 30m both exceed 6.",
            units.NoUnit,
            burn_targets,
        )
        .thresholds(thresholds((None, "green"), (6, "orange"), (14.4, "red")))
        .thresholds_style(common_builders.GraphThresholdsStyleConfig().mode(common.GraphThresholdsStyleMode.LINE))
    )
    return builder


def failures_row(builder: dashboard_builders.Dashboard, ids: PanelIds) -> dashboard_builders.Dashboard:
    """Row 2: control-plane 502s and other failures (Bug A)."""
    failure_status = f'status=~"{FAILURE_STATUS_RE}"'
    builder = builder.with_row(dashboard_builders.Row("Control-plane failures").id(ids()))
    builder = builder.with_panel(
        timeseries_panel(
            ids,
            "502 rate per endpoint",
            "Attempts answered 502 Bad Gateway, per endpoint template (all engines).",
            units.RequestsPerSecond,
            [
                query(
                    f'sum by (endpoint) (rate(cpr_attempts_total{{{JOB}, {ENDPOINT}, {ENGINE}, status="502"}}{RATE}))',
                    "{{endpoint}}",
                    "A",
                )
            ],
        )
    )
    builder = builder.with_panel(
        timeseries_panel(
            ids,
            "502 rate per engine",
            "Attempts answered 502 Bad Gateway, per engine (scheme://host:port).",
            units.RequestsPerSecond,
            [
                query(
                    f'sum by (engine) (rate(cpr_attempts_total{{{JOB}, {ENDPOINT}, {ENGINE}, status="502"}}{RATE}))',
                    "{{engine}}",
                    "A",
                )
            ],
        )
    )
    builder = builder.with_panel(
        timeseries_panel(
            ids,
            "5xx and transport failures per endpoint",
            "Failed attempts per endpoint and status: any 5xx plus connect_error, read_timeout, connection_reset, error.",
            units.RequestsPerSecond,
            [
                query(
                    f"sum by (endpoint, status) (rate(cpr_attempts_total{{{JOB}, {ENDPOINT}, {ENGINE}, {failure_status}}}{RATE}))",
                    "{{endpoint}} {{status}}",
                    "A",
                )
            ],
            span=24,
        )
    )
    return builder


def retries_row(builder: dashboard_builders.Dashboard, ids: PanelIds) -> dashboard_builders.Dashboard:
    """Row 3: retries."""
    surfaced = f'outcome=~"{"|".join(SURFACED_OUTCOMES)}"'
    builder = builder.with_row(dashboard_builders.Row("Retries").id(ids()))
    builder = builder.with_panel(
        timeseries_panel(
            ids,
            "Retries absorbed vs surfaced",
            "Logical calls that succeeded after retrying (absorbed) against calls that reached the caller as an "
            "error (surfaced, by outcome). A surfaced failure on a hot-path endpoint is what used to trigger a "
            "global restart.",
            units.RequestsPerSecond,
            [
                query(
                    f'sum(rate(cpr_requests_total{{{JOB}, {ENDPOINT}, outcome="retried_success"}}{RATE}))',
                    "absorbed (retried_success)",
                    "A",
                ),
                query(
                    f"sum by (outcome) (rate(cpr_requests_total{{{JOB}, {ENDPOINT}, {surfaced}}}{RATE}))",
                    "surfaced: {{outcome}}",
                    "B",
                ),
            ],
        )
    )
    builder = builder.with_panel(
        timeseries_panel(
            ids,
            "Retries by reason",
            "Retries scheduled, per endpoint and reason.",
            units.OpsPerSecond,
            [
                query(
                    f"sum by (endpoint, reason) (rate(cpr_retries_total{{{JOB}, {ENDPOINT}}}{RATE}))",
                    "{{endpoint}} {{reason}}",
                    "A",
                )
            ],
        )
    )
    builder = builder.with_panel(
        timeseries_panel(
            ids,
            "Retry-budget tokens per engine",
            "Tokens left in each engine's retry budget; under 1 no retry is allowed.",
            units.Short,
            [query(f"min by (engine) (cpr_retry_budget_tokens{{{JOB}, {ENGINE}}})", "{{engine}}", "A")],
        )
    )
    builder = builder.with_panel(
        timeseries_panel(
            ids,
            "Retry budget exhausted",
            "Retries refused because the engine's retry budget was empty.",
            units.OpsPerSecond,
            [
                query(
                    f"sum by (engine) (rate(cpr_retry_budget_exhausted_total{{{JOB}, {ENDPOINT}, {ENGINE}}}{RATE}))",
                    "{{engine}}",
                    "A",
                )
            ],
        )
    )
    return builder


def latency_row(builder: dashboard_builders.Dashboard, ids: PanelIds) -> dashboard_builders.Dashboard:
    """Row 4: latency."""
    builder = builder.with_row(dashboard_builders.Row("Latency").id(ids()))
    builder = builder.with_panel(
        timeseries_panel(
            ids,
            "Attempt latency p50 / p99 per endpoint",
            "histogram_quantile over cpr_attempt_duration_seconds (each attempt, not the whole logical call).",
            units.Seconds,
            [
                query(
                    f"histogram_quantile({q}, sum by (endpoint, le) "
                    f"(rate(cpr_attempt_duration_seconds_bucket{{{JOB}, {ENDPOINT}}}{RATE})))",
                    f"{{{{endpoint}}}} p{name}",
                    ref,
                )
                for ref, q, name in (("A", "0.5", "50"), ("B", "0.99", "99"))
            ],
            span=24,
        )
    )
    return builder


def breakers_row(builder: dashboard_builders.Dashboard, ids: PanelIds) -> dashboard_builders.Dashboard:
    """Row 5: circuit breakers."""
    builder = builder.with_row(dashboard_builders.Row("Circuit breakers").id(ids()))
    builder = builder.with_panel(
        statetimeline.Panel()
        .id(ids())
        .title("Breaker state per engine")
        .description("cpr_breaker_state: 0 closed, 1 half_open, 2 open (calls fail fast with CircuitOpen).")
        .datasource(DATASOURCE)
        .with_target(query(f"max by (engine) (cpr_breaker_state{{{JOB}, {ENGINE}}})", "{{engine}}", "A"))
        .unit(units.NoUnit)
        .height(8)
        .span(12)
        .mappings(
            [
                dashboard_models.ValueMap(
                    options={
                        "0": dashboard_models.ValueMappingResult(text="closed", color="green", index=0),
                        "1": dashboard_models.ValueMappingResult(text="half_open", color="yellow", index=1),
                        "2": dashboard_models.ValueMappingResult(text="open", color="red", index=2),
                    }
                )
            ]
        )
        .thresholds(thresholds((None, "green"), (1, "yellow"), (2, "red")))
        .show_value(common.VisibilityMode.AUTO)
        .merge_values(True)
    )
    builder = builder.with_panel(
        timeseries_panel(
            ids,
            "Breaker rejections per engine",
            "Calls refused by an open breaker.",
            units.RequestsPerSecond,
            [
                query(
                    f"sum by (engine) (rate(cpr_breaker_rejections_total{{{JOB}, {ENDPOINT}, {ENGINE}}}{RATE}))",
                    "{{engine}}",
                    "A",
                )
            ],
        )
    )
    return builder


def barrier_row(builder: dashboard_builders.Dashboard, ids: PanelIds) -> dashboard_builders.Dashboard:
    """Row 6: barrier phases."""
    builder = builder.with_row(dashboard_builders.Row("Barrier").id(ids()))
    builder = builder.with_panel(
        timeseries_panel(
            ids,
            "Barrier phase duration p50 / p99",
            "histogram_quantile over cpr_barrier_phase_duration_seconds by phase.",
            units.Seconds,
            [
                query(
                    f"histogram_quantile({q}, sum by (phase, le) (rate(cpr_barrier_phase_duration_seconds_bucket{{{JOB}}}{RATE})))",
                    f"{{{{phase}}}} p{name}",
                    ref,
                )
                for ref, q, name in (("A", "0.5", "50"), ("B", "0.99", "99"))
            ],
        )
    )
    builder = builder.with_panel(
        timeseries_panel(
            ids,
            "Barrier phase failures",
            "Engines that failed a barrier phase (one per failed engine), by transition and phase.",
            units.Short,
            [
                query(
                    f"sum by (transition, phase) (increase(cpr_barrier_phase_failures_total{{{JOB}}}{RATE}))",
                    "{{transition}} {{phase}}",
                    "A",
                )
            ],
        )
    )
    builder = builder.with_panel(
        timeseries_panel(
            ids,
            "Barrier transitions by result",
            "Barrier transitions ended, by transition and result (ok / failed).",
            units.Short,
            [
                query(
                    f"sum by (transition, result) (increase(cpr_barrier_transitions_total{{{JOB}}}{RATE}))",
                    "{{transition}} {{result}}",
                    "A",
                )
            ],
        )
    )
    builder = builder.with_panel(
        timeseries_panel(
            ids,
            "Engines held paused",
            "Holds on each engine (the barrier keeps an engine paused while it holds it).",
            units.Short,
            [query(f"max by (engine) (cpr_engines_held_paused{{{JOB}, {ENGINE}}})", "{{engine}}", "A")],
        )
    )
    return builder


ROWS = (restart_budget_row, failures_row, retries_row, latency_row, breakers_row, barrier_row, engines_row, smg_row)
"""The rows top to bottom; panel ids are handed out in this order."""
