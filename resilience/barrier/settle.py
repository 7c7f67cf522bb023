"""A transition's start, and the memory probe: late calls waited for, quarantined engines asked about.

With a ``MemoryProbe``, an engine whose released tags became unknown (an
ambiguous release or resume) is reconciled from the probe right after the
fold (``fold``), and again at the start of the next transition (``settle``);
a probe that cannot prove it leaves the quarantine as it is. Its answer is
trusted as the transport's ``MemoryProbeCheck`` (``adapters/sglang_memory.py``)
trusts it: "applied" at once; "as before" at once only after a 502 or 503
(the gateway answered for the request), and after a request that may still
be on its way (the knowledge's ``Doubt``: a reset or read timeout after
sending, a 504, no delivery record, an interruption) only once
``PhaseDeadlines.in_transit_s`` has passed, which the start of the next
transition waits out (up to its settle limit) before it asks again. Else a
release that lands just after the probe said "not released" would be released
again, and SGLang dies of the double release.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from resilience.barrier.effect import doubt_of, effect_of, is_engine_dead
from resilience.barrier.holds import unhold
from resilience.barrier.journal import OFFLOAD_TOKEN
from resilience.barrier.knowledge import RELEASE, RESUME, Effect, EngineKnowledge
from resilience.barrier.rules import BarrierRules
from resilience.barrier.steps import SettleCall, Steps, Transition, WaitCall
from resilience.memory_probe import MemoryProbe

__all__ = ["doubt", "land", "probe", "settle"]


def settle(rules: BarrierRules[Any], tx: Transition, names: Sequence[str]) -> Steps[dict[str, str]]:
    """Start of a transition: drop marks an interruption left, wait (up to the continue phase's limit) for calls still in
    flight, ask the memory probe about quarantined engines (waiting out a grace first, when that is what keeps it from
    being trusted); return the engines to skip, with why."""
    know = rules.know
    stale = [n for n in names if know[n].pending is not None]
    for n in stale:
        k = know[n]
        method = k.pending.method if k.pending is not None else ""
        k.abandon()
        doubt(rules, k, method, None)
    if stale:
        rules.persist(stale)
    late = {n: k.in_flight.call for n in names if (k := know[n]).in_flight is not None}
    if late:
        tx.phase = "settle"
        step = SettleCall(late, tx.deadline.cap(rules.deadlines.for_phase("settle")))
        yield step
        before = {n: know[n].state for n in step.landed}
        for n, error in step.landed.items():
            land(rules, n, error)
        if step.landed:
            rules.persist(tuple(step.landed))
        for n in before:
            rules.announce(n, before[n])
    before = {n: know[n].state for n in names}
    waiting: dict[str, float] = {}
    settled = probe(rules, names, waiting)
    cap = tx.deadline.cap(rules.deadlines.for_phase("settle"))
    if waiting and max(waiting.values()) <= cap.remaining():  # a request may still be on its way: wait it out, ask again
        tx.phase = "settle"
        yield WaitCall(tx.deadline.cap(max(waiting.values())))
        settled += probe(rules, waiting)
    for n in settled:
        rules.announce(n, before[n])
    return {n: rules.why_skipped(n) for n in names if know[n].dead is not None or know[n].in_flight is not None}


def land(rules: BarrierRules[Any], name: str, error: BaseException | None) -> None:
    """Fold a late call that landed (the caller persists and announces)."""
    k = rules.know[name]
    effect = effect_of(error)
    late = k.land(effect)
    if late is not None and effect is Effect.MAYBE:
        doubt(rules, k, late.method, error)
    if error is not None and is_engine_dead(error):
        k.dead = f"{type(error).__name__} after a late call"


def doubt(rules: BarrierRules[Any], k: EngineKnowledge, method: str, error: BaseException | None) -> None:
    """A release or resume had a "maybe" effect and left ``k``'s tags unknown: keep why, and whether its request may
    still be on its way (``error`` None: its answer was never read). The caller persists."""
    if method in (RELEASE, RESUME) and k.unknown:
        k.doubt = doubt_of(method, error, rules.clock.monotonic())


def probe(rules: BarrierRules[Any], names: Iterable[str], waiting: dict[str, float] | None = None) -> list[str]:
    """Reconcile from the memory probe every engine among ``names`` whose tags are unknown; return those it settled.

    An answer is trusted when it proves the call applied, when the request is not on its way (``Doubt.in_transit``
    False: a 502/503), or once the grace (``PhaseDeadlines.in_transit_for``) has passed since the answer; else the
    engine stays quarantined, and ``waiting`` (when given) gets the seconds of grace left for it.
    """
    memory_probe = rules.memory_probe
    if memory_probe is None:
        return []
    settled: list[str] = []
    for name in names:
        k = rules.know[name]
        if not k.unknown or k.in_flight is not None or k.pending is not None or name in rules.retired:
            continue
        released = _ask(memory_probe, name, k.memory.all_tags)
        if released is None:
            continue
        left = _grace_left(rules, k, released)
        if left > 0:
            if waiting is not None:
                waiting[name] = left
            continue
        k.released.update(k.unknown & released)  # known first, then no longer unknown
        k.unknown.clear()
        k.doubt = None
        rules.persist((name,))
        if not k.released:
            unhold(rules, name, OFFLOAD_TOKEN)
        settled.append(name)
    return settled


def _grace_left(rules: BarrierRules[Any], k: EngineKnowledge, released: frozenset[str]) -> float:
    """Seconds before the probe's answer ``released`` may be trusted for ``k`` (0: now)."""
    why = k.doubt
    if why is None:  # unknown tags with no record of why (cannot happen through the rules): trusted as before
        return 0.0
    if not why.in_transit or why.proves_applied(frozenset(k.unknown), released):
        return 0.0
    return max(0.0, why.since + rules.deadlines.in_transit_for(why.method) - rules.clock.monotonic())


def _ask(memory_probe: MemoryProbe, name: str, tags: frozenset[str]) -> frozenset[str] | None:
    """The probe's answer for ``name``, or None when it cannot prove it (None, an error, tags the engine does not have)."""
    try:
        answer = memory_probe.released_tags(name)
    except Exception:  # a probe that fails proves nothing: the quarantine stays
        return None
    if not isinstance(answer, (set, frozenset)) or not answer <= tags:
        return None
    return frozenset(answer)
