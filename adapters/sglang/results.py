"""Typed results and errors of ``SGLangClient``."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from resilience.adapters.answer_error import EngineAnswerError
from resilience.adapters.weights_resident import WeightsNotResident

__all__ = [
    "ControlResult", "FlushResult", "GenerateResult", "Health", "ModelInfo", "SGLangAppliedButRefused", "SGLangAuthError", "SGLangError",
    "SGLangProtocolError", "SGLangWeightsReleased", "WeightUpdateResult",
]

class SGLangError(EngineAnswerError):
    """An SGLang endpoint answered with an error (attributes: ``EngineAnswerError``'s). The clients always pass a delivery
    record: an answer came back, so its last attempt is at least ``RESPONDED`` with ``status``."""


class SGLangProtocolError(SGLangError):
    """An SGLang endpoint answered 2xx with a body that is not what the API promises."""


class SGLangWeightsReleased(WeightsNotResident, SGLangError):
    """Not sent: a weight update (``calls.WEIGHT_PATHS``) to an engine whose ``weights`` this client released and has
    not resumed; SGLang 0.5.23 would write into the freed memory and die. ``resume_memory_occupation(["weights"])`` first."""


class SGLangAuthError(SGLangError):
    """401 or 403: the engine refused the key (or the lack of one). Never retried.

    ``key`` says which key was sent: ``"api_key"``, ``"admin_api_key"`` or None (none was);
    the key itself appears nowhere (SGLang's body is only ``{"error": "Unauthorized"}``).
    """

    def __init__(self, engine: str, endpoint: str, status: int, body: str, *, key: str | None, **kwargs: Any) -> None:
        self.key = key
        if status == 403:
            detail = "forbidden: the route needs an admin API key and the server was started without --admin-api-key"
        elif key is None:
            detail = "unauthorized: no key was sent and the server requires one (pass api_key= or admin_api_key=)"
        else:
            detail = f"unauthorized: the server refused the {key.replace('_', ' ')} this client sent for this route"
        super().__init__(engine, endpoint, status, body, detail=detail, **kwargs)


class SGLangAppliedButRefused(SGLangError):
    """A weight update answered 400 ``success: false`` although the engine *did* load the weights.

    SGLang 0.5.23 (``scheduler_components/weight_updater.py``) writes the weights, then flushes the cache; when requests
    still run or wait (an ``in_place`` pause, or no pause), the flush is refused and the call answers "Weights were
    updated, but the cache was not flushed ...". The engine then serves the new weights with a KV cache from the old
    ones, and its reported weight version was *not* updated. Do not treat it as "nothing happened": finish or retract
    the requests, call ``flush_cache``, then set the version with ``update_weight_version``.
    """

    weights_applied = True
    """Always True: the weights changed on the engine."""


@dataclass(frozen=True, slots=True)
class ControlResult:
    """The answer of a control call (pause, continue, begin/end weight update, abort, release, resume)."""

    engine: str
    endpoint: str
    message: str = ""
    attempts: int = 1
    """Attempts the call took (retries absorbed = attempts - 1)."""
    confirmed_by_probe: bool = False
    """True when the engine's answer was lost (a gateway status, a timeout) and the memory probe proved the call applied."""


@dataclass(frozen=True, slots=True)
class FlushResult:
    """``flush_cache`` finished: how many times it asked and what SGLang said last."""

    engine: str
    message: str
    polls: int


@dataclass(frozen=True, slots=True)
class WeightUpdateResult:
    """A weight-update endpoint's ``{"success": ..., "message": ...}``."""

    engine: str
    endpoint: str
    success: bool
    message: str
    raw: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Health:
    """One health check: healthy, or why not, and how long it took."""

    engine: str
    healthy: bool
    status: int | None
    latency_s: float
    paused_by_us: bool = False
    """True when this client paused the engine: /health would hang ~20 s and 503, so it was not asked."""
    error: str | None = None


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """``/model_info``: the model and its current weight version."""

    engine: str
    model_path: str
    weight_version: str | None
    served_model_name: str | None = None
    raw: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class GenerateResult:
    """A ``/generate`` answer; ``aborted`` when SGLang answered 200 with finish_reason abort."""

    text: str
    output_ids: tuple[int, ...]
    finish_reason: str | None
    meta_info: Mapping[str, Any]

    @property
    def aborted(self) -> bool:
        """True when the request was aborted (by a pause in abort mode, or abort_request)."""
        return self.finish_reason == "abort"
