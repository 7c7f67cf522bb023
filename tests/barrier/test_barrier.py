"""The barrier orchestrator on emulated engines: ordering, owned pauses, idempotence, failures and rollback."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
import requests

from resilience import AmbiguousOutcome
from resilience.barrier import EngineGroup, Orchestrator, PhaseDeadlines, PhaseFailed
from resilience.barrier.journal import RestartBudget
from resilience.barrier.state import PhaseEnded, TransitionEnded
from resilience.engine_contract import EngineState
from resilience.events import Event
from resilience.testing.emulator import EmulatedFleet
from resilience.testing.faults import FaultPlan, FaultRule
from tests.barrier.conftest import Backend
from tests.conftest import port_held
from tests.sglang.conftest import FAST_ENGINE, FAST_SGLANG


@pytest.fixture(scope="module")
def fleet4() -> Iterator[EmulatedFleet]:
    """Four engines shared by the ordering tests (each test leaves them serving)."""
    with EmulatedFleet(4, FAST_ENGINE) as fleet:
        yield fleet


def calls(fleet: EmulatedFleet, since_ns: int = 0) -> list[list[dict[str, Any]]]:
    """Each engine's control calls received after ``since_ns``."""
    return [[c for c in e.record()["calls"] if c["received_ns"] >= since_ns] for e in fleet.engines]


def first_received(per_engine: list[list[dict[str, Any]]], path: str) -> int:
    return min(c["received_ns"] for cs in per_engine for c in cs if c["path"] == path)


def last_answered(per_engine: list[list[dict[str, Any]]], path: str) -> int:
    return max(c["answered_ns"] for cs in per_engine for c in cs if c["path"] == path)


def paths(cs: list[dict[str, Any]]) -> list[str]:
    return [c["path"] for c in cs]


def test_offload_onload_phase_order_and_skipped_group(fleet4: EmulatedFleet, backend: Backend) -> None:
    """Every pause is acked before any flush, every flush before any release; continue follows resumes; needs_offload=False gets nothing."""
    _, make, fanout = backend
    engines = make(fleet4.urls)
    orch = Orchestrator([EngineGroup(engines[:3]), EngineGroup(engines[3:], needs_offload=False)], fanout=fanout())
    t0 = time.monotonic_ns()
    orch.offload()
    orch.onload()
    seen = calls(fleet4, t0)
    offloaded = seen[:3]
    assert last_answered(offloaded, "/pause_generation") < first_received(offloaded, "/flush_cache")
    assert last_answered(offloaded, "/flush_cache") < first_received(offloaded, "/release_memory_occupation")
    assert last_answered(offloaded, "/resume_memory_occupation") < first_received(offloaded, "/continue_generation")
    for cs in offloaded:
        assert paths(cs) == ["/pause_generation", "/flush_cache", "/release_memory_occupation",
                             "/resume_memory_occupation", "/continue_generation"]
    assert seen[3] == []
    assert set(orch.states().values()) == {EngineState.SERVING}


def test_offload_and_onload_are_idempotent(fleet4: EmulatedFleet, backend: Backend) -> None:
    """Offloading twice releases once; onloading twice resumes once (a double release would kill the engine)."""
    _, make, fanout = backend
    orch = Orchestrator(EngineGroup(make(fleet4.urls)), fanout=fanout())
    t0 = time.monotonic_ns()
    orch.offload()
    second = orch.offload()
    orch.onload()
    orch.onload()
    assert second.phases == ()
    for cs, engine in zip(calls(fleet4, t0), fleet4.engines, strict=True):
        assert paths(cs).count("/release_memory_occupation") == 1
        assert paths(cs).count("/resume_memory_occupation") == 1
        assert engine.alive()


