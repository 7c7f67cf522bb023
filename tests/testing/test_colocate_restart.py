"""The colocate loop's controller restart (``ColocateConfig.controller_crash_step``) on emulated engines."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("torch")

from resilience.barrier.journal import RestartBudget
from resilience.testing.colocate import ColocateConfig, run_colocate
from resilience.testing.emulator import EmulatedFleet
from resilience.testing.lab import BASELINE, RESILIENT
from tests.sglang.conftest import FAST_ENGINE

RESTART = ColocateConfig(steps=2, seed=0, rollout_requests=1, stragglers=0, max_new_tokens=4, train_s=0.0, controller_crash_step=0)


@pytest.fixture(scope="module")
def fleet() -> Iterator[EmulatedFleet]:
    with EmulatedFleet(2, FAST_ENGINE) as f:
        yield f


@pytest.mark.parametrize("bad", [-1, True, 1.5, "0"])
def test_controller_crash_step_must_be_a_step(bad: object) -> None:
    """A controller_crash_step that is not None or an int >= 0 is refused, naming the field."""
    with pytest.raises(ValueError, match=r"controller_crash_step must be None or a step >= 0, but was"):
        replace(RESTART, controller_crash_step=bad)  # type: ignore[arg-type]


def _releases(fleet: EmulatedFleet) -> list[int]:
    return [sum(1 for c in e.record()["calls"] if c["path"] == "/release_memory_occupation") for e in fleet.engines]


def test_ours_resumes_from_the_journal_after_the_controller_dies(fleet: EmulatedFleet) -> None:
    """Ours: the controller dies after its offload; the new one, on the journal, sends no second release and finishes."""
    before = _releases(fleet)
    report = run_colocate(fleet, RESTART, RESILIENT)
    assert (report.controller_restarts, report.controller_restart_deaths, report.engine_deaths) == (1, 0, 0), report.failures
    assert (report.steps_finished, report.failed_steps) == (2, 0), report.failures
    assert [a - b for a, b in zip(_releases(fleet), before, strict=True)] == [2, 2]  # one per step, none repeated


def test_the_baseline_restarted_fresh_releases_again_and_kills_every_engine(fleet: EmulatedFleet) -> None:
    """The baseline: its fresh controller runs the offload again; every engine dies of the second release."""
    report = run_colocate(fleet, replace(RESTART, steps=1), BASELINE, restart_budget=RestartBudget(1))
    assert (report.controller_restarts, report.controller_restart_deaths) == (1, 2), report.failures
    assert report.failed_steps == 1 and report.restarts == 1  # the deaths fail the step; recovery restarted the engines
    assert all(e.alive() for e in fleet.engines)
