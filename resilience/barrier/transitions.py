"""The barrier's transitions as steps, written once for both orchestrators, with no I/O: offload, onload, a pause
and its end, the check of a resumed journal, recovery.

A transition is a generator over a ``BarrierState`` (``resilience.barrier.state``): it decides what to send, *yields*
a step that says so (``PhaseStep``, ``SettleStep``, ``WaitStep``, ``ReadStep``), and folds what came back into the
knowledge before deciding the next. The drivers (``Orchestrator``: threads; ``AsyncOrchestrator``: an event loop)
serve each step and hand it back filled in; a driver stopped inside a step hands it to ``abandon``. Each transition
starts by settling (``settle``), then sends its phases (``phase``: write-ahead, then the fold).

What each call needs known first is the engine kind's table (``resilience.engine_contract``); what to release and
resume, and which calls are re-sent, its memory model (``to_release``, ``resume_phases``, ``resend``); holds are
owned and counted (``EngineKnowledge.holds``, ``hold``).
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
from collections.abc import Generator, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Final, Generic, Literal, TypeVar

from resilience.barrier.fanout import EngineResult, LateCall, interrupted_results
from resilience.barrier.journal import FENCED, JOINING, OFFLOAD_TOKEN, open_journal, restore_budget
from resilience.barrier.state import (
    RELEASE,
    RESUME,
    BarrierState,
    Doubt,
    Effect,
    EngineKnowledge,
    EngineSkipped,
    HoldToken,
    Pending,
    PhaseEnded,
    PhaseFailed,
    PhaseFailure,
    PhaseReport,
    PhaseStarted,
    TransitionEnded,
    TransitionReport,
    TransitionStarted,
    doubt_of,
    effect_of,
    is_engine_dead,
    reasons,
    short,
)
from resilience.deadline import Deadline
from resilience.engine_contract import (
    ALL_TAGS,
    RESEND_ROUNDS,
    AnyEngine,
    ControlMethod,
    EngineState,
    EngineStateChanged,
    HoldChanged,
    MemoryProbe,
)
from resilience.events import emit

__all__ = [
    "OFFLOAD_HOLD", "WEIGHT_SYNC_HOLD", "PhaseStep", "ReadStep", "SettleStep", "Step", "Steps", "Transition", "WaitStep",
    "abandon", "continue_ready", "error", "hold", "offload_args", "offload_steps", "onload_steps", "pause_steps", "phase",
    "recheck", "reconcile", "resend", "resume", "resume_phases", "settle", "skips", "tags_arg", "to_release", "to_resume",
    "transition", "unhold", "unpause_steps",
]


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


OFFLOAD_HOLD = "offload"
"""The offload hold's reason."""
WEIGHT_SYNC_HOLD = "weight_sync"
"""The reason of the hold ``weight_sync`` takes."""
_tokens = itertools.count(1)
_tokens_lock = threading.Lock()


def new_token(reason: str, engines: Sequence[str]) -> HoldToken:
    """A hold token with a new id (unique in this process, and above any id a resumed journal holds)."""
    with _tokens_lock:
        return HoldToken(next(_tokens), reason, tuple(engines))


def reserve_tokens(past: int) -> None:
    """Hand out hold ids above ``past`` from now on (a journal resumed holds up to that id)."""
    global _tokens
    with _tokens_lock:
        nxt = next(_tokens)
        _tokens = itertools.count(max(nxt, past + 1))


def hold(state: BarrierState[Any], name: str, token: int, reason: str) -> None:
    """Take hold ``token`` (``reason``) on ``name``, persisted, then announced; nothing when it is held already.

    A record that could not be written (``persist`` raised) takes the hold back out of memory before the error goes on."""
    k = state.know[name]
    if token not in k.holds:
        k.holds[token] = reason
        try:
            state.persist((name,))
        except BaseException:  # not written (a full disk): no hold in memory either, or nobody would ever end it
            k.holds.pop(token, None)
            raise
        emit(state.observers, HoldChanged(engine=name, reason=reason, acquired=True, holds=reasons(k)))


def unhold(state: BarrierState[Any], name: str, token: int) -> None:
    """Drop hold ``token`` on ``name``, persisted, then announced; nothing when it is not held."""
    k = state.know[name]
    reason = k.holds.pop(token, None)
    if reason is not None:
        state.persist((name,))
        emit(state.observers, HoldChanged(engine=name, reason=reason, acquired=False, holds=reasons(k)))


def end_offload_hold(state: BarrierState[Any], names: Iterable[str]) -> None:
    """Drop the offload hold on each engine of ``names`` whose memory is all back (nothing released or unknown)."""
    for n in names:
        if not state.know[n].released and not state.know[n].unknown:
            unhold(state, n, OFFLOAD_TOKEN)


def token_of(state: BarrierState[Any], hold: HoldToken | str) -> HoldToken:
    """``hold`` as a token: itself, or the latest hold with that reason (``KeyError`` when none is held)."""
    if isinstance(hold, HoldToken):
        return hold
    ids = {i for k in state.know.values() for i, r in k.holds.items() if r == hold and i != OFFLOAD_TOKEN}
    if not ids:
        raise KeyError(f"unpause: no hold named {hold!r} is held")
    latest = max(ids)
    return HoldToken(latest, hold, tuple(n for n, k in state.know.items() if latest in k.holds))


def held_among(state: BarrierState[Any], names: Sequence[str]) -> dict[str, tuple[str, ...]]:
    """The engines among ``names`` that some hold keeps paused, with the reasons (``TransitionReport.held``)."""
    return {n: reasons(state.know[n]) for n in names if state.know[n].holds}


EngineCall = tuple[str, Mapping[str, Any]]
"""One engine's call in a phase: (engine name, kwargs)."""
E = TypeVar("E", bound=AnyEngine)
T = TypeVar("T")


