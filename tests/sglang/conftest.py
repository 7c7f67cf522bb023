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


@pytest.fixture(scope="module")
def one_engine_fleet() -> Iterator[EmulatedFleet]:
    """One engine for the whole module: :func:`fleet1` hands it out fresh to each test."""
    with EmulatedFleet(1, FAST_ENGINE) as fleet:
        yield fleet


@pytest.fixture
def fleet1(one_engine_fleet: EmulatedFleet) -> Iterator[EmulatedFleet]:
    """One fresh engine (tests may kill it, or leave it paused, released or mid-flush).

    The module's one fleet, its engine restarted after each test (same port, a fresh process: fresh state and
    record), so a module starts one fleet (a zygote importing torch) instead of one per test.
    """
    yield one_engine_fleet
    one_engine_fleet.engines[0].restart()
