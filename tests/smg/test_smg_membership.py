"""Membership behind a real smg gateway: a join through ``SmgFanOut``, a fenced joiner held out of rotation by
``SmgRouter``, and a retired engine deregistered from the gateway (NeMo-RL #3613: never deregistered, it took traffic).

One gateway (1 s health probes) in front of three emulated engines; each test drives its own engines.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

pytest.importorskip("torch")

from resilience.adapters.sglang import SGLangClient
from resilience.adapters.smg import HELD_LABEL, SmgRouter
from resilience.adapters.smg_fanout import SmgFanOut
from resilience.barrier import EngineGroup, EngineState, Orchestrator, PhaseFailed, WeightVersionCheck
from resilience.testing.emulator import EmulatedFleet, EngineConfig
from resilience.testing.lab_sglang import demo_policies
from resilience.testing.smg import GatewayHealth, SmgGateway
from tests.smg.conftest import gateway_for

HEALTH = GatewayHealth(interval_s=1, timeout_s=1, failure_threshold=1, success_threshold=1)
CONFIG = EngineConfig(health_poll_seconds=0.05, health_hang_seconds=3.0)
ALL = frozenset({"kv_cache", "weights", "cuda_graph"})


@pytest.fixture(scope="module")
def stack() -> Iterator[tuple[EmulatedFleet, SmgGateway]]:
    with EmulatedFleet(3, CONFIG) as fleet, gateway_for(fleet.urls, HEALTH) as gateway:
        yield fleet, gateway


def test_an_engine_joins_an_offloaded_group_through_the_gateway(stack: tuple[EmulatedFleet, SmgGateway]) -> None:
    fleet, _gateway = stack
    fanout = SmgFanOut(_gateway.url)
    a, b, c = fanout.engines(fleet.urls)
    orch = Orchestrator(EngineGroup([a, b]), fanout=fanout)
    try:
        orch.offload()
        report = orch.add(c)
        assert [p.phase for p in report.phases] == ["pause", "flush", "release"]
        assert fleet.memory_probe().released_tags(fleet.urls[2]) == ALL
        assert orch.states()[c.engine] is EngineState.RELEASED
        orch.onload()
        assert all(not (s := e.state())["paused"] and not s["released_tags"] for e in fleet.engines)
    finally:
        fanout.close()


def test_a_fenced_joiner_is_held_out_of_rotation_and_a_retired_engine_is_deregistered(stack: tuple[EmulatedFleet, SmgGateway]) -> None:
    fleet, gateway = stack
    clients = [SGLangClient(url, policies=demo_policies()) for url in fleet.urls]
    a, b, c = clients
    orch = Orchestrator(EngineGroup([a, b]))
    router = SmgRouter(gateway.url, orch, interval_s=0.2, timeout_s=1)
    try:
        assert router.sync().errors == {}
        with pytest.raises(PhaseFailed):  # the wrong weights: fenced, paused, never continued
            orch.add(c, verify=WeightVersionCheck("a version nobody serves"))
        assert orch.states()[c.engine] is EngineState.FENCED
        assert router.sync().patched == {c.engine: "leaving"}
        assert gateway.wait_status(c.engine, lambda s: s == "not_ready", 15) == "not_ready"  # smg routes nothing to it
        router.sync()
        worker = gateway.worker(c.engine)
        assert worker is not None and worker["labels"][HELD_LABEL] == "fenced", worker
        orch.retire(b)
        synced = router.sync()
        assert synced.removed == [b.engine], synced
        assert gateway.wait_status(b.engine, lambda s: s is None, 10) is None, "a retired engine is no longer a worker"
        assert router.sync().removed == []  # idempotent
    finally:
        router.stop()
        orch.retire(c)
        router.sync()
        for engine in (b, c):  # put the gateway back as the module found it
            if gateway.worker(engine.engine) is None:
                gateway.add_worker(engine.engine)
        for handle in fleet.engines:
            if handle.state()["paused"]:
                SGLangClient(handle.direct_url, policies=demo_policies()).continue_generation()
        for client in clients:
            client.close()
