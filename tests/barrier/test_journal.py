"""Orchestrators on a journal: a new controller resumes what the last one knew, so no engine dies of a restart.

Socket-free engines that crash where SGLang 0.5.23 crashes (``tests/barrier/fake_engine.py``). The
live-engine version, with controllers SIGKILLed at random moments, is ``test_crash_consistency.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

from resilience.barrier import AsyncOrchestrator, EngineGroup, Orchestrator, PhaseDeadlines, PhaseFailed, SequentialFanOut
from resilience.barrier.journal import JournalBusy, JournalError, JournalMismatch, RestartBudget
from resilience.engine_contract import EngineState
from tests.barrier.fake_engine import AsyncFakeEngine, FakeEngine, Fault
from tests.barrier.fake_vllm_engine import FakeVLLMEngine

NAMES = ["http://127.0.0.1:40001", "http://127.0.0.1:40002", "http://127.0.0.1:40003"]
SHORT_GRACE = PhaseDeadlines(in_transit_s=0.1)
"""A release the dead controller left in flight may still be on its way: the probe's "not released" is trusted after 0.1 s."""


class TruthProbe:
    """A memory probe that reads the fake engines' real released tags (what NVML or the emulator's side channel give)."""

    def __init__(self, engines: list[FakeEngine]) -> None:
        self.engines = {e.engine: e for e in engines}

    def released_tags(self, engine: str) -> frozenset[str] | None:
        fake = self.engines.get(engine)
        return None if fake is None else fake.snapshot()[2]


def alive(engines: list[FakeEngine]) -> None:
    assert [e.crash for e in engines] == [None] * len(engines)


def test_a_restarted_controller_resumes_the_offload_and_onloads_without_a_double_release(tmp_path: Path) -> None:
    engines = [FakeEngine(n) for n in NAMES]
    first = Orchestrator(EngineGroup(engines), fanout=SequentialFanOut(), journal=tmp_path / "j")
    assert first.recovery is not None and not first.recovery.resumed
    first.offload()
    first.close()  # the controller goes away; the engines stay released

    second = Orchestrator(EngineGroup(engines), fanout=SequentialFanOut(), journal=tmp_path / "j")
    assert second.recovery is not None and second.recovery.resumed
    assert second.states() == dict.fromkeys(NAMES, EngineState.RELEASED)
    second.offload()  # idempotent: nothing released twice
    second.onload()
    alive(engines)
    assert all(e.serving for e in engines)
    second.close()


def test_without_a_journal_the_same_restart_double_releases(tmp_path: Path) -> None:
    """The failure the journal prevents, shown on the same engines (so the test above can fail)."""
    engines = [FakeEngine(n) for n in NAMES]
    Orchestrator(EngineGroup(engines), fanout=SequentialFanOut()).offload()
    with contextlib.suppress(PhaseFailed):
        Orchestrator(EngineGroup(engines), fanout=SequentialFanOut()).offload()
    assert all(e.crash is not None and "double release" in e.crash for e in engines), [e.crash for e in engines]


@pytest.mark.parametrize("fault", [Fault.INTERRUPT_AFTER, Fault.INTERRUPT_BEFORE])
def test_a_controller_interrupted_mid_release_leaves_the_call_ambiguous_for_the_next_one(tmp_path: Path, fault: Fault) -> None:
    engines = [FakeEngine(n) for n in NAMES]

    def interrupt() -> None:
        raise KeyboardInterrupt

    engines[1].interrupt = interrupt
    engines[1].arm("release_memory_occupation", fault)
    first = Orchestrator(EngineGroup(engines), fanout=SequentialFanOut(), journal=tmp_path / "j")
    with pytest.raises(KeyboardInterrupt):
        first.offload()
    first.close()
    engines[1].land()

    second = Orchestrator(EngineGroup(engines), fanout=SequentialFanOut(), journal=tmp_path / "j")
    assert second.recovery is not None and second.recovery.in_flight == {}  # the interrupted controller settled it as ambiguous
    assert second.states()[NAMES[1]] is EngineState.QUARANTINED
    with pytest.raises(PhaseFailed) as failed:
        second.onload()
    assert NAMES[1] in failed.value.quarantined
    second.close()
    alive(engines)

    third = Orchestrator(
        EngineGroup(engines), fanout=SequentialFanOut(), journal=tmp_path / "j", memory_probe=TruthProbe(engines), deadlines=SHORT_GRACE
    )
    third.onload()  # the probe settles what the interrupted release did (a "not released" once the grace is waited out)
    alive(engines)
    assert all(e.serving for e in engines)
    third.close()


