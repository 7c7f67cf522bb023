"""Generate the controlplane-resilience Grafana dashboard and Prometheus alert rules.

Both artefacts are built from one set of PromQL builders below, so the
restart-budget burn rate drawn on the dashboard is exactly the expression the
alerts page on. The outputs are committed; regenerate and check with::

    python grafana/generate.py            # rewrite grafana/dashboards/*.json and grafana/rules/*.rules.yml
    python grafana/generate.py --check    # exit 1 when a committed file differs from a fresh generation
    python grafana/generate.py --out DIR  # write the dashboard JSON into DIR (rules: --rules-out DIR)

The module imports nothing from the repository (only ``grafana-foundation-sdk``
and the standard library) so that it runs from a bare checkout and can be
loaded by file path (``cpr dashboards``). Every metric it names is in the
metric contract of DESIGN.md (Telemetry); ``tests/grafana`` checks that.

Output is deterministic: JSON with sorted keys and a fixed indent, YAML emitted
by hand in a fixed order, both ending in one newline.
"""

import argparse
import difflib
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from grafana_foundation_sdk.builders import bargauge, prometheus, stat, statetimeline, timeseries
from grafana_foundation_sdk.builders import common as common_builders
from grafana_foundation_sdk.builders import dashboard as dashboard_builders
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common, units
from grafana_foundation_sdk.models import dashboard as dashboard_models

__all__ = [
    "ALERT_GROUPS",
    "DASHBOARD_FILENAME",
    "DASHBOARD_UID",
    "DEFAULT_DASHBOARD_DIR",
    "DEFAULT_RULES_DIR",
    "RULES_FILENAME",
    "AlertRule",
    "AlertGroup",
    "build_dashboard",
    "burn_rate",
    "dashboard_json",
    "generate",
    "generate_rules",
    "main",
    "restarts_in_window",
    "rules_yaml",
]

HERE = Path(__file__).resolve().parent
DEFAULT_DASHBOARD_DIR = HERE / "dashboards"
"""Where ``generate()`` writes the dashboard by default (the committed copy)."""
DEFAULT_RULES_DIR = HERE / "rules"
"""Where ``generate_rules()`` writes the alert rules by default (the committed copy)."""
DASHBOARD_FILENAME = "controlplane-resilience.json"
RULES_FILENAME = "controlplane-resilience.rules.yml"
DASHBOARD_UID = "controlplane-resilience"

# --------------------------------------------------------------------------
# PromQL builders (shared by the dashboard and the alert rules)
# --------------------------------------------------------------------------

#: ``cpr_requests_total`` outcomes that reach the caller as an error: what retries did not absorb.
SURFACED_OUTCOMES = ("failed", "ambiguous", "deadline_exceeded", "circuit_open", "budget_exhausted")
#: ``cpr_attempts_total`` statuses that count as "5xx or transport failure".
FAILURE_STATUS_RE = "5..|connect_error|read_timeout|connection_reset|error"

#: The SRE workbook's multiwindow, multi-burn-rate pairs: (long window, short window, threshold).
FAST_BURN = (("1h", 3600), ("5m", 300), 14.4)
SLOW_BURN = (("6h", 21600), ("30m", 1800), 6.0)


def selector(metric: str, matchers: Sequence[str] = ()) -> str:
    """``metric{m1, m2}``, or the bare name when there are no matchers."""
    return f"{metric}{{{', '.join(matchers)}}}" if matchers else metric


def _indent(text: str, by: int) -> str:
    pad = " " * by
    return "\n".join(pad + line if line else line for line in text.splitlines())


def compact(expr: str) -> str:
    """Fold a multi-line expression onto one line (the expressions hold no quoted whitespace)."""
    return " ".join(expr.split()).replace("( ", "(").replace(" )", ")")


