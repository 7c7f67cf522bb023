"""An SGLang engine emulator on the CPU: SGLang 0.5.23's control plane and crash semantics (and vLLM 0.33.0's).

What an engine does and how to use a fleet of them: ``docs/emulator.md``. vLLM engines (``vllm/``): give the fleet a
:class:`VLLMEngineConfig` (the config's type picks the engine), or run ``cpr emulate --engine vllm``. Importing this
package imports neither torch nor FastAPI; only the engine processes do.

Debug routes (not SGLang's, never behind a key): ``GET /_emulator/state`` answers ``{"pid", "version",
"server_status", "paused", "pause_mode", "scheduler_paused", "weight_version", "weight_update_session_open",
"in_flight", "model_update_lock": {"readers", "writer_active", "waiting_writers"}, "waiting_at_pause_gate", "running",
"waiting", "released_tags", "allocated_bytes": {tag: bytes}, "counts": {"completed", "aborted", "retracted",
"prefilled"}}``. ``GET /_emulator/record`` answers ``{"calls": [...], "dropped": n, "state": {...}}``: the last 2048
calls but ``/generate`` (``record.py``), in arrival order, each ``{"seq", "method", "path", "query", "body" (parsed
JSON, raw text, or None), "status" (None until answered), "received_ns", "answered_ns"}`` with ``time.monotonic_ns()``
stamps, comparable across processes. Memory truth, for ``EmulatorMemoryProbe``: every engine of an ``EmulatedFleet``
keeps its released tags in a file (``memory_state.py``).
"""

from __future__ import annotations

from .config import SGLANG_VERSION, EngineConfig
from .fleet import EmulatedFleet, EmulatorStartError, EngineHandle
from .server import main
from .vllm import VLLM_VERSION, VLLMEngineConfig, expected_completion

__all__ = [
    "SGLANG_VERSION", "VLLM_VERSION", "EmulatedFleet", "EmulatorStartError", "EngineConfig", "EngineHandle", "VLLMEngineConfig",
    "expected_completion", "main",
]  # fmt: skip
