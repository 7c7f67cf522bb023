"""The one table of vLLM routes the clients speak (``ROUTES``, one ``Route`` per client method of both clients,
pinned by ``tests/vllm/test_route_table.py``), and ``VLLM_POLICIES`` derived from it: the retry layer and the
clients cannot disagree.

Idempotence, from the 0.33.0 source (reference section 5):

- ``/sleep``, ``/wake_up``: memory transitions are no-ops when repeated (``v1/executor/abstract.py`` l.400 "Executor is
  already sleeping.", l.416 "Executor is not sleeping."), so a re-send after a timeout or a gateway status is safe;
  unlike SGLang, where a second release kills the process.
- ``/pause``, ``/resume``, ``/abort_requests``, the cache resets, ``/update_weight_version``, ``/weight_checker``: the
  state is overwritten, a repeat changes nothing more. (That ``/resume`` and a full ``/wake_up`` reopen a pause someone
  else holds is the barrier's concern: it never sends them then.)
- ``/update_weights`` is a collective with the trainer: a re-send while the first still applies queues behind it and
  waits for a broadcast that never comes (prime-rl #3599). It is **never re-sent once it may have arrived**: only a
  refused connection (nothing left the client) is retried, and a gateway status is handed back. So are the session
  routes (a second ``/start_weight_update`` or ``/finish_weight_update`` answers 500), ``/init_weight_transfer_engine``
  (it re-creates the NCCL group), ``/release_kv_cache_memory`` (a second call answers 500), ``/collective_rpc`` (an
  arbitrary worker method) and ``/fault_tolerance/apply`` (a ``retry`` runs a collective recovery in the background: a
  second one while the first runs would race it; once it is done, the engine rejects it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from resilience.adapters.engine_retries import CONTROL_RETRY, NO_STATUS_RETRY, READ_RETRY
from resilience.adapters.vllm.versions import (
    OLDEST,
    PAUSE_NEEDS_DEV_MODE,
    WEIGHT_SESSION,
    WEIGHT_TRANSFER,
    WEIGHT_VERSION_ROUTES,
    Version,
)
from resilience.policy import EndpointPolicy, PolicyTable

__all__ = ["CONTROL_ROUTES", "ROUTES", "VLLM_POLICIES", "Route", "route"]

_V033: Final[Version] = (0, 33, 0)

# The retry rules are SGLANG_POLICIES' (``engine_retries.py``: a dead URL fails in ~5 s).
_LONG = EndpointPolicy(retry=CONTROL_RETRY, idempotent=True, attempt_timeout_s=120, deadline_s=300)
"""Sleep, wake, pause, ``/weight_checker``: re-sent on timeouts and 502/503/504 (idempotent), with room for a
``mode=wait`` that answers once every running request finished and for hashing every weight on every worker."""
_CONTROL = EndpointPolicy(retry=CONTROL_RETRY, idempotent=True, attempt_timeout_s=30, deadline_s=120)
_ONCE = EndpointPolicy(retry=CONTROL_RETRY, idempotent=False, retry_statuses_if_not_idempotent=False, attempt_timeout_s=60, deadline_s=120)
"""Sent again only when it provably never left (a refused connection); a gateway status is handed back."""
_UPDATE = EndpointPolicy(
    retry=CONTROL_RETRY, idempotent=False, retry_statuses_if_not_idempotent=False, attempt_timeout_s=600, deadline_s=900
)
"""``/update_weights``: as ``_ONCE``, with room for a large chunk over NCCL."""
_RPC = EndpointPolicy(retry=CONTROL_RETRY, idempotent=False, retry_statuses_if_not_idempotent=False, attempt_timeout_s=120, deadline_s=300)
_READ = EndpointPolicy(retry=READ_RETRY, idempotent=True, attempt_timeout_s=10, deadline_s=30)
_COMPLETION = EndpointPolicy(retry=NO_STATUS_RETRY, idempotent=False, attempt_timeout_s=None, deadline_s=None)
"""Generation is never re-sent once it may have arrived; an abort/wait pause's 503 is handed back (back-pressure)."""


