"""Random control loops with faults on every call: no engine ever dies, a normal return keeps its promise,
every engine not serving is named.

A Hypothesis state machine drives one ``Orchestrator`` over three socket-free
``FakeEngine``s (two offloaded, one in a ``needs_offload=False`` group) with
SGLang's crash semantics, through offload (all tags and some), onload (all and
``weights`` only), weight syncs (plain, nested, from two threads, and with an
offload or onload from another thread during the body), user holds,
reconcile and retire; any call may be armed with a fault (applied then
ambiguous, ambiguous and not applied, refused, late past the phase deadline,
a dead or unavailable Ray actor, applied then a proxy's 502 or 504, a proxy's 502
without forwarding, a refused connection, and a connection dropped right after sending
whose request reaches the engine only later: after the memory probe answered, or
at the engine's next call).

Barrier v3's faults (issue 19) come on top, each followed by more transitions
(the caller keeps going): an interrupt before or after the engine applied a call
(KeyboardInterrupt reaching the caller's thread, SystemExit inside a worker's
call, the awaiting task cancelled), observers that raise a BaseException, and a
fan-out that raises part-way. Two more runs have a memory probe over the fakes'
true state, answering for some engines only, on each orchestrator: a request on
its way arrives right after the probe answered, so a barrier that trusts "not
released" then releases twice.

``CPR_BARRIER_EXAMPLES`` sets the number of examples of each synchronous run
(default 200), ``CPR_BARRIER_ASYNC_EXAMPLES`` those of each async run (default 80).

The same machine runs three ways: ``Orchestrator`` over ``ThreadFanOut`` (the
examples above), ``Orchestrator`` over ``AsyncFanOut`` with ``AsyncFakeEngine``s,
and ``AsyncOrchestrator`` (driven on a loop thread through ``SyncFacade``) with
one more rule: a transition whose awaiting task is cancelled part-way, after
which the knowledge must still be true.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import signal
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
from resilience.barrier.fanout import Calls, EngineResult, SequentialFanOut, ThreadFanOut
from resilience.deadline import Deadline
from resilience.engine_contract import EngineState
from resilience.events import Event
from tests.barrier.async_facade import LoopThread, SyncFacade
from tests.barrier.fake_engine import ALL, AnyFake, AsyncFakeEngine, FakeEngine, Fault

EXAMPLES = int(os.environ.get("CPR_BARRIER_EXAMPLES", "200"))
ASYNC_EXAMPLES = int(os.environ.get("CPR_BARRIER_ASYNC_EXAMPLES", "80"))
DEADLINES = PhaseDeadlines(transition_s=5.0, pause_s=0.02, flush_s=0.02, release_s=0.02, resume_s=0.02, continue_s=0.02, in_transit_s=0.1)
"""Tiny phase limits: a "late" fault costs one phase limit of waiting; transitions get 5 s (exclusion waits). A request
that may be on its way has 0.1 s of grace: far more than the fold takes to ask the probe under load (a delivery lands at
that first question), and more than the phase and settle limits, so a phase or a transition's start polls the probe only
up to its own limit (the engine stays quarantined till the grace passed or the probe proved it applied)."""
APPLY_AFTER_S = 0.01
"""How long after its answer a ``Fault.APPLIES_LATER`` call is applied: well within the grace (a call applied after the
grace passed is what the grace assumes never happens)."""
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
    Fault.APPLIED_THEN_502: 2,
    Fault.APPLIED_THEN_504: 1,
    Fault.GATEWAY_NOT_FORWARDED: 1,
    Fault.CONNECTION_REFUSED: 1,
    Fault.DELIVERED_LATE: 2,
    Fault.APPLIES_LATER: 2,
}
FAULTS = st.lists(
    st.tuples(
        st.sampled_from([0, 1, 0, 1, 2]),
        st.sampled_from([m for m, w in zip(METHODS, _METHOD_WEIGHTS, strict=True) for _ in range(w)]),
        st.sampled_from([f for f, w in _FAULT_WEIGHTS.items() for _ in range(w)]),
    ),
    max_size=3,
).map(lambda faults: {(i, method): fault for i, method, fault in faults})
_PROMPT = {f: w for f, w in _FAULT_WEIGHTS.items() if f not in (Fault.LATE_APPLIED, Fault.LATE_FAILED)}
PROMPT_FAULTS = st.lists(
    st.tuples(
        st.sampled_from([0, 1, 0, 1, 2]),
        st.sampled_from([m for m, w in zip(METHODS, _METHOD_WEIGHTS, strict=True) for _ in range(w)]),
        st.sampled_from([f for f, w in _PROMPT.items() for _ in range(w)]),
    ),
    max_size=3,
).map(lambda faults: {(i, method): fault for i, method, fault in faults})
"""FAULTS without late calls: for a fan-out that raises and loses its late handles (no barrier can wait for those)."""
TRANSITIONS = st.sampled_from(["offload", "onload", "onload_weights", "weight_sync", "step", "pause"])
METHODS_OF = {
    "offload": ("pause_generation", "flush_cache", "release_memory_occupation"),
    "onload": ("resume_memory_occupation", "continue_generation"),
    "onload_weights": ("resume_memory_occupation", "continue_generation"),
    "weight_sync": ("pause_generation", "continue_generation"),
    "step": METHODS,
    "pause": ("pause_generation",),
}
"""The calls each transition may send: where an interrupt fault is placed, so that it fires."""


class Boom(BaseException):
    """What a misbehaving observer raises: not an ``Exception``, so ``emit`` does not swallow it."""


class FanOutBroke(RuntimeError):
    """What ``FlakyFanOut`` raises part-way."""


class FlakyFanOut:
    """A fan-out that, when armed, sends the phase to its first ``k`` calls (through ``inner``), then raises and loses the answers."""

    def __init__(self, inner: ThreadFanOut | SequentialFanOut) -> None:
        self.inner = inner
        self.armed: int | None = None

    def call(self, calls: Calls, method: str, deadline: Deadline) -> list[EngineResult]:
        k, self.armed = self.armed, None
        if k is None:
            return self.inner.call(calls, method, deadline)
        if k:
            self.inner.call(list(calls)[:k], method, deadline)
        raise FanOutBroke(f"fan-out broke after sending {method} to {min(k, len(calls))} of {len(calls)} engines")

    def close(self) -> None:
        if isinstance(self.inner, ThreadFanOut):
            self.inner.close()


class TruthProbe:
    """A ``MemoryProbe`` over the fakes' true state, answering only for the engines in ``answers`` (None for the others)."""

    def __init__(self, engines: list[AnyFake]) -> None:
        self.engines = {e.engine: e for e in engines}
        self.answers: set[str] = set()
        self.asked = 0

    def released_tags(self, engine: str) -> frozenset[str] | None:
        self.asked += 1
        fake = self.engines[engine]
        released = None if engine not in self.answers else fake.snapshot()[2]
        # A request on its way arrives just after the first question about it (the race the grace waits out): its
        # delivery takes a bounded time, and the barrier asks right after the fold that starts the grace.
        fake.deliver()
        return released