def test_a_controller_killed_outright_mid_release_leaves_the_release_in_flight(tmp_path: Path) -> None:
    script = (
        "import os, sys\n"
        "from resilience.barrier import EngineGroup, Orchestrator, SequentialFanOut\n"
        "from tests.barrier.fake_engine import FakeEngine, Fault\n"
        "engines = [FakeEngine(n) for n in sys.argv[2:]]\n"
        "engines[1].interrupt = lambda: os.kill(os.getpid(), 9)\n"
        "engines[1].arm('release_memory_occupation', Fault.INTERRUPT_AFTER)\n"
        "Orchestrator(EngineGroup(engines), fanout=SequentialFanOut(), journal=sys.argv[1]).offload()\n"
    )
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path / "j"), *NAMES], cwd=Path(__file__).parents[2], timeout=120)
    assert proc.returncode == -9
    engines = [FakeEngine(n) for n in NAMES]  # the engines as the killed controller left them
    for e in engines:
        e.pause_generation()
        e.flush_cache()
    for e in engines[:2]:
        e.release_memory_occupation()
    orch = Orchestrator(EngineGroup(engines), fanout=SequentialFanOut(), journal=tmp_path / "j")
    # the whole phase was written as "ambiguous" before any release went out
    assert orch.recovery is not None and orch.recovery.in_flight == dict.fromkeys(NAMES, "release_memory_occupation")
    assert orch.recovery.orphaned_holds == {}  # the offload hold belongs to whichever controller runs
    assert orch.states() == dict.fromkeys(NAMES, EngineState.QUARANTINED)
    with pytest.raises(PhaseFailed) as failed:
        orch.offload()  # without a probe: named, never released again
    assert list(failed.value.quarantined) == NAMES
    alive(engines)
    orch.close()
    probed = Orchestrator(
        EngineGroup(engines), fanout=SequentialFanOut(), journal=tmp_path / "j", memory_probe=TruthProbe(engines), deadlines=SHORT_GRACE
    )
    probed.onload()  # engine 3's release never left: its "not released" is trusted once the grace is waited out
    alive(engines)
    assert all(e.serving for e in engines)
    probed.close()


def test_a_hold_whose_owner_died_is_named_and_kept_until_unpaused(tmp_path: Path) -> None:
    script = (
        "import os, sys\n"
        "from resilience.barrier import EngineGroup, Orchestrator, SequentialFanOut\n"
        "from tests.barrier.fake_engine import FakeEngine\n"
        "engines = [FakeEngine(n) for n in sys.argv[2:]]\n"
        "orch = Orchestrator(EngineGroup(engines), fanout=SequentialFanOut(), journal=sys.argv[1])\n"
        "with orch.weight_sync():\n"
        "    os.kill(os.getpid(), 9)  # killed inside the body: its hold has no owner any more\n"
    )
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path / "j"), *NAMES], cwd=Path(__file__).parents[2], timeout=120)
    assert proc.returncode == -9
    engines = [FakeEngine(n) for n in NAMES]
    for e in engines:  # the real engines were paused by the dead controller
        e.pause_generation()
    orch = Orchestrator(EngineGroup(engines), fanout=SequentialFanOut(), journal=tmp_path / "j")
    assert orch.recovery is not None
    assert set(orch.recovery.orphaned_holds) == set(NAMES)
    assert orch.held() == dict.fromkeys(NAMES, ("weight_sync",))
    orch.unpause("weight_sync")
    assert all(e.serving for e in engines)
    orch.close()


def test_the_restart_budget_and_retired_engines_come_back(tmp_path: Path) -> None:
    engines = [FakeEngine(n) for n in NAMES]
    budget = RestartBudget(3)
    first = Orchestrator(EngineGroup(engines), fanout=SequentialFanOut(), journal=tmp_path / "j", restart_budget=budget)
    budget.record("engine died", step=7)
    first.retire(NAMES[2])
    first.close()
    second = Orchestrator(EngineGroup(engines), fanout=SequentialFanOut(), journal=tmp_path / "j")
    assert second.restart_budget is not None and second.restart_budget.remaining == 2
    assert [r.cause for r in second.restart_budget.records] == ["engine died"]
    assert NAMES[2] not in second.states()
    second.close()


def test_a_journal_for_other_engines_is_refused_at_construction_and_let_go(tmp_path: Path) -> None:
    engines = [FakeEngine(n) for n in NAMES]
    Orchestrator(EngineGroup(engines), fanout=SequentialFanOut(), journal=tmp_path / "j").close()
    other = [FakeEngine(n) for n in [*NAMES[:2], "http://127.0.0.1:40009"]]
    with pytest.raises(JournalMismatch, match=re.escape("http://127.0.0.1:40009")):
        Orchestrator(EngineGroup(other), fanout=SequentialFanOut(), journal=tmp_path / "j")
    Orchestrator(EngineGroup(engines), fanout=SequentialFanOut(), journal=tmp_path / "j").close()  # the lock was let go


