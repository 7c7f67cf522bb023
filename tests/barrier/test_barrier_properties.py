"""Random control loops with faults on every call: no engine ever dies, a normal return keeps its promise,
every engine not serving is named.

A Hypothesis state machine drives one ``Orchestrator`` over three socket-free
``FakeEngine``s (two offloaded, one in a ``needs_offload=False`` group) with
SGLang's crash semantics, through offload (all tags and some), onload (all and
``weights`` only), weight syncs (plain, nested, from two threads, and with an
offload or onload from another thread during the body), user holds,
reconcile and retire; any call may be armed with a fault (applied then
ambiguous, ambiguous and not applied, refused, late past the phase deadline,
a dead or unavailable Ray actor). ``CPR_BARRIER_EXAMPLES`` sets the number of
examples (default 500).

The same machine runs three ways: ``Orchestrator`` over ``ThreadFanOut`` (the
examples above), ``Orchestrator`` over ``AsyncFanOut`` with ``AsyncFakeEngine``s,
and ``AsyncOrchestrator`` (driven on a loop thread through ``SyncFacade``) with
one more rule: a transition whose awaiting task is cancelled part-way, after
which the knowledge must still be true. ``CPR_BARRIER_ASYNC_EXAMPLES`` sets the
examples of each async run (default 200).
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from resilience.barrier import AsyncOrchestrator, BarrierBusy, EngineGroup, HoldToken, Orchestrator, PhaseDeadlines, PhaseFailed
from resilience.barrier.async_fanout import AsyncFanOut
from resilience.barrier.fanout import ThreadFanOut
from resilience.barrier.knowledge import EngineState
from tests.barrier.async_facade import LoopThread, SyncFacade
from tests.barrier.fake_engine import ALL, AnyFake, AsyncFakeEngine, FakeEngine, Fault

EXAMPLES = int(os.environ.get("CPR_BARRIER_EXAMPLES", "500"))
ASYNC_EXAMPLES = int(os.environ.get("CPR_BARRIER_ASYNC_EXAMPLES", "200"))
DEADLINES = PhaseDeadlines(transition_s=5.0, pause_s=0.02, flush_s=0.02, release_s=0.02, resume_s=0.02, continue_s=0.02)
"""Tiny phase limits: a "late" fault costs one phase limit of waiting; transitions get 5 s (exclusion waits)."""
METHODS = ("pause_generation", "flush_cache", "release_memory_occupation", "resume_memory_occupation", "continue_generation")
_METHOD_WEIGHTS = (1, 1, 3, 3, 2)
_FAULT_WEIGHTS = {
    Fault.AMBIGUOUS_APPLIED: 3,
    Fault.AMBIGUOUS_NOT_APPLIED: 2,
    Fault.FAILED: 2,
    Fault.LATE_APPLIED: 1,
    Fault.LATE_FAILED: 1,
    Fault.ACTOR_DIED: 1,
    Fault.ACTOR_UNAVAILABLE: 1,
}
FAULTS = st.lists(
    st.tuples(
        st.sampled_from([0, 1, 0, 1, 2]),
        st.sampled_from([m for m, w in zip(METHODS, _METHOD_WEIGHTS, strict=True) for _ in range(w)]),
        st.sampled_from([f for f, w in _FAULT_WEIGHTS.items() for _ in range(w)]),
    ),
    max_size=3,
).map(lambda faults: {(i, method): fault for i, method, fault in faults})
"""Per rule: which engine's next call of which method goes wrong, and how. Weighted towards the calls that kill an
engine when repeated (release, resume), towards the offloaded engines 0 and 1, and towards "applied, then ambiguous";
"late" faults cost a phase limit of real time, so they are drawn less."""
OFFLOAD_TAGS = st.sampled_from([None, ("kv_cache",), ("kv_cache", "cuda_graph"), ("weights",), ("kv_cache", "weights", "cuda_graph")])
ONLOAD_TAGS = st.sampled_from([None, ("weights",), ("kv_cache",)])
MODES = st.sampled_from(["abort", "retract"])
SYNC_MODES = st.sampled_from(["abort", "retract", "in_place"])


class BarrierMachine(RuleBasedStateMachine):
    """One orchestrator, three fake engines, faults on any call."""

    def __init__(self) -> None:
        super().__init__()
        self.engines: list[AnyFake] = [FakeEngine(f"http://fake-{i}:30000") for i in range(3)]
        self.fanout: ThreadFanOut | AsyncFanOut = ThreadFanOut(max_workers=32)
        self.orch: Any = Orchestrator(self.groups(), fanout=self.fanout, deadlines=DEADLINES)
        self.retired: set[str] = set()
        self.tokens: list[HoldToken | None] = []
        """One entry per ``pause`` rule run, None when it failed: preconditions must not depend on timing
        (a 20 ms phase limit missed under load), or hypothesis sees the same choices take two paths."""
        self.threads: list[threading.Thread] = []
        self.failures: list[str] = []

    # -- helpers ------------------------------------------------------------------------------

    def groups(self) -> list[EngineGroup[Any]]:
        """Engines 0 and 1 offloaded, engine 2 in a needs_offload=False group."""
        return [EngineGroup(self.engines[:2]), EngineGroup(self.engines[2:], needs_offload=False)]

    def active(self, offloaded_only: bool = False) -> list[AnyFake]:
        engines = self.engines[:2] if offloaded_only else self.engines
        return [e for e in engines if e.engine not in self.retired]

    @contextmanager
    def armed(self, faults: Mapping[tuple[int, str], Fault]) -> Iterator[None]:
        for (i, method), fault in faults.items():
            self.engines[i].arm(method, fault)
        try:
            yield
        finally:
            for e in self.engines:
                e.disarm()

    def check_named(self, err: PhaseFailed) -> None:
        """Every engine not serving is named in ``left_paused``; failures name real engines."""
        assert err.failures, err
        for e in self.active():
            if not e.serving:
                assert e.engine in err.left_paused, f"{e.engine} is not serving ({e.snapshot()}) but not named: {err}"
        assert set(err.quarantined) <= set(err.left_paused) and set(err.dead) <= set(err.left_paused)

    def push(self) -> None:
        """Push weights to every engine whose weights the orchestrator says are in memory (a trainer would ask it)."""
        for e in self.active():
            if "weights" not in self.orch.released_tags(e):
                e.push_weights()

    def body(self, tag: str) -> None:
        """A weight sync body: every engine it was given is paused (checked by ``push_weights``)."""
        for e in self.active():
            e.sync_bodies += 1
        try:
            self.push()
        finally:
            for e in self.active():
                e.sync_bodies -= 1

    def unheld_serve(self) -> None:
        """After a hold ends normally, each engine is serving or still held by someone."""
        held = self.orch.held()
        for e in self.active():
            if e.engine not in held:
                assert e.serving, f"{e.engine} is not held yet not serving: {e.snapshot()}"

    # -- rules ----------------------------------------------------------------------------------

    @rule(tags=OFFLOAD_TAGS, mode=MODES, faults=FAULTS)
    def offload(self, tags: tuple[str, ...] | None, mode: Any, faults: dict[tuple[int, str], Fault]) -> None:
        with self.armed(faults):
            try:
                self.orch.offload(tags, mode)
            except PhaseFailed as err:
                self.check_named(err)
                return
        wanted = set(tags) if tags else set(ALL)
        for e in self.active(offloaded_only=True):
            paused, _, released = e.snapshot()
            assert paused and wanted <= released, f"offload returned but {e.engine} is paused={paused} released={sorted(released)}"

    @rule(faults=FAULTS)
    def colocate_step(self, faults: dict[tuple[int, str], Fault]) -> None:
        """One training step as the README's recipe writes it: offload, onload weights, weight sync, onload the rest."""
        with self.armed(faults):
            try:
                self.orch.offload()
                self.orch.onload(tags=["weights"])
                with self.orch.weight_sync():
                    self.body("step")
                report = self.orch.onload()
            except PhaseFailed as err:
                self.check_named(err)
                return
        for e in self.active(offloaded_only=True):
            assert e.serving or e.engine in report.held, f"the step returned but {e.engine} is not serving: {e.snapshot()}"

    @rule(tags=ONLOAD_TAGS, faults=FAULTS)
    def onload(self, tags: tuple[str, ...] | None, faults: dict[tuple[int, str], Fault]) -> None:
        with self.armed(faults):
            try:
                report = self.orch.onload(tags)
            except PhaseFailed as err:
                self.check_named(err)
                return
        for e in self.active(offloaded_only=True):
            assert e.serving or e.engine in report.held, f"onload returned but {e.engine} neither serves nor is named held: {e.snapshot()}"
            if tags is None:
                assert not e.snapshot()[2], f"onload of everything returned but {e.engine} still has memory released"

    @rule(mode=SYNC_MODES, faults=FAULTS)
    def weight_sync(self, mode: Any, faults: dict[tuple[int, str], Fault]) -> None:
        with self.armed(faults):
            try:
                with self.orch.weight_sync(mode):
                    self.body("sync")
            except PhaseFailed as err:
                self.check_named(err)
                return
        self.unheld_serve()

    @rule(faults=FAULTS)
    def nested_weight_sync(self, faults: dict[tuple[int, str], Fault]) -> None:
        with self.armed(faults):
            try:
                with self.orch.weight_sync():
                    with self.orch.weight_sync("in_place"):
                        self.body("inner")
                    self.body("outer, after the inner sync ended")  # defect 5: the inner exit must not reopen admission
            except PhaseFailed as err:
                self.check_named(err)
                return
        self.unheld_serve()

    @rule(faults=FAULTS)
    def two_threads_weight_sync(self, faults: dict[tuple[int, str], Fault]) -> None:
        """Thread A's body runs across thread B's whole sync: B's exit must not reopen admission under A."""
        a_in, b_done = threading.Event(), threading.Event()
        outcome: list[BaseException | None] = []

        def a() -> None:
            try:
                with self.orch.weight_sync():
                    a_in.set()
                    b_done.wait(5)
                    self.body("A after B ended")
            except PhaseFailed as err:
                try:
                    if not a_in.is_set():  # failed on entry: B has not started, the engines are as the error saw them
                        self.check_named(err)
                    outcome.append(None)
                except BaseException as exc:  # reported below, on the test's thread
                    outcome.append(exc)
            except BaseException as exc:
                outcome.append(exc)
            else:
                outcome.append(None)
            finally:
                a_in.set()

        with self.armed(faults):
            thread = threading.Thread(target=a, name="sync-A")
            thread.start()
            a_in.wait(5)
            try:
                with self.orch.weight_sync():
                    self.body("B")
            except PhaseFailed as err:
                self.check_named(err)
            finally:
                b_done.set()
                thread.join(10)
        assert not thread.is_alive()
        if outcome[0] is not None:
            raise outcome[0]

    @rule(onload=st.booleans(), faults=FAULTS)
    def transition_during_sync(self, onload: bool, faults: dict[tuple[int, str], Fault]) -> None:
        """An offload/onload from another thread while a weight sync body runs waits for the body (never runs inside it)."""
        in_body, go = threading.Event(), threading.Event()
        errors: list[BaseException] = []

        def other() -> None:
            in_body.wait(5)
            timer = threading.Timer(0.002, go.set)
            timer.start()
            try:
                self.orch.onload() if onload else self.orch.offload()
            except (PhaseFailed, BarrierBusy) as exc:
                errors.append(exc)
            finally:
                timer.cancel()
                go.set()

        with self.armed(faults):
            thread = threading.Thread(target=other, name="transition")
            thread.start()
            try:
                with self.orch.weight_sync():
                    for e in self.active():
                        e.sync_bodies += 1
                    in_body.set()
                    go.wait(5)
                    self.push()
                    for e in self.active():
                        e.sync_bodies -= 1
            except PhaseFailed as err:
                # The other thread's transition may run between this error and a check against the engines (it
                # waited for exactly this body to end), so the error is checked on its own; the invariants compare
                # the orchestrator's names with the engines once both threads are done.
                assert err.failures and set(err.left_paused) <= {e.engine for e in self.engines}, err
            finally:
                in_body.set()
                thread.join(10)
        assert not thread.is_alive()
        for exc in errors:
            if isinstance(exc, PhaseFailed):
                assert exc.failures

    @rule(faults=FAULTS)
    def user_pause(self, faults: dict[tuple[int, str], Fault]) -> None:
        if len(self.tokens) >= 2:  # a no-op, not a precondition: the draws stay the same when a replay's timing differs
            return
        with self.armed(faults):
            try:
                report = self.orch.pause("user")
            except PhaseFailed as err:
                self.check_named(err)
                self.tokens.append(None)
                return
        assert report.hold is not None
        self.tokens.append(report.hold)
        for e in self.active():
            assert e.snapshot()[0], f"pause returned but {e.engine} is not paused"

    @rule(faults=FAULTS)
    def user_unpause(self, faults: dict[tuple[int, str], Fault]) -> None:
        if not self.tokens:
            return
        token = self.tokens.pop(0)
        if token is None:  # that pause failed: it holds nothing
            return
        with self.armed(faults):
            try:
                self.orch.unpause(token)
            except PhaseFailed as err:
                self.check_named(err)
                return
        self.unheld_serve()

    @rule(i=st.integers(0, 2))
    def reconcile(self, i: int) -> None:
        """The caller checks the engine (here: reads the fake) and tells the orchestrator."""
        e = self.engines[i]
        if e.engine in self.retired:
            with pytest.raises(ValueError, match="retired"):
                self.orch.reconcile(e, released=(), paused=False)
            return
        paused, _, released = e.snapshot()
        try:
            self.orch.reconcile(e, released=released, paused=paused)
        except RuntimeError as err:
            assert "still running" in str(err)
            return
        assert self.orch.released_tags(e) == released and e.engine not in self.orch.quarantined()

    @rule(i=st.integers(0, 2))
    def retire(self, i: int) -> None:
        if len(self.retired) >= 2 and self.engines[i].engine not in self.retired:
            return
        self.orch.retire(self.engines[i])
        self.retired.add(self.engines[i].engine)

    @rule()
    def late_calls_land(self) -> None:
        for e in self.engines:
            e.land()

    # -- invariants --------------------------------------------------------------------------------

    @invariant()
    def no_engine_crashed(self) -> None:
        for e in self.engines:
            fired, e.fired = e.fired, []
            for what in fired:
                event(what)
            assert e.crash is None, f"{e.engine} crashed: {e.crash}"
            assert not e.violations, f"{e.engine}: {e.violations}"

    @invariant()
    def every_engine_not_serving_is_named(self) -> None:
        """At any time, not only in a ``PhaseFailed``: an engine that does not serve is in ``not_serving()``."""
        named = self.orch.not_serving()
        for e in self.active():
            if not e.serving:
                assert e.engine in named, f"{e.engine} is not serving ({e.snapshot()}) but the orchestrator does not say so"

    @invariant()
    def knowledge_matches_the_engines(self) -> None:
        """Whatever the orchestrator says it knows is true (engines with a call in flight excepted)."""
        states = self.orch.states()
        quarantined = self.orch.quarantined()
        for e in self.active():
            state = states[e.engine]
            if state in (EngineState.IN_FLIGHT, EngineState.DEAD, EngineState.UNKNOWN):
                continue
            paused, flushed, released = e.snapshot()
            known = self.orch.released_tags(e)
            assert known <= released <= known | quarantined.get(e.engine, frozenset()), (e.engine, state, known, released)
            if state is EngineState.SERVING:
                assert not paused, (e.engine, state)
            elif state is not EngineState.QUARANTINED:
                assert paused, (e.engine, state)
            if state is EngineState.FLUSHED:
                assert flushed, (e.engine, state)

    def teardown(self) -> None:
        for e in self.engines:
            e.land()
        for thread in self.threads:
            thread.join(10)
        self.fanout.close()


