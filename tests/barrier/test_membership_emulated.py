"""Membership on real emulated SGLang engines, with controllers SIGKILLed and restarted as the crash tests do.

- A controller offloads two engines, adds a third (paused, flushed and released like the others), and is SIGKILLed
  while it "trains"; the third engine restarts meanwhile (a fresh process on its URL). The next controller, given the
  three engines, reads from the journal that the third joined, takes it as a new engine (its ``/ready`` answers as a
  fresh process) and its onload resumes only the other two: no engine dies, all three serve.
- On each backend (threads, one event loop through ``AsyncFanOut``, Ray actors through ``RayFanOut``): an engine
  joins an offloaded group through the group's own fan-out, counts from the next onload, and another leaves.
- A controller SIGKILLed in the middle of a join (its release phase): the next controller reads that the join never
  finished, keeps the engine fenced (its onload sends it nothing), and a new ``add`` (with the emulator's memory
  probe) brings it in: no engine dies, all serve.

Each engine is its own process (``EmulatedFleet``); deaths are read from the engines' own logs.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("torch")

from resilience.barrier import EngineGroup, EngineState, Orchestrator
from resilience.cli.story import death_causes
from resilience.testing.emulator import EmulatedFleet, EngineConfig
from tests.barrier.conftest import Backend
from tests.barrier.crash_rig import Controller, put_in_order

CONFIG = EngineConfig(token_rate=400.0, health_hang_seconds=1.0, health_poll_seconds=0.05, abort_poll_seconds=0.05, swap_seconds=0.3)
READY_S = 60.0
END_S = 120.0


@pytest.fixture(scope="module")
def fleet() -> Iterator[EmulatedFleet]:
    with EmulatedFleet(3, CONFIG) as f:
        yield f


@pytest.fixture
def engines(fleet: EmulatedFleet) -> Iterator[EmulatedFleet]:
    put_in_order(fleet)
    yield fleet


def _deaths(fleet: EmulatedFleet, since: Sequence[int]) -> dict[int, list[str]]:
    out = {}
    for engine, start in zip(fleet.engines, since, strict=True):
        causes = death_causes(engine.log()[start:])
        if causes or not engine.alive():
            out[engine.index] = causes or ["not alive"]
    return out


def _serving(fleet: EmulatedFleet) -> list[bool]:
    return [not (s := e.state())["paused"] and not s["released_tags"] for e in fleet.engines]


def test_a_restarted_controller_knows_who_joined_and_takes_a_restarted_joiner_as_new(engines: EmulatedFleet, tmp_path: Path) -> None:
    journal = str(tmp_path / "barrier.journal")
    urls = engines.direct_urls
    since = [len(e.log()) for e in engines.engines]
    first = Controller(urls[:2], "--journal", journal, "--join", urls[2], "--ops", "offload,join,train", "--train-s", "60")
    try:
        joined = first.wait_for("end", READY_S, op="join")
        assert joined is not None and joined["ok"], f"{first.seen} {first.stderr}"
        assert joined["states"][urls[2]] == "released", joined
    finally:
        first.kill()  # SIGKILL while it "trains": the journal says all three are released
    assert all(e.state()["released_tags"] for e in engines.engines)
    engines.engines[2].restart()  # the joiner's process restarts: all its memory, serving
    second = Controller(urls, "--journal", journal, "--ops", "onload")
    try:
        ready = second.wait_for("ready", READY_S)
        assert ready is not None and ready["members"] == {urls[2]: "joined"}, f"{second.seen} {second.stderr}"
        assert second.wait(END_S) == 0, second.stderr
    finally:
        second.kill()
    assert _deaths(engines, since) == {}, f"{second.seen} {second.stderr}"
    end = next((line for line in second.seen if line.get("event") == "end"), None)
    assert end is not None and end["ok"] and list(end["replaced"]) == [urls[2]], second.seen
    assert _serving(engines) == [True, True, True]


def test_a_join_cut_by_a_sigkill_leaves_the_engine_fenced_until_it_is_added_again(engines: EmulatedFleet, tmp_path: Path) -> None:
    journal = str(tmp_path / "barrier.journal")
    urls = engines.direct_urls
    since = [len(e.log()) for e in engines.engines]
    probe = ("--probe-dir", str(engines.memory_state_dir))
    first = Controller(urls[:2], "--journal", journal, "--join", urls[2], "--ops", "offload,join", *probe)
    try:
        cut = first.wait_for("phase", READY_S, transition="join", phase="release")
        assert cut is not None, f"{first.seen} {first.stderr}"
    finally:
        first.kill()  # SIGKILL with the join's release on its way
    second = Controller(urls, "--journal", journal, "--join", urls[2], "--ops", "onload,join", *probe)
    try:
        ready = second.wait_for("ready", READY_S)
        assert ready is not None and ready["members"] == {urls[2]: "joining"}, f"{second.seen} {second.stderr}"
        assert ready["states"][urls[2]] == "fenced", ready
        assert second.wait(END_S) == 0, second.stderr
    finally:
        second.kill()
    assert _deaths(engines, since) == {}, f"{second.seen} {second.stderr}"
    ends = [line for line in second.seen if line.get("event") == "end"]
    assert [e["op"] for e in ends] == ["onload", "join"] and all(e["ok"] for e in ends), ends
    onload_phases = [p for p in second.seen if p.get("event") == "phase" and p.get("transition") == "onload"]
    assert onload_phases and all(urls[2] not in p["engines"] for p in onload_phases), "a fenced engine is sent nothing"
    assert _serving(engines) == [True, True, True]


def test_an_engine_joins_and_another_leaves_on_every_backend(engines: EmulatedFleet, backend: Backend) -> None:
    """Ray needs nothing new for a join: ``ray_engines([url])`` starts the joiner's actor, ``RayFanOut`` checks it
    (``check_engines``) and drives it like the others."""
    _, make, fanout = backend
    since = [len(e.log()) for e in engines.engines]
    urls = engines.direct_urls
    orch = Orchestrator(EngineGroup(make(urls[:2])), fanout=fanout())
    orch.offload()
    (joiner,) = make(urls[2:])
    report = orch.add(joiner)
    assert [p.phase for p in report.phases] == ["pause", "flush", "release"]
    assert engines.engines[2].state()["released_tags"], "brought into the offloaded group's state before it counts"
    orch.onload()
    orch.retire(urls[0])
    assert sorted(orch.states()) == sorted(urls[1:]) and set(orch.states().values()) == {EngineState.SERVING}
    assert _serving(engines) == [True, True, True] and _deaths(engines, since) == {}
