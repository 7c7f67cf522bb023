"""The router/health recipe (examples/router_health.py) on emulated engines: a paused engine stays, a dead one goes."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

pytest.importorskip("torch")

from resilience.adapters.sglang import SGLangClient
from resilience.barrier import EngineGroup, Orchestrator
from resilience.testing.emulator import EmulatedFleet, EngineConfig
from resilience.testing.lab_sglang import demo_policies

PAUSED, DEAD, DEAD_WHILE_PAUSED = range(3)
HANG_S = 3.0
"""How long the engines' /health hangs while paused (SGLang: 20 s); the monitors' timeout is below it."""


def _load_recipe() -> ModuleType:
    path = Path(__file__).resolve().parents[2] / "examples" / "router_health.py"
    spec = importlib.util.spec_from_file_location("router_health", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


recipe = _load_recipe()


class NoHolds:
    """A monitor that trusts /health alone: nobody told it about any hold."""

    def held(self) -> dict[str, tuple[str, ...]]:
        return {}


@pytest.fixture(scope="module")
def offloaded() -> Iterator[tuple[EmulatedFleet, Orchestrator]]:
    """Engines 0 and 2 offloaded (paused, flushed, released) by an orchestrator; then engines 1 and 2 killed."""
    config = EngineConfig(health_hang_seconds=HANG_S, health_poll_seconds=0.05)
    with EmulatedFleet(3, config) as fleet:
        clients = [SGLangClient(url, policies=demo_policies()) for url in fleet.urls]
        orch = Orchestrator([
            EngineGroup([clients[PAUSED], clients[DEAD_WHILE_PAUSED]]),
            EngineGroup([clients[DEAD]], needs_offload=False),  # e.g. a reward model: never paused by us
        ])  # fmt: skip
        orch.offload()
        assert set(orch.held()) == {fleet.urls[PAUSED], fleet.urls[DEAD_WHILE_PAUSED]}
        fleet.engines[DEAD].kill()
        fleet.engines[DEAD_WHILE_PAUSED].kill()
        try:
            yield fleet, orch
        finally:
            for client in clients:
                client.close()


def test_monitor_per_the_recipe_keeps_the_paused_engine_and_ejects_the_dead(offloaded: tuple[EmulatedFleet, Orchestrator]) -> None:
    """Two failed rounds eject: the engine we paused answers healthy ("paused by us"); dead ones are ejected, held or not."""
    fleet, orch = offloaded
    monitor = recipe.HealthMonitor(orch, fleet.urls, failure_threshold=2, timeout_s=1.0)
    for _ in range(3):
        monitor.check()
    assert monitor.ejected == {fleet.urls[DEAD], fleet.urls[DEAD_WHILE_PAUSED]}
    assert monitor.last[fleet.urls[PAUSED]].reason.startswith("paused by us (")
    assert monitor.last[fleet.urls[DEAD_WHILE_PAUSED]].reason.startswith("dead while paused by us")
    assert monitor.failures[fleet.urls[PAUSED]] == 0


def test_a_monitor_trusting_health_alone_ejects_the_paused_engine(offloaded: tuple[EmulatedFleet, Orchestrator]) -> None:
    """The control: without the holds, the paused engine's hanging /health gets it ejected like the dead ones."""
    fleet, _ = offloaded
    monitor = recipe.HealthMonitor(NoHolds(), fleet.urls, failure_threshold=2, timeout_s=1.0)
    for _ in range(2):
        monitor.check()
    assert monitor.ejected == set(fleet.urls)
    assert monitor.last[fleet.urls[PAUSED]].reason == "/health no answer in 1 s"
