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
``PhaseDeadlines.in_transit_s`` has passed. Else a release that lands just
after the probe said "not released" would be released again, and SGLang dies
of the double release.

While such an answer is not trusted yet, the probe is polled (``poll``: a
``WaitCall`` of ``PhaseDeadlines.probe_poll_s`` on the orchestrator's clock,
then ask again), right after the phase that sent the call (up to that phase's
deadline) and at the start of the next transition (up to its settle limit):
until it proves the call applied (settled at once), or the grace has passed
("as before" trusted). A release is slow to apply (torch_memory_saver's pause
frees the memory; the emulator too), so the probe right after a reset often
answers "not released yet"; a short wait proves it applied instead of leaving
the engine quarantined. Whatever stops the wait (an interruption, a cancelled
task) leaves the engine quarantined with its doubt, as it was before the wait.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any, Final

from resilience.barrier.effect import doubt_of, effect_of, is_engine_dead
from resilience.barrier.holds import unhold
from resilience.barrier.journal import OFFLOAD_TOKEN
from resilience.barrier.knowledge import RELEASE, RESUME, Effect, EngineKnowledge
from resilience.barrier.resume_check import ask, recheck
from resilience.barrier.rules import BarrierRules
from resilience.barrier.steps import SettleCall, Steps, Transition, WaitCall
from resilience.deadline import Deadline

__all__ = ["doubt", "land", "poll", "probe", "settle"]

_GRACE_EPSILON_S: Final = 1e-6
"""Grace left below this counts as passed (a clock summed from sleeps may stop a hair short of the end)."""


def settle(rules: BarrierRules[Any], tx: Transition, names: Sequence[str]) -> Steps[dict[str, str]]:
    """Start of a transition: check what a resumed journal says against the engines (``resume_check.recheck``: a fresh
    process is taken as a new engine), drop marks an interruption left, wait (up to the continue phase's limit) for calls
    still in flight, ask the memory probe about quarantined engines (polling it while a grace keeps its "as before" from
    being trusted, up to the settle limit: ``poll``); return the engines to skip, with why."""
    know = rules.know
    yield from recheck(rules, tx, names)
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
    if waiting:  # a request may still be on its way: ask again until it proves applied or the grace has passed
        tx.phase = "settle"
        settled += yield from poll(rules, waiting, tx.deadline.cap(rules.deadlines.for_phase("settle")))
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
    engine stays quarantined, and ``waiting`` (when given) gets the seconds of grace left for it. So does an engine
    whose probe cannot prove it now (None: the emulator's probe while a release is being carried out) while its
    request may still be on its way and the grace has not passed.
    """
    memory_probe = rules.memory_probe
    if memory_probe is None:
        return []
    settled: list[str] = []
    for name in names:
        k = rules.know[name]
        if not k.unknown or k.in_flight is not None or k.pending is not None or name in rules.retired:
            continue
        released = ask(memory_probe, name, k.memory.all_tags)
        left = _grace_left(rules, k, released)
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
        rules.persist((name,))
        if not k.released:
            unhold(rules, name, OFFLOAD_TOKEN)
        settled.append(name)
    return settled


def poll(rules: BarrierRules[Any], waiting: dict[str, float], deadline: Deadline) -> Steps[list[str]]:
    """Ask the memory probe again, every ``PhaseDeadlines.probe_poll_s``, about the engines in ``waiting`` (name -> grace
    left, as ``probe`` fills it) until each is settled (proved applied, or the grace passed and "as before" is trusted),
    or ``deadline`` has passed; return those settled. ``waiting`` is left with the engines still waiting (a probe that
    still cannot prove it once the grace has passed drops out: the engine stays quarantined).

    Each wait is a ``WaitCall`` (the driver sleeps on the orchestrator's clock, on its thread or without blocking its
    event loop), so an interruption can only come while nothing is being decided: it closes these steps and leaves
    every engine still waiting quarantined, with its doubt, as ``probe`` left it. Bounded: at most one wait per
    ``probe_poll_s`` of the smaller of the longest grace left and ``deadline`` (plus one for rounding).
    """
    every = rules.deadlines.probe_poll_s
    settled: list[str] = []
    limit = min(max(waiting.values(), default=0.0), deadline.remaining())
    polls = math.ceil(limit / every) + 1 if limit > 0 else 0
    for _ in range(polls):
        left = min(max(waiting.values(), default=0.0), deadline.remaining())
        if left <= 0:
            break
        yield WaitCall(deadline.cap(min(every, left)))
        again: dict[str, float] = {}
        settled += probe(rules, list(waiting), again)
        waiting.clear()
        waiting.update(again)
    return settled


def _grace_left(rules: BarrierRules[Any], k: EngineKnowledge, released: frozenset[str] | None) -> float:
    """Seconds before the probe's answer ``released`` may be trusted for ``k`` (0: now; for None, no answer: the seconds
    its request may still be on its way, 0 when it is not)."""
    why = k.doubt
    if why is None:  # unknown tags with no record of why (cannot happen through the rules): trusted as before
        return 0.0
    if not why.in_transit or (released is not None and why.proves_applied(frozenset(k.unknown), released)):
        return 0.0
    left = why.since + rules.deadlines.in_transit_for(why.method) - rules.clock.monotonic()
    return left if left > _GRACE_EPSILON_S else 0.0

