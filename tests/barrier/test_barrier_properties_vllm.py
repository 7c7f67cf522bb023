"""The barrier's property machine on vLLM engines: random control loops with faults on every call, vLLM's semantics.

``BarrierMachine`` (``test_barrier_properties``) over socket-free vLLM engines (``fake_vllm_engine``): two offloaded,
one in a ``needs_offload=False`` group; and a mixed fleet (an SGLang engine and a vLLM engine offloaded, a vLLM engine
not). Every rule of the SGLang machine runs here too (offload, onload, weight syncs plain, nested, from two threads and
against a transition from another thread, user holds, reconcile, retire, interrupts, observers and fan-outs that
raise), with the same ambiguous faults on every call (applied then ambiguous, 502/504 after applying, ...).

On top of the SGLang machine's invariants, the fakes record as a violation any scheduling reopened while a pause is
held (a ``/resume``, or a wake that leaves nothing asleep, both of which end vLLM's one shared pause) and as a crash
any scheduling reopened while a tag sleeps (``/resume`` while asleep): the rules must never send either. Unknown
tags on a vLLM engine are not a quarantine: the knowledge invariant reads them from ``unsettled()``.

``CPR_BARRIER_VLLM_EXAMPLES`` sets the examples of each run (default 40).
"""

from __future__ import annotations

import os
from typing import Any

from hypothesis import event, settings
from hypothesis.stateful import invariant, rule

from resilience.barrier import AsyncOrchestrator, Orchestrator, PhaseFailed
from resilience.barrier.fanout import ThreadFanOut
from resilience.engine_contract import EngineState, rules_of
from tests.barrier.async_facade import LoopThread, SyncFacade
from tests.barrier.fake_engine import AnyFake, FakeEngine, Fault
from tests.barrier.fake_vllm_engine import AsyncFakeVLLMEngine, FakeVLLMEngine
from tests.barrier.test_barrier_properties import (
    DEADLINES,
    FAULTS,
    MODES,
    OFFLOAD_TAGS,
    ONLOAD_TAGS,
    SETTINGS,
    BarrierMachine,
    FlakyFanOut,
)

EXAMPLES = int(os.environ.get("CPR_BARRIER_VLLM_EXAMPLES", "40"))


