"""What an SGLang client sends, and what the answers mean: shared by ``SGLangClient`` and ``AsyncSGLangClient``.

No I/O here. A client method builds a ``Call`` (method, path, JSON body, query), its transport turns the engine's answer
into an ``Answer`` (status, text, attempts), and a parser here turns that into a typed result or raises the typed error.
The sync and async clients differ only in how they send, so they cannot drift apart. ``routes.py`` lists every client
method with its route and result; ``state.py`` holds what both clients remember; ``liveness.py`` decides whether an
engine behind a proxy is dead.
"""

from __future__ import annotations

import enum
import itertools
import json as jsonlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from resilience.adapters.answer_error import parse_object
from resilience.adapters.engine_http import Answer, answer_records
from resilience.adapters.engine_steps import Steps, value_of
from resilience.adapters.sglang import results
from resilience.adapters.sglang.policies import SGLANG_ADMIN_PATHS, SGLANG_OPEN_PREFIXES
from resilience.deadline import Deadline
from resilience.engine_contract import ALL_TAGS
from resilience.errors import DeadlineExceeded
from resilience.outcome import AttemptRecord

__all__ = [
    "WEIGHT_PATHS", "Call", "StreamEnd", "auth_headers", "control_result", "flush_gave_up", "flush_outcome",
    "flush_server_wait", "flush_steps", "generate_result", "health_result", "json_of", "key_for", "model_info_result", "post",
    "models_result", "paused_health", "raise_if_refused", "require_ok", "json_object", "sse_line", "weights_result",
]

NOT_IDLE = ("Timed out waiting for idle state", "Flush cache failed", "Another flush_cache is already in progress")
"""``/flush_cache`` 400 answers that mean "busy, ask again" (``scheduler.py``, ``flush_wrapper.py``)."""

WEIGHT_PATHS: frozenset[str] = frozenset({
    "/begin_weight_update", "/end_weight_update", "/update_weights_from_tensor", "/update_weights_from_distributed",
    "/update_weights_from_disk",
})
"""The routes that read or write the weights: both clients refuse them, unsent, while ``weights`` is released
(``SGLangWeightsReleased``; why, with SGLang's lines: ``resilience.adapters.weights_resident``)."""

APPLIED_NOT_FLUSHED = "Weights were updated, but the cache was not flushed"
"""The start of a weight update's 400 message when the weights were loaded but the cache flush was refused."""

FLUSH_SERVER_WAIT_CAP_S = 30.0
"""The longest ``?timeout=`` a flush asks SGLang to wait for idle in one request."""


# -- the value that crosses the transport (the answer is ``engine_http.Answer``) ---------


@dataclass(frozen=True, slots=True)
class Call:
    """One request to send: ``method``, ``path``, a JSON ``body`` (None = no body) and query ``params``."""

    method: str
    path: str
    body: dict[str, Any] | None = None
    params: Mapping[str, str] | None = None

    @property
    def endpoint(self) -> str:
        """``"POST /pause_generation"``: how errors and results name the call."""
        return f"{self.method} {self.path}"


class StreamEnd(enum.Enum):
    """``sse_line``'s answer for the ``data: [DONE]`` line."""

    DONE = "[DONE]"


# -- what to send ----------------------------------------------------------------


def key_for(path: str, api_key: str | None, admin_api_key: str | None) -> tuple[str | None, str | None]:
    """The key this route's SGLang auth level asks for, as (name, key); (None, None) = send none."""
    if path.startswith(SGLANG_OPEN_PREFIXES):
        return None, None
    if path in SGLANG_ADMIN_PATHS and admin_api_key:
        return "admin_api_key", admin_api_key
    if api_key:
        return "api_key", api_key
    return None, None


def auth_headers(key: str | None) -> dict[str, str] | None:
    """The ``Authorization: Bearer`` header for ``key``, or None."""
    return {"Authorization": f"Bearer {key}"} if key else None


