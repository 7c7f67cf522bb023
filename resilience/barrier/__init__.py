"""The barrier: offload, onload and weight sync across engine groups, without ever killing an engine.

- ``orchestrator``: ``Orchestrator``, the transitions and their rollback.
- ``types``: its values and errors (``EngineGroup``, ``PhaseDeadlines``, reports, ``PhaseFailed``).
- ``engine``: the engine contract (``ControlPlaneEngine``) and ``ALL_TAGS``.
- ``knowledge``: what the orchestrator knows of each engine, and what it knows it does not know.
- ``outcome``: what a failed call did to the engine (applied, not applied, maybe).
- ``fanout``: one phase sent to many engines at once (``ThreadFanOut``, ``SequentialFanOut``).

Ray engines and ``RayFanOut`` live in ``resilience.adapters.ray``.
"""

from resilience.barrier.engine import ALL_TAGS, AsyncControlPlaneEngine, ControlPlaneEngine, PauseMode
from resilience.barrier.fanout import (
    EngineDied,
    EngineResult,
    EngineUnavailable,
    FanOut,
    PhaseTimeout,
    SequentialFanOut,
    ThreadFanOut,
)
from resilience.barrier.knowledge import EngineState
from resilience.barrier.orchestrator import Orchestrator
from resilience.barrier.types import (
    BarrierBusy,
    EngineGroup,
    EngineSkipped,
    HoldToken,
    PhaseDeadlines,
    PhaseFailed,
    PhaseReport,
    TransitionReport,
)

__all__ = [
    "ALL_TAGS",
    "AsyncControlPlaneEngine",
    "BarrierBusy",
    "ControlPlaneEngine",
    "EngineDied",
    "EngineGroup",
    "EngineResult",
    "EngineSkipped",
    "EngineState",
    "EngineUnavailable",
    "FanOut",
    "HoldToken",
    "Orchestrator",
    "PauseMode",
    "PhaseDeadlines",
    "PhaseFailed",
    "PhaseReport",
    "PhaseTimeout",
    "SequentialFanOut",
    "ThreadFanOut",
    "TransitionReport",
]
