"""Write-ahead knowledge and what a call did, one rule at a time, on socket-free engines that crash where SGLang 0.5.23 crashes.

Write-ahead knowledge (an interrupt at any point leaves what a call touches unknown, never forgotten), observers told
after the knowledge changed, the effect of a call read from the driver's record (a gateway status after the engine
applied is ambiguous), the memory probe's auto-reconcile, the ``BarrierState.persist`` hook, and the checks made before anything is sent.
"""

from __future__ import annotations

import http.server
import signal
import threading
from collections.abc import Collection, Iterator
from typing import Any, ClassVar

import pytest

from resilience.barrier import (
    AsyncOrchestrator,
    EngineGroup,
    EngineState,
    Orchestrator,
    PhaseDeadlines,
    PhaseFailed,
    SequentialFanOut,
    ThreadFanOut,
)
from resilience.barrier.async_fanout import AsyncFanOut
from resilience.barrier.fanout import FanOut
from resilience.barrier.state import PhaseEnded
from resilience.engine_contract import EngineStateChanged
from resilience.events import Event
from tests.barrier.fake_engine import ALL, AnyFake, AsyncFakeEngine, FakeEngine, Fault

DEADLINES = PhaseDeadlines(transition_s=10.0, pause_s=2, flush_s=2, release_s=2, resume_s=2, continue_s=2)
"""Phase limits no prompt call reaches under load; a call interrupted before it applied lands when the test lets it."""


class Boom(BaseException):
    """An observer's BaseException (not swallowed by ``emit``)."""


def _signal_main() -> None:
    """Ctrl-C reaching the caller's (main) thread while an engine's call runs on a worker; raised in place on the main thread."""
    if threading.current_thread() is threading.main_thread():
        raise KeyboardInterrupt("Ctrl-C")
    signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)


