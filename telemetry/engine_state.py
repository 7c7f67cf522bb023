"""What the barrier knows of each engine, published at scrape time: ``cpr_engine_state`` and ``cpr_engine_weight_version``.

``EngineStateCollector`` reads an orchestrator's public view at every scrape:
``states()``, each engine's kind and ``weight_versions()``, so the gauges say
what the orchestrator would answer (after a resumed journal too). While a
transition holds the orchestrator's lock, a scrape answers from its last read
with the ``EngineStateChanged`` events heard since laid over it. The labels,
their bounds and the ``other`` engine are in ``telemetry/METRICS.md`` ("What
the barrier knows of each engine"). ``WeightVersionTap`` keeps the versions
read through a fan-out outside the orchestrator too.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Mapping
from typing import Any, Final

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from resilience.barrier import EngineResult, EngineState, FanOut
from resilience.barrier.fanout import Calls, reported_versions
from resilience.barrier.view import BarrierView
from resilience.deadline import Deadline
from resilience.engine_contract import EngineStateChanged

from ._labels import OTHER, scrub_engine

__all__ = [
    "DEFAULT_MAX_ENGINES",
    "ENGINE_STATES",
    "EngineStateCollector",
    "WeightVersionTap",
]

log = logging.getLogger("resilience.telemetry")

DEFAULT_MAX_ENGINES: Final = 256
"""Engines that get their own ``engine`` label in ``cpr_engine_state``; later ones are counted under ``other``."""

RETIRED: Final = "retired"
ENGINE_STATES: Final[tuple[str, ...]] = (*(s.value for s in EngineState), RETIRED)
"""Every value of ``cpr_engine_state``'s ``state`` label."""

_VERSION_MAX: Final = 64
_VERSION_READS: Final = frozenset({"weight_info", "model_info"})

DEFAULT_LOCK_WAIT_S: Final = 0.05
"""Seconds a scrape waits for the orchestrator's lock before it answers from its last read and the changes heard since."""


class WeightVersionTap:
    """A ``FanOut`` that sends every call through ``fanout`` and keeps the weight version each engine last reported.

    ``fanout``: the fan-out that reaches the engines (``ThreadFanOut()``,
    ``RayFanOut()``, ...). Answers to ``weight_info`` (vLLM) and
    ``model_info`` (SGLang) that carry a ``weight_version`` are kept per
    engine name (``versions()``). For reads sent outside the orchestrator
    (which keeps its own, ``weight_versions()``): give the tap to the
    orchestrator as its ``fanout`` and to ``EngineStateCollector`` as its
    ``versions``; the orchestrator's checks find ``check_engines`` through it.
    """

    def __init__(self, fanout: FanOut) -> None:
        self.fanout = fanout
        self._lock = threading.Lock()
        self._versions: dict[str, str] = {}

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.fanout, name)  # check_engines and anything else the wrapped fan-out offers

    def call(self, calls: Calls, method: str, deadline: Deadline) -> list[EngineResult]:
        """``fanout.call(...)``; a version read's answers are remembered before they are handed back."""
        results = self.fanout.call(calls, method, deadline)
        if method in _VERSION_READS:
            self.record(results)
        return results

    def record(self, results: Iterable[EngineResult]) -> None:
        """Keep the ``weight_version`` of every answer that has one (also for reads sent some other way)."""
        seen = {name: version[:_VERSION_MAX] for name, version in reported_versions(results).items()}
        if seen:
            with self._lock:
                self._versions.update(seen)

    def versions(self) -> dict[str, str]:
        """Engine name -> the weight version it last reported through this tap."""
        with self._lock:
            return dict(self._versions)


