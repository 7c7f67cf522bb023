"""One ``Plan`` per client method: what each vLLM 0.33.0 route takes, and what its answer means.

``VLLMClient`` and ``AsyncVLLMClient`` call the builder of the same name; it checks the arguments at once (a clear error
naming a bad value, before anything is sent) and returns a ``answers.Plan``: the route, the request for the server's
release, and the reader of the answer. No I/O here.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, TypeVar, get_args

from resilience.adapters.engine_http import Answer
from resilience.adapters.vllm import results
from resilience.adapters.vllm.answers import (
    DEFAULT_RESET_DEADLINE_S,
    DEFAULT_RESET_POLL_S,
    Plan,
    Request,
    VLLMPauseMode,
    WeightCheckerAction,
    check_mode,
    command_reader,
    fixed,
    flag,
    flag_reader,
    health_result,
    json_object,
    malformed,
    needs_mode,
    require_bool,
    strict_command,
    typed_field,
    version_result,
)
from resilience.adapters.vllm.routes import route
from resilience.adapters.vllm.versions import NEWEST, VLLMApi

T = TypeVar("T")
Extra = Mapping[str, Any] | None
"""More fields of a completion request's body (None = none)."""

FaultInstruction = Literal["retry"]
"""The instructions ``POST /fault_tolerance/apply`` takes in 0.33.0 (``_ALLOWED_INSTRUCTIONS``,
``entrypoints/serve/fault_tolerance/api_router.py`` l.20; vLLM's main adds ``pause``)."""

def _plain(name: str, read: Callable[[str, VLLMApi | None, Answer], T]) -> Plan[T]:
    """The plan of route ``name``: a request without parameters or body, read by ``read``."""
    r = route(name)
    return Plan(r, fixed(r), read)


# -- memory: /sleep, /wake_up, /is_sleeping, /release_kv_cache_memory -------------------------------


def sleep(level: int = 1, mode: VLLMPauseMode | None = None) -> Plan[results.SleepResult]:
    """``POST /sleep?level=&mode=``: level 0 pauses scheduling, 1 offloads weights and drops KV, 2 drops both.

    ``mode`` None = the server's default (``abort`` since 0.17.0; older releases take no mode and do not pause).
    """
    r = route("sleep")
    if isinstance(level, bool) or not isinstance(level, int) or not 0 <= level <= 2:
        raise ValueError(f"sleep level must be 0, 1 or 2, but was {level!r}")
    checked = check_mode("sleep", mode)

    def build(engine: str, api: VLLMApi | None) -> Request:
        assert api is not None
        params: tuple[tuple[str, str], ...] = (("level", str(level)),)
        if checked is not None:
            needs_mode(engine, r, api)
            params += (("mode", checked),)
        return Request(r, params)

    def read(engine: str, api: VLLMApi | None, answer: Answer) -> results.SleepResult:
        if api is not None and not api.json_sleep_bodies and not answer.text:
            return results.SleepResult(engine, level, answer.attempts)  # before 0.33.0: an empty 200
        data = json_object(engine, answer, required=("status", "level"))
        if data["status"] != "sleeping":
            raise malformed(engine, answer, "'status' is not 'sleeping'")
        return results.SleepResult(engine, int(typed_field(engine, answer, data, "level", int)), answer.attempts)

    return Plan(r, build, read)


def wake_up(tags: Sequence[str] | None = None) -> Plan[results.WakeResult]:
    """``POST /wake_up?tags=...`` (repeated); None or empty = every tag. ``"scheduling"`` wakes a level-0 sleep."""
    r = route("wake_up")
    if isinstance(tags, str):
        raise TypeError(f"wake_up tags must be a sequence of tag names, not one string: {tags!r}")
    names = tuple(tags or ())
    for tag in names:
        if not isinstance(tag, str) or not tag:
            raise ValueError(f"wake_up tags must be non-empty strings, but got {tag!r}")

    def read(engine: str, api: VLLMApi | None, answer: Answer) -> results.WakeResult:
        if api is not None and not api.json_sleep_bodies and not answer.text:
            return results.WakeResult(engine, None, names or None, answer.attempts)
        data = json_object(engine, answer, required=("status",))
        status = data["status"]
        if status not in ("awake", "sleeping"):
            raise malformed(engine, answer, "'status' is neither 'awake' nor 'sleeping'")
        woken = data.get("tags")
        if woken is not None and not (isinstance(woken, list) and all(isinstance(t, str) for t in woken)):
            raise malformed(engine, answer, "'tags' is not a list of strings")
        return results.WakeResult(engine, status == "awake", None if woken is None else tuple(woken), answer.attempts)

    return Plan(r, fixed(r, tuple(("tags", t) for t in names)), read)


