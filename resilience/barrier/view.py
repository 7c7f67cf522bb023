"""``BarrierView``: the queries and attributes both orchestrators answer from the ``BarrierState`` they hold."""

from __future__ import annotations

from typing import Any, Generic, TypeVar, overload

from resilience.barrier.journal import Journal, Recovery, RestartBudget
from resilience.barrier.state import BarrierState, EngineGroup, PhaseDeadlines
from resilience.clock import Clock
from resilience.engine_contract import AnyEngine, EngineState, MemoryProbe
from resilience.events import Observer

__all__ = ["BarrierView"]

E = TypeVar("E", bound=AnyEngine)
V = TypeVar("V")


class _OnState(Generic[V]):
    """An orchestrator attribute that lives on its state: read there, and set there."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, view: None, owner: type | None = None) -> _OnState[V]: ...

    @overload
    def __get__(self, view: BarrierView[Any], owner: type | None = None) -> V: ...

    def __get__(self, view: BarrierView[Any] | None, owner: type | None = None) -> V | _OnState[V]:
        if view is None:
            return self
        value: V = getattr(view.state, self.name)
        return value

    def __set__(self, view: BarrierView[Any], value: V) -> None:
        setattr(view.state, self.name, value)


class BarrierView(Generic[E]):
    """The queries and attributes both orchestrators share, answered by the ``BarrierState`` they hold (``state``)."""

    state: BarrierState[E]
    """The engines, their knowledge and the journal: set by the orchestrator's constructor."""

    groups: _OnState[tuple[EngineGroup[E], ...]] = _OnState()
    """The engine groups, as given."""
    observers: _OnState[tuple[Observer, ...]] = _OnState()
    """Who is told of transitions, phases, state and hold changes."""
    deadlines: _OnState[PhaseDeadlines] = _OnState()
    """The transition and phase limits."""
    restart_budget: _OnState[RestartBudget | None] = _OnState()
    """The restart budget errors report (resumed from the journal, when there is one)."""
    rollback: _OnState[bool] = _OnState()
    """Whether a failed transition resumes what it released and continues engines where that is known safe."""
    clock: _OnState[Clock] = _OnState()
    """What times transitions and phases and sets their deadlines."""
    memory_probe: _OnState[MemoryProbe | None] = _OnState()
    """The ``MemoryProbe`` quarantined engines are reconciled from (None: none)."""
    journal: _OnState[Journal | None] = _OnState()
    """The journal the knowledge is written to (None: in memory only)."""
    recovery: _OnState[Recovery | None] = _OnState()
    """What the journal gave back when the orchestrator started (None without a journal)."""

    def close(self) -> None:
        """Let go of the journal (its lock), if there is one. The orchestrator sends nothing more afterwards."""
        self.state.close()

    def states(self) -> dict[str, EngineState]:
        """Every engine's state (not retired ones) as the orchestrator knows it, in one word."""
        return self.state.states()

    def held(self) -> dict[str, tuple[str, ...]]:
        """The engines held paused on purpose, and by which reasons."""
        return self.state.held()

    def paused_by_us(self, engine: str | E) -> bool:
        """True when the orchestrator keeps ``engine`` from serving (a hold, or a pause it sent).

        Its /health then hangs ~20 s and answers 503: not a fault. ``engine``: its name or URL, or any engine object the
        orchestrator was built with. Raises ``KeyError`` naming an engine it does not drive.
        """
        return self.state.paused_by_us(engine)

    def released_tags(self, engine: str | E) -> frozenset[str]:
        """Memory tags known released on ``engine`` (name, URL or engine object)."""
        return self.state.released_tags(engine)

    def quarantined(self) -> dict[str, frozenset[str]]:
        """Engines (not retired) whose released tags are unknown, with those tags: they need ``reconcile`` or ``retire``."""
        return self.state.quarantined()

    def unsettled(self) -> dict[str, frozenset[str]]:
        """Engines (not retired) whose unknown released tags the next transition settles by re-sending (vLLM), with those tags."""
        return self.state.unsettled()

    def weight_versions(self) -> dict[str, str]:
        """Every engine (not retired) whose weight version the orchestrator read (a ``verify`` check, a join's
        ``WeightVersionCheck``), with the version it last reported; what ``cpr_engine_weight_version`` publishes."""
        return self.state.weight_versions()

    def not_serving(self) -> dict[str, str]:
        """Every engine (not retired) not known to serve, with why (what ``PhaseFailed.left_paused`` holds)."""
        return self.state.not_serving()
