"""The barrier's rules, once, for both orchestrators: per-engine knowledge, owned holds, and each transition as steps.

A transition (offload, onload, a pause or its end) is written here as a
generator that never does I/O: it decides what to send, *yields* a step that
says so, and folds what came back into the knowledge before deciding the next.
There are three kinds of step:

- ``PhaseCall``: send ``method`` to these engines at once under ``deadline``;
  the driver fills ``results`` (one ``EngineResult`` per engine).
- ``SettleCall``: wait up to ``deadline`` for these late calls; the driver fills
  ``landed`` with the ones that landed.
- ``WaitCall``: wait until ``deadline`` has passed (what is left of the grace of a
  release or resume that may still be on its way, before the probe is asked again).

``Orchestrator`` drives the steps with a ``FanOut`` on the caller's thread
under one lock; ``AsyncOrchestrator`` awaits them on the caller's event loop,
holding the lock only between steps.

Knowledge is write-ahead: before a ``PhaseCall`` is yielded, each engine's
facts the call may change are marked in flight (``EngineKnowledge.mark``:
where a "maybe applied" would leave them), and only an answer, or the
driver's record that the request never left, settles them. A driver that
stops in the middle (KeyboardInterrupt, SystemExit, a cancelled task, a
fan-out that raised, an observer raising anything) hands the step's results
as far as they go back to ``_abandon``, which folds them in; every call it has
no answer for stays "maybe", so nothing that may have been applied is ever
forgotten. Observers are told after the knowledge changed (every engine of a
phase is folded first), so nothing they raise can undo it.

Every change of the knowledge goes through a place that calls ``_persist``
with the engines it touched, before any command that depends on it is sent.

With a ``MemoryProbe``, an engine whose released tags became unknown (an
ambiguous release or resume) is reconciled from the probe right after the
fold, and again at the start of the next transition; a probe that cannot
prove it leaves the quarantine as it is. Its answer is trusted as the
transport's ``MemoryProbeCheck`` trusts it: "applied" at once; "as before"
at once only after a 502 or 503 (the gateway answered for the request), and
after a request that may still be on its way (the knowledge's ``Doubt``:
a reset or read timeout after sending, a 504, no delivery record, an
interruption) only once ``PhaseDeadlines.in_transit_s`` has passed, which the
start of the next transition waits out (up to its settle limit) before it
asks again. Else a release that lands just after the probe said "not
released" would be released again, and SGLang dies of the double release.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Collection, Generator, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, TypeVar

from resilience.barrier.engine import ALL_TAGS, AnyEngine, ControlMethod
from resilience.barrier.fanout import EngineResult, engine_name, interrupted_results
from resilience.barrier.journal import OFFLOAD_TOKEN, Journal, Recovery, open_journal, restore_budget
from resilience.barrier.journal_store import JournalStore
from resilience.barrier.knowledge import RELEASE, RESUME, Doubt, Effect, EngineKnowledge, EngineState, LateCall, Pending, tags_of
from resilience.barrier.outcome import doubt_of, effect_of, is_engine_dead
from resilience.barrier.types import (
    EngineGroup,
    EngineSkipped,
    HoldToken,
    PhaseDeadlines,
    PhaseFailed,
    PhaseReport,
    TransitionReport,
    short,
)
from resilience.budget import RestartBudget
from resilience.clock import SYSTEM_CLOCK, Clock
from resilience.deadline import Deadline
from resilience.events import (
    EngineStateChanged,
    HoldChanged,
    Observer,
    PhaseEnded,
    PhaseFailure,
    PhaseStarted,
    TransitionEnded,
    TransitionStarted,
    emit,
)
from resilience.memory_probe import MemoryProbe

__all__ = [
    "OFFLOAD_HOLD",
    "WEIGHT_SYNC_HOLD",
    "BarrierRules",
    "PhaseCall",
    "SettleCall",
    "Step",
    "Steps",
    "WaitCall",
    "offload_args",
    "tags_arg",
]

OFFLOAD_HOLD = "offload"
WEIGHT_SYNC_HOLD = "weight_sync"
_OFFLOAD_TOKEN = OFFLOAD_TOKEN
"""The offload hold's id: one per engine, taken by offload and dropped once all its memory is back."""
_ids = itertools.count(1)
_tokens = itertools.count(1)
_tokens_lock = threading.Lock()


def _reserve_tokens(past: int) -> None:
    """Hand out hold ids above ``past`` from now on (a journal resumed holds up to that id)."""
    global _tokens
    with _tokens_lock:
        nxt = next(_tokens)
        _tokens = itertools.count(max(nxt, past + 1))
Call = tuple[str, Mapping[str, Any]]
E = TypeVar("E", bound=AnyEngine)
T = TypeVar("T")