@pytest.fixture(params=["sequential", "threads", "async"])
def fanout(request: pytest.FixtureRequest) -> Iterator[FanOut]:
    """The three synchronous-caller fan-outs; Ctrl-C reaches the main thread in each."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    pool: Any = {"sequential": SequentialFanOut, "threads": lambda: ThreadFanOut(max_workers=8), "async": AsyncFanOut}[request.param]()
    yield pool
    if hasattr(pool, "close"):
        pool.close()
    signal.signal(signal.SIGINT, previous)


def fakes(fanout: FanOut, n: int = 2) -> list[AnyFake]:
    kind = AsyncFakeEngine if isinstance(fanout, AsyncFanOut) else FakeEngine
    engines: list[AnyFake] = [kind(f"http://fake-{i}:30000") for i in range(n)]
    for e in engines:
        e.interrupt = _signal_main
    return engines


def make(fanout: FanOut, n: int = 2, **kwargs: Any) -> tuple[list[AnyFake], Orchestrator[Any]]:
    engines = fakes(fanout, n)
    return engines, Orchestrator(EngineGroup(engines), fanout=fanout, deadlines=DEADLINES, **kwargs)


def alive(engines: list[AnyFake]) -> None:
    for e in engines:
        assert e.crash is None and not e.violations, (e.engine, e.crash, e.violations)


def named(err: PhaseFailed, engines: list[AnyFake]) -> None:
    """Every engine not serving is named."""
    for e in engines:
        if not e.serving:
            assert e.engine in err.left_paused, (e.engine, e.snapshot(), str(err))


def back_to_serving(orch: Orchestrator[Any], engines: list[AnyFake]) -> None:
    """What a controller does after an interruption: land what still runs, reconcile what it cannot know, onload."""
    for _ in range(3):
        for e in engines:
            e.land()
        try:
            orch.onload()
            break
        except PhaseFailed as err:
            named(err, engines)
            for e in engines:
                e.land()
            for e in engines:  # what you check must be the engine's state once its calls have ended
                assert e.wait_idle(), f"{e.engine}: a call is still being carried out"
            for name in err.quarantined:
                engine = next(e for e in engines if e.engine == name)
                paused, _, released = engine.snapshot()
                orch.reconcile(name, released=released, paused=paused)
    alive(engines)
    assert all(e.serving for e in engines), [e.snapshot() for e in engines]


def interrupted(transition: Any) -> None:
    with pytest.raises(KeyboardInterrupt):
        transition()


# -- an interruption forgets nothing --------------------------------------------------------


@pytest.mark.parametrize("when", [Fault.INTERRUPT_BEFORE, Fault.INTERRUPT_AFTER])
def test_ctrl_c_during_release_then_onload_never_continues_onto_released_memory(fanout: FanOut, when: Fault) -> None:
    """Ctrl-C while one engine releases: the next onload resumes what was released and never continues a released engine."""
    engines, orch = make(fanout)
    engines[1].arm("release_memory_occupation", when)
    interrupted(orch.offload)
    state = orch.states()[engines[1].engine]  # unknown, or known from the answer read back; never "flushed" (forgotten)
    assert state in (EngineState.IN_FLIGHT, EngineState.QUARANTINED, EngineState.RELEASED), state
    assert orch.released_tags(engines[1]) <= engines[1].snapshot()[2]
    back_to_serving(orch, engines)


@pytest.mark.parametrize("when", [Fault.INTERRUPT_BEFORE, Fault.INTERRUPT_AFTER])
def test_ctrl_c_during_resume_then_offload_keeps_its_promise_and_onload_never_resumes_twice(fanout: FanOut, when: Fault) -> None:
    """Ctrl-C while one engine resumes: the next offload names it or really offloads it, and no resume is sent twice."""
    engines, orch = make(fanout)
    orch.offload()
    engines[0].arm("resume_memory_occupation", when)
    interrupted(orch.onload)
    for e in engines:
        e.land()
    try:
        orch.offload()
        assert all(e.snapshot()[0] and e.snapshot()[2] == ALL for e in engines), [e.snapshot() for e in engines]
    except PhaseFailed as err:
        named(err, engines)
        assert engines[0].engine in err.quarantined or engines[0].engine in err.left_paused
    alive(engines)
    back_to_serving(orch, engines)


def test_ctrl_c_during_continue_then_offload_pauses_before_it_releases(fanout: FanOut) -> None:
    """Ctrl-C after one engine applied continue: the next offload pauses and flushes it again before releasing."""
    engines, orch = make(fanout)
    orch.offload()
    engines[0].arm("continue_generation", Fault.INTERRUPT_AFTER)
    interrupted(orch.onload)
    for e in engines:
        e.land()
    orch.offload()
    assert all(e.snapshot()[0] and e.snapshot()[2] == ALL for e in engines)
    alive(engines)
    back_to_serving(orch, engines)


@pytest.mark.parametrize("when", [Fault.SYSTEM_EXIT_BEFORE, Fault.SYSTEM_EXIT_AFTER])
def test_system_exit_inside_one_engines_call_on_a_worker(when: Fault) -> None:
    """SystemExit raised by one engine's release on a ThreadFanOut worker reaches the caller, and the knowledge keeps every call."""
    pool = ThreadFanOut(max_workers=4)
    try:
        engines, orch = make(pool, 3)
        engines[1].arm("release_memory_occupation", when)
        with pytest.raises(SystemExit):
            orch.offload()
        assert orch.states()[engines[1].engine] is EngineState.QUARANTINED
        assert all(orch.states()[e.engine] is EngineState.RELEASED for e in (engines[0], engines[2]))  # answered: known
        back_to_serving(orch, engines)
    finally:
        pool.close()


@pytest.mark.parametrize("broken_after", [0, 1, 2])
def test_a_fan_out_that_raises_part_way_leaves_every_call_maybe(broken_after: int) -> None:
    """A fan-out that sends a release to some engines, then raises: every engine of the phase stays unknown, none is forgotten."""
    inner = SequentialFanOut()

    class Broken:
        armed = True

        def call(self, calls: Any, method: str, deadline: Any) -> Any:
            if method == "release_memory_occupation" and self.armed:
                self.armed = False
                inner.call(list(calls)[:broken_after], method, deadline)
                raise RuntimeError("fan-out broke")
            return inner.call(calls, method, deadline)

    engines = [FakeEngine(f"http://fake-{i}:30000") for i in range(2)]
    orch = Orchestrator(EngineGroup(engines), fanout=Broken(), deadlines=DEADLINES)
    with pytest.raises(RuntimeError, match="broke"):
        orch.offload()
    assert set(orch.quarantined()) == {e.engine for e in engines}
    back_to_serving(orch, engines)


# -- observers are told after the knowledge changed ------------------------------------------------


def _bomb_on_release(seen: list[Event]) -> Any:
    def observer(event: Event) -> None:
        seen.append(event)
        if isinstance(event, PhaseEnded) and event.phase == "release":
            raise Boom("observer")

    return observer


def test_an_observer_raising_a_base_exception_cannot_undo_the_fold(fanout: FanOut) -> None:
    """An observer raising a BaseException when the release phase ends: every engine is already known released, so the
    next onload resumes them all before continuing."""
    seen: list[Event] = []
    engines, orch = make(fanout, 3, observers=[_bomb_on_release(seen)])
    with pytest.raises(Boom):
        orch.offload()
    assert set(orch.states().values()) == {EngineState.RELEASED}
    assert [e for e in seen if isinstance(e, EngineStateChanged)]  # the fold's events came before the phase's end
    orch.observers = ()
    orch.onload()
    alive(engines)
    assert all(e.serving for e in engines)


