"""``KillSwitchFanOut``: a controller killed inside a phase, and a new one on the journal's copy from that instant."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("torch")

from resilience.adapters.sglang import SGLangClient
from resilience.barrier import EngineGroup, Orchestrator
from resilience.barrier.fanout import EngineResult
from resilience.deadline import Deadline
from resilience.testing.colocate import ColocateConfig
from resilience.testing.controller_kill import ControllerKilled, KillPoint, KillSwitchFanOut
from resilience.testing.counting_probe import CountingProbe
from resilience.testing.emulator import EmulatedFleet
from tests.sglang.conftest import FAST_ENGINE, FAST_SGLANG


@pytest.fixture(scope="module")
def fleet() -> Iterator[EmulatedFleet]:
    with EmulatedFleet(2, FAST_ENGINE) as f:
        yield f


def _releases(fleet: EmulatedFleet) -> list[int]:
    return [sum(1 for c in e.record()["calls"] if c["path"] == "/release_memory_occupation") for e in fleet.engines]


@pytest.mark.parametrize("after_s", [0.0, 0.05])
def test_killed_inside_the_release_a_new_controller_resumes_from_the_copy_and_no_engine_dies(
    fleet: EmulatedFleet, tmp_path: Path, after_s: float
) -> None:
    """Kill in offload's release (3rd phase), journal copied at that instant: the next controller proves the release from
    the probe, sends no second release, onloads, and every engine serves."""
    journal, copy = tmp_path / "a.journal", tmp_path / "b.journal"
    probe = CountingProbe(fleet.memory_probe())
    fanout = KillSwitchFanOut(on_kill=lambda: shutil.copyfile(journal, copy))
    clients = [SGLangClient(u, policies=FAST_SGLANG, flush_poll_s=0.05) for u in fleet.urls]
    before = _releases(fleet)
    first = Orchestrator(EngineGroup(clients), fanout=fanout, memory_probe=probe, journal=journal)
    fanout.arm(KillPoint(phase=2, after_s=after_s))
    with pytest.raises(ControllerKilled, match=r"killed during release_memory_occupation \(\d of 2 calls had answered\)"):
        first.offload()
    assert fanout.kills == 1 and not fanout.armed
    assert fanout.drain(10.0) == 0  # what the dead controller sent has landed
    first.close()
    fresh = [SGLangClient(u, policies=FAST_SGLANG, flush_poll_s=0.05) for u in fleet.urls]
    second = Orchestrator(EngineGroup(fresh), fanout=fanout, memory_probe=probe, journal=copy)
    try:
        assert second.recovery is not None and second.recovery.resumed
        assert set(second.recovery.in_flight.values()) == {"release_memory_occupation"}
        second.offload()  # the probe proves the tags released: nothing is released twice
        assert [a - b for a, b in zip(_releases(fleet), before, strict=True)] == [1, 1]
        assert probe.proved >= 2
        second.onload()
        assert all(e.alive() for e in fleet.engines)
        assert all(not e.state()["paused"] and not e.state()["released_tags"] for e in fleet.engines)
    finally:
        second.close()
        fanout.close()
        for client in [*clients, *fresh]:
            client.close()


def test_an_armed_point_counts_phases_and_disarm_cancels_it() -> None:
    """Phases with no calls do not count; phase=1 lets the first through; disarm hands back the unreached point."""
    fanout = KillSwitchFanOut()

    class Engine:
        engine = "e"

        def pause_generation(self) -> str:
            return "ok"

    calls = [(Engine(), {})]
    fanout.arm(KillPoint(phase=1, after_s=0.0))
    assert fanout.call([], "pause_generation", Deadline(1.0)) == []
    assert [r.value for r in fanout.call(calls, "pause_generation", Deadline(1.0))] == ["ok"]
    with pytest.raises(ControllerKilled):
        fanout.call(calls, "pause_generation", Deadline(1.0))
    fanout.arm(KillPoint(phase=5, after_s=0.0))
    assert fanout.disarm() == KillPoint(phase=5, after_s=0.0)
    assert isinstance(fanout.call(calls, "pause_generation", Deadline(1.0))[0], EngineResult)
    fanout.close()


@pytest.mark.parametrize(("field", "bad"), [("phase", -1), ("phase", True), ("after_s", 61), ("after_s", "0")])
def test_a_bad_kill_point_names_its_field(field: str, bad: object) -> None:
    """KillPoint refuses a negative or non-int phase and a delay outside [0, 60] s, naming the field."""
    kwargs: dict[str, object] = {"phase": 0, "after_s": 0.0, field: bad}
    with pytest.raises(ValueError, match=rf"KillPoint\.{field} must be"):
        KillPoint(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [0, -1, True, 1.5])
def test_controller_kill_every_must_be_a_number_of_steps(bad: object) -> None:
    """ColocateConfig.controller_kill_every: None or an int >= 1; anything else is refused, naming the field."""
    with pytest.raises(ValueError, match=r"controller_kill_every must be None or a number of steps >= 1, but was"):
        ColocateConfig(controller_kill_every=bad)  # type: ignore[arg-type]


def test_kills_at_names_every_kth_step() -> None:
    """controller_kill_every=3 kills in the 3rd, 6th, 9th step (0-based 2, 5, 8); None never."""
    assert [n for n in range(10) if ColocateConfig(controller_kill_every=3).kills_at(n)] == [2, 5, 8]
    assert not any(ColocateConfig().kills_at(n) for n in range(10))
