"""SGLang's HTTP control plane, resilient: ``SGLangClient``, ``AsyncSGLangClient`` and ``SGLANG_POLICIES``.

Import every name from here (``from resilience.adapters.sglang import SGLangClient``);
the modules behind it, one job each:

- ``client.py``: ``SGLangClient`` (requests) and ``mount_sglang``;
- ``async_client.py``: ``AsyncSGLangClient`` (aiohttp by default, or httpx), over
  ``async_http.py``'s request helpers;
- ``methods.py``: the method table both clients are held to (route, parameters,
  result, policy), ``calls.py``: what they send and what the answers mean (no I/O),
  ``state.py``: what they remember, ``liveness.py``: the dead-engine check behind
  a proxy, ``own_session.py``: the driver settings of a client's own session;
- ``policies.py``: ``SGLANG_POLICIES`` and its variants, ``memory_check.py``: the
  memory probe asked before a release or resume is re-sent;
- ``results.py``: the typed results and errors.
"""

from __future__ import annotations

from resilience.adapters.sglang.async_client import DEFAULT_LIMIT_PER_HOST, AsyncSGLangClient
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
