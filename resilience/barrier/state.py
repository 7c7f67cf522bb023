"""The barrier's state, with no I/O and no clock: what it knows of each engine (``EngineKnowledge``), what a call did
(``Effect``, read by ``effect_of`` from the driver's record only), the barrier's values, reports, events and errors,
and ``BarrierState``, the one object each orchestrator holds them in.

An engine's state is a few facts, each known or unknown: ``paused`` (None: a pause or continue that may have been
applied; pause and flush are safe to re-send, so it is resolved by pausing again), ``flushed``, the ``released`` tags
and the ``unknown`` ones (an ambiguous release or resume; ``doubt`` says why), ``dead``, and ``in_flight`` (a call
still running past its phase deadline: nothing else is sent to the engine until it lands). An engine with unknown tags
is *quarantined* on a kind where re-sending kills (SGLang: nothing it answers tells which tags are released, see
docs/failure-and-recovery.md) until ``reconcile``, a ``MemoryProbe`` or ``retire``.

Knowledge is write-ahead: before a call is handed to a fan-out, ``mark`` puts the facts it may change where an
ambiguous effect would leave them and keeps what they were in ``pending``; only an answer, or the driver's record that
the request never left, settles them (``settle``), field by field in an order where every intermediate state is still
true, so an interruption at any instant leaves them unknown, never forgotten. Each command is sent only when its
precondition (the kind's ``EngineRules``) is *known* to hold. Every change of the knowledge goes through a place that
calls ``BarrierState.persist`` with the engines it touched, before any command that depends on it is sent.
"""

from __future__ import annotations

import enum
import os
import threading
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Final, Generic, TypedDict, TypeVar

from resilience.barrier.fanout import EngineNotDriven, EngineResult, LateCall, PhaseTimeout, reported_versions
from resilience.clock import SYSTEM_CLOCK, Clock
from resilience.engine_contract import (
    GATEWAY_STATUSES,
    SGLANG_MEMORY,
    AnyEngine,
    ControlMethod,
    EngineDied,
    EngineRules,
    EngineState,
    EngineStateChanged,
    MemoryModel,
    MemoryProbe,
    engine_name,
    rules_of,
)
from resilience.events import Event, Observer, emit
from resilience.outcome import AttemptRecord, Delivery, attempts_of

if TYPE_CHECKING:  # the journal reads this module's knowledge; the state only holds a journal
    from resilience.barrier.journal import Journal, Recovery, RestartBudget
    from resilience.barrier.journal_store import JournalStore

__all__ = [
    "ANSWERED_FOR", "BarrierBusy", "BarrierKeywords", "BarrierOptions", "BarrierState", "Doubt", "Effect",
    "EngineGroup", "EngineKnowledge", "EngineSkipped", "Facts", "HoldToken", "InFlight", "Pending", "PhaseDeadlines",
    "PhaseEnded", "PhaseFailed", "PhaseFailure", "PhaseReport", "PhaseStarted", "TransitionEnded", "TransitionReport",
    "TransitionStarted", "doubt_of", "effect_of", "is_engine_dead", "reasons", "short",
]


RELEASE, RESUME = "release_memory_occupation", "resume_memory_occupation"


class Effect(enum.StrEnum):
    """What one control call did to the engine, as far as the barrier can tell (``resilience.barrier.state.effect_of``)."""

    APPLIED = "applied"
    NOT_APPLIED = "not_applied"
    AMBIGUOUS = "ambiguous"
    """It may have been applied, or not (an ambiguous answer, a timeout or reset after sending, a dead actor): the word
    ``Outcome.AMBIGUOUS`` uses for a call."""


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

    def after(self, method: str, kwargs: Mapping[str, Any], effect: Effect, memory: MemoryModel) -> Facts:
        """The facts once ``method(**kwargs)`` had ``effect`` on an engine of ``memory``'s kind with these facts."""
        k = EngineKnowledge("", self.paused, self.flushed, self.pause_mode, set(self.released), set(self.unknown), memory=memory)
        k.apply(method, kwargs, effect)
        return k.facts()


