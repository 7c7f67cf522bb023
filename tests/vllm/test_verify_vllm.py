"""Verify after a transition on emulated vLLM engines: "a 200 that isn't healthy" is caught, and the engine named.

The checks of ``resilience.barrier.verify`` (``check_steps``) read ``/weight_info`` and ``/v1/completions`` through a
fan-out, as the orchestrators drive them after ``onload``/``weight_sync``. The emulator's completions depend on the weights it holds
(``resilience/testing/emulator/vllm/text.py``): after a level-2 sleep they are garbage until a weight update, and a
completion still answers 200 (verl #7904, TRL #5312) — the canary check sees it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from resilience.adapters.vllm import AsyncVLLMClient, VLLMClient
from resilience.barrier import CanaryCheck, TransitionReport, VerificationFailed, WeightVersionCheck
from resilience.barrier.async_fanout import PhaseRun
from resilience.barrier.fanout import Calls, EngineResult, ThreadFanOut
from resilience.barrier.verify import check_steps
from resilience.deadline import Deadline
from resilience.testing.emulator import EmulatedFleet
from resilience.testing.emulator.vllm import VLLMEngineConfig, expected_completion
from tests.vllm.conftest import FAST_VLLM

CONFIG = VLLMEngineConfig(dev_mode=True, enable_sleep_mode=True, weight_transfer_backend="nccl", token_rate=400.0)
PROMPT = "canary prompt"
TOKENS = 6
DONE = TransitionReport("onload", 0.0)


@pytest.fixture(scope="module")
def fleet() -> Iterator[EmulatedFleet]:
    with EmulatedFleet(2, CONFIG) as f:
        yield f


@pytest.fixture
def clients(fleet: EmulatedFleet) -> Iterator[list[VLLMClient]]:
    """Both engines awake, unpaused, with the checkpoint's intact weights, reported as version "default"."""
    made = [VLLMClient(u, policies=FAST_VLLM) for u in fleet.urls]
    for c in made:
        c.wake_up()
        c.collective_rpc("reload_weights")
        c.update_weight_version("default")
    yield made
    for c in made:
        c.close()


Send = Callable[[Calls, str, Deadline], list[EngineResult]]
AsyncSend = Callable[[Calls, str, Deadline], Awaitable[list[EngineResult]]]


def verify(transition: str, checks: Any, engines: dict[str, Any], send: Send) -> TransitionReport:
    """Drive ``check_steps`` as ``Orchestrator`` does: each read through the fan-out's ``call``. Deliberately not through an
    orchestrator: the checks read bare clients, in states (paused in abort mode, woken from a level-2 sleep) that a
    transition before the verify would change."""
    steps = check_steps(transition, DONE, checks, engines, not_serving={}, deadline_s=10.0)
    try:
        step = next(steps)
        while True:
            step.results = send(step.engines, step.method, step.deadline)
            step = steps.send(None)
    except StopIteration as stop:
        report: TransitionReport = stop.value
        return report


async def averify(transition: str, checks: Any, engines: dict[str, Any], send: AsyncSend) -> TransitionReport:
    """``verify`` on the running loop, as ``AsyncOrchestrator`` drives it."""
    steps = check_steps(transition, DONE, checks, engines, not_serving={}, deadline_s=10.0)
    try:
        step = next(steps)
        while True:
            step.results = await send(step.engines, step.method, step.deadline)
            step = steps.send(None)
    except StopIteration as stop:
        report: TransitionReport = stop.value
        return report


def check(clients: list[VLLMClient], *checks: object) -> TransitionReport:
    return verify("onload", checks, {c.engine: c for c in clients}, ThreadFanOut().call)


def test_intact_engines_pass_both_checks(clients: list[VLLMClient]) -> None:
    """Weight version read from /weight_info (rl/online/api_router.py l.226), canary from /v1/completions: both pass."""
    reference = expected_completion(PROMPT, "default", TOKENS)
    assert check(clients, WeightVersionCheck("default"), CanaryCheck(PROMPT, reference, max_tokens=TOKENS)) is DONE


def test_garbage_weights_after_level_2_answer_200_and_fail_the_canary(clients: list[VLLMClient]) -> None:
    """Engine 1 slept at level 2 and woke without a weight update: it still reports "default" and answers 200, but its text
    is wrong; the canary names it, and only it."""
    clients[1].sleep(2)
    assert clients[1].wake_up().awake is True
    reference = expected_completion(PROMPT, "default", TOKENS)
    assert check(clients, WeightVersionCheck("default")) is DONE  # the version alone cannot see it
    with pytest.raises(VerificationFailed) as info:
        check(clients, WeightVersionCheck("default"), CanaryCheck(PROMPT, reference, max_tokens=TOKENS))
    assert list(info.value.failures) == [clients[1].engine]
    miss = info.value.by_engine[clients[1].engine]
    assert miss.check == "canary completion" and miss.expected == reference and miss.got != reference
    assert clients[1].engine in str(info.value) and info.value.phase == "verify"


def test_a_weight_session_that_skipped_an_engine_fails_the_version_check(clients: list[VLLMClient]) -> None:
    """start -> update -> finish("v2") on engine 0 only: engine 1 still reports "default" and is named."""
    c = clients[0]
    c.init_weight_transfer_engine({"master_address": "127.0.0.1"})
    c.start_weight_update()
    c.update_weights({"names": ["w"]})
    c.finish_weight_update("v2")
    with pytest.raises(VerificationFailed) as info:
        check(clients, WeightVersionCheck("v2"), CanaryCheck(PROMPT, expected_completion(PROMPT, "v2", TOKENS), max_tokens=TOKENS))
    err = info.value
    assert list(err.failures) == [clients[1].engine]
    assert (err.by_engine[clients[1].engine].expected, err.by_engine[clients[1].engine].got) == ("v2", "default")
    assert [m.engine for m in err.mismatches] == [clients[1].engine, clients[1].engine]  # both checks caught it


def test_an_engine_that_cannot_be_read_fails_naming_why(clients: list[VLLMClient], fleet: EmulatedFleet) -> None:
    """A read that raises (here a paused engine's canary, refused 503 in abort mode: v1/engine/core.py l.1796) is a failure
    with the error as its cause, not a pass."""
    clients[0].pause("abort")
    try:
        with pytest.raises(VerificationFailed) as info:
            check(clients, CanaryCheck(PROMPT, expected_completion(PROMPT, "default", TOKENS), max_tokens=TOKENS))
        miss = info.value.by_engine[clients[0].engine]
        assert "could not read it (complete)" in str(miss) and "503" in str(miss.__cause__)
        assert list(info.value.failures) == [clients[0].engine]
    finally:
        clients[0].resume()


@pytest.mark.asyncio
async def test_async_clients_verify_on_the_loop(fleet: EmulatedFleet, clients: list[VLLMClient]) -> None:
    """AsyncVLLMClient engines, read as tasks on the running loop: the stale engine is named."""
    clients[0].update_weight_version("v3")

    async def send(calls: Calls, method: str, deadline: Deadline) -> list[EngineResult]:
        run = PhaseRun(calls, method, deadline)
        await run.wait()
        return run.results()

    aclients = [AsyncVLLMClient(u, policies=FAST_VLLM) for u in fleet.urls]
    try:
        engines = {c.engine: c for c in aclients}
        with pytest.raises(VerificationFailed) as info:
            await averify("weight_sync", [WeightVersionCheck("v3")], engines, send)
        assert list(info.value.failures) == [aclients[1].engine]
    finally:
        for c in aclients:
            await c.aclose()
