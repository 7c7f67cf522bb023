"""AsyncOrchestrator from inside a running loop, on socket-free async engines with SGLang's crash semantics."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from resilience.barrier import AsyncOrchestrator, BarrierBusy, EngineGroup, EngineSkipped, PhaseDeadlines, PhaseFailed
from resilience.barrier.state import TransitionEnded
from resilience.engine_contract import EngineState
from resilience.errors import AmbiguousOutcome
from resilience.events import Event
from tests.barrier.fake_engine import ALL, AsyncFakeEngine, Fault, Refused

DEADLINES = PhaseDeadlines(transition_s=10.0, pause_s=3, flush_s=3, release_s=3, resume_s=3, continue_s=3)
"""Phase limits no test reaches: a test cancels or lands its late calls itself (robust under load)."""
OFFLOAD = ["pause_generation", "flush_cache", "release_memory_occupation"]
ONLOAD = ["resume_memory_occupation", "continue_generation"]


def make(n: int = 2, **kwargs: object) -> tuple[list[AsyncFakeEngine], AsyncOrchestrator[AsyncFakeEngine]]:
    engines = [AsyncFakeEngine(f"http://fake-{i}:30000") for i in range(n)]
    return engines, AsyncOrchestrator(EngineGroup(engines), deadlines=kwargs.pop("deadlines", DEADLINES), **kwargs)  # type: ignore[arg-type]


def alive(engines: list[AsyncFakeEngine]) -> None:
    for e in engines:
        assert e.crash is None and not e.violations, (e.engine, e.crash, e.violations)


async def until(condition: Callable[[], bool], turns: int = 10_000) -> None:
    """Let the loop run until ``condition`` holds (loop turns, not time: robust under load)."""
    for _ in range(turns):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition not reached")


@pytest.mark.asyncio
async def test_offload_weight_sync_onload_from_a_running_loop() -> None:
    """The colocate step awaited on the test's loop: phases in order on every engine, the sync inside the offloaded window."""
    engines, orch = make(3)
    report = await orch.offload()
    assert [p.phase for p in report.phases] == ["pause", "flush", "release"]
    assert all(e.paused and e.released == set(ALL) for e in engines)
    await orch.onload(tags=["weights"])
    async with orch.weight_sync() as synced:
        assert synced == engines and orch.held()[engines[0].engine] == ("offload", "weight_sync")
        for e in engines:
            e.push_weights()
    assert all(e.paused for e in engines)  # the offload's hold remains: admission stays closed
    final = await orch.onload()
    assert final.held == {} and orch.held() == {}
    for e in engines:
        assert e.started == [*OFFLOAD, *["resume_memory_occupation"] * 2, "continue_generation"]  # known paused: no re-pause
        assert e.serving
    assert set(orch.states().values()) == {EngineState.SERVING}
    alive(engines)


@pytest.mark.asyncio
async def test_a_failed_release_raises_phase_failed_with_each_engines_error() -> None:
    """A refused release on one engine and an ambiguous one on another: PhaseFailed names both with their errors; the
    refused one is rolled back, the ambiguous one is quarantined and named in left_paused."""
    engines, orch = make(3)
    engines[1].arm("release_memory_occupation", Fault.FAILED)
    engines[2].arm("release_memory_occupation", Fault.AMBIGUOUS_APPLIED)
    with pytest.raises(PhaseFailed) as info:
        await orch.offload()
    err = info.value
    assert err.transition == "offload" and err.phase == "release"
    assert isinstance(err.failures[engines[1].engine], Refused) and isinstance(err.failures[engines[2].engine], AmbiguousOutcome)
    assert sorted(err.rolled_back) == [engines[0].engine, engines[1].engine]
    assert list(err.left_paused) == [engines[2].engine] and "quarantined" in err.left_paused[engines[2].engine]
    assert err.quarantined == (engines[2].engine,)
    assert engines[0].serving and engines[1].serving and engines[2].released == set(ALL)  # applied, and left alone
    with pytest.raises(PhaseFailed) as again:
        await orch.onload()
    assert isinstance(again.value.failures[engines[2].engine], EngineSkipped)
    await orch.reconcile(engines[2], released=ALL, paused=True)
    await orch.onload()
    assert all(e.serving for e in engines)
    alive(engines)


