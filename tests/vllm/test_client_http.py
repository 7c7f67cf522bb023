"""VLLMClient and AsyncVLLMClient over HTTP against emulated vLLM 0.33.0 engines (real processes on 127.0.0.1).

Every scenario runs on the three transports (requests; aiohttp; httpx). One module-scoped fleet of two engines:
engine 0 is reached directly and left awake, unpaused and idle by each test; engine 1 sits behind the fault proxy,
whose plan answers 502 after forwarding on chosen calls of ``/sleep`` and ``/update_weights`` (``test_what_is_resent``).
Each behaviour names the vLLM 0.33.0 line it follows (paths under ``vllm/``).
"""

from __future__ import annotations

import asyncio
import pickle
from collections.abc import Iterator

import pytest
import requests

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from resilience.adapters.vllm import (
    AsyncVLLMClient,
    VLLMClient,
    VLLMDevModeOff,
    VLLMError,
    VLLMRefused,
    VLLMWeightsAsleep,
    mount_vllm,
)
from resilience.errors import ConfigConflict
from resilience.events import Event, RetryScheduled
from resilience.testing.emulator import EmulatedFleet, EngineHandle
from resilience.testing.emulator.vllm import VLLMEngineConfig, expected_completion
from resilience.testing.faultplan import FaultPlan, FaultRule
from tests.vllm.conftest import FAST_VLLM, TRANSPORTS, do, open_vllm

CONFIG = VLLMEngineConfig(dev_mode=True, enable_sleep_mode=True, weight_transfer_backend="nccl", token_rate=200.0)
PROMPT = "the quick brown fox"
# engine 1: a 502 after the engine applied the call, on the first call of each transport (each transport sends /sleep twice:
# the faulted attempt and its re-send; /update_weights once)
FAULTS = FaultPlan(
    seed=22,
    rules=(
        FaultRule("/sleep", "status_after", status=502, calls=frozenset({1, 3, 5}), engines=frozenset({1})),
        FaultRule("/update_weights", "status_after", status=502, calls=frozenset({1, 2, 3}), engines=frozenset({1})),
    ),
)


@pytest.fixture(scope="module")
def fleet() -> Iterator[EmulatedFleet]:
    with EmulatedFleet(2, CONFIG, fault_plan=FAULTS) as f:
        yield f


@pytest.fixture
def engine(fleet: EmulatedFleet) -> Iterator[EngineHandle]:
    """Engine 0, reached directly; checked awake, unpaused and idle afterwards."""
    handle = fleet.engines[0]
    yield handle
    assert handle.alive(), handle.log()
    state = handle.state()
    assert (state["pause_state"], state["sleeping_tags"], state["weight_update_active"]) == ("unpaused", [], False), state


def calls_to(handle: EngineHandle, path: str) -> int:
    return sum(1 for c in handle.record()["calls"] if c["path"] == path)


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", TRANSPORTS)
async def test_sleep_and_wake_by_tags(engine: EngineHandle, kind: str) -> None:
    """Sleep level 1, then wake weights (still "sleeping": the scheduler waits for every tag, v1/engine/core.py l.1051),
    then kv_cache (awake); a wake of a tag that is not asleep wakes nothing and says so (v1/executor/abstract.py l.416-422)."""
    async with open_vllm(kind, engine.direct_url) as client:
        assert (await do(client, "version")).text == "0.33.0"  # serve/instrumentator/basic.py l.53
        slept = await do(client, "sleep", 1, "abort")
        assert (slept.level, slept.attempts) == (1, 1)  # serve/dev/sleep/api_router.py l.34
        assert await do(client, "is_sleeping") is True
        assert (await do(client, "health")).healthy  # /health stays 200 while asleep (serve/instrumentator/health.py l.30)
        weights = await do(client, "wake_up", ["weights"])
        assert (weights.awake, weights.tags) == (False, ("weights",))
        noop = await do(client, "wake_up", ["weights", "kv_cache"])  # weights is awake: the whole call is a no-op
        assert (noop.awake, engine.state()["sleeping_tags"]) == (False, ["kv_cache"])
        kv = await do(client, "wake_up", ["kv_cache"])
        assert (kv.awake, kv.tags) == (True, ("kv_cache",))
        assert await do(client, "is_sleeping") is False


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", TRANSPORTS)
async def test_pause_modes_and_resume(engine: EngineHandle, kind: str) -> None:
    """``/pause?mode=keep`` answers "paused" (rl/online/api_router.py l.31-63); /is_sleeping is true while merely paused
    (v1/engine/core.py l.1078); an abort pause answers new completions 503 (core.py l.1796); /resume reopens."""
    async with open_vllm(kind, engine.direct_url) as client:
        assert (await do(client, "pause", "keep")).message == "paused"
        assert await do(client, "is_paused") is True and await do(client, "is_sleeping") is True
        assert (await do(client, "pause", "abort", clear_cache=False)).message == "paused"  # the last mode wins
        with pytest.raises(VLLMError) as refused:
            await do(client, "complete", PROMPT)
        assert refused.value.status == 503 and "POST /v1/completions" in str(refused.value)
        assert (await do(client, "resume")).message == "resumed"
        assert await do(client, "is_paused") is False
        done = await do(client, "complete", PROMPT, max_tokens=5)
        assert (done.text, done.finish_reason) == (expected_completion(PROMPT, "default", 5), "length")


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", TRANSPORTS)
async def test_the_weight_session_and_the_version_it_sets(engine: EngineHandle, kind: str) -> None:
    """start -> update -> finish(version) sets /weight_info (rl/online/api_router.py l.181-229); a second finish answers 500
    and the engine lives (gpu_worker.py l.1519-1650); the checker's checksums compare equal with themselves."""
    async with open_vllm(kind, engine.direct_url) as client:
        assert (await do(client, "init_weight_transfer_engine", {"master_address": "127.0.0.1"})).message == "Weight transfer initialized"
        assert (await do(client, "start_weight_update")).message == "Weight update started"
        assert (
            await do(client, "update_weights", {"names": ["w"], "dtype_names": ["bfloat16"], "shapes": [[1]]})
        ).message == "Weights updated"
        assert (await do(client, "finish_weight_update", f"v-{kind}")).message == "Weight update finished"
        assert (await do(client, "weight_info")).weight_version == f"v-{kind}"
        with pytest.raises(VLLMError) as again:
            await do(client, "finish_weight_update")
        assert again.value.status == 500 and "without a matching start_weight_update" in str(again.value)
        sums = await do(client, "weight_checker", "checksum")
        assert sums.checksums
        same = await do(client, "weight_checker", "compare", sums.checksums)
        assert (same.match, same.mismatches) == (True, ())
        assert (await do(client, "update_weight_version", "default")).weight_version == "default"
        assert await do(client, "get_world_size") >= 1
    assert engine.alive()


