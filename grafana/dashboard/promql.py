"""PromQL builders shared by the dashboard and the alert rules, so a panel draws exactly what an alert pages on."""

from collections.abc import Sequence

__all__ = [
    "ENGINE_STATE_CODES",
    "FAILURE_STATUS_RE",
    "FAST_BURN",
    "SLOW_BURN",
    "SURFACED_OUTCOMES",
    "burn_rate",
    "compact",
    "counter_events",
    "engine_state_code",
    "not_serving_after_onload",
    "multiwindow",
    "restarts_in_window",
    "selector",
]

#: ``cpr_requests_total`` outcomes that reach the caller as an error: what retries did not absorb.
SURFACED_OUTCOMES = ("failed", "ambiguous", "deadline_exceeded", "circuit_open", "budget_exhausted")
#: ``cpr_attempts_total`` statuses that count as "5xx or transport failure".
FAILURE_STATUS_RE = "5..|connect_error|read_timeout|connection_reset|error"

#: ``cpr_engine_state``'s ``state`` words (telemetry/engine_state.py ``ENGINE_STATES``), each with the number a state
#: timeline draws and its colour: serving first, then the states a transition (or a join) passes through, then the ones
#: that need someone (quarantined, fenced, dead), then retired.
ENGINE_STATE_CODES: tuple[tuple[str, int, str], ...] = (
    ("serving", 0, "green"),
    ("paused", 1, "blue"),
    ("flushed", 2, "blue"),
    ("released", 3, "purple"),
    ("in_flight", 4, "yellow"),
    ("joining", 5, "yellow"),
    ("unknown", 6, "orange"),
    ("unsettled", 7, "orange"),
    ("quarantined", 8, "red"),
    ("fenced", 9, "red"),
    ("dead", 10, "dark-red"),
    ("retired", 11, "gray"),
)

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


def multiwindow(long: tuple[str, int], short: tuple[str, int], threshold: float) -> str:
    return f"(\n{_indent(burn_rate(*long), 2)}\n) > {threshold:g}\nand\n(\n{_indent(burn_rate(*short), 2)}\n) > {threshold:g}"


def counter_events(metric: str, window: str, by: str) -> str:
    """Events counted by ``metric`` in ``window``, a born series counting its whole value."""
    return f"sum by ({by}) (\n    ({metric} unless {metric} offset {window})\n  or\n    increase({metric}[{window}])\n)"


def engine_state_code(matchers: Sequence[str] = ()) -> str:
    """Each engine's ``cpr_engine_state`` as one number per engine (``ENGINE_STATE_CODES``), for a state timeline.

    The state is a label and the value is 1, so each state's series is scaled to its code and the engine's one
    series kept: ``max by (engine)`` over them (an ``other`` engine label, several engines, shows its worst state).
    """
    parts = []
    for state, code, _colour in ENGINE_STATE_CODES:
        series = selector("cpr_engine_state", [*matchers, f'state="{state}"'])
        parts.append(f"({series} > 0) * {code}")
    return "max by (engine) (\n    " + "\n  or\n    ".join(parts) + "\n)"


def not_serving_after_onload(matchers: Sequence[str] = ()) -> str:
    """Engines (not retired) not serving while the last transition of their exporter that ended was an onload.

    ``cpr_barrier_transition_last_end_timestamp_seconds`` says when the last onload and the last offload ended; an
    exporter that never offloaded compares its onload with 0. Per scrape target (``job``, ``instance``).
    """
    onload = selector("cpr_barrier_transition_last_end_timestamp_seconds", [*matchers, 'transition="onload"'])
    offload = selector("cpr_barrier_transition_last_end_timestamp_seconds", [*matchers, 'transition="offload"'])
    state = selector("cpr_engine_state", [*matchers, 'state!~"serving|retired"'])
    return (
        f"({state} > 0)\n"
        "  and on (job, instance)\n"
        "(\n"
        f"    max by (job, instance) ({onload})\n"
        "  >\n"
        f"    (max by (job, instance) ({offload}) or max by (job, instance) ({onload}) * 0)\n"
        ")"
    )
