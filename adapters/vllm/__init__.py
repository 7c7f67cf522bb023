"""vLLM engines: ``VLLMClient`` and ``AsyncVLLMClient``, one method per control route of vLLM 0.33.0.

The modules have the jobs and names of ``adapters/sglang/``'s (``client``, ``async_client``, ``routes``: the one
table ``ROUTES`` and ``VLLM_POLICIES`` derived from it, ``calls``: one ``Plan`` per client method, ``state``,
``results``), plus vLLM's own: ``answers`` (the rules every answer goes through: dev mode, refusals, the version
gate), ``versions`` (``GET /version`` read into a ``VLLMApi``: the drift between releases and the supported range),
``engine`` (``VLLMEngine`` / ``AsyncVLLMEngine``, a server as the barrier drives it) and ``weights``
(``push_weights``, one weight-transfer session with each route's idempotence). What both kinds share is one level
up, in ``adapters/engine_*.py``.

What vLLM does differently from SGLang, and how the clients handle it: ``docs/vllm.md`` (from
``shared/reference/vllm-control-plane.md``).
"""

from resilience.adapters.vllm.answers import VLLMPauseMode, WeightCheckerAction
from resilience.adapters.vllm.async_client import AsyncVLLMClient
from resilience.adapters.vllm.client import VLLMClient, mount_vllm
from resilience.adapters.vllm.engine import VLLM_PAUSE_MODES, VLLM_TAGS, AsyncVLLMEngine, VLLMEngine
from resilience.adapters.vllm.results import (
    AbortResult,
    CacheReset,
    CommandResult,
    CompletionResult,
    EngineFaultState,
    FaultToleranceAccepted,
    FaultToleranceStatus,
    RpcResult,
    SleepResult,
    VLLMAuthError,
    VLLMDevModeOff,
    VLLMError,
    VLLMHealth,
    VLLMProtocolError,
    VLLMRefused,
    VLLMVersionError,
    VLLMWeightsAsleep,
    WakeResult,
    WeightCheck,
    WeightInfo,
)
from resilience.adapters.vllm.routes import ROUTES, VLLM_POLICIES, Route
from resilience.adapters.vllm.versions import SUPPORTED, VLLMApi
from resilience.adapters.vllm.weights import WeightPush, WeightPushAmbiguous, WeightPushFailed, apush_weights, push_weights

__all__ = [
    "ROUTES", "SUPPORTED", "VLLM_PAUSE_MODES", "VLLM_POLICIES", "VLLM_TAGS", "AbortResult", "AsyncVLLMClient", "AsyncVLLMEngine",
    "CacheReset", "CommandResult", "CompletionResult", "EngineFaultState", "FaultToleranceAccepted", "FaultToleranceStatus", "Route",
    "RpcResult", "SleepResult", "VLLMApi", "VLLMAuthError", "VLLMClient", "VLLMDevModeOff", "VLLMEngine", "VLLMError", "VLLMHealth",
    "VLLMPauseMode", "VLLMProtocolError", "VLLMRefused", "VLLMVersionError", "VLLMWeightsAsleep", "WakeResult", "WeightCheck",
    "WeightCheckerAction", "WeightInfo", "WeightPush", "WeightPushAmbiguous", "WeightPushFailed", "apush_weights", "mount_vllm",
    "push_weights",
]