INTERRUPTED_BY = (KeyboardInterrupt, SystemExit, asyncio.CancelledError, concurrent.futures.CancelledError, Boom, FanOutBroke)
"""What a rule with an interrupt catches (a transition that returned or raised PhaseFailed is checked as usual)."""

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
        self.fanout: Any = FlakyFanOut(ThreadFanOut(max_workers=32))
        self.bomb: tuple[int, type[BaseException]] | None = None
        """Armed by ``observer_raises``: the observer raises this after so many more events."""
        self.interrupted = 0
        signal.signal(signal.SIGINT, signal.default_int_handler)
        self.orch: Any = Orchestrator(self.groups(), fanout=self.fanout, deadlines=DEADLINES, observers=[self.observe])
        self.in_transition = False
        """True while the rule that draws interrupts runs its first transition: only then may a hook interrupt the caller
        (a late call's hook firing later would interrupt the test itself)."""
        self.use_hook(self.signal_main)
        self.retired: set[str] = set()
        self.tokens: list[HoldToken | None] = []
        """One entry per ``pause`` rule run, None when it failed: preconditions must not depend on timing
        (a 20 ms phase limit missed under load), or hypothesis sees the same choices take two paths."""
        self.threads: list[threading.Thread] = []
        self.failures: list[str] = []

    INTERRUPTS: tuple[Fault, ...] = (Fault.INTERRUPT_BEFORE, Fault.INTERRUPT_AFTER, Fault.SYSTEM_EXIT_BEFORE, Fault.SYSTEM_EXIT_AFTER)
    """The interrupt faults this machine draws (KeyboardInterrupt to the main thread, SystemExit in a worker)."""
    BOMBS: tuple[type[BaseException], ...] = (Boom, KeyboardInterrupt)
    """What its observers may raise."""

    # -- helpers ------------------------------------------------------------------------------

    def signal_main(self) -> None:
        """An interrupt hook: Ctrl-C reaches the caller's (main) thread; raised in place when the call runs there."""
        if threading.current_thread() is threading.main_thread():
            raise KeyboardInterrupt("interrupted in the main thread")
        if self.in_transition:
            signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)

    def cancel_transition(self) -> None:
        """An interrupt hook for ``AsyncOrchestrator``: cancel the task awaiting the transition."""
        if self.in_transition and isinstance(self.orch, SyncFacade):
            self.orch.cancel_current()

    def use_hook(self, hook: Any) -> None:
        for e in self.engines:
            e.interrupt = hook

    def observe(self, event: Event) -> None:
        """The orchestrator's observer: raises when ``observer_raises`` armed it."""
        if self.bomb is not None:
            left, kind = self.bomb
            self.bomb = (left - 1, kind) if left else None
            if not left:
                raise kind(f"observer raised on {type(event).__name__}")

    def transition(self, which: str) -> None:
        """One transition (or the docs' colocate step, docs/barrier.md); a PhaseFailed is checked, an interruption propagates."""
        try:
            if which == "offload":
                self.orch.offload()
            elif which == "onload":
                self.orch.onload()
            elif which == "onload_weights":
                self.orch.onload(tags=["weights"])
            elif which == "weight_sync":
                with self.orch.weight_sync():
                    self.body("interrupted sync")
            elif which == "pause":
                if len(self.tokens) < 2:
                    report = self.orch.pause("user")
                    self.tokens.append(report.hold)
            else:
                self.orch.offload()
                self.orch.onload(tags=["weights"])
                with self.orch.weight_sync():
                    self.body("interrupted step")
                self.orch.onload()
        except PhaseFailed as err:
            self.check_named(err)
        except BarrierBusy:
            pass

    def interrupted_then_go_on(self, which: str, then: str, faults: Mapping[tuple[int, str], Fault]) -> str:
        """Run ``which`` with ``faults`` armed, expecting an interruption, then keep going with ``then`` (nothing armed);
        return how the first one ended."""
        with self.armed(faults):
            try:
                self.in_transition = True
                self.transition(which)
                outcome = "finished"
            except INTERRUPTED_BY as exc:
                outcome = type(exc).__name__
                self.interrupted += 1
            finally:
                self.in_transition = False
                self.bomb = None
                if isinstance(self.fanout, FlakyFanOut):
                    self.fanout.armed = None
        self.settle_interrupts()
        self.transition(then)  # the caller keeps going: the next transition must not kill an engine either
        return outcome

    def settle_interrupts(self) -> None:
        """Nothing to do for threads: a KeyboardInterrupt was raised where the signal reached the main thread."""

    def groups(self) -> list[EngineGroup[Any]]:
        """Engines 0 and 1 offloaded, engine 2 in a needs_offload=False group."""
        return [EngineGroup(self.engines[:2]), EngineGroup(self.engines[2:], needs_offload=False)]

    def active(self, offloaded_only: bool = False) -> list[AnyFake]:
        engines = self.engines[:2] if offloaded_only else self.engines
        return [e for e in engines if e.engine not in self.retired]

    @contextmanager
    def armed(self, faults: Mapping[tuple[int, str], Fault]) -> Iterator[None]:
        for (i, method), fault in faults.items():
            self.engines[i].apply_after_s = APPLY_AFTER_S
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
        """One training step as docs/barrier.md's recipe writes it: offload, onload weights, weight sync, onload the rest."""
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
        if not e.wait_idle(0):  # a call is still being carried out: what the caller reads now may change under it
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

    @rule(which=TRANSITIONS, then=TRANSITIONS, i=st.sampled_from([0, 1, 0, 1, 2]), how=st.data(), faults=FAULTS)
    def interrupted(self, which: str, then: str, i: int, how: st.DataObject, faults: dict[tuple[int, str], Fault]) -> None:
        """An interrupt before or after one engine applied one call, with other faults; then the caller keeps going."""
        method = how.draw(st.sampled_from(METHODS_OF[which]), label="method")
        interrupt = how.draw(st.sampled_from(self.INTERRUPTS), label="interrupt")
        outcome = self.interrupted_then_go_on(which, then, {**faults, (i, method): interrupt})
        event(f"interrupted {which} ({interrupt}): {outcome}")

    @rule(which=TRANSITIONS, then=TRANSITIONS, after=st.integers(0, 14), how=st.data(), faults=FAULTS)
    def observer_raises(self, which: str, then: str, after: int, how: st.DataObject, faults: dict[tuple[int, str], Fault]) -> None:
        """An observer raises a BaseException on some event of a transition; then the caller keeps going."""
        self.bomb = (after, how.draw(st.sampled_from(self.BOMBS), label="bomb"))
        outcome = self.interrupted_then_go_on(which, then, faults)
        event(f"observer raised in {which}: {outcome}")

    @rule(which=TRANSITIONS, then=TRANSITIONS, k=st.integers(0, 3), faults=PROMPT_FAULTS)
    def fanout_raises(self, which: str, then: str, k: int, faults: dict[tuple[int, str], Fault]) -> None:
        """The fan-out sends a phase to its first ``k`` engines, then raises (losing the answers); then the caller keeps going."""
        if not isinstance(self.fanout, FlakyFanOut):
            return
        self.fanout.armed = k
        outcome = self.interrupted_then_go_on(which, then, faults)
        event(f"fan-out raised in {which}: {outcome}")

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


