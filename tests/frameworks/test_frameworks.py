"""Real framework client code (AReaL 1.0.4, verl 0.9.1), unmodified, on emulated engines behind ``FaultProxy``.

Each test runs one framework's own offload/onload cycle (``resilience.testing.frameworks``)
for two cycles on three engines, under ``SGLangInstrumentor`` as docs/frameworks.md's recipes
mount it. The full 5 seeds x 5 cycles table is ``benchmarks/bench_frameworks.py``.

The frameworks are installed by ``scripts/setup.sh`` (``areal==1.0.4 --no-deps`` and its
light control-path deps; verl's ``http_server_engine.py`` from its wheel). Without them a
local run skips these tests with the command to run; with ``CI=true`` a missing framework
is a failure, never a skip.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("torch")

from resilience.testing.frameworks import FrameworkMissing, SeedResult, load_verl_http_engine, run_seed
from resilience.testing.skyrl import SkyRLMissing, load_skyrl_client

CYCLES = 2
SEED = 3


def _available(framework: str) -> None:
    """Skip (locally) or fail (``CI=true``) when ``framework`` is not installed."""
    try:
        if framework == "areal":
            import areal.engine.sglang_remote  # noqa: F401
        elif framework == "skyrl":
            load_skyrl_client()
        else:
            load_verl_http_engine()
    except (ImportError, FrameworkMissing, SkyRLMissing) as exc:
        message = f"{framework} is not installed ({exc}); run `bash scripts/setup.sh`"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(message)
        pytest.skip(message)


def _run(framework: str, plan: str, mount: str) -> SeedResult:
    _available(framework)
    return run_seed(framework, plan, mount, SEED, cycles=CYCLES)


@pytest.mark.parametrize("framework", ["areal", "verl", "skyrl"])
def test_transient_502s_with_the_mount(framework: str) -> None:
    """502s answered by the proxy: with the mount every cycle completes, no engine dies, and no engine gets more than 6 releases."""
    result = _run(framework, "transient", "middleware")
    assert result.completed == CYCLES, result.cycles
    assert result.deaths == 0
    assert result.most_releases <= 6  # the release entry's max_attempts, however often the framework re-sends


def test_verl_as_shipped_fails_on_transient_502s() -> None:
    """The same plan without the mount: verl raises on the first 502 (the rig's faults are real)."""
    result = _run("verl", "transient", "shipped")
    assert result.completed < CYCLES, result.cycles


@pytest.mark.parametrize("framework", ["areal", "verl"])
def test_502s_after_forwarding_with_the_memory_probe(framework: str) -> None:
    """502s after the engine acted on release and resume: with the emulator's memory probe, every cycle completes, no engine dies."""
    result = _run(framework, "after", "probe")
    assert result.completed == CYCLES, result.cycles
    assert result.deaths == 0


@pytest.mark.parametrize("plan", ["transient", "after"])
def test_skyrl_on_vllm_with_the_mount_without_a_streak_cap(plan: str) -> None:
    """SkyRL's own vLLM client (sleep, wake weights, wake kv_cache): as shipped it fails on the first 502; under
    ``VLLMInstrumentor`` every cycle completes with no cap on 502s in a row, after forwarding too (sleep and wake are idempotent)."""
    _available("skyrl")
    assert run_seed("skyrl", plan, "shipped", SEED, cycles=CYCLES, max_streak=None).completed < CYCLES
    result = run_seed("skyrl", plan, "middleware", SEED, cycles=CYCLES, max_streak=None)
    assert result.completed == CYCLES, result.cycles
    assert result.deaths == 0


@pytest.mark.parametrize("framework", ["areal", "verl"])
def test_502s_after_forwarding_with_the_probe_without_a_streak_cap(framework: str) -> None:
    """Issue 31's plan (no cap on 502s in a row) with the probe: every cycle completes, no engine dies."""
    _available(framework)
    result = run_seed(framework, "after", "probe", SEED, cycles=CYCLES, max_streak=None)
    assert result.completed == CYCLES, result.cycles
    assert result.deaths == 0