def pause_call(mode: str) -> Call:
    """``POST /pause_generation``; ``mode`` must be abort, retract or in_place."""
    if mode not in ("abort", "retract", "in_place"):
        raise ValueError(f"pause mode must be 'abort', 'retract' or 'in_place', but was {mode!r}")
    return Call("POST", "/pause_generation", {"mode": mode})


def continue_call(torch_empty_cache: bool) -> Call:
    """``POST /continue_generation``."""
    return Call("POST", "/continue_generation", {"torch_empty_cache": torch_empty_cache})


def flush_call(server_wait_s: float) -> Call:
    """``POST /flush_cache?timeout=`` with the seconds SGLang itself waits for idle (0 = flush now or refuse)."""
    return Call("POST", "/flush_cache", params={"timeout": f"{server_wait_s:.3f}"})


def abort_call(rid: str | None, abort_all: bool) -> Call:
    """``POST /abort_request`` for requests whose rid starts with ``rid``, or all."""
    if rid is None and not abort_all:
        raise ValueError("abort_request needs a rid or abort_all=True")
    return Call("POST", "/abort_request", {"rid": rid or "", "abort_all": abort_all})


def memory_call(path: str, tags: Sequence[str] | None) -> Call:
    """``POST /release_memory_occupation`` or ``/resume_memory_occupation`` for ``tags`` (None = all)."""
    return Call("POST", path, {"tags": list(tags) if tags else None})


def memory_tags(tags: Sequence[str] | None) -> tuple[str, ...]:
    """The tags a release or resume of ``tags`` touches (None or empty = ``ALL_TAGS``)."""
    return tuple(tags) if tags else ALL_TAGS


def generate_call(
    text: str | None, input_ids: Sequence[int] | None, sampling_params: Mapping[str, Any] | None, rid: str | None, *, stream: bool
) -> Call:
    """``POST /generate`` with exactly one of ``text`` or ``input_ids``."""
    if (text is None) == (input_ids is None):
        raise ValueError("generate needs exactly one of text or input_ids")
    ids = None if input_ids is None else list(input_ids)
    return post("/generate", sampling_params=dict(sampling_params or {}), stream=stream, text=text, input_ids=ids, rid=rid)


def post(path: str, **fields: Any) -> Call:
    """A ``POST`` of ``path`` whose JSON body holds the ``fields`` given (a None one is left out, as SGLang's default)."""
    return Call("POST", path, {name: value for name, value in fields.items() if value is not None})


def read_call(path: str) -> Call:
    """A GET of one of the read routes (``/health``, ``/ready``, ``/server_info``, ``/model_info``, ``/v1/models``, ``/v1/loads``)."""
    return Call("GET", path, params={"include": "core"} if path == "/v1/loads" else None)


def flush_server_wait(wait_for_idle: bool, remaining_s: float) -> float:
    """The ``?timeout=`` of the next flush: 1 s less than what is left, at most 30 s; 0 when not waiting."""
    return max(0.0, min(remaining_s - 1.0, FLUSH_SERVER_WAIT_CAP_S)) if wait_for_idle else 0.0


# -- what the answer means -------------------------------------------------------------


def raise_if_refused(engine: str, answer: Answer, key_name: str | None) -> Answer:
    """Raise ``SGLangAuthError`` on a 401/403 (never retried), naming which key was sent, never the key."""
    if answer.status in (401, 403):
        raise results.SGLangAuthError.of(engine, answer, key=key_name)
    return answer


def require_ok(engine: str, answer: Answer) -> Answer:
    """``answer`` when its status is below 400, else ``SGLangError`` with the status and a body excerpt."""
    if not answer.ok:
        raise results.SGLangError.of(engine, answer)
    return answer