@pytest.mark.asyncio
async def test_an_observer_raising_a_base_exception_in_the_async_orchestrator() -> None:
    """The same on AsyncOrchestrator: the raising observer interrupts the offload, and the next onload continues nobody early."""
    seen: list[Event] = []
    engines = [AsyncFakeEngine(f"http://fake-{i}:30000") for i in range(3)]
    orch = AsyncOrchestrator(EngineGroup(engines), deadlines=DEADLINES, observers=[_bomb_on_release(seen)])
    with pytest.raises(Boom):
        await orch.offload()
    assert set(orch.states().values()) == {EngineState.RELEASED}
    orch.observers = ()
    await orch.onload()
    assert all(e.serving and e.crash is None for e in engines)


# -- a gateway status after the engine applied is ambiguous ------------------------------------------


def test_release_answered_502_after_it_applied_is_not_rolled_back_onto_released_memory(fanout: FanOut) -> None:
    """A release applied then answered 502: quarantined, so the offload's rollback neither resumes nor continues it."""
    engines, orch = make(fanout)
    engines[0].arm("release_memory_occupation", Fault.APPLIED_THEN_502)
    with pytest.raises(PhaseFailed) as info:
        orch.offload()
    assert info.value.quarantined == (engines[0].engine,) and info.value.rolled_back == (engines[1].engine,)
    alive(engines)
    back_to_serving(orch, engines)


def test_resume_answered_504_after_it_applied_is_not_resumed_again(fanout: FanOut) -> None:
    """A resume applied then answered 504: the next onload skips the engine (a second resume is a KeyError) and names it."""
    engines, orch = make(fanout)
    orch.offload()
    engines[0].arm("resume_memory_occupation", Fault.APPLIED_THEN_504)
    for _ in range(2):
        with pytest.raises(PhaseFailed) as info:
            orch.onload()
        assert info.value.quarantined == (engines[0].engine,)
    assert engines[0].started.count("resume_memory_occupation") == 1
    alive(engines)
    back_to_serving(orch, engines)


def test_continue_answered_502_after_it_applied_is_paused_again_by_the_next_offload(fanout: FanOut) -> None:
    """A continue applied then answered 502: the engine "may be paused", never "paused"; the next offload pauses it again."""
    engines, orch = make(fanout)
    orch.offload()
    engines[0].arm("continue_generation", Fault.APPLIED_THEN_502)
    with pytest.raises(PhaseFailed) as info:
        orch.onload()
    assert "may be paused" in info.value.left_paused[engines[0].engine]
    orch.offload()
    assert all(e.snapshot()[0] and e.snapshot()[2] == ALL for e in engines)
    alive(engines)


def test_a_502_the_proxy_answered_without_forwarding_is_still_maybe(fanout: FanOut) -> None:
    """A 502 that never reached the engine reads the same as one after it: the engine is quarantined, not released again."""
    engines, orch = make(fanout)
    engines[0].arm("release_memory_occupation", Fault.GATEWAY_NOT_FORWARDED)
    with pytest.raises(PhaseFailed) as info:
        orch.offload()
    assert info.value.quarantined == (engines[0].engine,) and not engines[0].released
    back_to_serving(orch, engines)


def test_a_refused_connection_proves_nothing_left_and_names_the_engine_dead(fanout: FanOut) -> None:
    """Every attempt NOT_SENT: not applied (no quarantine) and the engine is named dead until reconciled."""
    engines, orch = make(fanout)
    engines[0].arm("pause_generation", Fault.CONNECTION_REFUSED)
    with pytest.raises(PhaseFailed) as info:
        orch.offload()
    assert info.value.dead == (engines[0].engine,) and not info.value.quarantined
    orch.reconcile(engines[0], released=(), paused=False)
    orch.offload()
    orch.onload()
    alive(engines)


# -- the memory probe --------------------------------------------------------------------------------------------


class TruthProbe:
    """A ``MemoryProbe`` over the fakes' true state; ``blind`` engines get None (cannot prove)."""

    def __init__(self, engines: list[AnyFake]) -> None:
        self.engines = {e.engine: e for e in engines}
        self.blind: set[str] = set()
        self.asked: list[str] = []

    def released_tags(self, engine: str) -> frozenset[str] | None:
        self.asked.append(engine)
        return None if engine in self.blind else self.engines[engine].snapshot()[2]


