"""The top-level surface: what ``resilience`` exports, what it loads lazily, and the one testing switch."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import resilience
from resilience import _config
from resilience._config import current_testing
from resilience.events import AttemptEnded, CallEnded
from resilience.outcome import CallOutcome, Outcome

LAZY = {
    "AsyncOrchestrator", "AsyncResilientTransport", "AsyncSGLangClient", "EngineGroup", "Orchestrator", "PhaseFailed",
    "ResilientAdapter", "ResilientMiddleware", "ResilientTransport", "SGLangClient", "resilient_session",
}  # fmt: skip
ELSEWHERE = {
    "resilience.outcome": {"AttemptRecord", "CallOutcome", "Delivery", "Outcome", "attempts_of"},
    "resilience.events": {"CallObserver", "Event", "Observer"},
    "resilience.policy": {"Probe", "ProbeAnswer", "ProbeContext", "EndpointMatch"},
    "resilience.clock": {"Clock", "SystemClock"},
    "resilience.testing.clock": {"FakeClock"},
    "resilience.barrier": {"RestartBudget", "RestartBudgetError", "RestartRecord"},
    "resilience.breaker": {"BreakerState", "CircuitBreaker"},
    "resilience.errors": {"ConfigConflict", "RetryBudgetExhausted", "ErrorTypes"},
    "resilience.deadline": {"CURRENT_DEADLINE"},
    "resilience.adapters.driver_config": {"DriverConfig"},
    "resilience.backoff": {"backoff_delay"},
    "resilience.retry.retrier": {"Retrier"},
    "resilience.retry.call": {"RetryCall"},
    "resilience.retry.spec": {"CallSpec", "AttemptResult", "classify"},
}
"""Names a user meets after the first hour, or a transport author's: each only at its module, its one import path."""
SURFACE_PROOF = Path(__file__).resolve().parents[1] / "typecheck" / "surface.py"


def test_the_top_level_is_what_a_user_needs_first_and_each_name_resolves() -> None:
    """``__all__`` is short and resolves (lazy names included); the rest is reachable only from its module."""
    assert len(set(resilience.__all__)) == len(resilience.__all__) <= 30, resilience.__all__
    missing = [name for name in resilience.__all__ if getattr(resilience, name, None) is None]
    assert not missing
    assert LAZY <= set(resilience.__all__) and LAZY <= set(dir(resilience))
    for module, names in ELSEWHERE.items():
        assert not names & set(resilience.__all__), names & set(resilience.__all__)
        defined = importlib.import_module(module)
        assert all(hasattr(defined, name) for name in names), (module, sorted(n for n in names if not hasattr(defined, n)))
    with pytest.raises(AttributeError, match="no attribute 'Retrier'"):
        _ = resilience.Retrier  # type: ignore[attr-defined]
    with pytest.raises(AttributeError, match="no attribute 'attempts_of'"):
        _ = resilience.attempts_of  # type: ignore[attr-defined]


def test_every_exported_name_is_proven_by_the_typecheck_file() -> None:
    """Each name of ``__all__`` is used as ``resilience.<name>`` in ``tests/typecheck/surface.py``, which mypy checks."""
    tree = ast.parse(SURFACE_PROOF.read_text(encoding="utf-8"))
    used = {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "resilience"
    }
    assert not set(resilience.__all__) - used, f"exported but never used in {SURFACE_PROOF.name}: {sorted(set(resilience.__all__) - used)}"
    assert not used - set(resilience.__all__), f"used there but not exported: {sorted(used - set(resilience.__all__))}"


