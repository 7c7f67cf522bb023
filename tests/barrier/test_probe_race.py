"""The memory probe's race (issue 19): a release or resume whose request is still on its way when the probe is asked.

A connection dropped right after sending (a read timeout, a 504, no delivery record) leaves the request possibly in
transit: the probe may answer "as before" a moment before the call lands. The barrier trusts the probe's "applied"
at once (it proves it), and its "not applied" only after a 502/503 or once ``PhaseDeadlines.in_transit_s`` has passed
since the ambiguous answer, re-asking at the start of the next transition. ``Fault.DELIVERED_LATE`` makes the fake
engine apply the call only after the probe answered, so a barrier that settles from that first answer kills it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from resilience.barrier import AsyncOrchestrator, EngineGroup, EngineState, Orchestrator, PhaseDeadlines, PhaseFailed, ThreadFanOut
from tests.barrier.fake_engine import ALL, AnyFake, AsyncFakeEngine, FakeEngine, Fault

DEADLINES = PhaseDeadlines(transition_s=10.0, pause_s=2, flush_s=2, release_s=2, resume_s=2, continue_s=2, in_transit_s=0.2)
"""Phase limits no prompt call reaches under load; a 0.2 s grace for a request that may still be on its way."""
RELEASE, RESUME = "release_memory_occupation", "resume_memory_occupation"


class LateTruthProbe:
    """A ``MemoryProbe`` over the fakes' true state that lets the requests still on their way arrive right after it answered."""

    def __init__(self, engines: list[AnyFake]) -> None:
        self.engines = {e.engine: e for e in engines}
        self.answers: list[tuple[str, frozenset[str]]] = []

    def released_tags(self, engine: str) -> frozenset[str] | None:
        fake = self.engines[engine]
        released = fake.snapshot()[2]
        self.answers.append((engine, released))
        fake.deliver()
        return released


def alive(engines: list[AnyFake]) -> None:
    for e in engines:
        assert e.crash is None, f"{e.engine} crashed: {e.crash}"


@pytest.fixture
def fanout() -> Iterator[ThreadFanOut]:
    pool = ThreadFanOut(max_workers=8)
    yield pool
    pool.close()


def test_a_release_delivered_after_the_probe_answered_is_waited_for_not_released_again(fanout: ThreadFanOut) -> None:
    engines: list[AnyFake] = [FakeEngine(f"http://fake-{i}:30000") for i in range(2)]
    probe = LateTruthProbe(engines)
    orch = Orchestrator(EngineGroup(engines), fanout=fanout, deadlines=DEADLINES, memory_probe=probe)
    engines[0].arm(RELEASE, Fault.DELIVERED_LATE)
    with pytest.raises(PhaseFailed) as failed:
        orch.offload()
    assert probe.answers[0] == (engines[0].engine, frozenset())  # asked before the release arrived: "nothing released"
    assert engines[0].snapshot()[2] == ALL  # ... and then it arrived
    assert failed.value.quarantined == (engines[0].engine,)  # "not released" is not trusted while the release may be on its way
    assert "on its way" in orch.not_serving()[engines[0].engine]
    alive(engines)  # the rollback did not continue it onto memory the late release freed
    orch.offload()  # asked again at the start: "released" proves the release; nothing is released twice
    alive(engines)
    assert orch.states() == dict.fromkeys((e.engine for e in engines), EngineState.RELEASED)
    orch.onload()
    alive(engines)
    assert all(e.serving for e in engines)


def test_a_resume_delivered_after_the_probe_answered_is_not_resumed_again(fanout: ThreadFanOut) -> None:
    engines: list[AnyFake] = [FakeEngine(f"http://fake-{i}:30000") for i in range(2)]
    probe = LateTruthProbe(engines)
    orch = Orchestrator(EngineGroup(engines), fanout=fanout, deadlines=DEADLINES, memory_probe=probe)
    orch.offload()
    engines[1].arm(RESUME, Fault.DELIVERED_LATE)
    with pytest.raises(PhaseFailed) as failed:
        orch.onload()
    assert probe.answers[-1] == (engines[1].engine, ALL)  # "still released", a moment before the resume arrived
    assert failed.value.quarantined == (engines[1].engine,)
    orch.onload()  # asked again: "nothing released" proves the resume; it is continued, never resumed twice
    alive(engines)
    assert all(e.serving for e in engines)


def test_not_applied_is_trusted_once_the_grace_has_passed(fanout: ThreadFanOut) -> None:
    """A release that never arrives: its "nothing released" is trusted at the next transition, once the grace is waited out."""
    engines: list[AnyFake] = [FakeEngine(f"http://fake-{i}:30000") for i in range(2)]
    orch = Orchestrator(EngineGroup(engines), fanout=fanout, deadlines=DEADLINES, memory_probe=LateTruthProbe(engines))
    engines[0].arm(RELEASE, Fault.AMBIGUOUS_NOT_APPLIED)
    with pytest.raises(PhaseFailed) as failed:
        orch.offload()
    assert failed.value.quarantined == (engines[0].engine,)
    orch.offload()  # the settle waits out what is left of the 0.2 s grace, then trusts "nothing released" and releases once
    alive(engines)
    assert all(e.snapshot()[2] == ALL for e in engines)


def test_a_502_lets_not_applied_be_trusted_at_once(fanout: ThreadFanOut) -> None:
    """After a gateway's 502 the request is not on its way (the gateway answered for it): the probe's "as before" settles it."""
    engines: list[AnyFake] = [FakeEngine(f"http://fake-{i}:30000") for i in range(2)]
    orch = Orchestrator(EngineGroup(engines), fanout=fanout, deadlines=DEADLINES, memory_probe=LateTruthProbe(engines))
    engines[0].arm(RELEASE, Fault.GATEWAY_NOT_FORWARDED)
    with pytest.raises(PhaseFailed) as failed:
        orch.offload()
    assert failed.value.quarantined == () and engines[0].serving  # settled "not released" at once, and continued back
    alive(engines)


def test_the_async_orchestrator_waits_for_a_release_on_its_way_too() -> None:
    engines: list[AnyFake] = [AsyncFakeEngine(f"http://fake-{i}:30000") for i in range(2)]
    probe = LateTruthProbe(engines)
    orch = AsyncOrchestrator(EngineGroup(engines), deadlines=DEADLINES, memory_probe=probe)
    engines[0].arm(RELEASE, Fault.DELIVERED_LATE)

    async def run() -> tuple[str, ...]:
        try:
            await orch.offload()
        except PhaseFailed as failed:
            quarantined = failed.quarantined
        else:
            raise AssertionError("the offload returned although a release was on its way")
        alive(engines)
        await orch.offload()
        await orch.onload()
        return tuple(quarantined)

    assert asyncio.run(run()) == (engines[0].engine,)
    alive(engines)
    assert all(e.serving for e in engines)
