"""SGLang's HTTP control plane, resilient: ``SGLangClient``, ``AsyncSGLangClient`` and ``SGLANG_POLICIES``.

Import every name from here (``from resilience.adapters.sglang import SGLangClient``).
The modules behind it, one job each, named as in ``adapters/vllm/`` where the job is the same:

- ``client.py`` / ``async_client.py``: ``SGLangClient`` (requests) and ``mount_sglang`` /
  ``AsyncSGLangClient`` (aiohttp by default, or httpx), twins that differ only in ``await``;
- ``routes.py``: the table both clients are held to (route, parameters, result, policy);
- ``calls.py``: what each method sends and what its answer means (no I/O);
- ``state.py``: what both clients remember; ``results.py``: the typed results and errors;
- ``policies.py``: ``SGLANG_POLICIES`` and its variants;
- SGLang's own: ``liveness.py`` (the dead-engine check behind a proxy), ``memory_check.py``
  (the memory probe asked before a release or resume is re-sent).

What both kinds share is one level up: ``adapters/engine_http.py`` (the answer, the async
sender, the own async session), ``engine_state.py`` (the engine, its keys), ``engine_session.py``
(the own session's driver settings, checked one way).
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
    "DEFAULT_LIMIT_PER_HOST",
    "SGLANG_ADMIN_PATHS",
    "SGLANG_OPEN_PREFIXES",
    "SGLANG_POLICIES",
    "SGLANG_STRICT_POLICIES",
    "AsyncSGLangClient",
    "ControlResult",
    "FlushResult",
    "GenerateResult",
    "Health",
    "MemoryProbeCheck",
    "ModelInfo",
    "SGLangAppliedButRefused",
    "SGLangAuthError",
    "SGLangClient",
    "SGLangError",
    "SGLangProtocolError",
    "SGLangWeightsReleased",
    "WeightUpdateResult",
    "mount_sglang",
    "sglang_policies",
    "with_memory_probe",
]
