"""Membership: engines that join a running group (``add``), leave it (``retire``), and are fenced (partial progress),
with no I/O; what each does for a user is docs/barrier.md, "Engines that join and leave".

A join is a transition of one engine (``join_steps``, driven as any transition): until it reached its group's current
state (``GroupTarget``: offloaded with the group's tags released, or serving, verified first when given checks) its
state is ``joining`` and no other transition covers it; a join that cannot get there fences it. A known engine added
again is checked first as a resumed journal's engines are (``transitions.recheck``). With ``min_engines``, a failed
offload or onload fences the engines it failed on and runs again for the rest (``partial``). The journal records each
change (``Journal.member``: ``joining``, ``joined``, ``fenced``, ``left``); a restarted controller keeps an engine whose
join had not finished, or that was fenced, fenced (``transitions.resume``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from resilience.barrier.fanout import EngineResult
from resilience.barrier.journal import FENCED, JOINED, JOINING, LEFT, OFFLOAD_TOKEN
from resilience.barrier.state import BarrierBusy, BarrierState, EngineGroup, EngineKnowledge, EngineSkipped, PhaseFailed, TransitionReport
from resilience.barrier.transitions import (
    OFFLOAD_HOLD,
    ReadStep,
    Steps,
    Transition,
    continue_ready,
    error,
    hold,
    phase,
    resend,
    resume_phases,
    settle,
    skips,
    to_release,
    to_resume,
    transition,
    unhold,
)
from resilience.barrier.verify import EngineCheck, judge_one, unreadable
from resilience.engine_contract import AnyEngine, EngineState, EngineStateChanged, engine_name, rules_of
from resilience.events import emit

__all__ = [
    "GroupTarget", "admit", "fence", "fence_failed", "join_steps", "min_engines_arg", "retire", "partial",
]

E = TypeVar("E", bound=AnyEngine)


@dataclass(frozen=True, slots=True)
class GroupTarget:
    """Where a joining engine must be before it counts: in ``group``, ``offloaded`` (its engines hold the offload hold)
    with the ``released`` tags (their union; the same on each after an offload that returned), or serving."""

    group: EngineGroup[Any]
    offloaded: bool
    released: frozenset[str]


def _group(state: BarrierState[Any], group: str | int | None) -> int:
    """The index of ``group`` (a name, the first with it; an index; None: the first group)."""
    if group is None:
        return 0
    if isinstance(group, int) and not isinstance(group, bool):
        if 0 <= group < len(state.groups):
            return group
    else:
        for i, g in enumerate(state.groups):
            if g.name == group:
                return i
    raise ValueError(f"add: no group {group!r}; the groups are {', '.join(repr(g.name) for g in state.groups)} (by name or index)")


def target_of(state: BarrierState[Any], index: int, joining: str) -> GroupTarget:
    """The state of group ``index`` that ``joining`` must reach, read from the engines that count in it (``joining``
    itself left out): offloaded (and which tags) or serving."""
    group = state.groups[index]
    members = state.active(n for n in state.engines if state.group_of.get(n) == index and n != joining)
    offloaded = [n for n in members if OFFLOAD_TOKEN in state.know[n].holds]
    released = frozenset(t for n in offloaded for t in state.know[n].released)
    return GroupTarget(group, bool(offloaded) and group.needs_offload, released)


def admit(state: BarrierState[Any], engine: Any, group: str | int | None) -> tuple[str, GroupTarget]:
    """Register ``engine`` for a join into ``group`` (None: the first group, or the group a known engine is in); return
    its name and where it must get to.

    A new engine gets fresh knowledge (serving, nothing released); a known one (same name or URL) keeps what was known
    of it (a retired engine of another kind starts afresh) and is checked again at the join's start
    (``state.unchecked``). Refused (``BarrierBusy``, nothing registered) while a ``pause`` or ``weight_sync`` hold is held.
    """
    held = sorted({r for n, k in state.know.items() if n not in state.retired for i, r in k.holds.items() if i != OFFLOAD_TOKEN})
    if held:
        raise BarrierBusy(
            f"add: the engines are held paused by {', '.join(held)}; a joining engine could not be given that hold "
            "(its owner's unpause would not end it there): unpause first, then add"
        )
    name = engine_name(engine)
    try:
        known: str | None = state.name_of(name)
    except KeyError:
        known = None
    kind = rules_of(engine)
    name = known or name
    if known is not None and known not in state.retired:
        mine = state.group_of[name]
        if group is not None and _group(state, group) != mine:
            raise ValueError(f"add: {name} belongs to group {state.groups[mine].name!r}, not {group!r} (retire it first)")
        group = mine
        if state.kinds[name].kind != kind.kind:
            raise ValueError(f"add: {name} was a {state.kinds[name].kind} engine and is now a {kind.kind} engine (retire it first)")
    index = _group(state, group)
    target_group = state.groups[index]
    state.engines[name] = engine
    if known is None:
        state.know[name] = EngineKnowledge(name, memory=kind.memory)
    else:  # a restart at a known URL, or a retired engine back: what was known stands until a read tells a fresh process
        if name in state.retired and state.kinds[name].kind != kind.kind:
            state.know[name] = EngineKnowledge(name, memory=kind.memory)
        state.retired.discard(name)
        state.unchecked.add(name)
    state.kinds[name] = kind
    if name in state.offloaded and not target_group.needs_offload:
        state.offloaded.remove(name)  # a retired engine back in another group
    state.group_of[name] = index
    if target_group.needs_offload and name not in state.offloaded:
        state.offloaded.append(name)
    state.fenced.pop(name, None)
    with state.versions_lock:
        state.versions.pop(name, None)  # what it reports now is read by its join's checks, if any
    return name, target_of(state, index, name)


def join_steps(state: BarrierState[Any], name: str, target: GroupTarget, checks: Sequence[EngineCheck]) -> Steps[TransitionReport]:
    """Bring ``name`` (registered by ``admit``) to ``target``; it counts once there (see the module docstring).

    A join that cannot fences the engine (named in ``state.fenced``, with why) and raises ``PhaseFailed`` naming it;
    one abandoned by its driver (an interruption) leaves it joining, hence fenced at the next controller's start.
    """
    state.joining.discard(name)
    with transition(state, "join", [name]) as tx:
        state.joining.add(name)  # out of every other transition, and ``joining`` in ``states`` until it counts
        record(state, name, JOINING, target.group.name)
        emit(state.observers, EngineStateChanged(engine=name, from_state="", to_state=str(EngineState.JOINING)))
        skipped = yield from settle(state, tx, [name])
        k = state.know[name]
        if not skipped and k.quarantined:
            skipped[name] = state.why_skipped(name)
        if skipped:
            raise _fail(state, tx, name, "settle", skips(skipped))
        if target.offloaded:
            failed = yield from _to_offloaded(state, tx, name, target.released, checks)
        else:
            failed = yield from _to_serving(state, tx, name, checks)
        if failed:
            raise _fail(state, tx, name, tx.phase, failed)
        state.joining.discard(name)
        record(state, name, JOINED, target.group.name)
        emit(state.observers, EngineStateChanged(engine=name, from_state=str(EngineState.JOINING), to_state=str(k.state)))
    return tx.finished()


def _to_offloaded(
    state: BarrierState[Any], tx: Transition, name: str, tags: frozenset[str], checks: Sequence[EngineCheck]
) -> Steps[dict[str, BaseException]]:
    """Pause, flush and release ``tags`` on ``name``, as ``offload`` does (only where each call's precondition holds);
    the ``checks`` that read a paused engine are asked once it is paused, before anything is released (the canary is
    the group's ``onload(verify=...)``'s to ask: a paused engine cannot answer it)."""
    k = state.know[name]
    hold(state, name, OFFLOAD_TOKEN, OFFLOAD_HOLD)
    if (k.paused is not True or k.pause_mode == "in_place") and state.allows(name, "pause_generation"):
        failed = yield from phase(state, tx, "pause", "pause_generation", [(name, {"mode": "abort"})])
        if failed:
            return failed
    paused_checks = [c for c in checks if not c.needs_serving]
    if paused_checks and not k.released and not k.unknown:
        failed = yield from _verify(state, tx, name, paused_checks)
        if failed:
            return failed
    missing = to_release(k, tags)
    if missing and k.memory.flush_before_release and not k.flushed and state.allows(name, "flush_cache"):
        failed = yield from phase(state, tx, "flush", "flush_cache", [(name, {})])
        if failed:
            return failed
    if missing:
        if not state.allows(name, "release_memory_occupation", missing):
            return {name: EngineSkipped(f"{name} not allowed a release of {sorted(missing)}: {k.why_not_serving()}")}
        calls = [(name, k.memory.release_kwargs(missing))]
        failed = yield from phase(state, tx, "release", "release_memory_occupation", calls)
        failed = yield from resend(state, tx, "release", "release_memory_occupation", calls, failed)
        if failed:
            return failed
    if k.paused is not True or not tags <= k.released or k.unknown:
        return {name: EngineSkipped(f"{name} did not reach the group's state (paused, {sorted(tags)} released): {k.why_not_serving()}")}
    return {}


def _to_serving(state: BarrierState[Any], tx: Transition, name: str, checks: Sequence[EngineCheck]) -> Steps[dict[str, BaseException]]:
    """Resume what is released on ``name``; with ``checks``, pause it, ask the paused checks, continue it, ask the serving
    ones (a mismatch pauses it again); without, continue it where it is not serving."""
    k = state.know[name]
    if k.released or k.unknown:
        failed = yield from resume_phases(state, tx, "resume", {name: to_resume(k, k.memory.all_tags)})
        if failed:
            return failed
    if not k.released and not k.unknown:
        unhold(state, name, OFFLOAD_TOKEN)
    paused_checks = [c for c in checks if not c.needs_serving]
    serving_checks = [c for c in checks if c.needs_serving]
    if checks and k.paused is not True and state.allows(name, "pause_generation"):
        failed = yield from phase(state, tx, "pause", "pause_generation", [(name, {"mode": "retract"})])
        if failed:
            return failed
    if paused_checks:
        failed = yield from _verify(state, tx, name, paused_checks)
        if failed:
            return failed
    _, failed = yield from continue_ready(state, tx, [name])
    if failed:
        return failed
    if not k.serving:
        return {name: EngineSkipped(f"{name} is not serving after its join: {k.why_not_serving()}")}
    if serving_checks:
        failed = yield from _verify(state, tx, name, serving_checks)
        if failed:  # it served only the canary's read: paused again before anything else reaches it
            if state.allows(name, "pause_generation"):
                yield from phase(state, tx, "fence", "pause_generation", [(name, {"mode": "retract"})])
            tx.phase = "verify"
            return failed
    return {}


def _verify(state: BarrierState[Any], tx: Transition, name: str, checks: Sequence[EngineCheck]) -> Steps[dict[str, BaseException]]:
    """Ask ``checks`` of ``name`` in phase "verify" (one ``ReadStep`` each, under its limit); the first mismatch, by engine."""
    tx.phase = "verify"
    engine = state.engines[name]
    for check in checks:
        try:
            method, kwargs = check.request(engine)
        except TypeError as exc:
            return {name: unreadable(name, check, exc)}
        step: ReadStep[Any] = ReadStep(method, ((name, kwargs),), [(engine, kwargs)], tx.deadline.cap(state.deadlines.for_phase("verify")))
        yield step
        state.heard(step.results or ())
        results = step.results if step.error is None and step.results is not None and len(step.results) == 1 else None
        miss = judge_one(check, method, results[0] if results else EngineResult(name, error=step.error or RuntimeError("no answer")))
        if miss is not None:
            return {name: miss}
    return {}


def _fail(state: BarrierState[Any], tx: Transition, name: str, where: str, failed: Mapping[str, BaseException]) -> PhaseFailed:
    """The join of ``name`` failed in ``where``: fence it (named, journaled), then the ``PhaseFailed`` that ends it."""
    first = failed.get(name)
    why = f"its join failed in {where}" + ("" if first is None else f": {type(first).__name__}: {first}")
    fence(state, name, why)
    return error(state, tx, where, failed)


def record(state: BarrierState[Any], name: str, change: str, group: str) -> None:
    """Write the membership change ``change`` of ``name`` (in the group named ``group``) to the journal, with its facts;
    nothing without one."""
    if state.journal is not None:
        state.journal.member(name, change, group, state.know, retired=state.retired, budget=state.restart_budget)


def _group_name(state: BarrierState[Any], name: str) -> str:
    index = state.group_of.get(name)
    return "" if index is None else state.groups[index].name


def fence(state: BarrierState[Any], name: str, why: str) -> None:
    """Take ``name`` out of every transition and out of rotation (``EngineState.FENCED``), with ``why``; journaled."""
    before = state.states().get(name, state.know[name].state)
    state.joining.discard(name)
    state.fenced[name] = why
    record(state, name, FENCED, _group_name(state, name))
    emit(state.observers, EngineStateChanged(engine=name, from_state=str(before), to_state=str(EngineState.FENCED)))


def retire(state: BarrierState[E], engine: str | E) -> None:
    """Stop sending anything to ``engine`` (name, URL or engine object): no transition covers or names it again; the
    journal records that it left, with its facts."""
    name = state.name_of(engine)
    with state.lock:
        state.retired.add(name)
        state.fenced.pop(name, None)
        state.joining.discard(name)
        state.label = "retire"
        record(state, name, LEFT, _group_name(state, name))
        state.persist((name,))  # the knowledge hook; the record above holds every fact, so a journal writes nothing more


def min_engines_arg(min_engines: int | None, transition: str) -> int | None:
    """``min_engines`` checked: None, or an integer >= 1."""
    if min_engines is None:
        return None
    if isinstance(min_engines, bool) or not isinstance(min_engines, int) or min_engines < 1:
        raise ValueError(f"{transition} min_engines must be an integer >= 1 or None, but was {min_engines!r}")
    return min_engines


def fence_failed(state: BarrierState[Any], err: PhaseFailed, min_engines: int | None, fenced: dict[str, str]) -> bool:
    """After ``err`` ended a transition: with ``min_engines``, fence the engines it failed on when at least that many of
    the engines it covered are left, add them to ``fenced`` and return True (the caller runs the transition again);
    else False (the caller raises ``err``, as without the option)."""
    if min_engines is None:
        return False
    covered = state.active(state.offloaded)
    failed = [n for n in err.failures if n in covered]
    if not failed or len(covered) - len(failed) < min_engines:
        return False
    for n in failed:
        why = f"fenced by {err.transition} ({err.phase}): {type(err.failures[n]).__name__}: {err.failures[n]}"
        fence(state, n, why)
        fenced[n] = why
    return True


def partial(state: BarrierState[Any], steps: Callable[[], Steps[TransitionReport]], min_engines: int | None) -> Steps[TransitionReport]:
    """The transition ``steps()``; with ``min_engines``, fence the engines it failed on and run it again for the rest while
    enough are left (``fence_failed``), else its ``PhaseFailed`` goes on. The report names the engines fenced on its way
    (``TransitionReport.fenced``)."""
    fenced: dict[str, str] = {}
    while True:
        try:
            report = yield from steps()
        except PhaseFailed as err:
            if not fence_failed(state, err, min_engines, fenced):
                raise
        else:
            return replace(report, fenced=dict(fenced)) if fenced else report
