"""The gateway row: smg's own metrics (its ``/metrics`` listener) next to ours, 502s seen by the gateway beside 502s we absorbed.

smg 1.13.0 exports (read from a real gateway's ``/metrics``, ``tests/smg/test_smg_metrics.py``):
``smg_rl_control_calls_total{op, result}`` (each control call its ``/v1/rl`` routes proxied to an engine;
``result="upstream_error"`` when the engine side answered an error status, such as a 502 from a proxy in between),
``smg_rl_fanout_total{result}`` (``ok``, ``partial``, ...), and ``smg_router_upstream_responses_total{status_code}``
(the data plane's upstream answers). Their queries carry no ``job`` matcher: the dashboard's ``$job`` lists our
exporters' jobs, and smg is scraped as a job of its own.
"""

from grafana_foundation_sdk.builders import dashboard as dashboard_builders
from grafana_foundation_sdk.models import units

from grafana.dashboard.external import SMG_METRICS
from grafana.dashboard.panels import ENDPOINT, ENGINE, JOB, RATE, PanelIds, query, timeseries_panel

__all__ = ["SMG_METRICS", "smg_row"]


def smg_row(builder: dashboard_builders.Dashboard, ids: PanelIds) -> dashboard_builders.Dashboard:
    """Row 8: the smg gateway beside us."""
    builder = builder.with_row(dashboard_builders.Row("Gateway (smg)").id(ids()))
    builder = builder.with_panel(
        timeseries_panel(
            ids,
            "502s: seen by the gateway, absorbed by us",
            "Left, smg's view: control calls its /v1/rl routes proxied that the engine side answered with an error "
            "(upstream_error: a 502 from a proxy between gateway and engine counts here), and 502s its data plane got "
            "from engines. Ours: attempts answered 502 and the retries scheduled after one (absorbed unless the call "
            "still failed: see Retries), from our drivers and from SmgFanOut (its observers), which sends the "
            "barrier's phases through the gateway: there the gateway's 502s and ours are the same answers.",
            units.RequestsPerSecond,
            [
                query(f'sum(rate(smg_rl_control_calls_total{{result="upstream_error"}}{RATE}))', "gateway: /v1/rl engine errors", "A"),
                query(f'sum(rate(smg_router_upstream_responses_total{{status_code="502"}}{RATE}))', "gateway: data-plane 502s", "B"),
                query(f'sum(rate(cpr_attempts_total{{{JOB}, {ENDPOINT}, {ENGINE}, status="502"}}{RATE}))', "ours: 502 answers", "C"),
                query(f'sum(rate(cpr_retries_total{{{JOB}, {ENDPOINT}, reason="status_502"}}{RATE}))', "ours: retried after a 502", "D"),
            ],
            span=12,
        )
    )
    builder = builder.with_panel(
        timeseries_panel(
            ids,
            "Gateway fan-outs by result",
            "smg_rl_fanout_total: /v1/rl/engine fan-outs, ok (every engine answered 2xx) or partial (a 207: some failed).",
            units.OpsPerSecond,
            [query(f"sum by (result) (rate(smg_rl_fanout_total{RATE}))", "{{result}}", "A")],
            span=6,
        )
    )
    builder = builder.with_panel(
        timeseries_panel(
            ids,
            "Gateway control calls by operation and result",
            "smg_rl_control_calls_total: each engine call the gateway proxied, by operation (pause_generation, ...) and result.",
            units.OpsPerSecond,
            [query(f"sum by (op, result) (rate(smg_rl_control_calls_total{RATE}))", "{{op}} {{result}}", "A")],
            span=6,
        )
    )
    return builder
