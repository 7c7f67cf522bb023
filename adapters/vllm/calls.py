"""What a vLLM client sends and what the answers mean: one ``Plan`` per client method, shared by both clients.

No I/O here. A client method calls the builder of the same name, which checks
the arguments at once and returns a ``Plan``: its ``Route`` (``routes.ROUTES``),
how to build the ``Request`` for the server's release (``VLLMApi``, the drift),
and how to read the ``Reply`` into a typed result or raise the typed error.
``VLLMClient`` and ``AsyncVLLMClient`` differ only in how they send, so they
cannot drift apart.

Every reply goes through ``check_reply`` first:

- 401: ``VLLMAuthError`` naming the key sent (never the key).
- 404 on a route mounted only in dev mode: ``VLLMDevModeOff``.
- any other status >= 400: ``VLLMError`` with the status and a body excerpt.
- a 200 whose JSON object says ``"success": false``: ``VLLMRefused``. The
  client asks again only where the route allows it (``Route.refusals_retried``:
  ``/reset_prefix_cache``, whose docstring says "callers may retry", until the
  call's deadline) and raises it after; it is never returned as a success.
"""

from __future__ import annotations

import json as jsonlib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar, get_args

from resilience.adapters.vllm.routes import Route, route
from resilience.adapters.vllm.types import (
    AbortResult,
    CacheReset,
    CommandResult,
    CompletionResult,
    RpcResult,
    SleepResult,
    VLLMAuthError,
    VLLMDevModeOff,
    VLLMError,
    VLLMHealth,
    VLLMProtocolError,
    VLLMRefused,
    VLLMVersionError,
    WakeResult,
    WeightCheck,
    WeightInfo,
)
from resilience.adapters.vllm.versions import MODE_PARAMS, NEWEST, Version, VLLMApi, format_version
from resilience.outcome import AttemptRecord

__all__ = [
    "API_KEY_PREFIXES",
    "Plan",
    "Reply",
    "Request",
    "VLLMPauseMode",
    "WeightCheckerAction",
    "check_reply",
    "gate",
    "health_result",
    "key_header",
    "refusal_wait",
    "version_result",
]

T = TypeVar("T")

VLLMPauseMode = Literal["abort", "wait", "keep"]
"""vLLM's ``PauseMode`` (``v1/engine/__init__.py`` l.33): abort running requests, wait for them, or keep them frozen."""
WeightCheckerAction = Literal["checksum", "reset", "compare"]
"""``/weight_checker`` actions (``rl/online/api_router.py`` l.235)."""

API_KEY_PREFIXES: tuple[str, ...] = ("/v1", "/v2", "/inference", "/cohere")
"""The only paths vLLM checks ``--api-key`` on (``serve/middleware/authenticate.py`` l.11): the key goes nowhere else."""

DEFAULT_RESET_DEADLINE_S = 30.0
"""How long ``reset_prefix_cache`` keeps asking while the engine answers ``success: false``."""
DEFAULT_RESET_POLL_S = 0.5
"""The pause between two ``success: false`` answers."""


# -- the values that cross the transport ------------------------------------------------


@dataclass(frozen=True, slots=True)
class Request:
    """One request: its ``route``, query ``params`` (pairs; a key may repeat, as ``tags``) and JSON ``body`` (None = none)."""

    route: Route
    params: tuple[tuple[str, str], ...] = ()
    body: dict[str, Any] | None = None

    @property
    def endpoint(self) -> str:
        """``"POST /sleep"``."""
        return self.route.endpoint


@dataclass(frozen=True, slots=True)
class Reply:
    """What the engine answered: ``status``, the body ``text``, the transport's ``records`` and ``response``.

    ``polls``: which ask this is, for a route whose refusals are asked again (1 = the first).
    """

    endpoint: str
    status: int
    text: str
    records: tuple[AttemptRecord, ...] = ()
    response: Any = None
    polls: int = 1

    @property
    def attempts(self) -> int:
        """Attempts the call took (at least 1: an answer came)."""
        return max(1, len(self.records))


