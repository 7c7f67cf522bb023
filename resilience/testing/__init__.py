"""Tools for users' own test suites: the SGLang and vLLM emulators, fault plans and proxy, fast policies, a fake clock.

``resilience.testing.emulator`` needs the ``[emulator]`` extra (FastAPI,
uvicorn, torch: only the engine processes import them; a vLLM engine,
``EmulatedFleet(n, VLLMEngineConfig(...))``, imports no torch itself, the zygote that forks it does);
``resilience.testing.faults`` is standard library only. Importing this
package itself is cheap: ``EmulatorMemoryProbe`` (the emulator's memory truth,
read through its side channel) is imported on first access.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from resilience.testing.clock import FakeClock
from resilience.testing.policies import fast_policies

if TYPE_CHECKING:
    from resilience.testing.memory_probe import EmulatorMemoryProbe

__all__ = ["EmulatorMemoryProbe", "FakeClock", "fast_policies"]


def __getattr__(name: str) -> Any:
    if name == "EmulatorMemoryProbe":
        from resilience.testing.memory_probe import EmulatorMemoryProbe

        return EmulatorMemoryProbe
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
