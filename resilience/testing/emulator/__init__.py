"""An SGLang engine emulator on the CPU: SGLang 0.5.23's control plane and crash semantics.

Each engine is a real HTTP server (FastAPI + uvicorn) in its own process, with a
scheduler thread, an admission queue, KV memory that is really freed on release, the
three pause modes, and SGLang's deaths (release with work in flight, double release,
resume of an unreleased tag, a write into a released pool). Importing this package
imports neither torch nor FastAPI; only the engine processes do.

    from resilience.testing.emulator import EmulatedFleet, EngineConfig

    with EmulatedFleet(2, EngineConfig(health_hang_seconds=1)) as fleet:
        requests.post(fleet.urls[0] + "/pause_generation", json={"mode": "abort"})
"""

from __future__ import annotations

from .config import SGLANG_VERSION, EngineConfig
from .fleet import EmulatedFleet, EmulatorStartError, EngineHandle
from .server import main

__all__ = ["SGLANG_VERSION", "EmulatedFleet", "EmulatorStartError", "EngineConfig", "EngineHandle", "main"]
