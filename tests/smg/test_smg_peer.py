"""What the peer (smg's own client) does: ``smg.rl.paused`` sends continue on the way out whatever its body did.

A body that released memory (an offload written inside ``paused()``) gets a continue on an engine with its memory
released: it serves again, and its next prefill crashes it (SGLang: the KV cache is gone). The barrier never sends that
continue: it continues only an engine with nothing released.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import requests

pytest.importorskip("torch")
from resilience.adapters.smg_fanout import SmgFanOut
from resilience.barrier import EngineGroup, Orchestrator
from resilience.engine_contract import EngineState
from resilience.testing.emulator import EmulatedFleet, EngineConfig
from resilience.testing.smg import GatewayHealth, SmgGateway
from tests.smg.conftest import gateway_for

HEALTH = GatewayHealth(interval_s=5, timeout_s=2)
PEER, OURS = range(2)


@pytest.fixture(scope="module")
def stack() -> Iterator[tuple[EmulatedFleet, SmgGateway]]:
    with EmulatedFleet(2, EngineConfig(health_poll_seconds=0.05)) as fleet, gateway_for(fleet.urls, HEALTH) as gateway:
        yield fleet, gateway


def _selector(rl: Any, url: str) -> str:  # rl: smg.rl.RL
    return f"id in ({next(w.id for w in rl.workers() if w.url == url)})"


def test_paused_continues_after_a_body_that_released_memory_and_the_next_prefill_kills_the_engine(
    stack: tuple[EmulatedFleet, SmgGateway],
) -> None:
    fleet, gateway = stack
    from smg.rl import RL, paused  # smg only once the fixture found it (it skips without, or fails on CI)

    rl = RL(gateway.url, timeout=10)
    selector = _selector(rl, fleet.urls[PEER])
    with paused(rl, selector, mode="abort"):
        rl.fanout("flush_cache", {}, selector=selector)
        rl.fanout("release_memory_occupation", {"tags": None}, selector=selector)
    state = fleet.engines[PEER].state()
    assert state["paused"] is False and set(state["released_tags"]) == {"kv_cache", "weights", "cuda_graph"}
    with pytest.raises(requests.RequestException):  # served again with no memory: its scheduler dies on the prefill
        requests.post(f"{fleet.urls[PEER]}/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}}, timeout=10)
    assert fleet.engines[PEER].wait_exit(10.0) is not None


def test_the_barrier_through_the_same_gateway_keeps_an_engine_with_memory_released_paused(stack: tuple[EmulatedFleet, SmgGateway]) -> None:
    fleet, gateway = stack
    fanout = SmgFanOut(gateway.url)
    orch = Orchestrator([EngineGroup(fanout.engines([fleet.urls[OURS]]))], fanout=fanout)
    hold = orch.pause("peer-like").hold  # what paused() takes: a hold, then an offload inside it releases memory
    assert hold is not None
    orch.offload()
    orch.unpause(hold)  # the hold's end: no continue, memory is released
    assert orch.states()[fleet.urls[OURS]] == EngineState.RELEASED
    assert fleet.engines[OURS].state()["paused"] is True
    orch.onload()
    assert orch.states()[fleet.urls[OURS]] == EngineState.SERVING
    answer = requests.post(f"{fleet.urls[OURS]}/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}}, timeout=10)
    assert answer.status_code == 200
    fanout.close()
