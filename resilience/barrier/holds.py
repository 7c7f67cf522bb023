"""Owned holds: a hold keeps an engine paused until its owner drops it; each is counted, never shared.

An engine must stay paused while any hold remains (``EngineKnowledge.holds``,
token id -> reason). Offload takes the "offload" hold (one per engine, id
``resilience.barrier.journal.OFFLOAD_TOKEN``), dropped once all its memory is back; ``pause`` and
``weight_sync`` take a hold with a new token each (``new_token``).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence
from typing import Any

from resilience.barrier.journal import OFFLOAD_TOKEN
from resilience.barrier.rules import BarrierRules, reasons
from resilience.barrier.types import HoldToken
from resilience.events import HoldChanged, emit

__all__ = ["OFFLOAD_HOLD", "WEIGHT_SYNC_HOLD", "held_among", "hold", "new_token", "reserve_tokens", "token_of", "unhold"]

OFFLOAD_HOLD = "offload"
"""The offload hold's reason."""
WEIGHT_SYNC_HOLD = "weight_sync"
"""The reason of the hold ``weight_sync`` takes."""
_tokens = itertools.count(1)
_tokens_lock = threading.Lock()


def new_token(reason: str, engines: Sequence[str]) -> HoldToken:
    """A hold token with a new id (unique in this process, and above any id a resumed journal holds)."""
    with _tokens_lock:
        return HoldToken(next(_tokens), reason, tuple(engines))


def reserve_tokens(past: int) -> None:
    """Hand out hold ids above ``past`` from now on (a journal resumed holds up to that id)."""
    global _tokens
    with _tokens_lock:
        nxt = next(_tokens)
        _tokens = itertools.count(max(nxt, past + 1))


def hold(rules: BarrierRules[Any], name: str, token: int, reason: str) -> None:
    """Take hold ``token`` (``reason``) on ``name``, persisted, then announced; nothing when it is held already.

    A record that could not be written (``persist`` raised) takes the hold back out of memory before the error goes on."""
    k = rules.know[name]
    if token not in k.holds:
        k.holds[token] = reason
        try:
            rules.persist((name,))
        except BaseException:  # not written (a full disk): no hold in memory either, or nobody would ever end it
            k.holds.pop(token, None)
            raise
        emit(rules.observers, HoldChanged(engine=name, reason=reason, acquired=True, holds=reasons(k)))


def unhold(rules: BarrierRules[Any], name: str, token: int) -> None:
    """Drop hold ``token`` on ``name``, persisted, then announced; nothing when it is not held."""
    k = rules.know[name]
    reason = k.holds.pop(token, None)
    if reason is not None:
        rules.persist((name,))
        emit(rules.observers, HoldChanged(engine=name, reason=reason, acquired=False, holds=reasons(k)))


def token_of(rules: BarrierRules[Any], hold: HoldToken | str) -> HoldToken:
    """``hold`` as a token: itself, or the latest hold with that reason (``KeyError`` when none is held)."""
    if isinstance(hold, HoldToken):
        return hold
    ids = {i for k in rules.know.values() for i, r in k.holds.items() if r == hold and i != OFFLOAD_TOKEN}
    if not ids:
        raise KeyError(f"unpause: no hold named {hold!r} is held")
    latest = max(ids)
    return HoldToken(latest, hold, tuple(n for n, k in rules.know.items() if latest in k.holds))


def held_among(rules: BarrierRules[Any], names: Sequence[str]) -> dict[str, tuple[str, ...]]:
    """The engines among ``names`` that some hold keeps paused, with the reasons (``TransitionReport.held``)."""
    return {n: reasons(rules.know[n]) for n in names if rules.know[n].holds}
