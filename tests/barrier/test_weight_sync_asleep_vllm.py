"""A weight sync into slept weights, on emulated vLLM 0.33.0 engines: refused before anything is sent, on threads and async.

vLLM #57853 / #57854: a weight update while the engine sleeps segfaults the EngineCore (the emulator dies of it:
``tests/testing/test_vllm_emulator.py``). After ``offload()`` the barrier knows every engine's weights released, so
``weight_sync()`` raises ``PhaseFailed`` naming each engine and its state, pauses nobody and never runs the body; the
clients refuse the push on their own too (``VLLMWeightsAsleep``). After ``onload(tags=["weights"])`` the same sync
pushes, and every engine lives and serves the pushed version.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from resilience.adapters.vllm import AsyncVLLMEngine, VLLMClient, VLLMEngine, VLLMWeightsAsleep, WeightPushFailed
from resilience.barrier import AsyncOrchestrator, EngineGroup, Orchestrator, PhaseDeadlines, PhaseFailed, WeightVersionCheck
from resilience.testing.emulator import EmulatedFleet
from resilience.testing.emulator.vllm import VLLMEngineConfig
from tests.vllm.conftest import FAST_VLLM

CONFIG = VLLMEngineConfig(dev_mode=True, enable_sleep_mode=True, weight_transfer_backend="nccl", token_rate=400.0)
DEADLINES = PhaseDeadlines(transition_s=60, pause_s=20, flush_s=20, release_s=20, resume_s=20, continue_s=20)
CHUNKS = [{"names": ["w"]}]


@pytest.fixture(scope="module")
def fleet() -> Iterator[EmulatedFleet]:
    with EmulatedFleet(2, CONFIG) as f:
        for h in f.engines:
            with VLLMClient(h.url, policies=FAST_VLLM) as c:
                c.init_weight_transfer_engine({"rank_offset": 0})
        yield f


def calls(fleet: EmulatedFleet) -> list[int]:
    return [len(h.record()["calls"]) for h in fleet.engines]


def check_refused(err: PhaseFailed, names: list[str]) -> None:
    """The sync's ``PhaseFailed`` names every engine, its state and the way out."""
    assert err.phase == "skipped" and set(err.failures) == set(names), err
    for name in names:
        why = str(err.failures[name])
        assert name in why and "weights are released (state released)" in why and "onload(tags=['weights'])" in why, why


def check_served(fleet: EmulatedFleet, version: str) -> None:
    for h in fleet.engines:
        assert h.alive(), h.log()
        state = h.state()
        assert (state["pause_state"], state["sleeping_tags"], state["weights"]) == ("unpaused", [], f"weights:{version}"), state


def test_a_sync_into_slept_weights_is_refused_unsent_and_one_after_the_weights_wake_pushes(fleet: EmulatedFleet) -> None:
    engines = [VLLMEngine(VLLMClient(h.url, policies=FAST_VLLM)) for h in fleet.engines]
    orch = Orchestrator(EngineGroup(engines), deadlines=DEADLINES)
    orch.offload()
    before = calls(fleet)
    ran = False
    with pytest.raises(PhaseFailed) as info, orch.weight_sync():
        ran = True
    assert not ran and calls(fleet) == before  # no pause, no push: nothing reached an engine
    check_refused(info.value, [e.engine for e in engines])
    assert orch.held() == {e.engine: ("offload",) for e in engines}  # the refused sync took no hold
    with pytest.raises(WeightPushFailed) as pushed:  # a body that bypasses the barrier: the client refuses it too
        engines[0].push_weights(CHUNKS, version="v1")
    assert isinstance(pushed.value.cause, VLLMWeightsAsleep) and calls(fleet) == before
    orch.onload(tags=["weights"])
    with orch.weight_sync() as synced:
        for e in synced:
            assert e.push_weights(CHUNKS, version="v1").chunks == 1
    orch.onload(verify=WeightVersionCheck("v1"))
    check_served(fleet, "v1")
    for e in engines:
        e.close()


def test_the_async_barrier_refuses_it_too(fleet: EmulatedFleet) -> None:
    async def run() -> None:
        engines = [AsyncVLLMEngine(h.url, policies=FAST_VLLM) for h in fleet.engines]
        orch: AsyncOrchestrator[Any] = AsyncOrchestrator(EngineGroup(engines), deadlines=DEADLINES)
        await orch.offload()
        before = await asyncio.to_thread(calls, fleet)
        with pytest.raises(PhaseFailed) as info:
            async with orch.weight_sync():
                raise AssertionError("the body of a refused sync ran")
        assert await asyncio.to_thread(calls, fleet) == before
        check_refused(info.value, [e.engine for e in engines])
        await orch.onload(tags=["weights"])
        async with orch.weight_sync() as synced:
            for e in synced:
                await e.push_weights(CHUNKS, version="v2")
        await orch.onload(verify=WeightVersionCheck("v2"))
        for e in engines:
            await e.aclose()

    asyncio.run(run())
    check_served(fleet, "v2")
