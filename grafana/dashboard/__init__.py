"""Generate the controlplane-resilience Grafana dashboard and Prometheus alert rules.

Both artefacts are built from one set of PromQL builders (``promql``), so the
restart-budget burn rate drawn on the dashboard is exactly the expression the
alerts page on. ``rules`` holds the alert rules, ``panels`` the pieces every
panel uses, ``rows`` one function per dashboard row, ``build`` the dashboard
itself and ``files`` the writing, checking and command line. The outputs are
committed; regenerate and check with (from the repository root)::

    python -m grafana.dashboard            # rewrite grafana/dashboards/*.json and grafana/rules/*.rules.yml
    python -m grafana.dashboard --check    # exit 1 when a committed file differs from a fresh generation
    python -m grafana.dashboard --out DIR  # write the dashboard JSON into DIR (rules: --rules-out DIR)

``cpr dashboards`` imports this package. It imports nothing from ``resilience``
(only ``grafana-foundation-sdk`` and the standard library). Every metric it
names is in the metric contract of ``resilience/telemetry/METRICS.md``;
``tests/grafana`` checks that.

Output is deterministic: JSON with sorted keys and a fixed indent, YAML emitted
by hand in a fixed order, both ending in one newline.
"""

from grafana.dashboard.build import DASHBOARD_UID, build_dashboard, dashboard_json
from grafana.dashboard.files import (
    DASHBOARD_FILENAME,
    DEFAULT_DASHBOARD_DIR,
    DEFAULT_RULES_DIR,
    RULES_FILENAME,
    generate,
    generate_rules,
    main,
)
from grafana.dashboard.promql import burn_rate, restarts_in_window
from grafana.dashboard.rules import ALERT_GROUPS, AlertGroup, AlertRule, rules_yaml

__all__ = [
    "ALERT_GROUPS",
    "DASHBOARD_FILENAME",
    "DASHBOARD_UID",
    "DEFAULT_DASHBOARD_DIR",
    "DEFAULT_RULES_DIR",
    "RULES_FILENAME",
    "AlertGroup",
    "AlertRule",
    "build_dashboard",
    "burn_rate",
    "dashboard_json",
    "generate",
    "generate_rules",
    "main",
    "restarts_in_window",
    "rules_yaml",
]