class VLLMMachine(BarrierMachine):
    """The barrier machine on three vLLM engines over ``ThreadFanOut``."""

    def make_engines(self) -> list[AnyFake]:
        return [FakeVLLMEngine(f"http://vllm-{i}:8000") for i in range(3)]

    def __init__(self) -> None:
        super().__init__()
        self.fanout.close()
        self.engines = self.make_engines()
        self.use_hook(self.signal_main)
        self.fanout = FlakyFanOut(ThreadFanOut(max_workers=32))
        self.orch = Orchestrator(self.groups(), fanout=self.fanout, deadlines=DEADLINES, observers=[self.observe])

    def set_held(self) -> None:
        """Tell the vLLM fakes how many user holds the test has: reopening scheduling meanwhile is a violation."""
        live = sum(1 for t in self.tokens if t is not None)
        for e in self.engines:
            if isinstance(e, (FakeVLLMEngine, AsyncFakeVLLMEngine)):
                e.held = live

    def transition(self, which: str) -> None:
        super().transition(which)
        self.set_held()

    @rule(faults=FAULTS)
    def user_pause(self, faults: dict[tuple[int, str], Fault]) -> None:
        super().user_pause(faults)
        self.set_held()

    @rule(faults=FAULTS)
    def user_unpause(self, faults: dict[tuple[int, str], Fault]) -> None:
        if self.tokens and self.tokens[0] is not None:  # the hold ends before its unpause is sent
            for e in self.engines:
                if isinstance(e, (FakeVLLMEngine, AsyncFakeVLLMEngine)):
                    e.held = max(0, e.held - 1)
        super().user_unpause(faults)
        self.set_held()

    @rule(tags=OFFLOAD_TAGS, mode=MODES, faults=FAULTS)
    def offload(self, tags: tuple[str, ...] | None, mode: Any, faults: dict[tuple[int, str], Fault]) -> None:
        """As the SGLang machine's, with each engine's own tags (a vLLM engine has weights and kv_cache only)."""
        with self.armed(faults):
            try:
                self.orch.offload(tags, mode)
            except PhaseFailed as err:
                self.check_named(err)
                return
        for e in self.active(offloaded_only=True):
            table = rules_of(e).memory
            wanted = (set(tags) if tags else set(table.tags)) & set(table.tags)
            paused, _, released = e.snapshot()
            assert paused and wanted <= released, f"offload returned but {e.engine} is paused={paused} released={sorted(released)}"

    @rule(tags=ONLOAD_TAGS, faults=FAULTS)
    def onload(self, tags: tuple[str, ...] | None, faults: dict[tuple[int, str], Fault]) -> None:
        """As the SGLang machine's, except that a vLLM engine another hold keeps paused keeps its last tag asleep (the
        wake that would bring it back would also end that hold's pause)."""
        with self.armed(faults):
            try:
                report = self.orch.onload(tags)
            except PhaseFailed as err:
                self.check_named(err)
                return
        for e in self.active(offloaded_only=True):
            assert e.serving or e.engine in report.held, f"onload returned but {e.engine} neither serves nor is named held: {e.snapshot()}"
            others = set(report.held.get(e.engine, ())) - {"offload"}
            if tags is None and not (rules_of(e).memory.last_wake_resumes and others):
                assert not e.snapshot()[2], f"onload of everything returned but {e.engine} still has memory released"
            if e.snapshot()[2] and others:
                event("the last wake was held back by another hold")

    @invariant()
    def knowledge_matches_the_engines(self) -> None:
        """What the orchestrator says it knows is true; unknown tags (quarantined or unsettled) may be either way."""
        states = self.orch.states()
        unknown = {**self.orch.quarantined(), **self.orch.unsettled()}
        for e in self.active():
            state = states[e.engine]
            if state in (EngineState.IN_FLIGHT, EngineState.DEAD, EngineState.UNKNOWN):
                continue
            paused, flushed, released = e.snapshot()
            known = self.orch.released_tags(e)
            assert known <= released <= known | unknown.get(e.engine, frozenset()), (e.engine, state, known, released)
            if state is EngineState.SERVING:
                assert not paused, (e.engine, state)
            elif state not in (EngineState.QUARANTINED, EngineState.UNSETTLED):
                assert paused, (e.engine, state)
            if state is EngineState.FLUSHED:
                assert flushed, (e.engine, state)
            if state is EngineState.UNSETTLED:
                event("an unsettled vLLM engine")
        for e in self.engines:
            if isinstance(e, FakeVLLMEngine) and e.wakes_that_resumed:
                event("a wake resumed a vLLM engine")


VLLMMachine.TestCase.settings = settings(max_examples=EXAMPLES, **SETTINGS)  # type: ignore[arg-type]
TestBarrierPropertiesVLLM = VLLMMachine.TestCase


class MixedMachine(VLLMMachine):
    """One orchestrator over an SGLang engine and a vLLM engine (offloaded) and a vLLM engine (``needs_offload=False``)."""

    def make_engines(self) -> list[AnyFake]:
        return [FakeEngine("http://sglang-0:30000"), FakeVLLMEngine("http://vllm-1:8000"), FakeVLLMEngine("http://vllm-2:8000")]


MixedMachine.TestCase.settings = settings(max_examples=EXAMPLES, **SETTINGS)  # type: ignore[arg-type]
TestBarrierPropertiesMixed = MixedMachine.TestCase


class VLLMAsyncOrchestratorMachine(VLLMMachine):
    """The vLLM machine on ``AsyncOrchestrator`` (through ``SyncFacade``): engines with coroutine calls; interrupts cancel."""

    INTERRUPTS = (Fault.INTERRUPT_BEFORE, Fault.INTERRUPT_AFTER)
    BOMBS = (BarrierMachine.BOMBS[0],)

    def make_engines(self) -> list[AnyFake]:
        return [AsyncFakeVLLMEngine(f"http://vllm-{i}:8000") for i in range(3)]

    def __init__(self) -> None:
        super().__init__()
        self.fanout.close()
        self.loop = LoopThread()
        self.async_orch: Any = AsyncOrchestrator(self.groups(), deadlines=DEADLINES, observers=[self.observe])
        self.orch = SyncFacade(self.async_orch, self.loop)
        self.use_hook(self.cancel_transition)

    def teardown(self) -> None:
        super().teardown()
        self.loop.close()


VLLMAsyncOrchestratorMachine.TestCase.settings = settings(max_examples=max(1, EXAMPLES // 2), **SETTINGS)  # type: ignore[arg-type]
TestBarrierPropertiesVLLMAsync = VLLMAsyncOrchestratorMachine.TestCase