@pytest.mark.asyncio
async def test_barrier_busy_from_a_concurrent_task_and_from_inside_the_body() -> None:
    """An offload from another task waits for a running sync body, then gives up at transition_s having sent nothing;
    awaited inside the body it is refused at once; once the body ended it runs."""
    engines, orch = make(2, deadlines=PhaseDeadlines(transition_s=0.05, pause_s=1, flush_s=1, release_s=1, resume_s=1, continue_s=1))
    body_in, body_out = asyncio.Event(), asyncio.Event()

    async def sync() -> None:
        async with orch.weight_sync():
            body_in.set()
            with pytest.raises(BarrierBusy, match="inside a weight_sync"):
                await orch.onload()
            await body_out.wait()

    holder = asyncio.create_task(sync())
    await body_in.wait()
    sent = [list(e.started) for e in engines]
    with pytest.raises(BarrierBusy, match="weight_sync"):
        await asyncio.create_task(orch.offload())
    assert [list(e.started) for e in engines] == sent == [["pause_generation"]] * 2
    body_out.set()
    await holder
    await orch.offload()
    await orch.onload()
    assert all(e.serving for e in engines) and orch.held() == {}
    alive(engines)


@pytest.mark.asyncio
async def test_offload_from_another_task_waits_for_the_body() -> None:
    """With time to spare, the other task's offload starts only after the body ended (never inside it)."""
    engines, orch = make(2)
    order: list[str] = []
    body_in = asyncio.Event()

    async def sync() -> None:
        async with orch.weight_sync():
            body_in.set()
            for _ in range(50):
                await asyncio.sleep(0)
            order.append("body ended")

    holder = asyncio.create_task(sync())
    await body_in.wait()
    await orch.offload()
    order.append("offload done")
    await holder
    assert order == ["body ended", "offload done"]
    assert all(e.released == set(ALL) for e in engines)
    await orch.onload()
    alive(engines)


@pytest.mark.asyncio
async def test_concurrent_syncs_hold_their_own_tokens() -> None:
    """Two tasks' syncs overlap: the first to end does not reopen admission under the other."""
    engines, orch = make(2)
    a_in, b_done = asyncio.Event(), asyncio.Event()

    async def a() -> None:
        async with orch.weight_sync():
            a_in.set()
            await b_done.wait()
            assert all(e.paused for e in engines)

    task = asyncio.create_task(a())
    await a_in.wait()
    async with orch.weight_sync(mode="in_place"):
        pass
    assert all(e.paused for e in engines) and orch.held() == {e.engine: ("weight_sync",) for e in engines}
    b_done.set()
    await task
    assert all(e.serving for e in engines) and orch.held() == {}
    alive(engines)


@pytest.mark.asyncio
async def test_cancelled_mid_release_keeps_the_call_in_flight_then_learns_its_outcome() -> None:
    """Cancelling the awaiting task while one release runs: the answered release is known, the running one is recorded in
    flight (not forgotten, not re-sent); it keeps running, and the next onload waits for it and resumes what it released."""
    seen: list[Event] = []
    engines, orch = make(2, observers=[seen.append])
    engines[0].arm("release_memory_occupation", Fault.LATE_APPLIED)
    task = asyncio.create_task(orch.offload())
    await until(lambda: engines[1].released == set(ALL) and "release_memory_occupation" in engines[0].started)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    states = orch.states()
    assert states == {engines[0].engine: EngineState.IN_FLIGHT, engines[1].engine: EngineState.RELEASED}
    assert "late release_memory_occupation" in orch.not_serving()[engines[0].engine]
    ended = [e for e in seen if isinstance(e, TransitionEnded)]
    assert ended[-1].ok is False and ended[-1].failed_phase == "release"
    engines[0].land()
    report = await orch.onload()
    assert [p.phase for p in report.phases] == ["resume", "continue"] and report.phases[0].engines == tuple(e.engine for e in engines)
    assert [e.started.count("release_memory_occupation") for e in engines] == [1, 1]
    assert all(e.serving for e in engines)
    alive(engines)


