"""Tools for users' own test suites: the SGLang emulator, fault plans and proxy, fast policies, a fake clock.

``resilience.testing.emulator`` needs the ``[emulator]`` extra (FastAPI,
uvicorn, torch: only the engine processes import them);
``resilience.testing.faults`` is standard library only. Importing this
package itself is cheap.
"""

from resilience.clock import FakeClock
from resilience.testing.policies import fast_policies

__all__ = ["FakeClock", "fast_policies"]