def json_of(engine: str, answer: Answer) -> Any:
    """The JSON body of a successful answer; ``SGLangProtocolError`` when it is not JSON."""
    require_ok(engine, answer)
    try:
        return jsonlib.loads(answer.text)
    except ValueError:
        raise results.SGLangProtocolError.of(engine, answer, "answer is not JSON") from None


def control_result(engine: str, answer: Answer) -> results.ControlResult:
    """A control call's answer: its ``message`` when the body is a JSON object that has one."""
    require_ok(engine, answer)
    data = parse_object(answer.text) if answer.text else None
    message = str(data.get("message", "")) if data is not None else ""
    return results.ControlResult(engine, answer.endpoint, message, answer.attempts, confirmed_by_probe=answer.confirmed_by_probe)


def weights_result(engine: str, answer: Answer) -> results.WeightUpdateResult:
    """A weight-update answer ``{"success", "message"}``; a refusal raises, an applied-but-refused update says so."""
    if answer.status == 400:
        data = parse_object(answer.text)
        if data is not None and data.get("success") is False:
            message = str(data.get("message", ""))
            if message.startswith(APPLIED_NOT_FLUSHED):
                raise results.SGLangAppliedButRefused.of(engine, answer, "weights applied, cache not flushed")
            raise results.SGLangError.of(engine, answer, f"refused: {message}")
    data = json_of(engine, answer)
    if not isinstance(data, dict) or "success" not in data:
        raise results.SGLangProtocolError.of(engine, answer, "no 'success' field")
    if not data["success"]:
        raise results.SGLangError.of(engine, answer, f"refused: {data.get('message', '')}")
    return results.WeightUpdateResult(engine, answer.endpoint, True, str(data.get("message", "")), data)


def flush_outcome(engine: str, answer: Answer, *, polls: int, remaining_s: float, poll_s: float) -> results.FlushResult | None:
    """A flush's answer: the result when flushed, None to ask again after ``poll_s``, else raise.

    "Not idle" answers (400 with one of ``NOT_IDLE``) are asked again while more
    than ``poll_s`` of the flush deadline is left; any other error raises at once.
    """
    if answer.ok:
        return results.FlushResult(engine, answer.text.strip(), polls)
    not_idle = answer.status == 400 and any(text in answer.text for text in NOT_IDLE)
    if not not_idle:
        raise results.SGLangError.of(engine, answer)
    if remaining_s <= poll_s:
        raise flush_gave_up(engine, answer, polls)
    return None


def flush_steps(engine: str, wait_for_idle: bool, deadline_s: float, poll_s: float) -> Steps[Call | float, results.FlushResult]:
    """``flush_cache`` as steps (``engine_steps``): a flush ``Call``, then ``poll_s`` seconds to wait after each
    "not idle", until flushed (the ``FlushResult``) or ``deadline_s`` from now ends (``flush_gave_up``).

    ``wait_for_idle``: pass the remaining time as ``?timeout=`` (``flush_server_wait``). A ``DeadlineExceeded``
    from the transport after a "not idle" answer is that answer's ``flush_gave_up`` (the cause kept).
    """
    with Deadline(deadline_s) as deadline:
        last: Answer | None = None
        for polls in itertools.count(1):
            answer, error = yield flush_call(flush_server_wait(wait_for_idle, deadline.remaining()))
            if isinstance(error, DeadlineExceeded) and last is not None:
                raise flush_gave_up(engine, last, polls - 1) from error
            if error is not None:
                raise error
            result = flush_outcome(engine, answer, polls=polls, remaining_s=deadline.remaining(), poll_s=poll_s)
            if result is not None:
                return result
            last = answer
            value_of((yield poll_s))
    raise AssertionError("unreachable")


def flush_gave_up(engine: str, last_not_idle: Answer, polls: int) -> results.SGLangError:
    """The error of a flush whose deadline ended while the engine still answered "not idle".

    Raised both when too little time is left for another poll and when the deadline runs out during the pause before the
    next one (the transport's ``DeadlineExceeded`` is then its cause): the caller learns the same thing.
    """
    return results.SGLangError.of(engine, last_not_idle, f"still not idle after {polls} tries before the deadline")