class SequentialMachine(BarrierMachine):
    """The same machine over ``SequentialFanOut``: every call runs on the caller's (main) thread, where interrupts are raised.

    No late faults: a call that blocks blocks the caller itself (no phase deadline can cut it short there).
    """

    @contextmanager
    def armed(self, faults: Mapping[tuple[int, str], Fault]) -> Iterator[None]:
        with super().armed({k: f for k, f in faults.items() if f not in (Fault.LATE_APPLIED, Fault.LATE_FAILED)}):
            yield

    def __init__(self) -> None:
        super().__init__()
        self.fanout.close()
        self.fanout = FlakyFanOut(SequentialFanOut())
        self.orch = Orchestrator(self.groups(), fanout=self.fanout, deadlines=DEADLINES, observers=[self.observe])


SequentialMachine.TestCase.settings = settings(max_examples=EXAMPLES, **SETTINGS)  # type: ignore[arg-type]
TestBarrierPropertiesSequential = SequentialMachine.TestCase


class ProbeMachine(BarrierMachine):
    """The thread machine with a ``MemoryProbe`` over the fakes' true state, answering only for the engines a rule picked."""

    def __init__(self) -> None:
        super().__init__()
        self.probe = TruthProbe(self.engines)
        self.orch = Orchestrator(self.groups(), fanout=self.fanout, deadlines=DEADLINES, observers=[self.observe], memory_probe=self.probe)

    @rule(i=st.integers(0, 2), answers=st.booleans())
    def probe_answers(self, i: int, answers: bool) -> None:
        """The probe can (or can no longer) prove engine ``i``'s memory."""
        (self.probe.answers.add if answers else self.probe.answers.discard)(self.engines[i].engine)

    @rule(i=st.integers(0, 1), faults=FAULTS)
    def probe_lifts_the_quarantine(self, i: int, faults: dict[tuple[int, str], Fault]) -> None:
        """Once the probe can prove engine ``i``'s memory, the next transition reconciles it: it is no longer quarantined
        (unless a call to it is still in flight), with no human in the loop."""
        name = self.engines[i].engine
        was = name in self.orch.quarantined()
        self.probe.answers.add(name)
        with self.armed(faults):
            self.transition("onload")
        why = self.orch.not_serving().get(name, "")
        if self.orch.states().get(name) is not EngineState.IN_FLIGHT and "on its way" not in why:  # this onload's own doubt waits
            assert name not in self.orch.quarantined(), (name, self.orch.not_serving())
        event(f"probe: {'lifted a quarantine' if was else 'nothing quarantined'}")