def restarts_in_window(window: str, matchers: Sequence[str] = ()) -> str:
    """Restarts recorded in the last ``window``, per scrape target (``cause`` summed away).

    ``cpr_restarts_total`` comes from the RestartBudget's persisted record, so
    a cause's series is *born* at 1 when its first restart is recorded;
    ``increase()`` cannot see a series' first sample, so it alone would miss
    the first restart of every cause. A series absent ``window`` ago
    contributes its whole value instead, but only when the budget gauge of
    the same target was already scraped then: a Prometheus that has just
    started must not read a run's old restarts as a burst.
    """
    restarts = selector("cpr_restarts_total", matchers)
    limit = selector("cpr_restart_budget_limit", matchers)
    return (
        "sum without (cause) (\n"
        "    (\n"
        f"        ({restarts} unless {restarts} offset {window})\n"
        "      and ignoring (cause)\n"
        f"        ({limit} offset {window})\n"
        "    )\n"
        "  or\n"
        f"    increase({restarts}[{window}])\n"
        ")"
    )


def burn_rate(window: str, seconds: int, matchers: Sequence[str] = ()) -> str:
    """Restart-budget burn rate over ``window``: budget fraction used / run fraction elapsed.

    burn = (restarts in window / cpr_restart_budget_limit)
           / (window seconds / cpr_restart_budget_planned_run_seconds)

    1 means the run would use exactly its whole budget by its planned end.
    Both sides keep the target labels (``job``, ``instance``) so that two runs
    scraped by one Prometheus never mix; the gauges carry no other label.
    """
    limit = selector("cpr_restart_budget_limit", matchers)
    planned = selector("cpr_restart_budget_planned_run_seconds", matchers)
    return f"(\n{_indent(restarts_in_window(window, matchers), 4)}\n  / {limit}\n)\n/ ({seconds} / {planned})"


def _multiwindow(long: tuple[str, int], short: tuple[str, int], threshold: float) -> str:
    return f"(\n{_indent(burn_rate(*long), 2)}\n) > {threshold:g}\nand\n(\n{_indent(burn_rate(*short), 2)}\n) > {threshold:g}"


def _counter_events(metric: str, window: str, by: str) -> str:
    """Events counted by ``metric`` in ``window``, a born series counting its whole value."""
    return f"sum by ({by}) (\n    ({metric} unless {metric} offset {window})\n  or\n    increase({metric}[{window}])\n)"


# --------------------------------------------------------------------------
# Alert rules
# --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AlertRule:
    """One Prometheus alerting rule."""

    alert: str
    expr: str
    """PromQL; may span lines (emitted as a YAML literal block)."""
    for_: str
    """How long the expression must hold before the alert fires ("0m" = at once)."""
    severity: str
    """``page`` (act now: the run is at risk) or ``ticket`` (look today: a cause, absorbed so far)."""
    summary: str
    description: str


@dataclass(frozen=True, slots=True)
class AlertGroup:
    """A named rule group evaluated together."""

    name: str
    rules: tuple[AlertRule, ...]