SETTINGS = {
    "stateful_step_count": 12,
    "deadline": None,
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.filter_too_much],
}
BarrierMachine.TestCase.settings = settings(max_examples=EXAMPLES, **SETTINGS)  # type: ignore[arg-type]
TestBarrierProperties = BarrierMachine.TestCase


class AsyncFanOutMachine(BarrierMachine):
    """The same machine: ``Orchestrator`` over ``AsyncFanOut``, engines with coroutine calls."""

    def __init__(self) -> None:
        super().__init__()
        self.fanout.close()
        self.engines = [AsyncFakeEngine(f"http://fake-{i}:30000") for i in range(3)]
        self.fanout = AsyncFanOut()
        self.orch = Orchestrator(self.groups(), fanout=self.fanout, deadlines=DEADLINES)


AsyncFanOutMachine.TestCase.settings = settings(max_examples=ASYNC_EXAMPLES, **SETTINGS)  # type: ignore[arg-type]
TestBarrierPropertiesAsyncFanOut = AsyncFanOutMachine.TestCase


class AsyncOrchestratorMachine(BarrierMachine):
    """The same machine on ``AsyncOrchestrator`` (through ``SyncFacade``), plus transitions cancelled part-way."""

    def __init__(self) -> None:
        super().__init__()
        self.fanout.close()
        self.engines = [AsyncFakeEngine(f"http://fake-{i}:30000") for i in range(3)]
        self.loop = LoopThread()
        self.async_orch = AsyncOrchestrator(self.groups(), deadlines=DEADLINES)
        self.orch = SyncFacade(self.async_orch, self.loop)

    @rule(
        which=st.sampled_from(["offload", "onload", "weights_onload", "weight_sync", "step"]),
        ticks=st.integers(0, 12),
        faults=FAULTS,
    )
    def cancelled_transition(self, which: str, ticks: int, faults: dict[tuple[int, str], Fault]) -> None:
        """The task awaiting a transition is cancelled after ``ticks`` loop turns: whatever it sent stays known or in flight."""
        orch = self.async_orch

        async def transition() -> None:
            if which == "offload":
                await orch.offload()
            elif which == "onload":
                await orch.onload()
            elif which == "weights_onload":
                await orch.onload(tags=["weights"])
            elif which == "weight_sync":
                async with orch.weight_sync():
                    self.body("cancelled sync")
            else:
                await orch.offload()
                await orch.onload(tags=["weights"])
                async with orch.weight_sync():
                    self.body("cancelled step")
                await orch.onload()

        async def cancel_after() -> str:
            task = asyncio.create_task(transition())
            for _ in range(ticks):
                await asyncio.sleep(0)
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                return "cancelled"
            except (PhaseFailed, BarrierBusy) as err:
                return type(err).__name__
            return "finished"

        with self.armed(faults):
            outcome = self.loop.run(cancel_after())
        in_flight = sum(state is EngineState.IN_FLIGHT for state in self.orch.states().values())
        event(f"{which}: {outcome}" + (", a call in flight" if in_flight else ""))

    def teardown(self) -> None:
        super().teardown()
        self.loop.close()


AsyncOrchestratorMachine.TestCase.settings = settings(max_examples=ASYNC_EXAMPLES, **SETTINGS)  # type: ignore[arg-type]
TestBarrierPropertiesAsyncOrchestrator = AsyncOrchestratorMachine.TestCase
