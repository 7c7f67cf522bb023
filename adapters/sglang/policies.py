"""``SGLANG_POLICIES``: what each SGLang control endpoint tolerates; ``sglang_policies()`` builds variants of it.

- pause, continue, flush, abort, update_weight_version and every GET are idempotent: retried on 502/503/504,
  connection errors and read timeouts.
- release and resume are not: a re-sent release that had been done kills an engine that uses the memory saver ("Cannot
  pause allocation that is not active"), a re-sent resume of an active tag kills it too (KeyError). They are retried on
  failures before sending, never after a read timeout or a connection dropped after sending (``AmbiguousOutcome``).
- the weight-update calls follow the seed's working ``_make_request`` (3 attempts on 502/503/504), are not re-sent
  after sending, and get long timeouts. ``/generate`` is never re-sent once it may have reached the engine.

**The seed's trade-off, and what it costs.** ``SGLANG_POLICIES`` still re-sends release and resume after a front
end's 502/503/504: the second seed's fix for Bug A, whose 502s came from an nginx that had not handed the request
on. A front end that answers 502 *after* handing the call on turns that re-send into a second release or resume,
and the engine dies: behind ``FaultProxy`` with 502s after forwarding (issue 19), mounting this table raised the
deaths from 1 to 5 (AReaL) and from 0 to 3 (verl) in 25 cycles each. Two ways out, per deployment:

- ``sglang_policies(memory_probe=probe)``: before re-sending a release or resume after a gateway status or an ambiguous
  failure, ask a ``resilience.engine_contract.MemoryProbe`` (NVML on the engine's node, ``resilience.adapters.nvml``; the
  emulator's truth, ``resilience.testing.EmulatorMemoryProbe``) whether it was applied. Applied: the call returns as
  applied (a body-less 200, reason ``"Applied (confirmed by probe)"``, ``.attempts`` showing the gateway status); not
  applied (after a 502/503): re-sent; cannot tell: as without a probe (``memory_check.py`` has the rules).
- ``SGLANG_STRICT_POLICIES`` (``sglang_policies(strict=True)``): release and resume are never re-sent on a gateway
  status alone; the status is handed back (``SGLangError``), giving up the fix for Bug A on these two calls. With a
  probe too, a re-send happens only when the probe proves the first attempt was not applied.

Every driver that mounts such a table (requests, httpx, aiohttp) gets the same decisions: the shared retry core asks
the probe.
"""

from __future__ import annotations

from dataclasses import replace

from resilience.adapters.engine_retries import CONNECT_WINDOW_S, CONTROL_RETRY, NO_STATUS_RETRY, READ_RETRY
from resilience.adapters.sglang.memory_check import RELEASE_PATH, RESUME_PATH, MemoryProbeCheck
from resilience.engine_contract import MemoryProbe
from resilience.policy import EndpointPolicy, PolicyTable, RetryPolicy, parse_key

__all__ = [
    "SGLANG_ADMIN_PATHS", "SGLANG_OPEN_PREFIXES", "SGLANG_POLICIES", "SGLANG_STRICT_POLICIES", "sglang_policies", "with_memory_probe",
]

SGLANG_ADMIN_PATHS: frozenset[str] = frozenset({
    "/pause_generation", "/continue_generation", "/flush_cache", "/abort_request", "/release_memory_occupation",
    "/resume_memory_occupation", "/begin_weight_update", "/end_weight_update", "/update_weights_from_tensor",
    "/update_weights_from_distributed", "/update_weights_from_disk", "/update_weight_version", "/init_weights_update_group",
    "/destroy_weights_update_group",
})
"""Routes SGLang 0.5.23 marks ``ADMIN_OPTIONAL`` (``utils/auth.py``): they take the admin key when the
server has one, else the API key. The contract check compares this set with the wheel's source."""