def test_the_probe_settles_an_ambiguous_release_and_the_offload_keeps_its_promise(fanout: FanOut) -> None:
    """An applied-then-ambiguous release, with a probe: asked right after the fold, it proves the release; offload returns."""
    seen: list[Event] = []
    engines = fakes(fanout)
    probe = TruthProbe(engines)
    orch = Orchestrator(EngineGroup(engines), fanout=fanout, deadlines=DEADLINES, memory_probe=probe, observers=[seen.append])
    engines[0].arm("release_memory_occupation", Fault.AMBIGUOUS_APPLIED)
    orch.offload()
    assert probe.asked == [engines[0].engine] and orch.quarantined() == {}
    changes = [(e.from_state, e.to_state) for e in seen if isinstance(e, EngineStateChanged) and e.engine == engines[0].engine]
    assert changes[-1] == ("flushed", "released")
    orch.onload()
    alive(engines)
    assert all(e.serving for e in engines)


def test_the_probe_says_a_resume_was_not_applied_and_the_next_onload_resumes_it(fanout: FanOut) -> None:
    """An ambiguous resume that was not applied: the probe's "still released" is trusted once the resume can no longer be
    on its way (``in_transit_s``: the resume phase polls the probe through it), and the next onload resumes it."""
    engines = fakes(fanout)
    deadlines = PhaseDeadlines(transition_s=10.0, pause_s=2, flush_s=2, release_s=2, resume_s=2, continue_s=2, in_transit_s=0.1)
    orch = Orchestrator(EngineGroup(engines), fanout=fanout, deadlines=deadlines, memory_probe=TruthProbe(engines))
    orch.offload()
    engines[1].arm("resume_memory_occupation", Fault.AMBIGUOUS_NOT_APPLIED)
    with pytest.raises(PhaseFailed) as info:
        orch.onload()
    assert info.value.quarantined == ()  # "still released" polled through the 0.1 s grace (the resume may have been on its way)
    assert orch.states()[engines[1].engine] == EngineState.RELEASED
    orch.onload()
    alive(engines)
    assert all(e.serving for e in engines)


def test_a_probe_that_cannot_prove_leaves_the_quarantine_until_it_can(fanout: FanOut) -> None:
    """A probe answering None leaves the engine quarantined and named; once it answers, the next transition reconciles it."""
    engines = fakes(fanout)
    probe = TruthProbe(engines)
    probe.blind.add(engines[0].engine)
    orch = Orchestrator(EngineGroup(engines), fanout=fanout, deadlines=DEADLINES, memory_probe=probe)
    engines[0].arm("release_memory_occupation", Fault.AMBIGUOUS_APPLIED)
    with pytest.raises(PhaseFailed) as info:
        orch.offload()
    assert info.value.quarantined == (engines[0].engine,)
    with pytest.raises(PhaseFailed):
        orch.onload()  # still blind: skipped and named
    probe.blind.clear()
    orch.onload()  # asked at the start: reconciled, resumed, continued
    alive(engines)
    assert all(e.serving for e in engines)


def test_a_memory_probe_must_answer_released_tags() -> None:
    """Anything but a MemoryProbe is refused at construction."""
    with pytest.raises(TypeError, match="memory_probe"):
        Orchestrator(EngineGroup([FakeEngine("http://fake-0:30000")]), memory_probe=object())  # type: ignore[arg-type]


# -- the persist hook --------------------------------------------------------------------------------------------


