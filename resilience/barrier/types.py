"""The barrier's values and errors: engine groups, deadlines, reports, hold tokens, ``PhaseFailed``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from resilience.barrier.engine import AnyEngine
from resilience.barrier.fanout import engine_name

__all__ = [
    "BarrierBusy",
    "EngineGroup",
    "EngineSkipped",
    "HoldToken",
    "PhaseDeadlines",
    "PhaseFailed",
    "PhaseReport",
    "TransitionReport",
]


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

    ``transition_s`` also bounds how long ``offload``/``onload`` wait for a
    running ``weight_sync`` body. A call still running at its phase deadline
    is awaited, before anything else is sent to that engine, for at most
    ``continue_s`` (then the engine is skipped and named).
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
    Meanwhile the probe is asked again every ``probe_poll_s``: right after the phase that sent the call (up to that
    phase's deadline) and at the start of the next transition (up to the settle limit, ``continue_s``). Default
    None: the deadline of the call's own phase (``release_s`` or ``resume_s``), the longest the barrier lets such a
    call run. 0 trusts the probe at once (the race this closes comes back)."""
    probe_poll_s: float = 0.05
    """While a probe's "as before" is not trusted yet (the grace above), how often it is asked again, on the
    orchestrator's clock: right after the phase that sent the ambiguous call (up to that phase's deadline) and at
    the start of the next transition (up to the settle limit), until it proves the call applied or the grace has
    passed. Default 0.05 s: an engine's release or resume applies within milliseconds to a few seconds."""

    def __post_init__(self) -> None:
        for name in ("transition_s", "pause_s", "flush_s", "release_s", "resume_s", "continue_s"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"PhaseDeadlines.{name} must be > 0, but was {value!r}")
        if not self.probe_poll_s > 0:
            raise ValueError(f"PhaseDeadlines.probe_poll_s must be > 0, but was {self.probe_poll_s!r}")
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

    ``held``: engines the transition left paused on purpose, each with the
    reasons that hold it (an onload inside a weight sync, a partial onload).
    ``hold``: the token a ``pause`` took, else None.
    ``replaced``: engines this transition found replaced by a fresh process since the journal it resumed was
    written (a restart while no controller watched), each with what showed it; they were taken as new engines,
    serving with nothing released and not paused by the orchestrator, never as the journal's
    (``resilience.barrier.recovery``). Empty (default) otherwise.
    ``fenced``: engines a transition with ``min_engines`` fenced on its way (kept out of every transition and out of
    rotation until ``add`` brings them back), each with why (``resilience.barrier.membership``). Empty (default) otherwise.
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


class EngineSkipped(RuntimeError):
    """A transition sent nothing to this engine (dead, quarantined, or a late call still in flight): the message says why."""


class BarrierBusy(TimeoutError):
    """``offload``/``onload`` could not start: a ``weight_sync`` body kept running past the transition deadline,
    or the call came from inside a ``weight_sync`` body on the same thread (it would wait for itself)."""


class PhaseFailed(RuntimeError):
    """A transition did not put every engine where it promised.

    - ``transition``, ``phase``: what failed, and the first phase it failed in
      (``"skipped"`` when engines were skipped and nothing else failed).
    - ``failures``: each engine the transition failed on, with its error;
      skipped engines carry an ``EngineSkipped`` saying why.
    - ``rolled_back``: engines continued again (serving) after the failure.
    - ``left_paused``: every engine of the orchestrator (not retired) that is
      not known to serve, whatever its state, with why: paused, held, released,
      maybe paused, quarantined, dead, or a late call in flight.
    - ``quarantined``: engines whose released tags are unknown; nothing will
      release, resume or continue them until ``Orchestrator.reconcile`` (you
      checked the engine, or restarted it) or ``Orchestrator.retire``.
    - ``dead``: engines that stopped answering (also in ``left_paused``).
    - ``restarts_remaining``/``restart_limit``: what a restart would leave, when
      the orchestrator has a ``RestartBudget``; it restarts nothing itself.
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
