"""``AsyncSGLangClient``: ``SGLangClient`` with coroutine methods, for controllers that run an event loop.

Same endpoints, policies, results, errors, key rules and ``flush_cache`` semantics as ``SGLangClient`` (both build
their requests and read the answers with ``resilience.adapters.sglang.calls``); it satisfies
``resilience.engine_contract.AsyncControlPlaneEngine``. Its own session is aiohttp because aiohttp measured fastest at
fan-out scale: for a five-phase barrier with 50 ms per call, ``asyncio.gather`` over raw aiohttp took 1.08x / 1.41x /
2.49x the 5 x latency floor at 8 / 64 / 256 engines, raw ``httpx.AsyncClient`` 1.40x at 8, 7.3x at 64, and failed
with ``ReadError`` at 256 (issue 12).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from resilience.adapters.driver_config import UNSET, DriverConfig, Unset
from resilience.adapters.engine_http import DEFAULT_LIMIT_PER_HOST, Answer, AsyncSessionOwner, OwnAsyncSession
from resilience.adapters.engine_steps import drive
from resilience.adapters.sglang import calls
from resilience.adapters.sglang.calls import Call, auth_headers, raise_if_refused
from resilience.adapters.sglang.results import (
    ControlResult,
    FlushResult,
    GenerateResult,
    Health,
    ModelInfo,
    SGLangError,
    WeightUpdateResult,
)
from resilience.adapters.sglang.state import SGLangClientState
from resilience.engine_contract import MemoryProbe, PauseMode
from resilience.events import Observer
from resilience.policy import PolicyTable

if TYPE_CHECKING:
    import aiohttp
    import httpx

__all__ = ["AsyncSGLangClient"]


class AsyncSGLangClient(AsyncSessionOwner, SGLangClientState):
    """A client of one SGLang engine's HTTP control plane, with ``async`` methods; the arguments are ``SGLangClient``'s.

    ``session``: an ``aiohttp.ClientSession`` or ``httpx.AsyncClient`` used as is, never closed, with your resilience
    layer on it (``aiohttp.ClientSession(middlewares=(ResilientMiddleware(SGLANG_POLICIES),))`` or
    ``httpx.AsyncClient(transport=AsyncResilientTransport(SGLANG_POLICIES))``; without it each call is sent once);
    default None = the client's own aiohttp session with ``ResilientMiddleware`` (other keyword arguments go to it),
    opened on first use in the running loop. ``limit_per_host``: the own session's pool size (default
    ``DEFAULT_LIMIT_PER_HOST`` = 100; calls beyond it wait for a connection); with ``session=`` it is refused as the
    other own-session settings are (``ConfigConflict``).

    Close the own session with ``await client.aclose()`` or ``async with``; the next call opens a new one (in
    whichever loop runs it then). The own session belongs to the loop that opened it: a call from another loop while
    that one is open raises RuntimeError; once that loop is closed, a new session is opened. Errors raised over the
    own aiohttp session carry no ``response`` (aiohttp's cannot be pickled, and errors travel pickled, as to Ray); the
    status and a body excerpt are on the error itself.
    """

    def __init__(
        self,
        base_url: str,
        session: aiohttp.ClientSession | httpx.AsyncClient | None = None,
        api_key: str | None = None,
        policies: PolicyTable | Unset = UNSET,
        *,
        admin_api_key: str | None = None,
        observers: Sequence[Observer] | Unset = UNSET,
        flush_deadline_s: float = 120.0,
        flush_poll_s: float = 0.5,
        limit_per_host: int = DEFAULT_LIMIT_PER_HOST,
        config: DriverConfig | None = None,
        memory_probe: MemoryProbe | None = None,
        **middleware_kwargs: Any,
    ) -> None:
        driver_kwargs = self._own_kwargs(session, config, policies, observers, middleware_kwargs, memory_probe, limit_per_host)
        self._own = OwnAsyncSession("AsyncSGLangClient", session, driver_kwargs, limit_per_host)
        super().__init__(
            base_url, api_key=api_key, admin_api_key=admin_api_key, flush_deadline_s=flush_deadline_s, flush_poll_s=flush_poll_s
        )

    async def _send(self, call: Call) -> Answer:
        """As ``SGLangClient._send``: the checks before and after the call (``SGLangClientState._call_steps``)."""
        return await drive(self._call_steps(call), self._exchange)

    async def _exchange(self, call: Call) -> Answer:
        """One exchange of ``call`` over the session, with the key its route needs."""
        return await self._own.requester(self).send(call, self.base_url + call.path, auth_headers(self._key_for(call.path)[1]))

    def _transport_errors(self) -> tuple[type[BaseException], ...]:
        return (*self._http().errors, SGLangError, OSError)  # errors: ResilienceError too

    async def _weights(self, path: str, **fields: Any) -> WeightUpdateResult:
        """A weight call: ``POST path`` with ``fields`` (a None one left out), its answer read by ``calls.weights_result``."""
        return calls.weights_result(self.engine, await self._send(calls.post(path, **fields)))

    # -- generation control --------------------------------------------------

    async def pause_generation(self, mode: PauseMode = "abort") -> ControlResult:
        """Pause admission. ``abort`` answers in-flight requests as aborted; ``retract`` re-queues them; ``in_place`` keeps their KV."""
        result = calls.control_result(self.engine, await self._send(calls.pause_call(mode)))
        self._note_paused(mode)
        return result

    async def continue_generation(self, torch_empty_cache: bool = True) -> ControlResult:
        """Reopen admission. SGLang's pause is one flag: the first continue wins (the orchestrator owns holds)."""
        result = calls.control_result(self.engine, await self._send(calls.continue_call(torch_empty_cache)))
        self._note_paused(None)
        return result

    async def flush_cache(self, deadline_s: float | None = None, *, wait_for_idle: bool | None = None) -> FlushResult:
        """Flush the radix cache, asking again on "not idle" answers until ``deadline_s`` (default ``flush_deadline_s``).

        ``wait_for_idle``: as in ``SGLangClient.flush_cache`` (by default ``?timeout=0`` after this client's own pause).
        """
        return await drive(self._flush_steps(deadline_s, wait_for_idle), self._perform)

    async def _pause_between_polls(self, seconds: float) -> None:
        """Wait between "not idle" answers of ``flush_cache`` (a method so a test can play a stalled loop)."""
        await asyncio.sleep(seconds)

    async def abort_request(self, rid: str | None = None, abort_all: bool = False) -> ControlResult:
        """Abort requests whose rid starts with ``rid``, or all of them."""
        return calls.control_result(self.engine, await self._send(calls.abort_call(rid, abort_all)))

    # -- memory occupation ---------------------------------------------------

    async def release_memory_occupation(self, tags: Sequence[str] | None = None) -> ControlResult:
        """Release GPU memory for ``tags`` (None = kv_cache, weights and cuda_graph). Not re-sent once it may have been applied."""
        result = calls.control_result(self.engine, await self._send(calls.memory_call("/release_memory_occupation", tags)))
        self._note_released(tags)
        return result

    async def resume_memory_occupation(self, tags: Sequence[str] | None = None) -> ControlResult:
        """Re-occupy memory for ``tags`` (None = all three). Not re-sent once it may have been applied."""
        self._note_resumed(tags)  # once a resume may be on its way, "released" is no longer known: refuse nothing on it
        return calls.control_result(self.engine, await self._send(calls.memory_call("/resume_memory_occupation", tags)))

    # -- weights ---------------------------------------------------------------

    async def begin_weight_update(self, selector: str = "all") -> WeightUpdateResult:
        """Open a weight-update session (SGLang 0.5.23); 400 when one is already open."""
        return await self._weights("/begin_weight_update", selector=selector)

    async def end_weight_update(self) -> WeightUpdateResult:
        """Close the weight-update session; 400 when none is open."""
        return await self._weights("/end_weight_update")

    async def update_weights_from_tensor(
        self, serialized_named_tensors: Sequence[str], *, load_format: str | None = None, flush_cache: bool = True,
        abort_all_requests: bool = False, weight_version: str | None = None
    ) -> WeightUpdateResult:
        """Load weights from serialized tensors (inside a begin/end session in 0.5.23)."""
        return await self._weights(
            "/update_weights_from_tensor", serialized_named_tensors=list(serialized_named_tensors), flush_cache=flush_cache,
            abort_all_requests=abort_all_requests, load_format=load_format, weight_version=weight_version,
        )

    async def update_weights_from_distributed(
        self, names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]], *, group_name: str = "weight_update_group",
        flush_cache: bool = True, weight_version: str | None = None
    ) -> WeightUpdateResult:
        """Receive weights over the distributed group set up by ``init_weights_update_group``."""
        return await self._weights(
            "/update_weights_from_distributed", names=list(names), dtypes=list(dtypes), shapes=[list(s) for s in shapes],
            group_name=group_name, flush_cache=flush_cache, weight_version=weight_version,
        )

    async def update_weights_from_disk(
        self, model_path: str, *, flush_cache: bool = True, weight_version: str | None = None, load_format: str | None = None
    ) -> WeightUpdateResult:
        """Load weights from a checkpoint path on the engine's machine."""
        fields = {"flush_cache": flush_cache, "weight_version": weight_version, "load_format": load_format}
        return await self._weights("/update_weights_from_disk", model_path=model_path, **fields)

    async def update_weight_version(self, new_version: str, abort_all_requests: bool = False) -> WeightUpdateResult:
        """Set the weight version reported by ``/model_info`` and in generation meta_info.

        ``abort_all_requests``: as in ``SGLangClient.update_weight_version`` (default False, where SGLang's own is true).
        """
        return await self._weights("/update_weight_version", new_version=new_version, abort_all_requests=abort_all_requests)

    async def init_weights_update_group(
        self, master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str = "weight_update_group",
        backend: str = "nccl"
    ) -> WeightUpdateResult:
        """Join the trainer's process group for distributed weight updates."""
        fields = {"master_address": master_address, "master_port": master_port, "rank_offset": rank_offset, "world_size": world_size}
        return await self._weights("/init_weights_update_group", **fields, group_name=group_name, backend=backend)

    # -- reads -----------------------------------------------------------------

    async def health(self) -> Health:
        """``/health``. An engine this client paused reports ``paused_by_us`` at once (its /health would hang ~20 s, then 503)."""
        return await drive(self._health_steps("/health", self._http().errors), self._send)

    async def health_generate(self) -> Health:
        """``/health_generate`` (runs a one-token generation), with the same paused-by-us rule."""
        return await drive(self._health_steps("/health_generate", self._http().errors), self._send)

    async def ready(self) -> bool:
        """``/ready``: True only when serving and not paused."""
        return (await self._send(calls.read_call("/ready"))).status == 200

    async def server_info(self) -> dict[str, Any]:
        """``/server_info``: server args, internal states, version."""
        return calls.json_object(self.engine, await self._send(calls.read_call("/server_info")))

    async def model_info(self) -> ModelInfo:
        """``/model_info``, including the weight version (``/get_weight_version`` is gone in 0.5.23)."""
        return calls.model_info_result(self.engine, await self._send(calls.read_call("/model_info")))

    async def loads(self) -> dict[str, Any]:
        """``/v1/loads?include=core``: per-rank running and waiting requests."""
        return calls.loads_result(self.engine, await self._send(calls.read_call("/v1/loads")))

    async def models(self) -> list[str]:
        """``/v1/models``: the served model ids."""
        return calls.models_result(self.engine, await self._send(calls.read_call("/v1/models")))

    # -- generation --------------------------------------------------------------

    async def generate(
        self, text: str | None = None, *, input_ids: Sequence[int] | None = None, sampling_params: Mapping[str, Any] | None = None,
        rid: str | None = None
    ) -> GenerateResult:
        """``/generate`` (never re-sent once it may have reached the engine). Aborted requests come back with ``aborted``."""
        call = calls.generate_call(text, input_ids, sampling_params, rid, stream=False)
        return calls.generate_result(self.engine, await self._send(call))

    async def generate_stream(
        self, text: str | None = None, *, input_ids: Sequence[int] | None = None, sampling_params: Mapping[str, Any] | None = None,
        rid: str | None = None
    ) -> AsyncIterator[GenerateResult]:
        """Streaming ``/generate``: yields the cumulative result of each SSE chunk until ``[DONE]``.

        Leaving the loop early leaves the response open until the iterator is
        closed: wrap it in ``contextlib.aclosing`` to close it at once.
        """
        call = calls.generate_call(text, input_ids, sampling_params, rid, stream=True)
        key_name, key = self._key_for(call.path)
        async with self._http().stream(call, self.base_url + call.path, auth_headers(key)) as reply:
            if reply.status >= 400:
                answer = Answer(call.endpoint, reply.status, await reply.text(), reply.records, reply.response)
                calls.require_ok(self.engine, raise_if_refused(self.engine, answer, key_name))
            async for line in reply.lines():
                item = calls.sse_line(self.engine, call.endpoint, line, reply.records)
                if item is calls.StreamEnd.DONE:
                    return
                if item is not None:
                    yield item