WEIGHT_CALLS = (
    ("start_weight_update", ()),
    ("update_weights", ({"names": ["w"]},)),
    ("finish_weight_update", ("v-never",)),
    ("weight_checker", ("checksum",)),
)
"""The calls that read or write the weights (``Route.needs_weights``), with arguments."""


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", TRANSPORTS)
async def test_a_weight_call_while_the_weights_sleep_is_refused_unsent(engine: EngineHandle, kind: str) -> None:
    """vLLM #57853 / #57854: a weight load into slept weights segfaults the EngineCore (0.33.0's gpu_worker.py l.1559-1650 has
    no guard; test_vllm_emulator plays it). After its own sleep the client refuses each weight call unsent, naming the engine
    and the state; a wake of kv_cache alone keeps the refusal, a wake of the weights lifts it."""
    async with open_vllm(kind, engine.direct_url) as client:
        sent = {path: calls_to(engine, path) for path in ("/start_weight_update", "/update_weights", "/weight_checker")}
        assert not client.weights_asleep
        await do(client, "sleep", 1)
        assert client.weights_asleep
        for method, args in WEIGHT_CALLS:
            with pytest.raises(VLLMWeightsAsleep) as refused:
                await do(client, method, *args)
            assert client.engine in str(refused.value) and f"/{method}" in str(refused.value) and "asleep" in refused.value.state
            assert isinstance(refused.value, VLLMError) and refused.value.status is None
        assert {path: calls_to(engine, path) for path in sent} == sent and engine.alive()
        await do(client, "wake_up", ["kv_cache"])
        assert client.weights_asleep  # the weights still sleep
        await do(client, "wake_up", ["weights"])
        assert not client.weights_asleep
        assert (await do(client, "weight_checker", "checksum")).checksums


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", TRANSPORTS)
async def test_reset_prefix_cache_asks_again_while_blocks_are_held_and_never_calls_false_a_success(engine: EngineHandle, kind: str) -> None:
    """``{"success": false}`` while a request holds blocks (serve/dev/cache/api_router.py l.31-44): asked again every poll;
    past its deadline VLLMRefused; once the request finished, a success after more than one ask."""
    async with open_vllm(kind, engine.direct_url) as client:
        long = asyncio.create_task(asyncio.to_thread(_complete_direct, engine.direct_url, 100))  # ~0.5 s at 200 tokens/s
        await _until_running(engine)
        with pytest.raises(VLLMRefused) as refused:
            await do(client, "reset_prefix_cache", deadline_s=0.2, poll_s=0.05)
        assert refused.value.polls >= 2 and "blocks are still held" in str(refused.value) and refused.value.status == 200
        reset = await do(client, "reset_prefix_cache", deadline_s=10.0, poll_s=0.05)
        assert reset.polls >= 2 and not engine.state()["running"]
        assert (await long).startswith(" ")


def _complete_direct(url: str, max_tokens: int) -> str:
    with VLLMClient(url) as client:
        return client.complete(PROMPT, max_tokens=max_tokens).text


