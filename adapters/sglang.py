"""``SGLangClient``: one method per SGLang control endpoint, each with the right policy.

Every call goes through a session with a ``ResilientAdapter`` mounted with
``SGLANG_POLICIES`` (or the session you pass: use ``mount_sglang`` to add the
adapter to a session your code already uses). Results are typed; errors name
the engine, endpoint, status and a short body excerpt. Keys follow SGLang's auth
levels (``utils/auth.py``): admin routes get the admin key when one is given, else
the API key; other routes get the API key; ``/health*``, ``/ready*`` and ``/metrics*``
get none. A key goes in a Bearer header and nowhere else (not in repr, errors,
events, spans or metrics); a 401/403 is never retried and the error says which key
was refused.
"""

from __future__ import annotations

import json as jsonlib
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import requests

from resilience.adapters.requests import ResilientAdapter, engine_of, resilient_session
from resilience.adapters.sglang_policies import SGLANG_ADMIN_PATHS, SGLANG_OPEN_PREFIXES, SGLANG_POLICIES
from resilience.adapters.sglang_types import (
    ControlResult,
    FlushResult,
    GenerateResult,
    Health,
    ModelInfo,
    SGLangAppliedButRefused,
    SGLangAuthError,
    SGLangError,
    SGLangProtocolError,
    WeightUpdateResult,
)
from resilience.barrier.engine import ALL_TAGS, PauseMode
from resilience.deadline import Deadline
from resilience.events import Observer
from resilience.policy import PolicyTable

__all__ = [
    "ALL_TAGS",
    "ControlResult",
    "FlushResult",
    "GenerateResult",
    "Health",
    "ModelInfo",
    "PauseMode",
    "SGLANG_POLICIES",
    "SGLangAppliedButRefused",
    "SGLangAuthError",
    "SGLangClient",
    "SGLangError",
    "SGLangProtocolError",
    "WeightUpdateResult",
    "mount_sglang",
]


_NOT_IDLE = ("Timed out waiting for idle state", "Flush cache failed", "Another flush_cache is already in progress")
_APPLIED_NOT_FLUSHED = "Weights were updated, but the cache was not flushed"


def mount_sglang(
    session: requests.Session,
    base_urls: Sequence[str],
    *,
    policies: PolicyTable = SGLANG_POLICIES,
    observers: Sequence[Observer] = (),
    **adapter_kwargs: Any,
) -> ResilientAdapter:
    """Mount one ``ResilientAdapter`` with SGLang policies on ``session`` for each engine URL; returns it.

    Existing code keeps its session and its calls; only the transport changes.
    """
    adapter = ResilientAdapter(policies, observers=observers, **adapter_kwargs)
    for url in base_urls:
        session.mount(url.rstrip("/") + "/", adapter)
    return adapter


