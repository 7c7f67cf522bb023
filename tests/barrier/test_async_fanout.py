"""AsyncFanOut on socket-free async engines: one loop, ThreadFanOut's semantics for deadlines, late calls and errors."""

from __future__ import annotations

import asyncio
import contextvars
import threading
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

import pytest

from resilience.barrier.async_fanout import AsyncFanOut, PhaseRun, TaskCall
from resilience.barrier.fanout import EngineResult, PhaseTimeout, ThreadFanOut, interrupted_results
from resilience.barrier.state import Effect, effect_of
from resilience.deadline import CURRENT_DEADLINE, Deadline
from resilience.errors import AmbiguousOutcome
from tests.barrier.fake_engine import AsyncFakeEngine, Fault, Refused

TENANT: contextvars.ContextVar[str] = contextvars.ContextVar("tenant", default="none")


@pytest.fixture
def fanout() -> Iterator[AsyncFanOut]:
    with AsyncFanOut() as f:
        yield f


def fakes(n: int) -> list[AsyncFakeEngine]:
    return [AsyncFakeEngine(f"http://fake-{i}:30000") for i in range(n)]


class Rendezvous:
    """Engines that answer only once all ``n`` calls have started: a fan-out that runs them one at a time never finishes."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.arrived = 0
        self.all_in: asyncio.Event | None = None
        self.seen: list[tuple[str, float | None, str]] = []

    def engine(self, name: str) -> Any:
        outer = self

        class Engine:
            engine = name

            async def pause_generation(self, *, mode: str = "abort") -> str:
                if outer.all_in is None:
                    outer.all_in = asyncio.Event()
                outer.arrived += 1
                deadline = CURRENT_DEADLINE.get()
                outer.seen.append((name, None if deadline is None else deadline.remaining(), TENANT.get()))
                if outer.arrived == outer.n:
                    outer.all_in.set()
                await outer.all_in.wait()
                return name

        return Engine()


def test_every_call_runs_at_once_under_the_phase_deadline_with_the_callers_context(fanout: AsyncFanOut) -> None:
    """50 calls all start before any answers; each sees the phase Deadline and the caller's context variables."""
    meet = Rendezvous(50)
    engines = [meet.engine(f"e{i}") for i in range(50)]
    token = TENANT.set("team-a")
    try:
        results = fanout.call([(e, {"mode": "retract"}) for e in engines], "pause_generation", Deadline(30))
    finally:
        TENANT.reset(token)
    assert [r.engine for r in results] == [f"e{i}" for i in range(50)]
    assert all(r.ok and r.value == r.engine for r in results), [r for r in results if not r.ok][:3]
    assert len(meet.seen) == 50
    assert all(remaining is not None and 0 < remaining <= 30 and tenant == "team-a" for _, remaining, tenant in meet.seen)


def test_errors_are_each_engines_own(fanout: AsyncFanOut) -> None:
    """A refusal and an ambiguous answer come back as that engine's error; the others' values are intact."""
    engines = fakes(3)
    engines[0].arm("flush_cache", Fault.FAILED)
    engines[2].arm("flush_cache", Fault.AMBIGUOUS_APPLIED)
    results = fanout.call([(e, {}) for e in engines], "flush_cache", Deadline(10))
    assert isinstance(results[0].error, Refused) and results[1].ok and isinstance(results[2].error, AmbiguousOutcome)
    assert results[1].value == {"engine": engines[1].engine, "method": "flush_cache"}
    assert [effect_of(r.error) for r in results] == [Effect.NOT_APPLIED, Effect.APPLIED, Effect.AMBIGUOUS]


def test_a_late_call_keeps_running_and_lands(fanout: AsyncFanOut) -> None:
    """A call still running at the phase deadline is a PhaseTimeout (maybe sent) with a handle; it is not cancelled, and lands."""
    engines = fakes(2)
    engines[0].arm("pause_generation", Fault.LATE_APPLIED)
    results = fanout.call([(e, {}) for e in engines], "pause_generation", Deadline(0.3))
    late = results[0]
    assert isinstance(late.error, PhaseTimeout) and late.error.maybe_sent and isinstance(late.late, TaskCall)
    assert results[1].ok and engines[1].paused and not engines[0].paused
    assert late.late.wait(0) == (False, None)
    engines[0].land()
    assert late.late.wait(10) == (True, None)
    assert engines[0].paused  # applied when it landed: nothing cancelled it


