"""One phase as a step: each engine's facts marked in flight (write-ahead, persisted), then its results folded in.

``phase`` yields the ``PhaseCall``; when the driver hands it back, its
results are folded: each engine's mark is settled from its result
(``effect_of``: applied, not applied, maybe), the memory probe is asked
(``settle.probe``), the change persisted; while the probe's "as before" is
not trusted yet (a request that may still be on its way), the phase polls it
(``settle.poll``: it yields ``WaitCall``s) until it proves the call applied or
the grace has passed; and only then are the observers told. A driver that
stopped inside a step calls ``abandon``: what it learnt is folded (``fold``,
which never waits), the rest stays "maybe"; one stopped while the phase polled
leaves the engines it polled for quarantined, with their doubt.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from resilience.barrier.effect import effect_of, is_engine_dead
from resilience.barrier.fanout import EngineResult, interrupted_results
from resilience.barrier.knowledge import RELEASE, RESUME, Effect, EngineKnowledge
from resilience.barrier.rules import BarrierRules
from resilience.barrier.settle import doubt, poll, probe
from resilience.barrier.steps import Call, PhaseCall, Step, Steps, Transition
from resilience.barrier.types import PhaseReport, short
from resilience.engine_contract import ControlMethod
from resilience.events import PhaseEnded, PhaseFailure, PhaseStarted, emit

__all__ = ["Interrupted", "abandon", "fold", "phase"]


class Interrupted(RuntimeError):
    """The failure of a call whose phase was interrupted before its answer was read: it may have been applied."""


def phase(
    rules: BarrierRules[Any], tx: Transition, name: str, method: ControlMethod, calls: Sequence[Call]
) -> Steps[dict[str, BaseException]]:
    """One phase (``name``) on every engine at once; each outcome is folded into its knowledge. Returns the failures.

    Write-ahead: each engine's facts are marked in flight (and persisted) before the step is yielded. When that
    record cannot be written (``persist`` raises: ``ENOSPC``, ``EIO``), the step is never yielded, so no call leaves:
    the marks are settled as not applied and the error goes on (the same orchestrator's next transition starts from
    the facts as they were, nothing quarantined).
    """
    if not calls:
        return {}
    names = tuple(n for n, _ in calls)
    deadline = tx.deadline.cap(rules.deadlines.for_phase(name))
    started = PhaseStarted(transition_id=tx.tid, transition=tx.name, phase=name, engines=names, deadline_s=deadline.remaining())
    emit(rules.observers, started)
    tx.phase = name
    rules.label = f"{tx.name} {name}"
    before = {n: rules.know[n].state for n in names}
    engines = [(rules.engines[n], kw) for n, kw in calls]
    step = PhaseCall(tx, name, method, tuple(calls), engines, deadline, rules.clock.monotonic(), before)
    for n, kwargs in calls:
        step.marks[n] = rules.know[n].mark(method, kwargs)
    try:
        rules.persist(names)
    except BaseException as exc:  # the write-ahead was not written (a full disk): nothing is sent, so nothing was applied
        _unmark(rules, step, exc)
        raise
    yield step
    assert step.results is not None and len(step.results) == len(step.calls), f"{step.phase}: the driver gave no result per engine"
    step.folded = True
    waiting: dict[str, float] = {}
    failures = _fold_knowledge(rules, step, step.results, waiting)
    try:
        if waiting:  # the probe's "as before" is not trusted yet: ask again until it proves applied or the grace passed
            settled = yield from poll(rules, waiting, step.deadline)
            _drop_done(rules, step, failures, settled)
    finally:  # reported once, also when the poll is interrupted (the knowledge is already folded and persisted)
        _report(rules, step, step.results, failures)
    return failures


def _unmark(rules: BarrierRules[Any], step: PhaseCall[Any], error: BaseException) -> None:
    """The step's write-ahead could not be persisted (``error``), so its calls are never sent: settle each mark as not
    applied (the facts go back to what they were; the journal still holds them so, its last record being the one
    before), then end the phase for the observers (``PhaseEnded``, every engine failed with ``error``)."""
    for n, _kwargs in step.calls:
        k = rules.know[n]
        if k.pending is not None and k.pending is step.marks.get(n):
            k.settle(Effect.NOT_APPLIED)
    tx, names = step.tx, tuple(n for n, _ in step.calls)
    failed = tuple(PhaseFailure(engine=n, error_type=type(error).__name__, message=short(error)) for n in names)
    duration = rules.clock.monotonic() - step.started
    ended = PhaseEnded(transition_id=tx.tid, transition=tx.name, phase=step.phase, engines=names, duration_s=duration, failures=failed)
    emit(rules.observers, ended)


def fold(rules: BarrierRules[Any], step: PhaseCall[Any], results: Sequence[EngineResult | None]) -> dict[str, BaseException]:
    """Fold a phase's results into the knowledge, then report it (once); return the failures. Never waits (the probe is
    asked once): what ``abandon`` uses.

    Every engine is folded, the memory probe asked and the change persisted
    before any observer hears of it, so nothing an observer raises undoes it.
    """
    step.folded = True
    failures = _fold_knowledge(rules, step, results)
    _report(rules, step, results, failures)
    return failures


def _report(
    rules: BarrierRules[Any], step: PhaseCall[Any], results: Sequence[EngineResult | None], failures: Mapping[str, BaseException]
) -> None:
    """Tell the observers what the folded phase did: its ``PhaseReport``, each engine's state change, ``PhaseEnded``."""
    tx, names = step.tx, tuple(n for n, _ in step.calls)
    duration = rules.clock.monotonic() - step.started
    durations = [r.duration_s for r in results if r is not None]
    tx.phases.append(PhaseReport(step.phase, names, duration, max(durations, default=0.0)))
    for name in names:
        rules.announce(name, step.before.get(name, rules.know[name].state))
    failed = tuple(PhaseFailure(engine=n, error_type=type(e).__name__, message=short(e)) for n, e in failures.items())
    ended = PhaseEnded(transition_id=tx.tid, transition=tx.name, phase=step.phase, engines=names, duration_s=duration, failures=failed)
    emit(rules.observers, ended)