def is_sleeping() -> Plan[bool]:
    """``GET /is_sleeping``: true while asleep *or merely paused* (``v1/engine/core.py`` l.1078)."""
    return _plain("is_sleeping", flag_reader("is_sleeping"))


def release_kv_cache_memory() -> Plan[results.CommandResult]:
    """``POST /release_kv_cache_memory`` (0.33.0): only after a completed pause; a second call answers 500."""
    return _plain("release_kv_cache_memory", strict_command("kv_cache_released", "status"))


# -- generation control: /pause, /resume, /is_paused, /abort_requests ---------------------------------


def pause(mode: VLLMPauseMode | None = None, clear_cache: bool | None = None) -> Plan[results.CommandResult]:
    """``POST /pause?mode=&clear_cache=``; ``mode`` None = the server's default (``abort``).

    Before 0.17.0 there is no ``mode``: ``abort`` is sent as ``wait_for_inflight_requests=false``,
    ``wait`` as ``true``, and ``keep`` is refused (``VLLMVersionError``). From 0.17.0 only ``mode`` is sent
    (``wait_for_inflight_requests`` is gone in 0.33.0). ``clear_cache`` None = the server's default (true).
    """
    r = route("pause")
    checked = check_mode("pause", mode)
    if clear_cache is not None:
        require_bool("pause", "clear_cache", clear_cache)

    def build(engine: str, api: VLLMApi | None) -> Request:
        assert api is not None
        params: tuple[tuple[str, str], ...] = ()
        if checked is not None and api.mode_params:
            params += (("mode", checked),)
        elif checked is not None:
            if checked == "keep":
                needs_mode(engine, r, api)
            params += (("wait_for_inflight_requests", flag(checked == "wait")),)
        if clear_cache is not None:
            params += (("clear_cache", flag(clear_cache)),)
        return Request(r, params)

    return Plan(r, build, strict_command("paused", "status", lenient_before=NEWEST))


def resume() -> Plan[results.CommandResult]:
    """``POST /resume``: reopens scheduling for everyone (pause is one shared state, ``v1/core/sched/scheduler.py`` l.3073)."""
    return _plain("resume", strict_command("resumed", "status", lenient_before=NEWEST))


def is_paused() -> Plan[bool]:
    """``GET /is_paused``."""
    return _plain("is_paused", flag_reader("is_paused"))


def abort_requests(request_ids: Sequence[str] | None = None) -> Plan[results.AbortResult]:
    """``POST /abort_requests`` with ``{"request_ids": [...]}``; None or empty = every request. Does not pause."""
    r = route("abort_requests")
    if isinstance(request_ids, str):
        raise TypeError(f"abort_requests request_ids must be a sequence of ids, not one string: {request_ids!r}")
    ids = [str(i) for i in request_ids or ()]

    def read(engine: str, api: VLLMApi | None, answer: Answer) -> results.AbortResult:
        data = json_object(engine, answer, required=("aborted",))
        return results.AbortResult(engine, int(typed_field(engine, answer, data, "aborted", int)), answer.attempts)

    return Plan(r, fixed(r, body={"request_ids": ids} if ids else {}), read)


# -- caches -------------------------------------------------------------------------------------------


def reset_prefix_cache(
    reset_running_requests: bool = False, reset_external: bool = False, *, deadline_s: float | None = None,
    poll_s: float = DEFAULT_RESET_POLL_S
) -> Plan[results.CacheReset]:
    """``POST /reset_prefix_cache?reset_running_requests=&reset_external=``; ``success: false`` is asked again.

    ``deadline_s``: how long to keep asking (default ``DEFAULT_RESET_DEADLINE_S`` = 30 s, capped by any
    ``Deadline`` in context); ``poll_s``: the pause between asks (default 0.5 s). Then ``VLLMRefused``.
    """
    r = route("reset_prefix_cache")
    require_bool("reset_prefix_cache", "reset_running_requests", reset_running_requests)
    require_bool("reset_prefix_cache", "reset_external", reset_external)
    limit = DEFAULT_RESET_DEADLINE_S if deadline_s is None else deadline_s
    for name, value in (("deadline_s", limit), ("poll_s", poll_s)):
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
            raise ValueError(f"reset_prefix_cache {name} must be a number > 0, but was {value!r}")
    params = (("reset_running_requests", flag(reset_running_requests)), ("reset_external", flag(reset_external)))

    def read(engine: str, api: VLLMApi | None, answer: Answer) -> results.CacheReset:
        data = json_object(engine, answer, required=("success",))
        if typed_field(engine, answer, data, "success", bool) is not True:  # a false was raised by check_reply
            raise malformed(engine, answer, "'success' is not true")
        return results.CacheReset(engine, answer.polls)

    return Plan(r, fixed(r, params), read, refusal_deadline_s=float(limit), poll_s=float(poll_s))