def test_the_async_orchestrator_resumes_from_the_same_journal(tmp_path: Path) -> None:
    async def main() -> None:
        engines = [AsyncFakeEngine(n) for n in NAMES]
        first = AsyncOrchestrator(EngineGroup(engines), journal=tmp_path / "j")
        await first.offload()
        first.close()
        second = AsyncOrchestrator(EngineGroup(engines), journal=tmp_path / "j")
        assert second.states() == dict.fromkeys(NAMES, EngineState.RELEASED)
        await second.onload()
        second.close()
        assert [e.crash for e in engines] == [None] * 3
        assert all(e.serving for e in engines)

    asyncio.run(main())


def test_every_record_is_written_before_the_command_it_announces(tmp_path: Path) -> None:
    """Write-ahead: when an engine receives a release, the journal already says the release may be applied."""
    from resilience.barrier.journal import Journal

    seen: list[EngineState] = []

    class Spy(FakeEngine):
        def release_memory_occupation(self, tags: object = None) -> object:
            reader = Journal.read_only(tmp_path / "j")
            seen.append(reader[self.engine].state)
            return super().release_memory_occupation(tags)  # type: ignore[arg-type]

    engines = [Spy(n) for n in NAMES]
    orch = Orchestrator(EngineGroup(engines), fanout=SequentialFanOut(), journal=tmp_path / "j")
    orch.offload()
    orch.close()
    assert seen == [EngineState.QUARANTINED] * 3  # a controller resumed at that instant would not release again


def test_a_second_controller_on_a_symlink_to_the_journal_is_refused_so_nothing_is_released_twice(tmp_path: Path) -> None:
    """``current.journal -> run-42.journal``, a controller on each name: the second is refused (v3 opened it, believed
    "serving" and released the first's released engines again)."""
    (tmp_path / "current.journal").symlink_to("run-42.journal")
    engines = [FakeEngine(n) for n in NAMES]
    first = Orchestrator(EngineGroup(engines), fanout=SequentialFanOut(), journal=tmp_path / "run-42.journal")
    first.offload()
    try:
        with pytest.raises(JournalBusy, match="is open in another controller"):
            Orchestrator(EngineGroup(engines), fanout=SequentialFanOut(), journal=tmp_path / "current.journal")
    finally:
        first.close()
    second = Orchestrator(EngineGroup(engines), fanout=SequentialFanOut(), journal=tmp_path / "current.journal")
    assert second.states() == dict.fromkeys(NAMES, EngineState.RELEASED)  # the same journal, once the first let go
    second.onload()
    second.close()
    alive(engines)


def test_an_orchestrator_given_a_file_that_is_not_a_journal_refuses_and_leaves_it(tmp_path: Path) -> None:
    """``journal=`` at a YAML config: JournalError, the config as it was, and the lock let go."""
    config = tmp_path / "train.yaml"
    config.write_text("engines: 3\njournal: run.journal\n")
    before = config.read_bytes()
    engines = [FakeEngine(n) for n in NAMES]
    with pytest.raises(JournalError, match="not a barrier journal"):
        Orchestrator(EngineGroup(engines), fanout=SequentialFanOut(), journal=config)
    assert config.read_bytes() == before
    with pytest.raises(JournalError, match="not a barrier journal"):  # refused again, not held (JournalBusy) by the first
        Orchestrator(EngineGroup(engines), fanout=SequentialFanOut(), journal=config)


def test_a_retired_vllm_engine_is_not_asked_for_when_the_journal_resumes(tmp_path: Path) -> None:
    """A controller started again without an engine that left (retired) resumes its journal, whatever that engine's kind."""
    path = tmp_path / "journal.jsonl"
    first = Orchestrator(EngineGroup([FakeEngine("http://a:1"), FakeVLLMEngine("http://v:1")]), fanout=SequentialFanOut(), journal=path)
    try:
        first.offload()
        first.onload()
        first.retire("http://v:1")
    finally:
        first.close()
    second = Orchestrator(EngineGroup([FakeEngine("http://a:1")]), fanout=SequentialFanOut(), journal=path)
    try:
        assert second.recovery is not None and second.recovery.members == {"http://v:1": "left"}
        assert second.states() == {"http://a:1": EngineState.SERVING}
    finally:
        second.close()