@dataclass(frozen=True, slots=True)
class Doubt:
    """Why an engine's ``unknown`` tags are unknown: the call that left them so, and how its request ended.

    ``method``: the release or resume (None: not known, e.g. a journal written before doubts were kept). ``in_transit``:
    the request may still be on its way or running (a reset or read timeout after sending, a 504, no delivery record, an
    interruption, a controller that died with it in flight); False only when a gateway's 502 or 503 answered for every
    attempt that may have reached the engine. ``delivery``: that, in words. ``since``: the orchestrator clock's
    ``monotonic()`` when the answer came (for a journal resumed: when it was resumed, so the grace starts again).
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
    """A call marked in flight (write-ahead) and not settled yet; its facts are already where an ambiguous effect leaves them."""
    holds: dict[int, str] = field(default_factory=dict)
    """Hold token id -> reason; the engine must stay paused while any remains."""
    memory: MemoryModel = SGLANG_MEMORY
    """The engine kind's memory semantics (``resilience.engine_contract``): what each release and resume does to these facts."""

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
        """Fold one call's outcome into the facts: not applied changes nothing; ambiguous makes what the call touches unknown."""
        if outcome is Effect.NOT_APPLIED:
            return
        maybe = outcome is Effect.AMBIGUOUS
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
        """Write-ahead: ``method(**kwargs)`` is about to be sent. Its facts become what "ambiguous" leaves.

        ``pending`` keeps them as they were, and is set first: an interruption
        between the two steps leaves a mark that ``abandon`` completes.
        """
        self.abandon()
        pending = self.pending = Pending(method, dict(kwargs), self.facts())
        self.apply(method, kwargs, Effect.AMBIGUOUS)
        return pending

    def settle(self, effect: Effect) -> None:
        """The ``pending`` call had ``effect``: refine its facts from ambiguous to what it really did, then drop the mark."""
        pending = self.pending
        if pending is None:
            return
        self._refine(pending.before.after(pending.method, pending.kwargs, effect, self.memory))
        self.pending = None

    def late(self, call: LateCall) -> None:
        """The ``pending`` call missed its phase deadline and is still running: it becomes ``in_flight`` (its facts stay ambiguous)."""
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
        """The ``pending`` call's outcome will never be known (its driver stopped): its facts stay ambiguous, the mark goes."""
        pending = self.pending
        if pending is not None:
            self.apply(pending.method, pending.kwargs, Effect.AMBIGUOUS)  # idempotent: completes a mark an interruption cut short
            self.pending = None

    def _refine(self, target: Facts) -> None:
        """Move the facts to ``target``, a refinement of what an ambiguous effect left: tags become known first, leave ``unknown`` last.

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


E = TypeVar("E", bound=AnyEngine)


class EngineGroup(Generic[E]):
    """Engines that move together. ``needs_offload=False`` groups are skipped by offload and onload (they keep their memory).

    ``engines``: each satisfies ``ControlPlaneEngine`` or ``AsyncControlPlaneEngine``; their names must be unique.
    ``name``: for messages (default "group").
    """

    def __init__(self, engines: Sequence[E], needs_offload: bool = True, name: str | None = None) -> None:
        self.engines = tuple(engines)
        self.needs_offload = needs_offload
        self.name = name or "group"
        names = [engine_name(e) for e in self.engines]
        if len(set(names)) != len(names):
            raise ValueError(f"EngineGroup {self.name!r}: engine names must be unique, got {names}")

    def __repr__(self) -> str:
        return f"EngineGroup({self.name!r}, {len(self.engines)} engines, needs_offload={self.needs_offload})"


@dataclass(frozen=True, slots=True)
class PhaseDeadlines:
    """Time limits, seconds: the whole transition, and each phase (capped by what is left of the transition).

    ``transition_s`` also bounds how long ``offload``/``onload`` wait for a running ``weight_sync`` body. A call still
    running at its phase deadline is awaited, before anything else is sent to that engine, for at most ``continue_s``
    (then the engine is skipped and named).
    """

    transition_s: float = 300.0
    pause_s: float = 90.0
    flush_s: float = 90.0
    release_s: float = 150.0
    resume_s: float = 150.0
    continue_s: float = 60.0
    in_transit_s: float | None = None
    """How long after an ambiguous release or resume whose request may still be on its way (a reset or read timeout
    after sending, a 504, no delivery record, an interruption) a memory probe's "as before" is trusted: until then a
    late arrival could still apply it, so the engine stays quarantined (the probe's "applied" is trusted at once).
    Meanwhile the probe is asked again every ``probe_poll_s``. Default None: the deadline of the call's own phase
    (``release_s`` or ``resume_s``), the longest the barrier lets such a call run. 0 trusts the probe at once (the race
    this closes comes back)."""
    probe_poll_s: float = 0.05
    """While a probe's "as before" is not trusted yet (the grace above), how often it is asked again, on the
    orchestrator's clock: right after the phase that sent the ambiguous call (up to that phase's deadline) and at the
    start of the next transition (up to ``continue_s``). Default 0.05 s: a release or resume applies within
    milliseconds to a few seconds."""

    def __post_init__(self) -> None:
        for name in ("transition_s", "pause_s", "flush_s", "release_s", "resume_s", "continue_s", "probe_poll_s"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"PhaseDeadlines.{name} must be > 0, but was {value!r}")
        if self.in_transit_s is not None and not self.in_transit_s >= 0:
            raise ValueError(f"PhaseDeadlines.in_transit_s must be >= 0 or None, but was {self.in_transit_s!r}")

    def in_transit_for(self, method: str | None) -> float:
        """The grace of a release or resume that may still be on its way (``in_transit_s``; None: its phase's deadline,
        the longer of the two when the method is not known)."""
        if self.in_transit_s is not None:
            return float(self.in_transit_s)
        if method == "release_memory_occupation":
            return float(self.release_s)
        if method == "resume_memory_occupation":
            return float(self.resume_s)
        return float(max(self.release_s, self.resume_s))

    def for_phase(self, phase: str) -> float:
        """The cap of one phase (rollback and settle phases use the continue cap)."""
        return float(getattr(self, f"{phase}_s", self.continue_s))


@dataclass(frozen=True, slots=True)
class PhaseReport:
    """One phase as it ran: engines, wall time and the slowest engine's own time."""

    phase: str
    engines: tuple[str, ...]
    duration_s: float
    slowest_s: float


