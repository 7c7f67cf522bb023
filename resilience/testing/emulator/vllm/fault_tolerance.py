"""vLLM 0.33.0's fault tolerance (``--enable-fault-tolerance``), emulated: one engine's sentinel and the status its client caches.

Paths and lines are vLLM 0.33.0's. With fault tolerance on, an exception in the EngineCore's busy loop
does not kill the engine: ``EngineCoreSentinel.on_fault`` (``v1/fault_tolerance/engine_core_sentinel.py``
l.82-104) aborts every request and marks the engine ``unhealthy``, and ``fault_tolerant_wrapper``
(l.207-231) waits up to ``engine_recovery_timeout_sec`` (``config/fault_tolerance.py``, default 120 s)
for an instruction; when none comes the original error is raised and the engine dies. While it waits
nothing steps and no utility call is answered (they run on the busy loop). ``retry`` (l.156-170), the
only instruction 0.33.0 allows (``entrypoints/serve/fault_tolerance/api_router.py`` l.20), marks it
healthy again; an instruction to an engine that is not unhealthy is rejected (``handle_command``
l.53-68), and the client's cached status then carries ``last_ft_request_id`` and ``ft_error``
(``v1/engine/core_client.py`` l.1449-1466). Without fault tolerance the same fault kills the engine at
once. 0.33.0 has no 503 "Service is in faulted state": requests sent meanwhile wait.

The emulator's trigger is ``POST /_emulator/fault`` (not vLLM's): "the busy loop raises now".
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

__all__ = ["ENGINE_INDEX", "FaultTolerance"]

log = logging.getLogger("vllm.emulator")

ENGINE_INDEX = 0
"""The emulated engine's DP rank: one engine core, no data parallelism."""


class FaultTolerance:
    """One engine core's ``EngineCoreSentinel`` and the status its ``AsyncMPClient`` caches; every method runs on the event loop.

    ``recovery_timeout_s``: how long an unhealthy engine waits for an instruction before it dies.
    """

    def __init__(self, recovery_timeout_s: float) -> None:
        self.recovery_timeout_s = recovery_timeout_s
        self.status = "healthy"
        self.fault_info: str | None = None
        self.deadline: float | None = None
        """When an unhealthy engine gives up waiting (monotonic seconds); None while healthy."""
        self._cached: dict[str, Any] = {"id": ENGINE_INDEX, "status": "healthy"}
        self._recovered: asyncio.Event | None = None

    @property
    def unhealthy(self) -> bool:
        """The busy loop waits for an instruction: nothing steps, no utility call is answered."""
        return self.status == "unhealthy"

    def on_fault(self, error_type: str) -> None:
        """``on_fault``: the engine turns unhealthy with ``error_type`` as its fault info (the caller aborts the requests)."""
        self.status, self.fault_info = "unhealthy", error_type
        self.deadline = time.monotonic() + self.recovery_timeout_s
        log.warning("[FT] Busy loop raised %s. Waiting for recovery.", error_type)
        self._push()

    def timed_out(self) -> bool:
        """No instruction came within the recovery timeout: the original error is raised (the engine dies)."""
        return self.deadline is not None and time.monotonic() >= self.deadline

    def handle(self, instruction: str, request_id: str) -> tuple[bool, str | None]:
        """``handle_command`` then the client's ``handle_fault``: ``(success, reason)``; a failure is kept in the status."""
        if not self.unhealthy:
            reason = f"[FT] Rejecting {instruction} on engine {ENGINE_INDEX}: status is {self.status.upper()}"
            self._cached.update(last_ft_request_id=request_id, ft_error=reason)
            return False, reason
        self.status, self.fault_info, self.deadline = "healthy", None, None  # retry: the only instruction allowed
        log.info("[FT] Engine %d status -> HEALTHY", ENGINE_INDEX)
        self._push()
        if self._recovered is not None:
            self._recovered.set()
            self._recovered = None
        return True, None

    async def wait_until_healthy(self) -> None:
        """Return once the engine is not unhealthy (at once when it is not)."""
        while self.unhealthy:
            if self._recovered is None:
                self._recovered = asyncio.Event()
            await self._recovered.wait()

    def answer(self) -> dict[str, Any]:
        """``GET /fault_tolerance/status``: ``AsyncMPClient.get_status`` (core_client.py l.1461-1466)."""
        return {"schema_version": 1, "total_engines": 1, "engines": [dict(self._cached)]}

    def _push(self) -> None:
        """``_push_status`` (l.142-154): the client's cached entry is replaced by the sentinel's payload."""
        payload: dict[str, Any] = {"id": ENGINE_INDEX, "status": self.status}
        if self.unhealthy:
            payload["fault_info"] = self.fault_info
        self._cached = payload
