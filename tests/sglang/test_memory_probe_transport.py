"""The transport asks the memory probe: a 502 after the engine applied release or resume no longer re-sends it.

Real emulated engines behind ``FaultProxy`` with ``status_after`` on the first release
and the first resume of each engine: the engine carries the call out, the client sees
502. ``SGLANG_POLICIES`` re-sends on a 502 (the seed's trade-off), so without a probe
the second release kills the engine; with the emulator's memory probe the call returns
as applied and nothing dies; the strict preset hands the 502 back instead of re-sending.
Over requests (``SGLangClient``, and a bare session with the table mounted), aiohttp
(``AsyncSGLangClient``'s own session) and httpx (an ``AsyncClient`` with the transport).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import requests

from resilience.adapters.driver_config import DriverConfig
from resilience.adapters.httpx import AsyncResilientTransport
from resilience.adapters.requests import resilient_session
from resilience.adapters.sglang import (
    SGLANG_POLICIES,
    SGLANG_STRICT_POLICIES,
    AsyncSGLangClient,
    SGLangClient,
    SGLangError,
    sglang_policies,
    with_memory_probe,
)
from resilience.engine_contract import EngineDied
from resilience.errors import ConfigConflict
from resilience.events import Event, ProbeCompleted
from resilience.outcome import Outcome
from resilience.policy import PolicyTable
from resilience.testing import EmulatorMemoryProbe, fast_policies
from resilience.testing.emulator import EmulatedFleet
from resilience.testing.faults import FaultPlan, FaultRule
from tests.sglang.conftest import FAST_ENGINE, FAST_SGLANG

TAGS = frozenset({"kv_cache", "weights", "cuda_graph"})
FAST_STRICT = fast_policies(SGLANG_STRICT_POLICIES, attempt_timeout_s=5.0, deadline_s=15.0)
PLAN = FaultPlan(
    seed=19,
    rules=(
        FaultRule("/release_memory_occupation", "status_after", calls=frozenset({1})),
        FaultRule("/resume_memory_occupation", "status_after", calls=frozenset({1})),
    ),
)
"""Each engine's first release and first resume are applied by the engine and answered 502 by the proxy."""
SCENARIOS = ("no_probe", "probe", "bare_session", "strict", "aiohttp_probe", "httpx_probe", "aiohttp_no_probe", "config_probe")


@pytest.fixture(scope="module")
def fleet() -> Iterator[EmulatedFleet]:
    """One engine per scenario, each behind a proxy that answers its first release and resume with a 502 after applying them."""
    with EmulatedFleet(len(SCENARIOS), FAST_ENGINE, fault_plan=PLAN) as f:
        yield f


def engine(fleet: EmulatedFleet, scenario: str) -> int:
    return SCENARIOS.index(scenario)


def wait_dead(fleet: EmulatedFleet, i: int, seconds: float = 10.0) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:  # bounded
        if not fleet.engines[i].alive():
            return True
        time.sleep(0.05)
    return False


def memory_calls(fleet: EmulatedFleet, i: int) -> list[str]:
    return [c["path"] for c in fleet.engines[i].record()["calls"] if c["path"].endswith("_memory_occupation")]


def prepare(url: str) -> None:
    """Pause and flush, so the release finds the engine idle (as the barrier's offload does)."""
    with SGLangClient(url, policies=FAST_SGLANG) as client:
        client.pause_generation("abort")
        client.flush_cache()


def test_without_a_probe_the_preset_re_sends_the_applied_release_and_the_engine_dies(fleet: EmulatedFleet) -> None:
    """SGLANG_POLICIES re-sends a release answered 502 after it was applied: the second release kills the engine.

    The client then names the engine dead (every attempt a gateway status, /model_info too).
    """
    i = engine(fleet, "no_probe")
    prepare(fleet.urls[i])
    with SGLangClient(fleet.urls[i], policies=FAST_SGLANG) as client, pytest.raises(EngineDied) as caught:
        client.release_memory_occupation()
    assert wait_dead(fleet, i)
    assert "Cannot pause allocation that is not active" in fleet.engines[i].log()
    assert all(a.status == 502 for a in caught.value.attempts) and len(caught.value.attempts) >= 2  # type: ignore[attr-defined]


