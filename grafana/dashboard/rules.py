"""The Prometheus alert rules: one :class:`AlertGroup` per concern, emitted as YAML by hand in a fixed order."""

import json
from collections.abc import Sequence
from dataclasses import dataclass

from grafana.dashboard.promql import FAST_BURN, SLOW_BURN, counter_events, multiwindow, not_serving_after_onload

__all__ = ["ALERT_GROUPS", "AlertGroup", "AlertRule", "rules_yaml"]


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
                expr=multiwindow(*FAST_BURN),
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
                expr=multiwindow(*SLOW_BURN),
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
                expr=counter_events("cpr_barrier_phase_failures_total", "10m", "job, transition, phase") + " > 0",
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
    AlertGroup(
        "cpr-engines",
        (
            AlertRule(
                alert="CPREngineQuarantined",
                expr='cpr_engine_state{state="quarantined"} > 0',
                for_="5m",
                severity="page",
                summary="Engine {{ $labels.engine }} quarantined for over 5m",
                description=(
                    "The barrier on {{ $labels.job }}/{{ $labels.instance }} has kept {{ $labels.kind }} engine "
                    "{{ $labels.engine }} quarantined for over 5m: it may or may not have released memory, so it is kept "
                    "paused and out of every transition. Check its memory and call reconcile(engine, released=..., "
                    "paused=...), or retire it (Orchestrator.quarantined() lists the tags in doubt)."
                ),
            ),
            AlertRule(
                alert="CPREnginesNotServingAfterOnload",
                expr=not_serving_after_onload(),
                for_="5m",
                severity="page",
                summary="Engine {{ $labels.engine }} not serving since the last onload",
                description=(
                    "The last barrier transition on {{ $labels.job }}/{{ $labels.instance }} was an onload, yet "
                    "{{ $labels.kind }} engine {{ $labels.engine }} has been {{ $labels.state }} for over 5m: rollouts run "
                    "without it. Orchestrator.not_serving() says why (a failed phase, a hold, a quarantine, "
                    "fenced: add or retire it, dead)."
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
        # grafana/generate.py is the script form of this package's command line (kept so this text stays true)
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