@dataclass(frozen=True, slots=True)
class Route:
    """One route as the clients speak it.

    ``name``: the client method. ``method``/``path``: the HTTP route. ``since``: the first release that has it (older
    servers get ``VLLMVersionError``, nothing sent). ``dev_mode_since``: the first release that mounts it only with
    ``VLLM_SERVER_DEV_MODE=1`` (None = always mounted): a 404 there raises ``VLLMDevModeOff``.
    ``refusals_retried``: a 200 ``{"success": false}`` is asked again until the
    call's deadline (else raised at once). ``versioned``: the request or its answer depends on the server's release, so
    the client learns it (``GET /version``) before the first such call. ``policy``: its retry policy in
    ``VLLM_POLICIES``. ``source``: where vLLM 0.33.0 defines it. ``needs_weights``: the call reads or writes the
    weights, so both clients refuse it unsent (``VLLMWeightsAsleep``) while they know the weights asleep: a load into
    slept weights is an illegal memory access that kills the EngineCore (vLLM #57853 / #57854; 0.33.0's
    ``v1/worker/gpu_worker.py`` l.1559-1650 has no guard). Default False. ``mounted_by``: the server flag that mounts
    the route (None = mounted by default or in dev mode): a 404 there names the flag.
    """

    name: str
    method: str
    path: str
    policy: EndpointPolicy
    source: str
    since: Version = OLDEST
    dev_mode_since: Version | None = OLDEST
    refusals_retried: bool = False
    versioned: bool = True
    needs_weights: bool = False
    mounted_by: str | None = None

    @property
    def endpoint(self) -> str:
        """``"POST /sleep"``."""
        return f"{self.method} {self.path}"


_SLEEP = "entrypoints/serve/dev/sleep/api_router.py"
_CACHE = "entrypoints/serve/dev/cache/api_router.py"
_RL = "entrypoints/rl/online/api_router.py"
_FT = "entrypoints/serve/fault_tolerance/api_router.py"
_FT_FLAG = "--enable-fault-tolerance"