async def _until_running(engine: EngineHandle) -> None:
    for _ in range(500):  # bounded: 5 s
        if engine.state()["running"]:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the long completion never started")


def test_what_is_resent_after_a_502_that_came_after_the_engine_applied_it(fleet: EmulatedFleet) -> None:
    """Behind a proxy that answers 502 after forwarding: /sleep (idempotent) is re-sent and succeeds; /update_weights is
    sent exactly once and the 502 is raised (prime-rl #3599), on each transport; the engine lives and its session closes."""
    handle = fleet.engines[1]
    for i, kind in enumerate(TRANSPORTS):
        events: list[Event] = []

        async def scenario(kind: str, events: list[Event]) -> None:
            async with open_vllm(kind, handle.url, events) as client:
                slept = await do(client, "sleep", 1)
                assert slept.attempts == 2
                await do(client, "wake_up")
                await do(client, "init_weight_transfer_engine", {"master_address": "127.0.0.1"})
                await do(client, "start_weight_update")
                with pytest.raises(VLLMError) as lost:
                    await do(client, "update_weights", {"names": ["w"]})
                assert lost.value.status == 502 and "POST /update_weights" in str(lost.value)
                await do(client, "finish_weight_update", "after-502")

        asyncio.run(scenario(kind, events))
        assert calls_to(handle, "/sleep") == 2 * (i + 1)
        assert calls_to(handle, "/update_weights") == i + 1  # applied once, never re-sent
        if kind == "requests":  # the sync client's observers see the retry layer's decisions
            assert [e.endpoint for e in events if isinstance(e, RetryScheduled)] == ["POST /sleep"]
    assert handle.alive() and handle.state()["weight_version"] == "after-502"


@pytest.fixture(scope="module")
def dev_mode_off() -> Iterator[str]:
    """One engine started without dev mode (started on first use, stopped with the module)."""
    with EmulatedFleet(1, VLLMEngineConfig(dev_mode=False)) as off:
        yield off.engines[0].direct_url


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", TRANSPORTS)
async def test_dev_mode_off_is_named_in_the_error(kind: str, dev_mode_off: str) -> None:
    """Without VLLM_SERVER_DEV_MODE=1 every control route is a 404 (entrypoints/launchers/api_server/routers.py l.46-53):
    VLLMDevModeOff says so, once, without retrying; /health, /version and completions still work."""
    async with open_vllm(kind, dev_mode_off) as client:
        with pytest.raises(VLLMDevModeOff) as info:
            await do(client, "sleep", 1)
        with pytest.raises(VLLMDevModeOff):
            await do(client, "update_weights", {"names": []})
        assert (await do(client, "health")).healthy
        assert (await do(client, "complete", PROMPT, max_tokens=2)).text == expected_completion(PROMPT, "default", 2)
    assert "VLLM_SERVER_DEV_MODE=1" in str(info.value) and info.value.status == 404 and len(info.value.attempts) == 1


@pytest.mark.asyncio
async def test_the_async_client_own_session_serves_a_fan_out(engine: EngineHandle) -> None:
    """Many concurrent calls on one AsyncVLLMClient share its own session and all answer."""
    async with AsyncVLLMClient(engine.direct_url) as client:
        answers = await asyncio.gather(*(client.is_paused() for _ in range(20)))
        assert answers == [False] * 20 and client.api is not None and client.api.text == "0.33.0"


def test_mount_vllm_on_a_session_your_code_already_uses(engine: EngineHandle) -> None:
    """``mount_vllm`` puts the resilience layer on an existing session; a client on it takes no own-session settings."""
    with requests.Session() as session:
        session.trust_env = False
        mount_vllm(session, [engine.direct_url], policies=FAST_VLLM)
        client = VLLMClient(engine.direct_url, session=session)
        assert client.is_paused() is False and client.pause("keep").attempts == 1
        assert client.resume().message == "resumed"
        with pytest.raises(ConfigConflict, match="policies="):
            VLLMClient(engine.direct_url, session=session, policies=FAST_VLLM)
        client.close()  # not its session: left open
        assert session.get(engine.direct_url + "/health", timeout=10).status_code == 200


def test_pickled_clients_keep_their_engine_and_api_and_still_work(engine: EngineHandle) -> None:
    """Ray ships clients pickled: each copy keeps the engine and the learned API, opens its own transport and answers."""
    with VLLMClient(engine.direct_url, policies=FAST_VLLM, api_key="sk-pickled") as client:
        client.version()
        copy = pickle.loads(pickle.dumps(client))
    assert copy.api is not None and copy.api.text == "0.33.0" and "sk-pickled" not in repr(copy)
    assert copy.is_paused() is False
    copy.close()
    acopy = pickle.loads(pickle.dumps(AsyncVLLMClient(engine.direct_url, policies=FAST_VLLM)))

    async def use() -> bool:
        async with acopy:
            return await acopy.is_sleeping()

    assert asyncio.run(use()) is False