@dataclass(frozen=True, slots=True)
class HoldToken:
    """One owned pause hold: ``reason``, the engines it holds, and an id unique in the process.

    ``Orchestrator.pause`` returns one (in ``TransitionReport.hold``);
    ``Orchestrator.unpause(token)`` releases exactly that one.
    """

    id: int
    reason: str
    engines: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class TransitionReport:
    """A finished transition: its phases in order.

    ``held``: engines the transition left paused on purpose, each with the reasons that hold it (an onload inside a
    weight sync, a partial onload). ``hold``: the token a ``pause`` took, else None. ``replaced``: engines found
    replaced by a fresh process since the journal it resumed was written, each with what showed it (taken as new
    engines, serving, never as the journal's). ``fenced``: engines a transition with ``min_engines`` fenced on its way,
    each with why. Both empty (default) otherwise.
    """

    transition: str
    duration_s: float
    phases: tuple[PhaseReport, ...] = ()
    held: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    hold: HoldToken | None = None
    replaced: Mapping[str, str] = field(default_factory=dict)
    fenced: Mapping[str, str] = field(default_factory=dict)

    @property
    def ideal_s(self) -> float:
        """The sum over phases of the slowest engine: what a perfect fan-out would take."""
        return sum(p.slowest_s for p in self.phases)


@dataclass(frozen=True, slots=True, kw_only=True)
class TransitionStarted(Event):
    """A barrier transition (offload, onload, weight_sync) began."""

    transition_id: int
    transition: str
    engines: tuple[str, ...]
    deadline_s: float | None


@dataclass(frozen=True, slots=True, kw_only=True)
class PhaseStarted(Event):
    """One barrier phase (pause, flush, release, resume, continue, ...) began on these engines."""

    transition_id: int
    transition: str
    phase: str
    engines: tuple[str, ...]
    deadline_s: float | None


@dataclass(frozen=True, slots=True, kw_only=True)
class PhaseFailure(Event):
    """One engine's failure inside a phase."""

    engine: str
    error_type: str
    message: str


