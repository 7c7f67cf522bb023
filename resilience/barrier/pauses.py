"""A pause and its end as steps: ``pause`` and ``weight_sync`` take an owned hold and pause; ``unpause`` drops it.

Each pause takes a hold with a new token on every engine (all groups);
its end drops that one hold and continues the engines no other hold keeps
paused and whose memory is back. The holds are taken inside the ``try`` that
drops them on failure: a hold whose record could not be written (a full disk)
is dropped with the others, never left without a body to end it. After a
journal was resumed, engines it calls paused are paused again
(``resume_check.pause_again``).
"""

from __future__ import annotations

import logging
from typing import Any

from resilience.barrier.fold import phase
from resilience.barrier.holds import WEIGHT_SYNC_HOLD, held_among, hold, new_token, token_of, unhold
from resilience.barrier.onload import continue_ready, rollback_continue
from resilience.barrier.resume_check import pause_again, paused_again
from resilience.barrier.rules import BarrierRules
from resilience.barrier.settle import settle
from resilience.barrier.steps import Steps
from resilience.barrier.transition import error, raise_if_skipped, skips, transition
from resilience.barrier.types import HoldToken, TransitionReport

__all__ = ["pause_steps", "unpause_steps"]

_LOG = logging.getLogger("resilience.barrier.pauses")


def pause_steps(rules: BarrierRules[Any], reason: str, mode: str) -> Steps[TransitionReport]:
    """Take a new hold named ``reason`` on every engine and pause the ones not known paused (``pause``, ``weight_sync``)."""
    with transition(rules, reason, rules.engines) as tx:
        know = rules.know
        names = list(tx.engines)
        skipped = yield from settle(rules, tx, names)
        # quarantined, or unsettled (vLLM: its next offload or onload re-sends): a body must not run on memory that may be released
        skipped.update({n: rules.why_skipped(n) for n in names if n not in skipped and know[n].unknown})
        if reason == WEIGHT_SYNC_HOLD:  # a weight update into released weights kills the engine: refused, nothing sent
            skipped.update({n: why for n in names if n not in skipped and (why := rules.why_no_weight_sync(n))})
        if skipped:
            raise error(rules, tx, "skipped", skips(skipped))
        token = new_token(reason, names)
        try:
            for n in names:
                hold(rules, n, token.id, reason)
            again = pause_again(rules, names)
            to_pause = [n for n in names if (know[n].paused is not True or n in again) and rules.allows(n, "pause_generation")]
            failed = yield from phase(rules, tx, "pause", "pause_generation", [(n, {"mode": mode}) for n in to_pause])
        except BaseException:  # a hold not written, abandoned mid-phase (cancelled, the fan-out raised): nobody will own the token
            _drop(rules, names, token.id)
            raise
        paused_again(rules, [n for n in again if n in to_pause], failed)
        if failed:
            for n in names:
                unhold(rules, n, token.id)
            rolled, rb_failed = yield from rollback_continue(rules, tx, names)
            raise error(rules, tx, "pause", {**rb_failed, **failed}, rolled_back=rolled)
        tx.hold = token
    return tx.finished()


def _drop(rules: BarrierRules[Any], names: list[str], token: int) -> None:
    """Drop hold ``token`` on every engine of ``names`` (on a failure path: the caller raises its own error). Each is
    dropped in memory even when writing another's record fails; a record not written leaves the hold in the journal,
    where the next controller names it orphaned (``Recovery.orphaned_holds``): it keeps an engine paused, never kills it."""
    for n in names:
        try:
            unhold(rules, n, token)
        except Exception:  # the record of a dropped hold could not be written (a full disk): drop the others all the same
            _LOG.warning("hold %s on %s dropped, but its record could not be written", token, n, exc_info=True)


def unpause_steps(rules: BarrierRules[Any], held: HoldToken | str) -> Steps[TransitionReport]:
    """Release one hold; continue the engines it held that no other hold keeps paused and whose memory is back."""
    token = token_of(rules, held)
    with transition(rules, f"{token.reason}_end", token.engines) as tx:
        know = rules.know
        names = list(tx.engines)
        for n in token.engines:
            unhold(rules, n, token.id)
        skipped = yield from settle(rules, tx, names)
        live = [n for n in names if n not in skipped]
        failed = yield from continue_ready(rules, tx, live, "continue")
        stuck = {n: rules.why_skipped(n) for n in live if not know[n].holds and not know[n].serving and n not in failed}
        skipped.update(stuck)
        if failed:
            raise error(rules, tx, "continue", {**skips(skipped), **failed})
        raise_if_skipped(rules, tx, skipped)
        tx.held = held_among(rules, live)
    return tx.finished()
