"""controlplane-resilience: HTTP control planes that survive transient failure.

The top level holds what a user reaches for in the first hour (``__all__``):
the resilient transports, the SGLang clients, the barrier, policies,
``Deadline``, the errors a caller catches and ``set_testing``. Everything else
is imported from its one module: ``resilience.outcome`` (what an attempt or a
call did), ``resilience.events``, ``resilience.policy`` (probes),
``resilience.clock``, ``resilience.barrier`` (the restart budget),
``resilience.errors``, ``resilience.adapters.driver_config`` and the retry
core for transport authors (``resilience.retry``).

The transports, the SGLang clients and the barrier load on first use (PEP
562), so ``import resilience`` pulls in no optional extra.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from resilience._config import set_testing
from resilience.breaker import BreakerConfig
from resilience.budget import RetryBudgetConfig
from resilience.deadline import Deadline
from resilience.errors import AmbiguousOutcome, CircuitOpen, ConfigError, DeadlineExceeded, ResilienceError, RetriesExhausted
from resilience.policy import EndpointPolicy, PolicyTable, RetryPolicy
from resilience.policy_files import load_policy_file

if TYPE_CHECKING:
    from resilience.adapters.aiohttp import ResilientMiddleware
    from resilience.adapters.httpx import AsyncResilientTransport, ResilientTransport
    from resilience.adapters.requests import ResilientAdapter, resilient_session
    from resilience.adapters.sglang import AsyncSGLangClient, SGLangClient
    from resilience.barrier import AsyncOrchestrator, EngineGroup, Orchestrator, PhaseFailed

__version__ = "0.1.0"

_LAZY: dict[str, str] = {  # name -> the module that defines it, imported on first access
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
    # transports
    "AsyncResilientTransport",
    "ResilientAdapter",
    "ResilientMiddleware",
    "ResilientTransport",
    "resilient_session",
    # SGLang engines and the barrier
    "AsyncOrchestrator",
    "AsyncSGLangClient",
    "EngineGroup",
    "Orchestrator",
    "PhaseFailed",
    "SGLangClient",
    # policies and deadlines
    "BreakerConfig",
    "Deadline",
    "EndpointPolicy",
    "PolicyTable",
    "RetryBudgetConfig",
    "RetryPolicy",
    "load_policy_file",
    # errors
    "AmbiguousOutcome",
    "CircuitOpen",
    "ConfigError",
    "DeadlineExceeded",
    "ResilienceError",
    "RetriesExhausted",
    # testing
    "set_testing",
    "__version__",
]