@dataclass(frozen=True, slots=True, kw_only=True)
class PhaseEnded(Event):
    """A barrier phase ended: every engine acknowledged, or some failed."""

    transition_id: int
    transition: str
    phase: str
    engines: tuple[str, ...]
    duration_s: float
    failures: tuple[PhaseFailure, ...] = ()

    @property
    def ok(self) -> bool:
        """True when every engine acknowledged the phase."""
        return not self.failures


@dataclass(frozen=True, slots=True, kw_only=True)
class TransitionEnded(Event):
    """A barrier transition ended."""

    transition_id: int
    transition: str
    engines: tuple[str, ...]
    duration_s: float
    ok: bool
    failed_phase: str | None = None
    rolled_back: tuple[str, ...] = ()
    """Engines the orchestrator continued again after a failure."""
    left_paused: tuple[str, ...] = ()
    """Engines that could not be rolled back and stay paused or released."""


class EngineSkipped(RuntimeError):
    """A transition sent nothing to this engine (dead, quarantined, or a late call still in flight): the message says why."""


class BarrierBusy(TimeoutError):
    """``offload``/``onload`` could not start: a ``weight_sync`` body kept running past the transition deadline,
    or the call came from inside a ``weight_sync`` body on the same thread (it would wait for itself)."""


class PhaseFailed(RuntimeError):
    """A transition did not put every engine where it promised.

    - ``transition``, ``phase``: what failed, and the first phase it failed in (``"skipped"`` when engines were skipped
      and nothing else failed).
    - ``failures``: each engine the transition failed on, with its error; skipped engines carry an ``EngineSkipped``
      saying why.
    - ``rolled_back``: engines continued again (serving) after the failure.
    - ``left_paused``: every engine of the orchestrator (not retired) that is not known to serve, whatever its state,
      with why: paused, held, released, maybe paused, quarantined, dead, or a late call in flight.
    - ``quarantined``: engines whose released tags are unknown; nothing will release, resume or continue them until
      ``Orchestrator.reconcile`` (you checked the engine, or restarted it) or ``Orchestrator.retire``.
    - ``dead``: engines that stopped answering (also in ``left_paused``).
    - ``restarts_remaining``/``restart_limit``: what a restart would leave, when the orchestrator has a
      ``RestartBudget``; it restarts nothing itself.
    """

    def __init__(
        self,
        transition: str,
        phase: str,
        failures: Mapping[str, BaseException],
        *,
        rolled_back: Sequence[str] = (),
        left_paused: Mapping[str, str] | None = None,
        quarantined: Sequence[str] = (),
        dead: Sequence[str] = (),
        restarts_remaining: int | None = None,
        restart_limit: int | None = None,
    ) -> None:
        self.transition = transition
        self.phase = phase
        self.failures = dict(failures)
        self.rolled_back = tuple(rolled_back)
        self.left_paused = dict(left_paused or {})
        self.quarantined = tuple(quarantined)
        self.dead = tuple(dead)
        self.restarts_remaining = restarts_remaining
        self.restart_limit = restart_limit
        super().__init__(self._message())

    def _message(self) -> str:
        causes = "; ".join(f"{name}: {type(err).__name__}: {short(err)}" for name, err in sorted(self.failures.items()))
        parts = [f"{self.transition} failed in phase {self.phase!r} on {len(self.failures)} engine(s): {causes}."]
        if self.dead:
            parts.append(f"Dead: {', '.join(self.dead)}.")
        if self.quarantined:
            parts.append(f"Quarantined (released tags unknown; reconcile or retire): {', '.join(self.quarantined)}.")
        if self.rolled_back:
            parts.append(f"Rolled back (serving again): {', '.join(self.rolled_back)}.")
        if self.left_paused:
            parts.append("Not serving: " + "; ".join(f"{k} ({v})" for k, v in sorted(self.left_paused.items())) + ".")
        else:
            parts.append("Every engine is serving.")
        if self.restarts_remaining is not None:
            parts.append(
                f"A restart would use 1 of {self.restarts_remaining} remaining (limit {self.restart_limit}); "
                "the orchestrator restarts nothing."
            )
        return " ".join(parts)


