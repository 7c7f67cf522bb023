"""The per-call metrics, counted in plain Python and published at scrape time (a prometheus-client collector).

``MetricsObserver`` moves four metrics on every call: ``cpr_requests_total``,
``cpr_attempts_total``, ``cpr_attempt_duration_seconds`` and
``cpr_retry_budget_tokens``. Through prometheus-client's metric objects each
move costs five to nine Python calls; here each moment costs one lock and, for
a duration, one ``bisect``. ``collect`` exports the same families, types,
label names and ``_created`` samples as prometheus-client's ``Counter``,
``Histogram`` and ``Gauge`` would (``tests/telemetry/test_metrics.py`` holds
the exposition to the contract).
"""

from __future__ import annotations

import threading
import time
from bisect import bisect_left
from collections.abc import Iterable, Sequence
from itertools import accumulate
from typing import Final

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

__all__ = ["Counted", "HotMetrics", "Timed"]


class Counted:
    """One counter or gauge series: its label values, its value, when it was created."""

    __slots__ = ("created", "labels", "value")

    def __init__(self, labels: tuple[str, ...]) -> None:
        self.labels = labels
        self.value = 0.0
        self.created = time.time()


class Timed:
    """One histogram series: its label values, a count per bucket (not cumulative; the last is +Inf), the sum."""

    __slots__ = ("buckets", "created", "labels", "sum")

    def __init__(self, labels: tuple[str, ...], size: int) -> None:
        self.labels = labels
        self.buckets = [0] * size
        self.sum = 0.0
        self.created = time.time()


class HotMetrics:
    """The four per-call families of one ``MetricsObserver``; register it in the observer's registry.

    ``bounds``: the duration histogram's finite upper bounds, ascending. Each
    family keeps one series per distinct label tuple; the observer bounds the
    label values before it asks for a series. ``lock`` guards every value:
    take it around a move (``with hot.lock: ...``).
    """

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds: Final = tuple(bounds)
        self.lock = threading.Lock()
        self.requests: dict[tuple[str, ...], Counted] = {}
        """(endpoint, method, outcome) -> series."""
        self.attempts: dict[tuple[str, ...], Counted] = {}
        """(endpoint, engine, status) -> series."""
        self.durations: dict[tuple[str, ...], Timed] = {}
        """(endpoint,) -> series."""
        self.tokens: dict[tuple[str, ...], Counted] = {}
        """(engine,) -> series."""

    def counted(self, family: dict[tuple[str, ...], Counted], labels: tuple[str, ...]) -> Counted:
        """The series of ``labels`` in ``family`` (a dict above), made at 0 the first time."""
        with self.lock:
            return family.setdefault(labels, Counted(labels))

    def timed(self, labels: tuple[str, ...]) -> Timed:
        """The duration series of ``labels``, made empty the first time."""
        with self.lock:
            return self.durations.setdefault(labels, Timed(labels, len(self.bounds) + 1))

    def observe(self, counter: Counted, timed: Timed, duration_s: float) -> None:
        """One attempt: its counter moves by one, its duration goes in its bucket (``le`` is inclusive, as Prometheus')."""
        i = bisect_left(self.bounds, duration_s)
        with self.lock:
            counter.value += 1.0
            timed.buckets[i] += 1
            timed.sum += duration_s

    def describe(self) -> Iterable[Metric]:
        """The families this collector owns (lets the registry detect name clashes at registration)."""
        return self._families()

    def collect(self) -> Iterable[Metric]:
        """Every series now, as prometheus-client's own metric objects would export it."""
        requests, attempts, durations, tokens = families = self._families()
        with self.lock:
            counted = [[(s.labels, s.value, s.created) for s in family.values()] for family in (self.requests, self.attempts)]
            timed = [(s.labels, list(s.buckets), s.sum, s.created) for s in self.durations.values()]
            gauges = [(s.labels, s.value) for s in self.tokens.values()]
        for family, rows in zip((requests, attempts), counted, strict=True):
            for labels, value, created in rows:
                family.add_metric(labels, value, created=created)
        names = [floatToGoString(b) for b in self.bounds] + ["+Inf"]  # type: ignore[no-untyped-call]
        for labels, buckets, total, created in timed:
            cumulative = [(name, float(count)) for name, count in zip(names, accumulate(buckets), strict=True)]
            durations.add_metric(labels, cumulative, total)
            durations.samples.append(Sample(durations.name + "_created", {"endpoint": labels[0]}, created, None))
        for labels, value in gauges:
            tokens.add_metric(labels, value)
        return families

    @staticmethod
    def _families() -> tuple[CounterMetricFamily, CounterMetricFamily, HistogramMetricFamily, GaugeMetricFamily]:
        return (
            CounterMetricFamily(
                "cpr_requests", "Logical calls by endpoint template, method and outcome.", labels=["endpoint", "method", "outcome"]
            ),
            CounterMetricFamily(
                "cpr_attempts",
                "Attempts by endpoint template, engine and HTTP status (or transport error).",
                labels=["endpoint", "engine", "status"],
            ),
            HistogramMetricFamily("cpr_attempt_duration_seconds", "Duration of one attempt, by endpoint template.", labels=["endpoint"]),
            GaugeMetricFamily("cpr_retry_budget_tokens", "Retry-budget balance per engine after the latest call.", labels=["engine"]),
        )
