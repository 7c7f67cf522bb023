"""The barrier orchestrator: offload, onload and weight sync across engine groups.

- offload: pause (all) -> barrier -> flush (all) -> barrier -> release (all) -> barrier.
- onload: resume (all) -> barrier -> continue, only on engines whose memory is
  all back and that no other reason holds paused.
- weight sync: a hold over pause -> your update -> the hold released.

Each phase goes to every engine of every offloaded group at once through a
``FanOut``; the next phase starts only when every engine acknowledged. Pause
is owned: each reason takes a hold, and ``continue_generation`` is sent only
when the last hold is gone. When engines fail a phase, ``PhaseFailed`` names
the phase, every failed engine and its cause; engines the transition paused
are rolled back (continued) where that is safe, and the error lists every
engine left paused or released. The orchestrator never restarts anything;
it says what a restart would cost when given a ``RestartBudget``.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import requests

from resilience.budget import RestartBudget
from resilience.deadline import Deadline
from resilience.engine_state import EngineState, EngineTracker
from resilience.errors import AmbiguousOutcome
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
from resilience.fanout import EngineDied, EngineResult, FanOut, PhaseTimeout, ThreadFanOut, engine_name
from resilience.outcome import AttemptRecord, Delivery

__all__ = ["ALL_TAGS", "EngineGroup", "Orchestrator", "PhaseDeadlines", "PhaseFailed", "PhaseReport", "TransitionReport"]

ALL_TAGS: tuple[str, ...] = ("kv_cache", "weights", "cuda_graph")
"""What SGLang releases when ``tags`` is None."""
OFFLOAD_HOLD = "offload"
WEIGHT_SYNC_HOLD = "weight_sync"
_ids = itertools.count(1)


class EngineGroup:
    """Engines that move together. ``needs_offload=False`` groups are skipped by offload and onload (they keep their memory)."""

    def __init__(self, engines: Sequence[Any], needs_offload: bool = True, name: str | None = None) -> None:
        self.engines = tuple(engines)
        self.needs_offload = needs_offload
        self.name = name or "group"
        names = [engine_name(e) for e in self.engines]
        if len(set(names)) != len(names):
            raise ValueError(f"EngineGroup {self.name!r}: engine names must be unique, got {names}")

    def __repr__(self) -> str:
        return f"EngineGroup({self.name!r}, {len(self.engines)} engines, needs_offload={self.needs_offload})"


@dataclass(frozen=True, slots=True)
class PhaseDeadlines:
    """Time limits, seconds: the whole transition, and each phase (capped by what is left of the transition)."""

    transition_s: float = 300.0
    pause_s: float = 90.0
    flush_s: float = 90.0
    release_s: float = 150.0
    resume_s: float = 150.0
    continue_s: float = 60.0

    def __post_init__(self) -> None:
        for name in ("transition_s", "pause_s", "flush_s", "release_s", "resume_s", "continue_s"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"PhaseDeadlines.{name} must be > 0, but was {value!r}")

    def for_phase(self, phase: str) -> float:
        """The cap of one phase (rollback phases use the continue/resume caps)."""
        return float(getattr(self, f"{phase}_s", self.continue_s))


@dataclass(frozen=True, slots=True)
class PhaseReport:
    """One phase as it ran: engines, wall time and the slowest engine's own time."""

    phase: str
    engines: tuple[str, ...]
    duration_s: float
    slowest_s: float


@dataclass(frozen=True, slots=True)
class TransitionReport:
    """A finished transition: its phases in order."""

    transition: str
    duration_s: float
    phases: tuple[PhaseReport, ...] = ()

    @property
    def ideal_s(self) -> float:
        """The sum over phases of the slowest engine: what a perfect fan-out would take."""
        return sum(p.slowest_s for p in self.phases)