def test_weight_sync_inside_offload_does_not_reopen_admission(fleet4: EmulatedFleet, backend: Backend) -> None:
    """A weight sync inside an offloaded window leaves engines paused; only onload's continue reopens them."""
    _, make, fanout = backend
    engines = make(fleet4.urls)
    orch = Orchestrator(EngineGroup(engines), fanout=fanout())
    t0 = time.monotonic_ns()
    orch.offload()
    orch.onload(tags=["weights"])  # a sync into released weights is refused (test_weight_sync_refused_while_weights_released)
    with orch.weight_sync():
        assert orch.held()[engines[0].engine] == ("offload", "weight_sync")
    assert all(requests.get(f"{u}/ready", timeout=5).status_code == 503 for u in fleet4.urls)
    assert all("/continue_generation" not in paths(cs) for cs in calls(fleet4, t0))
    orch.onload()
    assert all(paths(cs).count("/continue_generation") == 1 for cs in calls(fleet4, t0))
    assert orch.held() == {}


def test_weight_sync_alone_pauses_and_continues(fleet4: EmulatedFleet, backend: Backend) -> None:
    """Outside an offload, weight sync pauses every engine, runs the update, and continues them."""
    _, make, fanout = backend
    orch = Orchestrator(EngineGroup(make(fleet4.urls)), fanout=fanout())
    t0 = time.monotonic_ns()
    with orch.weight_sync(mode="retract"):
        for u in fleet4.urls:
            requests.post(f"{u}/update_weight_version", json={"new_version": "v9"}, timeout=5).raise_for_status()
    for cs in calls(fleet4, t0):
        assert paths(cs) == ["/pause_generation", "/update_weight_version", "/continue_generation"]


def test_offload_in_place_refused(fleet4: EmulatedFleet) -> None:
    """Offload with in_place pause is refused before any call: flush would fail with KV held."""
    orch = Orchestrator(EngineGroup([]))
    with pytest.raises(ValueError, match="in_place"):
        orch.offload(mode="in_place")  # type: ignore[arg-type]


