"""``SGLangClient``: one method per SGLang control endpoint, each with its policy (``SGLANG_POLICIES``), over requests.

Keys follow SGLang's auth levels (``utils/auth.py``): admin routes get the admin key when one is given, else the API
key; other routes the API key; ``/health*``, ``/ready*`` and ``/metrics*`` none. A key goes in a Bearer header and
nowhere else (not repr, errors, events, spans or metrics); a 401/403 is never retried and names the key refused.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import requests

from resilience.adapters.driver_config import UNSET, DriverConfig, Unset
from resilience.adapters.engine_http import Answer, answer_of
from resilience.adapters.engine_session import SyncSessionOwner, mount_adapter
from resilience.adapters.engine_steps import drive, run_now
from resilience.adapters.requests import ResilientAdapter
from resilience.adapters.sglang import calls
from resilience.adapters.sglang.calls import Call, auth_headers, raise_if_refused
from resilience.adapters.sglang.policies import SGLANG_POLICIES
from resilience.adapters.sglang.results import ControlResult, FlushResult, GenerateResult, Health, ModelInfo, WeightUpdateResult
from resilience.adapters.sglang.state import SGLangClientState
from resilience.engine_contract import MemoryProbe, PauseMode
from resilience.errors import ResilienceError
from resilience.events import Observer
from resilience.policy import PolicyTable

__all__ = ["SGLangClient", "mount_sglang"]


def mount_sglang(
    session: requests.Session, base_urls: Sequence[str], *, policies: PolicyTable | Unset = UNSET,
    observers: Sequence[Observer] | Unset = UNSET, config: DriverConfig | None = None, **adapter_kwargs: Any
) -> ResilientAdapter:
    """Mount one ``ResilientAdapter`` with SGLang policies on ``session`` for each engine URL; returns it.

    Existing code keeps its session and its calls; only the transport changes. ``policies`` defaults to
    ``SGLANG_POLICIES``; ``config=DriverConfig(...)`` instead shares one configuration (and its per-engine breakers and
    budgets) with other drivers, and conflicts with ``policies`` and the others it holds.
    """
    return mount_adapter(
        "mount_sglang", SGLANG_POLICIES, session, base_urls, policies=policies, observers=observers, config=config, extra=adapter_kwargs
    )


class SGLangClient(SyncSessionOwner, SGLangClientState):
    """A client of one SGLang engine's HTTP control plane; results are typed, errors name engine, endpoint, status
    and a body excerpt and carry the call's delivery record (``resilience.outcome.attempts_of``).

    ``base_url``: the engine (``http://127.0.0.1:30000``). ``session``: a session used as is (mount the adapter on it
    with ``mount_sglang``); default a new resilient session. ``api_key``: SGLang's ``--api-key``, sent to normal
    routes, and to admin routes when no ``admin_api_key`` is given (default None). ``admin_api_key``: SGLang's
    ``--admin-api-key``, sent to admin routes (pause, continue, flush, abort, release, resume, weight updates)
    (default None). ``flush_deadline_s``: how long ``flush_cache`` waits for the engine to become idle (default
    120 s, capped by any Deadline in context); ``flush_poll_s``: the pause between "not idle" answers (default 0.5 s).

    The own session: ``policies`` (default ``SGLANG_POLICIES``), ``observers`` (default none) and other keyword
    arguments (``breaker``, ``retry_budget``, ``clock``, ``pool_maxsize``, ...) go to its ``ResilientAdapter``; or
    ``config=DriverConfig(...)`` (build it with ``policies=SGLANG_POLICIES``) shares one configuration and its
    per-engine breakers and budgets with other clients and drivers. ``memory_probe``: a
    ``resilience.engine_contract.MemoryProbe`` its release and resume entries ask before re-sending after a gateway
    status or an ambiguous failure (``sglang_policies(memory_probe=...)``: a call it proves applied returns as
    applied, ``ControlResult.confirmed_by_probe``); default None. With ``config=``, a copy of the config whose
    policies ask the probe is used (``engine_session.probed_config``: same breakers and budgets, still shared). With
    a ``session``, all of those must be left out (``ConfigConflict`` names them): mount
    ``with_memory_probe(policies, probe)`` on your session instead.

    A control call whose every attempt got a gateway status is followed by ``GET /model_info`` within what is left of
    its deadline; when that fails too the call raises ``resilience.engine_contract.EngineDied`` (``.attempts`` = the
    call's record, caused by the ``SGLangError`` it would have raised).
    """

    def __init__(
        self,
        base_url: str,
        session: requests.Session | None = None,
        api_key: str | None = None,
        policies: PolicyTable | Unset = UNSET,
        *,
        admin_api_key: str | None = None,
        observers: Sequence[Observer] | Unset = UNSET,
        flush_deadline_s: float = 120.0,
        flush_poll_s: float = 0.5,
        config: DriverConfig | None = None,
        memory_probe: MemoryProbe | None = None,
        **adapter_kwargs: Any,
    ) -> None:
        kwargs = self._own_kwargs(session, config, policies, observers, adapter_kwargs, memory_probe)
        super().__init__(
            base_url, api_key=api_key, admin_api_key=admin_api_key, flush_deadline_s=flush_deadline_s, flush_poll_s=flush_poll_s
        )
        self._open_session(session, kwargs)

    # -- plumbing ------------------------------------------------------------

    def _send(self, call: Call) -> Answer:
        """``call`` with the checks before and after it (``SGLangClientState._call_steps``): a 401/403 raises
        ``SGLangAuthError``, a dead engine behind a proxy ``EngineDied``."""
        return run_now(drive(self._call_steps(call), self._exchange))

    def _exchange(self, call: Call, stream: bool = False) -> Any:
        """One exchange of ``call`` over the session, with the key its route needs: the answer (the response, streamed)."""
        headers = auth_headers(self._key_for(call.path)[1])
        url = self.base_url + call.path
        response = self.session.request(call.method, url, json=call.body, params=call.params, headers=headers, stream=stream)
        return response if stream else answer_of(call.endpoint, response)

    def _transport_errors(self) -> tuple[type[BaseException], ...]:
        return (requests.RequestException, ResilienceError, OSError)  # SGLangError is a RequestException

    def _weights(self, path: str, **fields: Any) -> WeightUpdateResult:
        """A weight call: ``POST path`` with ``fields`` (a None one left out), its answer read by ``calls.weights_result``."""
        return calls.weights_result(self.engine, self._send(calls.post(path, **fields)))

    # -- generation control --------------------------------------------------

    def pause_generation(self, mode: PauseMode = "abort") -> ControlResult:
        """Pause admission. ``abort`` answers in-flight requests as aborted; ``retract`` re-queues them; ``in_place`` keeps their KV."""
        result = calls.control_result(self.engine, self._send(calls.pause_call(mode)))
        self._note_paused(mode)
        return result

    def continue_generation(self, torch_empty_cache: bool = True) -> ControlResult:
        """Reopen admission. SGLang's pause is one flag: the first continue wins (the orchestrator owns holds)."""
        result = calls.control_result(self.engine, self._send(calls.continue_call(torch_empty_cache)))
        self._note_paused(None)
        return result

    def flush_cache(self, deadline_s: float | None = None, *, wait_for_idle: bool | None = None) -> FlushResult:
        """Flush the radix cache, asking again on "not idle" answers until ``deadline_s`` (default ``flush_deadline_s``).

        ``wait_for_idle``: pass the remaining time as SGLang's ``?timeout=`` so the engine itself waits to be idle. None
        (default) = only when this client has not paused the engine. On a paused engine SGLang's timed wait
        (``flush_wrapper.py``) counts re-queued requests as work that never drains while paused, so after a ``retract``
        pause it can only answer "Timed out waiting for idle state."; ``?timeout=0`` flushes at once, ignoring the
        waiting queue as the release that follows does (``scheduler.py``, ``flush_cache``).
        """
        return run_now(drive(self._flush_steps(deadline_s, wait_for_idle), self._perform))

    def _pause_between_polls(self, seconds: float) -> None:
        """Wait between "not idle" answers of ``flush_cache`` (a method so a test can play a stalled machine)."""
        time.sleep(seconds)

    def abort_request(self, rid: str | None = None, abort_all: bool = False) -> ControlResult:
        """Abort requests whose rid starts with ``rid``, or all of them."""
        return calls.control_result(self.engine, self._send(calls.abort_call(rid, abort_all)))

    # -- memory occupation ---------------------------------------------------

    def release_memory_occupation(self, tags: Sequence[str] | None = None) -> ControlResult:
        """Release GPU memory for ``tags`` (None = kv_cache, weights and cuda_graph). Not re-sent once it may have been applied."""
        result = calls.control_result(self.engine, self._send(calls.memory_call("/release_memory_occupation", tags)))
        self._note_released(tags)
        return result

    def resume_memory_occupation(self, tags: Sequence[str] | None = None) -> ControlResult:
        """Re-occupy memory for ``tags`` (None = all three). Not re-sent once it may have been applied."""
        self._note_resumed(tags)  # once a resume may be on its way, "released" is no longer known: refuse nothing on it
        return calls.control_result(self.engine, self._send(calls.memory_call("/resume_memory_occupation", tags)))

    # -- weights ---------------------------------------------------------------

    def begin_weight_update(self, selector: str = "all") -> WeightUpdateResult:
        """Open a weight-update session (SGLang 0.5.23); 400 when one is already open."""
        return self._weights("/begin_weight_update", selector=selector)

    def end_weight_update(self) -> WeightUpdateResult:
        """Close the weight-update session; 400 when none is open."""
        return self._weights("/end_weight_update")

    def update_weights_from_tensor(
        self, serialized_named_tensors: Sequence[str], *, load_format: str | None = None, flush_cache: bool = True,
        abort_all_requests: bool = False, weight_version: str | None = None
    ) -> WeightUpdateResult:
        """Load weights from serialized tensors (inside a begin/end session in 0.5.23)."""
        return self._weights(
            "/update_weights_from_tensor", serialized_named_tensors=list(serialized_named_tensors), flush_cache=flush_cache,
            abort_all_requests=abort_all_requests, load_format=load_format, weight_version=weight_version,
        )

    def update_weights_from_distributed(
        self, names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]], *, group_name: str = "weight_update_group",
        flush_cache: bool = True, weight_version: str | None = None
    ) -> WeightUpdateResult:
        """Receive weights over the distributed group set up by ``init_weights_update_group``."""
        return self._weights(
            "/update_weights_from_distributed", names=list(names), dtypes=list(dtypes), shapes=[list(s) for s in shapes],
            group_name=group_name, flush_cache=flush_cache, weight_version=weight_version,
        )

    def update_weights_from_disk(
        self, model_path: str, *, flush_cache: bool = True, weight_version: str | None = None, load_format: str | None = None
    ) -> WeightUpdateResult:
        """Load weights from a checkpoint path on the engine's machine."""
        fields = {"flush_cache": flush_cache, "weight_version": weight_version, "load_format": load_format}
        return self._weights("/update_weights_from_disk", model_path=model_path, **fields)

    def update_weight_version(self, new_version: str, abort_all_requests: bool = False) -> WeightUpdateResult:
        """Set the weight version reported by ``/model_info`` and in generation meta_info.

        ``abort_all_requests``: abort every running request first. SGLang's own default is true
        (0.5.23 ``srt/managers/io_struct.py`` l.2155-2159 ``UpdateWeightVersionReqInput.abort_all_requests: bool = True``,
        acted on in ``srt/entrypoints/http_server.py`` l.1533-1534), which aborted ~65 requests per update in
        miles #2589; this client sends false unless you ask (default False).
        """
        return self._weights("/update_weight_version", new_version=new_version, abort_all_requests=abort_all_requests)

    def init_weights_update_group(
        self, master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str = "weight_update_group",
        backend: str = "nccl"
    ) -> WeightUpdateResult:
        """Join the trainer's process group for distributed weight updates."""
        fields = {"master_address": master_address, "master_port": master_port, "rank_offset": rank_offset, "world_size": world_size}
        return self._weights("/init_weights_update_group", **fields, group_name=group_name, backend=backend)

    # -- reads -----------------------------------------------------------------

    def health(self) -> Health:
        """``/health``. An engine this client paused reports ``paused_by_us`` at once (its /health would hang ~20 s, then 503)."""
        return run_now(drive(self._health_steps("/health", (requests.RequestException,)), self._send))

    def health_generate(self) -> Health:
        """``/health_generate`` (runs a one-token generation), with the same paused-by-us rule."""
        return run_now(drive(self._health_steps("/health_generate", (requests.RequestException,)), self._send))

    def ready(self) -> bool:
        """``/ready``: True only when serving and not paused."""
        return self._send(calls.read_call("/ready")).status == 200

    def server_info(self) -> dict[str, Any]:
        """``/server_info``: server args, internal states, version."""
        return calls.json_object(self.engine, self._send(calls.read_call("/server_info")))

    def model_info(self) -> ModelInfo:
        """``/model_info``, including the weight version (``/get_weight_version`` is gone in 0.5.23)."""
        return calls.model_info_result(self.engine, self._send(calls.read_call("/model_info")))

    def loads(self) -> dict[str, Any]:
        """``/v1/loads?include=core``: per-rank running and waiting requests."""
        return calls.loads_result(self.engine, self._send(calls.read_call("/v1/loads")))

    def models(self) -> list[str]:
        """``/v1/models``: the served model ids."""
        return calls.models_result(self.engine, self._send(calls.read_call("/v1/models")))

    # -- generation --------------------------------------------------------------

    def generate(
        self, text: str | None = None, *, input_ids: Sequence[int] | None = None, sampling_params: Mapping[str, Any] | None = None,
        rid: str | None = None
    ) -> GenerateResult:
        """``/generate`` (never re-sent once it may have reached the engine). Aborted requests come back with ``aborted``."""
        call = calls.generate_call(text, input_ids, sampling_params, rid, stream=False)
        return calls.generate_result(self.engine, self._send(call))

    def generate_stream(
        self, text: str | None = None, *, input_ids: Sequence[int] | None = None, sampling_params: Mapping[str, Any] | None = None,
        rid: str | None = None
    ) -> Iterator[GenerateResult]:
        """Streaming ``/generate``: yields the cumulative result of each SSE chunk until ``[DONE]``."""
        call = calls.generate_call(text, input_ids, sampling_params, rid, stream=True)
        with self._exchange(call, stream=True) as response:
            if not response.ok:
                answer = answer_of(call.endpoint, response)
                calls.require_ok(self.engine, raise_if_refused(self.engine, answer, self._key_for(call.path)[0]))
            for line in response.iter_lines(decode_unicode=True):
                item = calls.sse_line(self.engine, call.endpoint, line, getattr(response, "attempts", ()))
                if item is calls.StreamEnd.DONE:
                    return
                if item is not None:
                    yield item