def reset_mm_cache() -> Plan[results.CommandResult]:
    """``POST /reset_mm_cache`` (an empty 200)."""
    return _plain("reset_mm_cache", command_reader)


def reset_encoder_cache() -> Plan[results.CommandResult]:
    """``POST /reset_encoder_cache`` (an empty 200)."""
    return _plain("reset_encoder_cache", command_reader)


# -- workers --------------------------------------------------------------------------------------------


def collective_rpc(
    method: str, args: Sequence[str] = (), kwargs: Mapping[str, str] | None = None, timeout: float | None = None
) -> Plan[results.RpcResult]:
    """``POST /collective_rpc``: call ``method`` on every worker; only string ``args``/``kwargs`` travel (vLLM's rule)."""
    r = route("collective_rpc")
    if not isinstance(method, str) or not method:
        raise ValueError(f"collective_rpc method must be a non-empty string, but was {method!r}")
    if isinstance(args, str) or not all(isinstance(a, str) for a in args):
        raise TypeError(f"collective_rpc args must be a sequence of strings (vLLM passes only serialized strings), but was {args!r}")
    kw = dict(kwargs or {})
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in kw.items()):
        raise TypeError("collective_rpc kwargs must map strings to strings (vLLM passes only serialized strings)")
    body: dict[str, Any] = {"method": method, "args": list(args), "kwargs": kw}
    if timeout is not None:
        body["timeout"] = float(timeout)

    def read(engine: str, api: VLLMApi | None, answer: Answer) -> results.RpcResult:
        if not answer.text:
            return results.RpcResult(engine, None)  # the method returned None (``serve/dev/rpc/api_router.py`` l.51)
        data = json_object(engine, answer, required=("results",))
        return results.RpcResult(engine, tuple(typed_field(engine, answer, data, "results", list)))

    return Plan(r, fixed(r, body=body), read)


def server_info(config_format: Literal["text", "json"] = "text") -> Plan[dict[str, Any]]:
    """``GET /server_info?config_format=``: the config dump."""
    r = route("server_info")
    if config_format not in ("text", "json"):
        raise ValueError(f"server_info config_format must be 'text' or 'json', but was {config_format!r}")
    return Plan(r, fixed(r, (("config_format", config_format),)), lambda engine, api, answer: json_object(engine, answer))


# -- weight transfer ----------------------------------------------------------------------------------


def init_weight_transfer_engine(init_info: Mapping[str, Any]) -> Plan[results.CommandResult]:
    """``POST /init_weight_transfer_engine`` with ``{"init_info": {...}}`` (backend-specific). Never re-sent once it may have arrived."""
    r = route("init_weight_transfer_engine")
    if not isinstance(init_info, Mapping):
        raise TypeError(f"init_weight_transfer_engine init_info must be a mapping, but was {init_info!r}")
    return Plan(r, fixed(r, body={"init_info": dict(init_info)}), strict_command("Weight transfer initialized"))


def shutdown_weight_transfer_engine() -> Plan[results.CommandResult]:
    """``POST /shutdown_weight_transfer_engine`` (0.33.0); 500 during a weight update."""
    return _plain("shutdown_weight_transfer_engine", strict_command("Weight transfer shut down"))


def start_weight_update() -> Plan[results.CommandResult]:
    """``POST /start_weight_update`` (0.23.0+): opens the session; 500 when one is open. Never re-sent once it may have arrived."""
    return _plain("start_weight_update", strict_command("Weight update started"))


def start_draft_weight_update() -> Plan[results.CommandResult]:
    """``POST /start_draft_weight_update`` (0.33.0); 500 when the backend has no draft support."""
    return _plain("start_draft_weight_update", strict_command("Draft weight update started"))


