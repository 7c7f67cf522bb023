"""What a transition yields to its driver: the barrier's steps, and the running transition they belong to.

A transition (offload, onload, a pause or its end) is a generator that never
does I/O: it decides what to send, *yields* a step that says so, and folds
what came back into the knowledge before deciding the next. There are three
kinds of step:

- ``PhaseCall``: send ``method`` to these engines at once under ``deadline``;
  the driver fills ``results`` (one ``EngineResult`` per engine).
- ``SettleCall``: wait up to ``deadline`` for these late calls; the driver fills
  ``landed`` with the ones that landed.
- ``WaitCall``: wait until ``deadline`` has passed (what is left of the grace of a
  release or resume that may still be on its way, before the probe is asked again).
- ``ReadCall``: send a read (no control call: nothing is marked in flight) to these
  engines at once; a fan-out that cannot send it sets ``error`` instead of raising
  (the engines' answers are then unknown, and nothing else changes).

``Orchestrator`` drives the steps with a ``FanOut`` on the caller's thread;
``AsyncOrchestrator`` awaits them on the caller's event loop.
"""

from __future__ import annotations

from collections.abc import Generator, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from resilience.barrier.fanout import EngineResult
from resilience.barrier.knowledge import LateCall, Pending
from resilience.barrier.types import HoldToken, PhaseReport, TransitionReport
from resilience.deadline import Deadline
from resilience.engine_contract import AnyEngine, ControlMethod, EngineState

__all__ = ["Call", "PhaseCall", "ReadCall", "SettleCall", "Step", "Steps", "Transition", "WaitCall"]

Call = tuple[str, Mapping[str, Any]]
"""One engine's call in a phase: (engine name, kwargs)."""
E = TypeVar("E", bound=AnyEngine)
T = TypeVar("T")


@dataclass
class Transition:
    """One running transition; ``held``/``hold`` are set by its body, ``report`` when it ended well; ``phase``: the step now."""

    tid: int
    name: str
    deadline: Deadline
    engines: tuple[str, ...]
    started: float
    phases: list[PhaseReport] = field(default_factory=list)
    held: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    hold: HoldToken | None = None
    replaced: dict[str, str] = field(default_factory=dict)
    """Engines this transition found replaced by a fresh process since the journal was written, with why (``recovery``)."""
    report: TransitionReport | None = None
    phase: str = "start"

    def finished(self) -> TransitionReport:
        """The report of this transition, which ended without raising."""
        assert self.report is not None, f"transition {self.name} has not ended"
        return self.report


@dataclass(eq=False)
class PhaseCall(Generic[E]):
    """A step: send ``method`` to every engine of ``engines`` (engine, kwargs) at once under ``deadline``.

    The driver sets ``results``, one per engine in order (``FanOut.call``'s contract).
    """

    tx: Transition
    phase: str
    method: ControlMethod
    calls: tuple[Call, ...]
    engines: list[tuple[E, Mapping[str, Any]]]
    deadline: Deadline
    started: float
    before: Mapping[str, EngineState] = field(default_factory=dict)
    """Each engine's state before the write-ahead mark (``EngineStateChanged`` reports the net change at the fold)."""
    marks: dict[str, Pending] = field(default_factory=dict)
    """Each engine's write-ahead mark for this step: only these are settled by its results."""
    results: list[EngineResult] | None = None
    folded: bool = False


@dataclass(eq=False)
class SettleCall:
    """A step: wait up to ``deadline`` for the late calls in ``late`` (engine name -> call).

    The driver puts each one that landed in ``landed`` (name -> its error, or None).
    """

    late: dict[str, LateCall]
    deadline: Deadline
    landed: dict[str, BaseException | None] = field(default_factory=dict)


@dataclass(eq=False)
class WaitCall:
    """A step: wait until ``deadline`` has passed (the driver sleeps on the orchestrator's clock), then hand back."""

    deadline: Deadline


@dataclass(eq=False)
class ReadCall(Generic[E]):
    """A step: send the read ``method`` (no arguments) to every engine of ``engines`` at once under ``deadline``.

    The driver sets ``results``, one per engine in order, or ``error`` when the fan-out raised (a fan-out that cannot
    send this read, a gateway's): a read proves nothing then, and the transition goes on.
    """

    method: str
    calls: tuple[Call, ...]
    engines: list[tuple[E, Mapping[str, Any]]]
    deadline: Deadline
    results: list[EngineResult] | None = None
    error: Exception | None = None


Step = PhaseCall[Any] | SettleCall | WaitCall | ReadCall[Any]
Steps = Generator[Step, None, T]
"""A transition as steps: yields what to send or wait for, returns its result."""
