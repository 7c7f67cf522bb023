"""Observers that turn resilience events into telemetry: spans and metrics.

* ``TracingObserver`` (``resilience.telemetry.tracing``, needs ``opentelemetry-api``):
  a span per logical call, a CLIENT span per attempt, spans per barrier
  transition and phase; injects ``traceparent`` on every attempt.
* ``MetricsObserver`` and ``start_metrics_server`` (``resilience.telemetry.metrics``,
  needs ``prometheus-client``): the ``cpr_*`` metrics.

Each name is imported on first use, so ``from resilience.telemetry import
MetricsObserver`` works without OpenTelemetry installed and vice versa.
Both are plain observers::

    session = resilient_session(policies, observers=[TracingObserver(), MetricsObserver()])
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .metrics import MetricsObserver, MetricsServer, start_metrics_server
    from .tracing import TracingObserver

__all__ = ["MetricsObserver", "MetricsServer", "TracingObserver", "start_metrics_server"]

_WHERE = {
    "MetricsObserver": ".metrics",
    "MetricsServer": ".metrics",
    "start_metrics_server": ".metrics",
    "TracingObserver": ".tracing",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
