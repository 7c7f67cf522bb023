"""The garbage collector paused while a phase runs on a loop: held, shared, bounded, given back, and left alone when asked."""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Iterator
from typing import Any

import pytest

from resilience.barrier import AsyncOrchestrator, EngineGroup, Orchestrator, PhaseDeadlines, async_fanout
from resilience.barrier.async_fanout import DEFAULT_GC_PAUSE_S, AsyncFanOut, PhaseRun, collector_paused_by_us, pause_collector
from resilience.deadline import Deadline
from resilience.errors import ConfigError
from tests.barrier.fake_engine import AsyncFakeEngine, Fault
from tests.barrier.test_async_orchestrator import until

DEADLINES = PhaseDeadlines(transition_s=10.0, pause_s=3, flush_s=3, release_s=3, resume_s=3, continue_s=3)


@pytest.fixture(autouse=True)
def collector_enabled() -> Iterator[None]:
    """Each test starts with the collector on and no pause held (an earlier test's fan-out may still linger, bounded), and
    leaves it as it found it (a failing test must not leave it off)."""
    for _ in range(1000):
        if not collector_paused_by_us():
            break
        time.sleep(0.01)
    was = gc.isenabled()
    gc.enable()
    try:
        yield
    finally:
        outlived = collector_paused_by_us()
        if was:
            gc.enable()
        else:
            gc.disable()
    assert not outlived, "a pause outlived its test"