@dataclass
class _Transition:
    """One running transition; ``held``/``hold`` are set by its body, ``report`` when it ended well; ``phase``: the step now."""

    tid: int
    name: str
    deadline: Deadline
    engines: tuple[str, ...]
    started: float
    phases: list[PhaseReport] = field(default_factory=list)
    held: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    hold: HoldToken | None = None
    report: TransitionReport | None = None
    phase: str = "start"

    def finished(self) -> TransitionReport:
        """The report of this transition, which ended without raising."""
        assert self.report is not None, f"transition {self.name} has not ended"
        return self.report


@dataclass(eq=False)
class PhaseCall(Generic[E]):
    """A step: send ``method`` to every engine of ``engines`` (engine, kwargs) at once under ``deadline``.

    The driver sets ``results``, one per engine in order (``FanOut.call``'s contract).
    """

    tx: _Transition
    phase: str
    method: ControlMethod
    calls: tuple[Call, ...]
    engines: list[tuple[E, Mapping[str, Any]]]
    deadline: Deadline
    started: float
    before: Mapping[str, EngineState] = field(default_factory=dict)
    """Each engine's state before the write-ahead mark (``EngineStateChanged`` reports the net change at the fold)."""
    marks: dict[str, Pending] = field(default_factory=dict)
    """Each engine's write-ahead mark for this step: only these are settled by its results."""
    results: list[EngineResult] | None = None
    folded: bool = False


@dataclass(eq=False)
class SettleCall:
    """A step: wait up to ``deadline`` for the late calls in ``late`` (engine name -> call).

    The driver puts each one that landed in ``landed`` (name -> its error, or None).
    """

    late: dict[str, LateCall]
    deadline: Deadline
    landed: dict[str, BaseException | None] = field(default_factory=dict)


@dataclass(eq=False)
class WaitCall:
    """A step: wait until ``deadline`` has passed (the driver sleeps on the orchestrator's clock), then hand back."""

    deadline: Deadline


Step = PhaseCall[Any] | SettleCall | WaitCall
Steps = Generator[Step, None, T]
"""A transition as steps: yields what to send or wait for, returns its result."""