def test_a_call_queued_at_the_deadline_is_never_sent() -> None:
    """With max_concurrency=1 and the first call late, the second is still queued at the deadline: not sent, and it says so."""
    engines = fakes(2)
    engines[0].arm("release_memory_occupation", Fault.LATE_APPLIED)
    with AsyncFanOut(max_concurrency=1) as fanout:
        results = fanout.call([(e, {"tags": None}) for e in engines], "release_memory_occupation", Deadline(0.3))
        queued = results[1]
        assert isinstance(queued.error, PhaseTimeout) and queued.error.maybe_sent is False and queued.late is None
        assert effect_of(queued.error) is Effect.NOT_APPLIED
        engines[0].land()
        assert results[0].late is not None and results[0].late.wait(10)[0]
    assert engines[1].started == [] and engines[0].started == ["release_memory_occupation"]


def test_close_cancels_a_late_call_which_lands_as_ambiguous() -> None:
    """close() cancels what still runs; the late handle then says the call may have run (never "not applied")."""
    engines = fakes(1)
    engines[0].arm("resume_memory_occupation", Fault.LATE_APPLIED)
    fanout = AsyncFanOut()
    [result] = fanout.call([(engines[0], {})], "resume_memory_occupation", Deadline(0.3))
    assert result.late is not None
    fanout.close()
    landed, error = result.late.wait(10)
    assert landed and isinstance(error, PhaseTimeout) and error.maybe_sent
    assert effect_of(error) is Effect.AMBIGUOUS


def test_run_and_calls_from_the_loop_thread(fanout: AsyncFanOut) -> None:
    """run() executes a coroutine on the fan-out's loop; a phase started from that loop's own thread is refused, not deadlocked."""

    async def on_loop() -> tuple[bool, str]:
        try:
            fanout.call([(fakes(1)[0], {})], "pause_generation", Deadline(1))
        except RuntimeError as err:
            return asyncio.get_running_loop() is fanout.loop, str(err)
        return False, "no error"

    same_loop, message = fanout.run(on_loop(), timeout=10)
    assert same_loop and "its own loop thread" in message


def test_thread_fanout_refuses_async_engines_without_sending() -> None:
    """ThreadFanOut given an async engine reports a TypeError (not applied) and never runs the coroutine."""
    engine = fakes(1)[0]
    pool = ThreadFanOut(max_workers=2)
    try:
        [result] = pool.call([(engine, {})], "pause_generation", Deadline(5))
    finally:
        pool.close()
    assert isinstance(result, EngineResult) and isinstance(result.error, TypeError) and "AsyncFanOut" in str(result.error)
    assert effect_of(result.error) is Effect.NOT_APPLIED and engine.started == [] and not engine.paused


def test_bad_knobs_are_refused() -> None:
    """max_concurrency below 1 and a negative close timeout are refused, naming the knob."""
    with pytest.raises(ValueError, match="max_concurrency"):
        AsyncFanOut(max_concurrency=0)
    with pytest.raises(ValueError, match="close_timeout_s"):
        AsyncFanOut(close_timeout_s=-1)


T = TypeVar("T")


class InterruptedOnceQueued(AsyncFanOut):
    """Ctrl-C landing in ``call`` just after its phase was queued on the loop, before the loop thread ran it: once.

    In life the interrupt lands in the loop's self-pipe write, so the loop is not woken until the read-back's own write
    wakes it. Here the loop is held busy by a callback queued first, until the read-back is queued behind the phase's
    start: the loop then runs the start, the read-back, and only then the phase's first step.
    """

    armed = True
    hold: threading.Event | None = None

    def _submit(self, coro: Coroutine[Any, Any, T], context: contextvars.Context | None = None) -> Any:
        if not self.armed:
            return super()._submit(coro, context)
        self.armed = False
        self.hold = threading.Event()
        self._start().call_soon_threadsafe(self.hold.wait, 10.0)  # the loop is busy until the read-back is queued
        super()._submit(coro, context)
        raise KeyboardInterrupt("interrupted once the phase was queued")

    def _queue_read_back(self, loop: asyncio.AbstractEventLoop, *args: Any) -> Any:
        read = super()._queue_read_back(loop, *args)
        if self.hold is not None:
            self.hold.set()
        return read


class InterruptedOnceRun(AsyncFanOut):
    """Ctrl-C landing in ``call`` after its phase was queued *and* the loop ran it to its end (the other side of the race)."""

    armed = True

    def _submit(self, coro: Coroutine[Any, Any, T], context: contextvars.Context | None = None) -> Any:
        future = super()._submit(coro, context)
        if self.armed:
            self.armed = False
            future.result(10.0)  # the phase has run and every engine answered
            raise KeyboardInterrupt("interrupted once the phase had run")
        return future