@dataclass(frozen=True, slots=True)
class Plan(Generic[T]):
    """One client call, before it is sent: the route, how to build its request for a release, and how to read the reply.

    ``build(engine, api)``: the ``Request`` (``api`` None for routes that are
    not ``versioned``); raises ``VLLMVersionError`` when this release cannot
    take it. ``read(engine, api, reply)``: the typed result (after ``check_reply``).
    ``refusal_deadline_s``/``poll_s``: for a route whose refusals are asked
    again, how long and how often (None = not asked again).
    """

    route: Route
    build: Callable[[str, VLLMApi | None], Request]
    read: Callable[[str, VLLMApi | None, Reply], T]
    refusal_deadline_s: float | None = None
    poll_s: float = DEFAULT_RESET_POLL_S


# -- before sending ------------------------------------------------------------------


def gate(engine: str, r: Route, api: VLLMApi | None) -> None:
    """Refuse, before sending, a call this server cannot take: an unsupported release, or a route added later."""
    if not r.versioned:
        return
    if api is None:
        raise VLLMVersionError(engine, r.endpoint, None, "", detail="not sent: the server's vLLM version is not known")
    if not api.supported:
        raise VLLMVersionError(
            engine,
            "GET /version",
            200,
            api.text,
            detail=f"vLLM {api.text} is outside the supported range {api.range_text()}; {r.endpoint} not sent",
        )
    if not api.at_least(r.since):
        raise VLLMVersionError(
            engine, r.endpoint, None, "", detail=f"not sent: vLLM {api.text} has no {r.endpoint} (added in {format_version(r.since)})"
        )


def key_header(path: str, api_key: str | None) -> dict[str, str] | None:
    """The ``Authorization: Bearer`` header for paths vLLM guards with ``--api-key``; None elsewhere or without a key."""
    return {"Authorization": f"Bearer {api_key}"} if api_key and path.startswith(API_KEY_PREFIXES) else None


def _flag(value: bool) -> str:
    return "true" if value else "false"


