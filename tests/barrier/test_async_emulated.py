"""AsyncOrchestrator over AsyncSGLangClient on emulated SGLang engines (real HTTP on loopback, SGLang's crash rules).

``test_barrier.py`` runs the sync ``Orchestrator`` over ``AsyncFanOut`` with the same
clients (its ``async`` backend); this drives the await-based orchestrator from a
running loop: a colocate step in order on every engine, then a dead engine named
while the others are rolled back and keep serving.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import requests

pytest.importorskip("fastapi")
pytest.importorskip("torch")

from resilience.adapters.sglang import AsyncSGLangClient
from resilience.barrier import AsyncOrchestrator, EngineGroup, PhaseDeadlines, PhaseFailed
from resilience.engine_contract import EngineState
from resilience.testing.emulator import EmulatedFleet
from tests.sglang.conftest import FAST_ENGINE, FAST_SGLANG


@pytest.fixture
def fleet3() -> Iterator[EmulatedFleet]:
    with EmulatedFleet(3, FAST_ENGINE) as fleet:
        yield fleet


def paths(fleet: EmulatedFleet, i: int, since_ns: int) -> list[str]:
    return [c["path"] for c in fleet.engines[i].record()["calls"] if c["received_ns"] >= since_ns]


@pytest.mark.asyncio
async def test_async_orchestrator_on_emulated_engines(fleet3: EmulatedFleet) -> None:
    """Offload, onload weights, weight sync, onload: each engine sees the calls in order and serves again; then one engine
    is killed: the next offload names it dead and rolls the other two back, which answer /generate."""
    clients = [AsyncSGLangClient(u, policies=FAST_SGLANG) for u in fleet3.urls]
    orch = AsyncOrchestrator(EngineGroup(clients), deadlines=PhaseDeadlines(transition_s=30, pause_s=10, flush_s=10))
    try:
        t0 = time.monotonic_ns()
        await orch.offload()
        await orch.onload(tags=["weights"])
        async with orch.weight_sync() as engines:
            assert engines == clients and all(orch.paused_by_us(c) for c in clients)
        report = await orch.onload()
        assert report.held == {} and set(orch.states().values()) == {EngineState.SERVING}
        for i, engine in enumerate(fleet3.engines):
            assert paths(fleet3, i, t0) == [
                "/pause_generation",
                "/flush_cache",
                "/release_memory_occupation",
                "/resume_memory_occupation",
                "/resume_memory_occupation",
                "/continue_generation",
            ]
            state: dict[str, Any] = engine.state()
            assert engine.alive() and not state["paused"] and state["released_tags"] == []

        fleet3.engines[2].kill()
        with pytest.raises(PhaseFailed) as info:
            await orch.offload()
        dead = clients[2].engine
        err = info.value
        assert err.phase == "pause" and list(err.failures) == [dead] and err.dead == (dead,) and list(err.left_paused) == [dead]
        assert sorted(err.rolled_back) == sorted(c.engine for c in clients[:2])
        for url in fleet3.urls[:2]:
            out = requests.post(f"{url}/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}}, timeout=10)
            assert out.status_code == 200
    finally:
        for client in clients:
            await client.aclose()
