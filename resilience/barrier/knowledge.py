"""What the orchestrator knows about one engine, and what it knows it does not know.

An engine's state is not one label but a few facts, each known or unknown:

- ``paused``: True, False, or None (unknown: a pause or continue that may have
  been applied). Pause and flush are safe to re-send, so an unknown "paused" is
  resolved by pausing again before anything that needs a paused engine.
- ``flushed``: the cache is known flushed since the engine was last known to pause.
- ``released``: tags known released; ``unknown``: tags that may or may not be
  released (an ambiguous release or resume). An engine with unknown tags is
  *quarantined*: no release, resume or continue is sent to it until the caller
  reconciles it (``Orchestrator.reconcile``), a ``MemoryProbe`` proves its tags,
  or it is retired. Nothing SGLang 0.5.23
  answers can tell which tags are released: the scheduler keeps them in
  ``WeightUpdater.offload_tags`` (``sglang/srt/managers/scheduler_components/weight_updater.py``,
  ``release_memory_occupation``) and no endpoint reads that set; ``/server_info``'s
  ``memory_usage`` holds static sizes (``scheduler_components/internal_state.py``,
  ``_add_memory_usage``). See docs/failure-and-recovery.md.
- ``doubt``: why the ``unknown`` tags are unknown (``Doubt``): which call left
  them so and how its request ended. After a reset or read timeout after
  sending, a 504, no delivery record or an interruption, the request may still
  be on its way or running (``in_transit``): a memory probe's "as before" is
  trusted only once ``PhaseDeadlines.in_transit_s`` has passed; its "applied"
  at once. After a gateway's 502 or 503 the gateway answered for it: both are
  trusted at once (the rule of ``adapters/sglang_memory.py``'s ``MemoryProbeCheck``).
- ``dead``: why the engine stopped answering, or None.
- ``in_flight``: a call still running past its phase deadline. Nothing is sent
  to the engine until it lands (it could undo a later command), and the facts it
  touches stay unknown until then.

Knowledge is *write-ahead*: before a call is handed to a fan-out, ``mark``
puts the facts it may change where a "maybe applied" would leave them (a
release's tags unknown, a continue's "paused" unknown) and keeps what they
were in ``pending``. Only an answer, or the driver's proof that the request
never left, settles them (``settle``), refining field by field in an order
where every intermediate state is still true: an interruption at any instant
leaves the facts unknown, never forgotten.

Each command's precondition (``may_*``) must be *known* to hold before it is
sent; ``apply`` folds a call's outcome into the facts. Pure bookkeeping: no I/O,
no clock. The orchestrator serialises access under its own lock.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from resilience.barrier.memory_model import SGLANG_MEMORY, MemoryModel

__all__ = ["Doubt", "Effect", "EngineKnowledge", "EngineState", "Facts", "InFlight", "LateCall", "Pending"]

RELEASE, RESUME = "release_memory_occupation", "resume_memory_occupation"

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
    UNSETTLED = "unsettled"
    """Some tags may or may not be released, on an engine whose release and resume are safe to re-send (vLLM): the next
    transition settles them by re-sending its call."""
    IN_FLIGHT = "in_flight"
    """A call is still running (past its phase deadline, or its phase is under way)."""
    DEAD = "dead"
    """Stopped answering."""
    JOINING = "joining"
    """Added (``add``) and not yet in its group's state: no transition covers it, a router keeps it out of rotation
    (``resilience.barrier.membership``; never a state of the knowledge itself)."""
    FENCED = "fenced"
    """Taken out of every transition (a join that failed, partial progress): kept as it is and out of rotation until
    ``add`` brings it back or ``retire`` ends it (``resilience.barrier.membership``)."""


class Effect(enum.StrEnum):
    """What one control call did to the engine, as far as the barrier can tell (``resilience.barrier.effect.effect_of``)."""

    APPLIED = "applied"
    NOT_APPLIED = "not_applied"
    MAYBE = "maybe"
    """It may or may not have taken effect (ambiguous answer, timeout or reset after sending, dead actor)."""


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
    before: Facts
    """The facts before the call was sent (what "not applied" restores)."""


@dataclass(frozen=True, slots=True)
class Facts:
    """The facts one call may change, as a value: ``paused``, ``flushed``, ``pause_mode``, ``released``, ``unknown``."""

    paused: bool | None
    flushed: bool
    pause_mode: str | None
    released: frozenset[str]
    unknown: frozenset[str]

    def after(self, method: str, kwargs: Mapping[str, Any], effect: Effect, memory: MemoryModel = SGLANG_MEMORY) -> Facts:
        """The facts once ``method(**kwargs)`` had ``effect`` on an engine of ``memory``'s kind with these facts."""
        k = EngineKnowledge("", self.paused, self.flushed, self.pause_mode, set(self.released), set(self.unknown), memory=memory)
        k.apply(method, kwargs, effect)
        return k.facts()


