"""Onload as steps: resume what is released, then continue the engines whose memory is all back and that nothing holds.

Also the continue phases the other transitions end with (``continue_ready``,
and ``rollback_continue`` after a failure): continue is sent only where the
engine kind's table allows it (``resilience.engine_contract``; SGLang's: nothing
released or unknown, not known serving, and no hold, since it reopens everyone's pause).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from resilience.barrier.fold import phase
from resilience.barrier.holds import held_among, unhold
from resilience.barrier.journal import OFFLOAD_TOKEN
from resilience.barrier.memory import resume_phases, to_resume
from resilience.barrier.rules import BarrierRules
from resilience.barrier.settle import settle
from resilience.barrier.steps import Steps, Transition
from resilience.barrier.transition import error, raise_if_skipped, skips, transition
from resilience.barrier.types import TransitionReport

__all__ = ["continue_ready", "onload_steps", "rollback_continue"]


def onload_steps(rules: BarrierRules[Any], wanted: frozenset[str]) -> Steps[TransitionReport]:
    """Resume ``wanted`` (those released) on every offloaded engine, then continue those whose memory is all back."""
    with transition(rules, "onload", rules.offloaded) as tx:
        know = rules.know
        names = list(tx.engines)
        skipped = yield from settle(rules, tx, names)
        skipped.update({n: rules.why_skipped(n) for n in names if n not in skipped and know[n].quarantined})
        live = [n for n in names if n not in skipped]
        failed = yield from resume_phases(rules, tx, "resume", {n: to_resume(know[n], wanted) for n in live})
        for n in live:
            if not know[n].released and not know[n].unknown:
                unhold(rules, n, OFFLOAD_TOKEN)
        cont_failed = yield from continue_ready(rules, tx, live, "continue")
        if failed or cont_failed:
            raise error(rules, tx, "resume" if failed else "continue", {**skips(skipped), **failed, **cont_failed})
        raise_if_skipped(rules, tx, skipped)
        tx.held = held_among(rules, live)
    return tx.finished()


def continue_ready(rules: BarrierRules[Any], tx: Transition, names: Sequence[str], name: str) -> Steps[dict[str, BaseException]]:
    """Continue (phase ``name``) the engines among ``names`` that may be continued; return the failures."""
    ready = [n for n in names if rules.allows(n, "continue_generation")]
    failed = yield from phase(rules, tx, name, "continue_generation", [(n, {}) for n in ready])
    return failed


def rollback_continue(rules: BarrierRules[Any], tx: Transition, names: Sequence[str]) -> Steps[tuple[list[str], dict[str, BaseException]]]:
    """After a failure: continue the engines among ``names`` that may be continued (not known serving, nothing released,
    no hold), when ``rollback`` is on; return those continued and the failures."""
    if not rules.rollback:
        return [], {}
    ready = [n for n in names if rules.allows(n, "continue_generation")]
    failed = yield from phase(rules, tx, "rollback", "continue_generation", [(n, {}) for n in ready])
    return [n for n in ready if n not in failed], failed