ALERT_GROUPS: tuple[AlertGroup, ...] = (
    AlertGroup(
        "cpr-restart-budget",
        (
            AlertRule(
                alert="CPRRestartBudgetBurnFast",
                expr=_multiwindow(*FAST_BURN),
                for_="2m",
                severity="page",
                summary="Restart budget burning fast on {{ $labels.job }} ({{ $value | humanize }}x over 1h)",
                description=(
                    "Global restarts on {{ $labels.job }}/{{ $labels.instance }} are consuming the restart budget "
                    "{{ $value | humanize }} times faster than the planned run length allows (burn > 14.4 over "
                    "both 1h and 5m). At this pace the run fails once cpr_restart_budget_remaining reaches 0. "
                    "See cpr_restarts_total by cause; control-plane 502s (Bug A) are one known cause."
                ),
            ),
            AlertRule(
                alert="CPRRestartBudgetBurnSlow",
                expr=_multiwindow(*SLOW_BURN),
                for_="15m",
                severity="ticket",
                summary="Restart budget burning steadily on {{ $labels.job }} ({{ $value | humanize }}x over 6h)",
                description=(
                    "Global restarts on {{ $labels.job }}/{{ $labels.instance }} are consuming the restart budget "
                    "{{ $value | humanize }} times faster than the planned run length allows (burn > 6 over both "
                    "6h and 30m). Find the restart causes before the budget runs out."
                ),
            ),
            AlertRule(
                alert="CPRRestartBudgetExhausted",
                expr="cpr_restart_budget_remaining <= 0",
                for_="1m",
                severity="page",
                summary="Restart budget exhausted on {{ $labels.job }}",
                description=(
                    "{{ $labels.job }}/{{ $labels.instance }} has no global restarts left "
                    "(cpr_restart_budget_remaining = {{ $value }}): the next actor failure ends the run."
                ),
            ),
            AlertRule(
                alert="CPRRestartBudgetNearlyExhausted",
                expr="cpr_restart_budget_remaining == 1 and cpr_restart_budget_limit > 1",
                for_="1m",
                severity="ticket",
                summary="One global restart left on {{ $labels.job }}",
                description=("{{ $labels.job }}/{{ $labels.instance }} has one global restart left; the restart after next ends the run."),
            ),
        ),
    ),
    AlertGroup(
        "cpr-control-plane",
        (
            AlertRule(
                alert="CPRControlPlane502Rate",
                expr='sum by (job, endpoint) (rate(cpr_attempts_total{status="502"}[5m])) > 0.01',
                for_="10m",
                severity="ticket",
                summary="Sustained 502s on {{ $labels.endpoint }}",
                description=(
                    "{{ $labels.endpoint }} attempts on {{ $labels.job }} get 502 Bad Gateway at "
                    '{{ printf "%.3f" $value }}/s (over 0.01/s for 10m). Retries absorb isolated 502s; a sustained '
                    "rate means the engines' HTTP front end keeps failing to hand requests to the scheduler "
                    "(e.g. during memory offload/onload) and retries may soon run out."
                ),
            ),
            AlertRule(
                alert="CPRBreakerOpen",
                expr="cpr_breaker_state == 2",
                for_="1m",
                severity="ticket",
                summary="Circuit breaker open for {{ $labels.engine }}",
                description=(
                    "The circuit breaker for engine {{ $labels.engine }} ({{ $labels.job }}/{{ $labels.instance }}) "
                    "has been open for over 1m: calls to it fail fast with CircuitOpen."
                ),
            ),
            AlertRule(
                alert="CPRBarrierPhaseFailures",
                expr=_counter_events("cpr_barrier_phase_failures_total", "10m", "job, transition, phase") + " > 0",
                for_="0m",
                severity="ticket",
                summary="Barrier phase {{ $labels.phase }} of {{ $labels.transition }} failed",
                description=(
                    "{{ $value | humanize }} engine failure(s) in phase {{ $labels.phase }} of barrier transition "
                    "{{ $labels.transition }} on {{ $labels.job }} in the last 10m."
                ),
            ),
        ),
    ),
)
"""Every alert, in file order."""


def _yaml_str(value: str) -> str:
    """A YAML double-quoted scalar (a JSON string is one)."""
    return json.dumps(value, ensure_ascii=True)


def rules_yaml(groups: Sequence[AlertGroup] = ALERT_GROUPS) -> str:
    """The Prometheus rule file text for ``groups``."""
    out = [
        "# Prometheus alert rules for controlplane-resilience.",
        "# GENERATED by grafana/generate.py from the same PromQL as the dashboard: do not edit by hand.",
        "# Regenerate: python grafana/generate.py   Check: promtool check rules / promtool test rules",
        "groups:",
    ]
    for group in groups:
        out += [f"  - name: {group.name}", "    rules:"]
        for rule in group.rules:
            out += [f"      - alert: {rule.alert}", "        expr: |-"]
            out += ["          " + line if line else "" for line in rule.expr.splitlines()]
            out += [
                f"        for: {rule.for_}",
                "        labels:",
                f"          severity: {rule.severity}",
                "        annotations:",
                f"          summary: {_yaml_str(rule.summary)}",
                f"          description: {_yaml_str(rule.description)}",
            ]
    return "\n".join(out) + "\n"


# --------------------------------------------------------------------------
# Dashboard
# --------------------------------------------------------------------------

DATASOURCE = dashboard_models.DataSourceRef(type_val="prometheus", uid="${datasource}")
"""Every panel and query reads the dashboard's ``datasource`` variable."""

JOB = 'job=~"$job"'
ENDPOINT = 'endpoint=~"$endpoint"'
ENGINE = 'engine=~"$engine"'
RATE = "[$__rate_interval]"


