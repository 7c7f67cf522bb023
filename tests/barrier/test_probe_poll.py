"""Polling the memory probe (issue 19, barrier v3): a release or resume that is slow to apply after an ambiguous answer.

A release answered by a reset after the engine acted is often not applied yet when the fold asks the probe (the
emulator frees its memory, SGLang's torch_memory_saver pause takes time too): the probe says "not released", which is
not trusted while the request may still be running. The phase then polls the probe every ``probe_poll_s`` (on the
orchestrator's clock: a ``FakeClock`` here, shared with the fake engines) until it proves the release applied, or the
grace (``in_transit_s``) has passed and "not released" is trusted. An interruption during the poll leaves the engine
quarantined with its doubt.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from resilience.barrier import AsyncOrchestrator, EngineGroup, EngineState, Orchestrator, PhaseDeadlines, PhaseFailed, ThreadFanOut
from resilience.testing.clock import FakeClock
from tests.barrier.fake_engine import ALL, AnyFake, AsyncFakeEngine, FakeEngine, Fault

GRACE_S = 2.0
DEADLINES = PhaseDeadlines(
    transition_s=30.0, pause_s=5, flush_s=5, release_s=5, resume_s=5, continue_s=5, in_transit_s=GRACE_S, probe_poll_s=0.05
)
"""A 2 s grace on the fake clock (it only moves when the orchestrator sleeps), within each 5 s phase limit."""
RELEASE = "release_memory_occupation"


class TruthProbe:
    """A ``MemoryProbe`` over the fakes' true state (what NVML or the emulator's side channel give)."""

    def __init__(self, engines: list[AnyFake]) -> None:
        self.engines = {e.engine: e for e in engines}
        self.asked = 0

    def released_tags(self, engine: str) -> frozenset[str] | None:
        self.asked += 1
        return self.engines[engine].snapshot()[2]


class BusyProbe(TruthProbe):
    """Answers None ("cannot prove it now") while a call is being carried out, as the emulator's probe does."""

    def released_tags(self, engine: str) -> frozenset[str] | None:
        released = super().released_tags(engine)
        return None if self.engines[engine].applying else released


class InterruptingClock(FakeClock):
    """A ``FakeClock`` whose ``at``-th sleep is interrupted: KeyboardInterrupt in the thread, or the sleeping task cancelled."""

    def __init__(self) -> None:
        super().__init__()
        self.at: int | None = None

    def sleep(self, seconds: float) -> None:
        super().sleep(seconds)
        if self.at is not None and len(self.sleeps) == self.at:
            raise KeyboardInterrupt("interrupted while the barrier polled the probe")

    async def asleep(self, seconds: float) -> None:
        FakeClock.sleep(self, seconds)
        if self.at is not None and len(self.sleeps) == self.at:
            task = asyncio.current_task()
            assert task is not None
            task.cancel()
        await asyncio.sleep(0)


def fakes(clock: FakeClock, kind: type[FakeEngine] | type[AsyncFakeEngine] = FakeEngine) -> list[AnyFake]:
    engines: list[AnyFake] = [kind(f"http://fake-{i}:30000") for i in range(3)]
    for e in engines:
        e.clock = clock
    return engines


def alive(engines: list[AnyFake]) -> None:
    assert [e.crash for e in engines] == [None] * len(engines)


@pytest.fixture
def fanout() -> Iterator[ThreadFanOut]:
    pool = ThreadFanOut(max_workers=4)
    yield pool
    pool.close()


def test_a_release_that_applies_after_its_reset_ends_the_offload_ok(fanout: ThreadFanOut, tmp_path: Path) -> None:
    clock = FakeClock()
    engines = fakes(clock)
    probe = TruthProbe(engines)
    orch = Orchestrator(EngineGroup(engines), fanout=fanout, deadlines=DEADLINES, clock=clock, memory_probe=probe, journal=tmp_path / "j")
    engines[0].arm(RELEASE, Fault.APPLIES_LATER)  # reset after sending; applied 0.3 s later
    orch.offload()
    assert orch.quarantined() == {} and orch.states() == dict.fromkeys((e.engine for e in engines), EngineState.RELEASED)
    assert 0.3 - 1e-9 <= sum(clock.sleeps) < GRACE_S  # polled until the probe proved it, not through the grace
    assert clock.sleeps == pytest.approx([0.05] * len(clock.sleeps)) and probe.asked == len(clock.sleeps) + 1
    assert engines[0].started.count(RELEASE) == 1
    orch.close()
    again = Orchestrator(EngineGroup(engines), fanout=fanout, deadlines=DEADLINES, clock=clock, journal=tmp_path / "j")
    assert again.states()[engines[0].engine] == EngineState.RELEASED  # the settled release was journaled
    again.onload()
    alive(engines)
    assert all(e.serving for e in engines)
    again.close()


