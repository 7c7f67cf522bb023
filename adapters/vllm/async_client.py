"""``AsyncVLLMClient``: ``VLLMClient`` with coroutine methods (same routes, policies, results, errors, version rules and docstrings:
only the sending differs), over its own aiohttp session or one you pass, as ``AsyncSGLangClient``."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from resilience.adapters.driver_config import UNSET, DriverConfig, Unset
from resilience.adapters.engine_http import DEFAULT_LIMIT_PER_HOST, Answer, AsyncSessionOwner, OwnAsyncSession
from resilience.adapters.engine_session import own_driver_kwargs
from resilience.adapters.engine_steps import drive
from resilience.adapters.vllm import answers, calls
from resilience.adapters.vllm.answers import Plan, Request, VLLMPauseMode, WeightCheckerAction, key_header
from resilience.adapters.vllm.calls import FaultInstruction
from resilience.adapters.vllm.client import VLLMClient
from resilience.adapters.vllm.results import (
    AbortResult,
    CacheReset,
    CommandResult,
    CompletionResult,
    FaultToleranceAccepted,
    FaultToleranceStatus,
    RpcResult,
    SleepResult,
    VLLMHealth,
    WakeResult,
    WeightCheck,
    WeightInfo,
)
from resilience.adapters.vllm.routes import ROUTES, VLLM_POLICIES
from resilience.adapters.vllm.state import VLLMClientState
from resilience.adapters.vllm.versions import VLLMApi
from resilience.events import Observer
from resilience.policy import PolicyTable

if TYPE_CHECKING:
    import aiohttp
    import httpx

__all__ = ["AsyncVLLMClient"]

T = TypeVar("T")


class AsyncVLLMClient(AsyncSessionOwner, VLLMClientState):
    """A client of one vLLM server's HTTP control plane, with ``async`` methods.

    ``base_url``, ``api_key``, ``api_version``, ``policies`` (default ``VLLM_POLICIES``), ``observers``, ``config``: as
    ``VLLMClient``. ``session``: an ``aiohttp.ClientSession`` or ``httpx.AsyncClient`` with your resilience layer
    mounted, used as is and never closed (default None = the client's own aiohttp session, opened on first use in the
    running loop). ``limit_per_host``: the own session's pool size (default 100). Other keyword arguments go to
    ``ResilientMiddleware`` (``breaker``, ``retry_budget``, ``clock``). With a ``session``, the settings of the own
    session must be left out (``ConfigConflict`` names them). Close the own session with ``await client.aclose()`` or
    ``async with``.
    """

    def __init__(
        self,
        base_url: str,
        session: aiohttp.ClientSession | httpx.AsyncClient | None = None,
        api_key: str | None = None,
        policies: PolicyTable | Unset = UNSET,
        *,
        observers: Sequence[Observer] | Unset = UNSET,
        config: DriverConfig | None = None,
        api_version: str | None = None,
        limit_per_host: int = DEFAULT_LIMIT_PER_HOST,
        **middleware_kwargs: Any,
    ) -> None:
        driver_kwargs = own_driver_kwargs(
            "AsyncVLLMClient", VLLM_POLICIES, session=session, config=config, policies=policies, observers=observers,
            extra=middleware_kwargs, limit_per_host=limit_per_host,
        )
        self._own = OwnAsyncSession("AsyncVLLMClient", session, driver_kwargs, limit_per_host)
        super().__init__(base_url, api_key=api_key, api_version=api_version)

    async def _send(self, request: Request) -> Answer:
        return await self._http().send(request, self.base_url + request.path, key_header(request.path, self._api_key))

    async def _run(self, plan: Plan[T]) -> T:
        """See ``VLLMClient._run``."""
        return await drive(self._steps(plan), self._perform)

    async def _pause_between_polls(self, seconds: float) -> None:
        """Wait between two refusals."""
        await asyncio.sleep(seconds)

    async def health(self) -> VLLMHealth:
        """See ``VLLMClient.health``: never raises."""
        request = calls.health().build(self.engine, None)
        return await drive(self._timed(request, answers.health_result, self._http().errors), self._send)

    # -- memory ------------------------------------------------------------------

    async def sleep(self, level: int = 1, mode: VLLMPauseMode | None = None) -> SleepResult:
        return await self._run(calls.sleep(level, mode))

    async def wake_up(self, tags: Sequence[str] | None = None) -> WakeResult:
        return await self._run(calls.wake_up(tags))

    async def is_sleeping(self) -> bool:
        return await self._run(calls.is_sleeping())

    async def release_kv_cache_memory(self) -> CommandResult:
        return await self._run(calls.release_kv_cache_memory())

    # -- generation control ----------------------------------------------------------

    async def pause(self, mode: VLLMPauseMode | None = None, clear_cache: bool | None = None) -> CommandResult:
        return await self._run(calls.pause(mode, clear_cache))

    async def resume(self) -> CommandResult:
        return await self._run(calls.resume())

    async def is_paused(self) -> bool:
        return await self._run(calls.is_paused())

    async def abort_requests(self, request_ids: Sequence[str] | None = None) -> AbortResult:
        return await self._run(calls.abort_requests(request_ids))

    # -- caches ----------------------------------------------------------------------

    async def reset_prefix_cache(
        self, reset_running_requests: bool = False, reset_external: bool = False, *, deadline_s: float | None = None, poll_s: float = 0.5
    ) -> CacheReset:
        return await self._run(calls.reset_prefix_cache(reset_running_requests, reset_external, deadline_s=deadline_s, poll_s=poll_s))

    async def reset_mm_cache(self) -> CommandResult:
        return await self._run(calls.reset_mm_cache())

    async def reset_encoder_cache(self) -> CommandResult:
        return await self._run(calls.reset_encoder_cache())

    # -- workers ---------------------------------------------------------------------

    async def collective_rpc(
        self, method: str, args: Sequence[str] = (), kwargs: Mapping[str, str] | None = None, timeout: float | None = None
    ) -> RpcResult:
        return await self._run(calls.collective_rpc(method, args, kwargs, timeout))

    async def server_info(self, config_format: Literal["text", "json"] = "text") -> dict[str, Any]:
        return await self._run(calls.server_info(config_format))

    # -- weight transfer ------------------------------------------------------------------

    async def init_weight_transfer_engine(self, init_info: Mapping[str, Any]) -> CommandResult:
        return await self._run(calls.init_weight_transfer_engine(init_info))

    async def shutdown_weight_transfer_engine(self) -> CommandResult:
        return await self._run(calls.shutdown_weight_transfer_engine())

    async def start_weight_update(self) -> CommandResult:
        return await self._run(calls.start_weight_update())

    async def start_draft_weight_update(self) -> CommandResult:
        return await self._run(calls.start_draft_weight_update())

    async def update_weights(self, update_info: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> CommandResult:
        return await self._run(calls.update_weights(update_info))

    async def finish_weight_update(self, weight_version: str | None = None) -> CommandResult:
        return await self._run(calls.finish_weight_update(weight_version))

    async def update_weight_version(self, new_version: str) -> WeightInfo:
        return await self._run(calls.update_weight_version(new_version))

    async def weight_info(self) -> WeightInfo:
        return await self._run(calls.weight_info())

    async def weight_checker(self, action: WeightCheckerAction, baseline: Mapping[str, str] | None = None) -> WeightCheck:
        return await self._run(calls.weight_checker(action, baseline))

    async def get_world_size(self, include_dp: bool = True) -> int:
        return await self._run(calls.get_world_size(include_dp))

    # -- fault tolerance ---------------------------------------------------------------------

    async def fault_tolerance_apply(
        self, instruction: FaultInstruction = "retry", params: Mapping[str, Any] | None = None
    ) -> FaultToleranceAccepted:
        return await self._run(calls.fault_tolerance_apply(instruction, params))

    async def fault_tolerance_status(self) -> FaultToleranceStatus:
        return await self._run(calls.fault_tolerance_status())

    # -- always mounted ------------------------------------------------------------------

    async def version(self) -> VLLMApi:
        return self._remember(await self._run(calls.version()))

    async def models(self) -> list[str]:
        return await self._run(calls.models())

    async def complete(
        self, prompt: str, *, max_tokens: int = 16, temperature: float = 0.0, model: str | None = None, seed: int | None = None,
        extra: Mapping[str, Any] | None = None
    ) -> CompletionResult:
        return await self._run(calls.complete(prompt, max_tokens=max_tokens, temperature=temperature, model=model, seed=seed, extra=extra))


for _name in ROUTES.keys() - {"health"}:  # each route method says what VLLMClient's says
    getattr(AsyncVLLMClient, _name).__doc__ = getattr(VLLMClient, _name).__doc__
