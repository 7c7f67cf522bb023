"""What the orchestrator knows about one engine, and what it knows it does not know.

An engine's state is not one label but a few facts, each known or unknown:

- ``paused``: True, False, or None (unknown: a pause or continue that may have
  been applied). Pause and flush are safe to re-send, so an unknown "paused" is
  resolved by pausing again before anything that needs a paused engine.
- ``flushed``: the cache is known flushed since the engine was last known to pause.
- ``released``: tags known released; ``unknown``: tags that may or may not be
  released (an ambiguous release or resume). An engine with unknown tags is
  *quarantined*: no release, resume or continue is sent to it until the caller
  reconciles it (``Orchestrator.reconcile``) or retires it. Nothing SGLang 0.5.23
  answers can tell which tags are released: the scheduler keeps them in
  ``WeightUpdater.offload_tags`` (``sglang/srt/managers/scheduler_components/weight_updater.py``,
  ``release_memory_occupation``) and no endpoint reads that set; ``/server_info``'s
  ``memory_usage`` holds static sizes (``scheduler_components/internal_state.py``,
  ``_add_memory_usage``). See the README's recovery section.
- ``dead``: why the engine stopped answering, or None.
- ``in_flight``: a call still running past its phase deadline. Nothing is sent
  to the engine until it lands (it could undo a later command), and the facts it
  touches stay unknown until then.

Each command's precondition (``may_*``) must be *known* to hold before it is
sent; ``apply`` folds a call's outcome into the facts. Pure bookkeeping: no I/O,
no clock. The orchestrator serialises access under its own lock.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from resilience.barrier.engine import ALL_TAGS

__all__ = ["CallOutcome", "EngineKnowledge", "EngineState", "InFlight", "LateCall", "tags_of"]

class EngineState(enum.StrEnum):
    """A one-word summary of an engine's knowledge (for events, ``states()`` and messages)."""

    SERVING = "serving"
    """Known not paused, nothing released."""
    PAUSED = "paused"
    """Known paused, nothing released, not flushed."""
    FLUSHED = "flushed"
    """Known paused and flushed, nothing released."""
    RELEASED = "released"
    """Known paused with some tags known released."""
    UNKNOWN = "unknown"
    """Whether it is paused is unknown (nothing released)."""
    QUARANTINED = "quarantined"
    """Some tags may or may not be released: needs ``reconcile`` or ``retire``."""
    IN_FLIGHT = "in_flight"
    """A call is still running past its phase deadline."""
    DEAD = "dead"
    """Stopped answering."""


class CallOutcome(enum.StrEnum):
    """What one control call did to the engine."""

    APPLIED = "applied"
    NOT_APPLIED = "not_applied"
    MAYBE = "maybe"
    """It may or may not have taken effect (ambiguous answer, timeout or reset after sending, dead actor)."""


def tags_of(kwargs: Mapping[str, Any]) -> frozenset[str]:
    """The tags a release/resume call names (None or empty = all three, as in SGLang)."""
    tags = kwargs.get("tags")
    return frozenset(tags) if tags else frozenset(ALL_TAGS)


class LateCall(Protocol):
    """A call still running after its phase gave up on it (a ``Future``, a Ray ObjectRef)."""

    def wait(self, timeout: float | None) -> tuple[bool, BaseException | None]:
        """Wait up to ``timeout`` s; (landed, its error or None). Not landed: (False, None)."""
        ...


@dataclass(frozen=True, slots=True)
class InFlight:
    """A call that was still running at its phase deadline."""

    method: str
    kwargs: Mapping[str, Any]
    call: LateCall


