"""Fleets of emulated SGLang engines for client and barrier tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from resilience.adapters.sglang import SGLANG_POLICIES
from resilience.policy import PolicyTable
from resilience.testing import fast_policies
from resilience.testing.emulator import EmulatedFleet, EngineConfig

FAST_ENGINE = EngineConfig(token_rate=400.0, health_hang_seconds=1.0, health_poll_seconds=0.05, abort_poll_seconds=0.05)
"""Engines whose waits are short enough for tests."""

FAST_SGLANG: PolicyTable = fast_policies(SGLANG_POLICIES, attempt_timeout_s=5.0, deadline_s=15.0)
"""SGLANG_POLICIES' decisions with test-sized waits."""


@pytest.fixture
def fleet1() -> Iterator[EmulatedFleet]:
    """One fresh engine (tests may kill it)."""
    with EmulatedFleet(1, FAST_ENGINE) as fleet:
        yield fleet