def test_lazy_names_are_the_defining_modules_objects() -> None:
    """The lazy exports are the very classes of their modules, not copies."""
    from resilience.adapters.aiohttp import ResilientMiddleware
    from resilience.adapters.httpx import AsyncResilientTransport, ResilientTransport
    from resilience.adapters.requests import ResilientAdapter, resilient_session
    from resilience.adapters.sglang import AsyncSGLangClient, SGLangClient
    from resilience.barrier import AsyncOrchestrator, EngineGroup, Orchestrator, PhaseFailed

    assert resilience.Orchestrator is Orchestrator and resilience.EngineGroup is EngineGroup and resilience.PhaseFailed is PhaseFailed
    assert resilience.AsyncOrchestrator is AsyncOrchestrator
    assert resilience.SGLangClient is SGLangClient and resilience.AsyncSGLangClient is AsyncSGLangClient
    assert resilience.ResilientTransport is ResilientTransport and resilience.AsyncResilientTransport is AsyncResilientTransport
    assert resilience.ResilientMiddleware is ResilientMiddleware
    assert resilience.ResilientAdapter is ResilientAdapter and resilience.resilient_session is resilient_session


def test_import_resilience_loads_no_adapter_barrier_or_extra() -> None:
    """``import resilience`` alone imports neither the lazy modules nor any optional extra nor any transport (fresh interpreter)."""
    code = textwrap.dedent(
        """
        import sys
        import resilience
        loaded = sorted(m for m in sys.modules if m.startswith(("resilience.adapters", "resilience.barrier", "resilience.telemetry",
                        "resilience.testing", "opentelemetry", "prometheus_client", "ray", "torch", "fastapi", "rich", "httpx", "aiohttp",
                        "requests", "urllib3")))
        print(len([m for m in sys.modules if m.startswith("resilience")]), loaded)
        resilience.Orchestrator
        print("resilience.barrier" in sys.modules)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    first, second = out.stdout.split("\n")[:2]
    count, loaded = first.split(" ", 1)
    assert int(count) >= 10, out.stdout  # the core did load
    assert loaded == "[]", out.stdout
    assert second == "True", out.stdout


def test_set_testing_switches_at_once_and_restores_as_a_context_manager() -> None:
    """``set_testing`` works as a plain call (stays on) and as a ``with`` block (restores the mode before)."""
    assert current_testing() == _config.TestingMode()
    switch = resilience.set_testing(True, attempts=3)
    assert current_testing() == _config.TestingMode(active=True, attempts=3) and switch.previous == _config.TestingMode()
    with resilience.set_testing(False) as inner:
        assert inner == _config.TestingMode() and current_testing() == _config.TestingMode()
        with resilience.set_testing(attempts=2) as innermost:
            assert innermost == current_testing() == _config.TestingMode(active=True, attempts=2)
        assert current_testing() == _config.TestingMode()
    assert current_testing() == _config.TestingMode(active=True, attempts=3)
    resilience.set_testing(False)
    assert current_testing() == _config.TestingMode()


@pytest.mark.parametrize("attempts", [0, -1, True, 1.5, "2"])
def test_set_testing_rejects_bad_attempts(attempts: object) -> None:
    """A bad cap is a ConfigError (a ValueError) naming the argument; the mode in force is unchanged."""
    with pytest.raises(resilience.ConfigError, match=r"set_testing.attempts must be an integer >= 1 or None"):
        resilience.set_testing(True, attempts=attempts)  # type: ignore[arg-type]
    assert current_testing() == _config.TestingMode()
    assert issubclass(resilience.ConfigError, ValueError)


def test_events_with_many_fields_are_keyword_only() -> None:
    """Positional construction of the many-field events is a TypeError, so two ``str`` fields cannot swap silently."""
    with pytest.raises(TypeError):
        AttemptEnded(1, 0, "GET", "GET /x", "http://e:1", 200, Outcome.SUCCESS, None, True, 0.1)  # type: ignore[misc]
    with pytest.raises(TypeError):
        CallEnded(1, "GET", "GET /x", "http://e:1", CallOutcome.SUCCESS, 200, 1, 0.1, None, None)  # type: ignore[misc]
    event = AttemptEnded(
        call_id=1, attempt=0, method="GET", endpoint="GET /x", engine="http://e:1", status=200,
        outcome=Outcome.SUCCESS, error_type=None, sent=True, duration_s=0.1,
    )  # fmt: skip
    assert event.endpoint == "GET /x" and event.engine == "http://e:1"