def short(err: BaseException, limit: int = 240) -> str:
    """An error's text on one line, cut to ``limit`` characters."""
    text = " ".join(str(err).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def effect_of(error: BaseException | None) -> Effect:
    """The effect of a call that ended with ``error`` (None: it returned).

    - no error: APPLIED;
    - the barrier's own ``PhaseTimeout(maybe_sent=False)`` (the call never started), ``EngineSkipped`` and
      ``EngineNotDriven`` (nothing was sent): NOT_APPLIED;
    - no driver record at all (``EngineDied``, ``EngineUnavailable``, a ``PhaseTimeout`` of a call that may have
      started, any error no driver wrote, such as a fan-out's or an engine's own bug; an empty record, which
      ``attempts_of`` reads as none): AMBIGUOUS. This is the conservative reading: without the driver's word that the
      request never left, it may have been applied;
    - any attempt delivered ``AMBIGUOUS`` (read timeout, reset after sending): AMBIGUOUS;
    - any attempt ``RESPONDED`` with a gateway status (502, 503, 504: a proxy may answer it after forwarding), whatever
      the transport's retry policy did with it: AMBIGUOUS;
    - any attempt ``RESPONDED`` with a status that is not an error (below 400: the engine answered, and the driver
      raised anyway): AMBIGUOUS;
    - otherwise every attempt was ``NOT_SENT`` (refused, connect timeout, DNS, TLS, a full local pool, an open breaker)
      or answered with the engine's own error status (4xx, other 5xx): NOT_APPLIED.
    """
    if error is None:
        return Effect.APPLIED
    if isinstance(error, (EngineSkipped, EngineNotDriven)) or (isinstance(error, PhaseTimeout) and not error.maybe_sent):
        return Effect.NOT_APPLIED
    attempts = attempts_of(error)
    if attempts is None:
        return Effect.AMBIGUOUS
    return Effect.AMBIGUOUS if any(_may_have_applied(a) for a in attempts) else Effect.NOT_APPLIED


ANSWERED_FOR: Final = frozenset({502, 503})
"""Gateway statuses after which the request is not on its way any more: the gateway answered for it (it never forwarded
it, or the engine had answered). After a 504, a reset or a read timeout it may still be (``MemoryProbeCheck``'s rule)."""


def doubt_of(method: str, error: BaseException | None, since: float) -> Doubt:
    """Why a call that ended with ``error`` and had an ambiguous effect leaves its tags unknown, and whether its request may
    still be on its way: yes unless every attempt that may have reached the engine was answered 502 or 503 (None: the
    call's answer was never read, an interruption)."""
    if error is None:
        return Doubt(method, True, "interrupted before its answer was read", since)
    attempts = attempts_of(error)
    if attempts is None:
        return Doubt(method, True, f"no delivery record ({type(error).__name__})", since)
    maybe = [a for a in attempts if _may_have_applied(a)]
    in_transit = [a for a in maybe if not (a.delivery is Delivery.RESPONDED and a.status in ANSWERED_FOR)]
    if not in_transit:
        return Doubt(method, False, f"HTTP {maybe[-1].status if maybe else '?'} from a gateway", since)
    last = in_transit[-1]
    if last.delivery is Delivery.AMBIGUOUS:
        what = f"sent, then no answer ({last.error_type or 'reset or read timeout'})"
    else:
        what = f"HTTP {last.status}" if last.status is not None else "an answer with no status"
    return Doubt(method, True, what, since)


def _may_have_applied(attempt: AttemptRecord) -> bool:
    """One attempt may have reached the engine and been acted on."""
    if attempt.delivery is Delivery.NOT_SENT:
        return False
    if attempt.delivery is Delivery.AMBIGUOUS:
        return True
    status = attempt.status
    return status is None or status < 400 or status in GATEWAY_STATUSES


def is_engine_dead(error: BaseException) -> bool:
    """True when the error says the engine is gone: ``EngineDied`` (its actor died), or a driver record with at least
    one real attempt whose every attempt was ``NOT_SENT`` (refused before sending, each time).

    A breaker's refusal is recorded as a ``NOT_SENT`` entry with ``error_type="CircuitOpen"``; it proves nothing
    was sent, not that the engine is gone (the breaker may have opened on gateway 502s), so it is left out here.
    """
    if isinstance(error, EngineDied):
        return True
    attempts = [a for a in attempts_of(error) or () if a.error_type != "CircuitOpen"]
    return bool(attempts) and all(a.delivery is Delivery.NOT_SENT for a in attempts)


@dataclass(frozen=True, slots=True, kw_only=True)
class BarrierOptions:
    """Both orchestrators' keywords besides their engines, as one value; their ``BarrierState`` copies them into attributes
    users may set later (``orch.observers = ...``)."""

    observers: Sequence[Observer] = ()
    """Who is told of transitions, phases, state and hold changes (default: nobody)."""
    deadlines: PhaseDeadlines | None = None
    """The transition and phase limits (None, the default: ``PhaseDeadlines()``)."""
    restart_budget: RestartBudget | None = None
    """When given, errors say what a restart would leave (default None)."""
    rollback: bool = True
    """After a failed transition, resume what it released and continue engines where that is known safe (default True)."""
    clock: Clock = SYSTEM_CLOCK
    """Times transitions and phases and sets their deadlines (default the system clock)."""
    memory_probe: MemoryProbe | None = None
    """Proves which tags are released on an engine whose tags became unknown (default None: such an engine stays
    quarantined until ``reconcile``)."""
    journal: Journal | JournalStore | str | os.PathLike[str] | None = None
    """Where the knowledge is written before each command and after each answer (a path, a ``Journal`` or a
    ``JournalStore``; default None: in memory only)."""

    @classmethod
    def of(cls, owner: str, keywords: Mapping[str, Any]) -> BarrierOptions:
        """The options an orchestrator named ``owner`` was given as ``keywords``; an unknown keyword is refused, named."""
        unknown = sorted(set(keywords) - {f.name for f in fields(cls)})
        if unknown:
            known = ", ".join(f.name for f in fields(cls))
            raise TypeError(f"{owner} got unknown keyword argument(s) {', '.join(unknown)}; its options are {known}")
        return cls(**keywords)


class BarrierKeywords(TypedDict, total=False):
    """``BarrierOptions``' fields as the orchestrators' keyword arguments (``**options: Unpack[BarrierKeywords]``),
    so that mypy checks each keyword a user passes; each one's meaning and default is ``BarrierOptions``'."""

    observers: Sequence[Observer]
    deadlines: PhaseDeadlines | None
    restart_budget: RestartBudget | None
    rollback: bool
    clock: Clock
    memory_probe: MemoryProbe | None
    journal: Journal | JournalStore | str | os.PathLike[str] | None


class BarrierState(Generic[E]):
    """The engines an orchestrator drives and what it knows of each: held by ``Orchestrator`` and ``AsyncOrchestrator``.

    ``owner`` names the orchestrator in error messages. ``lock`` guards the knowledge: queries take it; a driver holds
    it while a step is decided or folded, never while waiting on an engine from an event loop.
    """

    def __init__(self, groups: EngineGroup[E] | Sequence[EngineGroup[E]], options: BarrierOptions, *, owner: str = "Orchestrator") -> None:
        self.groups = (groups,) if isinstance(groups, EngineGroup) else tuple(groups)
        for group in self.groups:
            if not isinstance(group, EngineGroup):
                raise TypeError(f"{owner} groups must be EngineGroup objects, but got {group!r}")
        memory_probe = options.memory_probe
        if memory_probe is not None and not isinstance(memory_probe, MemoryProbe):
            raise TypeError(f"{owner} memory_probe must have released_tags(engine), but was {memory_probe!r}")
        self.memory_probe = memory_probe
        self.observers = tuple(options.observers)
        self.deadlines = options.deadlines or PhaseDeadlines()
        self.restart_budget = options.restart_budget
        self.rollback = options.rollback
        self.clock = options.clock
        self.engines: dict[str, E] = {}
        """Name -> engine, every engine of every group."""
        self.offloaded: list[str] = []
        """The engines of ``needs_offload`` groups: what offload and onload cover."""
        self.group_of: dict[str, int] = {}
        """Name -> the index in ``groups`` of the group it belongs to (an engine ``add`` brought in too)."""
        for i, group in enumerate(self.groups):
            for engine in group.engines:
                name = engine_name(engine)
                if name in self.engines:
                    raise ValueError(f"engine {name} appears in more than one group")
                self.engines[name] = engine
                self.group_of[name] = i
                if group.needs_offload:
                    self.offloaded.append(name)
        self.joining: set[str] = set()
        """Engines ``add`` is bringing to their group's state (``resilience.barrier.membership``): no transition covers
        them, and ``states`` calls them ``joining``."""
        self.fenced: dict[str, str] = {}
        """Engines taken out of every transition, with why (a join that failed, partial progress): ``states`` calls them
        ``fenced``; ``add`` brings one back, ``retire`` ends it."""
        self.kinds: dict[str, EngineRules] = {name: rules_of(engine) for name, engine in self.engines.items()}
        """Name -> its engine kind's control rules (``resilience.engine_contract``: SGLang's unless the engine says otherwise)."""
        self.know = {name: EngineKnowledge(name, memory=self.kinds[name].memory) for name in self.engines}
        self.retired: set[str] = set()
        self.lock = threading.RLock()
        self.label = "start"
        """What is under way, for the journal's records (``why``)."""
        self.journal_arg = options.journal
        """The journal as given; ``transitions.resume`` opens it once the orchestrator checked its engines."""
        self.journal: Journal | None = None
        self.recovery: Recovery | None = None
        """What the journal gave back when the orchestrator started (None without a journal)."""
        self.unchecked: set[str] = set()
        """Engines the resumed journal calls paused or released that no transition has checked yet against what can be
        read (the memory probe, the engine's ``ServingRead``): the next transition's start does (``transitions.recheck``)."""
        self.repause: set[str] = set()
        """Engines the resumed journal calls paused, with nothing released, that this orchestrator has not paused itself
        yet: the next offload or pause sends pause (and offload flush) to them again, both safe to repeat."""
        self.replaced: dict[str, str] = {}
        """Engines found replaced by a fresh process since the journal was written, with what showed it (``recovery``)."""
        self.versions: dict[str, str] = {}
        """Name -> the weight version the engine last reported to a read the barrier sent (``heard``): a ``verify`` check's
        or a join's ``WeightVersionCheck``. In memory only; dropped when the engine joins again (``add``)."""
        self.versions_lock = threading.Lock()
        """Guards ``versions`` alone: a scrape reads them while a transition holds ``lock``, without waiting for it."""

    def close(self) -> None:
        """``BarrierView.close``."""
        if self.journal is not None:
            self.journal.close()

    # -- queries ---------------------------------------------------------------

    def states(self) -> dict[str, EngineState]:
        """``BarrierView.states``."""
        with self.lock:
            return {n: self.state_of(n, k) for n, k in self.know.items() if n not in self.retired}

    def state_of(self, name: str, k: EngineKnowledge) -> EngineState:
        """``name``'s one word: ``joining``/``fenced`` for an engine kept out of the transitions, else its knowledge's."""
        if name in self.joining:
            return EngineState.JOINING
        return EngineState.FENCED if name in self.fenced else k.state

    def held(self) -> dict[str, tuple[str, ...]]:
        """``BarrierView.held``."""
        with self.lock:
            return {n: reasons(k) for n, k in self.know.items() if k.holds and n not in self.retired}

    def paused_by_us(self, engine: str | E) -> bool:
        """``BarrierView.paused_by_us``."""
        name = self.name_of(engine)
        with self.lock:
            k = self.know[name]
            return name not in self.retired and (bool(k.holds) or k.paused is not False)

    def released_tags(self, engine: str | E) -> frozenset[str]:
        """``BarrierView.released_tags``."""
        name = self.name_of(engine)
        with self.lock:
            return frozenset(self.know[name].released)

    def quarantined(self) -> dict[str, frozenset[str]]:
        """``BarrierView.quarantined``."""
        with self.lock:
            return {n: frozenset(k.unknown) for n, k in self.know.items() if k.quarantined and n not in self.retired}

    def unsettled(self) -> dict[str, frozenset[str]]:
        """``BarrierView.unsettled``."""
        with self.lock:
            return {n: frozenset(k.unknown) for n, k in self.know.items() if k.unknown and not k.quarantined and n not in self.retired}

    def not_serving(self) -> dict[str, str]:
        """``BarrierView.not_serving``."""
        with self.lock:
            out = {n: k.why_not_serving() for n, k in self.know.items() if n not in self.retired and not k.serving}
            out.update({n: f"joining: not in its group's state yet ({out.get(n) or 'serving'})" for n in self.joining})
            out.update({n: f"fenced: {why}" for n, why in self.fenced.items() if n not in self.retired})
            return out

    # -- what the transitions' modules share ---------------------------------------------

    def persist(self, names: Collection[str]) -> None:
        """The knowledge of ``names`` changed; called before any command that depends on it is sent.

        With a journal, the facts of ``names`` that changed are written durably before this returns (every
        knowledge change goes through a caller of this hook); without one, nothing happens.
        """
        if self.journal is None or not names:
            return
        pending = sorted({k.pending.method for n in names if (k := self.know[n]).pending is not None})
        why = f"{self.label}: sending {', '.join(pending)}" if pending else self.label
        self.journal.commit(self.know, names, why, retired=self.retired, budget=self.restart_budget)

    def allows(self, name: str, method: ControlMethod, tags: frozenset[str] = frozenset()) -> bool:
        """``method`` (naming ``tags``) may be sent to ``name`` now, by its engine kind's table (``EngineRules.allows``)."""
        return self.kinds[name].allows(self.know[name], method, tags)

    def announce(self, name: str, before: EngineState) -> None:
        """Tell the observers that ``name``'s state changed from ``before`` (nothing when it did not, nor while it is
        ``joining`` or ``fenced``: its one word in ``states`` stays that, and ``resilience.barrier.membership`` announces
        its own changes)."""
        if name in self.joining or name in self.fenced:
            return
        after = self.know[name].state
        if after is not before:
            emit(self.observers, EngineStateChanged(engine=name, from_state=str(before), to_state=str(after)))

    def heard(self, results: Iterable[EngineResult]) -> None:
        """Keep the weight version of every answer of a read that carries one (``fanout.reported_versions``)."""
        found = reported_versions(results)
        if found:
            with self.versions_lock:
                self.versions.update(found)

    def weight_versions(self) -> dict[str, str]:
        """Engine (not retired) -> the weight version it last reported to the barrier's reads (``versions``); never waits
        for a transition (``versions_lock`` only)."""
        retired = frozenset(self.retired)  # one copy, taken at once
        with self.versions_lock:
            return {n: v for n, v in self.versions.items() if n not in retired}

    def why_skipped(self, name: str) -> str:
        """Why a transition skips ``name``, for ``EngineSkipped``."""
        return f"skipped: {self.know[name].why_not_serving()}"

    def why_no_weight_sync(self, name: str) -> str:
        """Why a weight sync must not start on ``name`` (its ``weights`` are known released), or "" when nothing stops it.

        A weight update into released weights kills the engine (vLLM #57853 / #57854; smg #2529) and no engine refuses it
        itself, so ``weight_sync`` refuses the whole sync before pausing anyone.
        """
        k = self.know[name]
        if "weights" not in k.released:
            return ""
        return f"refused: its weights are released (state {k.state}); a weight update would kill it: onload(tags=['weights']) first"

    def active(self, names: Iterable[str]) -> list[str]:
        """``names`` without the retired, joining and fenced engines (``resilience.barrier.membership``)."""
        return [n for n in names if n not in self.retired and n not in self.fenced and n not in self.joining]

    def name_of(self, engine: str | E) -> str:
        """The name of an engine given by name, URL, or any engine object the orchestrator was built with."""
        if isinstance(engine, str):
            key = engine.rstrip("/")
            if key in self.engines:
                return key
            for name, candidate in self.engines.items():
                if getattr(candidate, "base_url", None) == key:
                    return name
        else:
            for name, candidate in self.engines.items():
                if candidate is engine:
                    return name
            name = engine_name(engine)
            if name in self.engines:
                return name
        raise KeyError(f"unknown engine {engine!r}: this orchestrator drives {', '.join(self.engines) or 'no engines'}")


def reasons(k: EngineKnowledge) -> tuple[str, ...]:
    """The reasons of ``k``'s holds, sorted, each once."""
    return tuple(sorted(set(k.holds.values())))