_TABLE: Final[tuple[Route, ...]] = (
    # routes whose first release the reference does not establish are marked since 0.33.0 (read there): an
    # older server gets a clear VLLMVersionError instead of a 404 misread as "dev mode off"
    # memory (serve/dev/sleep, dev mode in every release)
    Route("sleep", "POST", "/sleep", _LONG, f"{_SLEEP} l.26"),
    Route("wake_up", "POST", "/wake_up", _LONG, f"{_SLEEP} l.44"),
    Route("is_sleeping", "GET", "/is_sleeping", _READ, f"{_SLEEP} l.58"),
    Route("release_kv_cache_memory", "POST", "/release_kv_cache_memory", _ONCE, f"{_SLEEP} l.37", since=_V033),
    # generation control (rl/online; always mounted in 0.12/0.14, dev mode since 0.17)
    Route("pause", "POST", "/pause", _LONG, f"{_RL} l.31", dev_mode_since=PAUSE_NEEDS_DEV_MODE),
    Route("resume", "POST", "/resume", _CONTROL, f"{_RL} l.78", dev_mode_since=PAUSE_NEEDS_DEV_MODE),
    Route("is_paused", "GET", "/is_paused", _READ, f"{_RL} l.145", dev_mode_since=PAUSE_NEEDS_DEV_MODE),
    Route("abort_requests", "POST", "/abort_requests", _CONTROL, f"{_RL} l.97", since=_V033),
    # caches (serve/dev/cache)
    Route("reset_prefix_cache", "POST", "/reset_prefix_cache", _CONTROL, f"{_CACHE} l.20", refusals_retried=True),
    Route("reset_mm_cache", "POST", "/reset_mm_cache", _CONTROL, f"{_CACHE} l.47", since=_V033),
    Route("reset_encoder_cache", "POST", "/reset_encoder_cache", _CONTROL, f"{_CACHE} l.57", since=_V033),
    # workers (serve/dev/rpc, serve/dev/server_info)
    Route("collective_rpc", "POST", "/collective_rpc", _RPC, "entrypoints/serve/dev/rpc/api_router.py l.23"),
    Route("server_info", "GET", "/server_info", _READ, "entrypoints/serve/dev/server_info/api_router.py l.43", since=_V033),
    # weight transfer (rl/online)
    Route("init_weight_transfer_engine", "POST", "/init_weight_transfer_engine", _ONCE, f"{_RL} l.162", since=WEIGHT_TRANSFER),
    Route("shutdown_weight_transfer_engine", "POST", "/shutdown_weight_transfer_engine", _ONCE, f"{_RL} l.174", since=_V033),
    Route("start_weight_update", "POST", "/start_weight_update", _ONCE, f"{_RL} l.181", since=WEIGHT_SESSION, needs_weights=True),
    Route("start_draft_weight_update", "POST", "/start_draft_weight_update", _ONCE, f"{_RL} l.188", since=_V033, needs_weights=True),
    Route("update_weights", "POST", "/update_weights", _UPDATE, f"{_RL} l.195", since=WEIGHT_TRANSFER, needs_weights=True),
    Route("finish_weight_update", "POST", "/finish_weight_update", _ONCE, f"{_RL} l.207", since=WEIGHT_SESSION, needs_weights=True),
    Route("update_weight_version", "POST", "/update_weight_version", _CONTROL, f"{_RL} l.217", since=WEIGHT_VERSION_ROUTES),
    Route("weight_info", "GET", "/weight_info", _READ, f"{_RL} l.226", since=WEIGHT_VERSION_ROUTES),
    Route("weight_checker", "POST", "/weight_checker", _LONG, f"{_RL} l.232", since=_V033, needs_weights=True),
    Route("get_world_size", "GET", "/get_world_size", _READ, f"{_RL} l.269", since=_V033),
    # fault tolerance (serve/fault_tolerance, mounted with --enable-fault-tolerance, dev mode or not)
    Route(
        "fault_tolerance_apply", "POST", "/fault_tolerance/apply", _ONCE, f"{_FT} l.37", since=_V033, dev_mode_since=None,
        mounted_by=_FT_FLAG,
    ),
    Route(
        "fault_tolerance_status", "GET", "/fault_tolerance/status", _READ, f"{_FT} l.93", since=_V033, dev_mode_since=None,
        mounted_by=_FT_FLAG,
    ),
    # always mounted
    Route("health", "GET", "/health", _READ, "entrypoints/serve/instrumentator/health.py l.22", dev_mode_since=None, versioned=False),
    Route("version", "GET", "/version", _READ, "entrypoints/serve/instrumentator/basic.py l.53", dev_mode_since=None, versioned=False),
    Route("models", "GET", "/v1/models", _READ, "entrypoints/openai/models/api_router.py", dev_mode_since=None, versioned=False),
    Route(
        "complete",
        "POST",
        "/v1/completions",
        _COMPLETION,
        "entrypoints/openai/completion/api_router.py",
        dev_mode_since=None,
        versioned=False,
    ),
)

ROUTES: Final[dict[str, Route]] = {r.name: r for r in _TABLE}
"""Every route the clients speak, by client method name."""

CONTROL_ROUTES: Final[frozenset[str]] = frozenset(r.path for r in _TABLE if r.dev_mode_since is not None)
"""The paths mounted only in dev mode (in 0.33.0)."""


def route(name: str) -> Route:
    """The route of client method ``name``; ``KeyError`` naming it when there is none."""
    try:
        return ROUTES[name]
    except KeyError:
        raise KeyError(f"no vLLM route for client method {name!r}") from None


VLLM_POLICIES: Final[PolicyTable] = PolicyTable({r.endpoint: r.policy for r in _TABLE})
"""The policy table ``VLLMClient``, ``AsyncVLLMClient`` and ``mount_vllm`` use: one entry per route of ``ROUTES``."""