@dataclass
class Transition:
    """One running transition; ``held``/``hold`` are set by its body, ``report`` when it ended well; ``phase``: the step now."""

    tid: int
    name: str
    deadline: Deadline
    engines: tuple[str, ...]
    started: float
    phases: list[PhaseReport] = field(default_factory=list)
    held: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    hold: HoldToken | None = None
    replaced: dict[str, str] = field(default_factory=dict)
    """Engines this transition found replaced by a fresh process since the journal was written, with why (``recovery``)."""
    report: TransitionReport | None = None
    phase: str = "start"
    """The step now ("start" until its first phase): the failed phase an interruption's ``TransitionEnded`` names."""

    def finished(self) -> TransitionReport:
        """The report of this transition, which ended without raising."""
        assert self.report is not None, f"transition {self.name} has not ended"
        return self.report


@dataclass(eq=False)
class PhaseStep(Generic[E]):
    """A step: send ``method`` to every engine of ``engines`` (engine, kwargs) at once under ``deadline``.

    The driver sets ``results``, one per engine in order (``FanOut.call``'s contract).
    """

    tx: Transition
    phase: str
    method: ControlMethod
    calls: tuple[EngineCall, ...]
    names: tuple[str, ...]
    """The engines' names, in ``calls``' order."""
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
class SettleStep:
    """A step: wait up to ``deadline`` for the late calls in ``late`` (engine name -> call).

    The driver puts each one that landed in ``landed`` (name -> its error, or None).
    """

    late: dict[str, LateCall]
    deadline: Deadline
    landed: dict[str, BaseException | None] = field(default_factory=dict)


@dataclass(eq=False)
class WaitStep:
    """A step: wait until ``deadline`` has passed (the driver sleeps on the orchestrator's clock), then hand back."""

    deadline: Deadline


@dataclass(eq=False)
class ReadStep(Generic[E]):
    """A step: send the read ``method`` (no arguments) to every engine of ``engines`` at once under ``deadline``.

    The driver sets ``results``, one per engine in order, or ``error`` when the fan-out raised (a fan-out that cannot
    send this read, a gateway's): a read proves nothing then, and the transition goes on.
    """

    method: str
    calls: tuple[EngineCall, ...]
    engines: list[tuple[E, Mapping[str, Any]]]
    deadline: Deadline
    results: list[EngineResult] | None = None
    error: Exception | None = None


Step = PhaseStep[Any] | SettleStep | WaitStep | ReadStep[Any]
Steps = Generator[Step, None, T]
"""A transition as steps: yields what to send or wait for, returns its result."""


_LOG = logging.getLogger("resilience.barrier.transitions")


def ask_probe(memory_probe: MemoryProbe, name: str, tags: frozenset[str]) -> frozenset[str] | None:
    """The probe's answer for ``name``, or None when it cannot prove it (None, an error, tags the engine does not have)."""
    try:
        answer = memory_probe.released_tags(name)
    except Exception:  # a probe that fails proves nothing
        return None
    if not isinstance(answer, (set, frozenset)) or not answer <= tags:
        return None
    return frozenset(answer)


def recheck(state: BarrierState[Any], tx: Transition, names: Sequence[str]) -> Steps[list[str]]:
    """Check the engines among ``names`` still in ``state.unchecked`` (once each); take those that mismatch as new.

    Returns the engines taken as new. The probe is asked first; the engines it cannot clear are asked their kind's
    ``ServingRead`` (one ``ReadStep`` per read method, under the settle limit), where the engine object has it.
    """
    todo = [n for n in names if n in state.unchecked and n not in state.retired]
    if not todo:
        return []
    state.unchecked.difference_update(todo)
    know = state.know
    fresh: dict[str, str] = {}
    if state.memory_probe is not None:
        for n in todo:
            k = know[n]
            answer = ask_probe(state.memory_probe, n, k.memory.all_tags)
            if answer is not None and not k.released <= answer:
                missing = ", ".join(sorted(k.released - answer))
                fresh[n] = f"the memory probe finds {missing} not released, which the journal records released ({k.state})"
    reads: dict[str, list[EngineCall]] = {}
    for n in todo:
        read = state.kinds[n].serving_read
        if n in fresh or read is None or not callable(getattr(state.engines[n], read.method, None)):
            continue
        reads.setdefault(read.method, []).append((n, {}))
    for method, calls in reads.items():
        tx.phase = "resume_check"
        deadline = tx.deadline.cap(state.deadlines.for_phase("settle"))
        step: ReadStep[Any] = ReadStep(method, tuple(calls), [(state.engines[n], kw) for n, kw in calls], deadline)
        yield step
        if step.results is None or len(step.results) != len(calls):
            continue  # the fan-out could not send it: nothing is proved
        for (n, _), result in zip(calls, step.results, strict=True):
            read = state.kinds[n].serving_read
            if read is not None and result.error is None and result.late is None and read.proves_serving(result.value):
                fresh[n] = f"it answers {method} as a serving engine (not paused), which the journal records {know[n].state}"
    for n, why in fresh.items():
        take_as_new(state, tx, n, why)
    return list(fresh)


def take_as_new(state: BarrierState[Any], tx: Transition | None, name: str, why: str) -> None:
    """``name`` is a fresh process, not the journal's engine: serving, nothing released or unknown, no hold; persisted,
    logged, announced, and named in ``state.replaced`` (and ``tx.replaced``)."""
    k = state.know[name]
    before = k.state
    k.abandon()
    k.in_flight = None
    k.reconcile(released=(), paused=False)
    state.label = "resume_check"
    state.persist((name,))
    for token in sorted(k.holds):
        unhold(state, name, token)
    state.repause.discard(name)
    state.replaced[name] = why
    if tx is not None:
        tx.replaced[name] = why
    _LOG.warning("engine %s: a new process since the journal was written (%s); taken as a new engine, serving", name, why)
    state.announce(name, before)


