"""A transition's start, end and errors: ``TransitionStarted``/``TransitionEnded``, ``PhaseFailed`` and skipped engines."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from resilience.barrier.rules import BarrierRules
from resilience.barrier.steps import Transition
from resilience.barrier.types import EngineSkipped, PhaseFailed, TransitionReport
from resilience.deadline import Deadline
from resilience.events import TransitionEnded, TransitionStarted, emit

__all__ = ["error", "raise_if_skipped", "skips", "transition"]

_ids = itertools.count(1)


@contextmanager
def transition(rules: BarrierRules[Any], name: str, engines: Iterable[str]) -> Iterator[Transition]:
    """One transition over the ``engines`` not retired: announce it, let the body run, end it.

    A body that returns ends the transition well: its ``TransitionEnded`` is
    emitted and ``tx.report`` set from ``tx.held`` and ``tx.hold``. A body
    that raises ``PhaseFailed`` has announced its own end (``error``); any
    other exception (the driver abandoned the steps: a cancelled task, a
    fan-out that raised) ends it with ``ok=False`` and the step it was in.
    """
    names = tuple(rules.active(engines))
    clock, limit = rules.clock, rules.deadlines.transition_s
    tx = Transition(next(_ids), name, Deadline(limit, clock=clock), names, clock.monotonic())
    rules.label = name
    emit(rules.observers, TransitionStarted(transition_id=tx.tid, transition=name, engines=tx.engines, deadline_s=limit))
    try:
        yield tx
    except PhaseFailed:
        raise
    except BaseException:
        duration = clock.monotonic() - tx.started
        left = tuple(rules.not_serving())
        ended = TransitionEnded(
            transition_id=tx.tid, transition=tx.name, engines=tx.engines, duration_s=duration, ok=False, failed_phase=tx.phase,
            left_paused=left,
        )
        emit(rules.observers, ended)
        raise
    duration = clock.monotonic() - tx.started
    emit(rules.observers, TransitionEnded(transition_id=tx.tid, transition=tx.name, engines=tx.engines, duration_s=duration, ok=True))
    tx.report = TransitionReport(tx.name, duration, tuple(tx.phases), dict(tx.held), tx.hold, dict(tx.replaced))


def error(
    rules: BarrierRules[Any], tx: Transition, phase: str, failed: Mapping[str, BaseException], *, rolled_back: Sequence[str] = ()
) -> PhaseFailed:
    """The ``PhaseFailed`` that ends ``tx`` in ``phase`` (its ``TransitionEnded`` emitted): every engine not serving is named."""
    left = rules.not_serving()
    dead = [n for n in left if rules.know[n].dead is not None]
    budget = rules.restart_budget
    err = PhaseFailed(
        tx.name,
        phase,
        failed,
        rolled_back=rolled_back,
        left_paused=left,
        quarantined=sorted(rules.quarantined()),
        dead=dead,
        restarts_remaining=None if budget is None else budget.remaining,
        restart_limit=None if budget is None else budget.limit,
    )
    duration = rules.clock.monotonic() - tx.started
    emit(
        rules.observers,
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


def skips(skipped: Mapping[str, str]) -> dict[str, BaseException]:
    """Skipped engines (name -> why) as the failures ``PhaseFailed`` names."""
    return {n: EngineSkipped(f"{n} {why}") for n, why in skipped.items()}


def raise_if_skipped(rules: BarrierRules[Any], tx: Transition, skipped: Mapping[str, str]) -> None:
    """End ``tx`` with ``PhaseFailed`` when it skipped any engine."""
    if skipped:
        raise error(rules, tx, "skipped", skips(skipped))
