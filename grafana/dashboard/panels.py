"""Building blocks every dashboard panel uses: the data source, label matchers, queries, legends, thresholds, ids."""

from collections.abc import Sequence

from grafana_foundation_sdk.builders import common as common_builders
from grafana_foundation_sdk.builders import dashboard as dashboard_builders
from grafana_foundation_sdk.builders import prometheus, timeseries
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models import dashboard as dashboard_models

from grafana.dashboard.promql import compact

__all__ = [
    "DATASOURCE",
    "ENDPOINT",
    "ENGINE",
    "JOB",
    "RATE",
    "PanelIds",
    "last_value",
    "query",
    "thresholds",
    "timeseries_panel",
    "variables",
]

DATASOURCE = dashboard_models.DataSourceRef(type_val="prometheus", uid="${datasource}")
"""Every panel and query reads the dashboard's ``datasource`` variable."""

JOB = 'job=~"$job"'
ENDPOINT = 'endpoint=~"$endpoint"'
ENGINE = 'engine=~"$engine"'
RATE = "[$__rate_interval]"


def query(expr: str, legend: str, ref_id: str, *, instant: bool = False) -> prometheus.Dataquery:
    query = prometheus.Dataquery().expr(compact(expr)).legend_format(legend).ref_id(ref_id).datasource(DATASOURCE)
    return query.instant() if instant else query.range()


def legend() -> common_builders.VizLegendOptions:
    return (
        common_builders.VizLegendOptions()
        .display_mode(common.LegendDisplayMode.TABLE)
        .placement(common.LegendPlacement.BOTTOM)
        .show_legend(True)
        .calcs(["mean", "max", "lastNotNull"])
    )


def tooltip() -> common_builders.VizTooltipOptions:
    return common_builders.VizTooltipOptions().mode(common.TooltipDisplayMode.MULTI).sort(common.SortOrder.DESCENDING)


def last_value() -> common_builders.ReduceDataOptions:
    """Stat and bar-gauge panels show each series' last value (not a mean over the range)."""
    return common_builders.ReduceDataOptions().values(False).calcs(["lastNotNull"])


class PanelIds:
    """Hands out panel ids 1, 2, 3, ... in build order."""

    def __init__(self) -> None:
        self._next = 0

    def __call__(self) -> int:
        self._next += 1
        return self._next


def timeseries_panel(
    ids: PanelIds, title: str, description: str, unit: str, targets: Sequence[prometheus.Dataquery], *, span: int = 12
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
        .legend(legend())
        .tooltip(tooltip())
    )
    for target in targets:
        panel = panel.with_target(target)
    return panel


def thresholds(*steps: tuple[float | None, str]) -> dashboard_builders.ThresholdsConfig:
    return (
        dashboard_builders.ThresholdsConfig()
        .mode(dashboard_models.ThresholdsMode.ABSOLUTE)
        .steps([dashboard_models.Threshold(value=value, color=color) for value, color in steps])
    )


def variables() -> list[dashboard_builders.DatasourceVariable | dashboard_builders.QueryVariable]:
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
