"""A dead engine behind a proxy is named dead, not "paused": every attempt a gateway status, and /model_info fails too.

The proxy turns the dead engine's refused connections into 502s. The SGLang clients
then check ``GET /model_info`` (SGLang's HTTP process answers it without its
scheduler) within what is left of the call's deadline, and raise ``EngineDied`` with
the call's attempts; a live engine whose route answers 502 but whose ``/model_info``
answers keeps the original error.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import replace

import pytest

from resilience.adapters.sglang import SGLANG_POLICIES, AsyncSGLangClient, SGLangClient, SGLangError
from resilience.deadline import Deadline
from resilience.engine_contract import EngineDied
from resilience.errors import DeadlineExceeded
from resilience.testing import fast_policies
from resilience.testing.emulator import EmulatedFleet
from resilience.testing.faults import FaultPlan, FaultRule
from tests.conftest import port_held
from tests.sglang.conftest import FAST_ENGINE, FAST_SGLANG

PAUSE_502 = FaultPlan(seed=10, rules=(FaultRule("/pause_generation", "status_before", engines=frozenset({1})),))
"""Engine 1's proxy answers every pause with 502 without forwarding it; engine 0's proxy passes everything."""


@pytest.fixture(scope="module")
def shared_fleet() -> Iterator[EmulatedFleet]:
    """Two engines behind their proxies for the whole module (one fleet start instead of one per test)."""
    with EmulatedFleet(2, FAST_ENGINE, fault_plan=PAUSE_502) as f:
        yield f


@pytest.fixture
def fleet(shared_fleet: EmulatedFleet) -> Iterator[EmulatedFleet]:
    """The module's fleet with every engine alive: one a test killed is restarted first (same port, fresh state).

    No test leaves an engine paused or released (engine 1's pauses never reach it), so a live engine is as a new one;
    the proxies stay, so a test reads only what its own calls added to them (the counts before it, subtracted).
    """
    for engine in shared_fleet.engines:
        if not engine.alive():
            engine.restart()
    yield shared_fleet


@pytest.fixture
def kill(fleet: EmulatedFleet) -> Iterator[Callable[[int], None]]:
    """Kill engine ``i`` (SIGKILL) and keep its port refusing until the test ends (``port_held``: no other server
    takes it while the clients retry the refused connects); the next test's ``fleet`` restarts it."""
    with ExitStack() as held:

        def kill_engine(i: int) -> None:
            fleet.engines[i].kill()
            held.enter_context(port_held(fleet.engines[i].direct_url))

        yield kill_engine


def model_info_calls(fleet: EmulatedFleet, i: int) -> int:
    return sum(1 for c in fleet.engines[i].record()["calls"] if c["path"] == "/model_info")


def test_a_killed_engine_behind_the_proxy_is_named_dead_with_the_calls_attempts(fleet: EmulatedFleet, kill: Callable[[int], None]) -> None:
    """SGLangClient.pause_generation on a killed engine: EngineDied, caused by the 502 SGLangError, within the phase deadline."""
    seen_before = len(fleet.engines[0].proxy.seen)  # type: ignore[union-attr]
    kill(0)
    with SGLangClient(fleet.urls[0], policies=FAST_SGLANG) as client, Deadline(10), pytest.raises(EngineDied) as caught:
        client.pause_generation("abort")
    died = caught.value
    attempts = died.attempts  # type: ignore[attr-defined]
    assert len(attempts) == FAST_SGLANG.match("POST", "/pause_generation").policy.retry.max_attempts
    assert {a.status for a in attempts} == {502}
    assert isinstance(died.__cause__, SGLangError) and died.__cause__.status == 502
    assert "POST /pause_generation" in str(died) and "GET /model_info failed too" in str(died)
    seen = fleet.engines[0].proxy.seen[seen_before:]  # type: ignore[union-attr]
    assert any(s.path == "/model_info" and s.upstream_error == "ConnectionRefusedError" for s in seen)


def test_a_live_engine_whose_route_answers_502_keeps_the_original_error(fleet: EmulatedFleet) -> None:
    """Every pause answered 502 by the proxy, /model_info answered by the engine: SGLangError 502, not EngineDied."""
    checks_before = model_info_calls(fleet, 1)
    with SGLangClient(fleet.urls[1], policies=FAST_SGLANG) as client:
        with pytest.raises(SGLangError, match="HTTP 502") as caught:
            client.pause_generation("abort")
        assert not isinstance(caught.value, EngineDied)
        assert client.continue_generation().message == "Generation continued successfully."  # never paused: harmless
    assert model_info_calls(fleet, 1) == checks_before + 1 and fleet.engines[1].alive()


def test_a_call_ended_by_its_deadline_on_502s_is_checked_with_the_time_left(fleet: EmulatedFleet, kill: Callable[[int], None]) -> None:
    """Retries on 502 stopped by the deadline (DeadlineExceeded, every attempt a 502): the check runs in what is left.

    A fixed 0.5 s backoff under a 0.8 s deadline: the second wait does not fit, so the call
    raises with time still left, and that time is what ``/model_info`` gets.
    """
    kill(0)
    short = fast_policies(SGLANG_POLICIES, base_s=0.5, cap_s=0.5, attempt_timeout_s=0.8, deadline_s=0.8)
    jitterless = short.with_entries(
        {"POST /pause_generation": replace(p := short.entries["POST /pause_generation"], retry=replace(p.retry, jitter=0.0))}
    )
    with SGLangClient(fleet.urls[0], policies=jitterless) as client, pytest.raises(EngineDied) as caught:
        client.pause_generation("abort")
    assert isinstance(caught.value.__cause__, DeadlineExceeded)
    assert {a.status for a in caught.value.attempts} == {502}  # type: ignore[attr-defined]


def test_async_client_names_a_dead_engine_behind_the_proxy_too(fleet: EmulatedFleet, kill: Callable[[int], None]) -> None:
    """AsyncSGLangClient over aiohttp: the same check, the same EngineDied; a live engine keeps its 502."""
    kill(0)

    async def run() -> tuple[BaseException, BaseException]:
        async with AsyncSGLangClient(fleet.urls[0], policies=FAST_SGLANG) as dead, AsyncSGLangClient(
            fleet.urls[1], policies=FAST_SGLANG
        ) as live:
            errors = []
            for client in (dead, live):
                try:
                    await client.pause_generation("abort")
                except Exception as exc:
                    errors.append(exc)
            return errors[0], errors[1]

    dead_error, live_error = asyncio.run(run())
    assert isinstance(dead_error, EngineDied) and {a.status for a in dead_error.attempts} == {502}  # type: ignore[attr-defined]
    assert isinstance(live_error, SGLangError) and live_error.status == 502


def test_the_barrier_names_the_engine_dead_behind_its_proxy(fleet: EmulatedFleet, kill: Callable[[int], None]) -> None:
    """Issue 19 item 10 end to end: an offload over a killed engine behind its proxy fails naming it dead, not "paused"."""
    from resilience.barrier import EngineGroup, Orchestrator, PhaseDeadlines, PhaseFailed

    kill(0)
    client = SGLangClient(fleet.urls[0], policies=FAST_SGLANG, flush_poll_s=0.05)
    deadlines = PhaseDeadlines(transition_s=30, pause_s=10, flush_s=10, release_s=10, resume_s=10, continue_s=10)
    orch = Orchestrator(EngineGroup([client]), deadlines=deadlines)
    with pytest.raises(PhaseFailed) as caught:
        orch.offload()
    assert list(caught.value.dead) == [client.engine]
    assert "dead" in caught.value.left_paused[client.engine]