class SGLangClient:
    """A client of one SGLang engine's HTTP control plane.

    ``base_url``: the engine (``http://127.0.0.1:30000``). ``session``: a
    session to use as is (mount the adapter on it with ``mount_sglang``);
    default a new resilient session with ``policies`` and ``observers``.
    ``api_key``: SGLang's ``--api-key``, sent as ``Authorization: Bearer`` to normal
    routes, and to admin routes when no ``admin_api_key`` is given (default None).
    ``admin_api_key``: SGLang's ``--admin-api-key``, sent to admin routes (pause,
    continue, flush, abort, release, resume, weight updates) (default None).
    ``flush_deadline_s``: how long ``flush_cache`` waits for the engine to
    become idle (default 120 s, capped by any Deadline in context);
    ``flush_poll_s``: the pause between "not idle" answers (default 0.5 s).
    Other keyword arguments go to ``ResilientAdapter`` (``breaker``,
    ``retry_budget``, ``clock``).
    """

    def __init__(
        self,
        base_url: str,
        session: requests.Session | None = None,
        api_key: str | None = None,
        policies: PolicyTable = SGLANG_POLICIES,
        *,
        admin_api_key: str | None = None,
        observers: Sequence[Observer] = (),
        flush_deadline_s: float = 120.0,
        flush_poll_s: float = 0.5,
        **adapter_kwargs: Any,
    ) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"SGLangClient base_url must start with http:// or https://, but was {base_url!r}")
        self.base_url = base_url.rstrip("/")
        self.engine = engine_of(self.base_url)[0]
        self._owns_session = session is None
        self.session = session if session is not None else resilient_session(policies, observers=observers, **adapter_kwargs)
        self._api_key = api_key
        self._admin_api_key = admin_api_key
        self.flush_deadline_s = flush_deadline_s
        self.flush_poll_s = flush_poll_s
        self._lock = threading.Lock()
        self._paused_mode: str | None = None
        self._released: set[str] = set()

    def __repr__(self) -> str:
        keys = (", api_key=***" if self._api_key else "") + (", admin_api_key=***" if self._admin_api_key else "")
        return f"SGLangClient({self.base_url!r}{keys})"

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        del state["_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def close(self) -> None:
        """Close the session if this client created it."""
        if self._owns_session:
            self.session.close()

    def __enter__(self) -> SGLangClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- state this client knows -------------------------------------------

    @property
    def paused_mode(self) -> str | None:
        """The mode of the pause this client sent and has not continued, or None."""
        return self._paused_mode

    @property
    def released_tags(self) -> frozenset[str]:
        """Tags this client released and has not resumed (SGLang itself cannot tell)."""
        with self._lock:
            return frozenset(self._released)

    # -- plumbing ------------------------------------------------------------

    def _request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        params: Mapping[str, str] | None = None,
        stream: bool = False,
        timeout: float | None = None,
    ) -> requests.Response:
        key_name, key = self._key_for(path)
        headers = {"Authorization": f"Bearer {key}"} if key else None
        response = self.session.request(
            method, self.base_url + path, json=json, params=params, headers=headers, stream=stream, timeout=timeout
        )
        if response.status_code in (401, 403):
            raise SGLangAuthError(self.engine, f"{method} {path}", response.status_code, response.text, key=key_name, response=response)
        return response

    def _key_for(self, path: str) -> tuple[str | None, str | None]:
        """The key this route's SGLang auth level asks for, as (name, key); (None, None) = send none."""
        if path.startswith(SGLANG_OPEN_PREFIXES):
            return None, None
        if path in SGLANG_ADMIN_PATHS and self._admin_api_key:
            return "admin_api_key", self._admin_api_key
        if self._api_key:
            return "api_key", self._api_key
        return None, None

    def _ok(self, response: requests.Response, endpoint: str) -> requests.Response:
        if not response.ok:
            raise SGLangError(self.engine, endpoint, response.status_code, response.text, response=response)
        return response

    def _json(self, response: requests.Response, endpoint: str) -> Any:
        self._ok(response, endpoint)
        try:
            return response.json()
        except ValueError:
            raise SGLangProtocolError(
                self.engine, endpoint, response.status_code, response.text, detail="answer is not JSON", response=response
            ) from None

    def _control(self, path: str, body: Mapping[str, Any]) -> ControlResult:
        endpoint = f"POST {path}"
        response = self._ok(self._request("POST", path, json=dict(body)), endpoint)
        message = ""
        if response.content:
            try:
                data = response.json()
            except ValueError:
                data = None
            if isinstance(data, dict):
                message = str(data.get("message", ""))
        return ControlResult(self.engine, endpoint, message, len(getattr(response, "attempts", ())) or 1)

    def _weights(self, path: str, body: Mapping[str, Any]) -> WeightUpdateResult:
        endpoint = f"POST {path}"
        response = self._request("POST", path, json=dict(body))
        if response.status_code == 400:
            try:
                data = response.json()
            except ValueError:
                data = None
            if isinstance(data, dict) and data.get("success") is False:
                message = str(data.get("message", ""))
                if message.startswith(_APPLIED_NOT_FLUSHED):
                    raise SGLangAppliedButRefused(
                        self.engine, endpoint, 400, response.text, detail="weights applied, cache not flushed", response=response
                    )
                raise SGLangError(self.engine, endpoint, 400, response.text, detail=f"refused: {message}")
        data = self._json(response, endpoint)
        if not isinstance(data, dict) or "success" not in data:
            raise SGLangProtocolError(self.engine, endpoint, response.status_code, response.text, detail="no 'success' field")
        if not data["success"]:
            raise SGLangError(self.engine, endpoint, response.status_code, response.text, detail=f"refused: {data.get('message', '')}")
        return WeightUpdateResult(self.engine, endpoint, True, str(data.get("message", "")), data)

    # -- generation control --------------------------------------------------

    def pause_generation(self, mode: PauseMode = "abort") -> ControlResult:
        """Pause admission. ``abort`` answers in-flight requests as aborted; ``retract`` re-queues them; ``in_place`` keeps their KV."""
        if mode not in ("abort", "retract", "in_place"):
            raise ValueError(f"pause mode must be 'abort', 'retract' or 'in_place', but was {mode!r}")
        result = self._control("/pause_generation", {"mode": mode})
        self._paused_mode = mode
        return result

    def continue_generation(self, torch_empty_cache: bool = True) -> ControlResult:
        """Reopen admission. SGLang's pause is one flag: the first continue wins (the orchestrator owns holds)."""
        result = self._control("/continue_generation", {"torch_empty_cache": torch_empty_cache})
        self._paused_mode = None
        return result

    def flush_cache(self, deadline_s: float | None = None, *, wait_for_idle: bool | None = None) -> FlushResult:
        """Flush the radix cache, asking again on "not idle" answers until ``deadline_s`` (default ``flush_deadline_s``).

        ``wait_for_idle``: pass the remaining time as SGLang's ``?timeout=`` so the engine itself
        waits to be idle. None (default) = only when this client has not paused the engine.
        On a paused engine SGLang's timed wait (``flush_wrapper.py``) counts re-queued requests
        as work that never drains while paused, so after a ``retract`` pause it can only answer
        "Timed out waiting for idle state."; ``?timeout=0`` flushes at once, ignoring the
        waiting queue as the release that follows does (``scheduler.py``, ``flush_cache``).
        """
        endpoint = "POST /flush_cache"
        wait = self._paused_mode is None if wait_for_idle is None else wait_for_idle
        with Deadline(deadline_s if deadline_s is not None else self.flush_deadline_s) as deadline:
            polls = 0
            while True:
                polls += 1
                server_wait = max(0.0, min(deadline.remaining() - 1.0, 30.0)) if wait else 0.0
                response = self._request("POST", "/flush_cache", params={"timeout": f"{server_wait:.3f}"})
                if response.ok:
                    return FlushResult(self.engine, response.text.strip(), polls)
                not_idle = response.status_code == 400 and any(text in response.text for text in _NOT_IDLE)
                if not not_idle:
                    raise SGLangError(self.engine, endpoint, response.status_code, response.text, response=response)
                if deadline.remaining() <= self.flush_poll_s:
                    raise SGLangError(
                        self.engine,
                        endpoint,
                        response.status_code,
                        response.text,
                        detail=f"still not idle after {polls} tries before the deadline",
                        response=response,
                    )
                time.sleep(self.flush_poll_s)

    def abort_request(self, rid: str | None = None, abort_all: bool = False) -> ControlResult:
        """Abort requests whose rid starts with ``rid``, or all of them."""
        if rid is None and not abort_all:
            raise ValueError("abort_request needs a rid or abort_all=True")
        return self._control("/abort_request", {"rid": rid or "", "abort_all": abort_all})

    # -- memory occupation ---------------------------------------------------

    def release_memory_occupation(self, tags: Sequence[str] | None = None) -> ControlResult:
        """Release GPU memory for ``tags`` (None = kv_cache, weights and cuda_graph). Not re-sent once it may have been applied."""
        result = self._control("/release_memory_occupation", {"tags": list(tags) if tags else None})
        with self._lock:
            self._released.update(tags or ALL_TAGS)
        return result

    def resume_memory_occupation(self, tags: Sequence[str] | None = None) -> ControlResult:
        """Re-occupy memory for ``tags`` (None = all three). Not re-sent once it may have been applied."""
        result = self._control("/resume_memory_occupation", {"tags": list(tags) if tags else None})
        with self._lock:
            self._released.difference_update(tags or ALL_TAGS)
        return result

    # -- weights ---------------------------------------------------------------

    def begin_weight_update(self, selector: str = "all") -> WeightUpdateResult:
        """Open a weight-update session (SGLang 0.5.23); 400 when one is already open."""
        return self._weights("/begin_weight_update", {"selector": selector})

    def end_weight_update(self) -> WeightUpdateResult:
        """Close the weight-update session; 400 when none is open."""
        return self._weights("/end_weight_update", {})

    def update_weights_from_tensor(
        self,
        serialized_named_tensors: Sequence[str],
        *,
        load_format: str | None = None,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
        weight_version: str | None = None,
    ) -> WeightUpdateResult:
        """Load weights from serialized tensors (inside a begin/end session in 0.5.23)."""
        body: dict[str, Any] = {
            "serialized_named_tensors": list(serialized_named_tensors),
            "flush_cache": flush_cache,
            "abort_all_requests": abort_all_requests,
        }
        if load_format is not None:
            body["load_format"] = load_format
        if weight_version is not None:
            body["weight_version"] = weight_version
        return self._weights("/update_weights_from_tensor", body)

    def update_weights_from_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        *,
        group_name: str = "weight_update_group",
        flush_cache: bool = True,
        weight_version: str | None = None,
    ) -> WeightUpdateResult:
        """Receive weights over the distributed group set up by ``init_weights_update_group``."""
        body: dict[str, Any] = {
            "names": list(names),
            "dtypes": list(dtypes),
            "shapes": [list(s) for s in shapes],
            "group_name": group_name,
            "flush_cache": flush_cache,
        }
        if weight_version is not None:
            body["weight_version"] = weight_version
        return self._weights("/update_weights_from_distributed", body)

    def update_weights_from_disk(
        self, model_path: str, *, flush_cache: bool = True, weight_version: str | None = None, load_format: str | None = None
    ) -> WeightUpdateResult:
        """Load weights from a checkpoint path on the engine's machine."""
        body: dict[str, Any] = {"model_path": model_path, "flush_cache": flush_cache}
        if weight_version is not None:
            body["weight_version"] = weight_version
        if load_format is not None:
            body["load_format"] = load_format
        return self._weights("/update_weights_from_disk", body)

    def update_weight_version(self, new_version: str, abort_all_requests: bool = True) -> WeightUpdateResult:
        """Set the weight version reported by ``/model_info`` and in generation meta_info."""
        return self._weights("/update_weight_version", {"new_version": new_version, "abort_all_requests": abort_all_requests})

    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
    ) -> WeightUpdateResult:
        """Join the trainer's process group for distributed weight updates."""
        return self._weights(
            "/init_weights_update_group",
            {
                "master_address": master_address,
                "master_port": master_port,
                "rank_offset": rank_offset,
                "world_size": world_size,
                "group_name": group_name,
                "backend": backend,
            },
        )

    # -- reads -----------------------------------------------------------------

    def _health(self, path: str) -> Health:
        if self._paused_mode is not None:
            return Health(self.engine, True, None, 0.0, paused_by_us=True)
        t0 = time.monotonic()
        try:
            response = self._request("GET", path)
        except requests.RequestException as exc:
            return Health(self.engine, False, None, time.monotonic() - t0, error=type(exc).__name__)
        return Health(self.engine, response.ok, response.status_code, time.monotonic() - t0)

    def health(self) -> Health:
        """``/health``. An engine this client paused reports ``paused_by_us`` at once (its /health would hang ~20 s, then 503)."""
        return self._health("/health")

    def health_generate(self) -> Health:
        """``/health_generate`` (runs a one-token generation), with the same paused-by-us rule."""
        return self._health("/health_generate")

    def ready(self) -> bool:
        """``/ready``: True only when serving and not paused."""
        return self._request("GET", "/ready").status_code == 200

    def server_info(self) -> dict[str, Any]:
        """``/server_info``: server args, internal states, version."""
        data = self._json(self._request("GET", "/server_info"), "GET /server_info")
        if not isinstance(data, dict):
            raise SGLangProtocolError(self.engine, "GET /server_info", 200, str(data), detail="answer is not an object")
        return data

    def model_info(self) -> ModelInfo:
        """``/model_info``, including the weight version (``/get_weight_version`` is gone in 0.5.23)."""
        endpoint = "GET /model_info"
        data = self._json(self._request("GET", "/model_info"), endpoint)
        if not isinstance(data, dict) or "model_path" not in data:
            raise SGLangProtocolError(self.engine, endpoint, 200, jsonlib.dumps(data)[:200], detail="no 'model_path' field")
        version = data.get("weight_version")
        return ModelInfo(
            self.engine, str(data["model_path"]), None if version is None else str(version), data.get("served_model_name"), data
        )

    def loads(self) -> dict[str, Any]:
        """``/v1/loads?include=core``: per-rank running and waiting requests."""
        data = self._json(self._request("GET", "/v1/loads", params={"include": "core"}), "GET /v1/loads")
        return data if isinstance(data, dict) else {"loads": data}

    def models(self) -> list[str]:
        """``/v1/models``: the served model ids."""
        data = self._json(self._request("GET", "/v1/models"), "GET /v1/models")
        try:
            return [str(m["id"]) for m in data["data"]]
        except (KeyError, TypeError):
            raise SGLangProtocolError(self.engine, "GET /v1/models", 200, jsonlib.dumps(data)[:200], detail="no data[].id") from None

    # -- generation --------------------------------------------------------------

    def generate(
        self,
        text: str | None = None,
        *,
        input_ids: Sequence[int] | None = None,
        sampling_params: Mapping[str, Any] | None = None,
        rid: str | None = None,
    ) -> GenerateResult:
        """``/generate`` (never re-sent once it may have reached the engine). Aborted requests come back with ``aborted``."""
        body = self._generate_body(text, input_ids, sampling_params, rid, stream=False)
        data = self._json(self._request("POST", "/generate", json=body), "POST /generate")
        if not isinstance(data, dict):
            raise SGLangProtocolError(self.engine, "POST /generate", 200, str(data)[:200], detail="answer is not an object")
        return _generate_result(data)

    def generate_stream(
        self,
        text: str | None = None,
        *,
        input_ids: Sequence[int] | None = None,
        sampling_params: Mapping[str, Any] | None = None,
        rid: str | None = None,
    ) -> Iterator[GenerateResult]:
        """Streaming ``/generate``: yields the cumulative result of each SSE chunk until ``[DONE]``."""
        body = self._generate_body(text, input_ids, sampling_params, rid, stream=True)
        response = self._ok(self._request("POST", "/generate", json=body, stream=True), "POST /generate")
        with response:
            for line in response.iter_lines(decode_unicode=True):
                if not line or not line.startswith("data:"):
                    continue
                payload = line[len("data:") :].strip()
                if payload == "[DONE]":
                    return
                try:
                    chunk = jsonlib.loads(payload)
                except ValueError:
                    raise SGLangProtocolError(self.engine, "POST /generate", 200, payload, detail="bad SSE chunk") from None
                yield _generate_result(chunk)

    @staticmethod
    def _generate_body(
        text: str | None, input_ids: Sequence[int] | None, sampling_params: Mapping[str, Any] | None, rid: str | None, *, stream: bool
    ) -> dict[str, Any]:
        if (text is None) == (input_ids is None):
            raise ValueError("generate needs exactly one of text or input_ids")
        body: dict[str, Any] = {"sampling_params": dict(sampling_params or {}), "stream": stream}
        if text is not None:
            body["text"] = text
        else:
            body["input_ids"] = list(input_ids or ())
        if rid is not None:
            body["rid"] = rid
        return body


def _generate_result(data: Mapping[str, Any]) -> GenerateResult:
    meta = data.get("meta_info") or {}
    finish = meta.get("finish_reason")
    reason = finish.get("type") if isinstance(finish, dict) else finish
    return GenerateResult(
        text=str(data.get("text", "")),
        output_ids=tuple(int(i) for i in data.get("output_ids") or ()),
        finish_reason=None if reason is None else str(reason),
        meta_info=meta,
    )
