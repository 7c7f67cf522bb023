"""The values between a vLLM client and its transport, and the rules every answer goes through; no I/O.

A ``Plan`` (built per client method in ``calls``) holds its ``Route`` (``routes.ROUTES``), how to build the ``Request``
for the server's release (``VLLMApi``, the drift), and how to read the ``Answer`` into a typed result. ``VLLMClient``
and ``AsyncVLLMClient`` differ only in how they send, so they cannot drift apart. Here too: ``gate`` (a call this
release cannot take is refused unsent), ``key_header``, and the readers' shared parts.

Every answer goes through ``check_reply`` first:

- 401: ``VLLMAuthError`` naming the key sent (never the key).
- 404 on a route mounted only in dev mode: ``VLLMDevModeOff``.
- any other status >= 400: ``VLLMError`` with the status and a body excerpt.
- a 200 whose JSON object says ``"success": false``: ``VLLMRefused``. The client asks again only where the route allows
  it (``Route.refusals_retried``: ``/reset_prefix_cache``, whose docstring says "callers may retry", until the call's
  deadline) and raises it after; it is never returned as a success.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar, get_args

from resilience.adapters.answer_error import parse_object
from resilience.adapters.engine_http import Answer
from resilience.adapters.vllm import results
from resilience.adapters.vllm.routes import Route
from resilience.adapters.vllm.versions import MODE_PARAMS, Version, VLLMApi, format_version

__all__ = [
    "API_KEY_PREFIXES", "Plan", "Request", "VLLMPauseMode", "WeightCheckerAction", "check_mode", "check_reply", "command_reader", "fixed",
    "flag", "flag_reader", "gate", "health_result", "json_object", "key_header", "malformed", "needs_mode", "refusal_wait", "require_bool",
    "strict_command", "typed_field", "version_result",
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

    @property
    def method(self) -> str:
        """``"POST"``."""
        return self.route.method

    @property
    def path(self) -> str:
        """``"/sleep"``."""
        return self.route.path


@dataclass(frozen=True, slots=True)
class Plan(Generic[T]):
    """One client call, before it is sent: the route, how to build its request for a release, and how to read the answer.

    ``build(engine, api)``: the ``Request`` (``api`` None for routes that are not ``versioned``); raises
    ``VLLMVersionError`` when this release cannot take it. ``read(engine, api, answer)``: the typed result (after
    ``check_reply``). ``refusal_deadline_s``/``poll_s``: for a route whose refusals are asked again, how long and how
    often (None = not asked again).
    """

    route: Route
    build: Callable[[str, VLLMApi | None], Request]
    read: Callable[[str, VLLMApi | None, Answer], T]
    refusal_deadline_s: float | None = None
    poll_s: float = DEFAULT_RESET_POLL_S


# -- before sending ------------------------------------------------------------------


def gate(engine: str, r: Route, api: VLLMApi | None) -> None:
    """Refuse, before sending, a call this server cannot take: an unsupported release, or a route added later."""
    if not r.versioned:
        return
    if api is None:
        raise results.VLLMVersionError(engine, r.endpoint, None, "", detail="not sent: the server's vLLM version is not known")
    if not api.supported:
        raise results.VLLMVersionError(
            engine,
            "GET /version",
            200,
            api.text,
            detail=f"vLLM {api.text} is outside the supported range {api.range_text()}; {r.endpoint} not sent",
        )
    if not api.at_least(r.since):
        raise results.VLLMVersionError(
            engine, r.endpoint, None, "", detail=f"not sent: vLLM {api.text} has no {r.endpoint} (added in {format_version(r.since)})"
        )


def key_header(path: str, api_key: str | None) -> dict[str, str] | None:
    """The ``Authorization: Bearer`` header for paths vLLM guards with ``--api-key``; None elsewhere or without a key."""
    return {"Authorization": f"Bearer {api_key}"} if api_key and path.startswith(API_KEY_PREFIXES) else None


def flag(value: bool) -> str:
    return "true" if value else "false"


def require_bool(owner: str, name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{owner} {name} must be True or False, but was {value!r}")
    return value


def check_mode(owner: str, mode: object) -> VLLMPauseMode | None:
    if mode is not None and mode not in get_args(VLLMPauseMode):
        raise ValueError(f"{owner} mode must be 'abort', 'wait', 'keep' or None, but was {mode!r}")
    return mode  # type: ignore[return-value]  # checked just above


def needs_mode(engine: str, r: Route, api: VLLMApi) -> None:
    if not api.mode_params:
        raise results.VLLMVersionError(
            engine, r.endpoint, None, "", detail=f"not sent: vLLM {api.text} takes no mode= (added in {format_version(MODE_PARAMS)})"
        )


Builder = Callable[[str, VLLMApi | None], Request]
"""``Plan.build``: the request for one engine and release."""


def fixed(r: Route, params: tuple[tuple[str, str], ...] = (), body: dict[str, Any] | None = None) -> Builder:
    request = Request(r, params, body)
    return lambda engine, api: request


# -- after the answer ------------------------------------------------------------------


def malformed(engine: str, answer: Answer, detail: str) -> results.VLLMProtocolError:
    """The error for a 2xx answer that is not what 0.33.0 sends: endpoint, status, ``detail`` and a body excerpt."""
    return results.VLLMProtocolError.of(engine, answer, detail)


def check_reply(engine: str, r: Route, api: VLLMApi | None, answer: Answer, *, key_sent: bool = False) -> Answer:
    """``answer`` when it is a success; else the typed error (see the module docstring for the rules)."""
    if answer.status == 401:
        sent = "the server refused the API key this client sent" if key_sent else "no API key was sent (pass api_key=)"
        raise results.VLLMAuthError.of(engine, answer, f"unauthorized: {sent}")
    dev_only = r.dev_mode_since is not None and (api is None or api.at_least(r.dev_mode_since))
    if answer.status == 404 and dev_only:
        detail = (
            f"vLLM mounts {r.path} only in dev mode and this server runs without it: "
            "start it with VLLM_SERVER_DEV_MODE=1 (the control routes answer 404 otherwise)"
        )
        raise results.VLLMDevModeOff.of(engine, answer, detail)
    if answer.status == 404 and r.mounted_by is not None:
        raise results.VLLMError.of(engine, answer, f"vLLM mounts {r.path} only with {r.mounted_by} and this server runs without it")
    if answer.status >= 400:
        raise results.VLLMError.of(engine, answer)
    data = parse_object(answer.text) if answer.text else None
    if data is not None and data.get("success") is False:
        refused = results.VLLMRefused.of(engine, answer, _refusal_detail(r, answer.polls))
        refused.polls = answer.polls
        raise refused
    return answer


def _refusal_detail(r: Route, polls: int) -> str:
    asked = f" (asked {polls} times)" if polls > 1 else ""
    return f'the engine answered "success": false{asked}: not done' + (", blocks are still held" if r.name == "reset_prefix_cache" else "")


def refusal_wait(plan: Plan[Any], remaining_s: float) -> float | None:
    """After a ``success: false``: the seconds to wait before asking again, or None to raise the refusal.

    Asked again only on a route that allows it, and only while at least one poll interval is left of the deadline.
    """
    if not plan.route.refusals_retried or plan.refusal_deadline_s is None:
        return None
    return plan.poll_s if remaining_s > plan.poll_s else None


def json_object(engine: str, answer: Answer, *, required: Sequence[str] = ()) -> dict[str, Any]:
    """The answer's JSON object; ``VLLMProtocolError`` when it is not one or lacks a ``required`` field."""
    data = parse_object(answer.text)
    if data is None:
        raise malformed(engine, answer, "answer is not a JSON object")
    missing = [name for name in required if name not in data]
    if missing:
        raise malformed(engine, answer, f"no {', '.join(repr(m) for m in missing)} field")
    return data


