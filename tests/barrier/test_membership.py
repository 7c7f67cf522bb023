"""Engines joining and leaving a running group, partial progress, and the journal's membership, on socket-free fakes.

The fakes keep SGLang 0.5.23's crash rules (``fake_engine.py``): a double release, a resume of a tag not released, a
release while serving each leave ``crash`` set. ``JoinFake`` adds the two reads a join asks: SGLang's ``/ready``
(``ServingRead``: True only while not paused, as ``srt/entrypoints/http_server.py`` answers) and ``/model_info``'s
``weight_version``.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from resilience.barrier import (
    AsyncOrchestrator,
    BarrierBusy,
    CanaryCheck,
    EngineGroup,
    EngineState,
    Orchestrator,
    PhaseFailed,
    WeightVersionCheck,
)
from resilience.barrier.fanout import ThreadFanOut
from resilience.barrier.journal import Journal, JournalMismatch
from resilience.engine_contract import EngineStateChanged
from resilience.events import Event
from tests.barrier.fake_engine import ALL, AsyncFakeEngine, FakeEngine, Fault


class JoinFake(FakeEngine):
    """A fake with ``ready()`` (SGLang's serving read) and ``model_info()`` / ``generate()`` (what the checks read)."""

    def __init__(self, name: str, version: str = "v1", canary: str = "ok") -> None:
        super().__init__(name)
        self.version = version
        self.canary = canary
        self.generated_while_paused = 0

    def ready(self) -> bool:
        return not self.snapshot()[0]

    def model_info(self) -> SimpleNamespace:
        return SimpleNamespace(weight_version=self.version)

    def generate(self, text: str, sampling_params: dict[str, Any]) -> SimpleNamespace:
        if self.snapshot()[0]:
            self.generated_while_paused += 1
        return SimpleNamespace(text=self.canary)


def _orch(engines: list[Any], **kw: Any) -> Orchestrator[Any]:
    return Orchestrator(EngineGroup(engines), fanout=ThreadFanOut(max_workers=8), **kw)


def _alive(*engines: FakeEngine) -> None:
    for e in engines:
        assert e.crash is None, f"{e.engine} would have died: {e.crash}"
        assert not e.violations, e.violations


def test_a_new_engine_joins_an_offloaded_group_paused_and_released_first() -> None:
    a, b, c = JoinFake("http://a:1"), JoinFake("http://b:1"), JoinFake("http://c:1")
    orch = _orch([a, b])
    orch.offload(tags=["kv_cache", "weights"])
    report = orch.add(c)
    assert report.transition == "join"
    assert [p.phase for p in report.phases] == ["pause", "flush", "release"]
    assert c.snapshot() == (True, True, frozenset({"kv_cache", "weights"}))
    assert orch.states()[c.engine] is EngineState.RELEASED
    orch.onload()  # it counts now: the onload resumes it with the others
    assert all(e.serving for e in (a, b, c))
    orch.offload()
    assert c.snapshot()[2] == ALL
    _alive(a, b, c)


def test_a_new_engine_joins_a_serving_group_verified_while_paused() -> None:
    a, c = JoinFake("http://a:1", "v2"), JoinFake("http://c:1", "v2")
    seen: list[Event] = []
    orch = _orch([a], observers=[seen.append])
    report = orch.add(c, verify=[WeightVersionCheck("v2"), CanaryCheck("hi", "ok")])
    assert [p.phase for p in report.phases] == ["pause", "continue"]
    assert c.serving and c.generated_while_paused == 0
    assert orch.states() == {a.engine: EngineState.SERVING, c.engine: EngineState.SERVING}
    changes = [(e.from_state, e.to_state) for e in seen if isinstance(e, EngineStateChanged) and e.engine == c.engine]
    assert changes == [("", "joining"), ("joining", "serving")]  # the one word states() gives: no phase's word mid-join
    _alive(a, c)


def test_a_joining_engine_with_the_wrong_weights_is_fenced_and_kept_paused() -> None:
    a, c = JoinFake("http://a:1", "v2"), JoinFake("http://c:1", "v1")
    orch = _orch([a])
    with pytest.raises(PhaseFailed) as failed:
        orch.add(c, verify=WeightVersionCheck("v2"))
    assert failed.value.transition == "join" and failed.value.phase == "verify"
    assert list(failed.value.failures) == [c.engine] and c.engine in failed.value.left_paused
    assert c.snapshot()[0] is True, "an engine that failed its check must not serve"
    assert orch.states()[c.engine] is EngineState.FENCED
    pauses = len(c.started)
    orch.offload()
    orch.onload()
    assert len(c.started) == pauses, "a fenced engine is sent nothing by the group's transitions"
    c.version = "v2"  # the trainer pushed the weights to it: add it again
    orch.add(c, verify=WeightVersionCheck("v2"))
    assert c.serving and orch.states()[c.engine] is EngineState.SERVING
    _alive(a, c)


def test_a_canary_mismatch_after_the_continue_pauses_the_engine_again() -> None:
    a, c = JoinFake("http://a:1"), JoinFake("http://c:1", canary="garbage")
    orch = _orch([a])
    with pytest.raises(PhaseFailed) as failed:
        orch.add(c, verify=CanaryCheck("hi", "ok"))
    assert failed.value.phase == "verify"
    assert c.snapshot()[0] is True and orch.states()[c.engine] is EngineState.FENCED
    _alive(a, c)


def test_an_engine_restarted_at_its_url_is_taken_as_new_never_resumed_onto_memory_it_lacks() -> None:
    a, b = JoinFake("http://a:1"), JoinFake("http://b:1")
    orch = _orch([a, b])
    orch.offload()
    fresh = JoinFake("http://b:1")  # b's process restarted: all its memory, serving
    report = orch.add(fresh)
    assert list(report.replaced) == [b.engine], report
    assert fresh.snapshot() == (True, True, ALL), "brought to the group's state: paused and released like the others"
    orch.onload()
    assert fresh.serving and a.serving
    _alive(a, fresh)


def test_a_known_engine_added_again_that_proves_nothing_keeps_what_the_barrier_knew() -> None:
    a, b = JoinFake("http://a:1"), JoinFake("http://b:1")
    orch = _orch([a, b])
    orch.offload()
    report = orch.add(b)  # the same process (paused: /ready proves nothing): nothing released twice
    assert report.replaced == {} and report.phases == ()
    orch.onload()
    _alive(a, b)


def test_add_is_refused_while_a_pause_hold_is_held_and_names_the_group() -> None:
    a, c = JoinFake("http://a:1"), JoinFake("http://c:1")
    orch = _orch([a])
    token = orch.pause("eval").hold
    assert token is not None
    with pytest.raises(BarrierBusy, match="eval"):
        orch.add(c)
    assert c.engine not in orch.states() and c.started == []
    orch.unpause(token)
    with pytest.raises(ValueError, match="no group 'nope'"):
        orch.add(c, group="nope")


def test_partial_offload_fences_the_engine_it_cannot_prove_and_completes_for_the_rest() -> None:
    engines = [JoinFake(f"http://e{i}:1") for i in range(3)]
    orch = _orch(engines)
    engines[2].arm("release_memory_occupation", Fault.AMBIGUOUS_APPLIED)
    report = orch.offload(min_engines=2)
    assert list(report.fenced) == [engines[2].engine] and "release" in report.fenced[engines[2].engine]
    assert all(e.snapshot()[2] == ALL for e in engines[:2])
    assert orch.states()[engines[2].engine] is EngineState.FENCED
    orch.onload()
    assert all(e.serving for e in engines[:2])
    _alive(*engines)


def test_without_min_engines_a_failed_offload_fails_for_all_as_before() -> None:
    engines = [JoinFake(f"http://e{i}:1") for i in range(3)]
    orch = _orch(engines)
    engines[2].arm("pause_generation", Fault.FAILED)
    with pytest.raises(PhaseFailed) as failed:
        orch.offload()
    assert list(failed.value.failures) == [engines[2].engine]
    assert all(e.serving for e in engines), "rolled back, as before"
    assert EngineState.FENCED not in orch.states().values()
    engines[2].arm("pause_generation", Fault.FAILED)
    with pytest.raises(PhaseFailed):  # too few would be left: the option changes nothing then
        orch.offload(min_engines=3)
    with pytest.raises(ValueError, match="min_engines"):
        orch.offload(min_engines=0)
    _alive(*engines)


def test_the_journal_records_who_joined_and_who_left(tmp_path: Path) -> None:
    path = tmp_path / "barrier.journal"
    a, b, c = JoinFake("http://a:1"), JoinFake("http://b:1"), JoinFake("http://c:1")
    orch = _orch([a, b], journal=path)
    orch.offload()
    orch.add(c)
    orch.retire(b)
    orch.close()
    with pytest.raises(JournalMismatch, match=r"http://c:1 joined"):
        _orch([a, b], journal=path)
    again = _orch([a, c], journal=path)  # b left: it may be left out
    assert again.recovery is not None and dict(again.recovery.members) == {c.engine: "joined", b.engine: "left"}
    assert again.states() == {a.engine: EngineState.RELEASED, c.engine: EngineState.RELEASED}
    again.onload()
    assert a.serving and c.serving
    again.close()
    compacted = Journal(path, compact_after=2)  # rewritten as one snapshot: the header keeps the membership
    resumed = compacted.open([a.engine, c.engine])
    compacted.commit(resumed.knowledge, [a.engine], "test")
    compacted.close()
    last = _orch([a, c], journal=path)
    assert last.recovery is not None and last.recovery.members[c.engine] == "joined"
    last.close()
    _alive(a, b, c)


def test_a_join_the_controller_never_finished_leaves_the_engine_fenced_until_added_again(tmp_path: Path) -> None:
    path = tmp_path / "barrier.journal"
    a, c = JoinFake("http://a:1"), JoinFake("http://c:1")
    orch = _orch([a], journal=path)
    orch.offload()
    c.arm("release_memory_occupation", Fault.INTERRUPT_AFTER)  # KeyboardInterrupt in the join's release
    with pytest.raises(KeyboardInterrupt):
        orch.add(c)
    assert orch.states()[c.engine] is EngineState.JOINING
    orch.close()
    again = _orch([a, c], journal=path)
    assert again.recovery is not None and again.recovery.members[c.engine] == "joining"
    assert again.states()[c.engine] is EngineState.FENCED
    again.onload()  # the group's onload leaves it alone: it never counted
    c.disarm()
    with pytest.raises(PhaseFailed):  # its release may have been applied: quarantined, so the join is refused
        again.add(c)
    again.reconcile(c, released=ALL, paused=True)  # the operator checked it
    again.offload()
    again.add(c)
    assert again.states()[c.engine] is EngineState.RELEASED
    again.onload()
    assert c.serving
    again.close()
    _alive(a, c)


def test_an_async_orchestrator_adds_engines_too() -> None:
    async def main() -> None:
        a, c = AsyncFakeEngine("http://a:1"), AsyncFakeEngine("http://c:1")
        orch: AsyncOrchestrator[Any] = AsyncOrchestrator(EngineGroup([a]))
        await orch.offload()
        await orch.add(c)
        assert c.snapshot() == (True, True, ALL)
        with pytest.raises(TypeError, match="coroutine"):
            await orch.add(FakeEngine("http://sync:1"))
        await orch.retire(a)
        assert list(orch.states()) == [c.engine]
        await orch.onload()
        assert c.serving
        _alive(a, c)

    asyncio.run(main())


def test_a_retired_engine_added_back_keeps_what_was_known_and_is_never_released_twice() -> None:
    a, b = JoinFake("http://a:1"), JoinFake("http://b:1")
    orch = _orch([a, b])
    orch.offload()
    orch.retire(b)  # retired while released: the same process comes back later
    orch.add(b)
    assert orch.states()[b.engine] is EngineState.RELEASED
    orch.onload()
    assert a.serving and b.serving
    _alive(a, b)