def pause_again(state: BarrierState[Any], names: Sequence[str]) -> list[str]:
    """The engines among ``names`` the resumed journal calls paused that this orchestrator has not paused itself: their
    "flushed" is dropped (persisted; a flush is safe to repeat), and the caller sends them a pause, and a flush before
    a release, again. Engines with tags released or unknown are left out (nothing is released on them again)."""
    again = [n for n in names if n in state.repause and not state.know[n].released and not state.know[n].unknown]
    for n in again:
        state.know[n].flushed = False
    if again:
        state.persist(again)
    return again


def paused_again(state: BarrierState[Any], again: Sequence[str], failed: Mapping[str, BaseException]) -> None:
    """The pause phase ended: the engines of ``again`` it paused (not in ``failed``) are no longer paused only by the journal."""
    state.repause.difference_update(n for n in again if n not in failed)


_ids = itertools.count(1)


@contextmanager
def transition(state: BarrierState[Any], name: str, engines: Iterable[str]) -> Iterator[Transition]:
    """One transition over the ``engines`` not retired: announce it, let the body run, end it (``tx.report`` when the
    body returned; a ``PhaseFailed`` announced its own end; anything else ends it with ``ok=False`` in its step)."""
    names = tuple(state.active(engines))
    clock, limit = state.clock, state.deadlines.transition_s
    tx = Transition(next(_ids), name, Deadline(limit, clock=clock), names, clock.monotonic())
    state.label = name
    emit(state.observers, TransitionStarted(transition_id=tx.tid, transition=name, engines=tx.engines, deadline_s=limit))
    try:
        yield tx
    except PhaseFailed:
        raise
    except BaseException:
        _ended(state, tx, failed_phase=tx.phase, left=state.not_serving(), rolled_back=())
        raise
    duration = _ended(state, tx, failed_phase=None, left=(), rolled_back=())
    tx.report = TransitionReport(tx.name, duration, tuple(tx.phases), dict(tx.held), tx.hold, dict(tx.replaced))


def _ended(
    state: BarrierState[Any], tx: Transition, *, failed_phase: str | None, left: Iterable[str], rolled_back: Sequence[str]
) -> float:
    """Tell the observers ``tx`` ended: ``ok`` when ``failed_phase`` is None, else failed in that phase with ``left`` not
    serving and ``rolled_back`` rolled back; return its duration."""
    duration = state.clock.monotonic() - tx.started
    ended = TransitionEnded(
        transition_id=tx.tid, transition=tx.name, engines=tx.engines, duration_s=duration, ok=failed_phase is None,
        failed_phase=failed_phase, rolled_back=tuple(rolled_back), left_paused=tuple(left),
    )
    emit(state.observers, ended)
    return duration


def error(
    state: BarrierState[Any], tx: Transition, phase: str, failed: Mapping[str, BaseException], *, rolled_back: Sequence[str] = ()
) -> PhaseFailed:
    """The ``PhaseFailed`` that ends ``tx`` in ``phase`` (its ``TransitionEnded`` emitted): every engine not serving is named."""
    left = state.not_serving()
    dead = [n for n in left if state.know[n].dead is not None]
    budget = state.restart_budget
    remaining, limit = (None, None) if budget is None else (budget.remaining, budget.limit)
    err = PhaseFailed(
        tx.name, phase, failed, rolled_back=rolled_back, left_paused=left, quarantined=sorted(state.quarantined()), dead=dead,
        restarts_remaining=remaining, restart_limit=limit,
    )
    _ended(state, tx, failed_phase=phase, left=left, rolled_back=rolled_back)
    return err


def skips(skipped: Mapping[str, str]) -> dict[str, BaseException]:
    """Skipped engines (name -> why) as the failures ``PhaseFailed`` names."""
    return {n: EngineSkipped(f"{n} {why}") for n, why in skipped.items()}


def raise_if_skipped(state: BarrierState[Any], tx: Transition, skipped: Mapping[str, str]) -> None:
    """End ``tx`` with ``PhaseFailed`` when it skipped any engine."""
    if skipped:
        raise error(state, tx, "skipped", skips(skipped))


_GRACE_EPSILON_S: Final = 1e-6
"""Grace left below this counts as passed (a clock summed from sleeps may stop a hair short of the end)."""


def settle(state: BarrierState[Any], tx: Transition, names: Sequence[str]) -> Steps[dict[str, str]]:
    """Start of a transition: check what a resumed journal says against the engines (``recheck``: a fresh
    process is taken as a new engine), drop marks an interruption left, wait (up to the continue phase's limit) for calls
    still in flight, ask the memory probe about quarantined engines (polling it while a grace keeps its "as before" from
    being trusted, up to the settle limit: ``poll_probe``); return the engines to skip, with why."""
    know = state.know
    yield from recheck(state, tx, names)
    stale = [n for n in names if know[n].pending is not None]
    for n in stale:
        k = know[n]
        method = k.pending.method if k.pending is not None else ""
        k.abandon()
        record_doubt(state, k, method, None)
    if stale:
        state.persist(stale)
    late = {n: k.in_flight.call for n in names if (k := know[n]).in_flight is not None}
    if late:
        tx.phase = "settle"
        step = SettleStep(late, tx.deadline.cap(state.deadlines.for_phase("settle")))
        yield step
        before = {n: know[n].state for n in step.landed}
        for n, error in step.landed.items():
            land(state, n, error)
        if step.landed:
            state.persist(tuple(step.landed))
        for n in before:
            state.announce(n, before[n])
    before = {n: know[n].state for n in names}
    waiting: dict[str, float] = {}
    settled = reconcile_from_probe(state, names, waiting)
    if waiting:  # a request may still be on its way: ask again until it proves applied or the grace has passed
        tx.phase = "settle"
        settled += yield from poll_probe(state, waiting, tx.deadline.cap(state.deadlines.for_phase("settle")))
    for n in settled:
        state.announce(n, before[n])
    return {n: state.why_skipped(n) for n in names if know[n].dead is not None or know[n].in_flight is not None}