class Watching(AsyncFakeEngine):
    """An engine that notes, in every control call, whether the collector runs."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.collector_on: list[bool] = []

    async def _call(self, method: str, apply: Any) -> dict[str, Any]:
        self.collector_on.append(gc.isenabled())
        return await super()._call(method, apply)


def watching(n: int) -> list[Watching]:
    return [Watching(f"http://fake-{i}:30000") for i in range(n)]


@pytest.mark.asyncio
async def test_a_pause_is_held_until_its_end_and_end_is_idempotent() -> None:
    """The collector is off from ``pause_collector`` until ``end()``; a second ``end()`` changes nothing."""
    pause = pause_collector(DEFAULT_GC_PAUSE_S)
    assert pause.held and not gc.isenabled() and collector_paused_by_us()
    pause.end()
    assert not pause.held and gc.isenabled() and not collector_paused_by_us()
    pause.end()
    assert gc.isenabled()


@pytest.mark.asyncio
async def test_overlapping_pauses_give_the_collector_back_when_the_last_ends() -> None:
    """Two phases at once: the collector stays off until both let go, in either order."""
    first, second = pause_collector(5.0), pause_collector(5.0)
    first.end()
    assert not gc.isenabled()
    second.end()
    assert gc.isenabled()


def until_collector_runs(turns: int = 2000) -> None:
    """Wait (bounded: 20 s) for the watchdog to give the collector back; fail if it never does."""
    for _ in range(turns):
        if gc.isenabled():
            return
        time.sleep(0.01)
    raise AssertionError("the collector is still paused")


def test_a_pause_ends_by_itself_at_its_bound() -> None:
    """A phase that outlasts its bound gives the collector back then, while it still runs (the watchdog ends it)."""
    pause = pause_collector(0.5)  # long enough that a stalled test thread still finds it held
    assert not gc.isenabled()
    until_collector_runs()
    assert not pause.held


def test_a_pause_whose_loop_stopped_still_ends() -> None:
    """A phase on a loop that stopped running mid-phase (its task never resumed, its timers never fire) still gives the
    collector back."""
    loop = asyncio.new_event_loop()

    async def phase_forever() -> None:
        pause_collector(0.5)
        await asyncio.Event().wait()

    try:
        task = loop.create_task(phase_forever())
        loop.run_until_complete(asyncio.sleep(0))  # the phase took its pause; the loop then stops running
        assert not gc.isenabled() and not task.done()
        until_collector_runs()
        task.cancel()
        loop.run_until_complete(asyncio.gather(task, return_exceptions=True))
    finally:
        loop.close()


def test_holds_back_to_back_never_chain_a_pause_past_its_bound() -> None:
    """A hold taken while the collector is paused ends no later than that pause's start plus its bound: phases that
    keep overlapping (each starting inside the last one's linger) cannot keep the collector off for good."""
    first = pause_collector(60.0)
    time.sleep(0.05)
    second = pause_collector(60.0)
    first.end()
    assert second._bound == first._bound  # the pause's own start plus 60 s, not 60 s from the second hold
    second.end()
    assert gc.isenabled()
    third = pause_collector(60.0)  # the collector ran again: a new pause, with a bound of its own
    assert third._bound > first._bound
    third.end()


def test_no_watchdog_no_pause(monkeypatch: pytest.MonkeyPatch) -> None:
    """When the watchdog thread cannot start (no threads left, interpreter shutdown), nothing is paused: a pause that
    only the watchdog could end at its bound is never taken."""

    class NoThread(async_fanout.threading.Thread):
        def start(self) -> None:
            raise RuntimeError("can't start new thread")

    monkeypatch.setattr(async_fanout, "_watchdog", None)
    monkeypatch.setattr(async_fanout.threading, "Thread", NoThread)
    pause = pause_collector(60.0)
    assert not pause.held and gc.isenabled() and not collector_paused_by_us()
    assert async_fanout._holds == {}


def test_end_after_lingers_but_never_past_the_bound() -> None:
    """``end_after`` keeps the pause a while longer, and a linger longer than the bound still ends at the bound."""
    pause = pause_collector(0.5)
    pause.end_after(60.0)  # capped at the 0.5 s bound
    assert not gc.isenabled()
    until_collector_runs()
    pause = pause_collector(60.0)
    pause.end_after(0.5)
    assert not gc.isenabled()
    until_collector_runs()
    pause.end()


@pytest.mark.asyncio
async def test_a_collector_disabled_before_is_left_disabled() -> None:
    """A process that runs without automatic collection keeps running without it."""
    gc.disable()
    pause = pause_collector(5.0)
    assert not collector_paused_by_us()
    pause.end()
    assert not gc.isenabled()
    gc.enable()


@pytest.mark.asyncio
async def test_a_pause_of_zero_leaves_the_collector_alone() -> None:
    """``max_s = 0`` pauses nothing."""
    pause = pause_collector(0.0)
    assert not pause.held and gc.isenabled()


@pytest.mark.asyncio
async def test_async_orchestrator_pauses_during_its_phases_and_gives_back() -> None:
    """By default every call of an offload and onload runs with the collector paused, and it runs again after; with
    ``gc_pause_s=0`` it runs throughout."""
    engines = watching(3)
    orch = AsyncOrchestrator(EngineGroup(engines), deadlines=DEADLINES)
    assert orch.gc_pause_s == DEFAULT_GC_PAUSE_S
    await orch.offload()
    await orch.onload()
    assert gc.isenabled()
    assert all(e.collector_on == [False] * 5 for e in engines), [e.collector_on for e in engines]
    engines = watching(2)
    alone = AsyncOrchestrator(EngineGroup(engines), deadlines=DEADLINES, gc_pause_s=0)
    await alone.offload()
    assert all(e.collector_on == [True] * 3 for e in engines)


@pytest.mark.asyncio
async def test_a_cancelled_transition_gives_the_collector_back() -> None:
    """Cancelling the task awaiting an offload (a release still running) ends the transition's and the phase's pauses."""
    engines = watching(2)
    engines[0].arm("release_memory_occupation", Fault.LATE_APPLIED)
    orch = AsyncOrchestrator(EngineGroup(engines), deadlines=DEADLINES)
    task = asyncio.create_task(orch.offload())
    await until(lambda: "release_memory_occupation" in engines[0].started)
    assert not gc.isenabled()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert gc.isenabled()
    engines[0].land()
    await orch.onload()
    assert gc.isenabled()


@pytest.mark.asyncio
async def test_a_phase_read_without_waiting_gives_the_collector_back() -> None:
    """``PhaseRun.results()`` read before (or instead of) ``wait()`` ends the phase's pause too."""
    engines = watching(2)
    run = PhaseRun([(e, {}) for e in engines], "pause_generation", Deadline(5.0))
    assert not gc.isenabled()
    run.results()
    assert gc.isenabled()


def test_async_fanout_pauses_on_its_loop_and_gives_back() -> None:
    """The sync ``Orchestrator`` on ``AsyncFanOut``: its calls run with the collector paused; after each phase it runs."""
    engines = watching(2)
    with AsyncFanOut() as fanout:
        orch = Orchestrator(EngineGroup(engines), fanout=fanout, deadlines=DEADLINES)
        orch.offload()
        until_collector_runs()  # after a linger for the fold (FOLD_LINGER_S)
        orch.onload()
    until_collector_runs()  # closed: the watchdog ends what lingered
    assert all(e.collector_on == [False] * 5 for e in engines)
    engines = watching(1)
    with AsyncFanOut(gc_pause_s=0) as fanout:
        Orchestrator(EngineGroup(engines), fanout=fanout, deadlines=DEADLINES).offload()
    assert engines[0].collector_on == [True] * 3


@pytest.mark.parametrize("bad", [-1, float("nan"), float("inf"), "2", True, None])
def test_a_bad_gc_pause_is_refused_naming_the_knob(bad: object) -> None:
    """A negative, NaN, infinite (an unbounded pause) or non-number ``gc_pause_s`` is a ``ConfigError`` naming it, on both."""
    with pytest.raises(ConfigError, match="gc_pause_s"):
        AsyncFanOut(gc_pause_s=bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="AsyncOrchestrator gc_pause_s"):
        AsyncOrchestrator(EngineGroup(watching(1)), gc_pause_s=bad)  # type: ignore[arg-type]
