"""``VLLMClient``: one method per control route of vLLM 0.33.0, each with its route's policy, over requests.

How a call runs (the version asked once, a route the release lacks refused unsent, refusals asked again) is
``VLLMClientState``'s; what an answer means is ``answers.check_reply``'s. The API key goes only to the ``/v1``
routes vLLM guards with it, in a Bearer header, and nowhere else (not repr, errors, events or spans).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any, Literal, TypeVar

import requests

from resilience.adapters.driver_config import UNSET, DriverConfig, Unset
from resilience.adapters.engine_http import Answer, answer_of
from resilience.adapters.engine_session import SyncSessionOwner, mount_adapter, own_driver_kwargs
from resilience.adapters.engine_steps import drive, run_now
from resilience.adapters.requests import ResilientAdapter
from resilience.adapters.vllm import answers, calls
from resilience.adapters.vllm.answers import Plan, Request, VLLMPauseMode, WeightCheckerAction, key_header
from resilience.adapters.vllm.calls import FaultInstruction
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
from resilience.adapters.vllm.routes import VLLM_POLICIES
from resilience.adapters.vllm.state import VLLMClientState
from resilience.adapters.vllm.versions import VLLMApi
from resilience.errors import ResilienceError
from resilience.events import Observer
from resilience.policy import PolicyTable

__all__ = ["VLLMClient", "mount_vllm"]

T = TypeVar("T")


def mount_vllm(
    session: requests.Session, base_urls: Sequence[str], *, policies: PolicyTable | Unset = UNSET,
    observers: Sequence[Observer] | Unset = UNSET, config: DriverConfig | None = None, **adapter_kwargs: Any
) -> ResilientAdapter:
    """Mount one ``ResilientAdapter`` with ``VLLM_POLICIES`` (default) on ``session`` for each engine URL; returns it.

    ``config=DriverConfig(...)`` instead shares one configuration (and its per-engine breakers and budgets)
    with other drivers, and conflicts with ``policies`` and the others it holds.
    """
    return mount_adapter(
        "mount_vllm", VLLM_POLICIES, session, base_urls, policies=policies, observers=observers, config=config, extra=adapter_kwargs
    )


class VLLMClient(SyncSessionOwner, VLLMClientState):
    """A client of one vLLM server's HTTP control plane (``vllm serve`` with ``VLLM_SERVER_DEV_MODE=1``).

    ``base_url``: the server (``http://127.0.0.1:8000``). ``session``: a session to use as is (mount the adapter on it
    with ``mount_vllm``); default a new resilient session with ``policies`` (default ``VLLM_POLICIES``) and
    ``observers`` (default none); other keyword arguments (``breaker``, ``retry_budget``, ``clock``, ``pool_maxsize``,
    ...) go to its ``ResilientAdapter``, or ``config=DriverConfig(...)`` (build it with ``policies=VLLM_POLICIES``)
    shares one configuration with other drivers. With a ``session``, all of those must be left out (``ConfigConflict``
    names them). ``api_key``: vLLM's ``--api-key``, sent only to ``/v1`` routes (default None). ``api_version``: the
    server's release when known (default None = ask ``GET /version`` once). Results are typed; errors (``VLLMError`` and
    its subclasses) name the engine, endpoint, status and a body excerpt.
    """

    def __init__(
        self,
        base_url: str,
        session: requests.Session | None = None,
        api_key: str | None = None,
        policies: PolicyTable | Unset = UNSET,
        *,
        observers: Sequence[Observer] | Unset = UNSET,
        config: DriverConfig | None = None,
        api_version: str | None = None,
        **adapter_kwargs: Any,
    ) -> None:
        kwargs = own_driver_kwargs(
            "VLLMClient", VLLM_POLICIES, session=session, config=config, policies=policies, observers=observers, extra=adapter_kwargs
        )
        super().__init__(base_url, api_key=api_key, api_version=api_version)
        self._open_session(session, kwargs)

    # -- plumbing ------------------------------------------------------------

    def _send(self, request: Request) -> Answer:
        r = request.route
        headers = key_header(r.path, self._api_key)
        response = self.session.request(
            r.method, self.base_url + r.path, params=list(request.params) or None, json=request.body, headers=headers
        )
        return answer_of(r.endpoint, response)

    def _run(self, plan: Plan[T]) -> T:
        """Send ``plan`` and read its answer, by ``VLLMClientState._steps``' rules (version, weights asleep, refusals)."""
        return run_now(drive(self._steps(plan), self._perform))

    def _pause_between_polls(self, seconds: float) -> None:
        """Wait between two refusals (a method so a test can play a stalled machine)."""
        time.sleep(seconds)

    def health(self) -> VLLMHealth:
        """``GET /health``; never raises. 200 = the engine core lives (paused and asleep engines answer 200 too); 503 = dead."""
        request = calls.health().build(self.engine, None)
        return run_now(drive(self._timed(request, answers.health_result, (requests.RequestException, ResilienceError)), self._send))

    # -- memory ------------------------------------------------------------------

    def sleep(self, level: int = 1, mode: VLLMPauseMode | None = None) -> SleepResult:
        """``POST /sleep``: level 0 pauses scheduling, 1 offloads weights and drops the KV cache, 2 drops both.

        ``mode``: what happens to running requests (``abort``, ``wait``, ``keep``); None = the server's default
        (``abort``). Idempotent: a second sleep is a no-op on the executor, so it is re-sent after a timeout.
        After level 2 the weights are garbage until updated: completions still answer 200, but wrong.
        """
        return self._run(calls.sleep(level, mode))

    def wake_up(self, tags: Sequence[str] | None = None) -> WakeResult:
        """``POST /wake_up?tags=...``: None = every tag. A tag that is not asleep makes the whole call a no-op (``awake`` False).

        A full wake (no tags) also ends a pause, whoever took it; idempotent otherwise, so re-sent after a timeout.
        """
        return self._run(calls.wake_up(tags))

    def is_sleeping(self) -> bool:
        """``GET /is_sleeping``: true while asleep, and also while merely paused (vLLM reports both the same)."""
        return self._run(calls.is_sleeping())

    def release_kv_cache_memory(self) -> CommandResult:
        """``POST /release_kv_cache_memory`` (0.33.0): only after a completed pause; never re-sent (a second call answers 500)."""
        return self._run(calls.release_kv_cache_memory())

    # -- generation control ----------------------------------------------------------

    def pause(self, mode: VLLMPauseMode | None = None, clear_cache: bool | None = None) -> CommandResult:
        """``POST /pause``: ``abort`` (default) aborts running requests, ``wait`` drains them, ``keep`` freezes them.

        New requests get 503 during ``abort``/``wait`` pauses and queue during ``keep``. ``clear_cache`` None
        = the server's default (true). Idempotent (the last mode wins). Pause is one shared state.
        """
        return self._run(calls.pause(mode, clear_cache))

    def resume(self) -> CommandResult:
        """``POST /resume``: reopens scheduling for everyone, and even while asleep (no guard in 0.33.0)."""
        return self._run(calls.resume())

    def is_paused(self) -> bool:
        """``GET /is_paused``."""
        return self._run(calls.is_paused())

    def abort_requests(self, request_ids: Sequence[str] | None = None) -> AbortResult:
        """``POST /abort_requests``: abort these requests (None = all) without pausing."""
        return self._run(calls.abort_requests(request_ids))

    # -- caches ----------------------------------------------------------------------

    def reset_prefix_cache(
        self, reset_running_requests: bool = False, reset_external: bool = False, *, deadline_s: float | None = None, poll_s: float = 0.5
    ) -> CacheReset:
        """``POST /reset_prefix_cache``; a 200 ``{"success": false}`` (blocks still held) is asked again every ``poll_s``
        until ``deadline_s`` (default 30 s), then raised as ``VLLMRefused``: never returned as a success."""
        return self._run(calls.reset_prefix_cache(reset_running_requests, reset_external, deadline_s=deadline_s, poll_s=poll_s))

    def reset_mm_cache(self) -> CommandResult:
        """``POST /reset_mm_cache``."""
        return self._run(calls.reset_mm_cache())

    def reset_encoder_cache(self) -> CommandResult:
        """``POST /reset_encoder_cache``."""
        return self._run(calls.reset_encoder_cache())

    # -- workers ---------------------------------------------------------------------

    def collective_rpc(
        self, method: str, args: Sequence[str] = (), kwargs: Mapping[str, str] | None = None, timeout: float | None = None
    ) -> RpcResult:
        """``POST /collective_rpc``: run a worker method everywhere (string arguments only). Never re-sent once it may have arrived."""
        return self._run(calls.collective_rpc(method, args, kwargs, timeout))

    def server_info(self, config_format: Literal["text", "json"] = "text") -> dict[str, Any]:
        """``GET /server_info``: the config and environment dump."""
        return self._run(calls.server_info(config_format))

    # -- weight transfer ------------------------------------------------------------------

    def init_weight_transfer_engine(self, init_info: Mapping[str, Any]) -> CommandResult:
        """``POST /init_weight_transfer_engine`` (once per trainer connection). Never re-sent once it may have arrived."""
        return self._run(calls.init_weight_transfer_engine(init_info))

    def shutdown_weight_transfer_engine(self) -> CommandResult:
        """``POST /shutdown_weight_transfer_engine`` (0.33.0)."""
        return self._run(calls.shutdown_weight_transfer_engine())

    def start_weight_update(self) -> CommandResult:
        """``POST /start_weight_update`` (0.23.0+): opens the update session. Never re-sent once it may have arrived."""
        return self._run(calls.start_weight_update())

    def start_draft_weight_update(self) -> CommandResult:
        """``POST /start_draft_weight_update`` (0.33.0)."""
        return self._run(calls.start_draft_weight_update())

    def update_weights(self, update_info: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> CommandResult:
        """``POST /update_weights``: one chunk. **Never re-sent once it may have arrived**; ask ``weight_info`` instead."""
        return self._run(calls.update_weights(update_info))

    def finish_weight_update(self, weight_version: str | None = None) -> CommandResult:
        """``POST /finish_weight_update``: closes the session and sets the reported version. Never re-sent once it may have arrived."""
        return self._run(calls.finish_weight_update(weight_version))

    def update_weight_version(self, new_version: str) -> WeightInfo:
        """``POST /update_weight_version`` (0.27.0+): set the version ``weight_info`` reports."""
        return self._run(calls.update_weight_version(new_version))

    def weight_info(self) -> WeightInfo:
        """``GET /weight_info`` (0.27.0+): the weight version the engine reports."""
        return self._run(calls.weight_info())

    def weight_checker(self, action: WeightCheckerAction, baseline: Mapping[str, str] | None = None) -> WeightCheck:
        """``POST /weight_checker`` (0.33.0): ``checksum``, ``compare`` with ``baseline``, or ``reset`` (zeroes the weights)."""
        return self._run(calls.weight_checker(action, baseline))

    def get_world_size(self, include_dp: bool = True) -> int:
        """``GET /get_world_size``."""
        return self._run(calls.get_world_size(include_dp))

    # -- fault tolerance ---------------------------------------------------------------------

    def fault_tolerance_apply(
        self, instruction: FaultInstruction = "retry", params: Mapping[str, Any] | None = None
    ) -> FaultToleranceAccepted:
        """``POST /fault_tolerance/apply`` (0.33.0, with ``--enable-fault-tolerance``): answered 202 at once, the recovery after.

        ``instruction``: ``retry`` (the only one 0.33.0 takes) recovers an engine whose busy loop raised and waits
        (``unhealthy``); poll ``fault_tolerance_status`` for the outcome. Never re-sent once it may have arrived.
        """
        return self._run(calls.fault_tolerance_apply(instruction, params))

    def fault_tolerance_status(self) -> FaultToleranceStatus:
        """``GET /fault_tolerance/status`` (0.33.0, with ``--enable-fault-tolerance``): each engine core's state."""
        return self._run(calls.fault_tolerance_status())

    # -- always mounted ------------------------------------------------------------------

    def version(self) -> VLLMApi:
        """``GET /version``: the server's release, kept as the API every later request is built for."""
        return self._remember(self._run(calls.version()))

    def models(self) -> list[str]:
        """``GET /v1/models``: the served model ids."""
        return self._run(calls.models())

    def complete(
        self, prompt: str, *, max_tokens: int = 16, temperature: float = 0.0, model: str | None = None, seed: int | None = None,
        extra: Mapping[str, Any] | None = None
    ) -> CompletionResult:
        """``POST /v1/completions`` (greedy by default), for tests and canaries. Never re-sent once it may have arrived."""
        return self._run(calls.complete(prompt, max_tokens=max_tokens, temperature=temperature, model=model, seed=seed, extra=extra))
