"""Health during holds on a real smg gateway: its own checker ejects an engine we hold paused; SmgRouter keeps it.

One gateway (short health intervals, ``--remove-unhealthy-workers``) in front of four emulated engines, each behind a
pass-through fault proxy that counts what the gateway sends it. Each test drives its own engines:

- 0 (no integration) and 1 (SmgRouter) held side by side for longer than the gateway's ejection window;
- 2 held, then killed: still ejected;
- 3 an onload that fails (502s on continue_generation), then one that succeeds: the gateway follows both.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import requests

pytest.importorskip("torch")

from resilience.adapters.sglang import SGLangClient
from resilience.adapters.smg import HELD_LABEL, SmgRouter
from resilience.barrier import EngineGroup, Orchestrator, PhaseFailed
from resilience.testing.emulator import EmulatedFleet, EngineConfig
from resilience.testing.faultplan import FaultPlan, FaultRule
from resilience.testing.faultproxy import FaultProxy
from resilience.testing.lab_sglang import demo_policies
from resilience.testing.smg import GatewayHealth, SmgGateway
from tests.smg.conftest import gateway_for

HEALTH = GatewayHealth(interval_s=1, timeout_s=1, failure_threshold=1, success_threshold=1, remove_unhealthy=True)
"""Ejection of a held-paused engine after 4 failed probes (ready -> not_ready after 1, failed after 3 more)."""
CONFIG = EngineConfig(health_hang_seconds=3.0, health_poll_seconds=0.05)
"""A paused engine's /health hangs 3 s (SGLang: 20 s), past the gateway's 1 s probe timeout."""
UNGUARDED, GUARDED, DIES, FAILS = range(4)
CONTINUE_502S = 8
"""502s on engine FAILS's first continue_generation attempts: more than one onload's retries, fewer than two."""
PLAN = FaultPlan(
    seed=0,
    rules=(FaultRule(path="/continue_generation", kind="status_before", engines=frozenset({FAILS}), max_count=CONTINUE_502S),),
)


@pytest.fixture(scope="module")
def stack() -> Iterator[tuple[EmulatedFleet, SmgGateway]]:
    with EmulatedFleet(4, CONFIG, fault_plan=PLAN) as fleet, gateway_for(fleet.urls, HEALTH) as gateway:
        yield fleet, gateway


def _orchestrator(fleet: EmulatedFleet, *indices: int) -> tuple[Orchestrator[SGLangClient], list[SGLangClient]]:
    clients = [SGLangClient(fleet.urls[i], policies=demo_policies()) for i in indices]
    return Orchestrator([EngineGroup(clients)]), clients


def _proxy(fleet: EmulatedFleet, index: int) -> FaultProxy:
    proxy = fleet.engines[index].proxy
    assert proxy is not None
    return proxy


def _seen(fleet: EmulatedFleet, index: int, path: str) -> int:
    """How many requests to ``path`` engine ``index``'s proxy received (the gateway's probes and routed traffic)."""
    return sum(1 for r in _proxy(fleet, index).seen if r.path == path)


def _poll(condition: Callable[[], bool], timeout: float, step: float = 0.1) -> bool:
    import time

    deadline = time.monotonic() + timeout
    for _ in range(int(timeout / step) + 1):
        if condition():
            return True
        if time.monotonic() >= deadline:
            break
        time.sleep(step)
    return condition()


def _generate(gateway: SmgGateway, n: int) -> list[int]:
    return [
        requests.post(f"{gateway.url}/generate", json={"text": f"q{i}", "sampling_params": {"max_new_tokens": 2}}, timeout=10).status_code
        for i in range(n)
    ]


def test_a_hold_past_the_ejection_window_ejects_the_engine_without_smgrouter_and_keeps_it_with(
    stack: tuple[EmulatedFleet, SmgGateway],
) -> None:
    fleet, gateway = stack
    unguarded, guarded = fleet.urls[UNGUARDED], fleet.urls[GUARDED]
    orch, clients = _orchestrator(fleet, UNGUARDED, GUARDED)
    router = SmgRouter(gateway.url, orch, HEALTH.settings(), engines=[guarded], interval_s=0.1)
    orch.observers = (*orch.observers, router)  # an observer: a hold or state change wakes its thread at once
    with router:
        orch.offload()
        assert set(orch.held()) == {unguarded, guarded}
        # The guarded engine leaves rotation (not_ready: never routed to) within a probe or two.
        assert gateway.wait_status(guarded, lambda s: s == "not_ready", 10) == "not_ready"
        assert _poll(lambda: router.phases().get(guarded) == "held", 5)
        # The gateway's own checker ejects the one it was not told about: a paused engine's /health hangs.
        assert gateway.wait_status(unguarded, lambda s: s is None, HEALTH.ejection_window_s + 10) is None
        # Meanwhile it kept probing the guarded one, more often than its ejection needs, and kept it listed.
        probes_at_hold = _seen(fleet, GUARDED, "/health")
        assert _poll(lambda: _seen(fleet, GUARDED, "/health") >= probes_at_hold + 4, 10)
        held = gateway.worker(guarded)
        assert held is not None and held["status"] == "not_ready" and held["labels"][HELD_LABEL] == "released"
        # Generation through the gateway is served by the engines not held, and none of it reaches the held one.
        served_by_held = _seen(fleet, GUARDED, "/generate")
        assert _generate(gateway, 4) == [200] * 4
        assert _seen(fleet, GUARDED, "/generate") == served_by_held
        # Idempotent: with nothing changed a pass sends nothing.
        assert router.sync().patched == {}
        orch.onload()
        assert orch.held() == {}
        assert gateway.wait_status(guarded, lambda s: s == "ready", 10) == "ready"
        assert _poll(lambda: router.phases().get(guarded) == "free", 5)
        restored = gateway.worker(guarded)
        assert restored is not None and restored["labels"][HELD_LABEL] == ""
        assert router.sync().patched == {}
    for client in clients:
        client.close()


def test_an_engine_that_dies_while_held_is_still_ejected(stack: tuple[EmulatedFleet, SmgGateway]) -> None:
    fleet, gateway = stack
    url = fleet.urls[DIES]
    orch, clients = _orchestrator(fleet, DIES)
    with SmgRouter(gateway.url, orch, HEALTH.settings(), interval_s=0.1) as router:
        orch.offload()
        assert _poll(lambda: router.phases().get(url) == "held", 10)
        fleet.engines[DIES].kill()
        assert _poll(lambda: router.phases().get(url) in ("dead", None), 10)
        assert gateway.wait_status(url, lambda s: s is None, HEALTH.ejection_window_s + 10) is None
    for client in clients:
        client.close()


def test_a_failed_onload_keeps_the_engine_out_and_the_next_one_puts_it_back(stack: tuple[EmulatedFleet, SmgGateway]) -> None:
    fleet, gateway = stack
    url = fleet.urls[FAILS]
    orch, clients = _orchestrator(fleet, FAILS)
    with SmgRouter(gateway.url, orch, HEALTH.settings(), interval_s=0.1) as router:
        orch.offload()
        assert _poll(lambda: router.phases().get(url) == "held", 10)
        with pytest.raises(PhaseFailed):
            orch.onload()
        assert orch.states()[url] != "serving"
        router.sync()
        assert router.phases()[url] == "held"
        assert gateway.status(url) == "not_ready"
        orch.onload()
        assert orch.states()[url] == "serving"
        assert gateway.wait_status(url, lambda s: s == "ready", 10) == "ready"
        assert router.phases()[url] == "free"
    for client in clients:
        client.close()
