"""A gateway's 502 after the engine applied ``/continue_generation`` is ambiguous, on the real stack.

Three emulated engines behind ``FaultProxy``; the proxy in front of engine 1 forwards every
``/continue_generation`` to the engine, lets it act, and answers the client 502 instead, on every
attempt. Generation traffic runs through the proxies the whole time. Read as "not applied",
that 502 would make ``onload()`` name engine 1 "(paused)" while it served, and the next
``offload()`` skip its pause and flush, release its memory while it served, and the next
``/generate`` kill it. A gateway status may come after the engine acted: it is ambiguous,
so the next offload pauses and flushes engine 1 again before any release.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("torch")

from resilience.adapters.sglang import SGLANG_POLICIES, SGLangClient
from resilience.barrier import EngineGroup, EngineState, Orchestrator, PhaseDeadlines, PhaseFailed
from resilience.engine_contract import ALL_TAGS
from resilience.testing import fast_policies
from resilience.testing.emulator import EmulatedFleet, EngineConfig
from resilience.testing.faultplan import CONTROL_PATHS
from resilience.testing.faults import FaultPlan, FaultProxy, FaultRule
from tests.barrier.crash_rig import HTTP_TIMEOUT, Traffic, crash_causes, health, put_in_order

N_ENGINES = 3
LYING = 1
"""The engine whose proxy answers 502 after every continue it forwarded."""
CONFIG = EngineConfig(token_rate=400.0, health_hang_seconds=1.0, health_poll_seconds=0.05, abort_poll_seconds=0.05, swap_seconds=0.02)
POLICIES = fast_policies(SGLANG_POLICIES, attempt_timeout_s=2.0, deadline_s=6.0)
DEADLINES = PhaseDeadlines(transition_s=30, pause_s=10, flush_s=10, release_s=10, resume_s=10, continue_s=10)
PLAN = FaultPlan(seed=4, rules=(FaultRule("/continue_generation", "status_after", engines={LYING}),))
"""Every /continue_generation to engine 1, every attempt: forwarded, applied, answered 502."""


@pytest.fixture(scope="module")
def fleet() -> Iterator[EmulatedFleet]:
    with EmulatedFleet(N_ENGINES, CONFIG) as f:
        yield f


@pytest.fixture
def proxies(fleet: EmulatedFleet) -> Iterator[list[FaultProxy]]:
    """PLAN's proxies in front of engines put in order; stopped, and the engines put in order again, whatever happens."""
    put_in_order(fleet)
    started: list[FaultProxy] = []
    try:
        for engine in fleet.engines:
            proxy = FaultProxy(engine.direct_url, PLAN, engine.index)
            started.append(proxy)
            proxy.start()
        yield started
    finally:
        for proxy in started:
            proxy.stop()
        put_in_order(fleet)


def _calls_since(fleet: EmulatedFleet, index: int, seq: int) -> list[str]:
    return [c["path"] for c in fleet.engines[index].record()["calls"] if c["seq"] > seq and c["path"] != "/health"]


def _last_seq(fleet: EmulatedFleet, index: int) -> int:
    calls = fleet.engines[index].record()["calls"]
    return max((c["seq"] for c in calls), default=-1)


def test_continue_answered_502_after_apply_is_not_taken_for_paused(fleet: EmulatedFleet, proxies: list[FaultProxy]) -> None:
    """onload with every continue to engine 1 applied then answered 502: the next offload pauses and flushes it first; nothing dies."""
    clients = [SGLangClient(p.url, policies=POLICIES, flush_poll_s=0.05) for p in proxies]
    names = [c.engine for c in clients]
    lying = names[LYING]
    orch = Orchestrator(EngineGroup(clients), deadlines=DEADLINES)
    try:
        with Traffic([p.url for p in proxies]) as traffic:
            orch.offload()
            onload_error: PhaseFailed | None = None
            try:
                orch.onload()
            except PhaseFailed as exc:
                onload_error = exc
            for proxy in proxies:
                assert proxy.settle(HTTP_TIMEOUT, paths=CONTROL_PATHS)  # generation held at a paused gate is not waited for
            assert proxies[LYING].injected_count(502) >= 1  # the lie was told
            state = fleet.engines[LYING].state()
            assert not state["paused"] and not state["released_tags"], state  # the continue was applied: it serves
            if onload_error is not None:
                why = onload_error.left_paused.get(lying, "")
                assert why != "paused", f"onload names the serving engine {lying} as known paused: {onload_error}"
            assert orch.states()[lying] not in (EngineState.PAUSED, EngineState.FLUSHED), orch.states()

            seq = _last_seq(fleet, LYING)
            offload_error: PhaseFailed | None = None
            try:
                orch.offload()
            except PhaseFailed as exc:
                offload_error = exc
            for proxy in proxies:
                assert proxy.settle(HTTP_TIMEOUT, paths=CONTROL_PATHS)  # generation held at a paused gate is not waited for
            dead = [(e.index, crash_causes(e)) for e in fleet.engines if not e.alive()]
            assert not dead, f"the offload after the lie killed engines: {dead}; {offload_error}"
            sent = _calls_since(fleet, LYING, seq)
            if "/release_memory_occupation" in sent:
                first_release = sent.index("/release_memory_occupation")
                before = sent[:first_release]
                assert "/pause_generation" in before and "/flush_cache" in before, sent  # paused and flushed before the release
            for engine in fleet.engines:
                state = engine.state()
                assert state["paused"] or not state["released_tags"], f"engine {engine.index} serves with memory released: {state}"
                if offload_error is None:
                    assert state["paused"] and set(ALL_TAGS) <= set(state["released_tags"]), (engine.index, state)
        assert traffic.counts["error"] == 0, traffic.errors
        assert traffic.counts["answered"] > 0, traffic.counts
    finally:
        for client in clients:
            client.close()
    for engine in fleet.engines:
        assert engine.alive() and not crash_causes(engine), (engine.index, crash_causes(engine))
        assert health(engine) is not None
