"""The dashboard's gateway row reads real series: smg's (its /metrics listener) and ours, for the same 502s.

One engine behind a fault proxy that answers 502 to its first flush and first generation; a real smg in front. A
flush fanned out through the gateway and a generation through it make smg count them; our client, sent straight
through the same proxy to a pause that gets a 502 first, makes our MetricsObserver count its 502 and its retry.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import requests

pytest.importorskip("torch")
pytest.importorskip("prometheus_client")

from prometheus_client import generate_latest

from grafana.dashboard.external import SMG_METRICS
from resilience.adapters.sglang import SGLangClient
from resilience.adapters.smg_fanout import SmgFanOut
from resilience.deadline import Deadline
from resilience.telemetry.metrics import MetricsObserver
from resilience.testing.emulator import EmulatedFleet, EngineConfig
from resilience.testing.faultplan import FaultPlan, FaultRule
from resilience.testing.lab_sglang import demo_policies
from resilience.testing.smg import GatewayHealth, SmgGateway
from tests.smg.conftest import gateway_for

PLAN = FaultPlan(
    seed=0,
    rules=(
        FaultRule(path="/flush_cache", kind="status_before", calls=frozenset({1, 2})),
        *(FaultRule(path=p, kind="status_before", calls=frozenset({1})) for p in ("/generate", "/pause_generation")),
    ),
)


@pytest.fixture(scope="module")
def stack() -> Iterator[tuple[EmulatedFleet, SmgGateway]]:
    config = EngineConfig(health_poll_seconds=0.05)
    with EmulatedFleet(1, config, fault_plan=PLAN) as fleet, gateway_for(fleet.urls, GatewayHealth(interval_s=5, timeout_s=2)) as gateway:
        yield fleet, gateway


def _samples(text: str) -> list[str]:
    return [line for line in text.splitlines() if line and not line.startswith("#")]


def test_smg_and_our_exporter_both_expose_the_502s_the_gateway_row_selects(stack: tuple[EmulatedFleet, SmgGateway]) -> None:
    fleet, gateway = stack
    fanout = requests.post(f"{gateway.url}/v1/rl/engine/flush_cache", params={"selector": "engine=sglang"}, json={}, timeout=10)
    assert fanout.status_code == 207  # the engine side answered 502: a partial fan-out
    generated = requests.post(f"{gateway.url}/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}}, timeout=10)
    assert generated.status_code == 200  # smg retried past the 502
    theirs = _samples(gateway.metrics())
    assert {line.split("{")[0] for line in theirs} >= SMG_METRICS
    assert any(s.startswith("smg_rl_control_calls_total{") and 'result="upstream_error"' in s for s in theirs)
    assert any(s.startswith("smg_rl_fanout_total{") and 'result="partial"' in s for s in theirs)
    assert any(s.startswith("smg_router_upstream_responses_total{") and 'status_code="502"' in s for s in theirs)

    observer = MetricsObserver()
    with SGLangClient(fleet.urls[0], policies=demo_policies(), observers=[observer]) as client:
        client.pause_generation()  # 502 first, then paused
        client.continue_generation()
    ours = _samples(generate_latest(observer.registry).decode())
    assert any(s.startswith("cpr_attempts_total{") and 'status="502"' in s for s in ours)
    assert any(s.startswith("cpr_retries_total{") and 'reason="status_502"' in s for s in ours)

    through = MetricsObserver()  # SmgFanOut tells its observers the same events: the gateway relayed a 502, we re-sent
    fanout = SmgFanOut(gateway.url, observers=[through])
    (flushed,) = fanout.call([(fanout.engines(fleet.urls)[0], {})], "flush_cache", Deadline(10.0))
    assert flushed.ok and fanout.absorbed_502 == 1
    fanned = _samples(generate_latest(through.registry).decode())
    assert any(s.startswith("cpr_attempts_total{") and "POST /flush_cache" in s and 'status="502"' in s for s in fanned)
    assert any(s.startswith("cpr_retries_total{") and 'reason="status_502"' in s for s in fanned)
    assert any(s.startswith("cpr_requests_total{") and 'outcome="retried_success"' in s for s in fanned)
    fanout.close()