def health_result(engine: str, answer: Answer | None, latency_s: float, error: BaseException | None = None) -> results.Health:
    """A health check: the answer's status, or the transport error's type name when none came."""
    if answer is None:
        return results.Health(engine, False, None, latency_s, error=type(error).__name__ if error is not None else "no response")
    return results.Health(engine, answer.ok, answer.status, latency_s)


def paused_health(engine: str) -> results.Health:
    """What ``health()`` reports for an engine this client paused (without asking: /health would hang)."""
    return results.Health(engine, True, None, 0.0, paused_by_us=True)


def json_object(engine: str, answer: Answer, *required: str) -> dict[str, Any]:
    """The answer's JSON object (``/server_info``'s), with the ``required`` fields; ``SGLangProtocolError`` otherwise."""
    data = json_of(engine, answer)
    if not isinstance(data, dict):
        raise results.SGLangProtocolError.of(engine, answer, "answer is not an object")
    for name in required:
        if name not in data:
            raise results.SGLangProtocolError.of(engine, answer, f"no {name!r} field")
    return data


def model_info_result(engine: str, answer: Answer) -> results.ModelInfo:
    """``/model_info`` with its weight version."""
    data = json_object(engine, answer, "model_path")
    version = data.get("weight_version")
    weight_version = None if version is None else str(version)
    return results.ModelInfo(engine, str(data["model_path"]), weight_version, data.get("served_model_name"), data)


def loads_result(engine: str, answer: Answer) -> dict[str, Any]:
    """``/v1/loads``: the object, or ``{"loads": ...}`` around anything else."""
    data = json_of(engine, answer)
    return data if isinstance(data, dict) else {"loads": data}


def models_result(engine: str, answer: Answer) -> list[str]:
    """``/v1/models``: the ``data[].id`` list."""
    data = json_of(engine, answer)
    try:
        return [str(m["id"]) for m in data["data"]]
    except (KeyError, TypeError):
        raise results.SGLangProtocolError.of(engine, answer, "no data[].id") from None


def generate_result(engine: str, answer: Answer) -> results.GenerateResult:
    """A non-streaming ``/generate`` answer."""
    return generate_chunk(json_object(engine, answer))


def generate_chunk(data: Mapping[str, Any]) -> results.GenerateResult:
    """One ``/generate`` output object (a whole answer, or one SSE chunk) as a ``GenerateResult``."""
    meta = data.get("meta_info") or {}
    finish = meta.get("finish_reason")
    reason = finish.get("type") if isinstance(finish, dict) else finish
    return results.GenerateResult(
        text=str(data.get("text", "")),
        output_ids=tuple(int(i) for i in data.get("output_ids") or ()),
        finish_reason=None if reason is None else str(reason),
        meta_info=meta,
    )


def sse_line(engine: str, endpoint: str, line: str, records: tuple[AttemptRecord, ...] = ()) -> results.GenerateResult | StreamEnd | None:
    """One line of a streaming ``/generate``: a result, ``StreamEnd.DONE`` at ``[DONE]``, None for other lines.

    ``records``: the stream's delivery record, put on a protocol error (default: the one 200 that opened the stream).
    """
    if not line or not line.startswith("data:"):
        return None
    payload = line[len("data:") :].strip()
    if payload == StreamEnd.DONE.value:
        return StreamEnd.DONE
    try:
        chunk = jsonlib.loads(payload)
    except ValueError:
        detail = "bad SSE chunk"
    else:
        if isinstance(chunk, dict):
            return generate_chunk(chunk)
        detail = "SSE chunk is not an object"
    raise results.SGLangProtocolError(engine, endpoint, 200, payload, detail=detail, attempts=answer_records(records, 200)[0])