class PhaseFailed(RuntimeError):
    """A barrier phase failed on some engines.

    ``failures`` maps each failed engine to its error; ``rolled_back`` lists
    engines continued again; ``left_paused`` maps each engine left paused or
    released to why; ``dead`` lists engines that stopped answering.
    ``restarts_remaining`` is what a restart would leave, when a budget is known.
    """

    def __init__(
        self,
        transition: str,
        phase: str,
        failures: Mapping[str, BaseException],
        *,
        rolled_back: Sequence[str] = (),
        left_paused: Mapping[str, str] | None = None,
        dead: Sequence[str] = (),
        restarts_remaining: int | None = None,
        restart_limit: int | None = None,
    ) -> None:
        self.transition = transition
        self.phase = phase
        self.failures = dict(failures)
        self.rolled_back = tuple(rolled_back)
        self.left_paused = dict(left_paused or {})
        self.dead = tuple(dead)
        self.restarts_remaining = restarts_remaining
        self.restart_limit = restart_limit
        super().__init__(self._message())

    def _message(self) -> str:
        causes = "; ".join(f"{name}: {type(err).__name__}: {_short(err)}" for name, err in sorted(self.failures.items()))
        parts = [f"{self.transition} failed in phase {self.phase!r} on {len(self.failures)} engine(s): {causes}."]
        if self.dead:
            parts.append(f"Dead: {', '.join(self.dead)}.")
        if self.rolled_back:
            parts.append(f"Rolled back (serving again): {', '.join(self.rolled_back)}.")
        if self.left_paused:
            parts.append("Left paused or released: " + "; ".join(f"{k} ({v})" for k, v in sorted(self.left_paused.items())) + ".")
        else:
            parts.append("No engine was left paused or released.")
        if self.restarts_remaining is not None:
            parts.append(
                f"A restart would use 1 of {self.restarts_remaining} remaining (limit {self.restart_limit}); "
                "the orchestrator restarts nothing."
            )
        return " ".join(parts)


