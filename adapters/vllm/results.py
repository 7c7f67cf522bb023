"""Typed results and errors of ``VLLMClient`` and ``AsyncVLLMClient``.

Every error is a ``VLLMError`` (an ``EngineAnswerError``, as the SGLang client's are). No error, repr or result holds
an API key: vLLM's bodies never echo one, and the client puts the key only in the ``Authorization`` header.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from resilience.adapters.answer_error import EngineAnswerError
from resilience.adapters.weights_resident import WeightsNotResident

__all__ = [
    "AbortResult", "CacheReset", "CommandResult", "CompletionResult", "EngineFaultState", "FaultToleranceAccepted", "FaultToleranceStatus",
    "RpcResult", "SleepResult", "VLLMAuthError", "VLLMDevModeOff", "VLLMError", "VLLMHealth", "VLLMProtocolError", "VLLMRefused",
    "VLLMVersionError", "VLLMWeightsAsleep", "WakeResult", "WeightCheck", "WeightInfo",
]

class VLLMError(EngineAnswerError):
    """A vLLM endpoint answered with an error, or an answer the API does not promise (attributes: ``EngineAnswerError``'s)."""


class VLLMProtocolError(VLLMError):
    """A 2xx answer whose body is not what vLLM 0.33.0 sends (not JSON, a field missing or of the wrong type)."""


class VLLMDevModeOff(VLLMError):
    """404 on a control route: the server runs without ``VLLM_SERVER_DEV_MODE=1``, so none of them is mounted.

    vLLM mounts ``/sleep``, ``/wake_up``, ``/pause``, the weight routes and the rest only in dev mode
    (``entrypoints/launchers/api_server/routers.py`` l.46-53). Never retried: restart the server with it.
    """


class VLLMRefused(VLLMError):
    """A 200 whose body says the engine did not do it (``{"success": false}``, e.g. ``/reset_prefix_cache`` while
    blocks are held, ``serve/dev/cache/api_router.py`` l.31-44). Raised after the route's own retries; never a success.

    ``polls``: how many times it was asked.
    """

    polls: int = 1


class VLLMAuthError(VLLMError):
    """401: the server refused the API key (or its absence) on a ``/v1`` route. Never retried; the key is named, never shown.

    vLLM checks ``--api-key`` only for paths under ``/v1``, ``/v2``, ``/inference``, ``/cohere``
    (``serve/middleware/authenticate.py`` l.11, l.59): control routes are not protected by it.
    """


class VLLMVersionError(VLLMError):
    """The server's version is outside the supported range, or lacks the route or parameter asked for.

    Nothing was sent for the call that raised it (``status`` is the ``/version`` answer's, or None).
    """


class VLLMWeightsAsleep(WeightsNotResident, VLLMError):
    """Not sent: a call that reads or writes the weights (``Route.needs_weights``) while this client knows them asleep.

    The client knows it from its own calls: a ``/sleep`` at level 1 or 2 answered 200, and no ``/wake_up`` since
    that woke the weights (a full wake, a wake of ``weights`` alone, or one that answered ``awake``). vLLM 0.33.0's
    ``GET /is_sleeping`` cannot tell: it is true while merely paused and after ``wake_up(["weights"])`` with the KV
    cache still asleep (``v1/engine/core.py`` l.1078), the two states a weight update is meant for.
    """


@dataclass(frozen=True, slots=True)
class CommandResult:
    """A control call's answer: ``status`` or ``message`` from its JSON body ("paused", "Weights updated"); "" for an empty 200."""

    engine: str
    endpoint: str
    message: str = ""
    attempts: int = 1
    """Attempts the call took (retries absorbed = attempts - 1)."""


@dataclass(frozen=True, slots=True)
class SleepResult:
    """``/sleep``: the level the engine reports sleeping at (the level sent, before 0.33.0's JSON answer)."""

    engine: str
    level: int
    attempts: int = 1


@dataclass(frozen=True, slots=True)
class WakeResult:
    """``/wake_up``: ``awake`` True when every tag is resident, False when some are still asleep.

    None before 0.33.0 (an empty 200 says nothing). A wake of a tag that is not asleep wakes nothing,
    not even the other tags of the call, and answers ``awake`` False (``v1/executor/abstract.py`` l.416-422).
    ``tags``: the tags the server says it woke (None = all).
    """

    engine: str
    awake: bool | None
    tags: tuple[str, ...] | None
    attempts: int = 1


@dataclass(frozen=True, slots=True)
class AbortResult:
    """``/abort_requests``: how many requests the engine aborted."""

    engine: str
    aborted: int
    attempts: int = 1


@dataclass(frozen=True, slots=True)
class CacheReset:
    """``/reset_prefix_cache`` succeeded after ``polls`` asks (``{"success": false}`` answers before it were retried)."""

    engine: str
    polls: int


@dataclass(frozen=True, slots=True)
class RpcResult:
    """``/collective_rpc``: one result per worker, or None for an empty 200 (the method returned None)."""

    engine: str
    results: tuple[Any, ...] | None


@dataclass(frozen=True, slots=True)
class WeightInfo:
    """``/weight_info``: the weight version the engine reports (None = never set)."""

    engine: str
    weight_version: str | None


@dataclass(frozen=True, slots=True)
class WeightCheck:
    """``/weight_checker``: ``checksums`` (action checksum), ``match``/``mismatches`` (compare), or neither (reset)."""

    engine: str
    action: str
    checksums: Mapping[str, str] | None = None
    match: bool | None = None
    mismatches: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class FaultToleranceAccepted:
    """``POST /fault_tolerance/apply``'s 202: the instruction was taken; its recovery runs after the answer, in the background.

    ``request_id``: the id ``fault_tolerance_status`` names in ``last_ft_request_id`` when the instruction failed
    (``entrypoints/serve/fault_tolerance/api_router.py`` l.54-70). Poll ``fault_tolerance_status`` for the outcome.
    """

    engine: str
    request_id: str
    message: str = ""
    attempts: int = 1


@dataclass(frozen=True, slots=True)
class EngineFaultState:
    """One engine core in ``GET /fault_tolerance/status`` (``v1/engine/core_client.py`` l.1177-1182, l.1449-1466).

    ``status``: ``healthy``, ``unhealthy`` (its busy loop raised and waits for an instruction) or ``dead``.
    ``fault_info``: the exception's type while unhealthy. ``last_ft_request_id``/``ft_error``: the last
    instruction that failed on it, and why (None when none did).
    """

    id: int
    status: str
    fault_info: str | None = None
    last_ft_request_id: str | None = None
    ft_error: str | None = None


@dataclass(frozen=True, slots=True)
class FaultToleranceStatus:
    """``GET /fault_tolerance/status``: every engine core this server's client manages."""

    engine: str
    engines: tuple[EngineFaultState, ...]
    attempts: int = 1

    @property
    def healthy(self) -> bool:
        """Every engine core reports ``healthy``."""
        return all(e.status == "healthy" for e in self.engines)


@dataclass(frozen=True, slots=True)
class VLLMHealth:
    """One ``/health``: 200 means the engine core is alive, not that it serves (paused and asleep engines answer 200).

    ``status`` None = no answer (``error`` names the transport error's type). vLLM answers 503 only when the
    engine is dead (``serve/instrumentator/health.py`` l.29-33).
    """

    engine: str
    healthy: bool
    status: int | None
    latency_s: float
    error: str | None = None


@dataclass(frozen=True, slots=True)
class CompletionResult:
    """``/v1/completions`` (non-streaming): the first choice's text and finish reason ("abort" after an abort pause)."""

    text: str
    finish_reason: str | None
    raw: Mapping[str, Any] = field(default_factory=dict)

    @property
    def aborted(self) -> bool:
        """True when the request was aborted (a pause or sleep in ``abort`` mode, or ``/abort_requests``)."""
        return self.finish_reason == "abort"
