"""controlplane-resilience: HTTP control planes that survive transient failure.

The public API is what ``__all__`` lists: policies, errors, deadlines,
budgets, the breaker's config, the drivers' shared ``DriverConfig``, events,
the delivery record's reader ``attempts_of`` and the testing switch, imported
eagerly (standard library only: no transport library); the barrier
orchestrators, the SGLang clients and the requests, httpx and aiohttp
drivers are imported on first use (PEP 562), so ``import resilience`` pulls
in no optional extra (requests, httpx and aiohttp load only with their driver).

Names for transport authors (``Retrier``, ``RetryCall``, ``CallSpec``,
``AttemptResult``, ``ErrorTypes``, ``classify``, ``backoff_delay``,
``EndpointMatch``, ``CircuitBreaker``, ...) stay in their modules:
``resilience.retry.retrier``, ``resilience.retry.call``, ``resilience.retry.spec``,
``resilience.errors``, ``resilience.backoff``,
``resilience.policy``, ``resilience.breaker``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from resilience._config import set_testing
from resilience.breaker import BreakerConfig, BreakerState
from resilience.budget import RestartBudget, RestartBudgetError, RestartRecord, RetryBudgetConfig
from resilience.clock import Clock, FakeClock, SystemClock
from resilience.deadline import Deadline, current_deadline
from resilience.driver_config import DriverConfig
from resilience.errors import (
    AmbiguousOutcome,
    CircuitOpen,
    ConfigConflict,
    ConfigError,
    DeadlineExceeded,
    PolicyError,
    ResilienceError,
    RetriesExhausted,
    RetryBudgetExhausted,
)
from resilience.events import Event, Observer
from resilience.outcome import AttemptRecord, CallOutcome, Delivery, Outcome, attempts_of
from resilience.policy import EndpointPolicy, PolicyTable, Probe, ProbeAnswer, ProbeContext, RetryPolicy
from resilience.policy_files import load_policy_file

if TYPE_CHECKING:
    from resilience.adapters.aiohttp import ResilientMiddleware
    from resilience.adapters.httpx import AsyncResilientTransport, ResilientTransport
    from resilience.adapters.requests import ResilientAdapter, resilient_session
    from resilience.adapters.sglang import AsyncSGLangClient, SGLangClient
    from resilience.barrier import AsyncOrchestrator, EngineGroup, Orchestrator, PhaseFailed

__version__ = "0.1.0"

_LAZY: dict[str, str] = {
    "AsyncOrchestrator": "resilience.barrier",
    "AsyncResilientTransport": "resilience.adapters.httpx",
    "AsyncSGLangClient": "resilience.adapters.sglang",
    "EngineGroup": "resilience.barrier",
    "Orchestrator": "resilience.barrier",
    "PhaseFailed": "resilience.barrier",
    "ResilientAdapter": "resilience.adapters.requests",
    "ResilientMiddleware": "resilience.adapters.aiohttp",
    "ResilientTransport": "resilience.adapters.httpx",
    "SGLangClient": "resilience.adapters.sglang",
    "resilient_session": "resilience.adapters.requests",
}
"""Names imported on first access, from the module that defines them."""


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'resilience' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "AmbiguousOutcome",
    "AsyncOrchestrator",
    "AsyncResilientTransport",
    "AsyncSGLangClient",
    "AttemptRecord",
    "BreakerConfig",
    "BreakerState",
    "CallOutcome",
    "CircuitOpen",
    "Clock",
    "ConfigConflict",
    "ConfigError",
    "Deadline",
    "DeadlineExceeded",
    "Delivery",
    "DriverConfig",
    "EndpointPolicy",
    "EngineGroup",
    "Event",
    "FakeClock",
    "Observer",
    "Orchestrator",
    "Outcome",
    "PhaseFailed",
    "PolicyError",
    "PolicyTable",
    "Probe",
    "ProbeAnswer",
    "ProbeContext",
    "ResilienceError",
    "ResilientAdapter",
    "ResilientMiddleware",
    "ResilientTransport",
    "RestartBudget",
    "RestartBudgetError",
    "RestartRecord",
    "RetriesExhausted",
    "RetryBudgetConfig",
    "RetryBudgetExhausted",
    "RetryPolicy",
    "SGLangClient",
    "SystemClock",
    "__version__",
    "attempts_of",
    "current_deadline",
    "load_policy_file",
    "resilient_session",
    "set_testing",
]