def _short(err: BaseException, limit: int = 240) -> str:
    text = " ".join(str(err).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def is_engine_dead(error: BaseException) -> bool:
    """True when the error says the engine is gone: its actor died, or every attempt of the call was refused before sending.

    A ``CircuitOpen`` counts only when the call's own attempts were all refused (the breaker opened on them).
    """
    if isinstance(error, EngineDied):
        return True
    attempts: tuple[AttemptRecord, ...] = getattr(error, "attempts", None) or ()
    if isinstance(error, (ConnectionError, requests.ConnectionError)):
        return bool(attempts) and all(a.delivery is Delivery.NOT_SENT for a in attempts)
    return False


def _maybe_applied(error: BaseException) -> bool:
    """The call may have taken effect (ambiguous): the engine's state is unknown."""
    if isinstance(error, (AmbiguousOutcome, PhaseTimeout)):
        return True  # a call still running at the phase deadline may yet be applied
    attempts: tuple[AttemptRecord, ...] = getattr(error, "attempts", None) or ()
    return bool(attempts) and attempts[-1].delivery is Delivery.MAYBE_APPLIED and not is_engine_dead(error)


@dataclass
class _Transition:
    tid: int
    name: str
    deadline: Deadline
    engines: tuple[str, ...]
    started: float = field(default_factory=time.monotonic)
    phases: list[PhaseReport] = field(default_factory=list)


class Orchestrator:
    """Drives phases across engine groups with owned pauses and rollback.

    ``groups``: one ``EngineGroup`` or several. Engines are anything with the
    ``SGLangClient`` control methods and an ``engine`` name (or Ray engine
    handles through ``resilience.adapters.ray``). ``fanout``: how a phase
    reaches the engines (default ``ThreadFanOut()``). ``deadlines``: the
    transition and phase limits. ``restart_budget``: when given, errors say
    what a restart would leave. ``rollback``: continue engines again after a
    failed transition where safe (default True).
    """

    def __init__(
        self,
        groups: EngineGroup | Sequence[EngineGroup],
        *,
        fanout: FanOut | None = None,
        observers: Sequence[Observer] = (),
        deadlines: PhaseDeadlines | None = None,
        restart_budget: RestartBudget | None = None,
        rollback: bool = True,
    ) -> None:
        self.groups = (groups,) if isinstance(groups, EngineGroup) else tuple(groups)
        self.fanout: FanOut = fanout if fanout is not None else ThreadFanOut()
        self.observers = tuple(observers)
        self.deadlines = deadlines or PhaseDeadlines()
        self.restart_budget = restart_budget
        self.rollback = rollback
        self._engines: dict[str, Any] = {}
        self._offloaded: list[str] = []
        for group in self.groups:
            for engine in group.engines:
                name = engine_name(engine)
                if name in self._engines:
                    raise ValueError(f"engine {name} appears in more than one group")
                self._engines[name] = engine
                if group.needs_offload:
                    self._offloaded.append(name)
        self._trackers = {name: EngineTracker(name) for name in self._engines}
        self._modes: dict[str, str] = {}
        self._retired: set[str] = set()
        self._lock = threading.RLock()

    # -- queries ---------------------------------------------------------------

    def states(self) -> dict[str, EngineState]:
        """Every engine's state as the orchestrator knows it."""
        return {name: t.state for name, t in self._trackers.items()}

    def held(self) -> dict[str, tuple[str, ...]]:
        """The engines held paused on purpose, and by which reasons."""
        return {name: tuple(sorted(t.holds)) for name, t in self._trackers.items() if t.holds}

    def paused_by_us(self, engine: str) -> bool:
        """True when the orchestrator holds ``engine`` paused (its /health would hang ~20 s, then 503: not a fault)."""
        tracker = self._trackers.get(engine)
        return tracker is not None and bool(tracker.holds)

    def released_tags(self, engine: str) -> frozenset[str]:
        """Memory tags the orchestrator released on ``engine`` and has not resumed."""
        return frozenset(self._trackers[engine].released)

    def retire(self, engine: str) -> None:
        """Stop sending phases to ``engine`` (after it died and the caller replaced or dropped it)."""
        with self._lock:
            if engine not in self._engines:
                raise KeyError(f"unknown engine {engine}")
            self._retired.add(engine)

    def _active(self, names: Sequence[str]) -> list[str]:
        return [n for n in names if n not in self._retired and self._trackers[n].state is not EngineState.DEAD]

    # -- transitions -------------------------------------------------------------

    def offload(self, tags: Sequence[str] | None = None, mode: Literal["abort", "retract"] = "abort") -> TransitionReport:
        """Pause all offloaded engines, then flush all, then release ``tags`` (None = all) on all.

        Idempotent: engines already released are not released again.
        ``mode="in_place"`` is refused: it keeps running requests' KV, so flush would fail.
        """
        if mode not in ("abort", "retract"):
            raise ValueError(
                f"offload pause mode must be 'abort' or 'retract', but was {mode!r}: 'in_place' keeps running requests' KV cache, "
                "so flush_cache fails and release would crash the engine"
            )
        wanted = tuple(tags) if tags else ALL_TAGS
        with self._lock:
            names = self._active(self._offloaded)
            tx = self._begin("offload", names)
            try:
                for name in names:
                    self._hold(name, OFFLOAD_HOLD)
                to_pause = [n for n in names if self._trackers[n].state is EngineState.SERVING or self._modes.get(n) == "in_place"]
                failed = self._phase(tx, "pause", "pause_generation", [(n, {"mode": mode}) for n in to_pause], EngineState.PAUSED)
                for n in to_pause:
                    if n not in failed:
                        self._modes[n] = mode
                if failed:
                    self._fail_before_release(tx, "pause", failed, names)
                to_flush = [n for n in names if self._trackers[n].state is EngineState.PAUSED]
                failed = self._phase(tx, "flush", "flush_cache", [(n, {}) for n in to_flush], EngineState.FLUSHED)
                if failed:
                    self._fail_before_release(tx, "flush", failed, names)
                calls = []
                for n in names:
                    t = self._trackers[n]
                    missing = [tag for tag in wanted if tag not in t.released]
                    if missing and t.state in (EngineState.FLUSHED, EngineState.RELEASED):
                        calls.append((n, {"tags": None if not tags and not t.released else missing}))
                failed = self._phase(
                    tx,
                    "release",
                    "release_memory_occupation",
                    calls,
                    EngineState.RELEASED,
                    on_ok=lambda n, kw: self._trackers[n].mark_released(kw["tags"] or ALL_TAGS),
                )
                if failed:
                    self._fail_in_release(tx, failed, [n for n, _ in calls if n not in failed], wanted)
            except BaseException:
                self._end(tx, ok=False)
                raise
            return self._end(tx, ok=True)

    def onload(self, tags: Sequence[str] | None = None) -> TransitionReport:
        """Resume ``tags`` (None = everything released) on all offloaded engines, then continue those whose memory is all back.

        Engines that still have tags released, or that another reason (a weight
        sync) holds paused, stay paused. Idempotent: nothing released, nothing resumed.
        """
        with self._lock:
            names = self._active(self._offloaded)
            tx = self._begin("onload", names)
            try:
                calls = []
                for n in names:
                    t = self._trackers[n]
                    todo = [tag for tag in (tuple(tags) if tags else ALL_TAGS) if tag in t.released]
                    if todo:
                        calls.append((n, {"tags": None if set(todo) == set(ALL_TAGS) else todo}))

                def resumed(n: str, kw: Mapping[str, Any]) -> None:
                    t = self._trackers[n]
                    t.mark_resumed(kw["tags"] or ALL_TAGS)
                    if not t.released:
                        self._move(n, EngineState.RESUMED)

                failed = self._phase(tx, "resume", "resume_memory_occupation", calls, None, on_ok=resumed)
                for n in names:
                    if not self._trackers[n].released:
                        self._unhold(n, OFFLOAD_HOLD)
                cont_failed = self._continue_ready(tx, names, "continue")
                if failed or cont_failed:
                    left = {n: self._why_left(n) for n in names if self._trackers[n].holds or self._trackers[n].released}
                    raise self._error(tx, "resume" if failed else "continue", {**failed, **cont_failed}, rolled_back=(), left=left)
            except BaseException:
                self._end(tx, ok=False)
                raise
            return self._end(tx, ok=True)

    def pause(self, reason: str, mode: Literal["abort", "retract", "in_place"] = "retract") -> TransitionReport:
        """Take a pause hold named ``reason`` on every engine (all groups); engines not yet paused are paused."""
        with self._lock:
            names = self._active(list(self._engines))
            tx = self._begin(reason, names)
            try:
                for n in names:
                    self._hold(n, reason)
                to_pause = [n for n in names if self._trackers[n].state is EngineState.SERVING]
                failed = self._phase(tx, "pause", "pause_generation", [(n, {"mode": mode}) for n in to_pause], EngineState.PAUSED)
                for n in to_pause:
                    if n not in failed:
                        self._modes[n] = mode
                if failed:
                    for n in names:
                        self._unhold(n, reason)
                    rolled, left = self._rollback_continue(tx, [n for n in to_pause], failed)
                    raise self._error(tx, "pause", failed, rolled_back=rolled, left=left)
            except BaseException:
                self._end(tx, ok=False)
                raise
            return self._end(tx, ok=True)

    def unpause(self, reason: str) -> TransitionReport:
        """Release the hold named ``reason``; continue engines that no other hold keeps paused and whose memory is back."""
        with self._lock:
            names = self._active(list(self._engines))
            tx = self._begin(f"{reason}_end", names)
            try:
                for n in names:
                    self._unhold(n, reason)
                failed = self._continue_ready(tx, names, "continue")
                if failed:
                    raise self._error(tx, "continue", failed, rolled_back=(), left={n: self._why_left(n) for n in failed})
            except BaseException:
                self._end(tx, ok=False)
                raise
            return self._end(tx, ok=True)

    @contextmanager
    def weight_sync(self, mode: Literal["abort", "retract", "in_place"] = "retract") -> Iterator[list[Any]]:
        """Hold every engine paused while the body updates weights; the hold is released on exit.

        Inside an offloaded window the engines stay paused afterwards: the
        offload hold remains until onload brings the memory back.
        """
        self.pause(WEIGHT_SYNC_HOLD, mode)
        try:
            yield [self._engines[n] for n in self._active(list(self._engines))]
        finally:
            self.unpause(WEIGHT_SYNC_HOLD)

    # -- internals -----------------------------------------------------------------

    def _begin(self, name: str, engines: Sequence[str]) -> _Transition:
        tx = _Transition(next(_ids), name, Deadline(self.deadlines.transition_s), tuple(engines))
        emit(self.observers, TransitionStarted(tx.tid, name, tx.engines, self.deadlines.transition_s))
        return tx

    def _end(self, tx: _Transition, *, ok: bool) -> TransitionReport:
        duration = time.monotonic() - tx.started
        if ok:
            emit(self.observers, TransitionEnded(tx.tid, tx.name, tx.engines, duration, True))
        return TransitionReport(tx.name, duration, tuple(tx.phases))

    def _move(self, name: str, to: EngineState) -> None:
        previous = self._trackers[name].move(to)
        if previous is not None:
            emit(self.observers, EngineStateChanged(name, str(previous), str(to)))

    def _hold(self, name: str, reason: str) -> None:
        t = self._trackers[name]
        if t.hold(reason):
            emit(self.observers, HoldChanged(name, reason, True, tuple(sorted(t.holds))))

    def _unhold(self, name: str, reason: str) -> None:
        t = self._trackers[name]
        if t.unhold(reason):
            emit(self.observers, HoldChanged(name, reason, False, tuple(sorted(t.holds))))

    def _phase(
        self,
        tx: _Transition,
        phase: str,
        method: str,
        calls: Sequence[tuple[str, Mapping[str, Any]]],
        to: EngineState | None,
        on_ok: Any = None,
    ) -> dict[str, BaseException]:
        """Run one phase on every engine at once; return the failures (engine -> error)."""
        if not calls:
            return {}
        names = tuple(n for n, _ in calls)
        deadline = tx.deadline.cap(self.deadlines.for_phase(phase))
        emit(self.observers, PhaseStarted(tx.tid, tx.name, phase, names, deadline.remaining()))
        t0 = time.monotonic()
        results: list[EngineResult] = self.fanout.call([(self._engines[n], kw) for n, kw in calls], method, deadline)
        failures: dict[str, BaseException] = {}
        for (name, kwargs), result in zip(calls, results, strict=True):
            if result.error is None:
                if to is not None:
                    self._move(name, to)
                if on_ok is not None:
                    on_ok(name, kwargs)
            else:
                failures[name] = result.error
                if is_engine_dead(result.error):
                    self._move(name, EngineState.DEAD)
        duration = time.monotonic() - t0
        tx.phases.append(PhaseReport(phase, names, duration, max((r.duration_s for r in results), default=0.0)))
        emit(
            self.observers,
            PhaseEnded(
                tx.tid,
                tx.name,
                phase,
                names,
                duration,
                tuple(PhaseFailure(n, type(e).__name__, _short(e)) for n, e in failures.items()),
            ),
        )
        return failures

    def _continue_ready(self, tx: _Transition, names: Sequence[str], phase: str) -> dict[str, BaseException]:
        ready = [
            n
            for n in names
            if self._trackers[n].may_continue and self._trackers[n].state in (EngineState.PAUSED, EngineState.FLUSHED, EngineState.RESUMED)
        ]
        failed = self._phase(tx, phase, "continue_generation", [(n, {}) for n in ready], EngineState.SERVING)
        for n in ready:
            if n not in failed:
                self._modes.pop(n, None)
        return failed

    def _rollback_continue(
        self, tx: _Transition, touched: Sequence[str], failed: Mapping[str, BaseException]
    ) -> tuple[list[str], dict[str, str]]:
        """Continue engines this transition paused (and failed ones that may be paused) where nothing else holds them."""
        if not self.rollback:
            return [], {n: self._why_left(n) for n in touched if self._trackers[n].state is not EngineState.SERVING}
        candidates = [n for n in touched if self._trackers[n].state is not EngineState.DEAD and self._trackers[n].may_continue]
        for n in candidates:
            if self._trackers[n].state is EngineState.SERVING:
                self._move(n, EngineState.PAUSED)  # a failed pause may still have paused it
        cont_failed = self._phase(tx, "rollback", "continue_generation", [(n, {}) for n in candidates], EngineState.SERVING)
        rolled = [n for n in candidates if n not in cont_failed]
        left = {
            n: self._why_left(n)
            for n in touched
            if n in cont_failed or (self._trackers[n].state not in (EngineState.SERVING, EngineState.DEAD))
        }
        return rolled, left

    def _fail_before_release(self, tx: _Transition, phase: str, failed: Mapping[str, BaseException], names: Sequence[str]) -> None:
        """Pause or flush failed: nothing is released, so every engine the offload holds can be continued."""
        for n in names:
            self._unhold(n, OFFLOAD_HOLD)
        touched = [n for n in names if self._trackers[n].state is not EngineState.SERVING or n in failed]
        rolled, left = self._rollback_continue(tx, touched, failed)
        raise self._error(tx, phase, failed, rolled_back=rolled, left=left)

    def _fail_in_release(self, tx: _Transition, failed: Mapping[str, BaseException], released: Sequence[str], tags: Sequence[str]) -> None:
        """Release failed on some engines: resume the ones that released, continue every engine whose state is known."""
        left: dict[str, str] = {}
        if self.rollback:
            calls = [(n, {"tags": list(tags)}) for n in released]
            resume_failed = self._phase(
                tx,
                "rollback_resume",
                "resume_memory_occupation",
                calls,
                EngineState.RESUMED,
                on_ok=lambda n, kw: self._trackers[n].mark_resumed(kw["tags"]),
            )
            for n, err in failed.items():
                if _maybe_applied(err):
                    left[n] = "release may have been applied: not resumed (resume of an unreleased tag kills it), not re-released"
            for n in self._active(list(self._trackers)):
                if n not in left and n not in resume_failed and not self._trackers[n].released:
                    self._unhold(n, OFFLOAD_HOLD)
            touched = [n for n in tx.engines if n not in left and self._trackers[n].state is not EngineState.DEAD]
            rolled, more = self._rollback_continue(tx, touched, failed)
            left.update(more)
            for n in resume_failed:
                left.setdefault(n, self._why_left(n))
        else:
            rolled = []
            left = {n: self._why_left(n) for n in tx.engines if self._trackers[n].state is not EngineState.SERVING}
        raise self._error(tx, "release", failed, rolled_back=rolled, left=left)

    def _why_left(self, name: str) -> str:
        t = self._trackers[name]
        parts = [f"state {t.state}"]
        if t.holds:
            parts.append(f"held by {', '.join(sorted(t.holds))}")
        if t.released:
            parts.append(f"released {', '.join(sorted(t.released))}")
        return "; ".join(parts)

    def _error(
        self, tx: _Transition, phase: str, failed: Mapping[str, BaseException], *, rolled_back: Sequence[str], left: Mapping[str, str]
    ) -> PhaseFailed:
        dead = [n for n in tx.engines if self._trackers[n].state is EngineState.DEAD]
        left = {n: why for n, why in left.items() if n not in dead}
        budget = self.restart_budget
        err = PhaseFailed(
            tx.name,
            phase,
            failed,
            rolled_back=rolled_back,
            left_paused=left,
            dead=dead,
            restarts_remaining=None if budget is None else budget.remaining,
            restart_limit=None if budget is None else budget.limit,
        )
        emit(
            self.observers,
            TransitionEnded(tx.tid, tx.name, tx.engines, time.monotonic() - tx.started, False, phase, tuple(rolled_back), tuple(left)),
        )
        return err