class EngineStateCollector:
    """A prometheus-client collector of one orchestrator's per-engine state (module docstring).

    ``orchestrator``: an ``Orchestrator`` or ``AsyncOrchestrator`` (read only).
    ``versions``: a ``WeightVersionTap`` (or anything with ``versions() ->
    Mapping[str, str]``) for ``cpr_engine_weight_version``; default None: the
    orchestrator's own ``weight_versions()``. ``max_engines``: engines with
    their own label (default 256, >= 1). ``lock_wait_s``: how long a scrape
    waits for the orchestrator's lock (default 0.05 s, >= 0) before it answers
    from its last read of ``states()`` and the ``EngineStateChanged`` events
    given to ``hear`` since. ``MetricsObserver.watch(orchestrator)`` builds
    one, registers it and passes it the events it hears.
    """

    def __init__(
        self,
        orchestrator: BarrierView[Any],
        *,
        versions: Any = None,
        max_engines: int = DEFAULT_MAX_ENGINES,
        lock_wait_s: float = DEFAULT_LOCK_WAIT_S,
    ) -> None:
        if isinstance(max_engines, bool) or not isinstance(max_engines, int) or max_engines < 1:
            raise ValueError(f"EngineStateCollector.max_engines must be an integer >= 1, but was {max_engines!r}")
        if not lock_wait_s >= 0:
            raise ValueError(f"EngineStateCollector.lock_wait_s must be >= 0 seconds, but was {lock_wait_s!r}")
        if versions is not None and not callable(getattr(versions, "versions", None)):
            raise TypeError(f"EngineStateCollector.versions must have a versions() method (a WeightVersionTap), but was {versions!r}")
        self.orchestrator = orchestrator
        self.versions = versions
        self.max_engines = max_engines
        self.lock_wait_s = lock_wait_s
        self._last: dict[str, str] = {}  # the last states() read
        self._heard: dict[str, str] = {}  # engine -> to_state of EngineStateChanged heard since that read
        self._joined: set[str] = set()  # engines heard ``joining`` since that read (``add``): new to the last read
        self._lock = threading.Lock()
        self._labels: dict[str, str] = {}  # engine name -> its label, the first max_engines met
        self._kinds: dict[str, str] = {}  # engine name -> kind, for engines once seen (a retired one keeps its kind)
        self._warned = False
        self._states()  # the first read, so a scrape during the first transition has one to lay the changes over

    def describe(self) -> Iterable[Metric]:
        """The families this collector owns (lets the registry detect name clashes at registration)."""
        return self._families()

    def collect(self) -> Iterable[Metric]:
        """Read the orchestrator now; never raises (a failure is logged and the scrape gets no engine series)."""
        try:
            return self._collect()
        except Exception:
            log.warning("EngineStateCollector failed to read the orchestrator", exc_info=True)
            return []

    def hear(self, event: object) -> None:
        """Take an ``EngineStateChanged`` (other events are ignored): laid over the last read until the next one."""
        if isinstance(event, EngineStateChanged):
            with self._lock:
                self._heard[event.engine] = event.to_state
                if event.to_state == EngineState.JOINING:
                    self._joined.add(event.engine)

    def _states(self) -> dict[str, str]:
        """``states()`` when the orchestrator's lock comes within ``lock_wait_s``; else the last read plus what was heard."""
        lock = self.orchestrator.state.lock  # what states() waits for
        if lock.acquire(timeout=self.lock_wait_s):
            try:
                states = {name: state.value for name, state in self.orchestrator.states().items()}
            finally:
                lock.release()
            with self._lock:
                self._last, self._heard, self._joined = states, {}, set()
            return states
        with self._lock:
            return {**self._last, **{n: s for n, s in self._heard.items() if n in self._last or n in self._joined}}

    def _collect(self) -> list[Metric]:
        states = self._states()
        kinds = {name: rules.kind for name, rules in dict(self.orchestrator.state.kinds).items()}  # dict(): one copy at once
        with self._lock:
            self._kinds.update(kinds)
            for name in sorted(states.keys() - self._labels.keys()):  # the first max_engines met get a label of their own
                if len(self._labels) < self.max_engines:
                    self._labels[name] = scrub_engine(name)
                elif not self._warned:
                    self._warned = True
                    log.warning(
                        "EngineStateCollector: more than %d engines; further ones are counted under engine=%r", self.max_engines, OTHER
                    )
            retired = {name: RETIRED for name in self._labels if name not in states}
            labels, kinds_known = dict(self._labels), dict(self._kinds)
        state_family, version_family = self._families()
        folded: dict[tuple[str, str], int] = {}
        for name, state in sorted({**states, **retired}.items()):
            kind = kinds_known.get(name, "unknown")
            label = labels.get(name)
            if label is None:
                folded[kind, state] = folded.get((kind, state), 0) + 1
            else:
                state_family.add_metric([label, kind, state], 1.0)
        for (kind, state), count in sorted(folded.items()):
            state_family.add_metric([OTHER, kind, state], float(count))
        known: Mapping[str, str] = self.versions.versions() if self.versions is not None else self.orchestrator.weight_versions()
        for name, version in sorted(known.items()):
            label = labels.get(name)
            if label is not None and name in states:
                version_family.add_metric([label, kinds_known.get(name, "unknown"), version[:_VERSION_MAX]], 1.0)
        return [state_family, version_family]

    @staticmethod
    def _families() -> tuple[GaugeMetricFamily, GaugeMetricFamily]:
        return (
            GaugeMetricFamily(
                "cpr_engine_state",
                "What the barrier knows of each engine: 1 on its one state word (engine=other: how many engines).",
                labels=["engine", "kind", "state"],
            ),
            GaugeMetricFamily(
                "cpr_engine_weight_version",
                "The weight version each engine last reported to the barrier (value 1; the version is the label).",
                labels=["engine", "kind", "version"],
            ),
        )
