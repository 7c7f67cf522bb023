"""Random membership changes between and inside transitions, with the ambiguous faults drawn: no engine dies, none is
continued before it was verified, no joined engine counts before it reached the group's state.

A Hypothesis state machine drives one orchestrator over socket-free fakes (``JoinFake``: SGLang 0.5.23's crash rules,
``fake_engine.py``, plus ``/ready`` and ``/model_info``) in one offloaded group, through offload and onload (and
both with ``min_engines=1``: partial progress, which fences the engines it cannot prove), while engines are added
(some with the wrong weights), restarted at their URL (the old process killed: its
calls refused from then on; the fresh one added again) and retired, at random points; any call, a joining engine's
included, may be armed with a fault (applied then ambiguous, ambiguous and not applied, refused, a proxy's 502 or 504,
not forwarded, a refused connection, a dead actor, late past the phase deadline). It runs on threads (``Orchestrator``
over ``ThreadFanOut``) and on one loop (``AsyncOrchestrator`` on a loop thread); on Ray (engines in Ray actors through
``RayFanOut``) in ``test_membership_properties_ray.py``.

``CPR_MEMBERSHIP_EXAMPLES`` sets the number of examples of each run (default 25: a few seconds); the larger-count
opt-in is the same variable (e.g. 500).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Coroutine, Mapping
from types import SimpleNamespace
from typing import Any, ClassVar

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from resilience.barrier import (
    AsyncOrchestrator,
    EngineGroup,
    EngineState,
    Orchestrator,
    PhaseDeadlines,
    PhaseFailed,
    WeightVersionCheck,
)
from resilience.barrier.fanout import ThreadFanOut
from resilience.engine_contract import EngineDied
from tests.barrier.async_facade import LoopThread
from tests.barrier.fake_engine import ALL, AsyncFakeEngine, FakeEngine, Fault, _Fake

EXAMPLES = int(os.environ.get("CPR_MEMBERSHIP_EXAMPLES", "25"))
DEADLINES = PhaseDeadlines(transition_s=5.0, pause_s=0.05, flush_s=0.05, release_s=0.05, resume_s=0.05, continue_s=0.05, in_transit_s=0.1)
"""Tiny phase limits (a late call costs one of them), as the other barrier property tests use."""
SETTINGS: dict[str, Any] = {
    "max_examples": EXAMPLES,
    "stateful_step_count": 12,
    "deadline": None,
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.filter_too_much],
}
METHODS = ("pause_generation", "flush_cache", "release_memory_occupation", "resume_memory_occupation", "continue_generation")
FAULTS = st.sampled_from(
    [
        Fault.AMBIGUOUS_APPLIED,
        Fault.AMBIGUOUS_APPLIED,
        Fault.AMBIGUOUS_NOT_APPLIED,
        Fault.FAILED,
        Fault.APPLIED_THEN_502,
        Fault.APPLIED_THEN_504,
        Fault.GATEWAY_NOT_FORWARDED,
        Fault.CONNECTION_REFUSED,
        Fault.ACTOR_DIED,
        Fault.LATE_APPLIED,
    ]
)
ARMED = st.lists(st.tuples(st.integers(0, 5), st.sampled_from(METHODS), FAULTS), max_size=2)
"""Per rule: (engine index among the current ones, method, fault); an index past the end arms the joining engine."""
VERSION = "v1"


class _Join:
    """What ``JoinFake`` and ``AsyncJoinFake`` add to a fake: the reads a join asks, a kill, and what the barrier did."""

    version: str
    killed: bool
    continued_unverified: int
    sent: int
    """Control calls and reads (``ready``, ``model_info``) the fake was sent, its killed process's included."""

    def ready(self: Any) -> bool:
        """SGLang's ``/ready``: True only while not paused (``ServingRead``)."""
        self.sent += 1
        if self.killed:
            raise EngineDied(f"{self.engine} was killed")
        return not self.snapshot()[0]

    def model_info(self: Any) -> SimpleNamespace:
        self.sent += 1
        if self.killed:
            raise EngineDied(f"{self.engine} was killed")
        return SimpleNamespace(weight_version=self.version)


def _joined(fake: Any, version: str) -> None:
    fake.version, fake.killed, fake.continued_unverified, fake.sent = version, False, 0, 0
    inner = fake._continue

    def _continue() -> None:
        if fake.version != VERSION:
            fake.continued_unverified += 1
        inner()

    fake._continue = _continue


class JoinFake(_Join, FakeEngine):
    def __init__(self, name: str, version: str = VERSION) -> None:
        FakeEngine.__init__(self, name)
        _joined(self, version)

    def _call(self, method: str, apply: Callable[[], None]) -> dict[str, Any]:
        self.sent += 1
        if self.killed:
            raise EngineDied(f"{self.engine} was killed")
        return super()._call(method, apply)