class Journaled(Orchestrator[Any]):
    """Records, at each ``persist`` of the rules it holds, the state of the engines it names (what a journal would write)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.persisted: list[dict[str, EngineState]] = []
        super().__init__(*args, **kwargs)
        rules, write = self.state, self.state.persist

        def persist(names: Collection[str]) -> None:
            self.persisted.append({n: rules.know[n].state for n in names})
            write(names)

        rules.persist = persist  # type: ignore[method-assign]


class Checked(FakeEngine):
    """Checks, when a call arrives, that the orchestrator persisted it in flight first."""

    orch: Journaled | None = None
    seen_in_flight: int = 0

    def _call(self, method: str, apply: Any) -> dict[str, Any]:
        assert self.orch is not None
        last = next(p for p in reversed(self.orch.persisted) if self.engine in p)
        assert last[self.engine] is EngineState.IN_FLIGHT, (method, last)
        self.seen_in_flight += 1
        return super()._call(method, apply)


def test_every_call_is_persisted_in_flight_before_it_is_sent_and_its_outcome_after() -> None:
    """``persist`` is called with the engine marked in flight before each call reaches it, and with what it knows after."""
    engines = [Checked(f"http://fake-{i}:30000") for i in range(2)]
    orch = Journaled(EngineGroup(engines), fanout=SequentialFanOut(), deadlines=DEADLINES)
    for e in engines:
        e.orch = orch
    orch.offload()
    assert orch.persisted[-1] == {e.engine: EngineState.RELEASED for e in engines}
    with pytest.raises(PhaseFailed, match="weights are released"), orch.weight_sync():
        pass
    orch.onload()
    assert orch.persisted[-1] == {e.engine: EngineState.SERVING for e in engines}
    assert all(e.seen_in_flight == 5 for e in engines)  # pause, flush, release; resume, continue (the refused sync sent nothing)
    orch.retire(engines[1])
    assert orch.persisted[-1] == {engines[1].engine: EngineState.SERVING}


# -- construction: refuse what SGLang crashes in, and what cannot be driven ---------------------


def test_reconcile_refuses_paused_false_while_memory_is_released_or_unknown() -> None:
    """released=None keeps released (or unknown) tags: paused=False with them is a state SGLang crashes in, refused."""
    engines = [FakeEngine(f"http://fake-{i}:30000") for i in range(2)]
    orch = Orchestrator(EngineGroup(engines), fanout=SequentialFanOut(), deadlines=DEADLINES)
    orch.offload()
    with pytest.raises(ValueError, match="paused=False"):
        orch.reconcile(engines[0], released=None, paused=False)
    engines[1].arm("resume_memory_occupation", Fault.AMBIGUOUS_APPLIED)
    with pytest.raises(PhaseFailed):
        orch.onload()
    with pytest.raises(ValueError, match="crashes"):
        orch.reconcile(engines[1], released=None, paused=False)
    orch.reconcile(engines[1], released=(), paused=True)
    orch.onload()
    assert all(e.serving for e in engines) and all(e.crash is None for e in engines)


def test_engines_the_orchestrator_cannot_drive_are_refused_at_construction() -> None:
    """Coroutine engines on a thread or sequential fan-out, a missing control method, plain engines on an AsyncOrchestrator,
    a list of engines passed as groups: each refused with an error naming the engine, before anything is sent."""
    async_engine = AsyncFakeEngine("http://fake-async:30000")
    for pool in (ThreadFanOut(max_workers=1), SequentialFanOut()):
        with pytest.raises(TypeError, match=r"fake-async.*coroutine"):
            Orchestrator(EngineGroup([FakeEngine("http://fake-0:30000"), async_engine]), fanout=pool)
    assert async_engine.started == []

    class NoFlush:
        engine = "http://no-flush:30000"

        def pause_generation(self, *, mode: str = "abort") -> None: ...
        def release_memory_occupation(self, *, tags: Any = None) -> None: ...
        def resume_memory_occupation(self, *, tags: Any = None) -> None: ...
        def continue_generation(self, *, torch_empty_cache: bool = True) -> None: ...

    with pytest.raises(TypeError, match=r"no-flush.*flush_cache"):
        Orchestrator(EngineGroup([NoFlush()]))  # type: ignore[list-item]
    with pytest.raises(TypeError, match=r"fake-0.*not a coroutine"):
        AsyncOrchestrator(EngineGroup([FakeEngine("http://fake-0:30000")]))  # type: ignore[list-item]
    with pytest.raises(TypeError, match="EngineGroup"):
        Orchestrator([FakeEngine("http://fake-0:30000")])  # type: ignore[list-item]


class _Counting(http.server.BaseHTTPRequestHandler):
    hits: ClassVar[list[str]] = []

    def do_POST(self) -> None:
        _Counting.hits.append(self.path)
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


def test_ray_fan_out_checks_every_engine_before_it_sends_anything(ray_runtime: Any) -> None:
    """A phase mixing a Ray engine and a plain one raises TypeError naming the plain one, and the Ray engine got nothing;
    the Orchestrator refuses such a group when it is built."""
    from resilience.adapters.ray import RayFanOut, ray_engines
    from resilience.deadline import Deadline

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Counting)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    [ray_engine] = ray_engines([f"http://127.0.0.1:{server.server_address[1]}"])
    plain = FakeEngine("http://fake-plain:30000")
    try:
        with pytest.raises(TypeError, match="fake-plain"):
            RayFanOut().call([(ray_engine, {"mode": "abort"}), (plain, {"mode": "abort"})], "pause_generation", Deadline(10))
        with pytest.raises(TypeError, match="fake-plain"):
            Orchestrator(EngineGroup([ray_engine, plain]), fanout=RayFanOut())
        assert _Counting.hits == [] and plain.started == []
    finally:
        ray_engine.kill()
        server.shutdown()
        server.server_close()
        thread.join(10)