@pytest.mark.asyncio
async def test_a_cancelled_call_that_may_have_run_quarantines_its_engine() -> None:
    """The in-flight release of a cancelled offload is itself cancelled (its loop shutting down): it may have run, so its
    tags become unknown (quarantine), never "not released"; the next onload skips the engine and says so."""
    engines, orch = make(2)
    engines[0].arm("release_memory_occupation", Fault.LATE_APPLIED)
    task = asyncio.create_task(orch.offload())
    await until(lambda: "release_memory_occupation" in engines[0].started and engines[1].released == set(ALL))
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    running = [t for t in asyncio.all_tasks() if t.get_name().startswith("cpr-release_memory_occupation")]
    assert len(running) == 1
    running[0].cancel()
    await asyncio.gather(*running, return_exceptions=True)
    with pytest.raises(PhaseFailed) as info:
        await orch.onload()
    name = engines[0].engine
    assert isinstance(info.value.failures[name], EngineSkipped) and info.value.quarantined == (name,)
    assert orch.quarantined() == {name: frozenset(ALL)} and engines[1].serving
    alive(engines)


@pytest.mark.asyncio
async def test_a_cancelled_sync_body_ends_its_hold() -> None:
    """A weight_sync body cancelled while it awaits: the hold is released on the way out and the engines serve again."""
    engines, orch = make(2)
    body_in = asyncio.Event()

    async def sync() -> None:
        async with orch.weight_sync():
            body_in.set()
            await asyncio.Event().wait()  # until cancelled

    task = asyncio.create_task(sync())
    await body_in.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert orch.held() == {} and all(e.serving for e in engines)
    await orch.offload()  # nothing waits for a body that is gone
    await orch.onload()
    alive(engines)


def test_one_orchestrator_on_two_loops_one_after_the_other() -> None:
    """Idle between two asyncio.run calls, the orchestrator moves to the new loop."""
    engines, orch = make(2)
    asyncio.run(orch.offload())
    asyncio.run(orch.onload())
    assert all(e.serving for e in engines) and [e.started for e in engines] == [[*OFFLOAD, *ONLOAD]] * 2
    with pytest.raises(ValueError, match="max_concurrency"):
        AsyncOrchestrator(EngineGroup(engines), max_concurrency=0)


@pytest.mark.asyncio
async def test_cancelled_while_pausing_for_a_sync_drops_the_hold_nobody_received() -> None:
    """A weight_sync cancelled while its pause runs: no token was handed out, so no engine stays held by it; the pause
    still running is in flight, and once it landed an onload continues the engine it paused."""
    engines, orch = make(2)
    engines[0].arm("pause_generation", Fault.LATE_APPLIED)

    async def sync() -> None:
        async with orch.weight_sync():
            raise AssertionError("the body must not run")

    task = asyncio.create_task(sync())
    await until(lambda: "pause_generation" in engines[0].started and engines[1].paused)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert orch.held() == {}
    assert orch.states() == {engines[0].engine: EngineState.IN_FLIGHT, engines[1].engine: EngineState.PAUSED}
    engines[0].land()
    await until(lambda: engines[0].paused)
    await orch.onload()  # lands the late pause, then continues both: nothing holds them
    assert all(e.serving for e in engines) and set(orch.states().values()) == {EngineState.SERVING}
    alive(engines)


@pytest.mark.asyncio
async def test_a_cancelled_offload_keeps_its_hold_until_onload() -> None:
    """An offload cancelled after its pause phase leaves the engines paused and held by "offload"; onload ends it."""
    engines, orch = make(2)
    engines[1].arm("flush_cache", Fault.LATE_APPLIED)
    task = asyncio.create_task(orch.offload())
    await until(lambda: "flush_cache" in engines[1].started)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert orch.held() == {e.engine: ("offload",) for e in engines} and all(orch.paused_by_us(e) for e in engines)
    assert not any(e.released for e in engines)
    engines[1].land()
    await orch.onload()
    assert orch.held() == {} and all(e.serving for e in engines)
    alive(engines)