def test_a_probe_that_cannot_prove_it_while_the_release_is_carried_out_is_asked_again(fanout: ThreadFanOut) -> None:
    clock = FakeClock()
    engines = fakes(clock)
    probe = BusyProbe(engines)
    orch = Orchestrator(EngineGroup(engines), fanout=fanout, deadlines=DEADLINES, clock=clock, memory_probe=probe)
    engines[2].arm(RELEASE, Fault.APPLIES_LATER)
    orch.offload()
    assert orch.quarantined() == {} and orch.states() == dict.fromkeys((e.engine for e in engines), EngineState.RELEASED)
    assert 0.3 - 1e-9 <= sum(clock.sleeps) < GRACE_S
    assert engines[2].started.count(RELEASE) == 1
    alive(engines)


def test_the_async_orchestrator_polls_without_blocking_its_loop() -> None:
    clock = FakeClock()
    engines = fakes(clock, AsyncFakeEngine)
    orch = AsyncOrchestrator(EngineGroup(engines), deadlines=DEADLINES, clock=clock, memory_probe=TruthProbe(engines))
    engines[1].arm(RELEASE, Fault.APPLIES_LATER)
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    async def run() -> None:
        beat = asyncio.create_task(ticker())
        try:
            await orch.offload()
        finally:
            beat.cancel()

    asyncio.run(run())
    assert orch.quarantined() == {} and orch.states() == dict.fromkeys((e.engine for e in engines), EngineState.RELEASED)
    assert 0.3 - 1e-9 <= sum(clock.sleeps) < GRACE_S
    assert ticks >= len(clock.sleeps)  # the loop ran other tasks during each wait
    assert engines[1].started.count(RELEASE) == 1
    alive(engines)


def test_a_release_that_never_applies_is_trusted_not_released_after_the_grace_and_re_sent(fanout: ThreadFanOut) -> None:
    clock = FakeClock()
    engines = fakes(clock)
    orch = Orchestrator(EngineGroup(engines), fanout=fanout, deadlines=DEADLINES, clock=clock, memory_probe=TruthProbe(engines))
    engines[0].arm(RELEASE, Fault.AMBIGUOUS_NOT_APPLIED)  # reset after sending; never applied
    with pytest.raises(PhaseFailed) as failed:
        orch.offload()
    assert failed.value.phase == "release" and failed.value.quarantined == ()  # "not released" trusted once the grace passed
    assert sum(clock.sleeps) == pytest.approx(GRACE_S)
    alive(engines)
    assert all(e.serving for e in engines)  # rolled back: the others resumed, all continued
    orch.offload()  # the release is sent again, once
    alive(engines)
    assert engines[0].started.count(RELEASE) == 2
    assert orch.states() == dict.fromkeys((e.engine for e in engines), EngineState.RELEASED)


def test_an_interrupt_during_the_poll_leaves_the_engine_quarantined_with_its_doubt(fanout: ThreadFanOut) -> None:
    clock = InterruptingClock()
    engines = fakes(clock)
    orch = Orchestrator(EngineGroup(engines), fanout=fanout, deadlines=DEADLINES, clock=clock, memory_probe=TruthProbe(engines))
    engines[0].arm(RELEASE, Fault.APPLIES_LATER)
    clock.at = 2  # the second wait of the poll, before the release applies
    with pytest.raises(KeyboardInterrupt):
        orch.offload()
    assert orch.quarantined() == {engines[0].engine: ALL}
    assert "on its way" in orch.not_serving()[engines[0].engine]
    assert not engines[0].snapshot()[2]  # not applied yet: nothing was settled from a wrong "not released"
    clock.at = None
    orch.offload()  # the next start polls again until the release proves applied: never released twice
    alive(engines)
    assert engines[0].started.count(RELEASE) == 1
    assert orch.states() == dict.fromkeys((e.engine for e in engines), EngineState.RELEASED)


def test_a_cancelled_poll_leaves_the_engine_quarantined_with_its_doubt() -> None:
    clock = InterruptingClock()
    engines = fakes(clock, AsyncFakeEngine)
    orch = AsyncOrchestrator(EngineGroup(engines), deadlines=DEADLINES, clock=clock, memory_probe=TruthProbe(engines))
    engines[2].arm(RELEASE, Fault.APPLIES_LATER)
    clock.at = 2

    async def run() -> None:
        task = asyncio.create_task(orch.offload())
        with pytest.raises(asyncio.CancelledError):
            await task
        assert orch.quarantined() == {engines[2].engine: ALL}
        assert "on its way" in orch.not_serving()[engines[2].engine]
        clock.at = None
        await orch.offload()

    asyncio.run(run())
    alive(engines)
    assert engines[2].started.count(RELEASE) == 1
    assert orch.states() == dict.fromkeys((e.engine for e in engines), EngineState.RELEASED)