def test_an_interrupt_once_the_phase_is_queued_sends_nothing_and_says_so() -> None:
    """The phase was already queued on the loop when the interrupt came: it is abandoned before it starts (no engine gets
    the call) and the error carries every call as never sent, so the orchestrator's knowledge stays true."""
    engines = fakes(2)
    with InterruptedOnceQueued() as fanout:
        with pytest.raises(KeyboardInterrupt) as caught:
            fanout.call([(e, {}) for e in engines], "pause_generation", Deadline(5.0))
        results = interrupted_results(caught.value)
        assert results is not None and len(results) == 2
        for result in results:
            assert result is not None and isinstance(result.error, PhaseTimeout) and result.error.maybe_sent is False
        fanout.run(asyncio.sleep(0))  # the queued phase has run by now (it found itself abandoned)
        fanout.run(asyncio.sleep(0))
    assert [e.started for e in engines] == [[], []] and not any(e.paused for e in engines)


def test_an_interrupt_after_the_phase_ran_reports_what_the_engines_did() -> None:
    """The loop ran the whole phase before the interrupt was read back: the error carries each engine's answer, so the
    orchestrator learns that every engine paused (nothing is reported as not sent)."""
    engines = fakes(2)
    with InterruptedOnceRun() as fanout:
        with pytest.raises(KeyboardInterrupt) as caught:
            fanout.call([(e, {}) for e in engines], "pause_generation", Deadline(5.0))
        results = interrupted_results(caught.value)
    assert results is not None and len(results) == 2
    for engine, result in zip(engines, results, strict=True):
        assert result is not None and result.error is None and result.value == {"engine": engine.engine, "method": "pause_generation"}
    assert [e.started for e in engines] == [["pause_generation"], ["pause_generation"]] and all(e.paused for e in engines)


def test_an_interrupt_while_the_phase_makes_its_tasks_sends_nothing() -> None:
    """Ctrl-C between two of a phase's task creations (here: the loop's task factory raising on the second): the task
    already made is cancelled before it ever runs, so no engine gets the call and "nothing sent" is true."""
    engines = fakes(3)
    loop = asyncio.new_event_loop()
    made: list[asyncio.Task[Any]] = []

    def factory(loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> asyncio.Task[Any]:
        if made:
            coro.close()
            raise KeyboardInterrupt("interrupted while the phase made its tasks")
        task = asyncio.Task(coro, loop=loop, **kwargs)
        made.append(task)
        return task

    async def phase() -> None:
        asyncio.get_running_loop().set_task_factory(factory)  # type: ignore[arg-type]  # from here on: the phase's tasks
        PhaseRun([(e, {}) for e in engines], "pause_generation", Deadline(5.0))

    try:
        with pytest.raises(KeyboardInterrupt):
            loop.run_until_complete(phase())  # the phase coroutine itself runs in the loop's first task
        loop.set_task_factory(None)
        loop.run_until_complete(asyncio.sleep(0.01))
    finally:
        loop.close()
    assert len(made) == 1 and made[0].cancelled()
    assert [e.started for e in engines] == [[], [], []] and not any(e.paused for e in engines)


def test_a_task_cancelled_from_outside_before_it_runs_still_ends_the_wait() -> None:
    """A call's task cancelled from outside before it ran counts as ended: ``wait`` returns long before the deadline,
    and that call reads as never sent."""
    engines = fakes(2)

    async def phase() -> list[EngineResult]:
        run = PhaseRun([(e, {}) for e in engines], "pause_generation", Deadline(30.0))
        run.tasks[1].cancel()
        await asyncio.wait_for(run.wait(), 5.0)
        return run.results()

    results = asyncio.run(phase())
    assert results[0].ok and isinstance(results[1].error, PhaseTimeout) and results[1].error.maybe_sent is False
    assert engines[1].started == [] and engines[0].paused


def test_what_one_call_sets_in_its_context_its_siblings_do_not_see(fanout: AsyncFanOut) -> None:
    """The calls of a phase share the phase deadline, but each task runs in its own copy of the context."""
    seen: list[tuple[str, str]] = []

    class Engine:
        def __init__(self, name: str) -> None:
            self.engine = name

        async def pause_generation(self) -> None:
            TENANT.set(self.engine)
            await asyncio.sleep(0)  # the siblings run (and set theirs) in between
            seen.append((self.engine, TENANT.get()))

    engines: list[Any] = [Engine(f"e{i}") for i in range(3)]  # only the one call the phase makes
    results = fanout.call([(e, {}) for e in engines], "pause_generation", Deadline(10))
    assert all(r.ok for r in results) and sorted(seen) == [("e0", "e0"), ("e1", "e1"), ("e2", "e2")]