def _require_bool(owner: str, name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{owner} {name} must be True or False, but was {value!r}")
    return value


def _check_mode(owner: str, mode: object) -> VLLMPauseMode | None:
    if mode is not None and mode not in get_args(VLLMPauseMode):
        raise ValueError(f"{owner} mode must be 'abort', 'wait', 'keep' or None, but was {mode!r}")
    return mode  # type: ignore[return-value]  # checked just above


def _needs_mode(engine: str, r: Route, api: VLLMApi, mode: str) -> None:
    if not api.mode_params:
        raise VLLMVersionError(
            engine, r.endpoint, None, "", detail=f"not sent: vLLM {api.text} takes no mode= (added in {format_version(MODE_PARAMS)})"
        )


Builder = Callable[[str, VLLMApi | None], Request]
"""``Plan.build``: the request for one engine and release."""


def _fixed(r: Route, params: tuple[tuple[str, str], ...] = (), body: dict[str, Any] | None = None) -> Builder:
    request = Request(r, params, body)
    return lambda engine, api: request


# -- after the answer ------------------------------------------------------------------


def _malformed(engine: str, reply: Reply, detail: str) -> VLLMProtocolError:
    """The error for a 2xx answer that is not what 0.33.0 sends: endpoint, status, ``detail`` and a body excerpt."""
    return VLLMProtocolError(engine, reply.endpoint, reply.status, reply.text, detail=detail, attempts=reply.records)


def _object_or_none(text: str) -> dict[str, Any] | None:
    try:
        data = jsonlib.loads(text)
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


def check_reply(engine: str, r: Route, api: VLLMApi | None, reply: Reply, *, key_sent: bool = False) -> Reply:
    """``reply`` when it is a success; else the typed error (see the module docstring for the rules)."""
    common = {"response": reply.response, "attempts": reply.records}
    if reply.status == 401:
        detail = "unauthorized: " + (
            "the server refused the API key this client sent" if key_sent else "no API key was sent (pass api_key=)"
        )
        raise VLLMAuthError(engine, reply.endpoint, 401, reply.text, detail=detail, **common)
    dev_only = r.dev_mode_since is not None and (api is None or api.at_least(r.dev_mode_since))
    if reply.status == 404 and dev_only:
        detail = (
            f"vLLM mounts {r.path} only in dev mode and this server runs without it: "
            "start it with VLLM_SERVER_DEV_MODE=1 (the control routes answer 404 otherwise)"
        )
        raise VLLMDevModeOff(engine, reply.endpoint, 404, reply.text, detail=detail, **common)
    if reply.status >= 400:
        raise VLLMError(engine, reply.endpoint, reply.status, reply.text, **common)
    data = _object_or_none(reply.text) if reply.text else None
    if data is not None and data.get("success") is False:
        refused = VLLMRefused(engine, reply.endpoint, reply.status, reply.text, detail=_refusal_detail(r, reply.polls), **common)
        refused.polls = reply.polls
        raise refused
    return reply


def _refusal_detail(r: Route, polls: int) -> str:
    asked = f" (asked {polls} times)" if polls > 1 else ""
    return f'the engine answered "success": false{asked}: not done' + (", blocks are still held" if r.name == "reset_prefix_cache" else "")


def refusal_wait(plan: Plan[Any], refused: VLLMRefused, remaining_s: float) -> float | None:
    """After a ``success: false``: the seconds to wait before asking again, or None to raise ``refused``.

    Asked again only on a route that allows it, and only while at least one poll interval is left of the deadline.
    """
    if not plan.route.refusals_retried or plan.refusal_deadline_s is None:
        return None
    return plan.poll_s if remaining_s > plan.poll_s else None


def json_object(engine: str, reply: Reply, *, required: Sequence[str] = ()) -> dict[str, Any]:
    """The reply's JSON object; ``VLLMProtocolError`` when it is not one or lacks a ``required`` field."""
    data = _object_or_none(reply.text)
    if data is None:
        raise _malformed(engine, reply, "answer is not a JSON object")
    missing = [name for name in required if name not in data]
    if missing:
        raise _malformed(engine, reply, f"no {', '.join(repr(m) for m in missing)} field")
    return data


def _typed(engine: str, reply: Reply, data: Mapping[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    value = data.get(name)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise _malformed(engine, reply, f"{name!r} is not {_kind_name(kind)}")
    return value


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join("null" if k is type(None) else k.__name__ for k in kinds)


def _command(engine: str, api: VLLMApi | None, reply: Reply) -> CommandResult:
    """A control answer: its ``status`` or ``message`` field; an empty 200 is allowed where vLLM sends one."""
    if not reply.text:
        return CommandResult(engine, reply.endpoint, "", reply.attempts)
    data = json_object(engine, reply)
    message = data.get("status", data.get("message", ""))
    return CommandResult(engine, reply.endpoint, str(message), reply.attempts)


def _strict_command(
    expected: str, field_name: str = "message", *, lenient_before: Version | None = None
) -> Callable[[str, VLLMApi | None, Reply], CommandResult]:
    """A reader that wants ``{field_name: ...}`` (0.33.0 sends ``expected`` there); the value is kept as the message.

    ``lenient_before``: releases older than this are read as ``_command`` reads (any JSON object, or an
    empty 200), since what they answered was not read (default None: strict on every release).
    """

    def read(engine: str, api: VLLMApi | None, reply: Reply) -> CommandResult:
        if lenient_before is not None and api is not None and not api.at_least(lenient_before):
            return _command(engine, api, reply)
        data = json_object(engine, reply, required=(field_name,))
        return CommandResult(engine, reply.endpoint, str(data[field_name]), reply.attempts)

    return read


def _flag_of(name: str) -> Callable[[str, VLLMApi | None, Reply], bool]:
    def read(engine: str, api: VLLMApi | None, reply: Reply) -> bool:
        return bool(_typed(engine, reply, json_object(engine, reply, required=(name,)), name, bool))

    return read


# -- memory: /sleep, /wake_up, /is_sleeping, /release_kv_cache_memory -------------------------------


def sleep(level: int = 1, mode: VLLMPauseMode | None = None) -> Plan[SleepResult]:
    """``POST /sleep?level=&mode=``: level 0 pauses scheduling, 1 offloads weights and drops KV, 2 drops both.

    ``mode`` None = the server's default (``abort`` since 0.17.0; older releases take no mode and do not pause).
    """
    r = route("sleep")
    if isinstance(level, bool) or not isinstance(level, int) or not 0 <= level <= 2:
        raise ValueError(f"sleep level must be 0, 1 or 2, but was {level!r}")
    checked = _check_mode("sleep", mode)

    def build(engine: str, api: VLLMApi | None) -> Request:
        assert api is not None
        params: tuple[tuple[str, str], ...] = (("level", str(level)),)
        if checked is not None:
            _needs_mode(engine, r, api, checked)
            params += (("mode", checked),)
        return Request(r, params)

    def read(engine: str, api: VLLMApi | None, reply: Reply) -> SleepResult:
        if api is not None and not api.json_sleep_bodies and not reply.text:
            return SleepResult(engine, level, reply.attempts)  # before 0.33.0: an empty 200
        data = json_object(engine, reply, required=("status", "level"))
        if data["status"] != "sleeping":
            raise _malformed(engine, reply, "'status' is not 'sleeping'")
        return SleepResult(engine, int(_typed(engine, reply, data, "level", int)), reply.attempts)

    return Plan(r, build, read)


def wake_up(tags: Sequence[str] | None = None) -> Plan[WakeResult]:
    """``POST /wake_up?tags=...`` (repeated); None or empty = every tag. ``"scheduling"`` wakes a level-0 sleep."""
    r = route("wake_up")
    if isinstance(tags, str):
        raise TypeError(f"wake_up tags must be a sequence of tag names, not one string: {tags!r}")
    names = tuple(tags or ())
    for tag in names:
        if not isinstance(tag, str) or not tag:
            raise ValueError(f"wake_up tags must be non-empty strings, but got {tag!r}")

    def read(engine: str, api: VLLMApi | None, reply: Reply) -> WakeResult:
        if api is not None and not api.json_sleep_bodies and not reply.text:
            return WakeResult(engine, None, names or None, reply.attempts)
        data = json_object(engine, reply, required=("status",))
        status = data["status"]
        if status not in ("awake", "sleeping"):
            raise _malformed(engine, reply, "'status' is neither 'awake' nor 'sleeping'")
        woken = data.get("tags")
        if woken is not None and not (isinstance(woken, list) and all(isinstance(t, str) for t in woken)):
            raise _malformed(engine, reply, "'tags' is not a list of strings")
        return WakeResult(engine, status == "awake", None if woken is None else tuple(woken), reply.attempts)

    return Plan(r, _fixed(r, tuple(("tags", t) for t in names)), read)


def is_sleeping() -> Plan[bool]:
    """``GET /is_sleeping``: true while asleep *or merely paused* (``v1/engine/core.py`` l.1078)."""
    r = route("is_sleeping")
    return Plan(r, _fixed(r), _flag_of("is_sleeping"))


def release_kv_cache_memory() -> Plan[CommandResult]:
    """``POST /release_kv_cache_memory`` (0.33.0): only after a completed pause; a second call answers 500."""
    r = route("release_kv_cache_memory")
    return Plan(r, _fixed(r), _strict_command("kv_cache_released", "status"))


# -- generation control: /pause, /resume, /is_paused, /abort_requests ---------------------------------


def pause(mode: VLLMPauseMode | None = None, clear_cache: bool | None = None) -> Plan[CommandResult]:
    """``POST /pause?mode=&clear_cache=``; ``mode`` None = the server's default (``abort``).

    Before 0.17.0 there is no ``mode``: ``abort`` is sent as ``wait_for_inflight_requests=false``,
    ``wait`` as ``true``, and ``keep`` is refused (``VLLMVersionError``). From 0.17.0 only ``mode`` is sent
    (``wait_for_inflight_requests`` is gone in 0.33.0). ``clear_cache`` None = the server's default (true).
    """
    r = route("pause")
    checked = _check_mode("pause", mode)
    if clear_cache is not None:
        _require_bool("pause", "clear_cache", clear_cache)

    def build(engine: str, api: VLLMApi | None) -> Request:
        assert api is not None
        params: tuple[tuple[str, str], ...] = ()
        if checked is not None and api.mode_params:
            params += (("mode", checked),)
        elif checked is not None:
            if checked == "keep":
                _needs_mode(engine, r, api, checked)
            params += (("wait_for_inflight_requests", _flag(checked == "wait")),)
        if clear_cache is not None:
            params += (("clear_cache", _flag(clear_cache)),)
        return Request(r, params)

    return Plan(r, build, _strict_command("paused", "status", lenient_before=NEWEST))


def resume() -> Plan[CommandResult]:
    """``POST /resume``: reopens scheduling for everyone (pause is one shared state, ``v1/core/sched/scheduler.py`` l.3073)."""
    r = route("resume")
    return Plan(r, _fixed(r), _strict_command("resumed", "status", lenient_before=NEWEST))


def is_paused() -> Plan[bool]:
    """``GET /is_paused``."""
    r = route("is_paused")
    return Plan(r, _fixed(r), _flag_of("is_paused"))


def abort_requests(request_ids: Sequence[str] | None = None) -> Plan[AbortResult]:
    """``POST /abort_requests`` with ``{"request_ids": [...]}``; None or empty = every request. Does not pause."""
    r = route("abort_requests")
    if isinstance(request_ids, str):
        raise TypeError(f"abort_requests request_ids must be a sequence of ids, not one string: {request_ids!r}")
    ids = [str(i) for i in request_ids or ()]

    def read(engine: str, api: VLLMApi | None, reply: Reply) -> AbortResult:
        data = json_object(engine, reply, required=("aborted",))
        return AbortResult(engine, int(_typed(engine, reply, data, "aborted", int)), reply.attempts)

    return Plan(r, _fixed(r, body={"request_ids": ids} if ids else {}), read)


# -- caches -------------------------------------------------------------------------------------------


def reset_prefix_cache(
    reset_running_requests: bool = False,
    reset_external: bool = False,
    *,
    deadline_s: float | None = None,
    poll_s: float = DEFAULT_RESET_POLL_S,
) -> Plan[CacheReset]:
    """``POST /reset_prefix_cache?reset_running_requests=&reset_external=``; ``success: false`` is asked again.

    ``deadline_s``: how long to keep asking (default ``DEFAULT_RESET_DEADLINE_S`` = 30 s, capped by any
    ``Deadline`` in context); ``poll_s``: the pause between asks (default 0.5 s). Then ``VLLMRefused``.
    """
    r = route("reset_prefix_cache")
    _require_bool("reset_prefix_cache", "reset_running_requests", reset_running_requests)
    _require_bool("reset_prefix_cache", "reset_external", reset_external)
    limit = DEFAULT_RESET_DEADLINE_S if deadline_s is None else deadline_s
    for name, value in (("deadline_s", limit), ("poll_s", poll_s)):
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
            raise ValueError(f"reset_prefix_cache {name} must be a number > 0, but was {value!r}")
    params = (("reset_running_requests", _flag(reset_running_requests)), ("reset_external", _flag(reset_external)))

    def read(engine: str, api: VLLMApi | None, reply: Reply) -> CacheReset:
        data = json_object(engine, reply, required=("success",))
        if _typed(engine, reply, data, "success", bool) is not True:  # a false was raised by check_reply
            raise _malformed(engine, reply, "'success' is not true")
        return CacheReset(engine, reply.polls)

    return Plan(r, _fixed(r, params), read, refusal_deadline_s=float(limit), poll_s=float(poll_s))


def reset_mm_cache() -> Plan[CommandResult]:
    """``POST /reset_mm_cache`` (an empty 200)."""
    r = route("reset_mm_cache")
    return Plan(r, _fixed(r), _command)


def reset_encoder_cache() -> Plan[CommandResult]:
    """``POST /reset_encoder_cache`` (an empty 200)."""
    r = route("reset_encoder_cache")
    return Plan(r, _fixed(r), _command)


# -- workers --------------------------------------------------------------------------------------------


def collective_rpc(
    method: str, args: Sequence[str] = (), kwargs: Mapping[str, str] | None = None, timeout: float | None = None
) -> Plan[RpcResult]:
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

    def read(engine: str, api: VLLMApi | None, reply: Reply) -> RpcResult:
        if not reply.text:
            return RpcResult(engine, None)  # the method returned None (``serve/dev/rpc/api_router.py`` l.51)
        data = json_object(engine, reply, required=("results",))
        return RpcResult(engine, tuple(_typed(engine, reply, data, "results", list)))

    return Plan(r, _fixed(r, body=body), read)


def server_info(config_format: Literal["text", "json"] = "text") -> Plan[dict[str, Any]]:
    """``GET /server_info?config_format=``: the config dump."""
    r = route("server_info")
    if config_format not in ("text", "json"):
        raise ValueError(f"server_info config_format must be 'text' or 'json', but was {config_format!r}")
    return Plan(r, _fixed(r, (("config_format", config_format),)), lambda engine, api, reply: json_object(engine, reply))


# -- weight transfer ----------------------------------------------------------------------------------


def init_weight_transfer_engine(init_info: Mapping[str, Any]) -> Plan[CommandResult]:
    """``POST /init_weight_transfer_engine`` with ``{"init_info": {...}}`` (backend-specific). Never re-sent once it may have arrived."""
    r = route("init_weight_transfer_engine")
    if not isinstance(init_info, Mapping):
        raise TypeError(f"init_weight_transfer_engine init_info must be a mapping, but was {init_info!r}")
    return Plan(r, _fixed(r, body={"init_info": dict(init_info)}), _strict_command("Weight transfer initialized"))


def shutdown_weight_transfer_engine() -> Plan[CommandResult]:
    """``POST /shutdown_weight_transfer_engine`` (0.33.0); 500 during a weight update."""
    r = route("shutdown_weight_transfer_engine")
    return Plan(r, _fixed(r), _strict_command("Weight transfer shut down"))


def start_weight_update() -> Plan[CommandResult]:
    """``POST /start_weight_update`` (0.23.0+): opens the session; 500 when one is open. Never re-sent once it may have arrived."""
    r = route("start_weight_update")
    return Plan(r, _fixed(r), _strict_command("Weight update started"))


def start_draft_weight_update() -> Plan[CommandResult]:
    """``POST /start_draft_weight_update`` (0.33.0); 500 when the backend has no draft support."""
    r = route("start_draft_weight_update")
    return Plan(r, _fixed(r), _strict_command("Draft weight update started"))


def update_weights(update_info: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> Plan[CommandResult]:
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
    return Plan(r, _fixed(r, body={"update_info": payload}), _strict_command("Weights updated"))


def finish_weight_update(weight_version: str | None = None) -> Plan[CommandResult]:
    """``POST /finish_weight_update`` with ``{"weight_version": ...}`` (omitted when None); 500 without a matching start."""
    r = route("finish_weight_update")
    if weight_version is not None and not isinstance(weight_version, str):
        raise TypeError(f"finish_weight_update weight_version must be a string or None, but was {weight_version!r}")
    body = {} if weight_version is None else {"weight_version": weight_version}
    return Plan(r, _fixed(r, body=body), _strict_command("Weight update finished"))


def update_weight_version(new_version: str) -> Plan[WeightInfo]:
    """``POST /update_weight_version`` with ``{"new_version": ...}`` (0.27.0+): the version ``/weight_info`` reports."""
    r = route("update_weight_version")
    if not isinstance(new_version, str) or not new_version:
        raise ValueError(f"update_weight_version new_version must be a non-empty string, but was {new_version!r}")

    def read(engine: str, api: VLLMApi | None, reply: Reply) -> WeightInfo:
        data = json_object(engine, reply, required=("new_version",))
        return WeightInfo(engine, str(data["new_version"]))

    return Plan(r, _fixed(r, body={"new_version": new_version}), read)


def weight_info() -> Plan[WeightInfo]:
    """``GET /weight_info`` (0.27.0+): ``{"weight_version": ...}``."""
    r = route("weight_info")

    def read(engine: str, api: VLLMApi | None, reply: Reply) -> WeightInfo:
        data = json_object(engine, reply, required=("weight_version",))
        version = data["weight_version"]
        return WeightInfo(engine, None if version is None else str(version))

    return Plan(r, _fixed(r), read)


def weight_checker(action: WeightCheckerAction, baseline: Mapping[str, str] | None = None) -> Plan[WeightCheck]:
    """``POST /weight_checker`` (0.33.0): ``checksum`` the weights, ``compare`` them with ``baseline``, or ``reset`` (zeroes them)."""
    r = route("weight_checker")
    if action not in get_args(WeightCheckerAction):
        raise ValueError(f"weight_checker action must be 'checksum', 'reset' or 'compare', but was {action!r}")
    if action == "compare" and baseline is None:
        raise ValueError("weight_checker action='compare' needs a baseline (a checksum answer's checksums)")
    body: dict[str, Any] = {"action": action}
    if baseline is not None:
        body["baseline"] = dict(baseline)

    def read(engine: str, api: VLLMApi | None, reply: Reply) -> WeightCheck:
        if action == "reset":
            json_object(engine, reply, required=("status",))
            return WeightCheck(engine, action)
        if action == "checksum":
            data = json_object(engine, reply, required=("checksums",))
            sums = _typed(engine, reply, data, "checksums", dict)
            return WeightCheck(engine, action, checksums={str(k): str(v) for k, v in sums.items()})
        data = json_object(engine, reply, required=("match", "mismatches"))
        match = _typed(engine, reply, data, "match", bool)
        return WeightCheck(engine, action, match=match, mismatches=tuple(str(m) for m in _typed(engine, reply, data, "mismatches", list)))

    return Plan(r, _fixed(r, body=body), read)


def get_world_size(include_dp: bool = True) -> Plan[int]:
    """``GET /get_world_size?include_dp=``: TP x PP (x DP when ``include_dp``)."""
    r = route("get_world_size")
    _require_bool("get_world_size", "include_dp", include_dp)

    def read(engine: str, api: VLLMApi | None, reply: Reply) -> int:
        return int(_typed(engine, reply, json_object(engine, reply, required=("world_size",)), "world_size", int))

    return Plan(r, _fixed(r, (("include_dp", _flag(include_dp)),)), read)


# -- always mounted ------------------------------------------------------------------------------------


def health() -> Plan[VLLMHealth]:
    """``GET /health``: read by ``health_result`` (the clients never raise from ``health()``)."""
    r = route("health")
    return Plan(r, _fixed(r), lambda engine, api, reply: health_result(engine, reply, 0.0))


def health_result(engine: str, reply: Reply | None, latency_s: float, error: BaseException | None = None) -> VLLMHealth:
    """A health check: healthy on a 200; the status otherwise; the transport error's type name when nothing came."""
    if reply is None:
        return VLLMHealth(engine, False, None, latency_s, error=type(error).__name__ if error is not None else "no response")
    return VLLMHealth(engine, reply.status == 200, reply.status, latency_s)


def version_result(engine: str, reply: Reply) -> VLLMApi:
    """``GET /version``'s ``{"version": "0.33.0"}`` as a ``VLLMApi``; ``VLLMProtocolError`` when it names no release."""
    data = json_object(engine, reply, required=("version",))
    text = data["version"]
    try:
        return VLLMApi.of(text) if isinstance(text, str) else VLLMApi.of("")
    except ValueError:
        raise _malformed(engine, reply, "'version' names no vLLM release") from None


def version() -> Plan[VLLMApi]:
    """``GET /version`` (always mounted, ``serve/instrumentator/basic.py`` l.53)."""
    r = route("version")
    return Plan(r, _fixed(r), lambda engine, api, reply: version_result(engine, reply))


def models() -> Plan[list[str]]:
    """``GET /v1/models``: the served model ids."""
    r = route("models")

    def read(engine: str, api: VLLMApi | None, reply: Reply) -> list[str]:
        data = json_object(engine, reply, required=("data",))
        try:
            return [str(m["id"]) for m in data["data"]]
        except (KeyError, TypeError):
            raise _malformed(engine, reply, "no data[].id") from None

    return Plan(r, _fixed(r), read)


def complete(
    prompt: str,
    *,
    max_tokens: int = 16,
    temperature: float = 0.0,
    model: str | None = None,
    seed: int | None = None,
    extra: Mapping[str, Any] | None = None,
) -> Plan[CompletionResult]:
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

    def read(engine: str, api: VLLMApi | None, reply: Reply) -> CompletionResult:
        data = json_object(engine, reply, required=("choices",))
        choices = data["choices"]
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict) or not isinstance(choices[0].get("text"), str):
            raise _malformed(engine, reply, "no choices[0].text")
        finish = choices[0].get("finish_reason")
        return CompletionResult(choices[0]["text"], None if finish is None else str(finish), data)

    return Plan(r, _fixed(r, body=body), read)