def land(state: BarrierState[Any], name: str, error: BaseException | None) -> None:
    """Fold a late call that landed (the caller persists and announces)."""
    k = state.know[name]
    effect = effect_of(error)
    late = k.land(effect)
    if late is not None and effect is Effect.AMBIGUOUS:
        record_doubt(state, k, late.method, error)
    if error is not None and is_engine_dead(error):
        k.dead = f"{type(error).__name__} after a late call"


def record_doubt(state: BarrierState[Any], k: EngineKnowledge, method: str, error: BaseException | None) -> None:
    """A release or resume had an ambiguous effect and left ``k``'s tags unknown: keep why, and whether its request may
    still be on its way (``error`` None: its answer was never read). The caller persists."""
    if method in (RELEASE, RESUME) and k.unknown:
        k.doubt = doubt_of(method, error, state.clock.monotonic())


def reconcile_from_probe(state: BarrierState[Any], names: Iterable[str], waiting: dict[str, float] | None = None) -> list[str]:
    """Reconcile from the memory probe every engine among ``names`` whose tags are unknown; return those it settled.

    An answer is trusted when it proves the call applied, when the request is not on its way (``Doubt.in_transit``
    False: a 502/503), or once the grace (``PhaseDeadlines.in_transit_for``) has passed; else the engine stays
    quarantined, and ``waiting`` (when given) gets the seconds of grace left for it, as it does for a probe that cannot
    prove it now (None) while the request may still be on its way.
    """
    memory_probe = state.memory_probe
    if memory_probe is None:
        return []
    settled: list[str] = []
    for name in names:
        k = state.know[name]
        if not k.unknown or k.in_flight is not None or k.pending is not None or name in state.retired:
            continue
        released = ask_probe(memory_probe, name, k.memory.all_tags)
        left = _grace_left(state, k, released)
        if released is None:  # cannot prove it now (a release being carried out): worth asking again within the grace
            if waiting is not None and left > 0:
                waiting[name] = left
            continue
        if left > 0:
            if waiting is not None:
                waiting[name] = left
            continue
        k.released.update(k.unknown & released)  # known first, then no longer unknown
        k.unknown.clear()
        k.doubt = None
        state.persist((name,))
        if not k.released:
            unhold(state, name, OFFLOAD_TOKEN)
        settled.append(name)
    return settled


def poll_probe(state: BarrierState[Any], waiting: dict[str, float], deadline: Deadline) -> Steps[list[str]]:
    """Ask the memory probe again, every ``PhaseDeadlines.probe_poll_s``, about the engines in ``waiting`` (name -> grace
    left, as ``reconcile_from_probe`` fills it) until each is settled or ``deadline`` has passed; return those settled.

    Each wait is a ``WaitStep``, so an interruption comes only while nothing is being decided: it leaves every engine
    still waiting quarantined, with its doubt. Bounded: one wait per ``probe_poll_s`` of the smaller of the longest grace
    left and ``deadline`` (plus one for rounding).
    """
    every = state.deadlines.probe_poll_s
    settled: list[str] = []
    limit = min(max(waiting.values(), default=0.0), deadline.remaining())
    polls = math.ceil(limit / every) + 1 if limit > 0 else 0
    for _ in range(polls):
        left = min(max(waiting.values(), default=0.0), deadline.remaining())
        if left <= 0:
            break
        yield WaitStep(deadline.cap(min(every, left)))
        again: dict[str, float] = {}
        settled += reconcile_from_probe(state, list(waiting), again)
        waiting.clear()
        waiting.update(again)
    return settled


def _grace_left(state: BarrierState[Any], k: EngineKnowledge, released: frozenset[str] | None) -> float:
    """Seconds before the probe's answer ``released`` may be trusted for ``k`` (0: now; for None, no answer: the seconds
    its request may still be on its way, 0 when it is not)."""
    why = k.doubt
    if why is None:  # unknown tags with no record of why (cannot happen through the rules): trusted as before
        return 0.0
    if not why.in_transit or (released is not None and why.proves_applied(frozenset(k.unknown), released)):
        return 0.0
    left = why.since + state.deadlines.in_transit_for(why.method) - state.clock.monotonic()
    return left if left > _GRACE_EPSILON_S else 0.0


class Interrupted(RuntimeError):
    """The failure of a call whose phase was interrupted before its answer was read: it may have been applied."""


def phase(
    state: BarrierState[Any], tx: Transition, name: str, method: ControlMethod, calls: Sequence[EngineCall]
) -> Steps[dict[str, BaseException]]:
    """One phase (``name``) on every engine at once; each outcome is folded into its knowledge. Returns the failures.

    Write-ahead: each engine's facts are marked in flight (and persisted) before the step is yielded. When that
    record cannot be written (``persist`` raises: ``ENOSPC``, ``EIO``), the step is never yielded, so no call leaves:
    the marks are settled as not applied and the error goes on (the same orchestrator's next transition starts from
    the facts as they were, nothing quarantined).
    """
    if not calls:
        return {}
    names = tuple([n for n, _ in calls])  # a list first: a generator would be resumed once per engine
    deadline = tx.deadline.cap(state.deadlines.for_phase(name))
    started = PhaseStarted(transition_id=tx.tid, transition=tx.name, phase=name, engines=names, deadline_s=deadline.remaining())
    emit(state.observers, started)
    tx.phase = name
    state.label = f"{tx.name} {name}"
    before = {n: state.know[n].state for n in names}
    engines = [(state.engines[n], kw) for n, kw in calls]
    step = PhaseStep(tx, name, method, tuple(calls), names, engines, deadline, state.clock.monotonic(), before)
    for n, kwargs in calls:
        step.marks[n] = state.know[n].mark(method, kwargs)
    try:
        state.persist(names)
    except BaseException as exc:  # the write-ahead was not written (a full disk): nothing is sent, so nothing was applied
        _unmark(state, step, exc)
        raise
    yield step
    assert step.results is not None and len(step.results) == len(step.calls), f"{step.phase}: the driver gave no result per engine"
    step.folded = True
    waiting: dict[str, float] = {}
    failures = _fold_knowledge(state, step, step.results, waiting)
    try:
        if waiting:  # the probe's "as before" is not trusted yet: ask again until it proves applied or the grace passed
            settled = yield from poll_probe(state, waiting, step.deadline)
            _drop_done(state, step, failures, settled)
    finally:  # reported once, also when the poll is interrupted (the knowledge is already folded and persisted)
        _report(state, step, step.results, failures)
    return failures


