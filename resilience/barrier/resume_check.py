"""A resumed journal checked against the engines: a fresh process is a new engine, never the journal's.

A journal says what the last controller knew. While no controller watched, an
engine may have been restarted (a crash, a redeploy, a health monitor): the
process now on its URL has all its memory and serves. Resuming the journal onto
it would resume tags it never released (SGLang dies of the ``KeyError``) or
release it without a pause (it dies of "release while requests were running").

So, when an orchestrator resumes a journal (``recovery.resume``), every engine
the journal calls paused or released (or whose tags it calls unknown) is checked
at the start of the next transition (``recheck``, called by ``settle.settle``),
once, against what can be read:

- the memory probe, where there is one, about every tag the journal calls
  released (not only the unknown ones): a tag it proves not released means the
  memory was never released on this process;
- the engine's own answer, where its kind has one (``kinds.ServingRead``:
  SGLang's ``/ready`` 200, vLLM's ``/is_paused`` false): an engine the journal
  calls paused or released that answers "serving, not paused" is not the
  journal's (this orchestrator never continues an engine with memory released).

A mismatch takes the engine as new (``take_as_new``): serving, nothing released
or unknown, not paused by the orchestrator, its holds dropped; persisted, logged,
announced (``EngineStateChanged``) and named in ``TransitionReport.replaced``
(and ``BarrierRules.replaced``). A read that fails, or answers anything else,
proves nothing: the journal's knowledge stands.

Where neither can tell (no probe, an engine with no such read, one still
starting), the journal's "paused" is not trusted for a release: engines it calls
paused with nothing released are paused again, and flushed again, by the next
offload (``pause_again``), both safe to repeat; a pause's holds do the same.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from resilience.barrier.holds import unhold
from resilience.barrier.knowledge import EngineKnowledge
from resilience.barrier.rules import BarrierRules
from resilience.barrier.steps import Call, ReadCall, Steps, Transition
from resilience.memory_probe import MemoryProbe

__all__ = ["ask", "mark_resumed", "pause_again", "paused_again", "recheck", "take_as_new"]

_LOG = logging.getLogger("resilience.barrier.recovery")


def mark_resumed(rules: BarrierRules[Any], knowledge: Mapping[str, EngineKnowledge]) -> None:
    """After a journal was resumed: note the engines to check (``rules.unchecked``) and to pause again (``rules.repause``).

    Checked: not retired, not dead, and called paused, released, or with unknown tags. Paused again: called paused with
    nothing released or unknown.
    """
    for name, k in knowledge.items():
        if name in rules.retired or k.dead is not None:
            continue
        if k.paused is True or k.released or k.unknown:
            rules.unchecked.add(name)
        if k.paused is True and not k.released and not k.unknown:
            rules.repause.add(name)


def ask(memory_probe: MemoryProbe, name: str, tags: frozenset[str]) -> frozenset[str] | None:
    """The probe's answer for ``name``, or None when it cannot prove it (None, an error, tags the engine does not have)."""
    try:
        answer = memory_probe.released_tags(name)
    except Exception:  # a probe that fails proves nothing
        return None
    if not isinstance(answer, (set, frozenset)) or not answer <= tags:
        return None
    return frozenset(answer)


def recheck(rules: BarrierRules[Any], tx: Transition, names: Sequence[str]) -> Steps[list[str]]:
    """Check the engines among ``names`` still in ``rules.unchecked`` (once each); take those that mismatch as new.

    Returns the engines taken as new. The probe is asked first; the engines it cannot clear are asked their kind's
    ``ServingRead`` (one ``ReadCall`` per read method, under the settle limit), where the engine object has it.
    """
    todo = [n for n in names if n in rules.unchecked and n not in rules.retired]
    if not todo:
        return []
    rules.unchecked.difference_update(todo)
    know = rules.know
    fresh: dict[str, str] = {}
    if rules.memory_probe is not None:
        for n in todo:
            k = know[n]
            answer = ask(rules.memory_probe, n, k.memory.all_tags)
            if answer is not None and not k.released <= answer:
                missing = ", ".join(sorted(k.released - answer))
                fresh[n] = f"the memory probe finds {missing} not released, which the journal records released ({k.state})"
    reads: dict[str, list[Call]] = {}
    for n in todo:
        read = rules.kinds[n].serving_read
        if n in fresh or read is None or not callable(getattr(rules.engines[n], read.method, None)):
            continue
        reads.setdefault(read.method, []).append((n, {}))
    for method, calls in reads.items():
        tx.phase = "resume_check"
        deadline = tx.deadline.cap(rules.deadlines.for_phase("settle"))
        step: ReadCall[Any] = ReadCall(method, tuple(calls), [(rules.engines[n], kw) for n, kw in calls], deadline)
        yield step
        if step.results is None or len(step.results) != len(calls):
            continue  # the fan-out could not send it: nothing is proved
        for (n, _), result in zip(calls, step.results, strict=True):
            read = rules.kinds[n].serving_read
            if read is not None and result.error is None and result.late is None and read.proves_serving(result.value):
                fresh[n] = f"it answers {method} as a serving engine (not paused), which the journal records {know[n].state}"
    for n, why in fresh.items():
        take_as_new(rules, tx, n, why)
    return list(fresh)


def take_as_new(rules: BarrierRules[Any], tx: Transition | None, name: str, why: str) -> None:
    """``name`` is a fresh process, not the journal's engine: serving, nothing released or unknown, no hold; persisted,
    logged, announced, and named in ``rules.replaced`` (and ``tx.replaced``)."""
    k = rules.know[name]
    before = k.state
    k.abandon()
    k.in_flight = None
    k.reconcile(released=(), paused=False)
    rules.label = "resume_check"
    rules.persist((name,))
    for token in sorted(k.holds):
        unhold(rules, name, token)
    rules.repause.discard(name)
    rules.replaced[name] = why
    if tx is not None:
        tx.replaced[name] = why
    _LOG.warning("engine %s: a new process since the journal was written (%s); taken as a new engine, serving", name, why)
    rules.announce(name, before)


def pause_again(rules: BarrierRules[Any], names: Sequence[str]) -> list[str]:
    """The engines among ``names`` the resumed journal calls paused that this orchestrator has not paused itself: their
    "flushed" is dropped (persisted; a flush is safe to repeat), and the caller sends them a pause, and a flush before
    a release, again. Engines with tags released or unknown are left out (nothing is released on them again)."""
    again = [n for n in names if n in rules.repause and not rules.know[n].released and not rules.know[n].unknown]
    for n in again:
        rules.know[n].flushed = False
    if again:
        rules.persist(again)
    return again


def paused_again(rules: BarrierRules[Any], again: Sequence[str], failed: Mapping[str, BaseException]) -> None:
    """The pause phase ended: the engines of ``again`` it paused (not in ``failed``) are no longer paused only by the journal."""
    rules.repause.difference_update(n for n in again if n not in failed)
