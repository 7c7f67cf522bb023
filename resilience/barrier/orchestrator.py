"""The barrier orchestrator: offload, onload and weight sync across engine groups, without ever killing an engine.

- offload: pause (all) -> barrier -> flush (all) -> barrier -> release (all) -> barrier.
- onload: resume (all) -> barrier -> continue, only on engines whose memory is
  all back and that no other hold keeps paused.
- weight sync: a hold over pause -> your update -> the hold released.

Each phase goes to every engine at once through a ``FanOut``; the next phase
starts only when every engine answered. Per engine the orchestrator keeps what
it knows and what it knows it does not know (``knowledge``); every command is
sent only when its precondition is known to hold: release only to a known
paused and flushed engine for tags known not released; resume only for tags
known released; continue only when nothing is released and no hold remains;
pause and flush (safe to re-send) resolve an unknown "paused". A call whose
outcome is ambiguous makes the facts it touches unknown; an engine with
unknown released tags is quarantined until ``reconcile`` or ``retire``. A call
still running at its phase deadline is awaited before anything else goes to
that engine, so no late command can undo a later one. A transition that
returns has kept its promise; one that could not raises ``PhaseFailed`` naming
every engine it failed on or skipped, and every engine not serving.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, TypeVar

from resilience.barrier.engine import ALL_TAGS, ControlMethod, ControlPlaneEngine, PauseMode
from resilience.barrier.fanout import EngineResult, FanOut, ThreadFanOut, engine_name
from resilience.barrier.knowledge import EngineKnowledge, EngineState, InFlight
from resilience.barrier.outcome import is_engine_dead, outcome_of
from resilience.barrier.types import (
    BarrierBusy,
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

__all__ = ["Orchestrator"]

OFFLOAD_HOLD = "offload"
WEIGHT_SYNC_HOLD = "weight_sync"
_OFFLOAD_TOKEN = 0
"""The offload hold's id: one per engine, taken by offload and dropped once all its memory is back."""
_ids = itertools.count(1)
_tokens = itertools.count(1)
Call = tuple[str, Mapping[str, Any]]
E = TypeVar("E", bound=ControlPlaneEngine)


@dataclass
class _Transition:
    """One running transition; ``held``/``hold`` are set by its body, ``report`` when it ended well."""

    tid: int
    name: str
    deadline: Deadline
    engines: tuple[str, ...]
    started: float
    phases: list[PhaseReport] = field(default_factory=list)
    held: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    hold: HoldToken | None = None
    report: TransitionReport | None = None

    def finished(self) -> TransitionReport:
        """The report of this transition, which ended without raising."""
        assert self.report is not None, f"transition {self.name} has not ended"
        return self.report