def _unmark(state: BarrierState[Any], step: PhaseStep[Any], error: BaseException) -> None:
    """The step's write-ahead could not be persisted (``error``), so its calls are never sent: settle each mark as not
    applied (the facts go back to what they were; the journal still holds them so, its last record being the one
    before), then end the phase for the observers (``PhaseEnded``, every engine failed with ``error``)."""
    for n, _kwargs in step.calls:
        k = state.know[n]
        if k.pending is not None and k.pending is step.marks.get(n):
            k.settle(Effect.NOT_APPLIED)
    _phase_ended(state, step, dict.fromkeys(step.names, error), state.clock.monotonic() - step.started)


def _report(
    state: BarrierState[Any], step: PhaseStep[Any], results: Sequence[EngineResult | None], failures: Mapping[str, BaseException]
) -> None:
    """Tell the observers what the folded phase did: its ``PhaseReport``, each engine's state change, ``PhaseEnded``."""
    names, duration = step.names, state.clock.monotonic() - step.started
    durations = [r.duration_s for r in results if r is not None]
    step.tx.phases.append(PhaseReport(step.phase, names, duration, max(durations, default=0.0)))
    if state.observers:  # nobody to tell: no event to build per engine
        for name in names:
            state.announce(name, step.before.get(name, state.know[name].state))
    _phase_ended(state, step, failures, duration)


def _phase_ended(state: BarrierState[Any], step: PhaseStep[Any], failures: Mapping[str, BaseException], duration: float) -> None:
    """``PhaseEnded`` for ``step`` (``duration`` s), with each failure."""
    tx, names = step.tx, step.names
    failed = tuple(PhaseFailure(engine=n, error_type=type(e).__name__, message=short(e)) for n, e in failures.items())
    ended = PhaseEnded(transition_id=tx.tid, transition=tx.name, phase=step.phase, engines=names, duration_s=duration, failures=failed)
    emit(state.observers, ended)


def _fold_knowledge(
    state: BarrierState[Any],
    step: PhaseStep[Any],
    results: Sequence[EngineResult | None],
    waiting: dict[str, float] | None = None,
) -> dict[str, BaseException]:
    """Settle each engine's write-ahead mark from its result (engines already settled are left alone: safe to redo after
    an interruption); ask the probe; persist. A None result is a call whose outcome will never be known: it stays ambiguous.
    ``waiting`` (when given) gets the engines whose probe answer is not trusted yet, with the grace left (``reconcile_from_probe``)."""
    method = step.method
    failures: dict[str, BaseException] = {}
    for (name, _kwargs), result in zip(step.calls, results, strict=True):
        k = state.know[name]
        mine = k.pending is not None and k.pending is step.marks.get(name)  # a later step's mark is not this step's to settle
        if result is None:
            if mine:
                k.abandon()
                record_doubt(state, k, method, None)
            failures[name] = Interrupted(f"{name}: the phase was interrupted while {method} ran; it may have been applied")
            continue
        if mine:
            if result.late is not None:
                k.late(result.late)
            else:
                effect = effect_of(result.error)
                k.settle(effect)
                if effect is Effect.AMBIGUOUS:
                    record_doubt(state, k, method, result.error)
        if result.error is not None:
            failures[name] = result.error
            if is_engine_dead(result.error) and k.dead is None:
                k.dead = f"{type(result.error).__name__} in {step.phase}"
    names = step.names
    state.persist(names)
    _drop_done(state, step, failures, reconcile_from_probe(state, names, waiting))  # each engine it settles is persisted on its own
    return failures


def _drop_done(state: BarrierState[Any], step: PhaseStep[Any], failures: dict[str, BaseException], settled: Sequence[str]) -> None:
    """Drop from ``failures`` each engine among ``settled`` (by the probe) whose call the knowledge now proves done."""
    calls = dict(step.calls)
    for name in settled:
        if name in failures and _done(state.know[name], step.method, calls[name]):
            del failures[name]  # the probe proves the call did what it was sent for


def abandon(state: BarrierState[Any], steps: Steps[Any], step: Step, error: BaseException | None = None) -> None:
    """The driver stopped inside ``step`` (``error``): fold what it learnt, leave the rest ambiguous, then close the steps.

    Also after an interruption inside the fold itself: engines already folded are left as they are.
    """
    try:
        if isinstance(step, PhaseStep):
            results: Sequence[EngineResult | None] | None = step.results
            if results is None and error is not None:
                results = interrupted_results(error)
            if results is None or len(results) != len(step.calls):
                results = [None] * len(step.calls)
            if not step.folded:  # folded, persisted, then reported: nothing an observer raises can undo the knowledge
                step.folded = True
                _report(state, step, results, _fold_knowledge(state, step, results))
            elif any(state.know[n].pending is step.marks.get(n) for n, _ in step.calls):
                _fold_knowledge(state, step, results)
    finally:
        steps.close()


