"""Membership: engines that join a running group (``add``), leave it (``retire``), and are fenced (partial progress).

A group's membership changes while it runs: an engine is added to the fleet, one
restarts at its URL, one dies or is retired. Everything here decides without I/O;
the orchestrators drive the join's steps (``join_steps``) as they drive any
transition, and call the rest under their own exclusion.

**Join** (``Orchestrator.add``, ``AsyncOrchestrator.add``). A joining engine counts
(is covered by the group's transitions, and named serving by ``states``) only once
it reached the group's current state:

- into an *offloaded* group (its engines hold the offload hold, some tags released)
  it is paused, flushed and released (the tags the group has released) first; the
  ``verify`` checks that read a paused engine are asked once it is paused, before
  the release (a canary is the group's ``onload(verify=...)``'s to ask);
- into a *serving* group it is verified before it serves: with ``verify`` checks, it
  is paused, the checks that read a paused engine (``WeightVersionCheck``) are asked,
  it is continued, and the checks that need a serving engine (``CanaryCheck``) are
  asked; a mismatch pauses it again. Without checks it counts as it is.

Until then its state is ``joining`` (``EngineState.JOINING``): no transition covers
it, and a router (``SmgRouter``) keeps it out of rotation, as it does every engine
not serving. A join that cannot bring it there fences it (below) and raises
``PhaseFailed`` naming it. A join never runs while a ``weight_sync`` body runs (it
waits, as offload does) or while a ``pause`` hold is held (refused with
``BarrierBusy``: the hold's owner could not end it on the new engine).

A *known* engine given to ``add`` again (the same name or URL: a restart, a
replacement client) is checked first as a resumed journal's engines are
(``resume_check.recheck``): the memory probe, and its kind's ``ServingRead``
(SGLang's ``/ready``, vLLM's ``/is_paused``). An engine the barrier knows released
that answers as a fresh process is taken as new (``TransitionReport.replaced``
names it), never resumed onto memory it does not have; one that proves nothing
keeps what the barrier knew of it.

**Leave**. ``retire`` (or an engine fenced) takes it out of every transition at
once; the transition under way goes on for the others, and a router deregisters a
retired engine from its gateway (``SmgRouter``: ``DELETE /workers/{id}``).

**Partial progress, opt-in** (``offload(min_engines=N)``, ``onload(min_engines=N)``).
Without it a transition that cannot prove one engine fails for all (``PhaseFailed``),
as before. With it, when the transition fails and at least ``N`` of the engines it
covered are not among those it failed on, those engines are *fenced*: no transition
covers them (nothing more is sent to them: they are kept as the failed transition
left them, paused where it paused them), their state is ``fenced``
(``EngineState.FENCED``, so a router keeps them out of rotation), they are named in
``TransitionReport.fenced`` with why, and the transition runs again for the rest (a
transition is idempotent: what the failed run left in place is not sent again; what its
rollback undid, with ``rollback=True``, is done again). A fenced
engine comes back through ``add`` (checked and brought to the group's state) or
``retire``. Why a count and not a fraction: a trainer knows how many engines its
rollout batch needs; a fraction of a fleet that is itself changing is not a
promise anyone can check.

**The journal** records membership (``Journal.member``): ``joining`` before the
join's first command, then ``joined`` or ``fenced``, and ``left`` on ``retire``. A
restarted controller is given the engines that joined (the journal refuses a fleet
without them, naming them) and reads who joined and who left in
``Recovery.members``; an engine whose join had not finished, or that was fenced,
stays fenced until ``add`` brings it in again.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from resilience.barrier.engine import CONTROL_METHODS
from resilience.barrier.fanout import engine_name
from resilience.barrier.fold import phase
from resilience.barrier.holds import OFFLOAD_HOLD, hold, unhold
from resilience.barrier.journal import MEMBER_CHANGES, OFFLOAD_TOKEN
from resilience.barrier.kinds import rules_of
from resilience.barrier.knowledge import EngineKnowledge, EngineState
from resilience.barrier.memory import resend, resume_phases, to_release, to_resume
from resilience.barrier.onload import continue_ready
from resilience.barrier.rules import BarrierRules
from resilience.barrier.settle import settle
from resilience.barrier.steps import ReadCall, Steps, Transition
from resilience.barrier.transition import error, skips, transition
from resilience.barrier.types import BarrierBusy, EngineGroup, EngineSkipped, PhaseFailed, TransitionReport
from resilience.barrier.verify import CheckFailed, EngineCheck
from resilience.events import EngineStateChanged, emit

__all__ = [
    "GroupTarget",
    "admit",
    "fence",
    "fence_failed",
    "join_steps",
    "left",
    "min_engines_arg",
    "require_coroutines",
    "take_up",
    "with_fenced",
]

JOINING, JOINED, FENCED, LEFT = MEMBER_CHANGES
"""The membership changes the journal records (``Journal.member``)."""


class GroupTarget:
    """Where a joining engine must be before it counts: ``offloaded`` with ``released`` tags, or serving.

    ``group``: the group it joins; ``offloaded``: its engines hold the offload hold; ``released``: the tags released on
    them (their union; the same on each after an offload that returned).
    """

    def __init__(self, group: EngineGroup[Any], offloaded: bool, released: frozenset[str]) -> None:
        self.group = group
        self.offloaded = offloaded
        self.released = released

    def __repr__(self) -> str:
        where = f"offloaded, {sorted(self.released)} released" if self.offloaded else "serving"
        return f"GroupTarget({self.group.name!r}, {where})"


def _group(rules: BarrierRules[Any], group: str | int | None) -> int:
    """The index of ``group`` (a name, the first with it; an index; None: the first group)."""
    if group is None:
        return 0
    if isinstance(group, int) and not isinstance(group, bool):
        if 0 <= group < len(rules.groups):
            return group
    else:
        for i, g in enumerate(rules.groups):
            if g.name == group:
                return i
    raise ValueError(f"add: no group {group!r}; the groups are {', '.join(repr(g.name) for g in rules.groups)} (by name or index)")


def target_of(rules: BarrierRules[Any], index: int, joining: str) -> GroupTarget:
    """The state of group ``index`` that ``joining`` must reach, read from the engines that count in it (``joining``
    itself left out): offloaded (and which tags) or serving."""
    group = rules.groups[index]
    members = rules.active(n for n in rules.engines if rules.group_of.get(n) == index and n != joining)
    offloaded = [n for n in members if OFFLOAD_TOKEN in rules.know[n].holds]
    released = frozenset(t for n in offloaded for t in rules.know[n].released)
    return GroupTarget(group, bool(offloaded) and group.needs_offload, released)


def require_coroutines(name: str, engine: object) -> None:
    """``AsyncOrchestrator.add``: refuse an engine whose control calls are not coroutines (it would block the loop)."""
    for method in CONTROL_METHODS:
        if not inspect.iscoroutinefunction(getattr(engine, method, None)):
            raise TypeError(
                f"AsyncOrchestrator.add cannot drive engine {name}: its {method} is missing or not a coroutine function "
                "(it would block the event loop; drive synchronous engines with Orchestrator)"
            )


def admit(rules: BarrierRules[Any], engine: Any, group: str | int | None) -> tuple[str, GroupTarget]:
    """Register ``engine`` for a join into ``group`` (None: the first group, or the group a known engine is in); return
    its name and where it must get to.

    A new engine gets fresh knowledge (serving, nothing released: what the orchestrators assume of the engines they are
    built with); a known one (same name or URL: restarted, fenced, or retired and back) keeps what was known of it (a
    retired engine of another kind starts afresh) and is checked again at the join's start (``rules.unchecked``: the
    memory probe and its kind's ``ServingRead`` take a fresh process as new).
    Refused (``BarrierBusy``, nothing registered) while a ``pause`` or ``weight_sync`` hold is held.
    """
    held = sorted({r for n, k in rules.know.items() if n not in rules.retired for i, r in k.holds.items() if i != OFFLOAD_TOKEN})
    if held:
        raise BarrierBusy(
            f"add: the engines are held paused by {', '.join(held)}; a joining engine could not be given that hold "
            "(its owner's unpause would not end it there): unpause first, then add"
        )
    name = engine_name(engine)
    try:
        known: str | None = rules.name_of(name)
    except KeyError:
        known = None
    kind = rules_of(engine)
    name = known or name
    if known is not None and known not in rules.retired:
        mine = rules.group_of[name]
        if group is not None and _group(rules, group) != mine:
            raise ValueError(f"add: {name} belongs to group {rules.groups[mine].name!r}, not {group!r} (retire it first)")
        group = mine
        if rules.kinds[name].kind != kind.kind:
            raise ValueError(f"add: {name} was a {rules.kinds[name].kind} engine and is now a {kind.kind} engine (retire it first)")
    index = _group(rules, group)
    target_group = rules.groups[index]
    rules.engines[name] = engine
    if known is None:
        rules.know[name] = EngineKnowledge(name, memory=kind.memory)
    else:  # a restart at a known URL, or a retired engine back: what was known stands until a read tells a fresh process
        if name in rules.retired and rules.kinds[name].kind != kind.kind:
            rules.know[name] = EngineKnowledge(name, memory=kind.memory)
        rules.retired.discard(name)
        rules.unchecked.add(name)
    rules.kinds[name] = kind
    if name in rules.offloaded and not target_group.needs_offload:
        rules.offloaded.remove(name)  # a retired engine back in another group
    rules.group_of[name] = index
    if target_group.needs_offload and name not in rules.offloaded:
        rules.offloaded.append(name)
    rules.fenced.pop(name, None)
    return name, target_of(rules, index, name)


def join_steps(
    rules: BarrierRules[Any], name: str, target: GroupTarget, checks: Sequence[EngineCheck]
) -> Steps[TransitionReport]:
    """Bring ``name`` (registered by ``admit``) to ``target``; it counts once there (see the module docstring).

    A join that cannot fences the engine (named in ``rules.fenced``, with why) and raises ``PhaseFailed`` naming it;
    one abandoned by its driver (an interruption) leaves it joining, hence fenced at the next controller's start.
    """
    rules.joining.discard(name)
    with transition(rules, "join", [name]) as tx:
        rules.joining.add(name)  # out of every other transition, and ``joining`` in ``states`` until it counts
        record(rules, name, JOINING, target.group.name)
        emit(rules.observers, EngineStateChanged(engine=name, from_state="", to_state=str(EngineState.JOINING)))
        skipped = yield from settle(rules, tx, [name])
        k = rules.know[name]
        if not skipped and k.quarantined:
            skipped[name] = rules.why_skipped(name)
        if skipped:
            raise _fail(rules, tx, name, "settle", skips(skipped))
        if target.offloaded:
            failed = yield from _to_offloaded(rules, tx, name, target.released, checks)
        else:
            failed = yield from _to_serving(rules, tx, name, checks)
        if failed:
            raise _fail(rules, tx, name, tx.phase, failed)
        rules.joining.discard(name)
        record(rules, name, JOINED, target.group.name)
        emit(rules.observers, EngineStateChanged(engine=name, from_state=str(EngineState.JOINING), to_state=str(k.state)))
    return tx.finished()


def _to_offloaded(
    rules: BarrierRules[Any], tx: Transition, name: str, tags: frozenset[str], checks: Sequence[EngineCheck]
) -> Steps[dict[str, BaseException]]:
    """Pause, flush and release ``tags`` on ``name``, as ``offload`` does (only where each call's precondition holds);
    the ``checks`` that read a paused engine are asked once it is paused, before anything is released (the canary is
    the group's ``onload(verify=...)``'s to ask: a paused engine cannot answer it)."""
    k = rules.know[name]
    hold(rules, name, OFFLOAD_TOKEN, OFFLOAD_HOLD)
    if (k.paused is not True or k.pause_mode == "in_place") and rules.allows(name, "pause_generation"):
        failed = yield from phase(rules, tx, "pause", "pause_generation", [(name, {"mode": "abort"})])
        if failed:
            return failed
    paused_checks = [c for c in checks if not c.needs_serving]
    if paused_checks and not k.released and not k.unknown:
        tx.phase = "verify"
        failed = yield from _verify(rules, tx, name, paused_checks)
        if failed:
            return failed
    missing = to_release(k, tags)
    if missing and k.memory.flush_before_release and not k.flushed and rules.allows(name, "flush_cache"):
        failed = yield from phase(rules, tx, "flush", "flush_cache", [(name, {})])
        if failed:
            return failed
    if missing:
        if not rules.allows(name, "release_memory_occupation", missing):
            return {name: EngineSkipped(f"{name} not allowed a release of {sorted(missing)}: {k.why_not_serving()}")}
        calls = [(name, k.memory.release_kwargs(missing))]
        failed = yield from phase(rules, tx, "release", "release_memory_occupation", calls)
        failed = yield from resend(rules, tx, "release", "release_memory_occupation", calls, failed)
        if failed:
            return failed
    if k.paused is not True or not tags <= k.released or k.unknown:
        return {name: EngineSkipped(f"{name} did not reach the group's state (paused, {sorted(tags)} released): {k.why_not_serving()}")}
    return {}


def _to_serving(rules: BarrierRules[Any], tx: Transition, name: str, checks: Sequence[EngineCheck]) -> Steps[dict[str, BaseException]]:
    """Resume what is released on ``name``; with ``checks``, pause it, ask the paused checks, continue it, ask the serving
    ones (a mismatch pauses it again); without, continue it where it is not serving."""
    k = rules.know[name]
    if k.released or k.unknown:
        failed = yield from resume_phases(rules, tx, "resume", {name: to_resume(k, k.memory.all_tags)})
        if failed:
            return failed
    if not k.released and not k.unknown:
        unhold(rules, name, OFFLOAD_TOKEN)
    paused_checks = [c for c in checks if not c.needs_serving]
    serving_checks = [c for c in checks if c.needs_serving]
    if checks and k.paused is not True and rules.allows(name, "pause_generation"):
        failed = yield from phase(rules, tx, "pause", "pause_generation", [(name, {"mode": "retract"})])
        if failed:
            return failed
    if paused_checks:
        tx.phase = "verify"
        failed = yield from _verify(rules, tx, name, paused_checks)
        if failed:
            return failed
    failed = yield from continue_ready(rules, tx, [name], "continue")
    if failed:
        return failed
    if not k.serving:
        return {name: EngineSkipped(f"{name} is not serving after its join: {k.why_not_serving()}")}
    if serving_checks:
        tx.phase = "verify"
        failed = yield from _verify(rules, tx, name, serving_checks)
        if failed:  # it served only the canary's read: paused again before anything else reaches it
            if rules.allows(name, "pause_generation"):
                yield from phase(rules, tx, "fence", "pause_generation", [(name, {"mode": "retract"})])
            tx.phase = "verify"
            return failed
    return {}


def _verify(rules: BarrierRules[Any], tx: Transition, name: str, checks: Sequence[EngineCheck]) -> Steps[dict[str, BaseException]]:
    """Ask ``checks`` of ``name`` (one ``ReadCall`` each, under the verify limit); the first mismatch, by engine."""
    engine = rules.engines[name]
    for check in checks:
        try:
            method, kwargs = check.request(engine)
        except TypeError as exc:
            return {name: CheckFailed(name, check.name, None, None, detail=f"{check.name}: {exc}")}
        deadline = tx.deadline.cap(rules.deadlines.for_phase("verify"))
        step: ReadCall[Any] = ReadCall(method, ((name, kwargs),), [(engine, kwargs)], deadline)
        yield step
        if step.error is not None or step.results is None or len(step.results) != 1:
            why = step.error if step.error is not None else "no answer"
            return {name: CheckFailed(name, check.name, None, None, detail=f"{check.name}: could not read it ({method}): {why}")}
        result = step.results[0]
        if result.error is not None:
            detail = f"{check.name}: could not read it ({method}): {type(result.error).__name__}: {result.error}"
            return {name: CheckFailed(name, check.name, None, None, detail=detail)}
        verdict = check.judge(name, result.value)
        if verdict is not None:
            return {name: verdict}
    return {}


def _fail(rules: BarrierRules[Any], tx: Transition, name: str, where: str, failed: Mapping[str, BaseException]) -> PhaseFailed:
    """The join of ``name`` failed in ``where``: fence it (named, journaled), then the ``PhaseFailed`` that ends it."""
    first = failed.get(name)
    why = f"its join failed in {where}" + ("" if first is None else f": {type(first).__name__}: {first}")
    fence(rules, name, why)
    return error(rules, tx, where, failed)


def record(rules: BarrierRules[Any], name: str, change: str, group: str) -> None:
    """Write the membership change ``change`` of ``name`` (in the group named ``group``) to the journal, with its facts;
    nothing without one."""
    if rules.journal is not None:
        rules.journal.member(name, change, group, rules.know, retired=rules.retired)


def _group_name(rules: BarrierRules[Any], name: str) -> str:
    index = rules.group_of.get(name)
    return "" if index is None else rules.groups[index].name


def fence(rules: BarrierRules[Any], name: str, why: str) -> None:
    """Take ``name`` out of every transition and out of rotation (``EngineState.FENCED``), with ``why``; journaled."""
    before = rules.states().get(name, rules.know[name].state)
    rules.joining.discard(name)
    rules.fenced[name] = why
    record(rules, name, FENCED, _group_name(rules, name))
    emit(rules.observers, EngineStateChanged(engine=name, from_state=str(before), to_state=str(EngineState.FENCED)))


def left(rules: BarrierRules[Any], name: str) -> None:
    """``name`` was retired: journal that it left (``retire`` already wrote its facts)."""
    rules.fenced.pop(name, None)
    rules.joining.discard(name)
    record(rules, name, LEFT, _group_name(rules, name))


def take_up(rules: BarrierRules[Any], members: Mapping[str, str]) -> None:
    """A resumed journal's membership: an engine whose join had not finished, or that was fenced, stays fenced (``add``
    brings it in again); called by ``recovery.resume``."""
    for name, change in members.items():
        if name in rules.know and name not in rules.retired and change in (JOINING, FENCED):
            why = "its join had not finished when the last controller stopped" if change == JOINING else "fenced by the last controller"
            rules.fenced[name] = f"{why}: add() it again"


def min_engines_arg(min_engines: int | None, transition: str) -> int | None:
    """``min_engines`` checked: None, or an integer >= 1."""
    if min_engines is None:
        return None
    if isinstance(min_engines, bool) or not isinstance(min_engines, int) or min_engines < 1:
        raise ValueError(f"{transition} min_engines must be an integer >= 1 or None, but was {min_engines!r}")
    return min_engines


def fence_failed(rules: BarrierRules[Any], err: PhaseFailed, min_engines: int | None, fenced: dict[str, str]) -> bool:
    """After ``err`` ended a transition: with ``min_engines``, fence the engines it failed on when at least that many of
    the engines it covered are left, add them to ``fenced`` and return True (the caller runs the transition again);
    else False (the caller raises ``err``, as without the option)."""
    if min_engines is None:
        return False
    covered = rules.active(rules.offloaded)
    failed = [n for n in err.failures if n in covered]
    if not failed or len(covered) - len(failed) < min_engines:
        return False
    for n in failed:
        why = f"fenced by {err.transition} ({err.phase}): {type(err.failures[n]).__name__}: {err.failures[n]}"
        fence(rules, n, why)
        fenced[n] = why
    return True


def with_fenced(report: TransitionReport, fenced: Mapping[str, str]) -> TransitionReport:
    """``report`` naming the engines fenced on its way (``TransitionReport.fenced``)."""
    return replace(report, fenced=dict(fenced)) if fenced else report
