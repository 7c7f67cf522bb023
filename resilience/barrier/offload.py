"""Offload as steps: pause (all) -> flush (all) -> release (all), each only where its precondition is known to hold
(the engine kind's table, ``resilience.engine_contract``, says what each call needs).

After a journal was resumed, an engine it calls paused is paused and flushed again
before its release (``resume_check.pause_again``): the journal's "paused" may belong
to a process that is gone, and both calls are safe to repeat.

A failure before the release continues the engines back (nothing was
released); a failed release resumes what this offload released and continues
every engine whose memory is all back. An engine whose release may have been
applied is quarantined: neither resumed (a resume of an unreleased tag kills
it) nor released again (a double release kills it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

from resilience.barrier.fold import phase
from resilience.barrier.holds import OFFLOAD_HOLD, hold, unhold
from resilience.barrier.journal import OFFLOAD_TOKEN
from resilience.barrier.memory import resend, resume_phases, to_release
from resilience.barrier.onload import rollback_continue
from resilience.barrier.resume_check import pause_again, paused_again
from resilience.barrier.rules import BarrierRules
from resilience.barrier.settle import settle
from resilience.barrier.steps import Call, Steps, Transition
from resilience.barrier.transition import error, raise_if_skipped, skips, transition
from resilience.barrier.types import PhaseFailed, TransitionReport

__all__ = ["offload_steps"]


def offload_steps(rules: BarrierRules[Any], wanted: frozenset[str], mode: Literal["abort", "retract"]) -> Steps[TransitionReport]:
    """Pause every offloaded engine not known paused (``mode``), flush those not known flushed, release ``wanted``."""
    with transition(rules, "offload", rules.offloaded) as tx:
        know = rules.know
        names = list(tx.engines)
        skipped = yield from settle(rules, tx, names)
        live = [n for n in names if n not in skipped]
        for n in live:
            hold(rules, n, OFFLOAD_TOKEN, OFFLOAD_HOLD)
        again = pause_again(rules, live)
        to_pause = [
            n
            for n in live
            if (know[n].paused is not True or know[n].pause_mode == "in_place" or n in again) and rules.allows(n, "pause_generation")
        ]
        failed = yield from phase(rules, tx, "pause", "pause_generation", [(n, {"mode": mode}) for n in to_pause])
        paused_again(rules, [n for n in again if n in to_pause], failed)
        if failed:
            raise (yield from _fail_before_release(rules, tx, "pause", failed, live, skipped))
        skipped.update({n: rules.why_skipped(n) for n in live if know[n].quarantined})
        todo = {n: to_release(know[n], wanted) for n in live if n not in skipped}
        todo = {n: missing for n, missing in todo.items() if missing}
        for n in [n for n in todo if not rules.allows(n, "flush_cache")]:  # defensive: the pause phase makes this unreachable
            skipped[n] = f"not allowed a flush ({rules.kinds[n].calls['flush_cache'].needs_text}): {know[n].why_not_serving()}"
            del todo[n]
        to_flush = [n for n in todo if know[n].memory.flush_before_release and not know[n].flushed]
        failed = yield from phase(rules, tx, "flush", "flush_cache", [(n, {}) for n in to_flush])
        if failed:
            raise (yield from _fail_before_release(rules, tx, "flush", failed, live, skipped))
        calls: list[Call] = []
        for n, missing in todo.items():
            if rules.allows(n, "release_memory_occupation", missing):
                calls.append((n, know[n].memory.release_kwargs(missing)))
            else:  # defensive: the phases above make this unreachable
                needs = rules.kinds[n].calls["release_memory_occupation"].needs_text
                skipped[n] = f"not allowed a release of {sorted(missing)} ({needs}): {know[n].why_not_serving()}"
        failed = yield from phase(rules, tx, "release", "release_memory_occupation", calls)
        failed = yield from resend(rules, tx, "release", "release_memory_occupation", calls, failed)
        if failed:
            raise (yield from _fail_in_release(rules, tx, failed, [c for c in calls if c[0] not in failed], live, skipped))
        raise_if_skipped(rules, tx, skipped)
    return tx.finished()


def _fail_before_release(
    rules: BarrierRules[Any],
    tx: Transition,
    name: str,
    failed: Mapping[str, BaseException],
    live: Sequence[str],
    skipped: Mapping[str, str],
) -> Steps[PhaseFailed]:
    """Pause or flush failed: nothing was released by this offload, so engines holding nothing released are continued."""
    for n in live:
        if not rules.know[n].released and not rules.know[n].unknown:
            unhold(rules, n, OFFLOAD_TOKEN)
    rolled, rb_failed = yield from rollback_continue(rules, tx, live)
    return error(rules, tx, name, {**skips(skipped), **rb_failed, **failed}, rolled_back=rolled)


def _fail_in_release(
    rules: BarrierRules[Any],
    tx: Transition,
    failed: Mapping[str, BaseException],
    applied: Sequence[Call],
    live: Sequence[str],
    skipped: Mapping[str, str],
) -> Steps[PhaseFailed]:
    """Release failed on some engines: resume what this offload released, continue every engine whose memory is all back.

    An engine whose release may have been applied is quarantined on SGLang (neither resumed: a resume of an
    unreleased tag kills it; nor released again); on vLLM the re-sends have already been tried.
    """
    rolled: list[str] = []
    rb_failed: dict[str, BaseException] = {}
    if rules.rollback:
        know = rules.know
        wants = {n: know[n].memory.release_tags(kw) & know[n].released for n, kw in applied}
        rb_failed = yield from resume_phases(rules, tx, "rollback_resume", wants)
        for n in live:
            if not rules.know[n].released and not rules.know[n].unknown:
                unhold(rules, n, OFFLOAD_TOKEN)
        rolled, more = yield from rollback_continue(rules, tx, live)
        rb_failed.update(more)
    return error(rules, tx, "release", {**skips(skipped), **rb_failed, **failed}, rolled_back=rolled)