def _done(k: EngineKnowledge, method: str, kwargs: Mapping[str, Any]) -> bool:
    """The knowledge proves ``method(**kwargs)`` took effect (a release's tags released, a resume's back)."""
    if method == RELEASE:
        return k.memory.release_tags(kwargs) <= k.released and not k.unknown and k.dead is None
    if method == RESUME:
        return not (k.memory.resume_tags(kwargs) & (k.released | k.unknown)) and k.dead is None
    return False


def to_release(k: EngineKnowledge, wanted: frozenset[str]) -> frozenset[str]:
    """The tags an offload of ``wanted`` must still release on ``k`` (empty: nothing to do)."""
    table = k.memory
    missing = (wanted & table.all_tags) - k.released
    if table.release_whole and missing:
        return table.all_tags - k.released
    return missing


def to_resume(k: EngineKnowledge, wanted: frozenset[str]) -> frozenset[str]:
    """The tags an onload of ``wanted`` must resume on ``k``: those released, and unknown ones where a resume is re-sent."""
    resendable = k.unknown if k.memory.resend else set()
    return wanted & (k.released | resendable)


def _unsettled(k: EngineKnowledge, method: str, kwargs: Mapping[str, Any]) -> bool:
    """``k``'s kind re-sends, and the call left some of its tags unknown (and ``k`` may be sent something)."""
    if not k.memory.resend or not k.reachable or k.pending is not None:
        return False
    tags = k.memory.release_tags(kwargs) if method == RELEASE else k.memory.resume_tags(kwargs)
    return bool(tags & k.unknown)


def resend(
    state: BarrierState[Any],
    tx: Transition,
    name: str,
    method: ControlMethod,
    calls: Sequence[EngineCall],
    failed: Mapping[str, BaseException],
) -> Steps[dict[str, BaseException]]:
    """Re-send (phase ``name``) each call of ``calls`` whose effect was ambiguous, on kinds where that is safe; return the
    failures left (a call a re-send answered is no longer one)."""
    left = dict(failed)
    for _ in range(RESEND_ROUNDS):
        again = [(n, kw) for n, kw in calls if _unsettled(state.know[n], method, kw)]
        if not again:
            break
        more = yield from phase(state, tx, name, method, again)
        for n, _ in again:
            if n in more:
                left[n] = more[n]
            else:
                left.pop(n, None)
    return left


def _calls(k: EngineKnowledge, tags: frozenset[str]) -> list[dict[str, Any]]:
    """The resume calls of ``tags`` on ``k``, in order."""
    table = k.memory
    if table.wake_one_tag:
        return [{"tags": [t]} for t in table.tags if t in tags]
    return [{"tags": None if tags >= table.all_tags else sorted(tags)}]


def _reopens(k: EngineKnowledge, kwargs: Mapping[str, Any]) -> bool:
    """On a ``last_wake_resumes`` kind: this resume would (or might) leave nothing released, so it reopens scheduling."""
    return k.memory.last_wake_resumes and not (k.released - k.memory.resume_tags(kwargs))


def may_reopen(k: EngineKnowledge) -> bool:
    """Scheduling may reopen on ``k``: no hold but the offload's (which the onload is ending)."""
    return k.reachable and set(k.holds) <= {OFFLOAD_TOKEN}


def resume_phases(
    state: BarrierState[Any], tx: Transition, name: str, wants: Mapping[str, frozenset[str]]
) -> Steps[dict[str, BaseException]]:
    """Resume ``wants[n]`` on each engine ``n`` (phase ``name``, as often as the kinds need); return the failures.

    Each round sends every engine its next call at once; an engine whose call failed gets nothing more. A call
    is sent only while its tags may be resumed; a wake that reopens scheduling only where ``may_reopen``.
    """
    know = state.know
    queue = {n: _calls(know[n], tags) for n, tags in wants.items() if tags}
    failed: dict[str, BaseException] = {}
    for _ in range(1 + max((len(q) for q in queue.values()), default=0)):  # bounded: each round sends a queue's head
        calls: list[EngineCall] = []
        for n, q in queue.items():
            if not q or n in failed:
                continue
            k, kwargs = know[n], q[0]
            tags = k.memory.resume_tags(kwargs)
            if not state.allows(n, "resume_memory_occupation", tags) or (_reopens(k, kwargs) and not may_reopen(k)):
                q.clear()  # nothing more is sent to it in this transition: it stays held, and is named
                continue
            calls.append((n, q.pop(0)))
        if not calls:
            break
        more = yield from phase(state, tx, name, "resume_memory_occupation", calls)
        failed.update((yield from resend(state, tx, name, "resume_memory_occupation", calls, more)))
    return failed


def onload_steps(state: BarrierState[Any], wanted: frozenset[str]) -> Steps[TransitionReport]:
    """Resume ``wanted`` (those released) on every offloaded engine, then continue those whose memory is all back."""
    with transition(state, "onload", state.offloaded) as tx:
        know = state.know
        names = list(tx.engines)
        skipped = yield from settle(state, tx, names)
        skipped.update({n: state.why_skipped(n) for n in names if n not in skipped and know[n].quarantined})
        live = [n for n in names if n not in skipped]
        failed = yield from resume_phases(state, tx, "resume", {n: to_resume(know[n], wanted) for n in live})
        end_offload_hold(state, live)
        _, cont_failed = yield from continue_ready(state, tx, live)
        if failed or cont_failed:
            raise error(state, tx, "resume" if failed else "continue", {**skips(skipped), **failed, **cont_failed})
        raise_if_skipped(state, tx, skipped)
        tx.held = held_among(state, live)
    return tx.finished()


def continue_ready(
    state: BarrierState[Any], tx: Transition, names: Sequence[str], name: str = "continue"
) -> Steps[tuple[list[str], dict[str, BaseException]]]:
    """Continue (phase ``name``) the engines among ``names`` the kind's table allows it; return those continued and the
    failures."""
    ready = [n for n in names if state.allows(n, "continue_generation")]
    failed = yield from phase(state, tx, name, "continue_generation", [(n, {}) for n in ready])
    return [n for n in ready if n not in failed], failed