class AsyncJoinFake(_Join, AsyncFakeEngine):
    def __init__(self, name: str, version: str = VERSION) -> None:
        AsyncFakeEngine.__init__(self, name)
        _joined(self, version)

    async def _call(self, method: str, apply: Callable[[], None]) -> dict[str, Any]:
        self.sent += 1
        if self.killed:
            raise EngineDied(f"{self.engine} was killed")
        return await super()._call(method, apply)

    async def ready(self) -> bool:  # type: ignore[override]
        return _Join.ready(self)

    async def model_info(self) -> SimpleNamespace:  # type: ignore[override]
        return _Join.model_info(self)


class MembershipMachine(RuleBasedStateMachine):
    """One offloaded group; engines join, restart and leave at random points; faults on any call."""

    ASYNC = False
    fenced_watched: ClassVar[int] = 0
    """Steps across which a fenced engine was watched, over all examples of a run (``run_watching_fenced``)."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 2
        self.current: dict[str, _Fake] = {self.url(i): self.fake(self.url(i)) for i in range(2)}
        self.every: list[_Fake] = list(self.current.values())
        self.retired: set[str] = set()
        self.fenced_sent: dict[int, int] = {}
        """``id()`` of each fake the orchestrator called fenced at the last check -> the calls it had been sent then."""
        self.orch: Any = self.orchestrator(list(self.current.values()))

    def orchestrator(self, engines: list[Any]) -> Any:
        """The orchestrator under test over ``engines`` (a variant builds its own)."""
        if self.ASYNC:
            self.loop = LoopThread()
            return AsyncOrchestrator(EngineGroup(engines), deadlines=DEADLINES)
        return Orchestrator(EngineGroup(engines), fanout=ThreadFanOut(max_workers=16), deadlines=DEADLINES)

    def teardown(self) -> None:
        for fake in self.every:
            fake.land()
        if self.ASYNC:
            self.loop.close()
        elif isinstance(self.orch.fanout, ThreadFanOut):
            self.orch.fanout.close()

    # -- helpers -----------------------------------------------------------------------------

    @staticmethod
    def url(i: int) -> str:
        return f"http://join-{i}:30000"

    def fake(self, url: str, version: str = VERSION) -> _Fake:
        return AsyncJoinFake(url, version) if self.ASYNC else JoinFake(url, version)

    def kill_process(self, old: Any) -> None:
        """The engine's old process is killed: its calls are refused from then on (``EngineDied``)."""
        old.killed = True

    def call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        method = getattr(self.orch, name)
        if self.ASYNC:
            coro: Coroutine[Any, Any, Any] = method(*args, **kwargs)
            return self.loop.run(coro)
        return method(*args, **kwargs)

    def arm(self, armed: list[tuple[int, str, Fault]], joining: _Fake | None = None) -> None:
        live = [f for n, f in self.current.items() if n not in self.retired]
        for i, method, fault in armed:
            target = live[i] if i < len(live) else joining
            if target is not None:
                target.arm(method, fault)

    def after(self) -> None:
        for fake in self.every:
            fake.disarm()
            fake.land()

    def transition(self, which: str) -> str:
        try:
            if which == "offload":
                self.call("offload")
            elif which == "offload_partial":
                self.call("offload", min_engines=1)
            elif which == "onload":
                self.call("onload")
            elif which == "onload_partial":
                self.call("onload", min_engines=1)
            return "ok"
        except PhaseFailed as err:
            assert err.failures
            return "failed"

    def counted(self) -> list[str]:
        states = self.orch.states()
        return [n for n, s in states.items() if s not in (EngineState.FENCED, EngineState.JOINING)]

    def group_offloaded(self, joining: str) -> tuple[bool, frozenset[str]]:
        """Whether the counted engines (``joining`` left out) hold the offload hold, and the tags released on them (as
        the barrier knows)."""
        know = self.orch.state.know
        held = [n for n in self.counted() if 0 in know[n].holds and n != joining]
        return bool(held), frozenset(t for n in held for t in know[n].released)

    # -- rules --------------------------------------------------------------------------------

    @rule(which=st.sampled_from(["offload", "onload", "offload_partial", "onload_partial"]), armed=ARMED)
    def run_transition(self, which: str, armed: list[tuple[int, str, Fault]]) -> None:
        self.arm(armed)
        try:
            outcome = self.transition(which)
        finally:
            self.after()
        event(f"{which} {outcome}")
        if outcome == "ok":
            for name in self.counted():
                fake = self.current[name]
                paused, _, released = fake.snapshot()
                if which.startswith("offload"):
                    assert paused and released == ALL, f"{name} counted but not offloaded: {fake.snapshot()}"

    @precondition(lambda self: self.n < 6)
    @rule(wrong_weights=st.booleans(), armed=ARMED)
    def add_new(self, wrong_weights: bool, armed: list[tuple[int, str, Fault]]) -> None:
        url = self.url(self.n)
        self.n += 1
        fake = self.fake(url, "v0" if wrong_weights else VERSION)
        self.every.append(fake)
        self.current[url] = fake
        self.join(url, fake, armed)

    @precondition(lambda self: len(self.current) > len(self.retired))
    @rule(pick=st.integers(0, 5), armed=ARMED)
    def restart(self, pick: int, armed: list[tuple[int, str, Fault]]) -> None:
        """Kill an engine's process and start a fresh one on its URL (all its memory, serving), then add it."""
        live = [n for n in self.current if n not in self.retired]
        url = live[pick % len(live)]
        self.kill_process(self.current[url])
        fake = self.fake(url)
        self.every.append(fake)
        self.current[url] = fake
        self.join(url, fake, armed)

    @precondition(lambda self: len(self.current) - len(self.retired) > 1)
    @rule(pick=st.integers(0, 5))
    def retire(self, pick: int) -> None:
        live = [n for n in self.current if n not in self.retired]
        url = live[pick % len(live)]
        self.call("retire", url)
        self.retired.add(url)
        assert url not in self.orch.states()

    def join(self, url: str, fake: _Fake, armed: list[tuple[int, str, Fault]]) -> None:
        offloaded, tags = self.group_offloaded(url)
        self.fenced_sent.pop(id(fake), None)  # an add is how a fenced engine is sent calls again
        self.arm(armed, joining=fake)
        try:
            self.call("add", fake, verify=WeightVersionCheck(VERSION))
            ok = True
        except PhaseFailed as err:
            assert url in err.failures, err
            ok = False
        finally:
            self.after()
        state = self.orch.states()[url]
        event(f"join {'counted' if ok else 'fenced'} into a {'offloaded' if offloaded else 'serving'} group")
        if not ok:
            assert state is EngineState.FENCED, f"{url} failed its join but is {state}"
            return
        assert state not in (EngineState.FENCED, EngineState.JOINING)
        assert getattr(fake, "version", VERSION) == VERSION, f"{url} has the wrong weights yet joined"
        paused, _, released = fake.snapshot()
        if offloaded:
            assert paused and tags <= released, f"{url} joined an offloaded group ({sorted(tags)}) as {fake.snapshot()}"
        else:
            assert not paused and not released, f"{url} joined a serving group as {fake.snapshot()}"

    # -- invariants ------------------------------------------------------------------------------

    @invariant()
    def no_engine_dies_and_none_is_continued_unverified(self) -> None:
        for fake in self.every:
            if not getattr(fake, "killed", False):
                assert fake.crash is None, f"{fake.engine} would have died: {fake.crash}"
            assert getattr(fake, "continued_unverified", 0) == 0, f"{fake.engine} (wrong weights) was continued"

    @invariant()
    def fenced_engines_are_sent_nothing(self) -> None:
        """An engine fenced at the last check and fenced now was sent no call and no read (``ready``, ``model_info``) in
        between (only ``add`` brings it back)."""
        states: Mapping[str, EngineState] = self.orch.states()
        now: dict[int, int] = {}
        for url, state in states.items():
            fake = self.current.get(url)
            if state is not EngineState.FENCED or fake is None or not hasattr(fake, "sent"):
                continue  # the Ray variant's fakes live in actors: their calls are not counted here
            before = self.fenced_sent.get(id(fake))
            assert before is None or fake.sent == before, f"{url} was sent {fake.sent - before} calls while fenced"
            if before is not None:
                event("a fenced engine watched across a step")
                type(self).fenced_watched += 1
            now[id(fake)] = fake.sent
        self.fenced_sent = now


