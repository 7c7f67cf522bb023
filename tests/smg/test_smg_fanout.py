"""SmgFanOut on a real smg gateway: the barrier's phases through ``/v1/rl/engine/{path}``, with faults on both sides of it.

Four emulated engines behind fault proxies (the faults between the gateway and the engines), one gateway
(``--rl-control-timeout-secs 2``); a second fault proxy in front of the gateway plays a gateway that fails itself.
Each test drives its own engines (0 and 1 have no faults), so any of them runs alone.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import requests

pytest.importorskip("torch")
from resilience.adapters.smg_fanout import GatewayRefused, SmgEngine, SmgFanOut, SmgWorkerError
from resilience.barrier import EngineGroup, Orchestrator, PhaseFailed
from resilience.barrier.state import Effect, effect_of, is_engine_dead
from resilience.deadline import Deadline
from resilience.engine_contract import EngineState
from resilience.testing.emulator import EmulatedFleet, EngineConfig
from resilience.testing.faultplan import FaultPlan, FaultRule
from resilience.testing.faultproxy import FaultProxy
from resilience.testing.smg import GatewayHealth, SmgGateway
from tests.smg.conftest import gateway_for

HEALTH = GatewayHealth(interval_s=5, timeout_s=2)
CONFIG = EngineConfig(health_poll_seconds=0.05, health_hang_seconds=3.0)
CLEAN_A, CLEAN_B, FLAKY, HANGS, PROBED = range(5)
ALL = ("kv_cache", "weights", "cuda_graph")
PLAN = FaultPlan(
    seed=0,
    rules=(
        # the engine releases, the gateway sees a 502 from the proxy in between: it may have been applied
        FaultRule(path="/release_memory_occupation", kind="status_after", engines=frozenset({FLAKY, PROBED}), calls=frozenset({1})),
        # the engine never sees this resume, but a 502 cannot say so
        FaultRule(path="/resume_memory_occupation", kind="status_before", engines=frozenset({FLAKY, PROBED}), calls=frozenset({1})),
        # past --rl-control-timeout-secs
        FaultRule(path="/pause_generation", kind="hang", engines=frozenset({HANGS}), calls=frozenset({1, 2}), delay=5.0),
    ),
)


@pytest.fixture(scope="module")
def stack() -> Iterator[tuple[EmulatedFleet, SmgGateway]]:
    with EmulatedFleet(5, CONFIG, fault_plan=PLAN) as fleet, gateway_for(fleet.urls, HEALTH, rl_control_timeout_s=2) as gateway:
        yield fleet, gateway


def _released(fleet: EmulatedFleet, index: int) -> frozenset[str] | None:
    return fleet.memory_probe().released_tags(fleet.urls[index])


def _orchestrator(fanout: SmgFanOut, fleet: EmulatedFleet, *indices: int) -> tuple[Orchestrator[SmgEngine], list[str]]:
    urls = [fleet.urls[i] for i in indices]
    return Orchestrator([EngineGroup(fanout.engines(urls))], fanout=fanout), urls


def test_offload_weight_sync_and_onload_through_the_gateway_one_call_per_phase(stack: tuple[EmulatedFleet, SmgGateway]) -> None:
    fleet, gateway = stack
    fanout = SmgFanOut(gateway.url)
    orch, urls = _orchestrator(fanout, fleet, CLEAN_A, CLEAN_B)
    orch.offload()
    assert orch.states() == dict.fromkeys(urls, EngineState.RELEASED)
    assert _released(fleet, CLEAN_A) == _released(fleet, CLEAN_B) == frozenset(ALL)
    assert fanout.gateway_calls == 3  # pause, flush, release: each one fan-out for both engines
    orch.onload()
    assert orch.states() == dict.fromkeys(urls, EngineState.SERVING)
    assert _released(fleet, CLEAN_A) == _released(fleet, CLEAN_B) == frozenset()
    from smg.rl import RL  # smg only once the fixture found it (it skips without, or fails on CI)

    rl = RL(gateway.url)
    ids = [w.id for w in rl.workers() if w.url in urls]
    with orch.weight_sync() as engines:  # the sync's pause and continue go through the gateway too
        assert {e.engine for e in engines} == set(urls)
        assert set(orch.states().values()) == {EngineState.PAUSED}
        body = {"model_path": "emulated/sglang-model", "weight_version": "v2"}
        update = rl.fanout("update_weights_from_disk", body, selector=f"id in ({','.join(ids)})")
        assert update.succeeded == update.total == 2
    assert orch.states() == dict.fromkeys(urls, EngineState.SERVING)
    assert {rl.call(i, "model_info", method="GET").body["weight_version"] for i in ids} == {"v2"}
    assert fanout.gateway_calls == 3 + 2 + 2  # onload: resume, continue; the sync: pause, continue
    fanout.close()


def test_502s_between_gateway_and_engine_leave_its_touched_facts_unknown_until_reconciled(stack: tuple[EmulatedFleet, SmgGateway]) -> None:
    fleet, gateway = stack
    fanout = SmgFanOut(gateway.url)
    orch, (url,) = _orchestrator(fanout, fleet, FLAKY)
    with pytest.raises(PhaseFailed):
        orch.offload()  # release applied, 502 seen: maybe
    assert orch.states()[url] == EngineState.QUARANTINED
    assert _released(fleet, FLAKY) == frozenset(ALL)
    orch.reconcile(url, released=_released(fleet, FLAKY), paused=True)
    with pytest.raises(PhaseFailed):
        orch.onload()  # resume never reached the engine, but the 502 cannot prove it: maybe again
    assert orch.states()[url] == EngineState.QUARANTINED
    assert _released(fleet, FLAKY) == frozenset(ALL)
    orch.reconcile(url, released=_released(fleet, FLAKY), paused=True)
    orch.onload()
    assert orch.states()[url] == EngineState.SERVING
    assert _released(fleet, FLAKY) == frozenset()
    fanout.close()


def test_a_memory_probe_settles_those_502s_in_the_fanout_applied_or_sent_again(stack: tuple[EmulatedFleet, SmgGateway]) -> None:
    fleet, gateway = stack
    fanout = SmgFanOut(gateway.url, memory_probe=fleet.memory_probe())
    orch, (url,) = _orchestrator(fanout, fleet, PROBED)
    orch.offload()  # the 502 after the release: the probe proves it applied
    assert orch.states()[url] == EngineState.RELEASED
    orch.onload()  # the 502 before the resume: the probe proves it not applied, and it is sent again
    assert orch.states()[url] == EngineState.SERVING
    assert _released(fleet, PROBED) == frozenset()
    assert fanout.probe_verdicts == 2
    fanout.close()


def test_a_gateway_that_fails_itself_leaves_every_engine_of_the_call_unknown(stack: tuple[EmulatedFleet, SmgGateway]) -> None:
    """A 502 from in front of the gateway after it fanned the release out: both engines released, both unknown."""
    fleet, gateway = stack
    front_plan = FaultPlan(
        seed=0,
        rules=(
            FaultRule(path="/v1/rl/engine/release_memory_occupation", kind="status_after", calls=frozenset({1})),
            FaultRule(path="/v1/rl/engine/resume_memory_occupation", kind="drop_after", calls=frozenset({1})),
        ),
    )
    with FaultProxy(gateway.url, front_plan) as front:
        fanout = SmgFanOut(front.url)
        orch, urls = _orchestrator(fanout, fleet, CLEAN_A, CLEAN_B)
        with pytest.raises(PhaseFailed):
            orch.offload()
        assert orch.states() == dict.fromkeys(urls, EngineState.QUARANTINED)
        assert _released(fleet, CLEAN_A) == _released(fleet, CLEAN_B) == frozenset(ALL)
        for url in urls:
            orch.reconcile(url, released=ALL, paused=True)
        with pytest.raises(PhaseFailed):
            orch.onload()  # the connection is lost after the gateway got the resume: maybe, for both
        assert orch.states() == dict.fromkeys(urls, EngineState.QUARANTINED)
        assert front.settle()
        for index, url in zip((CLEAN_A, CLEAN_B), urls, strict=True):
            orch.reconcile(url, released=_released(fleet, index), paused=True)
        orch.onload()
        assert orch.states() == dict.fromkeys(urls, EngineState.SERVING)
        fanout.close()


def test_a_gateway_that_refuses_the_connection_sent_nothing_and_no_engine_is_called_dead(
    stack: tuple[EmulatedFleet, SmgGateway], refusing_port: int
) -> None:
    fleet, gateway = stack
    fanout = SmgFanOut(gateway.url)
    engines = fanout.engines([fleet.urls[CLEAN_A], fleet.urls[CLEAN_B]])
    fanout.check_engines(engines)  # learns the worker ids from the gateway
    fanout.gateway_url = f"http://127.0.0.1:{refusing_port}"  # then the gateway goes away
    results = fanout.call([(e, {"mode": "abort"}) for e in engines], "pause_generation", Deadline(5.0))
    assert all(isinstance(r.error, GatewayRefused) for r in results)
    assert {effect_of(r.error) for r in results} == {Effect.NOT_APPLIED}
    assert not any(is_engine_dead(r.error) for r in results if r.error is not None)
    fanout.close()


def test_rl_control_timeout_expiring_is_a_maybe_for_that_engine_only_and_an_idempotent_call_is_sent_again(
    stack: tuple[EmulatedFleet, SmgGateway],
) -> None:
    fleet, gateway = stack
    once = SmgFanOut(gateway.url, retries=0)
    engines = once.engines([fleet.urls[CLEAN_A], fleet.urls[HANGS]])
    results = once.call([(e, {"mode": "abort"}) for e in engines], "pause_generation", Deadline(10.0))
    assert results[0].ok
    assert isinstance(results[1].error, SmgWorkerError) and "upstream_timeout" in str(results[1].error)
    assert effect_of(results[1].error) is Effect.AMBIGUOUS
    assert once.gateway_calls == 1
    again = SmgFanOut(gateway.url)  # pause is idempotent: sent again to the engine whose answer timed out
    results = again.call([(e, {"mode": "abort"}) for e in engines], "pause_generation", Deadline(10.0))
    assert all(r.ok for r in results), results
    assert again.gateway_calls == 2
    cleanup = again.call([(e, {"torch_empty_cache": True}) for e in engines], "continue_generation", Deadline(10.0))
    assert all(r.ok for r in cleanup), cleanup
    once.close()
    again.close()


def test_a_worker_registered_again_under_a_new_id_is_refused_once_then_found(stack: tuple[EmulatedFleet, SmgGateway]) -> None:
    """The gateway forgot the id SmgFanOut had cached: nothing is sent (refused, not a maybe), and the next call uses the new id."""
    fleet, gateway = stack
    url = fleet.urls[CLEAN_B]
    fanout = SmgFanOut(gateway.url)
    (engine,) = fanout.engines([url])
    fanout.check_engines([engine])
    old = gateway.worker(url)
    assert old is not None
    worker = f"{gateway.url}/workers/{old['id']}"
    requests.patch(worker, json={"health": {"drain_settle_secs": 0}}, timeout=5).raise_for_status()  # no 5 s drain
    requests.delete(worker, timeout=5).raise_for_status()
    assert gateway.wait_status(url, lambda s: s is None, 10) is None
    gateway.add_worker(url)
    assert gateway.wait_status(url, lambda s: s is not None, 10) is not None  # listed under its new id (ready or not yet)
    (refused,) = fanout.call([(engine, {})], "flush_cache", Deadline(5.0))
    assert isinstance(refused.error, GatewayRefused) and effect_of(refused.error) is Effect.NOT_APPLIED
    (flushed,) = fanout.call([(engine, {})], "flush_cache", Deadline(5.0))
    assert flushed.ok, flushed
    fanout.close()