def rollback_continue(state: BarrierState[Any], tx: Transition, names: Sequence[str]) -> Steps[tuple[list[str], dict[str, BaseException]]]:
    """After a failure, when ``rollback`` is on: ``continue_ready`` in a phase named "rollback"."""
    return (yield from continue_ready(state, tx, names, "rollback")) if state.rollback else ([], {})


def offload_steps(state: BarrierState[Any], wanted: frozenset[str], mode: Literal["abort", "retract"]) -> Steps[TransitionReport]:
    """Pause every offloaded engine not known paused (``mode``), flush those not known flushed, release ``wanted``."""
    with transition(state, "offload", state.offloaded) as tx:
        know = state.know
        names = list(tx.engines)
        skipped = yield from settle(state, tx, names)
        live = [n for n in names if n not in skipped]
        for n in live:
            hold(state, n, OFFLOAD_TOKEN, OFFLOAD_HOLD)
        again = pause_again(state, live)
        to_pause = [
            n
            for n in live
            if (know[n].paused is not True or know[n].pause_mode == "in_place" or n in again) and state.allows(n, "pause_generation")
        ]
        failed = yield from phase(state, tx, "pause", "pause_generation", [(n, {"mode": mode}) for n in to_pause])
        paused_again(state, [n for n in again if n in to_pause], failed)
        if failed:
            raise (yield from _fail_before_release(state, tx, "pause", failed, live, skipped))
        skipped.update({n: state.why_skipped(n) for n in live if know[n].quarantined})
        todo = {n: to_release(know[n], wanted) for n in live if n not in skipped}
        todo = {n: missing for n, missing in todo.items() if missing}
        for n in [n for n in todo if not state.allows(n, "flush_cache")]:  # defensive: the pause phase makes this unreachable
            skipped[n] = f"not allowed a flush ({state.kinds[n].calls['flush_cache'].needs_text}): {know[n].why_not_serving()}"
            del todo[n]
        to_flush = [n for n in todo if know[n].memory.flush_before_release and not know[n].flushed]
        failed = yield from phase(state, tx, "flush", "flush_cache", [(n, {}) for n in to_flush])
        if failed:
            raise (yield from _fail_before_release(state, tx, "flush", failed, live, skipped))
        calls: list[EngineCall] = []
        for n, missing in todo.items():
            if state.allows(n, "release_memory_occupation", missing):
                calls.append((n, know[n].memory.release_kwargs(missing)))
            else:  # defensive: the phases above make this unreachable
                needs = state.kinds[n].calls["release_memory_occupation"].needs_text
                skipped[n] = f"not allowed a release of {sorted(missing)} ({needs}): {know[n].why_not_serving()}"
        failed = yield from phase(state, tx, "release", "release_memory_occupation", calls)
        failed = yield from resend(state, tx, "release", "release_memory_occupation", calls, failed)
        if failed:
            raise (yield from _fail_in_release(state, tx, failed, [c for c in calls if c[0] not in failed], live, skipped))
        raise_if_skipped(state, tx, skipped)
    return tx.finished()


def _fail_before_release(
    state: BarrierState[Any],
    tx: Transition,
    name: str,
    failed: Mapping[str, BaseException],
    live: Sequence[str],
    skipped: Mapping[str, str],
) -> Steps[PhaseFailed]:
    """Pause or flush failed: nothing was released by this offload, so engines holding nothing released are continued."""
    end_offload_hold(state, live)
    rolled, rb_failed = yield from rollback_continue(state, tx, live)
    return error(state, tx, name, {**skips(skipped), **rb_failed, **failed}, rolled_back=rolled)


def _fail_in_release(
    state: BarrierState[Any],
    tx: Transition,
    failed: Mapping[str, BaseException],
    applied: Sequence[EngineCall],
    live: Sequence[str],
    skipped: Mapping[str, str],
) -> Steps[PhaseFailed]:
    """Release failed on some engines: resume what this offload released, continue every engine whose memory is all back.

    An engine whose release may have been applied is quarantined on SGLang (neither resumed: a resume of an
    unreleased tag kills it; nor released again); on vLLM the re-sends have already been tried.
    """
    rolled: list[str] = []
    rb_failed: dict[str, BaseException] = {}
    if state.rollback:
        know = state.know
        wants = {n: know[n].memory.release_tags(kw) & know[n].released for n, kw in applied}
        rb_failed = yield from resume_phases(state, tx, "rollback_resume", wants)
        end_offload_hold(state, live)
        rolled, more = yield from rollback_continue(state, tx, live)
        rb_failed.update(more)
    return error(state, tx, "release", {**skips(skipped), **rb_failed, **failed}, rolled_back=rolled)


def pause_steps(state: BarrierState[Any], reason: str, mode: str) -> Steps[TransitionReport]:
    """Take a new hold named ``reason`` on every engine and pause the ones not known paused (``pause``, ``weight_sync``)."""
    with transition(state, reason, state.engines) as tx:
        know = state.know
        names = list(tx.engines)
        skipped = yield from settle(state, tx, names)
        # quarantined, or unsettled (vLLM: its next offload or onload re-sends): a body must not run on memory that may be released
        skipped.update({n: state.why_skipped(n) for n in names if n not in skipped and know[n].unknown})
        if reason == WEIGHT_SYNC_HOLD:  # a weight update into released weights kills the engine: refused, nothing sent
            skipped.update({n: why for n in names if n not in skipped and (why := state.why_no_weight_sync(n))})
        raise_if_skipped(state, tx, skipped)
        token = new_token(reason, names)
        try:
            for n in names:
                hold(state, n, token.id, reason)
            again = pause_again(state, names)
            to_pause = [n for n in names if (know[n].paused is not True or n in again) and state.allows(n, "pause_generation")]
            failed = yield from phase(state, tx, "pause", "pause_generation", [(n, {"mode": mode}) for n in to_pause])
        except BaseException:  # a hold not written, abandoned mid-phase (cancelled, the fan-out raised): nobody will own the token
            _drop(state, names, token.id)
            raise
        paused_again(state, [n for n in again if n in to_pause], failed)
        if failed:
            for n in names:
                unhold(state, n, token.id)
            rolled, rb_failed = yield from rollback_continue(state, tx, names)
            raise error(state, tx, "pause", {**rb_failed, **failed}, rolled_back=rolled)
        tx.hold = token
    return tx.finished()