class AsyncMembershipMachine(MembershipMachine):
    """The same rules on ``AsyncOrchestrator``, driven on one loop thread."""

    ASYNC = True


def run_watching_fenced(machine: type[MembershipMachine]) -> None:
    """Run ``machine``'s examples, then fail unless one of them watched a fenced engine across a step (else
    ``fenced_engines_are_sent_nothing`` checked nothing)."""
    machine.fenced_watched = 0
    run_state_machine_as_test(machine, settings=settings(**SETTINGS))
    assert machine.fenced_watched > 0, f"no example of {machine.__name__} watched a fenced engine across a step"


def test_membership_on_threads() -> None:
    """The rules on ``Orchestrator`` over ``ThreadFanOut``; a fenced engine is watched in some example."""
    run_watching_fenced(MembershipMachine)


def test_membership_on_one_loop() -> None:
    """The rules on ``AsyncOrchestrator`` on one loop thread; a fenced engine is watched in some example."""
    run_watching_fenced(AsyncMembershipMachine)


# What Hypothesis's pytest plugin takes as its tests (``hypothesis.is_hypothesis_test``) gets its statistics
# (``--hypothesis-show-statistics``) and marker, as the ``TestCase`` these two replace did.
test_membership_on_threads.is_hypothesis_test = True  # type: ignore[attr-defined]
test_membership_on_one_loop.is_hypothesis_test = True  # type: ignore[attr-defined]