SGLANG_OPEN_PREFIXES: tuple[str, ...] = ("/health", "/ready", "/metrics")
"""Paths SGLang never asks a key for (probes and scrapes); the client sends none there."""

_PAUSE = EndpointPolicy(retry=CONTROL_RETRY, idempotent=True, attempt_timeout_s=60, deadline_s=180)
_CONTROL = EndpointPolicy(retry=CONTROL_RETRY, idempotent=True, attempt_timeout_s=30, deadline_s=120)
_FLUSH = EndpointPolicy(retry=CONTROL_RETRY, idempotent=True, attempt_timeout_s=120, deadline_s=180)
_SWAP = EndpointPolicy(retry=CONTROL_RETRY, idempotent=False, retry_statuses_if_not_idempotent=True, attempt_timeout_s=120, deadline_s=300)
_WEIGHTS = EndpointPolicy(
    retry=RetryPolicy(max_attempts=3, base_s=0.5, cap_s=2.0, connect_window_s=CONNECT_WINDOW_S),
    idempotent=False, retry_statuses_if_not_idempotent=True, attempt_timeout_s=600, deadline_s=900,
)
_READ = EndpointPolicy(retry=READ_RETRY, idempotent=True, attempt_timeout_s=10, deadline_s=30)
_HEALTH = EndpointPolicy(retry=READ_RETRY, idempotent=True, attempt_timeout_s=25, deadline_s=30)
_GENERATE = EndpointPolicy(retry=NO_STATUS_RETRY, idempotent=False, attempt_timeout_s=None, deadline_s=None)


def sglang_policies(*, memory_probe: MemoryProbe | None = None, strict: bool = False) -> PolicyTable:
    """The SGLang policy table (see the module docstring for the trade-off these two knobs settle).

    ``memory_probe``: asked before release or resume is re-sent after a gateway status or an ambiguous failure (default
    None: no probe, the seed's trade-off). ``strict``: release and resume are never re-sent on a gateway status alone
    (default False: they are, as the seed's fix for Bug A).
    """
    if not isinstance(strict, bool):
        raise TypeError(f"sglang_policies strict must be True or False, but was {strict!r}")
    swap = replace(_SWAP, retry_statuses_if_not_idempotent=False) if strict else _SWAP
    table = PolicyTable(
        {
            "POST /pause_generation": _PAUSE,
            "POST /continue_generation": _CONTROL,
            "GET|POST /flush_cache": _FLUSH,
            "POST /abort_request": _CONTROL,
            "POST /update_weight_version": _CONTROL,
            "GET|POST /release_memory_occupation": swap,
            "GET|POST /resume_memory_occupation": swap,
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
    return table if memory_probe is None else with_memory_probe(table, memory_probe)


def with_memory_probe(table: PolicyTable, memory_probe: MemoryProbe) -> PolicyTable:
    """``table`` with ``memory_probe`` asked on its release and resume entries (``MemoryProbeCheck``); the rest unchanged.

    For a table of your own (say ``fast_policies(SGLANG_POLICIES)``); a table without those entries is refused.
    """
    check = MemoryProbeCheck(memory_probe)
    changed = {
        key: replace(policy, on_ambiguous=check)
        for key, policy in table.entries.items()
        if parse_key(key)[1].rstrip("/").endswith((RELEASE_PATH, RESUME_PATH))
    }
    if not changed:
        raise ValueError(f"with_memory_probe: the table has no {RELEASE_PATH} or {RESUME_PATH} entry to ask the probe on: {table!r}")
    return table.with_entries(changed)


SGLANG_POLICIES: PolicyTable = sglang_policies()
"""The default table ``SGLangClient`` and ``mount_sglang`` use: the seed's trade-off (release and resume re-sent on 502/503/504)."""

SGLANG_STRICT_POLICIES: PolicyTable = sglang_policies(strict=True)
"""``SGLANG_POLICIES`` with release and resume never re-sent on a gateway status alone (the status is handed back)."""