def _drop(state: BarrierState[Any], names: list[str], token: int) -> None:
    """Drop hold ``token`` on every engine of ``names`` (on a failure path: the caller raises its own error). Each is
    dropped in memory even when writing another's record fails; a record not written leaves the hold in the journal,
    where the next controller names it orphaned (``Recovery.orphaned_holds``): it keeps an engine paused, never kills it."""
    for n in names:
        try:
            unhold(state, n, token)
        except Exception:  # the record of a dropped hold could not be written (a full disk): drop the others all the same
            _LOG.warning("hold %s on %s dropped, but its record could not be written", token, n, exc_info=True)


def unpause_steps(state: BarrierState[Any], held: HoldToken | str) -> Steps[TransitionReport]:
    """Release one hold; continue the engines it held that no other hold keeps paused and whose memory is back."""
    token = token_of(state, held)
    with transition(state, f"{token.reason}_end", token.engines) as tx:
        know = state.know
        names = list(tx.engines)
        for n in token.engines:
            unhold(state, n, token.id)
        skipped = yield from settle(state, tx, names)
        live = [n for n in names if n not in skipped]
        _, failed = yield from continue_ready(state, tx, live)
        stuck = {n: state.why_skipped(n) for n in live if not know[n].holds and not know[n].serving and n not in failed}
        skipped.update(stuck)
        if failed:
            raise error(state, tx, "continue", {**skips(skipped), **failed})
        raise_if_skipped(state, tx, skipped)
        tx.held = held_among(state, live)
    return tx.finished()




def resume(state: BarrierState[Any]) -> None:
    """Open the journal given (once every engine was checked) and take up the knowledge, holds, retirements,
    membership and restart budget it kept; the engines it calls paused or released are checked at the next
    transition's start (``recheck``); an engine whose join had not finished, or that was fenced, stays fenced
    (``add`` brings it in again). Each orchestrator calls this at the end of its constructor."""
    if state.journal_arg is None:
        return
    journal = open_journal(state.journal_arg)
    try:
        resumed = journal.open(list(state.engines), kinds={n: k.memory for n, k in state.know.items()})
    except BaseException:
        journal.close()
        raise
    state.journal, state.recovery = journal, resumed.recovery
    now = state.clock.monotonic()
    state.know.update(resumed.knowledge)
    state.retired.update(resumed.retired)
    for name, k in resumed.knowledge.items():
        if k.doubt is not None:  # a dead controller's requests may still be on their way: the grace starts again
            k.doubt = Doubt(k.doubt.method, k.doubt.in_transit, k.doubt.delivery, now)
        if name in state.retired or k.dead is not None:
            continue
        if k.paused is True or k.released or k.unknown:  # checked against what can be read at the next transition's start
            state.unchecked.add(name)
        if k.paused is True and not k.released and not k.unknown:  # paused (and flushed) again before a release
            state.repause.add(name)
    state.restart_budget = restore_budget(state.restart_budget, resumed.budget)
    reserve_tokens(max((i for k in resumed.knowledge.values() for i in k.holds), default=0))
    for name, k in resumed.knowledge.items():
        if k.state is not EngineState.SERVING:
            emit(state.observers, EngineStateChanged(engine=name, from_state=str(EngineState.SERVING), to_state=str(k.state)))
    for name, change in resumed.recovery.members.items():
        if name in state.know and name not in state.retired and change in (JOINING, FENCED):
            why = "its join had not finished when the last controller stopped" if change == JOINING else "fenced by the last controller"
            state.fenced[name] = f"{why}: add() it again"


def reconcile(state: BarrierState[E], engine: str | E, *, released: Iterable[str] | None, paused: bool | None) -> None:
    """The caller's word on ``engine``'s real state (see ``Orchestrator.reconcile``), refused where SGLang would crash."""
    name = state.name_of(engine)
    tags = None if released is None else frozenset(released)
    kind = state.know[name].memory
    if tags is not None and not tags <= kind.all_tags:
        raise ValueError(f"reconcile released must be a subset of {kind.tags} ({kind.kind} engine {name}), but was {sorted(tags)}")
    if tags and paused is False:
        raise ValueError(
            f"reconcile {name}: released {sorted(tags)} with paused=False is a state SGLang crashes in (prefill into freed memory)"
        )
    if tags and name not in state.offloaded:
        raise ValueError(f"reconcile {name}: released tags on an engine of a needs_offload=False group (nothing would resume them)")
    with state.lock:
        if name in state.retired:
            raise ValueError(f"reconcile {name}: the engine was retired")
        k = state.know[name]
        if k.in_flight is not None:
            landed, error = k.in_flight.call.wait(0)
            if not landed:
                late = k.in_flight.method
                raise RuntimeError(f"reconcile {name}: a late {late} sent earlier is still running; reconcile after it lands")
            before = k.state
            land(state, name, error)
            state.persist((name,))
            state.announce(name, before)
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
        state.unchecked.discard(name)  # the caller's word, not the journal's, from now on
        state.repause.discard(name)
        state.label = "reconcile"
        state.persist((name,))
        if k.released or k.unknown:
            hold(state, name, OFFLOAD_TOKEN, OFFLOAD_HOLD)
        else:
            unhold(state, name, OFFLOAD_TOKEN)
        state.announce(name, before)
