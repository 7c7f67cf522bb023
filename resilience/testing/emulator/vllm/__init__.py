"""A vLLM 0.33.0 engine emulator on the CPU: its control plane, sleep mode and the crashes sleep mode brings.

Each engine is a real HTTP server in its own process, started as the SGLang emulator's (``python -m
resilience.testing.emulator --engine vllm``, or forked by the shared zygote fleet), with vLLM's own flags
(``config.py``) and ``VLLM_SERVER_DEV_MODE`` read from the environment. ``core.py`` says which semantics are
reproduced, each with its line in vLLM 0.33.0's source.

Debug routes (not vLLM's, never behind a key): ``GET /_emulator/state`` answers ``{"pid", "version", "engine": "vllm",
"dev_mode", "sleep_mode", "pause_state" ("unpaused" | "paused_new" | "paused_all"), "reject_new_requests",
"sleeping_tags", "weight_version", "weights" (the content: "weights:<version>" or "garbage:<n>"), "weights_discarded",
"transfer_initialized", "weight_update_active", "update_chunks" (of the session open or last closed), "wedged",
"fault_tolerance" (None when off, else "healthy" | "unhealthy"), "running", "waiting", "counts": {"completed",
"aborted", "rejected", "preempted"}}``; ``GET /_emulator/record`` answers ``{"calls", "dropped", "state"}`` as the
SGLang emulator's does (``/v1/completions`` is not recorded); ``POST /_emulator/fault?error_type=...`` makes the busy
loop raise (``fault_tolerance.py``). With ``--memory-state-dir`` the engine publishes its sleeping tags as
``released_tags`` (``emulator/memory_state.py``).

Importing this package imports neither FastAPI nor uvicorn.
"""

from __future__ import annotations

from .config import DEV_MODE_ENV, VLLM_VERSION, VLLMEngineConfig
from .text import expected_checksums, expected_completion

__all__ = ["DEV_MODE_ENV", "VLLM_VERSION", "VLLMEngineConfig", "expected_checksums", "expected_completion"]
