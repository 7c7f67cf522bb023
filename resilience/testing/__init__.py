"""Tools for users' own test suites: the SGLang emulator, fault plans, a fake clock.

``resilience.testing.emulator`` and ``resilience.testing.faults`` need the
``[emulator]`` extra; importing this package itself is cheap.
"""

from resilience.clock import FakeClock

__all__ = ["FakeClock"]