class Orchestrator(Generic[E]):
    """Drives phases across engine groups with owned pauses, explicit knowledge and rollback.

    ``groups``: one ``EngineGroup`` or several. Engines are anything that
    satisfies ``ControlPlaneEngine`` and has an ``engine`` name
    (``SGLangClient``, or Ray engine handles through
    ``resilience.adapters.ray``); they are assumed serving with
    nothing released when the orchestrator is built (else ``reconcile`` them).
    ``fanout``: how a phase reaches the engines (default ``ThreadFanOut()``).
    ``deadlines``: the transition and phase limits. ``restart_budget``: when
    given, errors say what a restart would leave. ``rollback``: after a failed
    transition, resume what it released and continue engines where that is
    known safe (default True). ``clock``: times transitions and phases and
    sets their deadlines (default the system clock; waits on threads and
    late calls use real time).

    Thread-safe: transitions run one at a time; ``weight_sync`` bodies may run
    concurrently with each other (each holds its own token), and ``offload``/
    ``onload`` wait for every running body to end (up to ``transition_s``)
    before they start, else raise ``BarrierBusy``.
    """

    def __init__(
        self,
        groups: EngineGroup[E] | Sequence[EngineGroup[E]],
        *,
        fanout: FanOut | None = None,
        observers: Sequence[Observer] = (),
        deadlines: PhaseDeadlines | None = None,
        restart_budget: RestartBudget | None = None,
        rollback: bool = True,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.groups = (groups,) if isinstance(groups, EngineGroup) else tuple(groups)
        self.fanout: FanOut = fanout if fanout is not None else ThreadFanOut()
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
        self._bodies_ended = threading.Condition(self._lock)
        self._bodies: dict[int, int] = {}
        """Thread id -> weight_sync bodies running on it."""

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

    # -- recovery ----------------------------------------------------------------

    def retire(self, engine: str | E) -> None:
        """Stop sending anything to ``engine`` (dead, or replaced): no transition covers or names it again."""
        name = self._name_of(engine)
        with self._lock:
            self._retired.add(name)

    def reconcile(self, engine: str | E, *, released: Iterable[str] | None, paused: bool | None) -> None:
        """Tell the orchestrator ``engine``'s real state, after you checked its memory or restarted it.

        ``released``: the tags released on it now (``()`` for none; None keeps
        what is known and leaves unknown tags unknown). ``paused``: True, False,
        or None when you do not know (the next transition that needs it paused
        pauses it again, which is safe). This lifts the quarantine and a "dead"
        mark. An engine with released memory cannot be serving: ``released``
        with ``paused=False`` is refused. Refused too while a call sent to it
        earlier is still running (reconcile after it lands: it could change the
        state you report).
        """
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
                self._land(name, error)
            before = k.state
            k.reconcile(released=tags, paused=paused)
            if k.released or k.unknown:
                self._hold(name, _OFFLOAD_TOKEN, OFFLOAD_HOLD)
            else:
                self._unhold(name, _OFFLOAD_TOKEN)
            self._announce(name, before)

    # -- transitions -------------------------------------------------------------

    def offload(self, tags: Sequence[str] | None = None, mode: Literal["abort", "retract"] = "abort") -> TransitionReport:
        """Pause all offloaded engines, then flush all, then release ``tags`` (None = all) on all.

        Returns only when every offloaded engine (not retired) is known paused
        with ``tags`` released. Idempotent: tags already released are not
        released again. Engines that are dead, quarantined or still busy with
        a late call are skipped and named in ``PhaseFailed`` after the others
        are done. ``mode="in_place"`` is refused: it keeps running requests' KV,
        so flush would fail. Waits for running ``weight_sync`` bodies first.
        """
        if mode not in ("abort", "retract"):
            raise ValueError(
                f"offload pause mode must be 'abort' or 'retract', but was {mode!r}: 'in_place' keeps running requests' KV cache, "
                "so flush_cache fails and release would crash the engine"
            )
        wanted = _tags(tags, "offload")
        with self._transition("offload", self._offloaded, exclusive=True) as tx:
            names = list(tx.engines)
            skipped = self._settle(tx, names)
            live = [n for n in names if n not in skipped]
            for n in live:
                self._hold(n, _OFFLOAD_TOKEN, OFFLOAD_HOLD)
            to_pause = [n for n in live if self._know[n].paused is not True or self._know[n].pause_mode == "in_place"]
            failed = self._phase(tx, "pause", "pause_generation", [(n, {"mode": mode}) for n in to_pause])
            if failed:
                self._fail_before_release(tx, "pause", failed, live, skipped)
            skipped.update({n: self._why_skipped(n) for n in live if self._know[n].quarantined})
            todo = {n: wanted - self._know[n].released for n in live if n not in skipped}
            todo = {n: missing for n, missing in todo.items() if missing}
            for n in [n for n in todo if not self._know[n].may_flush()]:  # defensive: the pause phase makes this unreachable
                skipped[n] = f"not known paused ({self._know[n].why_not_serving()})"
                del todo[n]
            to_flush = [n for n in todo if not self._know[n].flushed]
            failed = self._phase(tx, "flush", "flush_cache", [(n, {}) for n in to_flush])
            if failed:
                self._fail_before_release(tx, "flush", failed, live, skipped)
            calls: list[Call] = []
            for n, missing in todo.items():
                if all(self._know[n].may_release(t) for t in missing):
                    calls.append((n, {"tags": None if missing == frozenset(ALL_TAGS) else sorted(missing)}))
                else:  # defensive: the phases above make this unreachable
                    skipped[n] = f"not known flushed ({self._know[n].why_not_serving()})"
            failed = self._phase(tx, "release", "release_memory_occupation", calls)
            if failed:
                self._fail_in_release(tx, failed, [c for c in calls if c[0] not in failed], live, skipped)
            self._raise_if_skipped(tx, skipped)
        return tx.finished()

    def onload(self, tags: Sequence[str] | None = None) -> TransitionReport:
        """Resume ``tags`` (None = everything released) on all offloaded engines, then continue those whose memory is all back.

        Returns only when every offloaded engine (not retired) serves, or is
        held paused on purpose (tags still released, or another hold such as a
        weight sync) and named in ``TransitionReport.held``. Idempotent.
        Engines that are dead, quarantined or busy with a late call are skipped
        and named in ``PhaseFailed``. Waits for running ``weight_sync`` bodies first.
        """
        wanted = _tags(tags, "onload")
        with self._transition("onload", self._offloaded, exclusive=True) as tx:
            names = list(tx.engines)
            skipped = self._settle(tx, names)
            skipped.update({n: self._why_skipped(n) for n in names if n not in skipped and self._know[n].quarantined})
            live = [n for n in names if n not in skipped]
            calls: list[Call] = []
            for n in live:
                todo = wanted & self._know[n].released
                if todo:
                    calls.append((n, {"tags": None if todo == frozenset(ALL_TAGS) else sorted(todo)}))
            failed = self._phase(tx, "resume", "resume_memory_occupation", calls)
            for n in live:
                if not self._know[n].released and not self._know[n].unknown:
                    self._unhold(n, _OFFLOAD_TOKEN)
            cont_failed = self._continue_ready(tx, live, "continue")
            if failed or cont_failed:
                raise self._error(tx, "resume" if failed else "continue", {**self._skips(skipped), **failed, **cont_failed})
            self._raise_if_skipped(tx, skipped)
            tx.held = self._held_among(live)
        return tx.finished()

    def pause(self, reason: str, mode: PauseMode = "retract") -> TransitionReport:
        """Take a hold named ``reason`` on every engine (all groups) and pause the ones not known paused.

        Returns the token in ``TransitionReport.hold``; pass it to ``unpause``.
        Holds are owned and counted: two pauses with the same reason are two
        holds. Refused (``PhaseFailed``, nothing sent) when an engine is dead,
        quarantined or busy with a late call; on a failed pause the hold is
        released and the engines it paused are continued where safe.
        """
        return self._pause(reason, mode, body=False)

    def unpause(self, hold: HoldToken | str) -> TransitionReport:
        """Release one hold (a token from ``pause``, or the latest hold with that reason); continue the engines it held
        that no other hold keeps paused and whose memory is back."""
        with self._lock:
            token = self._token(hold)
            with self._transition(f"{token.reason}_end", token.engines) as tx:
                names = list(tx.engines)
                for n in token.engines:
                    self._unhold(n, token.id)
                skipped = self._settle(tx, names)
                live = [n for n in names if n not in skipped]
                failed = self._continue_ready(tx, live, "continue")
                stuck = {n: self._why_skipped(n) for n in live if not self._know[n].holds and not self._know[n].serving and n not in failed}
                skipped.update(stuck)
                if failed:
                    raise self._error(tx, "continue", {**self._skips(skipped), **failed})
                self._raise_if_skipped(tx, skipped)
                tx.held = self._held_among(live)
        return tx.finished()

    @contextmanager
    def weight_sync(self, mode: PauseMode = "retract") -> Iterator[list[E]]:
        """Hold every engine paused while the body updates weights; the hold (this sync's own token) is released on exit.

        Yields the engines (not retired), every one known paused. Re-entrant
        and thread-safe: nested or concurrent syncs each hold their own token,
        and admission reopens only when the last one ends (and memory is back:
        inside an offloaded window the engines stay paused until onload).
        ``offload``/``onload`` never run while a body runs: they wait for it.
        """
        report = self._pause(WEIGHT_SYNC_HOLD, mode, body=True)
        token = report.hold
        assert token is not None
        try:
            yield [self._engines[n] for n in token.engines]
        finally:
            with self._lock:
                me = threading.get_ident()
                self._bodies[me] -= 1
                if not self._bodies[me]:
                    del self._bodies[me]
                self._bodies_ended.notify_all()
            self.unpause(token)

    # -- transition steps ----------------------------------------------------------

    def _pause(self, reason: str, mode: PauseMode, *, body: bool) -> TransitionReport:
        with self._transition(reason, self._engines) as tx:
            names = list(tx.engines)
            skipped = self._settle(tx, names)
            skipped.update({n: self._why_skipped(n) for n in names if n not in skipped and self._know[n].quarantined})
            if skipped:
                raise self._error(tx, "skipped", self._skips(skipped))
            token = HoldToken(next(_tokens), reason, tuple(names))
            for n in names:
                self._hold(n, token.id, reason)
            to_pause = [n for n in names if self._know[n].paused is not True]
            failed = self._phase(tx, "pause", "pause_generation", [(n, {"mode": mode}) for n in to_pause])
            if failed:
                for n in names:
                    self._unhold(n, token.id)
                rolled, rb_failed = self._rollback_continue(tx, names)
                raise self._error(tx, "pause", {**rb_failed, **failed}, rolled_back=rolled)
            if body:
                me = threading.get_ident()
                self._bodies[me] = self._bodies.get(me, 0) + 1
            tx.hold = token
        return tx.finished()

    def _fail_before_release(
        self, tx: _Transition, phase: str, failed: Mapping[str, BaseException], live: Sequence[str], skipped: Mapping[str, str]
    ) -> None:
        """Pause or flush failed: nothing was released by this offload, so engines holding nothing released are continued."""
        for n in live:
            if not self._know[n].released and not self._know[n].unknown:
                self._unhold(n, _OFFLOAD_TOKEN)
        rolled, rb_failed = self._rollback_continue(tx, live)
        raise self._error(tx, phase, {**self._skips(skipped), **rb_failed, **failed}, rolled_back=rolled)

    def _fail_in_release(
        self,
        tx: _Transition,
        failed: Mapping[str, BaseException],
        applied: Sequence[Call],
        live: Sequence[str],
        skipped: Mapping[str, str],
    ) -> None:
        """Release failed on some engines: resume what this offload released, continue every engine whose memory is all back.

        An engine whose release may have been applied is quarantined (neither
        resumed: a resume of an unreleased tag kills it; nor released again).
        """
        rolled: list[str] = []
        rb_failed: dict[str, BaseException] = {}
        if self.rollback:
            rb_failed = self._phase(tx, "rollback_resume", "resume_memory_occupation", applied)
            for n in live:
                if not self._know[n].released and not self._know[n].unknown:
                    self._unhold(n, _OFFLOAD_TOKEN)
            rolled, more = self._rollback_continue(tx, live)
            rb_failed.update(more)
        raise self._error(tx, "release", {**self._skips(skipped), **rb_failed, **failed}, rolled_back=rolled)

    def _rollback_continue(self, tx: _Transition, names: Sequence[str]) -> tuple[list[str], dict[str, BaseException]]:
        """Continue the engines among ``names`` that may be continued (not known serving, nothing released, no hold)."""
        if not self.rollback:
            return [], {}
        ready = [n for n in names if self._know[n].may_continue()]
        failed = self._phase(tx, "rollback", "continue_generation", [(n, {}) for n in ready])
        return [n for n in ready if n not in failed], failed

    def _continue_ready(self, tx: _Transition, names: Sequence[str], phase: str) -> dict[str, BaseException]:
        ready = [n for n in names if self._know[n].may_continue()]
        return self._phase(tx, phase, "continue_generation", [(n, {}) for n in ready])

    # -- phases, late calls and knowledge ---------------------------------------------

    def _phase(self, tx: _Transition, phase: str, method: ControlMethod, calls: Sequence[Call]) -> dict[str, BaseException]:
        """Run one phase on every engine at once, fold each outcome into its knowledge; return the failures."""
        if not calls:
            return {}
        names = tuple(n for n, _ in calls)
        deadline = tx.deadline.cap(self.deadlines.for_phase(phase))
        started = PhaseStarted(transition_id=tx.tid, transition=tx.name, phase=phase, engines=names, deadline_s=deadline.remaining())
        emit(self.observers, started)
        t0 = self.clock.monotonic()
        results: list[EngineResult] = self.fanout.call([(self._engines[n], kw) for n, kw in calls], method, deadline)
        failures: dict[str, BaseException] = {}
        for (name, kwargs), result in zip(calls, results, strict=True):
            k = self._know[name]
            before = k.state
            k.apply(method, kwargs, outcome_of(result.error))
            if result.late is not None:
                k.in_flight = InFlight(method, dict(kwargs), result.late)
            if result.error is not None:
                failures[name] = result.error
                if is_engine_dead(result.error):
                    k.dead = f"{type(result.error).__name__} in {phase}"
            self._announce(name, before)
        duration = self.clock.monotonic() - t0
        tx.phases.append(PhaseReport(phase, names, duration, max((r.duration_s for r in results), default=0.0)))
        failed = tuple(PhaseFailure(engine=n, error_type=type(e).__name__, message=short(e)) for n, e in failures.items())
        ended = PhaseEnded(transition_id=tx.tid, transition=tx.name, phase=phase, engines=names, duration_s=duration, failures=failed)
        emit(self.observers, ended)
        return failures

    def _settle(self, tx: _Transition, names: Sequence[str]) -> dict[str, str]:
        """Wait (up to the continue phase's limit) for calls still in flight; return the engines to skip, with why."""
        deadline = tx.deadline.cap(self.deadlines.for_phase("settle"))
        skipped: dict[str, str] = {}
        for n in names:
            k = self._know[n]
            if k.in_flight is not None:
                landed, error = k.in_flight.call.wait(max(0.0, deadline.remaining()))
                if landed:
                    self._land(n, error)
            if k.dead is not None or k.in_flight is not None:
                skipped[n] = self._why_skipped(n)
        return skipped

    def _land(self, name: str, error: BaseException | None) -> None:
        k = self._know[name]
        before = k.state
        k.land(outcome_of(error))
        if error is not None and is_engine_dead(error):
            k.dead = f"{type(error).__name__} after a late call"
        self._announce(name, before)

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
            emit(self.observers, HoldChanged(engine=name, reason=reason, acquired=True, holds=_reasons(k)))

    def _unhold(self, name: str, token: int) -> None:
        k = self._know[name]
        reason = k.holds.pop(token, None)
        if reason is not None:
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

    def _wait_for_bodies(self, transition: str) -> None:
        """Exclusion: wait (up to ``transition_s``) until no ``weight_sync`` body runs; called under the lock."""
        if self._bodies.get(threading.get_ident()):
            raise BarrierBusy(f"{transition}() was called inside a weight_sync() body on the same thread: it would wait for itself")
        limit = self.deadlines.transition_s
        if not self._bodies_ended.wait_for(lambda: not self._bodies, timeout=limit):
            running = sum(self._bodies.values())
            raise BarrierBusy(f"{transition}() waited {limit} s for {running} weight_sync() body(ies) to end; none was sent anything")

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
    def _transition(self, name: str, engines: Iterable[str], *, exclusive: bool = False) -> Iterator[_Transition]:
        """One transition over the ``engines`` not retired, under the lock: announce it, let the body run, end it.

        ``exclusive`` (offload, onload): first wait for running ``weight_sync``
        bodies (``BarrierBusy`` when they do not end in time; nothing is
        announced then). A body that returns ends the transition well: its
        ``TransitionEnded`` is emitted and ``tx.report`` set from ``tx.held``
        and ``tx.hold``. A body that raises has announced its own end (a
        ``PhaseFailed`` from ``_error``) or ends silently.
        """
        with self._lock:
            if exclusive:
                self._wait_for_bodies(name)
            names = tuple(self._active(engines))
            tx = _Transition(next(_ids), name, Deadline(self.deadlines.transition_s, clock=self.clock), names, self.clock.monotonic())
            started = TransitionStarted(transition_id=tx.tid, transition=name, engines=tx.engines, deadline_s=self.deadlines.transition_s)
            emit(self.observers, started)
            yield tx
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


def _reasons(k: EngineKnowledge) -> tuple[str, ...]:
    return tuple(sorted(set(k.holds.values())))


def _tags(tags: Sequence[str] | None, transition: str) -> frozenset[str]:
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
