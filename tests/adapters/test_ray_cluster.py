"""The barrier on a Ray cluster of two nodes on this machine, over a mixed fleet (SGLang and vLLM emulated engines).

``ray.cluster_utils.Cluster`` starts a head node and one worker node (two raylets, loopback only, one CPU
each, no dashboard); the engine actors are placed by custom resources: one SGLang and one vLLM engine's actor
on each node. The worker node is removed between the offload's pause and its flush: its actors die with it
(the emulated engines behind them, separate processes, do not). The flush fails naming exactly the engines
whose actors were lost (``EngineDied``), the survivors are rolled back and serve, finish an offload and an
onload once the lost ones are retired, and a new actor started later with ``ray_engine`` (one more engine
joining) reaches a lost engine from the node that is left.

This module owns its Ray: it shuts down the session's local Ray if it is up, runs the cluster, and starts
the local Ray again afterwards (``tests/conftest.py``: ``start_local_ray``), so the Ray modules after it in
the same worker find what they expect. It is in ``RAY_MODULES``: one Ray at a time per run.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

if os.environ.get("CI", "").lower() == "true":
    import ray  # CI must have Ray: fail, don't skip
else:
    ray = pytest.importorskip("ray", reason="Ray is not installed (pip install controlplane-resilience[ray])")
pytest.importorskip("fastapi")
pytest.importorskip("torch")

import ray._private.ray_constants as ray_constants
from ray.cluster_utils import Cluster

from resilience.adapters.ray import RayEngine, RayEngineHandle, RayFanOut, RayVLLMEngine, ray_engine, ray_engines
from resilience.barrier import EngineDied, EngineGroup, Orchestrator, PhaseFailed
from resilience.barrier.state import PhaseEnded
from resilience.engine_contract import SGLANG_RULES, VLLM_RULES, rules_of
from resilience.events import Event
from resilience.testing.emulator import EmulatedFleet, EngineConfig
from resilience.testing.emulator.vllm import VLLMEngineConfig
from tests.conftest import start_local_ray

SGLANG = EngineConfig(token_rate=200.0, health_hang_seconds=1.0, health_poll_seconds=0.05, swap_seconds=0.05)
VLLM = VLLMEngineConfig(dev_mode=True, enable_sleep_mode=True, token_rate=400.0)
CLIENT_KWARGS: dict[str, Any] = {"flush_poll_s": 0.05}
TIMEOUT = 30.0  # seconds: a bound no healthy loopback exchange or node removal reaches
NODE_A, NODE_B = "cpr_node_a", "cpr_node_b"  # custom resources naming the two nodes
ON = {NODE_A: {"resources": {NODE_A: 0.01}}, NODE_B: {"resources": {NODE_B: 0.01}}}


def wait_for(predicate: Callable[[], bool], timeout: float = TIMEOUT) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, "condition not reached in time"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[Cluster, Any]]:
    """A head node and one worker node on loopback; yields (cluster, the worker node). The local Ray is back after."""
    was_up = ray.is_initialized()
    if was_up:
        ray.shutdown()
    os.environ["RAY_AUTH_MODE"] = "disabled"
    # ray.init(address="127.0.0.1:port") swaps a loopback address for the machine's own IP (ray/_private/services.py
    # resolve_ip_for_localhost -> get_node_ip_address), where nothing listens: with ENABLE_RAY_CLUSTER off,
    # get_node_ip_address answers the loopback address instead, and every node and the driver stay on 127.0.0.1
    patch = pytest.MonkeyPatch()
    patch.setattr(ray_constants, "ENABLE_RAY_CLUSTER", False)
    node_args: dict[str, Any] = {"num_cpus": 1, "node_ip_address": "127.0.0.1", "include_dashboard": False}
    c = Cluster(
        initialize_head=True,
        head_node_args={
            **node_args,
            "resources": {NODE_A: 1.0},
            # a raylet that stops answering is declared dead within ~2 s (a graceful removal says so at once)
            "_system_config": {"health_check_period_ms": 500, "health_check_failure_threshold": 4},
        },
    )
    try:
        worker = c.add_node(**node_args, resources={NODE_B: 1.0})
        c.wait_for_nodes()
        ray.init(address=c.address, log_to_driver=False, configure_logging=False)
        yield c, worker
    finally:
        ray.shutdown()
        c.shutdown()
        patch.undo()
        if was_up:
            start_local_ray()


@pytest.fixture(scope="module")
def fleets(cluster: tuple[Cluster, Any]) -> Iterator[tuple[EmulatedFleet, EmulatedFleet]]:
    with EmulatedFleet(2, SGLANG) as sglang, EmulatedFleet(2, VLLM) as vllm:
        yield sglang, vllm


def _dead(engine: RayEngineHandle) -> bool:
    try:
        ray.get(engine.actor.engine.remote(), timeout=TIMEOUT)
    except ray.exceptions.RayActorError:
        return True
    return False


def test_a_node_removed_mid_offload_loses_its_engines_by_name_and_the_survivors_finish(
    cluster: tuple[Cluster, Any], fleets: tuple[EmulatedFleet, EmulatedFleet]
) -> None:
    c, worker = cluster
    sglang, vllm = fleets
    assert len(ray.nodes()) == 2 and all(n["Alive"] for n in ray.nodes())
    # a mixed fleet in one call: one kind per URL; the two on node B start later, one at a time (engines that join)
    on_a = ray_engines([sglang.urls[0], vllm.urls[0]], kind=["sglang", "vllm"], actor_options=ON[NODE_A])
    on_b = [
        ray_engine(sglang.urls[1], kind="sglang", client_kwargs=CLIENT_KWARGS, actor_options=ON[NODE_B]),
        ray_engine(vllm.urls[1], kind="vllm", actor_options=ON[NODE_B]),
    ]
    engines = [*on_a, *on_b]
    assert [type(e) for e in engines] == [RayEngine, RayVLLMEngine, RayEngine, RayVLLMEngine]
    assert [rules_of(e) for e in engines] == [SGLANG_RULES, VLLM_RULES, SGLANG_RULES, VLLM_RULES]
    lost = {e.engine for e in on_b}
    survivors = [e.engine for e in on_a]

    def remove_node_b_after_pause(event: Event) -> None:
        if isinstance(event, PhaseEnded) and event.phase == "pause" and worker in c.worker_nodes:
            c.remove_node(worker)
            wait_for(lambda: all(_dead(e) for e in on_b))

    orch = Orchestrator(EngineGroup(engines), fanout=RayFanOut(), observers=[remove_node_b_after_pause])
    try:
        with pytest.raises(PhaseFailed) as info:
            orch.offload()
        err = info.value
        assert err.phase == "flush"
        assert set(err.failures) == lost  # the lost ones are named, and no one else
        assert all(isinstance(err.failures[name], EngineDied) for name in lost), err.failures
        assert set(err.dead) == lost
        assert sorted(err.rolled_back) == sorted(survivors)
        assert not any(n["Alive"] for n in ray.nodes() if n["Resources"].get(NODE_B))  # Ray sees node B gone
        # no engine died: every emulated engine, lost actor or not, still answers
        for handle in (*sglang.engines, *vllm.engines):
            assert handle.alive(), handle.log()
        assert sglang.engines[1].state()["paused"]  # paused by the offload's first phase, before its actor was lost
        assert {n: s.value for n, s in orch.states().items() if n in survivors} == dict.fromkeys(survivors, "serving")

        # the survivors finish: with the lost ones retired, an offload and an onload go through on node A
        for name in lost:
            orch.retire(name)
        orch.offload()
        assert {s.value for s in orch.states().values()} == {"released"}
        assert set(sglang.engines[0].state()["released_tags"]) and vllm.engines[0].alive()
        orch.onload()
        assert {s.value for s in orch.states().values()} == {"serving"}
        assert sglang.engines[0].state()["released_tags"] == []

        # one more actor, started later on the node that is left, reaches a lost engine and reopens it
        rejoined = ray_engine(sglang.urls[1], kind="sglang", client_kwargs=CLIENT_KWARGS, actor_options=ON[NODE_A])
        again = ray_engine(vllm.urls[1], kind="vllm", actor_options=ON[NODE_A])
        try:
            assert again.is_paused() is True  # the vLLM engine is still paused where the lost actor left it
            again.continue_generation()
            assert again.is_paused() is False
            rejoined.continue_generation()
            wait_for(lambda: not sglang.engines[1].state()["paused"])
        finally:
            rejoined.kill()
            again.kill()
    finally:
        orch.close()
        for e in on_a:
            e.kill()