def _query(expr: str, legend: str, ref_id: str, *, instant: bool = False) -> prometheus.Dataquery:
    query = prometheus.Dataquery().expr(compact(expr)).legend_format(legend).ref_id(ref_id).datasource(DATASOURCE)
    return query.instant() if instant else query.range()


def _legend() -> common_builders.VizLegendOptions:
    return (
        common_builders.VizLegendOptions()
        .display_mode(common.LegendDisplayMode.TABLE)
        .placement(common.LegendPlacement.BOTTOM)
        .show_legend(True)
        .calcs(["mean", "max", "lastNotNull"])
    )


def _tooltip() -> common_builders.VizTooltipOptions:
    return common_builders.VizTooltipOptions().mode(common.TooltipDisplayMode.MULTI).sort(common.SortOrder.DESCENDING)


def _last_value() -> common_builders.ReduceDataOptions:
    """Stat and bar-gauge panels show each series' last value (not a mean over the range)."""
    return common_builders.ReduceDataOptions().values(False).calcs(["lastNotNull"])


class _Ids:
    """Hands out panel ids 1, 2, 3, ... in build order."""

    def __init__(self) -> None:
        self._next = 0

    def __call__(self) -> int:
        self._next += 1
        return self._next


def _timeseries(
    ids: _Ids, title: str, description: str, unit: str, targets: Sequence[prometheus.Dataquery], *, span: int = 12
) -> timeseries.Panel:
    panel = (
        timeseries.Panel()
        .id(ids())
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .unit(unit)
        .min(0)
        .height(8)
        .span(span)
        .line_width(1)
        .fill_opacity(10)
        .legend(_legend())
        .tooltip(_tooltip())
    )
    for target in targets:
        panel = panel.with_target(target)
    return panel


def _thresholds(*steps: tuple[float | None, str]) -> dashboard_builders.ThresholdsConfig:
    return (
        dashboard_builders.ThresholdsConfig()
        .mode(dashboard_models.ThresholdsMode.ABSOLUTE)
        .steps([dashboard_models.Threshold(value=value, color=color) for value, color in steps])
    )


def _variables() -> list[dashboard_builders.DatasourceVariable | dashboard_builders.QueryVariable]:
    def label_values(name: str, label: str, metric: str) -> dashboard_builders.QueryVariable:
        return (
            dashboard_builders.QueryVariable(name)
            .label(label)
            .datasource(DATASOURCE)
            .query(f"label_values({metric}, {name})")
            .refresh(dashboard_models.VariableRefresh.ON_TIME_RANGE_CHANGED)
            .sort(dashboard_models.VariableSort.ALPHABETICAL_ASC)
            .multi(True)
            .include_all(True)
            .all_value(".*")
            .current(dashboard_models.VariableOption(selected=True, text="All", value="$__all"))
        )

    return [
        dashboard_builders.DatasourceVariable("datasource")
        .label("Data source")
        .type("prometheus")
        .current(dashboard_models.VariableOption(selected=True, text="default", value="default")),
        label_values("job", "Job", "cpr_attempts_total"),
        label_values("endpoint", "Endpoint", "cpr_attempts_total"),
        label_values("engine", "Engine", "cpr_attempts_total"),
    ]


