"""Prometheus metrics derived from resilience events: ``MetricsObserver`` (prometheus-client).

The metric contract (every name, type, label and bound, the series created at
0, the registry, the restart-budget and per-engine collectors) is
``telemetry/METRICS.md``; ``grafana/`` dashboards and alert rules query
exactly those names. Per call the observer takes its moments as plain values
(``CallObserver``): one lookup of the series (cached per endpoint and engine)
and one lock around plain additions (``telemetry/_hot.py`` counts the four
per-call families and publishes them at scrape time); other events go by one
type lookup to their labelled child. It never raises: a failure is logged at
WARNING on ``resilience.telemetry``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, Final, NamedTuple
from wsgiref.simple_server import WSGIServer

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from resilience.barrier.journal import RestartBudget
from resilience.barrier.journal_store import JournalStore
from resilience.barrier.state import PhaseEnded, TransitionEnded
from resilience.engine_contract import EngineStateChanged, HoldChanged
from resilience.events import AttemptEnded, BreakerRejected, BreakerTransitioned, CallEnded, RetryBudgetExhaustedEvent, RetryScheduled
from resilience.outcome import CallOutcome, Outcome

from ._dispatch import Dispatcher
from ._hot import Counted, HotMetrics, Timed
from ._labels import OTHER, scrub_engine, status_label, transport_label
from .engine_state import DEFAULT_MAX_ENGINES, EngineStateCollector
from .journal_timing import JOURNAL_COMMIT_BUCKETS, TimedJournalStore

__all__ = [
    "ATTEMPT_DURATION_BUCKETS",
    "BREAKER_STATE_VALUES",
    "PHASE_DURATION_BUCKETS",
    "MetricsObserver",
    "MetricsServer",
    "start_metrics_server",
]

log = logging.getLogger("resilience.telemetry")

ATTEMPT_DURATION_BUCKETS: Final = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 30.0)
"""Buckets (seconds) of ``cpr_attempt_duration_seconds``: OTel's HTTP client buckets plus 30 s."""

PHASE_DURATION_BUCKETS: Final = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
"""Buckets (seconds) of ``cpr_barrier_phase_duration_seconds``: a flush or a release takes seconds to minutes."""

BREAKER_STATE_VALUES: Final = {"closed": 0.0, "half_open": 1.0, "open": 2.0}
"""``cpr_breaker_state`` values; any other state name is ignored."""

_CACHE_MAX: Final = 65536
"""Series and labelled children cached per observer and kind; past this they are looked up through ``labels()`` each time."""


def _remember(cache: dict[Any, Any], key: Any, value: Any) -> None:
    if len(cache) < _CACHE_MAX:
        cache[key] = value


class _RestartBudgetCollector:
    """Publishes a ``RestartBudget``'s persisted record at scrape time."""

    def __init__(self) -> None:
        self.budget: RestartBudget | None = None

    def describe(self) -> Iterable[Metric]:
        """The families this collector owns (lets the registry detect name clashes at registration)."""
        return self._families()

    def collect(self) -> Iterable[Metric]:
        """Read the budget's record now: restarts per cause, limit, remaining, planned run length."""
        budget = self.budget
        if budget is None:
            return []
        restarts, limit, remaining, planned = self._families()
        for cause, count in sorted(budget.causes().items()):
            restarts.add_metric([cause], float(count))
        limit.add_metric([], float(budget.limit))
        remaining.add_metric([], float(budget.remaining))
        planned.add_metric([], float(budget.planned_run_seconds))
        return [restarts, limit, remaining, planned]

    @staticmethod
    def _families() -> tuple[CounterMetricFamily, GaugeMetricFamily, GaugeMetricFamily, GaugeMetricFamily]:
        return (
            CounterMetricFamily("cpr_restarts_total", "Restarts recorded in the run's RestartBudget, by cause.", labels=["cause"]),
            GaugeMetricFamily("cpr_restart_budget_limit", "Restarts the run may take (RestartBudget.limit)."),
            GaugeMetricFamily("cpr_restart_budget_remaining", "Restarts left in the run's RestartBudget."),
            GaugeMetricFamily(
                "cpr_restart_budget_planned_run_seconds",
                "Planned run length the restart-budget burn rate is measured against.",
            ),
        )


