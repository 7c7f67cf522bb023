"""Recovery: the journal taken up at start (``resume``), the caller's word on an engine (``reconcile``), ``retire``.

A resumed journal is checked against the engines at the next transition's start
(``resilience.barrier.resume_check``): an engine replaced by a fresh process while
no controller watched is taken as a new engine, never as the journal's.

The orchestrators call these under their own exclusion (``reconcile`` and
``retire`` of ``AsyncOrchestrator`` wait for a running transition to end).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, TypeVar

from resilience.barrier.engine import AnyEngine
from resilience.barrier.holds import OFFLOAD_HOLD, hold, reserve_tokens, unhold
from resilience.barrier.journal import OFFLOAD_TOKEN, open_journal, restore_budget
from resilience.barrier.knowledge import Doubt, EngineState
from resilience.barrier.membership import left, take_up
from resilience.barrier.resume_check import mark_resumed
from resilience.barrier.rules import BarrierRules
from resilience.barrier.settle import land
from resilience.events import EngineStateChanged, emit

__all__ = ["reconcile", "resume", "retire"]

E = TypeVar("E", bound=AnyEngine)


def resume(rules: BarrierRules[Any]) -> None:
    """Open the journal given (once every engine was checked) and take up the knowledge, holds, retirements and
    restart budget it kept; the engines it calls paused or released are checked at the next transition's start
    (``resume_check``). Each orchestrator calls this last in its constructor."""
    if rules.journal_arg is None:
        return
    journal = open_journal(rules.journal_arg)
    try:
        resumed = journal.open(list(rules.engines), kinds={n: k.memory for n, k in rules.know.items()})
    except BaseException:
        journal.close()
        raise
    rules.journal, rules.recovery = journal, resumed.recovery
    now = rules.clock.monotonic()
    for k in resumed.knowledge.values():  # a dead controller's requests may still be on their way: the grace starts again
        if k.doubt is not None:
            k.doubt = Doubt(k.doubt.method, k.doubt.in_transit, k.doubt.delivery, now)
    rules.know.update(resumed.knowledge)
    rules.retired.update(resumed.retired)
    take_up(rules, resumed.recovery.members)
    mark_resumed(rules, resumed.knowledge)
    rules.restart_budget = restore_budget(rules.restart_budget, resumed.budget)
    reserve_tokens(max((i for k in resumed.knowledge.values() for i in k.holds), default=0))
    for name, k in resumed.knowledge.items():
        if k.state is not EngineState.SERVING:
            emit(rules.observers, EngineStateChanged(engine=name, from_state=str(EngineState.SERVING), to_state=str(k.state)))


def retire(rules: BarrierRules[E], engine: str | E) -> None:
    """Stop sending anything to ``engine`` (name, URL or engine object): no transition covers or names it again."""
    name = rules.name_of(engine)
    with rules.lock:
        rules.retired.add(name)
        rules.label = "retire"
        rules.persist((name,))
        left(rules, name)


def reconcile(rules: BarrierRules[E], engine: str | E, *, released: Iterable[str] | None, paused: bool | None) -> None:
    """The caller's word on ``engine``'s real state (see ``Orchestrator.reconcile``), refused where SGLang would crash."""
    name = rules.name_of(engine)
    tags = None if released is None else frozenset(released)
    kind = rules.know[name].memory
    if tags is not None and not tags <= kind.all_tags:
        raise ValueError(f"reconcile released must be a subset of {kind.tags} ({kind.kind} engine {name}), but was {sorted(tags)}")
    if tags and paused is False:
        raise ValueError(
            f"reconcile {name}: released {sorted(tags)} with paused=False is a state SGLang crashes in (prefill into freed memory)"
        )
    if tags and name not in rules.offloaded:
        raise ValueError(f"reconcile {name}: released tags on an engine of a needs_offload=False group (nothing would resume them)")
    with rules.lock:
        if name in rules.retired:
            raise ValueError(f"reconcile {name}: the engine was retired")
        k = rules.know[name]
        if k.in_flight is not None:
            landed, error = k.in_flight.call.wait(0)
            if not landed:
                late = k.in_flight.method
                raise RuntimeError(f"reconcile {name}: a late {late} sent earlier is still running; reconcile after it lands")
            before = k.state
            land(rules, name, error)
            rules.persist((name,))
            rules.announce(name, before)
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
        rules.unchecked.discard(name)  # the caller's word, not the journal's, from now on
        rules.repause.discard(name)
        rules.label = "reconcile"
        rules.persist((name,))
        if k.released or k.unknown:
            hold(rules, name, OFFLOAD_TOKEN, OFFLOAD_HOLD)
        else:
            unhold(rules, name, OFFLOAD_TOKEN)
        rules.announce(name, before)
