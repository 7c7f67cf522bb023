"""``SGLANG_POLICIES``: what each SGLang control endpoint tolerates.

- pause, continue, flush, abort, update_weight_version and every GET are
  idempotent: retried on 502/503/504, connection errors and read timeouts.
- release and resume are not idempotent: a re-sent release that had been done
  kills an engine that uses the memory saver ("Cannot pause allocation that
  is not active"), a re-sent resume of an active tag kills it too (KeyError).
  They are retried on 502/503/504 and on failures before sending, never after
  a read timeout or a connection dropped after sending (``AmbiguousOutcome``,
  unless the endpoint policy carries a probe). Retrying gateway statuses is
  the explicit trade-off of the second seed's evidence: those 502s came from
  a front end that had not handed the request on. A front end that answers
  502 *after* handing it on defeats this; then set
  ``retry_statuses_if_not_idempotent=False`` for these two endpoints.
- the weight-update calls follow the seed's working ``_make_request``
  (3 attempts on 502/503/504), are not re-sent after sending, and get long
  timeouts.
- ``/generate`` is never re-sent once it may have reached the engine.
"""

from __future__ import annotations

from resilience.policy import EndpointPolicy, PolicyTable, RetryPolicy

__all__ = ["SGLANG_ADMIN_PATHS", "SGLANG_OPEN_PREFIXES", "SGLANG_POLICIES", "sglang_policies"]

SGLANG_ADMIN_PATHS: frozenset[str] = frozenset(
    {
        "/pause_generation",
        "/continue_generation",
        "/flush_cache",
        "/abort_request",
        "/release_memory_occupation",
        "/resume_memory_occupation",
        "/begin_weight_update",
        "/end_weight_update",
        "/update_weights_from_tensor",
        "/update_weights_from_distributed",
        "/update_weights_from_disk",
        "/update_weight_version",
        "/init_weights_update_group",
        "/destroy_weights_update_group",
    }
)
"""Routes SGLang 0.5.23 marks ``ADMIN_OPTIONAL`` (``utils/auth.py``): they take the admin key when the
server has one, else the API key. The contract check compares this set with the wheel's source."""

SGLANG_OPEN_PREFIXES: tuple[str, ...] = ("/health", "/ready", "/metrics")
"""Paths SGLang never asks a key for (probes and scrapes); the client sends none there."""

# connect_window_s: how long a call that never connected keeps retrying refusals before it fails with the refusal
# (and the engine's breaker opens). 5 s on every endpoint: an engine's front end that is coming up listens within
# seconds, so 5 s of backoff (4-6 attempts at these bases) reaches it; a memory swap takes tens of seconds but never
# closes the port (the seed's 502s and slow /health came from a listening front end), so the long deadlines below
# still cover it; and an engine that must be restarted takes minutes (the seed's global restart: about 8), which no
# call should sit through. A dead or mistyped URL thus fails in ~5 s instead of the deadline (180 s for a pause).
_CONNECT_WINDOW_S = 5.0
_CONTROL_RETRY = RetryPolicy(max_attempts=6, base_s=0.5, cap_s=4.0, connect_window_s=_CONNECT_WINDOW_S)
_SWAP_RETRY = RetryPolicy(max_attempts=6, base_s=0.5, cap_s=4.0, connect_window_s=_CONNECT_WINDOW_S)
_READ_RETRY = RetryPolicy(max_attempts=3, base_s=0.2, cap_s=1.0, connect_window_s=_CONNECT_WINDOW_S)
_NO_STATUS_RETRY = RetryPolicy(max_attempts=3, base_s=0.2, cap_s=1.0, statuses=frozenset(), connect_window_s=_CONNECT_WINDOW_S)

_PAUSE = EndpointPolicy(retry=_CONTROL_RETRY, idempotent=True, attempt_timeout_s=60, deadline_s=180)
_CONTROL = EndpointPolicy(retry=_CONTROL_RETRY, idempotent=True, attempt_timeout_s=30, deadline_s=120)
_FLUSH = EndpointPolicy(retry=_CONTROL_RETRY, idempotent=True, attempt_timeout_s=120, deadline_s=180)
_SWAP = EndpointPolicy(retry=_SWAP_RETRY, idempotent=False, retry_statuses_if_not_idempotent=True, attempt_timeout_s=120, deadline_s=300)
_WEIGHTS = EndpointPolicy(
    retry=RetryPolicy(max_attempts=3, base_s=0.5, cap_s=2.0, connect_window_s=_CONNECT_WINDOW_S),
    idempotent=False,
    retry_statuses_if_not_idempotent=True,
    attempt_timeout_s=600,
    deadline_s=900,
)
_READ = EndpointPolicy(retry=_READ_RETRY, idempotent=True, attempt_timeout_s=10, deadline_s=30)
_HEALTH = EndpointPolicy(retry=_READ_RETRY, idempotent=True, attempt_timeout_s=25, deadline_s=30)
_GENERATE = EndpointPolicy(retry=_NO_STATUS_RETRY, idempotent=False, attempt_timeout_s=None, deadline_s=None)


def sglang_policies() -> PolicyTable:
    """A fresh copy of the SGLang policy table (it is immutable; this is for symmetry with ``with_entries``)."""
    return PolicyTable(
        {
            "POST /pause_generation": _PAUSE,
            "POST /continue_generation": _CONTROL,
            "GET|POST /flush_cache": _FLUSH,
            "POST /abort_request": _CONTROL,
            "POST /update_weight_version": _CONTROL,
            "GET|POST /release_memory_occupation": _SWAP,
            "GET|POST /resume_memory_occupation": _SWAP,
            "POST /begin_weight_update": _WEIGHTS,
            "POST /end_weight_update": _WEIGHTS,
            "POST /update_weights_from_tensor": _WEIGHTS,
            "POST /update_weights_from_distributed": _WEIGHTS,
            "POST /update_weights_from_disk": _WEIGHTS,
            "POST /init_weights_update_group": _WEIGHTS,
            "GET /health": _HEALTH,
            "GET /health_generate": _HEALTH,
            "GET /ready": _READ,
            "GET /server_info": _READ,
            "GET /get_server_info": _READ,
            "GET /model_info": _READ,
            "GET /v1/loads": _READ,
            "GET /v1/models": _READ,
            "POST /generate": _GENERATE,
        }
    )


SGLANG_POLICIES: PolicyTable = sglang_policies()
"""The default table ``SGLangClient`` and ``mount_sglang`` use."""