class MetricsObserver(Dispatcher):
    """A ``CallObserver`` that counts every call's moments and the other events as Prometheus metrics (``telemetry/METRICS.md``).

    ``registry``: where the metrics are registered. Default None: a fresh
    ``CollectorRegistry`` owned by this observer (``.registry``); pass
    ``prometheus_client.REGISTRY`` to use the process-wide one (only one
    ``MetricsObserver`` may then exist per process, as metric names are
    unique per registry).

    ``restart_budget``: the run's ``RestartBudget``; its record is published
    as ``cpr_restarts_total`` and ``cpr_restart_budget_*``. Default None:
    nothing is published until ``publish_restart_budget`` names one (useful
    because the budget usually takes this observer among its observers).

    ``max_label_values``: how many distinct endpoints, and separately how
    many distinct engines, get their own label value; later ones are
    labelled ``other``. Default 1000. Must be >= 1.
    """

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        restart_budget: RestartBudget | None = None,
        *,
        max_label_values: int = 1000,
    ) -> None:
        if max_label_values < 1:
            raise ValueError(f"MetricsObserver.max_label_values must be >= 1, but was {max_label_values}")
        self.registry: CollectorRegistry = registry if registry is not None else CollectorRegistry()
        """The registry the metrics live in; serve it with ``start_metrics_server(registry=...)``."""
        self.max_label_values = max_label_values
        r = self.registry
        self._hot = HotMetrics(ATTEMPT_DURATION_BUCKETS)  # the four per-call families (telemetry/_hot.py)
        r.register(self._hot)
        self._m_retries = Counter("cpr_retries", "Retries scheduled, by endpoint template and reason.", ["endpoint", "reason"], registry=r)
        self._m_breaker_state = Gauge(
            "cpr_breaker_state", "Circuit breaker state per engine: 0 closed, 1 half_open, 2 open.", ["engine"],
            registry=r,
        )  # fmt: skip
        self._m_breaker_rejections = Counter(
            "cpr_breaker_rejections", "Calls failed fast by an open breaker.", ["endpoint", "engine"], registry=r
        )
        self._m_retry_budget_exhausted = Counter(
            "cpr_retry_budget_exhausted", "Retries refused because the engine's retry budget was spent.",
            ["endpoint", "engine"], registry=r,
        )  # fmt: skip
        self._m_phase_duration = Histogram(
            "cpr_barrier_phase_duration_seconds", "Duration of one barrier phase across all its engines.",
            ["transition", "phase"], buckets=PHASE_DURATION_BUCKETS, registry=r,
        )  # fmt: skip
        self._m_phase_failures = Counter(
            "cpr_barrier_phase_failures", "Engines that failed a barrier phase.", ["transition", "phase"], registry=r
        )
        self._m_transitions = Counter(
            "cpr_barrier_transitions", "Barrier transitions by result (ok / failed).", ["transition", "result"],
            registry=r,
        )  # fmt: skip
        self._m_engines_held_paused = Gauge("cpr_engines_held_paused", "Pause holds currently on each engine.", ["engine"], registry=r)
        self._m_transition_ended_at = Gauge(
            "cpr_barrier_transition_last_end_timestamp_seconds", "When the last transition of each kind ended (Unix time).",
            ["transition"], registry=r,
        )  # fmt: skip
        self._m_journal_commit = Histogram(
            "cpr_journal_commit_duration_seconds", "Time of one durable journal write (append: a commit; rewrite: a compaction).",
            ["op"], buckets=JOURNAL_COMMIT_BUCKETS, registry=r,
        )  # fmt: skip
        for op in ("append", "rewrite"):
            self._m_journal_commit.labels(op)
        self._restarts = _RestartBudgetCollector()
        r.register(self._restarts)
        if restart_budget is not None:
            self.publish_restart_budget(restart_budget)

        self._lock = threading.Lock()
        self._endpoints: dict[str, str] = {}
        self._engines: dict[str, str] = {}
        self._warned: set[str] = set()
        self._breaker_seen: set[str] = set()  # engine labels whose cpr_breaker_state exists
        self._declared_endpoints: set[str] = set()  # endpoint labels given to declare()
        self._declared_engines: set[str] = set()  # engine labels given to declare()
        # raw key -> series or labelled child; filled on first sight, read without a lock afterwards.
        self._c_requests: dict[tuple[Any, ...], Counted] = {}
        self._c_attempts: dict[tuple[Any, ...], tuple[Counted, Timed]] = {}
        self._children: dict[tuple[Any, str, str], Any] = {}  # (family, endpoint, engine or reason) -> labelled child
        self._c_tokens: dict[str, Counted] = {}
        self._handlers: dict[type[Any], Callable[[Any], None]] = {
            CallEnded: self.replay,
            AttemptEnded: self.replay,
            RetryScheduled: self._retry_scheduled,
            BreakerTransitioned: self._breaker_transitioned,
            BreakerRejected: self._breaker_rejected,
            RetryBudgetExhaustedEvent: self._budget_exhausted,
            PhaseEnded: self._phase_ended,
            TransitionEnded: self._transition_ended,
            HoldChanged: self._hold_changed,
            EngineStateChanged: self._engine_state_changed,
        }
        self._watched: tuple[EngineStateCollector, ...] = ()

    def declare(self, *, engines: Iterable[str] = (), endpoints: Iterable[str] = ()) -> None:
        """Create the zero series of engines and endpoints known before any call (a scrape then shows "closed" and 0).

        ``engines``: engine base URLs (``scheme://host:port``; user-info is stripped as usual).
        ``endpoints``: policy templates as events carry them (``"POST /flush_cache"``), e.g. the
        keys of the session's ``PolicyTable``. Every endpoint x engine pair declared so far (in this
        call or earlier ones) gets its ``cpr_breaker_rejections_total`` and
        ``cpr_retry_budget_exhausted_total`` series at 0; every engine its ``cpr_breaker_state`` at 0
        (closed) unless a transition already set it. Values beyond ``max_label_values`` are skipped.
        Never raises for a bad value: it is logged like any failure of this observer.
        """
        try:
            new_endpoints = {self._endpoint(e) for e in endpoints} - {OTHER}
            new_engines = {self._engine(e) for e in engines} - {OTHER}
            with self._lock:
                self._declared_endpoints |= new_endpoints
                self._declared_engines |= new_engines
                all_endpoints, all_engines = set(self._declared_endpoints), set(self._declared_engines)
            for engine in new_engines:
                self._init_engine(engine)
            for endpoint in all_endpoints:
                for engine in all_engines:
                    if endpoint in new_endpoints or engine in new_engines:
                        self._init_pair(endpoint, engine)
        except Exception:
            log.warning("MetricsObserver.declare failed", exc_info=True)

    def _init_engine(self, engine_label: str) -> None:
        """``cpr_breaker_state{engine}`` = 0 (closed) the first time the engine is met, unless a transition set it."""
        if engine_label == OTHER or engine_label in self._breaker_seen:
            return
        with self._lock:
            if engine_label in self._breaker_seen:
                return
            self._breaker_seen.add(engine_label)
            self._m_breaker_state.labels(engine_label).set(0.0)

    def _init_pair(self, endpoint_label: str, engine_label: str) -> None:
        """The (endpoint, engine) counters that count rare events exist at 0 (``labels()`` creates a child at 0)."""
        if OTHER in (endpoint_label, engine_label):
            return
        self._m_breaker_rejections.labels(endpoint_label, engine_label)
        self._m_retry_budget_exhausted.labels(endpoint_label, engine_label)

    def publish_restart_budget(self, budget: RestartBudget | None) -> None:
        """Publish ``budget``'s record as ``cpr_restarts_total`` / ``cpr_restart_budget_*`` (None: stop publishing)."""
        self._restarts.budget = budget

    def watch(self, orchestrator: Any, *, versions: Any = None, max_engines: int = DEFAULT_MAX_ENGINES) -> EngineStateCollector:
        """Publish what ``orchestrator`` knows of each engine (``cpr_engine_state``, ``cpr_engine_weight_version``) at every scrape.

        ``orchestrator``: an ``Orchestrator`` or ``AsyncOrchestrator``.
        ``versions`` (default None: the orchestrator's own ``weight_versions()``)
        and ``max_engines`` (default 256): ``EngineStateCollector``'s. The
        collector is registered in ``registry`` and returned
        (``registry.unregister(it)`` stops it). Put this observer among the
        orchestrator's observers too: the ``EngineStateChanged`` it hears keep
        the gauge moving while a transition holds the orchestrator's lock.
        """
        collector = EngineStateCollector(orchestrator, versions=versions, max_engines=max_engines)
        self.registry.register(collector)
        self._watched = (*self._watched, collector)
        return collector

    def timed_journal_store(self, store: JournalStore) -> TimedJournalStore:
        """``store`` with every durable write timed into ``cpr_journal_commit_duration_seconds`` (give it to ``Journal``)."""
        return TimedJournalStore(store, self._m_journal_commit)

    # -- bounded label values ----------------------------------------------------

    def _bounded(self, seen: dict[str, str], value: str, kind: str, clean: Callable[[str], str]) -> str:
        with self._lock:
            label = seen.get(value)
            if label is None and len(seen) < self.max_label_values:
                label = seen[value] = clean(value)
            if label is not None:
                return label
            if kind not in self._warned:
                self._warned.add(kind)
                log.warning(
                    "MetricsObserver: more than %d distinct %s label values; further ones are labelled %r",
                    self.max_label_values, kind, OTHER,
                )  # fmt: skip
            return OTHER  # not remembered: an overflow must not grow memory either

    def _endpoint(self, endpoint: str) -> str:
        label = self._endpoints.get(endpoint)
        return label if label is not None else self._bounded(self._endpoints, endpoint, "endpoint", str)

    def _engine(self, engine: str) -> str:
        label = self._engines.get(engine)
        return label if label is not None else self._bounded(self._engines, engine, "engine", scrub_engine)

    # -- handlers ------------------------------------------------------------------

    def hears(self, moment: str) -> bool:
        """``attempt_ended`` and ``call_ended``: the other two count nothing (unless a subclass overrides them)."""
        return moment in ("attempt_ended", "call_ended") or getattr(type(self), moment) is not getattr(MetricsObserver, moment)

    def call_ended(
        self,
        call_id: int,
        method: str,
        endpoint: str,
        engine: str,
        outcome: CallOutcome,
        status: int | None,
        attempts: int,
        duration_s: float,
        error_type: str | None,
        retry_budget_tokens: float | None,
    ) -> None:
        """``cpr_requests_total`` by one; ``cpr_retry_budget_tokens`` set to the balance, when a budget is in use."""
        try:
            try:
                series = self._c_requests[endpoint, method, outcome]
            except KeyError:
                series = self._hot.counted(self._hot.requests, (self._endpoint(endpoint), method, outcome.value))
                _remember(self._c_requests, (endpoint, method, outcome), series)
            gauge = None
            if retry_budget_tokens is not None:
                try:
                    gauge = self._c_tokens[engine]
                except KeyError:
                    label = self._engine(engine)
                    gauge = self._hot.counted(self._hot.tokens, (label,))
                    _remember(self._c_tokens, engine, gauge)
                    self._init_engine(label)
            with self._hot.lock:
                series.value += 1.0
                if gauge is not None and retry_budget_tokens is not None:
                    gauge.value = retry_budget_tokens
        except Exception:
            log.warning("MetricsObserver failed on CallEnded", exc_info=True)

    def attempt_ended(
        self,
        call_id: int,
        attempt: int,
        method: str,
        endpoint: str,
        engine: str,
        status: int | None,
        outcome: Outcome,
        error_type: str | None,
        sent: bool,
        duration_s: float,
    ) -> None:
        """``cpr_attempts_total`` by one and the duration in ``cpr_attempt_duration_seconds``; the zero series on first sight."""
        try:
            key: tuple[Any, ...] = (endpoint, engine, status) if status is not None else (endpoint, engine, None, error_type, sent, outcome)
            try:
                counter, timed = self._c_attempts[key]
            except KeyError:
                ambiguous = outcome is Outcome.AMBIGUOUS
                label = status_label(status) if status is not None else transport_label(error_type, sent=sent, ambiguous=ambiguous)
                endpoint_label, engine_label = self._endpoint(endpoint), self._engine(engine)
                counter = self._hot.counted(self._hot.attempts, (endpoint_label, engine_label, label))
                timed = self._hot.timed((endpoint_label,))
                _remember(self._c_attempts, key, (counter, timed))
                self._init_engine(engine_label)  # first sight of this key: the engine's zero series exist from now on
                self._init_pair(endpoint_label, engine_label)
            self._hot.observe(counter, timed, duration_s)
        except Exception:
            log.warning("MetricsObserver failed on AttemptEnded", exc_info=True)

    def _child(self, family: Any, endpoint: str, second: str, label: Callable[[str], str]) -> Any:
        """``family``'s child for ``endpoint`` and ``label(second)``, cached by the raw values."""
        key = (family, endpoint, second)
        child = self._children.get(key)
        if child is None:
            child = family.labels(self._endpoint(endpoint), label(second))
            _remember(self._children, key, child)
        return child

    def _retry_scheduled(self, ev: RetryScheduled) -> None:
        self._child(self._m_retries, ev.endpoint, ev.reason, str).inc()

    def _breaker_transitioned(self, ev: BreakerTransitioned) -> None:
        value = BREAKER_STATE_VALUES.get(ev.to_state)
        if value is not None:
            engine = self._engine(ev.engine)
            with self._lock:  # one lock with _init_engine, so a first-sight 0 never overwrites a transition
                self._breaker_seen.add(engine)
                self._m_breaker_state.labels(engine).set(value)

    def _breaker_rejected(self, ev: BreakerRejected) -> None:
        self._child(self._m_breaker_rejections, ev.endpoint, ev.engine, self._engine).inc()

    def _budget_exhausted(self, ev: RetryBudgetExhaustedEvent) -> None:
        self._child(self._m_retry_budget_exhausted, ev.endpoint, ev.engine, self._engine).inc()

    def _phase_ended(self, ev: PhaseEnded) -> None:
        self._m_phase_duration.labels(ev.transition, ev.phase).observe(ev.duration_s)
        self._m_phase_failures.labels(ev.transition, ev.phase).inc(len(ev.failures))  # exists at 0 from the first phase on
        for name in ev.engines:
            self._init_engine(self._engine(name))

    def _transition_ended(self, ev: TransitionEnded) -> None:
        self._m_transitions.labels(ev.transition, "ok" if ev.ok else "failed").inc()
        self._m_transition_ended_at.labels(ev.transition).set(time.time())

    def _engine_state_changed(self, ev: EngineStateChanged) -> None:
        for collector in self._watched:
            collector.hear(ev)

    def _hold_changed(self, ev: HoldChanged) -> None:
        engine = self._engine(ev.engine)
        self._m_engines_held_paused.labels(engine).set(len(ev.holds))
        self._init_engine(engine)


class MetricsServer(NamedTuple):
    """A running metrics endpoint: unpacks as ``(server, port)``; ``close()`` stops it."""

    server: WSGIServer
    """The WSGI server thread's server (``serve_forever`` runs in a daemon thread)."""
    port: int
    """The port really bound (useful with ``port=0``)."""

    def close(self) -> None:
        """Stop serving and release the socket; safe to call once the server is already stopped."""
        self.server.shutdown()
        self.server.server_close()


def start_metrics_server(
    port: int = 0,
    host: str = "127.0.0.1",
    registry: CollectorRegistry | None = None,
) -> MetricsServer:
    """Serve ``registry`` at ``http://host:port/metrics`` from a daemon thread.

    ``port``: 0 (default) lets the OS pick a free port; the real one is
    returned. ``host``: the address to bind, ``127.0.0.1`` by default so the
    endpoint is not exposed beyond the machine unless asked
    (``"0.0.0.0"`` for a Prometheus elsewhere). ``registry``: the registry to
    serve, normally ``observer.registry``; default None serves the
    process-wide ``prometheus_client.REGISTRY``.
    """
    server, _thread = start_http_server(port, addr=host, registry=registry if registry is not None else REGISTRY)
    return MetricsServer(server, int(server.server_port))