def test_with_the_probe_release_and_resume_return_as_applied_and_nothing_dies(fleet: EmulatedFleet) -> None:
    """SGLangClient(memory_probe=...): the lost 200s are confirmed by the probe; each call reached the engine once."""
    i = engine(fleet, "probe")
    url = fleet.urls[i]
    prepare(url)
    events: list[Event] = []
    probe = fleet.memory_probe()
    with SGLangClient(url, policies=FAST_SGLANG, memory_probe=probe, observers=[events.append]) as client:
        released = client.release_memory_occupation()
        assert released.confirmed_by_probe and released.attempts == 1
        assert probe.released_tags(url) == TAGS
        resumed = client.resume_memory_occupation()
        assert resumed.confirmed_by_probe and probe.released_tags(url) == frozenset()
        client.continue_generation()
        assert client.generate("after", sampling_params={"max_new_tokens": 4}).finish_reason == "length"
    assert fleet.engines[i].alive()
    assert memory_calls(fleet, i) == ["/release_memory_occupation", "/resume_memory_occupation"]
    assert [(e.endpoint, e.answer) for e in events if isinstance(e, ProbeCompleted)] == [
        ("POST /release_memory_occupation", "done"),
        ("POST /resume_memory_occupation", "done"),
    ]


def test_memory_probe_with_a_shared_config_asks_the_probe_and_keeps_the_shared_breakers(fleet: EmulatedFleet) -> None:
    """SGLangClient(config=..., memory_probe=...): the config's policies ask the probe; its breakers and budgets stay shared."""
    i = engine(fleet, "config_probe")
    url = fleet.urls[i]
    prepare(url)
    events: list[Event] = []
    config = DriverConfig(policies=FAST_SGLANG, observers=(events.append,))
    with SGLangClient(url, config=config, memory_probe=fleet.memory_probe()) as client:
        own = client.session.get_adapter(url).driver_config  # type: ignore[attr-defined]
        assert own is not config and own.breakers is config.breakers and own.budgets is config.budgets
        assert own.observers == config.observers and config.policies is FAST_SGLANG  # the caller's config is not changed
        released = client.release_memory_occupation()
        resumed = client.resume_memory_occupation()
        client.continue_generation()
    assert released.confirmed_by_probe and resumed.confirmed_by_probe
    assert fleet.engines[i].alive()
    assert memory_calls(fleet, i) == ["/release_memory_occupation", "/resume_memory_occupation"]
    assert [e.answer for e in events if isinstance(e, ProbeCompleted)] == ["done", "done"]
    with pytest.raises(ValueError, match="has no /release_memory_occupation or /resume_memory_occupation entry"):
        SGLangClient(url, config=DriverConfig(), memory_probe=fleet.memory_probe())
    with pytest.raises(ValueError, match="has no /release_memory_occupation or /resume_memory_occupation entry"):
        AsyncSGLangClient(url, config=DriverConfig(), memory_probe=fleet.memory_probe())


def test_a_bare_requests_session_with_the_table_mounted_gets_the_same_safety(fleet: EmulatedFleet) -> None:
    """A framework that only mounts the transport: the 502 becomes a body-less 200 'Applied (confirmed by probe)'."""
    i = engine(fleet, "bare_session")
    url = fleet.urls[i]
    prepare(url)
    with resilient_session(with_memory_probe(FAST_SGLANG, fleet.memory_probe())) as session:
        session.trust_env = False
        for path, tags in (("/release_memory_occupation", ["weights", "kv_cache"]), ("/resume_memory_occupation", ["kv_cache"])):
            response = session.post(url + path, json={"tags": tags})
            assert (response.status_code, response.reason, response.content) == (200, "Applied (confirmed by probe)", b"")
            assert [(a.status, a.outcome) for a in response.attempts] == [(502, Outcome.RETRYABLE)]  # type: ignore[attr-defined]
        assert fleet.memory_probe().released_tags(url) == frozenset({"weights"})
        assert session.post(url + "/resume_memory_occupation", json={"tags": ["weights"]}).status_code == 200
        assert session.post(url + "/continue_generation", json={}).status_code == 200
    assert fleet.engines[i].alive() and len(memory_calls(fleet, i)) == 3


