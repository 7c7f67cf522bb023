"""Type-checked (never run): the vLLM clients' methods are typed, alike, and the verify checks fit the orchestrators.

mypy checks this file (``files`` in pyproject.toml); each ``type: ignore`` must stay needed (``warn_unused_ignores``).
"""

from __future__ import annotations

from resilience.adapters.sglang import SGLangClient
from resilience.adapters.vllm import AsyncVLLMClient, SleepResult, VLLMClient, WakeResult, WeightInfo
from resilience.barrier import CanaryCheck, EngineCheck, EngineGroup, Orchestrator, WeightVersionCheck


def _sync(client: VLLMClient) -> None:
    slept: SleepResult = client.sleep(2, "keep")
    woke: WakeResult = client.wake_up(["weights"])
    info: WeightInfo = client.weight_info()
    paused: bool = client.is_paused()
    client.sleep(3.5)  # type: ignore[arg-type]
    client.pause("drain")  # type: ignore[arg-type]
    client.weight_checker("verify")  # type: ignore[arg-type]
    del slept, woke, info, paused


async def _async(client: AsyncVLLMClient) -> None:
    slept: SleepResult = await client.sleep(1)
    info: WeightInfo = await client.weight_info()
    not_awaited: WeightInfo = client.weight_info()  # type: ignore[assignment]
    del slept, info, not_awaited


checks: list[EngineCheck] = [WeightVersionCheck("v1"), CanaryCheck("p", "ref")]


def _verify(client: SGLangClient) -> None:
    orch = Orchestrator(EngineGroup([client]))
    orch.onload(verify=checks)
    orch.onload(verify=WeightVersionCheck({"http://127.0.0.1:1": "v2"}))
    orch.onload(verify=["v1"])  # type: ignore[list-item]
    with orch.weight_sync(verify=checks):
        pass


def _barrier_engines(url: str) -> None:
    """``VLLMEngine`` satisfies the barrier's engine contract (``AsyncVLLMEngine`` the async one); a bare client does not."""
    from resilience.adapters.vllm import AsyncVLLMEngine, VLLMEngine
    from resilience.barrier import AsyncControlPlaneEngine, ControlPlaneEngine

    engine: ControlPlaneEngine = VLLMEngine(url)
    async_engine: AsyncControlPlaneEngine = AsyncVLLMEngine(url)
    bare: ControlPlaneEngine = VLLMClient(url)  # type: ignore[assignment]
    mixed: list[EngineGroup[ControlPlaneEngine]] = [EngineGroup([engine]), EngineGroup([SGLangClient(url)])]
    Orchestrator(mixed)  # an SGLang fleet and a vLLM one in one orchestrator
    del async_engine, bare