def build_dashboard() -> dashboard_models.Dashboard:
    """Build the dashboard model with the foundation SDK's builders."""
    ids = _Ids()
    failure_status = f'status=~"{FAILURE_STATUS_RE}"'
    surfaced = f'outcome=~"{"|".join(SURFACED_OUTCOMES)}"'
    builder = (
        dashboard_builders.Dashboard("Control-plane resilience")
        .uid(DASHBOARD_UID)
        .description(
            "controlplane-resilience: control-plane HTTP attempts (502s per endpoint and engine), retries absorbed "
            "vs surfaced, latency, circuit breakers, barrier phases and the run's restart budget. "
            "Generated by grafana/generate.py; do not edit in the UI."
        )
        .tags(["controlplane-resilience", "sglang", "sre"])
        .editable()
        .tooltip(dashboard_models.DashboardCursorSync.CROSSHAIR)
        .time("now-6h", "now")
        .timezone("browser")
        .refresh("30s")
        .variables(list(_variables()))
    )

    # Row 1: the restart budget (what a page is about).
    builder = builder.with_row(dashboard_builders.Row("Restart budget").id(ids()))
    builder = builder.with_panel(
        stat.Panel()
        .id(ids())
        .title("Restarts remaining")
        .description("cpr_restart_budget_remaining: global restarts the run may still take. 0 = the next failure ends the run.")
        .datasource(DATASOURCE)
        .with_target(_query(f"min by (job) (cpr_restart_budget_remaining{{{JOB}}})", "{{job}}", "A", instant=True))
        .unit(units.Short)
        .decimals(0)
        .height(6)
        .span(4)
        .color_mode(common.BigValueColorMode.BACKGROUND)
        .graph_mode(common.BigValueGraphMode.NONE)
        .reduce_options(_last_value())
        .thresholds(_thresholds((None, "red"), (1, "orange"), (2, "green")))
    )
    builder = builder.with_panel(
        stat.Panel()
        .id(ids())
        .title("Restart limit")
        .description("cpr_restart_budget_limit: restarts the run may take in all (e.g. max_global_restart=3).")
        .datasource(DATASOURCE)
        .with_target(_query(f"max by (job) (cpr_restart_budget_limit{{{JOB}}})", "{{job}}", "A", instant=True))
        .unit(units.Short)
        .decimals(0)
        .height(6)
        .span(4)
        .color_mode(common.BigValueColorMode.NONE)
        .graph_mode(common.BigValueGraphMode.NONE)
        .reduce_options(_last_value())
    )
    builder = builder.with_panel(
        bargauge.Panel()
        .id(ids())
        .title("Restarts by cause (whole run)")
        .description("cpr_restarts_total by cause, read from the budget's persisted record: every restart of the run.")
        .datasource(DATASOURCE)
        .with_target(_query(f"sum by (cause) (cpr_restarts_total{{{JOB}}})", "{{cause}}", "A", instant=True))
        .unit(units.Short)
        .decimals(0)
        .min(0)
        .height(6)
        .span(4)
        .orientation(common.VizOrientation.HORIZONTAL)
        .reduce_options(_last_value())
        .thresholds(_thresholds((None, "orange")))
    )
    burn_targets = [
        _query(burn_rate(label, seconds, (JOB,)), f"{{{{job}}}} {label}", ref)
        for ref, (label, seconds) in zip("ABCD", (FAST_BURN[1], SLOW_BURN[1], FAST_BURN[0], SLOW_BURN[0]), strict=True)
    ]
    builder = builder.with_panel(
        _timeseries(
            ids,
            "Restart-budget burn rate",
            "(restarts in window / limit) / (window / planned run length). 1 = on pace to use exactly the whole "
            "budget by the planned end. Pages when 1h and 5m both exceed 14.4; tickets when 6h and 30m both exceed 6.",
            units.NoUnit,
            burn_targets,
        )
        .thresholds(_thresholds((None, "green"), (6, "orange"), (14.4, "red")))
        .thresholds_style(common_builders.GraphThresholdsStyleConfig().mode(common.GraphThresholdsStyleMode.LINE))
    )

    # Row 2: control-plane 502s and other failures (Bug A).
    builder = builder.with_row(dashboard_builders.Row("Control-plane failures").id(ids()))
    builder = builder.with_panel(
        _timeseries(
            ids,
            "502 rate per endpoint",
            "Attempts answered 502 Bad Gateway, per endpoint template (all engines).",
            units.RequestsPerSecond,
            [
                _query(
                    f'sum by (endpoint) (rate(cpr_attempts_total{{{JOB}, {ENDPOINT}, {ENGINE}, status="502"}}{RATE}))',
                    "{{endpoint}}",
                    "A",
                )
            ],
        )
    )
    builder = builder.with_panel(
        _timeseries(
            ids,
            "502 rate per engine",
            "Attempts answered 502 Bad Gateway, per engine (scheme://host:port).",
            units.RequestsPerSecond,
            [
                _query(
                    f'sum by (engine) (rate(cpr_attempts_total{{{JOB}, {ENDPOINT}, {ENGINE}, status="502"}}{RATE}))',
                    "{{engine}}",
                    "A",
                )
            ],
        )
    )
    builder = builder.with_panel(
        _timeseries(
            ids,
            "5xx and transport failures per endpoint",
            "Failed attempts per endpoint and status: any 5xx plus connect_error, read_timeout, connection_reset, error.",
            units.RequestsPerSecond,
            [
                _query(
                    f"sum by (endpoint, status) (rate(cpr_attempts_total{{{JOB}, {ENDPOINT}, {ENGINE}, {failure_status}}}{RATE}))",
                    "{{endpoint}} {{status}}",
                    "A",
                )
            ],
            span=24,
        )
    )

    # Row 3: retries.
    builder = builder.with_row(dashboard_builders.Row("Retries").id(ids()))
    builder = builder.with_panel(
        _timeseries(
            ids,
            "Retries absorbed vs surfaced",
            "Logical calls that succeeded after retrying (absorbed) against calls that reached the caller as an "
            "error (surfaced, by outcome). A surfaced failure on a hot-path endpoint is what used to trigger a "
            "global restart.",
            units.RequestsPerSecond,
            [
                _query(
                    f'sum(rate(cpr_requests_total{{{JOB}, {ENDPOINT}, outcome="retried_success"}}{RATE}))',
                    "absorbed (retried_success)",
                    "A",
                ),
                _query(
                    f"sum by (outcome) (rate(cpr_requests_total{{{JOB}, {ENDPOINT}, {surfaced}}}{RATE}))",
                    "surfaced: {{outcome}}",
                    "B",
                ),
            ],
        )
    )
    builder = builder.with_panel(
        _timeseries(
            ids,
            "Retries by reason",
            "Retries scheduled, per endpoint and reason.",
            units.OpsPerSecond,
            [
                _query(
                    f"sum by (endpoint, reason) (rate(cpr_retries_total{{{JOB}, {ENDPOINT}}}{RATE}))",
                    "{{endpoint}} {{reason}}",
                    "A",
                )
            ],
        )
    )
    builder = builder.with_panel(
        _timeseries(
            ids,
            "Retry-budget tokens per engine",
            "Tokens left in each engine's retry budget; under 1 no retry is allowed.",
            units.Short,
            [_query(f"min by (engine) (cpr_retry_budget_tokens{{{JOB}, {ENGINE}}})", "{{engine}}", "A")],
        )
    )
    builder = builder.with_panel(
        _timeseries(
            ids,
            "Retry budget exhausted",
            "Retries refused because the engine's retry budget was empty.",
            units.OpsPerSecond,
            [
                _query(
                    f"sum by (engine) (rate(cpr_retry_budget_exhausted_total{{{JOB}, {ENDPOINT}, {ENGINE}}}{RATE}))",
                    "{{engine}}",
                    "A",
                )
            ],
        )
    )

    # Row 4: latency.
    builder = builder.with_row(dashboard_builders.Row("Latency").id(ids()))
    builder = builder.with_panel(
        _timeseries(
            ids,
            "Attempt latency p50 / p99 per endpoint",
            "histogram_quantile over cpr_attempt_duration_seconds (each attempt, not the whole logical call).",
            units.Seconds,
            [
                _query(
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

    # Row 5: circuit breakers.
    builder = builder.with_row(dashboard_builders.Row("Circuit breakers").id(ids()))
    builder = builder.with_panel(
        statetimeline.Panel()
        .id(ids())
        .title("Breaker state per engine")
        .description("cpr_breaker_state: 0 closed, 1 half_open, 2 open (calls fail fast with CircuitOpen).")
        .datasource(DATASOURCE)
        .with_target(_query(f"max by (engine) (cpr_breaker_state{{{JOB}, {ENGINE}}})", "{{engine}}", "A"))
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
        .thresholds(_thresholds((None, "green"), (1, "yellow"), (2, "red")))
        .show_value(common.VisibilityMode.AUTO)
        .merge_values(True)
    )
    builder = builder.with_panel(
        _timeseries(
            ids,
            "Breaker rejections per engine",
            "Calls refused by an open breaker.",
            units.RequestsPerSecond,
            [
                _query(
                    f"sum by (engine) (rate(cpr_breaker_rejections_total{{{JOB}, {ENDPOINT}, {ENGINE}}}{RATE}))",
                    "{{engine}}",
                    "A",
                )
            ],
        )
    )

    # Row 6: barrier phases.
    builder = builder.with_row(dashboard_builders.Row("Barrier").id(ids()))
    builder = builder.with_panel(
        _timeseries(
            ids,
            "Barrier phase duration p50 / p99",
            "histogram_quantile over cpr_barrier_phase_duration_seconds by phase.",
            units.Seconds,
            [
                _query(
                    f"histogram_quantile({q}, sum by (phase, le) (rate(cpr_barrier_phase_duration_seconds_bucket{{{JOB}}}{RATE})))",
                    f"{{{{phase}}}} p{name}",
                    ref,
                )
                for ref, q, name in (("A", "0.5", "50"), ("B", "0.99", "99"))
            ],
        )
    )
    builder = builder.with_panel(
        _timeseries(
            ids,
            "Barrier phase failures",
            "Engines that failed a barrier phase (one per failed engine), by transition and phase.",
            units.Short,
            [
                _query(
                    f"sum by (transition, phase) (increase(cpr_barrier_phase_failures_total{{{JOB}}}{RATE}))",
                    "{{transition}} {{phase}}",
                    "A",
                )
            ],
        )
    )
    builder = builder.with_panel(
        _timeseries(
            ids,
            "Barrier transitions by result",
            "Barrier transitions ended, by transition and result (ok / failed).",
            units.Short,
            [
                _query(
                    f"sum by (transition, result) (increase(cpr_barrier_transitions_total{{{JOB}}}{RATE}))",
                    "{{transition}} {{result}}",
                    "A",
                )
            ],
        )
    )
    builder = builder.with_panel(
        _timeseries(
            ids,
            "Engines held paused",
            "Holds on each engine (the barrier keeps an engine paused while it holds it).",
            units.Short,
            [_query(f"max by (engine) (cpr_engines_held_paused{{{JOB}, {ENGINE}}})", "{{engine}}", "A")],
        )
    )
    return builder.build()


def dashboard_json() -> str:
    """The dashboard as deterministic JSON text (sorted keys, 2-space indent, trailing newline)."""
    return JSONEncoder(sort_keys=True, indent=2, ensure_ascii=True).encode(build_dashboard()) + "\n"


# --------------------------------------------------------------------------
# Writing and checking
# --------------------------------------------------------------------------


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8", newline="\n")
    return path


def generate(out_dir: Path | str = DEFAULT_DASHBOARD_DIR) -> list[Path]:
    """Write the dashboard JSON into ``out_dir``; return the paths written."""
    return [_write(Path(out_dir) / DASHBOARD_FILENAME, dashboard_json())]


def generate_rules(out_dir: Path | str = DEFAULT_RULES_DIR) -> list[Path]:
    """Write the Prometheus alert rules into ``out_dir``; return the paths written."""
    return [_write(Path(out_dir) / RULES_FILENAME, rules_yaml())]


def _check(path: Path, expected: str) -> bool:
    actual = path.read_text(encoding="utf-8") if path.exists() else ""
    if actual == expected:
        return True
    diff = difflib.unified_diff(actual.splitlines(keepends=True), expected.splitlines(keepends=True), str(path), "generated", n=2)
    sys.stderr.write(f"{path} is stale; run: python grafana/generate.py\n")
    sys.stderr.writelines(list(diff)[:60])
    return False


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: write (default) or ``--check`` the dashboard and rules; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="python grafana/generate.py",
        description="Generate (or --check) the controlplane-resilience Grafana dashboard and Prometheus alert rules.",
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_DASHBOARD_DIR, help="dashboard folder (%(default)s)")
    parser.add_argument("--rules-out", type=Path, default=DEFAULT_RULES_DIR, help="rules folder (%(default)s)")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 when a file there differs from a fresh generation")
    args = parser.parse_args(argv)
    outputs = ((args.out / DASHBOARD_FILENAME, dashboard_json()), (args.rules_out / RULES_FILENAME, rules_yaml()))
    if args.check:
        ok = [_check(path, text) for path, text in outputs]
        return 0 if all(ok) else 1
    for path, text in outputs:
        print(_write(path, text))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