def test_the_strict_preset_hands_the_502_back_instead_of_re_sending(fleet: EmulatedFleet) -> None:
    """SGLANG_STRICT_POLICIES: one attempt, the 502 raised as SGLangError; the engine applied it and lives."""
    i = engine(fleet, "strict")
    url = fleet.urls[i]
    prepare(url)
    with SGLangClient(url, policies=FAST_STRICT) as client:
        with pytest.raises(SGLangError, match="HTTP 502") as caught:
            client.release_memory_occupation(["kv_cache"])
        assert caught.value.status == 502
        assert fleet.memory_probe().released_tags(url) == frozenset({"kv_cache"})  # applied, and not re-sent
        with pytest.raises(SGLangError, match="HTTP 502"):
            client.resume_memory_occupation(["kv_cache"])
        client.continue_generation()
    assert fleet.engines[i].alive() and memory_calls(fleet, i) == ["/release_memory_occupation", "/resume_memory_occupation"]


async def _async_round_trip(client: AsyncSGLangClient) -> tuple[bool, bool]:
    await client.pause_generation("abort")
    await client.flush_cache()
    released = await client.release_memory_occupation()
    resumed = await client.resume_memory_occupation()
    await client.continue_generation()
    return released.confirmed_by_probe, resumed.confirmed_by_probe


def test_async_clients_with_the_probe_over_aiohttp_and_httpx(fleet: EmulatedFleet) -> None:
    """AsyncSGLangClient(memory_probe=...) on its aiohttp session, and an httpx.AsyncClient with the table mounted: no death."""
    probe = fleet.memory_probe()

    async def run() -> list[tuple[bool, bool]]:
        i = engine(fleet, "aiohttp_probe")
        async with AsyncSGLangClient(fleet.urls[i], policies=FAST_SGLANG, memory_probe=probe, flush_poll_s=0.05) as client:
            own = await _async_round_trip(client)
        j = engine(fleet, "httpx_probe")
        async with httpx.AsyncClient(transport=AsyncResilientTransport(with_memory_probe(FAST_SGLANG, probe))) as session:
            passed = await _async_round_trip(AsyncSGLangClient(fleet.urls[j], session=session, flush_poll_s=0.05))
        return [own, passed]

    assert asyncio.run(run()) == [(True, True), (True, True)]
    for scenario in ("aiohttp_probe", "httpx_probe"):
        i = engine(fleet, scenario)
        assert fleet.engines[i].alive() and memory_calls(fleet, i) == ["/release_memory_occupation", "/resume_memory_occupation"]


def test_async_client_without_the_probe_kills_the_engine_and_names_it_dead(fleet: EmulatedFleet) -> None:
    """The same fault over aiohttp without a probe: the re-sent release kills the engine; the client raises EngineDied."""
    i = engine(fleet, "aiohttp_no_probe")

    async def run() -> None:
        async with AsyncSGLangClient(fleet.urls[i], policies=FAST_SGLANG, flush_poll_s=0.05) as client:
            await client.pause_generation("abort")
            await client.flush_cache()
            await client.release_memory_occupation()

    with pytest.raises(EngineDied):
        asyncio.run(run())
    assert wait_dead(fleet, i)


def test_presets_and_knobs_are_checked() -> None:
    """strict must be a bool, a probe must have released_tags, a table needs release/resume entries, a passed session refuses one."""
    probe = EmulatorMemoryProbe("/nonexistent")
    with pytest.raises(TypeError, match="strict must be True or False"):
        sglang_policies(strict="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"memory_probe must have released_tags\(engine\)"):
        sglang_policies(memory_probe=object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="has no /release_memory_occupation or /resume_memory_occupation entry"):
        with_memory_probe(PolicyTable({}), probe)
    with requests.Session() as session, pytest.raises(ConfigConflict, match=r"session= and memory_probe=: .*with_memory_probe"):
        SGLangClient("http://127.0.0.1:9", session=session, memory_probe=probe)
    with pytest.raises(ConfigConflict, match=r"AsyncSGLangClient got session= and policies=, memory_probe=: "):
        AsyncSGLangClient("http://127.0.0.1:9", session=httpx.AsyncClient(), policies=SGLANG_POLICIES, memory_probe=probe)
    with pytest.raises(ConfigConflict, match=r"got config= and policies=: the DriverConfig already holds that"):
        SGLangClient("http://127.0.0.1:9", config=DriverConfig(policies=SGLANG_POLICIES), policies=SGLANG_POLICIES, memory_probe=probe)
    swap: dict[str, Any] = {k: p for k, p in sglang_policies(strict=True).entries.items() if "memory_occupation" in k}
    assert swap and all(not p.retry_statuses_if_not_idempotent for p in swap.values())
    assert all(SGLANG_POLICIES.entries[k].retry_statuses_if_not_idempotent for k in swap)
