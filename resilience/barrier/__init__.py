"""The barrier: offload, onload and weight sync across engine groups, without ever killing an engine.

- ``orchestrator``: ``Orchestrator``, the transitions driven from the caller's thread through a fan-out.
- ``async_orchestrator``: ``AsyncOrchestrator``, the same transitions awaited on the caller's event loop.
- ``state``: what the barrier knows (``EngineKnowledge``), what a call did (``Effect``), its values, reports and errors,
  and ``BarrierState``, what each orchestrator holds (``view``: the public surface both answer from it).
- ``transitions``: offload, onload, a pause and its end, and recovery, written once as steps with no I/O (``PhaseStep``,
  ``SettleStep``, ``WaitStep``, ``ReadStep``), with the phase fold and the settling at a transition's start.
- ``membership``: engines that join a running group (``add``), leave it (``retire``) and are fenced (``min_engines``).
- ``journal``, ``journal_store``: the knowledge written where it outlives the controller, and the run's
  ``RestartBudget``.
- ``fanout``: one phase sent to many engines at once (``ThreadFanOut``, ``SequentialFanOut``).
- ``async_fanout``: ``AsyncFanOut``, the same on one event loop for engines whose calls are coroutines, and Python's
  garbage collector paused (bounded) while its phase runs.
- ``verify``: checks after a transition (``WeightVersionCheck``, ``CanaryCheck``): "a 200 that isn't healthy" fails it.

The engine contract the barrier drives (``ControlPlaneEngine``, ``PauseMode``, ``EngineDied``, each engine kind's
``EngineRules``) is ``resilience.engine_contract``, below both the barrier and the engine clients. Ray engines and
``RayFanOut`` live in ``resilience.adapters.ray``.
"""

from resilience.barrier.async_orchestrator import AsyncOrchestrator
from resilience.barrier.fanout import EngineResult, FanOut, PhaseTimeout, SequentialFanOut, ThreadFanOut
from resilience.barrier.journal import RestartBudget, RestartBudgetError, RestartRecord
from resilience.barrier.orchestrator import Orchestrator
from resilience.barrier.state import (
    BarrierBusy,
    Effect,
    EngineGroup,
    EngineSkipped,
    HoldToken,
    PhaseDeadlines,
    PhaseFailed,
    PhaseReport,
    TransitionReport,
)
from resilience.barrier.verify import CanaryCheck, CheckFailed, EngineCheck, VerificationFailed, WeightVersionCheck
from resilience.engine_contract import (
    ALL_TAGS,
    AnyEngine,
    AsyncControlPlaneEngine,
    ControlPlaneEngine,
    EngineDied,
    EngineState,
    EngineUnavailable,
    PauseMode,
)

__all__ = [
    "ALL_TAGS", "AnyEngine", "AsyncControlPlaneEngine", "AsyncOrchestrator", "BarrierBusy", "CanaryCheck",
    "CheckFailed", "ControlPlaneEngine", "Effect", "EngineCheck", "EngineDied", "EngineGroup", "EngineResult",
    "EngineSkipped", "EngineState", "EngineUnavailable", "FanOut", "HoldToken", "Orchestrator", "PauseMode",
    "PhaseDeadlines", "PhaseFailed", "PhaseReport", "PhaseTimeout", "RestartBudget", "RestartBudgetError", "RestartRecord",
    "SequentialFanOut", "ThreadFanOut", "TransitionReport", "VerificationFailed", "WeightVersionCheck",
]