def typed_field(engine: str, answer: Answer, data: Mapping[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    value = data.get(name)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise malformed(engine, answer, f"{name!r} is not {_kind_name(kind)}")
    return value


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join("null" if k is type(None) else k.__name__ for k in kinds)


def command_reader(engine: str, api: VLLMApi | None, answer: Answer) -> results.CommandResult:
    """A control answer: its ``status`` or ``message`` field; an empty 200 is allowed where vLLM sends one."""
    if not answer.text:
        return results.CommandResult(engine, answer.endpoint, "", answer.attempts)
    data = json_object(engine, answer)
    message = data.get("status", data.get("message", ""))
    return results.CommandResult(engine, answer.endpoint, str(message), answer.attempts)


def strict_command(
    expected: str, field_name: str = "message", *, lenient_before: Version | None = None
) -> Callable[[str, VLLMApi | None, Answer], results.CommandResult]:
    """A reader that wants ``{field_name: ...}`` (0.33.0 sends ``expected`` there); the value is kept as the message.

    ``lenient_before``: releases older than this are read as ``_command`` reads (any JSON object, or an
    empty 200), since what they answered was not read (default None: strict on every release).
    """

    def read(engine: str, api: VLLMApi | None, answer: Answer) -> results.CommandResult:
        if lenient_before is not None and api is not None and not api.at_least(lenient_before):
            return command_reader(engine, api, answer)
        data = json_object(engine, answer, required=(field_name,))
        return results.CommandResult(engine, answer.endpoint, str(data[field_name]), answer.attempts)

    return read


def flag_reader(name: str) -> Callable[[str, VLLMApi | None, Answer], bool]:
    def read(engine: str, api: VLLMApi | None, answer: Answer) -> bool:
        return bool(typed_field(engine, answer, json_object(engine, answer, required=(name,)), name, bool))

    return read


def health_result(engine: str, answer: Answer | None, latency_s: float, error: BaseException | None = None) -> results.VLLMHealth:
    """A health check: healthy on a 200; the status otherwise; the transport error's type name when nothing came."""
    if answer is None:
        return results.VLLMHealth(engine, False, None, latency_s, error=type(error).__name__ if error is not None else "no response")
    return results.VLLMHealth(engine, answer.status == 200, answer.status, latency_s)


def version_result(engine: str, answer: Answer) -> VLLMApi:
    """``GET /version``'s ``{"version": "0.33.0"}`` as a ``VLLMApi``; ``VLLMProtocolError`` when it names no release."""
    data = json_object(engine, answer, required=("version",))
    text = data["version"]
    try:
        return VLLMApi.of(text) if isinstance(text, str) else VLLMApi.of("")
    except ValueError:
        raise malformed(engine, answer, "'version' names no vLLM release") from None
