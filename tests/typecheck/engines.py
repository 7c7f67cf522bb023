"""Type-checked (never run): every engine the barrier drives satisfies the engine contract.

mypy checks the assignments below (``files`` in pyproject.toml); each ``type: ignore`` must
stay needed (``warn_unused_ignores``), so the contract cannot silently go loose.
"""

from __future__ import annotations

from collections.abc import Sequence

from resilience.adapters.ray import RayEngine, RayVLLMEngine, _SGLangEngineActor, _VLLMEngineActor, ray_engine, ray_engines
from resilience.adapters.sglang import AsyncSGLangClient, SGLangClient
from resilience.adapters.vllm.engine import VLLMEngine
from resilience.barrier import AsyncControlPlaneEngine, ControlPlaneEngine, EngineGroup, Orchestrator, PauseMode


def _engines(client: SGLangClient, actor: _SGLangEngineActor, handle: RayEngine) -> list[ControlPlaneEngine]:
    return [client, actor, handle]


def _vllm_engines(engine: VLLMEngine, actor: _VLLMEngineActor, handle: RayVLLMEngine) -> list[ControlPlaneEngine]:
    return [engine, actor, handle]


def _ray_kinds(urls: Sequence[str]) -> None:
    """``ray_engines`` gives each kind's handle type, a mixed fleet the union; ``ray_engine`` the union."""
    from typing import assert_type

    from resilience.adapters.ray import RayEngineHandle

    assert_type(ray_engines(urls), list[RayEngine])
    assert_type(ray_engines(urls, kind="vllm"), list[RayVLLMEngine])
    assert_type(ray_engines(urls, kind=["sglang", "vllm"]), list[RayEngineHandle])
    assert_type(ray_engine(urls[0], kind="vllm"), RayEngineHandle)
    ray_engines(urls, kind="trtllm")  # type: ignore[arg-type]


def _typed_sync(client: SGLangClient) -> None:
    orch = Orchestrator(EngineGroup([client]))
    with orch.weight_sync() as engines:
        kept: list[SGLangClient] = engines  # the orchestrator keeps the engines' own type
        kept[0].begin_weight_update()


class _AsyncEngine:
    async def pause_generation(self, mode: PauseMode = "abort") -> None: ...
    async def flush_cache(self, deadline_s: float | None = None) -> None: ...
    async def release_memory_occupation(self, tags: Sequence[str] | None = None) -> None: ...
    async def resume_memory_occupation(self, tags: Sequence[str] | None = None) -> None: ...
    async def continue_generation(self, torch_empty_cache: bool = True) -> None: ...


class _MisspeltEngine:
    """``tag`` for ``tags``: the fan-out calls by keyword, so this engine would fail at run time."""

    def pause_generation(self, mode: PauseMode = "abort") -> None: ...
    def flush_cache(self, deadline_s: float | None = None) -> None: ...
    def release_memory_occupation(self, tag: Sequence[str] | None = None) -> None: ...
    def resume_memory_occupation(self, tags: Sequence[str] | None = None) -> None: ...
    def continue_generation(self, torch_empty_cache: bool = True) -> None: ...


async_engine: AsyncControlPlaneEngine = _AsyncEngine()
misspelt: ControlPlaneEngine = _MisspeltEngine()  # type: ignore[assignment]
not_an_engine: ControlPlaneEngine = object()  # type: ignore[assignment]
async_is_not_sync_client: AsyncControlPlaneEngine = SGLangClient("http://127.0.0.1:1")  # type: ignore[assignment]
async_client: AsyncControlPlaneEngine = AsyncSGLangClient("http://127.0.0.1:1")


def _held_state(client: SGLangClient, async_client: AsyncSGLangClient) -> None:
    """Both orchestrators hold their rules; the attributes users read keep their types (``BarrierView``)."""
    from typing import assert_type

    from resilience.barrier import AsyncOrchestrator, PhaseDeadlines
    from resilience.barrier.journal import Journal, Recovery
    from resilience.barrier.state import BarrierState
    from resilience.engine_contract import MemoryProbe
    from resilience.events import Observer

    orch = Orchestrator(EngineGroup([client]))
    aorch = AsyncOrchestrator(EngineGroup([async_client]))
    assert_type(orch.state, BarrierState[SGLangClient])
    assert_type(aorch.state, BarrierState[AsyncSGLangClient])
    assert_type(orch.recovery, Recovery | None)
    assert_type(aorch.journal, Journal | None)
    assert_type(orch.memory_probe, MemoryProbe | None)
    assert_type(aorch.deadlines, PhaseDeadlines)
    assert_type(orch.observers, tuple[Observer, ...])
    orch.observers = ()  # settable, as before
    orch.rollback = "no"  # type: ignore[assignment]
