"""Verify after a transition, on emulated SGLang engines (real HTTP on loopback): "a 200 that isn't healthy" fails it.

Onload and weight sync take ``verify=``: each engine's reported weight version (SGLang ``/model_info``) must equal the
one pushed, and a canary completion must match the caller's reference; a mismatch raises ``VerificationFailed`` (a
``PhaseFailed``, phase ``"verify"``) naming the engine, on threads and on an event loop. The vLLM side runs in
``tests/vllm/test_verify_vllm.py``.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("torch")

from resilience.adapters.sglang import AsyncSGLangClient, SGLangClient
from resilience.barrier import (
    AsyncOrchestrator,
    CanaryCheck,
    CheckFailed,
    EngineGroup,
    Orchestrator,
    PhaseDeadlines,
    PhaseFailed,
    VerificationFailed,
    WeightVersionCheck,
)
from resilience.testing.emulator import EmulatedFleet
from tests.sglang.conftest import FAST_ENGINE, FAST_SGLANG

DEADLINES = PhaseDeadlines(transition_s=30, pause_s=10, flush_s=10, continue_s=10)
PROMPT = "The canary"
TOKENS = 8


@pytest.fixture(scope="module")
def fleet2() -> Iterator[EmulatedFleet]:
    """Two engines shared by the module; each test sets the weight versions it needs first."""
    with EmulatedFleet(2, FAST_ENGINE) as fleet:
        yield fleet


@pytest.fixture
def clients(fleet2: EmulatedFleet) -> Iterator[list[SGLangClient]]:
    made = [SGLangClient(u, policies=FAST_SGLANG) for u in fleet2.urls]
    for c in made:
        c.update_weight_version("v1")
    yield made
    for c in made:
        c.close()


def reference(client: SGLangClient) -> str:
    """What a greedy canary answers on a good engine (the caller's reference)."""
    return client.generate(PROMPT, sampling_params={"max_new_tokens": TOKENS, "temperature": 0.0}).text


def test_onload_verified_passes_when_every_engine_reports_the_version_and_the_canary(clients: list[SGLangClient]) -> None:
    """After offload and onload, both checks pass on both engines and the report comes back."""
    orch = Orchestrator(EngineGroup(clients), deadlines=DEADLINES)
    canary = CanaryCheck(PROMPT, reference(clients[0]), max_tokens=TOKENS)
    orch.offload()
    report = orch.onload(verify=[WeightVersionCheck("v1"), canary])
    assert report.transition == "onload" and report.held == {}


def test_a_weight_sync_that_missed_one_engine_fails_naming_it(clients: list[SGLangClient]) -> None:
    """The body pushes v2 to the first engine only: the sync raises VerificationFailed naming the second, with what it reports."""
    orch = Orchestrator(EngineGroup(clients), deadlines=DEADLINES)
    with pytest.raises(VerificationFailed) as info:
        with orch.weight_sync(verify=WeightVersionCheck("v2")) as engines:
            engines[0].update_weight_version("v2", abort_all_requests=False)
    err = info.value
    missed = clients[1].engine
    assert isinstance(err, PhaseFailed) and err.phase == "verify" and err.transition == "weight_sync"
    assert list(err.failures) == [missed]
    miss = err.by_engine[missed]
    assert isinstance(miss, CheckFailed) and (miss.expected, miss.got) == ("v2", "v1")
    assert missed in str(err) and "'v2'" in str(err)
    assert err.left_paused == {} and err.report.transition == "weight_sync_end"  # the hold ended: both serve again


def test_a_canary_that_does_not_match_fails_naming_the_engine(clients: list[SGLangClient]) -> None:
    """Per-engine references: the engine whose completion differs from its reference is named, the other passes."""
    good = reference(clients[0])
    orch = Orchestrator(EngineGroup(clients), deadlines=DEADLINES)
    orch.offload()
    wrong = {clients[0].engine: good, clients[1].engine: good + " (not this)"}
    with pytest.raises(VerificationFailed) as info:
        orch.onload(verify=CanaryCheck(PROMPT, wrong, max_tokens=TOKENS))
    assert list(info.value.failures) == [clients[1].engine]
    assert info.value.by_engine[clients[1].engine].got == good


def test_engines_left_held_get_the_version_check_but_no_canary(clients: list[SGLangClient]) -> None:
    """An onload of the weights only leaves the engines paused (KV still released): a canary would hang, so it is not
    sent; the version is still read, and a wrong one still fails."""
    orch = Orchestrator(EngineGroup(clients), deadlines=DEADLINES)
    orch.offload()
    try:
        report = orch.onload(tags=["weights"], verify=[WeightVersionCheck("v1"), CanaryCheck(PROMPT, "never compared", max_tokens=TOKENS)])
        assert set(report.held) == {c.engine for c in clients}
        with pytest.raises(VerificationFailed) as info:
            orch.onload(tags=["weights"], verify=WeightVersionCheck("v9"))
        assert sorted(info.value.failures) == sorted(c.engine for c in clients)
        assert set(info.value.left_paused) == {c.engine for c in clients}
    finally:
        orch.onload()


@pytest.mark.asyncio
async def test_async_weight_sync_verifies_on_the_loop(fleet2: EmulatedFleet, clients: list[SGLangClient]) -> None:
    """AsyncOrchestrator: the same checks, read as tasks on the caller's loop; a missed engine is named."""
    aclients = [AsyncSGLangClient(u, policies=FAST_SGLANG) for u in fleet2.urls]
    orch = AsyncOrchestrator(EngineGroup(aclients), deadlines=DEADLINES)
    try:
        async with orch.weight_sync(verify=WeightVersionCheck("v1")):
            pass
        with pytest.raises(VerificationFailed) as info:
            async with orch.weight_sync(verify=[WeightVersionCheck("v3")]) as engines:
                await engines[1].update_weight_version("v3", abort_all_requests=False)
        assert list(info.value.failures) == [aclients[0].engine]
    finally:
        for c in aclients:
            await c.aclose()


def test_a_body_that_raises_is_not_verified(clients: list[SGLangClient]) -> None:
    """Checks run only after a body that returned: the body's own error reaches the caller, not a VerificationFailed."""
    orch = Orchestrator(EngineGroup(clients), deadlines=DEADLINES)
    with pytest.raises(KeyError, match="the body's own"):
        with orch.weight_sync(verify=WeightVersionCheck("never")):
            raise KeyError("the body's own")


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: WeightVersionCheck(""), "non-empty"),
        (lambda: WeightVersionCheck({"e": 3}), "mapping of engine name to string"),  # type: ignore[dict-item]
        (lambda: CanaryCheck("", "x"), "prompt must be a non-empty string"),
        (lambda: CanaryCheck("p", "x", max_tokens=0), "max_tokens must be an int >= 1"),
    ],
)
def test_bad_checks_are_refused_naming_the_field(make: object, message: str) -> None:
    """A check with a bad field fails when it is built, not when the transition runs."""
    with pytest.raises((ValueError, TypeError), match=message):
        make()  # type: ignore[operator]