ProbeMachine.TestCase.settings = settings(max_examples=EXAMPLES, **SETTINGS)  # type: ignore[arg-type]
TestBarrierPropertiesWithProbe = ProbeMachine.TestCase


class AsyncFanOutMachine(BarrierMachine):
    """The same machine: ``Orchestrator`` over ``AsyncFanOut``, engines with coroutine calls (Ctrl-C reaches the main thread)."""

    INTERRUPTS = (Fault.INTERRUPT_BEFORE, Fault.INTERRUPT_AFTER)  # a SystemExit on the loop thread would stop the loop itself

    def __init__(self) -> None:
        super().__init__()
        self.fanout.close()
        self.engines = [AsyncFakeEngine(f"http://fake-{i}:30000") for i in range(3)]
        self.use_hook(self.signal_main)
        self.fanout = AsyncFanOut()
        self.orch = Orchestrator(self.groups(), fanout=self.fanout, deadlines=DEADLINES, observers=[self.observe])


AsyncFanOutMachine.TestCase.settings = settings(max_examples=ASYNC_EXAMPLES, **SETTINGS)  # type: ignore[arg-type]
TestBarrierPropertiesAsyncFanOut = AsyncFanOutMachine.TestCase


class AsyncOrchestratorMachine(BarrierMachine):
    """The same machine on ``AsyncOrchestrator`` (through ``SyncFacade``), plus transitions cancelled part-way."""

    def __init__(self) -> None:
        super().__init__()
        self.fanout.close()
        self.engines = [AsyncFakeEngine(f"http://fake-{i}:30000") for i in range(3)]
        self.loop = LoopThread()
        self.async_orch = AsyncOrchestrator(self.groups(), deadlines=DEADLINES, observers=[self.observe])
        self.orch = SyncFacade(self.async_orch, self.loop)
        self.use_hook(self.cancel_transition)  # an interrupt cancels the task awaiting the transition

    INTERRUPTS = (Fault.INTERRUPT_BEFORE, Fault.INTERRUPT_AFTER)
    BOMBS = (Boom,)  # a KeyboardInterrupt raised on the loop thread would stop the loop, not the transition

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


class AsyncOrchestratorProbeMachine(AsyncOrchestratorMachine):
    """``AsyncOrchestrator`` with the memory probe over the fakes' true state (the race of a request on its way, awaited)."""

    def __init__(self) -> None:
        super().__init__()
        self.probe = TruthProbe(self.engines)
        self.async_orch = AsyncOrchestrator(self.groups(), deadlines=DEADLINES, observers=[self.observe], memory_probe=self.probe)
        self.orch = SyncFacade(self.async_orch, self.loop)

    probe_answers = ProbeMachine.probe_answers
    probe_lifts_the_quarantine = ProbeMachine.probe_lifts_the_quarantine


AsyncOrchestratorProbeMachine.TestCase.settings = settings(max_examples=ASYNC_EXAMPLES, **SETTINGS)  # type: ignore[arg-type]
TestBarrierPropertiesAsyncOrchestratorWithProbe = AsyncOrchestratorProbeMachine.TestCase