@dataclass(frozen=True, slots=True)
class Doubt:
    """Why an engine's ``unknown`` tags are unknown: the call that left them so, and how its request ended.

    ``method``: the release or resume (None: not known, e.g. a journal written before doubts were kept).
    ``in_transit``: the request may still be on its way or running (a reset or read timeout after sending,
    a 504, no delivery record, an interruption, a controller that died with it in flight); False only
    when a gateway's 502 or 503 answered for every attempt that may have reached the engine.
    ``delivery``: that, in words. ``since``: the orchestrator clock's ``monotonic()`` when the answer
    came (for a journal resumed: when it was resumed, so the grace starts again).
    """

    method: str | None
    in_transit: bool
    delivery: str
    since: float = 0.0

    def proves_applied(self, unknown: frozenset[str], released: frozenset[str]) -> bool:
        """A probe that says ``released`` proves the call was applied (a release's tags all released, a resume's all back):
        trusted at once, since nothing on its way can undo that."""
        if self.method == RELEASE:
            return unknown <= released
        if self.method == RESUME:
            return not unknown & released
        return False


@dataclass(frozen=True, slots=True)
class Pending:
    """A call marked in flight by ``EngineKnowledge.mark``: what it is, and the facts before it."""

    method: str
    kwargs: Mapping[str, Any]
    before: Facts


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
    doubt: Doubt | None = None
    """Why ``unknown`` is not empty (meaningless once it is); see ``Doubt``."""
    in_flight: InFlight | None = None
    pending: Pending | None = None
    """A call marked in flight (write-ahead) and not settled yet; its facts are already where a "maybe" leaves them."""
    holds: dict[int, str] = field(default_factory=dict)
    """Hold token id -> reason; the engine must stay paused while any remains."""
    memory: MemoryModel = SGLANG_MEMORY
    """The engine kind's memory semantics (``resilience.barrier.memory_model``): what each release and resume does to these facts."""

    # -- predicates: a command is sent only when its precondition is known to hold -----------------

    @property
    def quarantined(self) -> bool:
        """Some tags may or may not be released, on a kind where re-sending kills: no release, resume or continue until reconciled.

        On a ``resend`` kind (vLLM) unknown tags are settled by re-sending the transition's own call instead.
        """
        return bool(self.unknown) and not self.memory.resend

    @property
    def reachable(self) -> bool:
        """Not dead and no call in flight: something may be sent."""
        return self.dead is None and self.in_flight is None

    def may_flush(self) -> bool:
        """Known paused."""
        return self.reachable and self.paused is True

    def may_release(self, tag: str) -> bool:
        """Known paused (and flushed, where the kind needs it), not quarantined, ``tag`` known not released."""
        flushed = self.flushed or not self.memory.flush_before_release
        return self.reachable and not self.quarantined and self.paused is True and flushed and tag not in self.released

    def may_resume(self, tag: str) -> bool:
        """``tag`` known released (or unknown, on a kind where a resume is safe to re-send), not quarantined."""
        resend = self.memory.resend and tag in self.unknown
        return self.reachable and not self.quarantined and (tag in self.released or resend)

    def may_continue(self) -> bool:
        """Nothing released or unknown, no hold left, and not known serving already."""
        return self.reachable and not self.unknown and not self.released and not self.holds and self.paused is not False

    @property
    def serving(self) -> bool:
        """Known serving: not paused, nothing released or unknown, alive, nothing in flight."""
        return self.reachable and self.paused is False and not self.released and not self.unknown

    @property
    def state(self) -> EngineState:
        """A one-word summary (dead, in flight and quarantined first)."""
        if self.dead is not None:
            return EngineState.DEAD
        if self.in_flight is not None or self.pending is not None:
            return EngineState.IN_FLIGHT
        if self.unknown:
            return EngineState.QUARANTINED if self.quarantined else EngineState.UNSETTLED
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
        elif self.pending is not None:
            parts.append(f"a {self.pending.method} is in flight")
        if self.quarantined:
            parts.append(f"quarantined: may have released {', '.join(sorted(self.unknown))} (reconcile or retire it)")
        elif self.unknown:
            parts.append(f"may have released {', '.join(sorted(self.unknown))} (the next transition re-sends its call)")
        doubt = self.doubt
        if self.unknown and doubt is not None and doubt.in_transit:
            parts.append(f"its {doubt.method or 'last call'} may still be on its way ({doubt.delivery})")
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

    def apply(self, method: str, kwargs: Mapping[str, Any], outcome: Effect) -> None:
        """Fold one call's outcome into the facts: not applied changes nothing; maybe makes what the call touches unknown."""
        if outcome is Effect.NOT_APPLIED:
            return
        maybe = outcome is Effect.MAYBE
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
            tags = self.memory.release_tags(kwargs)
            if maybe:
                self.unknown.update(tags - self.released)
            else:
                self.released.update(tags)
                self.unknown.difference_update(tags)
            if self.memory.release_pauses and self.paused is not True:  # the release paused the engine itself
                self.paused, self.flushed = (None, False) if maybe else (True, False)
        elif method == "resume_memory_occupation":
            tags = self.memory.resume_tags(kwargs)
            self.released.difference_update(tags)
            (self.unknown.update if maybe else self.unknown.difference_update)(tags)
            if self.memory.last_wake_resumes and not self.released:  # nothing known released: the wake may have resumed
                if not maybe and not self.unknown:
                    self.paused, self.flushed, self.pause_mode = False, False, None
                elif self.paused is True:
                    self.paused, self.pause_mode = None, None
        elif method == "continue_generation":
            self.flushed = False
            if not maybe:
                self.paused, self.pause_mode = False, None
            elif self.paused is True:
                self.paused, self.pause_mode = None, None

    def facts(self) -> Facts:
        """The facts a call may change, as a value."""
        return Facts(self.paused, self.flushed, self.pause_mode, frozenset(self.released), frozenset(self.unknown))

    def mark(self, method: str, kwargs: Mapping[str, Any]) -> Pending:
        """Write-ahead: ``method(**kwargs)`` is about to be sent. Its facts become what "maybe applied" leaves.

        ``pending`` keeps them as they were, and is set first: an interruption
        between the two steps leaves a mark that ``abandon`` completes.
        """
        self.abandon()
        pending = self.pending = Pending(method, dict(kwargs), self.facts())
        self.apply(method, kwargs, Effect.MAYBE)
        return pending

    def settle(self, effect: Effect) -> None:
        """The ``pending`` call had ``effect``: refine its facts from "maybe" to what it really did, then drop the mark."""
        pending = self.pending
        if pending is None:
            return
        self._refine(pending.before.after(pending.method, pending.kwargs, effect, self.memory))
        self.pending = None

    def late(self, call: LateCall) -> None:
        """The ``pending`` call missed its phase deadline and is still running: it becomes ``in_flight`` (its facts stay "maybe")."""
        pending = self.pending
        assert pending is not None, f"{self.name}: no call marked in flight"
        self.in_flight = InFlight(pending.method, pending.kwargs, call, pending.before)
        self.pending = None

    def land(self, effect: Effect) -> InFlight | None:
        """The in-flight call landed with ``effect``: resolve what its timeout left unknown. Returns the call."""
        late = self.in_flight
        if late is None:
            return None
        self._refine(late.before.after(late.method, late.kwargs, effect, self.memory))
        self.in_flight = None
        return late

    def abandon(self) -> None:
        """The ``pending`` call's outcome will never be known (its driver stopped): its facts stay "maybe", the mark goes."""
        pending = self.pending
        if pending is not None:
            self.apply(pending.method, pending.kwargs, Effect.MAYBE)  # idempotent: completes a mark an interruption cut short
            self.pending = None

    def _refine(self, target: Facts) -> None:
        """Move the facts to ``target``, a refinement of what a "maybe" left: tags become known first, leave ``unknown`` last.

        Each step is one assignment or one set operation, and each intermediate
        state is true, so an interruption between two of them forgets nothing.
        """
        self.unknown.update(target.unknown)
        self.released.update(target.released)
        self.pause_mode = target.pause_mode
        self.paused = target.paused
        self.flushed = target.flushed
        self.released.intersection_update(target.released)
        self.unknown.intersection_update(target.unknown)

    def reconcile(self, *, released: Iterable[str] | None, paused: bool | None) -> None:
        """The caller's word on the engine's real state: ``released`` (None = leave tags as they are), ``paused``."""
        if released is not None:
            self.released, self.unknown, self.doubt = set(released), set(), None
        self.paused, self.flushed, self.pause_mode, self.dead = paused, False, None, None