def update_weights(update_info: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> Plan[results.CommandResult]:
    """``POST /update_weights`` with ``{"update_info": ...}`` (one mapping, or one per rank).

    **Never re-sent once it may have arrived** (a collective with the trainer; prime-rl #3599):
    only a refused connection is retried; a timeout or gateway status raises, and whether it applied
    is then asked through ``weight_info``/``weight_checker``, not by sending it again.
    """
    r = route("update_weights")
    if isinstance(update_info, Mapping):
        payload: Any = dict(update_info)
    elif isinstance(update_info, Sequence) and not isinstance(update_info, str) and all(isinstance(u, Mapping) for u in update_info):
        payload = [dict(u) for u in update_info]
    else:
        raise TypeError(f"update_weights update_info must be a mapping or a sequence of mappings, but was {update_info!r}")
    return Plan(r, fixed(r, body={"update_info": payload}), strict_command("Weights updated"))


def finish_weight_update(weight_version: str | None = None) -> Plan[results.CommandResult]:
    """``POST /finish_weight_update`` with ``{"weight_version": ...}`` (omitted when None); 500 without a matching start."""
    r = route("finish_weight_update")
    if weight_version is not None and not isinstance(weight_version, str):
        raise TypeError(f"finish_weight_update weight_version must be a string or None, but was {weight_version!r}")
    body = {} if weight_version is None else {"weight_version": weight_version}
    return Plan(r, fixed(r, body=body), strict_command("Weight update finished"))


def update_weight_version(new_version: str) -> Plan[results.WeightInfo]:
    """``POST /update_weight_version`` with ``{"new_version": ...}`` (0.27.0+): the version ``/weight_info`` reports."""
    r = route("update_weight_version")
    if not isinstance(new_version, str) or not new_version:
        raise ValueError(f"update_weight_version new_version must be a non-empty string, but was {new_version!r}")

    def read(engine: str, api: VLLMApi | None, answer: Answer) -> results.WeightInfo:
        data = json_object(engine, answer, required=("new_version",))
        return results.WeightInfo(engine, str(data["new_version"]))

    return Plan(r, fixed(r, body={"new_version": new_version}), read)


def weight_info() -> Plan[results.WeightInfo]:
    """``GET /weight_info`` (0.27.0+): ``{"weight_version": ...}``."""
    r = route("weight_info")

    def read(engine: str, api: VLLMApi | None, answer: Answer) -> results.WeightInfo:
        data = json_object(engine, answer, required=("weight_version",))
        version = data["weight_version"]
        return results.WeightInfo(engine, None if version is None else str(version))

    return Plan(r, fixed(r), read)


def weight_checker(action: WeightCheckerAction, baseline: Mapping[str, str] | None = None) -> Plan[results.WeightCheck]:
    """``POST /weight_checker`` (0.33.0): ``checksum`` the weights, ``compare`` them with ``baseline``, or ``reset`` (zeroes them)."""
    r = route("weight_checker")
    if action not in get_args(WeightCheckerAction):
        raise ValueError(f"weight_checker action must be 'checksum', 'reset' or 'compare', but was {action!r}")
    if action == "compare" and baseline is None:
        raise ValueError("weight_checker action='compare' needs a baseline (a checksum answer's checksums)")
    body: dict[str, Any] = {"action": action}
    if baseline is not None:
        body["baseline"] = dict(baseline)

    def read(engine: str, api: VLLMApi | None, answer: Answer) -> results.WeightCheck:
        if action == "reset":
            json_object(engine, answer, required=("status",))
            return results.WeightCheck(engine, action)
        if action == "checksum":
            data = json_object(engine, answer, required=("checksums",))
            sums = typed_field(engine, answer, data, "checksums", dict)
            return results.WeightCheck(engine, action, checksums={str(k): str(v) for k, v in sums.items()})
        data = json_object(engine, answer, required=("match", "mismatches"))
        match = typed_field(engine, answer, data, "match", bool)
        return results.WeightCheck(
            engine, action, match=match, mismatches=tuple(str(m) for m in typed_field(engine, answer, data, "mismatches", list))
        )

    return Plan(r, fixed(r, body=body), read)


def get_world_size(include_dp: bool = True) -> Plan[int]:
    """``GET /get_world_size?include_dp=``: TP x PP (x DP when ``include_dp``)."""
    r = route("get_world_size")
    require_bool("get_world_size", "include_dp", include_dp)

    def read(engine: str, api: VLLMApi | None, answer: Answer) -> int:
        return int(typed_field(engine, answer, json_object(engine, answer, required=("world_size",)), "world_size", int))

    return Plan(r, fixed(r, (("include_dp", flag(include_dp)),)), read)


# -- fault tolerance: /fault_tolerance/apply, /fault_tolerance/status (with --enable-fault-tolerance) ---------


def fault_tolerance_apply(
    instruction: FaultInstruction = "retry", params: Mapping[str, Any] | None = None
) -> Plan[results.FaultToleranceAccepted]:
    """``POST /fault_tolerance/apply`` with ``{"instruction": ..., "params": {...}}``: 202 at once, the recovery after.

    ``instruction``: ``retry`` (the only one 0.33.0 takes). ``params``: the instruction's (default none).
    """
    r = route("fault_tolerance_apply")
    if instruction not in get_args(FaultInstruction):
        raise ValueError(f"fault_tolerance_apply instruction must be one of {list(get_args(FaultInstruction))}, but was {instruction!r}")
    if params is not None and not isinstance(params, Mapping):
        raise TypeError(f"fault_tolerance_apply params must be a mapping or None, but was {params!r}")
    body: dict[str, Any] = {"instruction": instruction, "params": dict(params or {})}

    def read(engine: str, api: VLLMApi | None, answer: Answer) -> results.FaultToleranceAccepted:
        data = json_object(engine, answer, required=("request_id",))
        request_id = typed_field(engine, answer, data, "request_id", str)
        return results.FaultToleranceAccepted(engine, request_id, str(data.get("message", "")), answer.attempts)

    return Plan(r, fixed(r, body=body), read)


def fault_tolerance_status() -> Plan[results.FaultToleranceStatus]:
    """``GET /fault_tolerance/status``: ``{"schema_version": 1, "total_engines": n, "engines": [{"id", "status", ...}]}``."""
    r = route("fault_tolerance_status")

    def read(engine: str, api: VLLMApi | None, answer: Answer) -> results.FaultToleranceStatus:
        data = json_object(engine, answer, required=("engines",))
        entries = typed_field(engine, answer, data, "engines", list)
        states: list[results.EngineFaultState] = []
        for entry in entries:
            if not isinstance(entry, dict) or not isinstance(entry.get("id"), int) or not isinstance(entry.get("status"), str):
                raise malformed(engine, answer, "an 'engines' entry is not an object with an int 'id' and a string 'status'")
            optional = {k: None if entry.get(k) is None else str(entry[k]) for k in ("fault_info", "last_ft_request_id", "ft_error")}
            states.append(results.EngineFaultState(entry["id"], entry["status"], **optional))
        return results.FaultToleranceStatus(engine, tuple(states), answer.attempts)

    return Plan(r, fixed(r), read)


# -- always mounted ------------------------------------------------------------------------------------


def health() -> Plan[results.VLLMHealth]:
    """``GET /health``: read by ``health_result`` (the clients never raise from ``health()``)."""
    return _plain("health", lambda engine, api, answer: health_result(engine, answer, 0.0))


def version() -> Plan[VLLMApi]:
    """``GET /version`` (always mounted, ``serve/instrumentator/basic.py`` l.53)."""
    return _plain("version", lambda engine, api, answer: version_result(engine, answer))


def models() -> Plan[list[str]]:
    """``GET /v1/models``: the served model ids."""
    r = route("models")

    def read(engine: str, api: VLLMApi | None, answer: Answer) -> list[str]:
        data = json_object(engine, answer, required=("data",))
        try:
            return [str(m["id"]) for m in data["data"]]
        except (KeyError, TypeError):
            raise malformed(engine, answer, "no data[].id") from None

    return Plan(r, fixed(r), read)


def complete(
    prompt: str, *, max_tokens: int = 16, temperature: float = 0.0, model: str | None = None, seed: int | None = None, extra: Extra = None
) -> Plan[results.CompletionResult]:
    """``POST /v1/completions`` (non-streaming), for tests and canaries: greedy by default (``temperature=0``).

    ``model`` None = the server's (vLLM accepts a request without one); ``extra``: more request fields.
    Never re-sent once it may have arrived; a 503 during an ``abort``/``wait`` pause is raised as ``VLLMError``.
    """
    r = route("complete")
    if not isinstance(prompt, str):
        raise TypeError(f"complete prompt must be a string, but was {prompt!r}")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"complete max_tokens must be an int >= 1, but was {max_tokens!r}")
    body: dict[str, Any] = {"prompt": prompt, "max_tokens": max_tokens, "temperature": float(temperature), "stream": False}
    if model is not None:
        body["model"] = model
    if seed is not None:
        body["seed"] = int(seed)
    body.update(extra or {})

    def read(engine: str, api: VLLMApi | None, answer: Answer) -> results.CompletionResult:
        data = json_object(engine, answer, required=("choices",))
        choices = data["choices"]
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict) or not isinstance(choices[0].get("text"), str):
            raise malformed(engine, answer, "no choices[0].text")
        finish = choices[0].get("finish_reason")
        return results.CompletionResult(choices[0]["text"], None if finish is None else str(finish), data)

    return Plan(r, fixed(r, body=body), read)
