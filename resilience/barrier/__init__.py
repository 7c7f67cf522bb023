"""The barrier: offload, onload and weight sync across engine groups, without ever killing an engine.

- ``orchestrator``: ``Orchestrator``, the transitions driven from the caller's thread through a fan-out.
- ``async_orchestrator``: ``AsyncOrchestrator``, the same transitions awaited on the caller's event loop.
- ``rules``: ``BarrierState``, what each orchestrator holds: the engines, their knowledge, the journal, queries
  (``view``: the public surface both orchestrators answer from it).
- ``steps``: what a transition yields to its driver (``PhaseCall``, ``SettleCall``, ``WaitCall``, ``ReadCall``).
- ``offload``, ``onload``, ``pauses``: the transitions as steps (one copy, both orchestrators);
  ``fold``: one phase marked, sent and folded in; ``settle``: a transition's start (late calls, the
  memory probe); ``holds``: owned holds; ``recovery``: reconcile, retire, the journal resumed;
  ``resume_check``: a resumed journal checked against the engines (a fresh process is a new engine);
  ``transition``: a transition's events and ``PhaseFailed``; ``args``: argument checks.
- ``types``: its values and errors (``EngineGroup``, ``PhaseDeadlines``, reports, ``PhaseFailed``).
- ``engine``: the engine contract (``ControlPlaneEngine``) and ``ALL_TAGS``.
- ``knowledge``: what the orchestrator knows of each engine, and what it knows it does not know.
- ``kinds``: each engine kind's control rules as one table (``EngineRules``; ``SGLANG_RULES``), looked up per engine.
- ``effect``: what a call did to the engine (``Effect``: applied, not applied, maybe), from the driver's record only.
- ``journal``, ``journal_store``: the knowledge written where it outlives the controller.
- ``fanout``: one phase sent to many engines at once (``ThreadFanOut``, ``SequentialFanOut``).
- ``async_fanout``: ``AsyncFanOut``, the same on one event loop for engines whose calls are coroutines
  (imported from there: ``from resilience.barrier.async_fanout import AsyncFanOut``).
- ``collector``: Python's garbage collector paused (bounded) while an async fan-out's phase runs.
- ``verify``: checks after a transition (``WeightVersionCheck``, ``CanaryCheck``): "a 200 that isn't healthy" fails it.

Ray engines and ``RayFanOut`` live in ``resilience.adapters.ray``.
"""

from resilience.barrier.async_orchestrator import AsyncOrchestrator
from resilience.barrier.fanout import EngineResult, FanOut, PhaseTimeout, SequentialFanOut, ThreadFanOut
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
    "ALL_TAGS",
    "AnyEngine",
    "AsyncControlPlaneEngine",
    "AsyncOrchestrator",
    "BarrierBusy",
    "CanaryCheck",
    "CheckFailed",
    "ControlPlaneEngine",
    "Effect",
    "EngineCheck",
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
    "VerificationFailed",
    "WeightVersionCheck",
]
