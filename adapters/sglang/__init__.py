"""SGLang's HTTP control plane, resilient: ``SGLangClient``, ``AsyncSGLangClient`` and ``SGLANG_POLICIES``.

Import every name from here (``from resilience.adapters.sglang import SGLangClient``). The modules behind it have
the jobs and names of ``adapters/vllm/``'s (``client``, ``async_client``, ``routes``, ``calls``, ``state``,
``results``; CONTRIBUTING.md's table), plus SGLang's own: ``policies`` (``SGLANG_POLICIES`` and its variants),
``liveness`` (the dead-engine check behind a proxy) and ``memory_check`` (the memory probe asked before a release
or resume is re-sent). What both kinds share is one level up, in ``adapters/engine_*.py``.
"""

from __future__ import annotations

from resilience.adapters.engine_http import DEFAULT_LIMIT_PER_HOST
from resilience.adapters.sglang.async_client import AsyncSGLangClient
from resilience.adapters.sglang.client import SGLangClient, mount_sglang
from resilience.adapters.sglang.memory_check import MemoryProbeCheck
from resilience.adapters.sglang.policies import (
    SGLANG_ADMIN_PATHS,
    SGLANG_OPEN_PREFIXES,
    SGLANG_POLICIES,
    SGLANG_STRICT_POLICIES,
    sglang_policies,
    with_memory_probe,
)
from resilience.adapters.sglang.results import (
    ControlResult,
    FlushResult,
    GenerateResult,
    Health,
    ModelInfo,
    SGLangAppliedButRefused,
    SGLangAuthError,
    SGLangError,
    SGLangProtocolError,
    SGLangWeightsReleased,
    WeightUpdateResult,
)

__all__ = [
    "DEFAULT_LIMIT_PER_HOST", "SGLANG_ADMIN_PATHS", "SGLANG_OPEN_PREFIXES", "SGLANG_POLICIES", "SGLANG_STRICT_POLICIES",
    "AsyncSGLangClient", "ControlResult", "FlushResult", "GenerateResult", "Health", "MemoryProbeCheck", "ModelInfo",
    "SGLangAppliedButRefused", "SGLangAuthError", "SGLangClient", "SGLangError", "SGLangProtocolError", "SGLangWeightsReleased",
    "WeightUpdateResult", "mount_sglang", "sglang_policies", "with_memory_probe",
]
