"""``BarrierRules``: what the barrier knows, held by each orchestrator: engines, per-engine knowledge, the journal, queries.

Both orchestrators hold one (``Orchestrator.rules``, ``AsyncOrchestrator.rules``)
and hand it to the transitions, written once as steps that never do I/O
(``resilience.barrier.steps``), one module per job:

- ``offload``, ``onload``, ``pauses``: the transitions (``offload_steps``,
  ``onload_steps``, ``pause_steps``/``unpause_steps``);
- ``fold``: one phase (write-ahead mark, then its results folded in) and
  ``abandon`` for a driver that stopped inside a step;
- ``settle``: a transition's start (late calls, the memory probe);
- ``holds``: owned holds; ``recovery``: ``reconcile``, ``retire``, and the
  journal resumed; ``transition``: a transition's start, end and errors.

Knowledge is write-ahead: before a ``PhaseCall`` is yielded, each engine's
facts the call may change are marked in flight (``EngineKnowledge.mark``:
where a "maybe applied" would leave them), and only an answer, or the
driver's record that the request never left, settles them. A driver that
stops in the middle (KeyboardInterrupt, SystemExit, a cancelled task, a
fan-out that raised, an observer raising anything) hands the step's results
as far as they go back to ``fold.abandon``, which folds them in; every call
it has no answer for stays "maybe", so nothing that may have been applied is
ever forgotten. Observers are told after the knowledge changed (every engine
of a phase is folded first), so nothing they raise can undo it.

Every change of the knowledge goes through a place that calls ``persist``
with the engines it touched, before any command that depends on it is sent.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Collection, Iterable, Sequence
from typing import Generic, TypeVar

from resilience.barrier.engine import AnyEngine, ControlMethod
from resilience.barrier.fanout import engine_name
from resilience.barrier.journal import Journal, Recovery
from resilience.barrier.journal_store import JournalStore
from resilience.barrier.kinds import EngineRules, rules_of
from resilience.barrier.knowledge import EngineKnowledge, EngineState
from resilience.barrier.types import EngineGroup, PhaseDeadlines
from resilience.budget import RestartBudget
from resilience.clock import SYSTEM_CLOCK, Clock
from resilience.events import EngineStateChanged, Observer, emit
from resilience.memory_probe import MemoryProbe

__all__ = ["BarrierRules", "reasons"]

E = TypeVar("E", bound=AnyEngine)


class BarrierRules(Generic[E]):
    """The engines an orchestrator drives and what it knows of each: held by ``Orchestrator`` and ``AsyncOrchestrator``.

    Its arguments are the orchestrators' (see ``Orchestrator``); ``owner``
    names the orchestrator in error messages. ``lock`` guards the knowledge:
    queries take it; a driver holds it while a step is decided or folded,
    never while waiting on an engine from an event loop. The transitions'
    modules read and change ``know``, ``retired`` and ``label`` directly.
    """

    def __init__(
        self,
        groups: EngineGroup[E] | Sequence[EngineGroup[E]],
        *,
        owner: str = "Orchestrator",
        observers: Sequence[Observer] = (),
        deadlines: PhaseDeadlines | None = None,
        restart_budget: RestartBudget | None = None,
        rollback: bool = True,
        clock: Clock = SYSTEM_CLOCK,
        memory_probe: MemoryProbe | None = None,
        journal: Journal | JournalStore | str | os.PathLike[str] | None = None,
    ) -> None:
        self.groups = (groups,) if isinstance(groups, EngineGroup) else tuple(groups)
        for group in self.groups:
            if not isinstance(group, EngineGroup):
                raise TypeError(f"{owner} groups must be EngineGroup objects, but got {group!r}")
        if memory_probe is not None and not isinstance(memory_probe, MemoryProbe):
            raise TypeError(f"{owner} memory_probe must have released_tags(engine), but was {memory_probe!r}")
        self.memory_probe = memory_probe
        self.observers = tuple(observers)
        self.deadlines = deadlines or PhaseDeadlines()
        self.restart_budget = restart_budget
        self.rollback = rollback
        self.clock = clock
        self.engines: dict[str, E] = {}
        """Name -> engine, every engine of every group."""
        self.offloaded: list[str] = []
        """The engines of ``needs_offload`` groups: what offload and onload cover."""
        self.group_of: dict[str, int] = {}
        """Name -> the index in ``groups`` of the group it belongs to (an engine ``add`` brought in too)."""
        for i, group in enumerate(self.groups):
            for engine in group.engines:
                name = engine_name(engine)
                if name in self.engines:
                    raise ValueError(f"engine {name} appears in more than one group")
                self.engines[name] = engine
                self.group_of[name] = i
                if group.needs_offload:
                    self.offloaded.append(name)
        self.joining: set[str] = set()
        """Engines ``add`` is bringing to their group's state (``resilience.barrier.membership``): no transition covers
        them, and ``states`` calls them ``joining``."""
        self.fenced: dict[str, str] = {}
        """Engines taken out of every transition, with why (a join that failed, partial progress): ``states`` calls them
        ``fenced``; ``add`` brings one back, ``retire`` ends it."""
        self.kinds: dict[str, EngineRules] = {name: rules_of(engine) for name, engine in self.engines.items()}
        """Name -> its engine kind's control rules (``resilience.barrier.kinds``: SGLang's unless the engine says otherwise)."""
        self.know = {name: EngineKnowledge(name, memory=self.kinds[name].memory) for name in self.engines}
        self.retired: set[str] = set()
        self.lock = threading.RLock()
        self.label = "start"
        """What is under way, for the journal's records (``why``)."""
        self.journal_arg = journal
        """The journal as given; ``recovery.resume`` opens it once the orchestrator checked its engines."""
        self.journal: Journal | None = None
        self.recovery: Recovery | None = None
        """What the journal gave back when the orchestrator started (None without a journal)."""
        self.unchecked: set[str] = set()
        """Engines the resumed journal calls paused or released that no transition has checked yet against what can be
        read (the memory probe, the engine's ``ServingRead``): the next transition's start does (``recovery.recheck``)."""
        self.repause: set[str] = set()
        """Engines the resumed journal calls paused, with nothing released, that this orchestrator has not paused itself
        yet: the next offload or pause sends pause (and offload flush) to them again, both safe to repeat."""
        self.replaced: dict[str, str] = {}
        """Engines found replaced by a fresh process since the journal was written, with what showed it (``recovery``)."""

    def close(self) -> None:
        """Let go of the journal (its lock), if there is one. The orchestrator sends nothing more afterwards."""
        if self.journal is not None:
            self.journal.close()

    # -- queries ---------------------------------------------------------------

    def states(self) -> dict[str, EngineState]:
        """Every engine's state (not retired ones) as the orchestrator knows it, in one word (``joining`` and ``fenced``
        for the engines ``resilience.barrier.membership`` keeps out of the transitions)."""
        with self.lock:
            return {n: self.state_of(n, k) for n, k in self.know.items() if n not in self.retired}

    def state_of(self, name: str, k: EngineKnowledge) -> EngineState:
        """``name``'s one word: ``joining``/``fenced`` for an engine kept out of the transitions, else its knowledge's."""
        if name in self.joining:
            return EngineState.JOINING
        return EngineState.FENCED if name in self.fenced else k.state

    def held(self) -> dict[str, tuple[str, ...]]:
        """The engines held paused on purpose, and by which reasons."""
        with self.lock:
            return {n: reasons(k) for n, k in self.know.items() if k.holds and n not in self.retired}

    def paused_by_us(self, engine: str | E) -> bool:
        """True when the orchestrator keeps ``engine`` from serving (a hold, or a pause it sent).

        Its /health then hangs ~20 s and answers 503: not a fault. ``engine``:
        its name or URL, or any engine object the orchestrator was built with.
        Raises ``KeyError`` naming an engine it does not drive.
        """
        name = self.name_of(engine)
        with self.lock:
            k = self.know[name]
            return name not in self.retired and (bool(k.holds) or k.paused is not False)

    def released_tags(self, engine: str | E) -> frozenset[str]:
        """Memory tags known released on ``engine`` (name, URL or engine object)."""
        name = self.name_of(engine)
        with self.lock:
            return frozenset(self.know[name].released)

    def quarantined(self) -> dict[str, frozenset[str]]:
        """Engines (not retired) whose released tags are unknown, with those tags: they need ``reconcile`` or ``retire``.

        Engines of a kind whose calls are re-sent instead (vLLM) are not quarantined; ``unsettled`` names theirs.
        """
        with self.lock:
            return {n: frozenset(k.unknown) for n, k in self.know.items() if k.quarantined and n not in self.retired}

    def unsettled(self) -> dict[str, frozenset[str]]:
        """Engines (not retired) with unknown released tags that the next transition settles by re-sending (vLLM), with those tags."""
        with self.lock:
            return {n: frozenset(k.unknown) for n, k in self.know.items() if k.unknown and not k.quarantined and n not in self.retired}

    def not_serving(self) -> dict[str, str]:
        """Every engine (not retired) not known to serve, with why (what ``PhaseFailed.left_paused`` holds)."""
        with self.lock:
            out = {n: k.why_not_serving() for n, k in self.know.items() if n not in self.retired and not k.serving}
            out.update({n: f"joining: not in its group's state yet ({out.get(n) or 'serving'})" for n in self.joining})
            out.update({n: f"fenced: {why}" for n, why in self.fenced.items() if n not in self.retired})
            return out

    # -- what the transitions' modules share ---------------------------------------------

    def persist(self, names: Collection[str]) -> None:
        """The knowledge of ``names`` changed; called before any command that depends on it is sent.

        With a journal, the facts of ``names`` that changed are written durably before this returns (every
        knowledge change goes through a caller of this hook); without one, nothing happens.
        """
        if self.journal is None or not names:
            return
        pending = sorted({k.pending.method for n in names if (k := self.know[n]).pending is not None})
        why = f"{self.label}: sending {', '.join(pending)}" if pending else self.label
        self.journal.commit(self.know, names, why, retired=self.retired, budget=self.restart_budget)

    def allows(self, name: str, method: ControlMethod, tags: frozenset[str] = frozenset()) -> bool:
        """``method`` (naming ``tags``) may be sent to ``name`` now, by its engine kind's table (``EngineRules.allows``)."""
        return self.kinds[name].allows(self.know[name], method, tags)

    def announce(self, name: str, before: EngineState) -> None:
        """Tell the observers that ``name``'s state changed from ``before`` (nothing when it did not)."""
        after = self.know[name].state
        if after is not before:
            emit(self.observers, EngineStateChanged(engine=name, from_state=str(before), to_state=str(after)))

    def why_skipped(self, name: str) -> str:
        """Why a transition skips ``name``, for ``EngineSkipped``."""
        return f"skipped: {self.know[name].why_not_serving()}"

    def why_no_weight_sync(self, name: str) -> str:
        """Why a weight sync must not start on ``name`` (its ``weights`` are known released), or "" when nothing stops it.

        A weight update into released or slept weights kills the engine (vLLM #57853 / #57854: the EngineCore
        segfaults; smg #2529), and neither SGLang 0.5.23 nor vLLM 0.33.0 refuses it itself, so ``weight_sync``
        refuses the whole sync before pausing anyone (weights that may be released are refused as unknown).
        """
        k = self.know[name]
        if "weights" not in k.released:
            return ""
        return f"refused: its weights are released (state {k.state}); a weight update would kill it: onload(tags=['weights']) first"

    def active(self, names: Iterable[str]) -> list[str]:
        """``names`` without the retired, joining and fenced engines (``resilience.barrier.membership``)."""
        return [n for n in names if n not in self.retired and n not in self.fenced and n not in self.joining]

    def name_of(self, engine: str | E) -> str:
        """The name of an engine given by name, URL, or any engine object the orchestrator was built with."""
        if isinstance(engine, str):
            key = engine.rstrip("/")
            if key in self.engines:
                return key
            for name, candidate in self.engines.items():
                if getattr(candidate, "base_url", None) == key:
                    return name
        else:
            for name, candidate in self.engines.items():
                if candidate is engine:
                    return name
            name = engine_name(engine)
            if name in self.engines:
                return name
        raise KeyError(f"unknown engine {engine!r}: this orchestrator drives {', '.join(self.engines) or 'no engines'}")


def reasons(k: EngineKnowledge) -> tuple[str, ...]:
    """The reasons of ``k``'s holds, sorted, each once."""
    return tuple(sorted(set(k.holds.values())))
