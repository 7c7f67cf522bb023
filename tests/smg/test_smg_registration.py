"""A real smg gateway registers an emulated fleet: every listener on loopback, stopped by its PID."""

from __future__ import annotations

from collections.abc import Iterator

import psutil
import pytest
import requests

pytest.importorskip("torch")

from resilience.testing.emulator import EmulatedFleet, EngineConfig
from resilience.testing.smg import GatewayHealth, SmgGateway, SmgStartError
from tests.smg.conftest import gateway_for

HEALTH = GatewayHealth(interval_s=1, timeout_s=2, failure_threshold=1)
CONFIG = EngineConfig(health_poll_seconds=0.05, health_hang_seconds=3.0)


@pytest.fixture(scope="module")
def fleet_and_gateway() -> Iterator[tuple[EmulatedFleet, SmgGateway]]:
    with EmulatedFleet(2, CONFIG) as fleet, gateway_for(fleet.urls, HEALTH) as gateway:
        yield fleet, gateway


def test_every_engine_is_registered_ready_and_serves_through_the_gateway(fleet_and_gateway: tuple[EmulatedFleet, SmgGateway]) -> None:
    fleet, gateway = fleet_and_gateway
    workers = {w["url"]: w for w in gateway.workers()}
    assert set(workers) == set(fleet.urls)
    assert {w["status"] for w in workers.values()} == {"ready"}
    answer = requests.post(f"{gateway.url}/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}}, timeout=10)
    assert answer.status_code == 200, answer.text
    assert len(answer.json()["output_ids"]) == 2
    rl = requests.get(f"{gateway.url}/v1/rl/workers", timeout=5).json()
    assert {w["url"] for w in rl["workers"]} == set(fleet.urls)


def test_every_listener_of_the_gateway_is_on_loopback(fleet_and_gateway: tuple[EmulatedFleet, SmgGateway]) -> None:
    _, gateway = fleet_and_gateway
    listening = {c.laddr for c in psutil.Process(gateway.pid).net_connections(kind="inet") if c.status == psutil.CONN_LISTEN}
    assert {addr.port for addr in listening} >= {gateway.port, gateway.prometheus_port}
    assert {addr.ip for addr in listening} == {"127.0.0.1"}
    assert "smg_" in gateway.metrics()


def test_a_gateway_whose_worker_never_answers_fails_to_start_in_bounded_time_with_its_log(refusing_port: int) -> None:
    """A worker whose port refuses never registers: the bounded wait gives up, says why, and the gateway is stopped."""
    gateway = SmgGateway([f"http://127.0.0.1:{refusing_port}"], health=GatewayHealth(interval_s=1, timeout_s=1), startup_timeout=2)
    with pytest.raises(SmgStartError, match=r"did not register .* within 2 s"):
        gateway.start()
    assert gateway._proc is not None and gateway._proc.returncode is not None