def test_one_dead_engine_named_others_continue(backend: Backend) -> None:
    """One of 8 engines killed before offload: the error names it, the other 7 are continued and serve /generate."""
    _, make, fanout = backend
    events: list[Event] = []
    with EmulatedFleet(8, FAST_ENGINE) as fleet:
        engines = make(fleet.urls)
        budget = RestartBudget(3)
        orch = Orchestrator(EngineGroup(engines), fanout=fanout(), observers=[events.append],
                            deadlines=PhaseDeadlines(transition_s=30, pause_s=20), restart_budget=budget)
        fleet.engines[5].kill()
        t0 = time.monotonic()
        with port_held(fleet.urls[5]), pytest.raises(PhaseFailed) as info:  # no other server takes the dead one's port meanwhile
            orch.offload()
        assert time.monotonic() - t0 < 30
        err = info.value
        dead_name = engines[5].engine
        assert err.phase == "pause" and list(err.failures) == [dead_name]
        assert dead_name in str(err) and "A restart would use 1 of 3" in str(err)
        assert dead_name in err.dead and list(err.left_paused) == [dead_name]  # v2: every engine not serving is named, dead ones too
        assert "dead" in err.left_paused[dead_name]
        assert sorted(err.rolled_back) == sorted(e.engine for i, e in enumerate(engines) if i != 5)
        for i, url in enumerate(fleet.urls):
            if i != 5:
                out = requests.post(f"{url}/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}}, timeout=10)
                assert out.status_code == 200
        ended = [e for e in events if isinstance(e, TransitionEnded)]
        assert ended[-1].ok is False and ended[-1].failed_phase == "pause"
        assert any(isinstance(e, PhaseEnded) and e.failures for e in events)


def test_release_failure_rolls_back_every_engine(backend: Backend) -> None:
    """A release refused on one engine: the released ones are resumed, all are continued, and the error says so."""
    _, make, fanout = backend
    refuse = FaultRule("/release_memory_occupation", "status_before", status=500, probability=1.0, engines=frozenset({1}))
    plan = FaultPlan(seed=3, rules=(refuse,))
    with EmulatedFleet(3, FAST_ENGINE, fault_plan=plan) as fleet:
        engines = make(fleet.urls)
        orch = Orchestrator(EngineGroup(engines), fanout=fanout())
        with pytest.raises(PhaseFailed) as info:
            orch.offload()
        err = info.value
        assert err.phase == "release" and list(err.failures) == [engines[1].engine]
        assert err.left_paused == {} and "Every engine is serving" in str(err)
        assert sorted(err.rolled_back) == sorted(e.engine for e in engines)
        for engine in fleet.engines:
            state = engine.state()
            assert engine.alive() and not state["paused"] and state["released_tags"] == []
        assert set(orch.states().values()) == {EngineState.SERVING}


def test_ambiguous_release_is_quarantined_until_reconciled(backend: Backend) -> None:
    """A release that may have been applied is neither resumed nor re-sent: the engine is quarantined and named by every
    transition until the caller reconciles it from the engine's real state; then onload brings it back."""
    _, make, fanout = backend
    plan = FaultPlan(seed=3, rules=(FaultRule("/release_memory_occupation", "latency", delay=1.0, engines=frozenset({1})),))
    release = FAST_SGLANG.match("POST", "/release_memory_occupation").policy
    policies = FAST_SGLANG.with_entries({"GET|POST /release_memory_occupation": replace(release, attempt_timeout_s=0.4)})
    with EmulatedFleet(3, FAST_ENGINE, fault_plan=plan) as fleet:
        engines = make(fleet.urls, policies)
        orch = Orchestrator(EngineGroup(engines), fanout=fanout())
        with pytest.raises(PhaseFailed) as info:
            orch.offload()
        err = info.value
        name = engines[1].engine
        assert isinstance(err.failures[name], AmbiguousOutcome)
        assert "quarantined" in err.left_paused[name] and err.quarantined == (name,)  # v2: quarantined, reconcile or retire
        assert name in str(err) and "Not serving" in str(err)
        assert sorted(err.rolled_back) == sorted([engines[0].engine, engines[2].engine])
        with pytest.raises(PhaseFailed) as again:
            orch.onload()  # v2: skipped, and said so (the old code could resume or re-release it)
        assert again.value.phase == "skipped" and list(again.value.failures) == [name] and again.value.quarantined == (name,)
        time.sleep(1.2)  # the delayed release lands
        assert all(e.alive() for e in fleet.engines)
        state = fleet.engines[1].state()
        assert state["paused"] is True and state["released_tags"]  # applied: a resume is right now, a second release would kill it
        orch.reconcile(engines[1], released=state["released_tags"], paused=True)
        assert orch.quarantined() == {} and orch.paused_by_us(name)
        report = orch.onload()
        assert [p.phase for p in report.phases] == ["resume", "continue"] and report.phases[0].engines == (name,)
        assert all(e.alive() and not e.state()["paused"] and e.state()["released_tags"] == [] for e in fleet.engines)
        assert set(orch.states().values()) == {EngineState.SERVING}


def test_paused_by_us_takes_names_urls_and_engine_objects(fleet4: EmulatedFleet, backend: Backend) -> None:
    """paused_by_us accepts the engine's name, its URL, or the engine object; an engine it does not drive is a KeyError naming it."""
    _, make, fanout = backend
    engines = make(fleet4.urls)
    orch = Orchestrator([EngineGroup(engines[:2]), EngineGroup(engines[2:3], needs_offload=False)], fanout=fanout())
    orch.offload(tags=["kv_cache"])
    try:
        for engine, url in zip(engines[:3], fleet4.urls[:3], strict=True):
            expected = engine in engines[:2]
            assert orch.paused_by_us(engine) is expected
            assert orch.paused_by_us(engine.engine) is expected
            assert orch.paused_by_us(url + "/") is expected
        with pytest.raises(KeyError, match=re.escape(engines[3].engine)):
            orch.paused_by_us(engines[3])
        with pytest.raises(KeyError, match=re.escape("http://10.0.0.1:1")):
            orch.paused_by_us("http://10.0.0.1:1")
    finally:
        orch.onload()
    assert not any(orch.paused_by_us(e) for e in engines[:3])
