"""The memory phases as each engine kind needs them: what to release, the resumes in order, and the re-sends.

Read from the engine's memory model (``resilience.engine_contract``, part of its kind's table in ``kinds``):

- ``to_release``: the tags an offload of ``wanted`` still has to release (on a
  ``release_whole`` kind, every tag not known released, unknown ones included).
- ``resume_phases``: one resume per engine on SGLang; one tag per call in the
  kind's order on vLLM (``wake_one_tag``), every engine's next call in one phase.
  On a ``last_wake_resumes`` kind the wake that would leave nothing released
  (or might) reopens scheduling: it is sent only where a continue could be
  (no hold but the offload's); else that tag stays released and the engine held.
- ``resend``: on a ``resend`` kind a call whose effect was ambiguous (its tags
  left unknown) is sent again in a phase of its own, at most ``RESEND_ROUNDS``
  times; a failure a re-send settles is dropped.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from resilience.barrier.fold import phase
from resilience.barrier.journal import OFFLOAD_TOKEN
from resilience.barrier.knowledge import RELEASE, EngineKnowledge
from resilience.barrier.rules import BarrierRules
from resilience.barrier.steps import Call, Steps, Transition
from resilience.engine_contract import RESEND_ROUNDS, ControlMethod

__all__ = ["may_reopen", "resend", "resume_phases", "to_release", "to_resume"]


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
    rules: BarrierRules[Any],
    tx: Transition,
    name: str,
    method: ControlMethod,
    calls: Sequence[Call],
    failed: Mapping[str, BaseException],
) -> Steps[dict[str, BaseException]]:
    """Re-send (phase ``name``) each call of ``calls`` whose effect was ambiguous, on kinds where that is safe; return the
    failures left (a call a re-send answered is no longer one)."""
    left = dict(failed)
    for _ in range(RESEND_ROUNDS):
        again = [(n, kw) for n, kw in calls if _unsettled(rules.know[n], method, kw)]
        if not again:
            break
        more = yield from phase(rules, tx, name, method, again)
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
    rules: BarrierRules[Any], tx: Transition, name: str, wants: Mapping[str, frozenset[str]]
) -> Steps[dict[str, BaseException]]:
    """Resume ``wants[n]`` on each engine ``n`` (phase ``name``, as often as the kinds need); return the failures.

    Each round sends every engine its next call at once; an engine whose call failed gets nothing more. A call
    is sent only while its tags may be resumed; a wake that reopens scheduling only where ``may_reopen``.
    """
    know = rules.know
    queue = {n: _calls(know[n], tags) for n, tags in wants.items() if tags}
    failed: dict[str, BaseException] = {}
    for _ in range(1 + max((len(q) for q in queue.values()), default=0)):  # bounded: each round sends a queue's head
        calls: list[Call] = []
        for n, q in queue.items():
            if not q or n in failed:
                continue
            k, kwargs = know[n], q[0]
            tags = k.memory.resume_tags(kwargs)
            if not rules.allows(n, "resume_memory_occupation", tags) or (_reopens(k, kwargs) and not may_reopen(k)):
                q.clear()  # nothing more is sent to it in this transition: it stays held, and is named
                continue
            calls.append((n, q.pop(0)))
        if not calls:
            break
        more = yield from phase(rules, tx, name, "resume_memory_occupation", calls)
        failed.update((yield from resend(rules, tx, name, "resume_memory_occupation", calls, more)))
    return failed