class BarrierRules(Generic[E]):
    """What both orchestrators share: engines, knowledge, holds, queries, recovery, and the transitions as ``Steps``.

    Not used alone: ``Orchestrator`` and ``AsyncOrchestrator`` drive its steps.
    Its arguments are theirs (see ``Orchestrator``). ``_lock`` guards the
    knowledge: queries take it; a driver holds it while a step is decided or
    folded, never while waiting on an engine from an event loop.
    """

    def __init__(
        self,
        groups: EngineGroup[E] | Sequence[EngineGroup[E]],
        *,
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
                raise TypeError(f"{type(self).__name__} groups must be EngineGroup objects, but got {group!r}")
        if memory_probe is not None and not isinstance(memory_probe, MemoryProbe):
            raise TypeError(f"{type(self).__name__} memory_probe must have released_tags(engine), but was {memory_probe!r}")
        self.memory_probe = memory_probe
        self.observers = tuple(observers)
        self.deadlines = deadlines or PhaseDeadlines()
        self.restart_budget = restart_budget
        self.rollback = rollback
        self.clock = clock
        self._engines: dict[str, E] = {}
        self._offloaded: list[str] = []
        for group in self.groups:
            for engine in group.engines:
                name = engine_name(engine)
                if name in self._engines:
                    raise ValueError(f"engine {name} appears in more than one group")
                self._engines[name] = engine
                if group.needs_offload:
                    self._offloaded.append(name)
        self._know = {name: EngineKnowledge(name) for name in self._engines}
        self._retired: set[str] = set()
        self._lock = threading.RLock()
        self._label = "start"
        self._journal_arg = journal
        self.journal: Journal | None = None
        self.recovery: Recovery | None = None
        """What the journal gave back when the orchestrator started (None without a journal)."""

    def _resume(self) -> None:
        """Open the journal given (once every engine was checked) and take up the knowledge, holds, retirements and
        restart budget it kept. Each orchestrator calls this last in its constructor."""
        if self._journal_arg is None:
            return
        journal = open_journal(self._journal_arg)
        try:
            resumed = journal.open(list(self._engines))
        except BaseException:
            journal.close()
            raise
        self.journal, self.recovery = journal, resumed.recovery
        now = self.clock.monotonic()
        for k in resumed.knowledge.values():  # a dead controller's requests may still be on their way: the grace starts again
            if k.doubt is not None:
                k.doubt = Doubt(k.doubt.method, k.doubt.in_transit, k.doubt.delivery, now)
        self._know.update(resumed.knowledge)
        self._retired.update(resumed.retired)
        self.restart_budget = restore_budget(self.restart_budget, resumed.budget)
        _reserve_tokens(max((i for k in resumed.knowledge.values() for i in k.holds), default=0))
        for name, k in resumed.knowledge.items():
            if k.state is not EngineState.SERVING:
                emit(self.observers, EngineStateChanged(engine=name, from_state=str(EngineState.SERVING), to_state=str(k.state)))

    def close(self) -> None:
        """Let go of the journal (its lock), if there is one. The orchestrator sends nothing more afterwards."""
        if self.journal is not None:
            self.journal.close()

    # -- queries ---------------------------------------------------------------

    def states(self) -> dict[str, EngineState]:
        """Every engine's state (not retired ones) as the orchestrator knows it, in one word."""
        with self._lock:
            return {n: k.state for n, k in self._know.items() if n not in self._retired}

    def held(self) -> dict[str, tuple[str, ...]]:
        """The engines held paused on purpose, and by which reasons."""
        with self._lock:
            return {n: _reasons(k) for n, k in self._know.items() if k.holds and n not in self._retired}

    def paused_by_us(self, engine: str | E) -> bool:
        """True when the orchestrator keeps ``engine`` from serving (a hold, or a pause it sent).

        Its /health then hangs ~20 s and answers 503: not a fault. ``engine``:
        its name or URL, or any engine object the orchestrator was built with.
        Raises ``KeyError`` naming an engine it does not drive.
        """
        name = self._name_of(engine)
        with self._lock:
            k = self._know[name]
            return name not in self._retired and (bool(k.holds) or k.paused is not False)

    def released_tags(self, engine: str | E) -> frozenset[str]:
        """Memory tags known released on ``engine`` (name, URL or engine object)."""
        name = self._name_of(engine)
        with self._lock:
            return frozenset(self._know[name].released)

    def quarantined(self) -> dict[str, frozenset[str]]:
        """Engines (not retired) whose released tags are unknown, with those tags: they need ``reconcile`` or ``retire``."""
        with self._lock:
            return {n: frozenset(k.unknown) for n, k in self._know.items() if k.unknown and n not in self._retired}

    def not_serving(self) -> dict[str, str]:
        """Every engine (not retired) not known to serve, with why (what ``PhaseFailed.left_paused`` holds)."""
        with self._lock:
            return {n: k.why_not_serving() for n, k in self._know.items() if n not in self._retired and not k.serving}

    # -- the journal's hook ------------------------------------------------------------

    def _persist(self, names: Collection[str]) -> None:
        """The knowledge of ``names`` changed; called before any command that depends on it is sent.

        With a journal, the facts of ``names`` that changed are written durably before this returns (every
        knowledge change goes through a caller of this hook); without one, nothing happens.
        """
        if self.journal is None or not names:
            return
        pending = sorted({k.pending.method for n in names if (k := self._know[n]).pending is not None})
        why = f"{self._label}: sending {', '.join(pending)}" if pending else self._label
        self.journal.commit(self._know, names, why, retired=self._retired, budget=self.restart_budget)

    # -- recovery (the drivers call these under their own exclusion) -------------------

    def _retire(self, engine: str | E) -> None:
        name = self._name_of(engine)
        with self._lock:
            self._retired.add(name)
            self._label = "retire"
            self._persist((name,))

    def _reconcile(self, engine: str | E, *, released: Iterable[str] | None, paused: bool | None) -> None:
        name = self._name_of(engine)
        tags = None if released is None else frozenset(released)
        if tags is not None and not tags <= frozenset(ALL_TAGS):
            raise ValueError(f"reconcile released must be a subset of {ALL_TAGS}, but was {sorted(tags)}")
        if tags and paused is False:
            raise ValueError(
                f"reconcile {name}: released {sorted(tags)} with paused=False is a state SGLang crashes in (prefill into freed memory)"
            )
        if tags and name not in self._offloaded:
            raise ValueError(f"reconcile {name}: released tags on an engine of a needs_offload=False group (nothing would resume them)")
        with self._lock:
            if name in self._retired:
                raise ValueError(f"reconcile {name}: the engine was retired")
            k = self._know[name]
            if k.in_flight is not None:
                landed, error = k.in_flight.call.wait(0)
                if not landed:
                    late = k.in_flight.method
                    raise RuntimeError(f"reconcile {name}: a late {late} sent earlier is still running; reconcile after it lands")
                before = k.state
                self._land(name, error)
                self._persist((name,))
                self._announce(name, before)
            kept = (k.released | k.unknown) if tags is None else set()
            if kept and paused is False:
                raise ValueError(
                    f"reconcile {name}: released=None keeps {sorted(kept)} released or unknown, and memory released with "
                    "paused=False is a state SGLang crashes in (prefill into freed memory); pass released=() after you "
                    "checked that nothing is released"
                )
            before = k.state
            k.abandon()
            k.reconcile(released=tags, paused=paused)
            self._label = "reconcile"
            self._persist((name,))
            if k.released or k.unknown:
                self._hold(name, _OFFLOAD_TOKEN, OFFLOAD_HOLD)
            else:
                self._unhold(name, _OFFLOAD_TOKEN)
            self._announce(name, before)

    # -- transitions as steps --------------------------------------------------------

    def _offload_steps(self, wanted: frozenset[str], mode: Literal["abort", "retract"]) -> Steps[TransitionReport]:
        with self._transition("offload", self._offloaded) as tx:
            names = list(tx.engines)
            skipped = yield from self._settle(tx, names)
            live = [n for n in names if n not in skipped]
            for n in live:
                self._hold(n, _OFFLOAD_TOKEN, OFFLOAD_HOLD)
            to_pause = [n for n in live if self._know[n].paused is not True or self._know[n].pause_mode == "in_place"]
            failed = yield from self._phase(tx, "pause", "pause_generation", [(n, {"mode": mode}) for n in to_pause])
            if failed:
                raise (yield from self._fail_before_release(tx, "pause", failed, live, skipped))
            skipped.update({n: self._why_skipped(n) for n in live if self._know[n].quarantined})
            todo = {n: wanted - self._know[n].released for n in live if n not in skipped}
            todo = {n: missing for n, missing in todo.items() if missing}
            for n in [n for n in todo if not self._know[n].may_flush()]:  # defensive: the pause phase makes this unreachable
                skipped[n] = f"not known paused ({self._know[n].why_not_serving()})"
                del todo[n]
            to_flush = [n for n in todo if not self._know[n].flushed]
            failed = yield from self._phase(tx, "flush", "flush_cache", [(n, {}) for n in to_flush])
            if failed:
                raise (yield from self._fail_before_release(tx, "flush", failed, live, skipped))
            calls: list[Call] = []
            for n, missing in todo.items():
                if all(self._know[n].may_release(t) for t in missing):
                    calls.append((n, {"tags": None if missing == frozenset(ALL_TAGS) else sorted(missing)}))
                else:  # defensive: the phases above make this unreachable
                    skipped[n] = f"not known flushed ({self._know[n].why_not_serving()})"
            failed = yield from self._phase(tx, "release", "release_memory_occupation", calls)
            if failed:
                raise (yield from self._fail_in_release(tx, failed, [c for c in calls if c[0] not in failed], live, skipped))
            self._raise_if_skipped(tx, skipped)
        return tx.finished()

    def _onload_steps(self, wanted: frozenset[str]) -> Steps[TransitionReport]:
        with self._transition("onload", self._offloaded) as tx:
            names = list(tx.engines)
            skipped = yield from self._settle(tx, names)
            skipped.update({n: self._why_skipped(n) for n in names if n not in skipped and self._know[n].quarantined})
            live = [n for n in names if n not in skipped]
            calls: list[Call] = []
            for n in live:
                todo = wanted & self._know[n].released
                if todo:
                    calls.append((n, {"tags": None if todo == frozenset(ALL_TAGS) else sorted(todo)}))
            failed = yield from self._phase(tx, "resume", "resume_memory_occupation", calls)
            for n in live:
                if not self._know[n].released and not self._know[n].unknown:
                    self._unhold(n, _OFFLOAD_TOKEN)
            cont_failed = yield from self._continue_ready(tx, live, "continue")
            if failed or cont_failed:
                raise self._error(tx, "resume" if failed else "continue", {**self._skips(skipped), **failed, **cont_failed})
            self._raise_if_skipped(tx, skipped)
            tx.held = self._held_among(live)
        return tx.finished()

    def _pause_steps(self, reason: str, mode: str) -> Steps[TransitionReport]:
        """Take a new hold named ``reason`` on every engine and pause the ones not known paused (``pause``, ``weight_sync``)."""
        with self._transition(reason, self._engines) as tx:
            names = list(tx.engines)
            skipped = yield from self._settle(tx, names)
            skipped.update({n: self._why_skipped(n) for n in names if n not in skipped and self._know[n].quarantined})
            if skipped:
                raise self._error(tx, "skipped", self._skips(skipped))
            token = HoldToken(next(_tokens), reason, tuple(names))
            for n in names:
                self._hold(n, token.id, reason)
            to_pause = [n for n in names if self._know[n].paused is not True]
            try:
                failed = yield from self._phase(tx, "pause", "pause_generation", [(n, {"mode": mode}) for n in to_pause])
            except BaseException:  # abandoned mid-phase (cancelled, or the fan-out raised): nobody will own the token
                for n in names:
                    self._unhold(n, token.id)
                raise
            if failed:
                for n in names:
                    self._unhold(n, token.id)
                rolled, rb_failed = yield from self._rollback_continue(tx, names)
                raise self._error(tx, "pause", {**rb_failed, **failed}, rolled_back=rolled)
            tx.hold = token
        return tx.finished()

    def _unpause_steps(self, hold: HoldToken | str) -> Steps[TransitionReport]:
        """Release one hold; continue the engines it held that no other hold keeps paused and whose memory is back."""
        token = self._token(hold)
        with self._transition(f"{token.reason}_end", token.engines) as tx:
            names = list(tx.engines)
            for n in token.engines:
                self._unhold(n, token.id)
            skipped = yield from self._settle(tx, names)
            live = [n for n in names if n not in skipped]
            failed = yield from self._continue_ready(tx, live, "continue")
            stuck = {n: self._why_skipped(n) for n in live if not self._know[n].holds and not self._know[n].serving and n not in failed}
            skipped.update(stuck)
            if failed:
                raise self._error(tx, "continue", {**self._skips(skipped), **failed})
            self._raise_if_skipped(tx, skipped)
            tx.held = self._held_among(live)
        return tx.finished()

    def _fail_before_release(
        self, tx: _Transition, phase: str, failed: Mapping[str, BaseException], live: Sequence[str], skipped: Mapping[str, str]
    ) -> Steps[PhaseFailed]:
        """Pause or flush failed: nothing was released by this offload, so engines holding nothing released are continued."""
        for n in live:
            if not self._know[n].released and not self._know[n].unknown:
                self._unhold(n, _OFFLOAD_TOKEN)
        rolled, rb_failed = yield from self._rollback_continue(tx, live)
        return self._error(tx, phase, {**self._skips(skipped), **rb_failed, **failed}, rolled_back=rolled)

    def _fail_in_release(
        self,
        tx: _Transition,
        failed: Mapping[str, BaseException],
        applied: Sequence[Call],
        live: Sequence[str],
        skipped: Mapping[str, str],
    ) -> Steps[PhaseFailed]:
        """Release failed on some engines: resume what this offload released, continue every engine whose memory is all back.

        An engine whose release may have been applied is quarantined (neither
        resumed: a resume of an unreleased tag kills it; nor released again).
        """
        rolled: list[str] = []
        rb_failed: dict[str, BaseException] = {}
        if self.rollback:
            rb_failed = yield from self._phase(tx, "rollback_resume", "resume_memory_occupation", applied)
            for n in live:
                if not self._know[n].released and not self._know[n].unknown:
                    self._unhold(n, _OFFLOAD_TOKEN)
            rolled, more = yield from self._rollback_continue(tx, live)
            rb_failed.update(more)
        return self._error(tx, "release", {**self._skips(skipped), **rb_failed, **failed}, rolled_back=rolled)

    def _rollback_continue(self, tx: _Transition, names: Sequence[str]) -> Steps[tuple[list[str], dict[str, BaseException]]]:
        """Continue the engines among ``names`` that may be continued (not known serving, nothing released, no hold)."""
        if not self.rollback:
            return [], {}
        ready = [n for n in names if self._know[n].may_continue()]
        failed = yield from self._phase(tx, "rollback", "continue_generation", [(n, {}) for n in ready])
        return [n for n in ready if n not in failed], failed

    def _continue_ready(self, tx: _Transition, names: Sequence[str], phase: str) -> Steps[dict[str, BaseException]]:
        ready = [n for n in names if self._know[n].may_continue()]
        failed = yield from self._phase(tx, phase, "continue_generation", [(n, {}) for n in ready])
        return failed

    # -- phases, late calls and knowledge ---------------------------------------------

    def _phase(self, tx: _Transition, phase: str, method: ControlMethod, calls: Sequence[Call]) -> Steps[dict[str, BaseException]]:
        """One phase on every engine at once; each outcome is folded into its knowledge. Returns the failures.

        Write-ahead: each engine's facts are marked in flight (and persisted) before the step is yielded.
        """
        if not calls:
            return {}
        names = tuple(n for n, _ in calls)
        deadline = tx.deadline.cap(self.deadlines.for_phase(phase))
        started = PhaseStarted(transition_id=tx.tid, transition=tx.name, phase=phase, engines=names, deadline_s=deadline.remaining())
        emit(self.observers, started)
        tx.phase = phase
        self._label = f"{tx.name} {phase}"
        before = {n: self._know[n].state for n in names}
        step = PhaseCall(
            tx, phase, method, tuple(calls), [(self._engines[n], kw) for n, kw in calls], deadline, self.clock.monotonic(), before
        )
        for n, kwargs in calls:
            step.marks[n] = self._know[n].mark(method, kwargs)
        self._persist(names)
        yield step
        assert step.results is not None and len(step.results) == len(step.calls), f"{step.phase}: the driver gave no result per engine"
        return self._fold(step, step.results)

    def _fold(self, step: PhaseCall[Any], results: Sequence[EngineResult | None]) -> dict[str, BaseException]:
        """Fold a phase's results into the knowledge, then report it (once); return the failures.

        Every engine is folded, the memory probe asked and the change persisted
        before any observer hears of it, so nothing an observer raises undoes it.
        """
        step.folded = True
        failures = self._fold_knowledge(step, results)
        tx, phase, names = step.tx, step.phase, tuple(n for n, _ in step.calls)
        duration = self.clock.monotonic() - step.started
        durations = [r.duration_s for r in results if r is not None]
        tx.phases.append(PhaseReport(phase, names, duration, max(durations, default=0.0)))
        for name in names:
            self._announce(name, step.before.get(name, self._know[name].state))
        failed = tuple(PhaseFailure(engine=n, error_type=type(e).__name__, message=short(e)) for n, e in failures.items())
        ended = PhaseEnded(transition_id=tx.tid, transition=tx.name, phase=phase, engines=names, duration_s=duration, failures=failed)
        emit(self.observers, ended)
        return failures

    def _fold_knowledge(self, step: PhaseCall[Any], results: Sequence[EngineResult | None]) -> dict[str, BaseException]:
        """Settle each engine's write-ahead mark from its result (engines already settled are left alone: safe to redo after
        an interruption); ask the probe; persist. A None result is a call whose outcome will never be known: it stays "maybe"."""
        method, phase = step.method, step.phase
        failures: dict[str, BaseException] = {}
        for (name, _kwargs), result in zip(step.calls, results, strict=True):
            k = self._know[name]
            mine = k.pending is not None and k.pending is step.marks.get(name)  # a later step's mark is not this step's to settle
            if result is None:
                if mine:
                    k.abandon()
                    self._doubt(k, method, None)
                failures[name] = _Interrupted(f"{name}: the phase was interrupted while {method} ran; it may have been applied")
                continue
            if mine:
                if result.late is not None:
                    k.late(result.late)
                else:
                    effect = effect_of(result.error)
                    k.settle(effect)
                    if effect is Effect.MAYBE:
                        self._doubt(k, method, result.error)
            if result.error is not None:
                failures[name] = result.error
                if is_engine_dead(result.error) and k.dead is None:
                    k.dead = f"{type(result.error).__name__} in {phase}"
        names = tuple(n for n, _ in step.calls)
        self._persist(names)
        calls = dict(step.calls)
        for name in self._probe(names):  # each engine it settles is persisted on its own
            if name in failures and self._done(self._know[name], method, calls[name]):
                del failures[name]  # the probe proves the call did what it was sent for
        return failures

    def _abandon(self, steps: Steps[Any], step: Step, error: BaseException | None = None) -> None:
        """The driver stopped inside ``step`` (``error``): fold what it learnt, leave the rest "maybe", then close the steps.

        Also after an interruption inside the fold itself: engines already folded are left as they are.
        """
        try:
            if isinstance(step, PhaseCall):
                results: Sequence[EngineResult | None] | None = step.results
                if results is None and error is not None:
                    results = interrupted_results(error)
                if results is None or len(results) != len(step.calls):
                    results = [None] * len(step.calls)
                if step.folded:
                    if any(self._know[n].pending is step.marks.get(n) for n, _ in step.calls):
                        self._fold_knowledge(step, results)
                else:
                    self._fold(step, results)
        finally:
            steps.close()

    def _doubt(self, k: EngineKnowledge, method: str, error: BaseException | None) -> None:
        """A release or resume had a "maybe" effect and left ``k``'s tags unknown: keep why, and whether its request may
        still be on its way (``error`` None: its answer was never read). The caller persists."""
        if method in (RELEASE, RESUME) and k.unknown:
            k.doubt = doubt_of(method, error, self.clock.monotonic())

    @staticmethod
    def _done(k: EngineKnowledge, method: str, kwargs: Mapping[str, Any]) -> bool:
        """The knowledge proves ``method(**kwargs)`` took effect (a release's tags released, a resume's back)."""
        tags = tags_of(kwargs)
        if method == "release_memory_occupation":
            return tags <= k.released and not k.unknown and k.dead is None
        if method == "resume_memory_occupation":
            return not (tags & (k.released | k.unknown)) and k.dead is None
        return False

    def _probe(self, names: Iterable[str], waiting: dict[str, float] | None = None) -> list[str]:
        """Reconcile from the memory probe every engine among ``names`` whose tags are unknown; return those it settled.

        An answer is trusted when it proves the call applied, when the request is not on its way (``Doubt.in_transit``
        False: a 502/503), or once the grace (``PhaseDeadlines.in_transit_for``) has passed since the answer; else the
        engine stays quarantined, and ``waiting`` (when given) gets the seconds of grace left for it.
        """
        probe = self.memory_probe
        if probe is None:
            return []
        settled: list[str] = []
        for name in names:
            k = self._know[name]
            if not k.unknown or k.in_flight is not None or k.pending is not None or name in self._retired:
                continue
            released = self._ask(probe, name)
            if released is None:
                continue
            left = self._grace_left(k, released)
            if left > 0:
                if waiting is not None:
                    waiting[name] = left
                continue
            k.released.update(k.unknown & released)  # known first, then no longer unknown
            k.unknown.clear()
            k.doubt = None
            self._persist((name,))
            if not k.released:
                self._unhold(name, _OFFLOAD_TOKEN)
            settled.append(name)
        return settled

    def _grace_left(self, k: EngineKnowledge, released: frozenset[str]) -> float:
        """Seconds before the probe's answer ``released`` may be trusted for ``k`` (0: now)."""
        doubt = k.doubt
        if doubt is None:  # unknown tags with no record of why (cannot happen through the rules): trusted as before
            return 0.0
        if not doubt.in_transit or doubt.proves_applied(frozenset(k.unknown), released):
            return 0.0
        return max(0.0, doubt.since + self.deadlines.in_transit_for(doubt.method) - self.clock.monotonic())

    @staticmethod
    def _ask(probe: MemoryProbe, name: str) -> frozenset[str] | None:
        """The probe's answer for ``name``, or None when it cannot prove it (None, an error, tags that do not exist)."""
        try:
            answer = probe.released_tags(name)
        except Exception:  # a probe that fails proves nothing: the quarantine stays
            return None
        if not isinstance(answer, (set, frozenset)) or not answer <= frozenset(ALL_TAGS):
            return None
        return frozenset(answer)

    def _settle(self, tx: _Transition, names: Sequence[str]) -> Steps[dict[str, str]]:
        """Start of a transition: drop marks an interruption left, wait (up to the continue phase's limit) for calls still in
        flight, ask the memory probe about quarantined engines; return the engines to skip, with why."""
        stale = [n for n in names if self._know[n].pending is not None]
        for n in stale:
            k = self._know[n]
            method = k.pending.method if k.pending is not None else ""
            k.abandon()
            self._doubt(k, method, None)
        if stale:
            self._persist(stale)
        late = {n: k.in_flight.call for n in names if (k := self._know[n]).in_flight is not None}
        if late:
            tx.phase = "settle"
            step = SettleCall(late, tx.deadline.cap(self.deadlines.for_phase("settle")))
            yield step
            before = {n: self._know[n].state for n in step.landed}
            for n, error in step.landed.items():
                self._land(n, error)
            if step.landed:
                self._persist(tuple(step.landed))
            for n in before:
                self._announce(n, before[n])
        before = {n: self._know[n].state for n in names}
        waiting: dict[str, float] = {}
        settled = self._probe(names, waiting)
        cap = tx.deadline.cap(self.deadlines.for_phase("settle"))
        if waiting and max(waiting.values()) <= cap.remaining():  # a request may still be on its way: wait it out, ask again
            tx.phase = "settle"
            yield WaitCall(tx.deadline.cap(max(waiting.values())))
            settled += self._probe(waiting)
        for n in settled:
            self._announce(n, before[n])
        return {n: self._why_skipped(n) for n in names if self._know[n].dead is not None or self._know[n].in_flight is not None}

    def _land(self, name: str, error: BaseException | None) -> None:
        """Fold a late call that landed (the caller persists and announces)."""
        k = self._know[name]
        effect = effect_of(error)
        late = k.land(effect)
        if late is not None and effect is Effect.MAYBE:
            self._doubt(k, late.method, error)
        if error is not None and is_engine_dead(error):
            k.dead = f"{type(error).__name__} after a late call"

    def _why_skipped(self, name: str) -> str:
        return f"skipped: {self._know[name].why_not_serving()}"

    def _skips(self, skipped: Mapping[str, str]) -> dict[str, BaseException]:
        return {n: EngineSkipped(f"{n} {why}") for n, why in skipped.items()}

    def _raise_if_skipped(self, tx: _Transition, skipped: Mapping[str, str]) -> None:
        if skipped:
            raise self._error(tx, "skipped", self._skips(skipped))

    def _announce(self, name: str, before: EngineState) -> None:
        after = self._know[name].state
        if after is not before:
            emit(self.observers, EngineStateChanged(engine=name, from_state=str(before), to_state=str(after)))

    def _hold(self, name: str, token: int, reason: str) -> None:
        k = self._know[name]
        if token not in k.holds:
            k.holds[token] = reason
            self._persist((name,))
            emit(self.observers, HoldChanged(engine=name, reason=reason, acquired=True, holds=_reasons(k)))

    def _unhold(self, name: str, token: int) -> None:
        k = self._know[name]
        reason = k.holds.pop(token, None)
        if reason is not None:
            self._persist((name,))
            emit(self.observers, HoldChanged(engine=name, reason=reason, acquired=False, holds=_reasons(k)))

    def _token(self, hold: HoldToken | str) -> HoldToken:
        if isinstance(hold, HoldToken):
            return hold
        ids = {i for k in self._know.values() for i, r in k.holds.items() if r == hold and i != _OFFLOAD_TOKEN}
        if not ids:
            raise KeyError(f"unpause: no hold named {hold!r} is held")
        latest = max(ids)
        return HoldToken(latest, hold, tuple(n for n, k in self._know.items() if latest in k.holds))

    def _held_among(self, names: Sequence[str]) -> dict[str, tuple[str, ...]]:
        return {n: _reasons(self._know[n]) for n in names if self._know[n].holds}

    def _active(self, names: Iterable[str]) -> list[str]:
        return [n for n in names if n not in self._retired]

    def _name_of(self, engine: str | E) -> str:
        """The name of an engine given by name, URL, or any engine object the orchestrator was built with."""
        if isinstance(engine, str):
            key = engine.rstrip("/")
            if key in self._engines:
                return key
            for name, candidate in self._engines.items():
                if getattr(candidate, "base_url", None) == key:
                    return name
        else:
            for name, candidate in self._engines.items():
                if candidate is engine:
                    return name
            name = engine_name(engine)
            if name in self._engines:
                return name
        raise KeyError(f"unknown engine {engine!r}: this orchestrator drives {', '.join(self._engines) or 'no engines'}")

    # -- transitions' start, end and errors ---------------------------------------------

    @contextmanager
    def _transition(self, name: str, engines: Iterable[str]) -> Iterator[_Transition]:
        """One transition over the ``engines`` not retired: announce it, let the body run, end it.

        A body that returns ends the transition well: its ``TransitionEnded`` is
        emitted and ``tx.report`` set from ``tx.held`` and ``tx.hold``. A body
        that raises ``PhaseFailed`` has announced its own end (``_error``); any
        other exception (the driver abandoned the steps: a cancelled task, a
        fan-out that raised) ends it with ``ok=False`` and the step it was in.
        """
        names = tuple(self._active(engines))
        tx = _Transition(next(_ids), name, Deadline(self.deadlines.transition_s, clock=self.clock), names, self.clock.monotonic())
        self._label = name
        started = TransitionStarted(transition_id=tx.tid, transition=name, engines=tx.engines, deadline_s=self.deadlines.transition_s)
        emit(self.observers, started)
        try:
            yield tx
        except PhaseFailed:
            raise
        except BaseException:
            duration = self.clock.monotonic() - tx.started
            left = tuple(self.not_serving())
            ended = TransitionEnded(
                transition_id=tx.tid, transition=tx.name, engines=tx.engines, duration_s=duration, ok=False, failed_phase=tx.phase,
                left_paused=left,
            )
            emit(self.observers, ended)
            raise
        duration = self.clock.monotonic() - tx.started
        ended = TransitionEnded(transition_id=tx.tid, transition=tx.name, engines=tx.engines, duration_s=duration, ok=True)
        emit(self.observers, ended)
        tx.report = TransitionReport(tx.name, duration, tuple(tx.phases), dict(tx.held), tx.hold)

    def _error(
        self, tx: _Transition, phase: str, failed: Mapping[str, BaseException], *, rolled_back: Sequence[str] = ()
    ) -> PhaseFailed:
        left = self.not_serving()
        dead = [n for n in left if self._know[n].dead is not None]
        budget = self.restart_budget
        err = PhaseFailed(
            tx.name,
            phase,
            failed,
            rolled_back=rolled_back,
            left_paused=left,
            quarantined=sorted(self.quarantined()),
            dead=dead,
            restarts_remaining=None if budget is None else budget.remaining,
            restart_limit=None if budget is None else budget.limit,
        )
        duration = self.clock.monotonic() - tx.started
        emit(
            self.observers,
            TransitionEnded(
                transition_id=tx.tid,
                transition=tx.name,
                engines=tx.engines,
                duration_s=duration,
                ok=False,
                failed_phase=phase,
                rolled_back=tuple(rolled_back),
                left_paused=tuple(left),
            ),
        )
        return err


class _Interrupted(RuntimeError):
    """The failure of a call whose phase was interrupted before its answer was read: it may have been applied."""


def _reasons(k: EngineKnowledge) -> tuple[str, ...]:
    return tuple(sorted(set(k.holds.values())))


def tags_arg(tags: Sequence[str] | None, transition: str) -> frozenset[str]:
    """``tags`` as a set (None or empty: every tag), refusing a bare string and unknown tags with a message naming them."""
    if isinstance(tags, str):
        raise TypeError(f"{transition} tags must be a sequence of tag names, but was the string {tags!r}")
    wanted = frozenset(tags) if tags else frozenset(ALL_TAGS)
    unknown = wanted - frozenset(ALL_TAGS)
    if unknown:
        raise ValueError(
            f"{transition} tags must be among {ALL_TAGS}, but got {sorted(unknown)} "
            "(SGLang ignores an unknown tag on release, then dies of a KeyError on its resume)"
        )
    return wanted


def offload_args(tags: Sequence[str] | None, mode: str) -> frozenset[str]:
    """Check an offload's arguments before anything is sent; return the tags to release."""
    if mode not in ("abort", "retract"):
        raise ValueError(
            f"offload pause mode must be 'abort' or 'retract', but was {mode!r}: 'in_place' keeps running requests' KV cache, "
            "so flush_cache fails and release would crash the engine"
        )
    return tags_arg(tags, "offload")