def _fold_knowledge(
    rules: BarrierRules[Any],
    step: PhaseCall[Any],
    results: Sequence[EngineResult | None],
    waiting: dict[str, float] | None = None,
) -> dict[str, BaseException]:
    """Settle each engine's write-ahead mark from its result (engines already settled are left alone: safe to redo after
    an interruption); ask the probe; persist. A None result is a call whose outcome will never be known: it stays "maybe".
    ``waiting`` (when given) gets the engines whose probe answer is not trusted yet, with the grace left (``settle.probe``)."""
    method = step.method
    failures: dict[str, BaseException] = {}
    for (name, _kwargs), result in zip(step.calls, results, strict=True):
        k = rules.know[name]
        mine = k.pending is not None and k.pending is step.marks.get(name)  # a later step's mark is not this step's to settle
        if result is None:
            if mine:
                k.abandon()
                doubt(rules, k, method, None)
            failures[name] = Interrupted(f"{name}: the phase was interrupted while {method} ran; it may have been applied")
            continue
        if mine:
            if result.late is not None:
                k.late(result.late)
            else:
                effect = effect_of(result.error)
                k.settle(effect)
                if effect is Effect.MAYBE:
                    doubt(rules, k, method, result.error)
        if result.error is not None:
            failures[name] = result.error
            if is_engine_dead(result.error) and k.dead is None:
                k.dead = f"{type(result.error).__name__} in {step.phase}"
    names = tuple(n for n, _ in step.calls)
    rules.persist(names)
    _drop_done(rules, step, failures, probe(rules, names, waiting))  # each engine it settles is persisted on its own
    return failures


def _drop_done(rules: BarrierRules[Any], step: PhaseCall[Any], failures: dict[str, BaseException], settled: Sequence[str]) -> None:
    """Drop from ``failures`` each engine among ``settled`` (by the probe) whose call the knowledge now proves done."""
    calls = dict(step.calls)
    for name in settled:
        if name in failures and _done(rules.know[name], step.method, calls[name]):
            del failures[name]  # the probe proves the call did what it was sent for


def abandon(rules: BarrierRules[Any], steps: Steps[Any], step: Step, error: BaseException | None = None) -> None:
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
                if any(rules.know[n].pending is step.marks.get(n) for n, _ in step.calls):
                    _fold_knowledge(rules, step, results)
            else:
                fold(rules, step, results)
    finally:
        steps.close()


def _done(k: EngineKnowledge, method: str, kwargs: Mapping[str, Any]) -> bool:
    """The knowledge proves ``method(**kwargs)`` took effect (a release's tags released, a resume's back)."""
    if method == RELEASE:
        return k.memory.release_tags(kwargs) <= k.released and not k.unknown and k.dead is None
    if method == RESUME:
        return not (k.memory.resume_tags(kwargs) & (k.released | k.unknown)) and k.dead is None
    return False
