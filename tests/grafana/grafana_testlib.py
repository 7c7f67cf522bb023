"""Shared helpers for the grafana/ tests: the metric contract, a PromQL name tokenizer, tool lookup.

Kept outside ``conftest.py`` so that tests import plain functions; the module
name is unique across ``tests/`` because pytest puts each test folder on
``sys.path`` (rootdir-relative "prepend" imports).
"""

import importlib
import os
import re
import shutil
import sys
from pathlib import Path
from types import ModuleType
from typing import Final

import pytest

REPO: Final = Path(__file__).resolve().parents[2]
GRAFANA_DIR: Final = REPO / "grafana"
GENERATOR: Final = (sys.executable, "-m", "grafana.dashboard")
"""The generator's command line; run it with ``cwd=REPO``."""
SCRIPT: Final = GRAFANA_DIR / "generate.py"
"""``python grafana/generate.py``: the same command line, from any folder."""
DASHBOARD: Final = GRAFANA_DIR / "dashboards" / "controlplane-resilience.json"
RULES: Final = GRAFANA_DIR / "rules" / "controlplane-resilience.rules.yml"
RULE_TESTS: Final = tuple(sorted((GRAFANA_DIR / "rules" / "tests").glob("*.test.yml")))

#: The metric contract (telemetry/METRICS.md; telemetry/metrics.py): name -> (type, labels).
#: Fixed: the exporter and grafana/ both use exactly these names.
CONTRACT: Final[dict[str, tuple[str, frozenset[str]]]] = {
    "cpr_requests_total": ("counter", frozenset({"endpoint", "method", "outcome"})),
    "cpr_attempts_total": ("counter", frozenset({"endpoint", "engine", "status"})),
    "cpr_attempt_duration_seconds": ("histogram", frozenset({"endpoint"})),
    "cpr_retries_total": ("counter", frozenset({"endpoint", "reason"})),
    "cpr_breaker_state": ("gauge", frozenset({"engine"})),
    "cpr_breaker_rejections_total": ("counter", frozenset({"endpoint", "engine"})),
    "cpr_retry_budget_tokens": ("gauge", frozenset({"engine"})),
    "cpr_retry_budget_exhausted_total": ("counter", frozenset({"endpoint", "engine"})),
    "cpr_barrier_phase_duration_seconds": ("histogram", frozenset({"transition", "phase"})),
    "cpr_barrier_phase_failures_total": ("counter", frozenset({"transition", "phase"})),
    "cpr_barrier_transitions_total": ("counter", frozenset({"transition", "result"})),
    "cpr_engines_held_paused": ("gauge", frozenset({"engine"})),
    "cpr_barrier_transition_last_end_timestamp_seconds": ("gauge", frozenset({"transition"})),
    "cpr_engine_state": ("gauge", frozenset({"engine", "kind", "state"})),
    "cpr_engine_weight_version": ("gauge", frozenset({"engine", "kind", "version"})),
    "cpr_journal_commit_duration_seconds": ("histogram", frozenset({"op"})),
    "cpr_restarts_total": ("counter", frozenset({"cause"})),
    "cpr_restart_budget_limit": ("gauge", frozenset()),
    "cpr_restart_budget_remaining": ("gauge", frozenset()),
    "cpr_restart_budget_planned_run_seconds": ("gauge", frozenset()),
}


def exposed_series_names() -> frozenset[str]:
    """Every series name the exporter exposes: counters and gauges as named, histograms' _bucket/_sum/_count."""
    names: set[str] = set()
    for name, (kind, _labels) in CONTRACT.items():
        if kind == "histogram":
            names.update(f"{name}{suffix}" for suffix in ("_bucket", "_sum", "_count"))
        else:
            names.add(name)
    return frozenset(names)


# PromQL (Prometheus 2.42) words that are not metric names.
AGGREGATORS: Final = frozenset(("sum min max avg group stddev stdvar count count_values bottomk topk quantile").split())
FUNCTIONS: Final = frozenset(
    (
        "abs absent absent_over_time acos acosh asin asinh atan atanh avg_over_time ceil changes clamp "
        "clamp_max clamp_min cos cosh count_over_time days_in_month day_of_month day_of_week day_of_year deg "
        "delta deriv exp floor histogram_count histogram_fraction histogram_quantile histogram_sum "
        "holt_winters hour idelta increase irate label_join label_replace last_over_time ln log10 log2 "
        "max_over_time min_over_time minute month pi predict_linear present_over_time quantile_over_time rad "
        "rate resets round scalar sgn sin sinh sort sort_desc sqrt stddev_over_time stdvar_over_time "
        "sum_over_time tan tanh time timestamp vector year"
    ).split()
)
KEYWORDS: Final = frozenset(
    {"and", "or", "unless", "atan2", "bool", "offset", "by", "without", "on", "ignoring", "group_left", "group_right", "inf", "nan"}
)
#: Keywords whose parenthesised argument is a list of label names, not an expression.
LABEL_LIST_KEYWORDS: Final = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right"})

_IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
_NUMBER_OR_DURATION = re.compile(r"[0-9][0-9A-Za-z_.]*")


def _skip_string(expr: str, i: int) -> int:
    """Index just past the string literal that starts at ``expr[i]``."""
    quote = expr[i]
    i += 1
    while i < len(expr):
        if expr[i] == "\\" and quote != "`":
            i += 2
            continue
        if expr[i] == quote:
            return i + 1
        i += 1
    raise ValueError(f"unterminated string in {expr!r}")


def _skip_group(expr: str, i: int, close: str) -> int:
    """Index just past the ``close`` that ends the group opened at ``expr[i]`` (strings skipped)."""
    i += 1
    while i < len(expr):
        char = expr[i]
        if char in "\"'`":
            i = _skip_string(expr, i)
            continue
        if char == close:
            return i + 1
        i += 1
    raise ValueError(f"unclosed {expr[i - 1]!r} group in {expr!r}")


def promql_tokens(expr: str) -> tuple[set[str], set[str]]:
    """Split ``expr`` into (metric names, function names it calls).

    A metric name is an identifier followed by ``{``, ``[`` or standing alone
    that is not a PromQL keyword; an identifier followed by ``(``, or an
    aggregation operator (``sum by (job) (...)``), is a call. Label matchers, string literals, range/subquery
    brackets, durations, numbers and the label lists of ``by``/``without``/
    ``on``/``ignoring``/``group_left``/``group_right`` are skipped.
    """
    metrics: set[str] = set()
    calls: set[str] = set()
    i = 0
    while i < len(expr):
        char = expr[i]
        if char.isspace():
            i += 1
        elif char in "\"'`":
            i = _skip_string(expr, i)
        elif char == "{":
            i = _skip_group(expr, i, "}")
        elif char == "[":
            i = _skip_group(expr, i, "]")
        elif char == "#":  # a comment runs to the end of the line
            end = expr.find("\n", i)
            i = len(expr) if end < 0 else end
        elif (match := _NUMBER_OR_DURATION.match(expr, i)) is not None:
            i = match.end()
        elif (match := _IDENT.match(expr, i)) is not None:
            word = match.group()
            i = match.end()
            j = i
            while j < len(expr) and expr[j].isspace():
                j += 1
            followed_by_paren = j < len(expr) and expr[j] == "("
            if word in LABEL_LIST_KEYWORDS:
                if followed_by_paren:
                    i = _skip_group(expr, j, ")")
            elif word in KEYWORDS:
                pass
            elif followed_by_paren or word in AGGREGATORS:  # `sum by (l) (...)`: the modifier may come first
                calls.add(word)
            else:
                metrics.add(word)
        else:
            i += 1
    return metrics, calls


def metric_names(expr: str) -> set[str]:
    """The metric names an expression selects (see ``promql_tokens``)."""
    return promql_tokens(expr)[0]


GRAFANA_VARIABLE = re.compile(r"\$(?:\{(\w+)(?::\w+)?\}|(\w+))")


def substitute_grafana_variables(expr: str) -> str:
    """Replace Grafana's variables the way Grafana would before sending the query.

    ``$__rate_interval``/``$__interval``/``$__range`` become durations; the
    dashboard's own variables (regex matchers with "All" = ``.*``) become ``.*``.
    """
    durations = {"__rate_interval": "5m", "__interval": "1m", "__range": "6h"}

    def replace(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        return durations.get(name, ".*")

    return GRAFANA_VARIABLE.sub(replace, expr)


def require_binary(name: str) -> str:
    """The path of an executable: skip the test when it is missing, or fail when CI=true."""
    path = shutil.which(name) or (f"/usr/bin/{name}" if Path(f"/usr/bin/{name}").is_file() else None)
    if path is None:
        message = f"{name} not found on PATH or in /usr/bin (Debian package 'prometheus')"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{message}; CI=true requires it")
        pytest.skip(message)
    return path


def load_generator() -> ModuleType:
    """The ``grafana.dashboard`` package (the repository root is on ``sys.path``: pytest's ``pythonpath``)."""
    return importlib.import_module("grafana.dashboard")
