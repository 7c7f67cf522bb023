"""Offload, onload and weight sync over HTTP on emulated vLLM 0.33.0 engines behind the fault proxy, on threads and on async.

``Orchestrator(EngineGroup([VLLMEngine(u), ...]))`` (and ``AsyncOrchestrator`` with ``AsyncVLLMEngine``) runs RFC #48310's
transaction: offload (pause -> sleep), onload(weights), a weight sync whose body runs ``push_weights`` per engine,
onload (wake kv_cache, which resumes vLLM's scheduler). The proxy answers 502 after the engine applied the first sleep,
wake and ``/update_weights`` of engine 1: sleep and wake are sent again (idempotent on vLLM), ``/update_weights``
never (the emulator's server-side record shows it once), and ``/weight_checker`` settles it. Afterwards every engine
is alive, serving, reports the pushed version (``WeightVersionCheck``) and completes as intact weights of that version do.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from resilience.adapters.vllm import AsyncVLLMEngine, VLLMClient, VLLMEngine
from resilience.barrier import AsyncOrchestrator, CanaryCheck, EngineGroup, Orchestrator, PhaseDeadlines, WeightVersionCheck
from resilience.testing.emulator import EmulatedFleet, EngineHandle
from resilience.testing.emulator.vllm import VLLMEngineConfig, expected_completion
from resilience.testing.faultplan import FaultPlan, FaultRule
from tests.vllm.conftest import FAST_VLLM

CONFIG = VLLMEngineConfig(dev_mode=True, enable_sleep_mode=True, weight_transfer_backend="nccl", token_rate=400.0)
DEADLINES = PhaseDeadlines(transition_s=60, pause_s=20, flush_s=20, release_s=20, resume_s=20, continue_s=20)
PROMPT = "canary prompt"
_FIRST_OF_EACH_TEST = frozenset({1, 4})  # each test sends one sleep and two wakes to each engine (re-sends included below)
FAULTS = FaultPlan(
    seed=22,
    rules=(
        FaultRule("/sleep", "status_after", status=502, calls=frozenset({1, 3}), engines=frozenset({1})),
        FaultRule("/wake_up", "status_after", status=502, calls=frozenset({1, 4}), engines=frozenset({1})),
        FaultRule("/update_weights", "status_after", status=502, calls=frozenset({1, 2}), engines=frozenset({1})),
    ),
)
"""Engine 1: a 502 after the engine applied its first sleep, its first wake and its first update of each test."""


@pytest.fixture(scope="module")
def fleet() -> Iterator[EmulatedFleet]:
    with EmulatedFleet(2, CONFIG, fault_plan=FAULTS) as f:
        for h in f.engines:
            with VLLMClient(h.direct_url, policies=FAST_VLLM) as c:
                c.init_weight_transfer_engine({"rank_offset": 0})
        yield f


def calls_to(handle: EngineHandle, path: str) -> int:
    return sum(1 for c in handle.record()["calls"] if c["path"] == path)


def expected_checksums(fleet: EmulatedFleet, version: str) -> dict[str, str]:
    """The checksums intact weights of ``version`` have: read from engine 0 once it holds them (the trainer knows them)."""
    with VLLMClient(fleet.engines[0].direct_url, policies=FAST_VLLM) as c:
        assert c.weight_info().weight_version == version
        checks = c.weight_checker("checksum").checksums
        assert checks is not None
        return dict(checks)


def check_fleet(fleet: EmulatedFleet, version: str, before: dict[str, int]) -> None:
    for h in fleet.engines:
        assert h.alive(), h.log()
        state = h.state()
        assert (state["pause_state"], state["sleeping_tags"], state["weight_version"]) == ("unpaused", [], version), state
        assert state["weights"] == f"weights:{version}"
    record = fleet.engines[1]
    assert calls_to(record, "/update_weights") - before["update"] == 1  # never re-sent once it may have arrived
    assert calls_to(record, "/sleep") - before["sleep"] == 2 and calls_to(record, "/wake_up") - before["wake"] == 3
    assert calls_to(fleet.engines[0], "/resume") == 0  # the last wake resumed: no /resume was needed


def counts(fleet: EmulatedFleet) -> dict[str, int]:
    h = fleet.engines[1]
    return {"update": calls_to(h, "/update_weights"), "sleep": calls_to(h, "/sleep"), "wake": calls_to(h, "/wake_up")}


def test_offload_sync_onload_on_threads(fleet: EmulatedFleet) -> None:
    engines = [VLLMEngine(VLLMClient(h.url, policies=FAST_VLLM)) for h in fleet.engines]
    before = counts(fleet)
    orch = Orchestrator(EngineGroup(engines), deadlines=DEADLINES)
    orch.offload()
    assert all(h.state()["sleeping_tags"] == ["kv_cache", "weights"] for h in fleet.engines)
    orch.onload(tags=["weights"])
    with orch.weight_sync() as synced:
        first = synced[0].push_weights([{"names": ["w"]}], version="v1")
        assert first.settled == ()
        pushed = synced[1].push_weights([{"names": ["w"]}], version="v1", expected=expected_checksums(fleet, "v1"))
        assert pushed.settled == ("update_weights chunk 0: /weight_checker matched",)
    canary = CanaryCheck(PROMPT, expected_completion(PROMPT, "v1", 4), max_tokens=4)
    orch.onload(verify=[WeightVersionCheck("v1"), canary])
    check_fleet(fleet, "v1", before)
    for e in engines:
        e.close()


def test_offload_sync_onload_on_async(fleet: EmulatedFleet) -> None:
    async def run() -> None:
        engines = [AsyncVLLMEngine(h.url, policies=FAST_VLLM) for h in fleet.engines]
        orch: AsyncOrchestrator[Any] = AsyncOrchestrator(EngineGroup(engines), deadlines=DEADLINES)
        await orch.offload()
        await orch.onload(tags=["weights"])
        async with orch.weight_sync() as synced:
            await synced[0].push_weights([{"names": ["w"]}], version="v2")
            expected = await asyncio.to_thread(expected_checksums, fleet, "v2")
            await synced[1].push_weights([{"names": ["w"]}], version="v2", expected=expected)
        await orch.onload(verify=WeightVersionCheck("v2"))
        for e in engines:
            await e.aclose()

    before = counts(fleet)
    asyncio.run(run())
    check_fleet(fleet, "v2", before)
