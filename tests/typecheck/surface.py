"""Type-checked (never run): every name of ``resilience.__all__``, used through the top level as a user would.

mypy checks this file (``files`` in pyproject.toml); ``tests/core/test_public_surface.py`` checks that
each name of ``__all__`` is used here as ``resilience.<name>``, so no name is exported unproven.
"""

from __future__ import annotations

import aiohttp
import httpx
import requests

import resilience

version: str = resilience.__version__
resilience.set_testing(True, attempts=2)  # tests: no sleeps, capped attempts

# Policies: a table of entries, from Python or a file, and the breaker and budget configs.
policies: resilience.PolicyTable = resilience.PolicyTable(
    {"POST /release_memory_occupation": resilience.EndpointPolicy(idempotent=False, retry=resilience.RetryPolicy(max_attempts=3))}
)
from_file: resilience.PolicyTable = resilience.load_policy_file("examples/policies.toml", base=policies)
breaker: resilience.BreakerConfig = resilience.BreakerConfig(failure_threshold=5)
budget: resilience.RetryBudgetConfig = resilience.RetryBudgetConfig(max_tokens=10)

# One transport per HTTP library.
session: requests.Session = resilience.resilient_session(policies, breaker=breaker, retry_budget=budget)
session.mount("http://", resilience.ResilientAdapter(from_file))
sync_client = httpx.Client(transport=resilience.ResilientTransport(policies))
async_client = httpx.AsyncClient(transport=resilience.AsyncResilientTransport(policies))
middleware: resilience.ResilientMiddleware = resilience.ResilientMiddleware(policies)


async def aiohttp_call() -> int:
    async with aiohttp.ClientSession(middlewares=(middleware,)) as s, s.get("http://127.0.0.1:1/health") as r:
        return r.status


# The SGLang engines, and the barrier over them.
engine: resilience.SGLangClient = resilience.SGLangClient("http://127.0.0.1:30000")
async_engine: resilience.AsyncSGLangClient = resilience.AsyncSGLangClient("http://127.0.0.1:30001")
orchestrator: resilience.Orchestrator[resilience.SGLangClient] = resilience.Orchestrator(resilience.EngineGroup([engine]))
async_orchestrator: resilience.AsyncOrchestrator[resilience.AsyncSGLangClient] = resilience.AsyncOrchestrator(
    resilience.EngineGroup([async_engine])
)


def offload_and_onload() -> list[str]:
    """One round under a deadline; the errors a caller tells apart. Returns the engines left to reconcile."""
    try:
        with resilience.Deadline(60.0) as deadline:
            orchestrator.offload()
            if deadline.remaining() > 1.0:
                orchestrator.onload()
    except resilience.PhaseFailed as failed:
        return sorted(failed.quarantined)
    except resilience.AmbiguousOutcome as ambiguous:  # may have been applied: never re-sent blindly
        return [ambiguous.engine]
    except resilience.CircuitOpen:
        pass
    except resilience.DeadlineExceeded:
        pass
    except resilience.RetriesExhausted:
        pass
    except resilience.ResilienceError:
        pass
    return []


async def async_round() -> None:
    await async_orchestrator.offload()
    await async_orchestrator.onload()


try:
    resilience.RetryPolicy(max_attempts=0)
except resilience.ConfigError as bad:  # a ValueError naming the field and the rule
    message: str = str(bad)