@dataclass
class EngineKnowledge:
    """One engine's facts. Starts as "serving, nothing released" (call ``reconcile`` when that is not so)."""

    name: str
    paused: bool | None = False
    flushed: bool = False
    pause_mode: str | None = None
    """The mode of the last pause known applied (``in_place`` pauses are redone before a flush)."""
    released: set[str] = field(default_factory=set)
    unknown: set[str] = field(default_factory=set)
    dead: str | None = None
    in_flight: InFlight | None = None
    holds: dict[int, str] = field(default_factory=dict)
    """Hold token id -> reason; the engine must stay paused while any remains."""

    # -- predicates: a command is sent only when its precondition is known to hold -----------------

    @property
    def quarantined(self) -> bool:
        """Some tags may or may not be released: no release, resume or continue until reconciled."""
        return bool(self.unknown)

    @property
    def reachable(self) -> bool:
        """Not dead and no call in flight: something may be sent."""
        return self.dead is None and self.in_flight is None

    def may_flush(self) -> bool:
        """Known paused."""
        return self.reachable and self.paused is True

    def may_release(self, tag: str) -> bool:
        """Known paused and flushed, not quarantined, ``tag`` known not released."""
        return self.reachable and not self.quarantined and self.paused is True and self.flushed and tag not in self.released

    def may_resume(self, tag: str) -> bool:
        """``tag`` known released, not quarantined."""
        return self.reachable and not self.quarantined and tag in self.released

    def may_continue(self) -> bool:
        """Nothing released (known), no hold left, and not known serving already."""
        return self.reachable and not self.quarantined and not self.released and not self.holds and self.paused is not False

    @property
    def serving(self) -> bool:
        """Known serving: not paused, nothing released or unknown, alive, nothing in flight."""
        return self.reachable and self.paused is False and not self.released and not self.unknown

    @property
    def state(self) -> EngineState:
        """A one-word summary (dead, in flight and quarantined first)."""
        if self.dead is not None:
            return EngineState.DEAD
        if self.in_flight is not None:
            return EngineState.IN_FLIGHT
        if self.unknown:
            return EngineState.QUARANTINED
        if self.released:
            return EngineState.RELEASED
        if self.paused is None:
            return EngineState.UNKNOWN
        if self.paused:
            return EngineState.FLUSHED if self.flushed else EngineState.PAUSED
        return EngineState.SERVING

    def why_not_serving(self) -> str:
        """What keeps the engine from serving, in words (empty when it is known serving)."""
        parts: list[str] = []
        if self.dead is not None:
            parts.append(f"dead ({self.dead})")
        if self.in_flight is not None:
            parts.append(f"a late {self.in_flight.method} is still in flight")
        if self.unknown:
            parts.append(f"quarantined: may have released {', '.join(sorted(self.unknown))} (reconcile or retire it)")
        if self.released:
            parts.append(f"released {', '.join(sorted(self.released))}")
        if self.paused is None:
            parts.append("may be paused")
        elif self.paused:
            parts.append("paused")
        if self.holds:
            parts.append(f"held by {', '.join(sorted(set(self.holds.values())))}")
        return "; ".join(parts)

    # -- folding outcomes in ----------------------------------------------------------------------

    def apply(self, method: str, kwargs: Mapping[str, Any], outcome: CallOutcome) -> None:
        """Fold one call's outcome into the facts: not applied changes nothing; maybe makes what the call touches unknown."""
        if outcome is CallOutcome.NOT_APPLIED:
            return
        maybe = outcome is CallOutcome.MAYBE
        if method == "pause_generation":
            if not maybe:
                if self.paused is not True:
                    self.flushed = False
                self.paused, self.pause_mode = True, str(kwargs.get("mode", "abort"))
            elif self.paused is not True:
                self.paused, self.flushed, self.pause_mode = None, False, None
        elif method == "flush_cache":
            if not maybe:
                self.flushed = True
        elif method == "release_memory_occupation":
            (self.unknown if maybe else self.released).update(tags_of(kwargs))
        elif method == "resume_memory_occupation":
            tags = tags_of(kwargs)
            self.released.difference_update(tags)
            if maybe:
                self.unknown.update(tags)
        elif method == "continue_generation":
            self.flushed = False
            if not maybe:
                self.paused, self.pause_mode = False, None
            elif self.paused is True:
                self.paused, self.pause_mode = None, None

    def land(self, outcome: CallOutcome) -> InFlight | None:
        """The in-flight call landed with ``outcome``: resolve what its timeout left unknown. Returns the call."""
        late, self.in_flight = self.in_flight, None
        if late is None:
            return None
        method, kwargs = late.method, late.kwargs
        if outcome is CallOutcome.APPLIED and method in ("release_memory_occupation", "resume_memory_occupation"):
            tags = tags_of(kwargs)
            self.unknown.difference_update(tags)
            if method == "release_memory_occupation":
                self.released.update(tags)
        elif outcome is CallOutcome.NOT_APPLIED and method in ("release_memory_occupation", "resume_memory_occupation"):
            tags = tags_of(kwargs)
            self.unknown.difference_update(tags)
            if method == "resume_memory_occupation":
                self.released.update(tags)
        elif outcome is CallOutcome.APPLIED:
            self.apply(method, kwargs, outcome)
        return late

    def reconcile(self, *, released: Iterable[str] | None, paused: bool | None) -> None:
        """The caller's word on the engine's real state: ``released`` (None = leave tags as they are), ``paused``."""
        if released is not None:
            self.released, self.unknown = set(released), set()
        self.paused, self.flushed, self.pause_mode, self.dead = paused, False, None, None
