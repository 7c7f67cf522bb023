"""A resumed journal checked against the engines, and journal writes that fail, on real emulated SGLang engines.

- An engine replaced by a fresh process while no controller watched (SIGKILLed controller, the
  engine restarted on its URL) is taken as a new engine by the next controller, with the emulator's
  memory probe and without it: nothing is resumed onto memory it never released (``resume_check``).
- A journal that says "paused, flushed" while engine 0 was restarted and serves traffic: the next
  offload pauses and flushes it again before the release, also when the engine has no read that tells
  (an engine object with only the five control calls).
- A write-ahead record that could not be written (``ENOSPC`` from the journal store) sends nothing
  and marks nothing ambiguous: the same controller's next onload and offload work, nothing quarantined (its
  phase ends for the observers with the error).
- A ``weight_sync`` whose hold record could not be written leaves no hold behind: after the next
  offload and onload every engine serves.

Each engine is its own process (``EmulatedFleet``); deaths are read from the engines' own logs.
"""

from __future__ import annotations

import errno
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("torch")

from resilience.adapters.sglang import SGLangClient
from resilience.barrier import EngineGroup, Orchestrator, PhaseDeadlines
from resilience.barrier.fanout import Calls, EngineResult, ThreadFanOut
from resilience.barrier.journal import Journal
from resilience.barrier.journal_store import FileJournalStore, JournalStore, Loaded
from resilience.barrier.state import EngineKnowledge, PhaseEnded
from resilience.cli.story import death_causes
from resilience.deadline import Deadline
from resilience.engine_contract import CONTROL_METHODS, PauseMode
from resilience.events import Event
from resilience.testing.emulator import EmulatedFleet, EngineConfig, EngineHandle
from tests.barrier.crash_rig import Controller, Traffic, put_in_order
from tests.barrier.fake_engine import FakeEngine
from tests.sglang.conftest import FAST_SGLANG

CONFIG = EngineConfig(token_rate=400.0, health_hang_seconds=1.0, health_poll_seconds=0.05, abort_poll_seconds=0.05, swap_seconds=0.05)
DEADLINES = PhaseDeadlines(transition_s=30, pause_s=10, flush_s=10, release_s=10, resume_s=10, continue_s=10)
READY_S = 60.0
"""Seconds a controller process may take to import, read its journal and print a line (a loaded box)."""
END_S = 120.0
"""Seconds a controller process may take to run its transitions to their end."""


@pytest.fixture(scope="module")
def fleet() -> Iterator[EmulatedFleet]:
    """Two emulated engines for the module; they outlive every controller (the fleet stops them by PID)."""
    with EmulatedFleet(2, CONFIG) as f:
        yield f


@pytest.fixture
def engines(fleet: EmulatedFleet) -> Iterator[EmulatedFleet]:
    """The fleet, every engine alive and serving with all its memory at the start of the test."""
    put_in_order(fleet)
    yield fleet


def _logs_at(fleet: EmulatedFleet) -> list[int]:
    return [len(e.log()) for e in fleet.engines]


def _deaths(fleet: EmulatedFleet, since: Sequence[int]) -> dict[int, list[str]]:
    """Per engine, what killed it since ``since`` (its log length then); engines that never crashed left out."""
    out = {}
    for engine, start in zip(fleet.engines, since, strict=True):
        causes = death_causes(engine.log()[start:])
        if causes or not engine.alive():
            out[engine.index] = causes or ["not alive"]
    return out


def _serving(engine: EngineHandle) -> bool:
    state = engine.state()
    return not state["paused"] and not state["released_tags"]


def _calls(engine: EngineHandle, path: str) -> int:
    """The calls to ``path`` that ``engine``'s current process received (its server-side record)."""
    return sum(1 for c in engine.record()["calls"] if c["path"] == path)


def _releases(engine: EngineHandle) -> int:
    """The releases ``engine``'s current process received."""
    return _calls(engine, "/release_memory_occupation")


def _clients(fleet: EmulatedFleet) -> list[SGLangClient]:
    return [SGLangClient(u, policies=FAST_SGLANG, flush_poll_s=0.05) for u in fleet.direct_urls]


class ControlOnly:
    """An engine object with the five control calls and nothing else (your own client): it has no read that tells."""

    def __init__(self, client: SGLangClient) -> None:
        self.client = client
        self.engine = client.engine

    def pause_generation(self, *, mode: PauseMode = "abort") -> object:
        return self.client.pause_generation(mode)

    def flush_cache(self, *, deadline_s: float | None = None) -> object:
        return self.client.flush_cache(deadline_s)

    def release_memory_occupation(self, *, tags: Sequence[str] | None = None) -> object:
        return self.client.release_memory_occupation(tags)

    def resume_memory_occupation(self, *, tags: Sequence[str] | None = None) -> object:
        return self.client.resume_memory_occupation(tags)

    def continue_generation(self, *, torch_empty_cache: bool = True) -> object:
        return self.client.continue_generation(torch_empty_cache)


class FailingStore:
    """A ``JournalStore`` over a file store whose ``append`` raises ``OSError(ENOSPC)`` (a full disk) on chosen records.

    ``fails``: called with each record about to be appended and how many appends matched before; True: raise
    instead of writing it (the file is left as it was). ``failed``: the records refused.
    """

    def __init__(self, path: Path, fails: Callable[[bytes, int], bool]) -> None:
        self.inner = FileJournalStore(path)
        self.fails = fails
        self.failed: list[bytes] = []
        self._seen = 0

    @property
    def name(self) -> str:
        return self.inner.name

    def load(self) -> Loaded:
        return self.inner.load()

    def append(self, record: bytes) -> None:
        if self.fails(record, len(self.failed)):
            self.failed.append(record)
            raise OSError(errno.ENOSPC, "No space left on device (injected)", self.inner.name)
        self.inner.append(record)

    def rewrite(self, records: Sequence[bytes]) -> None:
        self.inner.rewrite(records)

    def close(self) -> None:
        self.inner.close()


def test_the_failing_store_is_a_journal_store(tmp_path: Path) -> None:
    """The wrapper stands behind the ``JournalStore`` seam, as the orchestrator takes it."""
    store = FailingStore(tmp_path / "j", lambda _r, _n: False)
    try:
        assert isinstance(store, JournalStore)
    finally:
        store.close()


# -- item: an engine restarted while no controller watched ---------------------------------------------------


@pytest.mark.parametrize(
    ("probe", "use_async"),
    [(True, False), (False, False), (False, True)],
    ids=["with-probe", "without-probe", "without-probe-async"],
)
def test_an_engine_restarted_while_the_controller_was_dead_is_taken_as_new(
    engines: EmulatedFleet, tmp_path: Path, probe: bool, use_async: bool
) -> None:
    """Offload; SIGKILL the controller; restart engine 0 (fresh, same URL); a new controller's onload resumes engine 1
    only, takes engine 0 as new (named in its report), and no engine dies; afterwards both serve. Without the probe
    the engine's own ``/ready`` tells, on threads and on an event loop (``AsyncOrchestrator``)."""
    journal = str(tmp_path / "barrier.journal")
    flags = (*(("--probe-dir", str(engines.memory_state_dir)) if probe else ()), *(("--async",) if use_async else ()))
    urls = engines.direct_urls
    first = Controller(urls, "--journal", journal, "--ops", "offload,train", "--train-s", "60", *flags)
    try:
        end = first.wait_for("end", READY_S, i=0)
        assert end is not None and end["ok"], f"{first.seen} {first.stderr}"
    finally:
        first.kill()  # SIGKILL while it "trains": the journal says both engines are released
    assert all(e.state()["released_tags"] for e in engines.engines)
    engines.engines[0].restart()  # a fresh process on the same URL: all its memory, serving
    since = _logs_at(engines)
    second = Controller(urls, "--journal", journal, "--ops", "onload", *flags)
    try:
        rc = second.wait(END_S)
    finally:
        second.kill()
    assert _deaths(engines, since) == {}, f"{second.seen} {second.stderr}"
    assert rc == 0, second.stderr
    end = next((line for line in second.seen if line.get("event") == "end"), None)
    assert end is not None and end["ok"], second.seen
    assert list(end["replaced"]) == [urls[0]], end
    assert all(_serving(e) for e in engines.engines), [e.state() for e in engines.engines]
    assert _releases(engines.engines[1]) >= 1  # engine 1 was the journal's: released by the first controller, resumed by the second


# -- item: pause and flush again before a release, after a resume ----------------------------------------------


def _journal_paused_flushed(path: Path, clients: Sequence[SGLangClient]) -> None:
    """What a controller killed right after its offload's flush leaves: every engine paused and flushed (on the
    engines and in the journal, with the offload's hold), nothing released."""
    for client in clients:
        client.pause_generation("abort")
        client.flush_cache()
    names = [c.engine for c in clients]
    journal = Journal(path)
    try:
        journal.open(names)
        know = {n: EngineKnowledge(n, paused=True, flushed=True, pause_mode="abort", holds={0: "offload"}) for n in names}
        journal.commit(know, names, "offload flush")
    finally:
        journal.close()


@pytest.mark.parametrize("wrap", [False, True], ids=["sglang-client", "control-calls-only"])
def test_after_a_resume_offload_pauses_and_flushes_again_before_releasing(engines: EmulatedFleet, tmp_path: Path, wrap: bool) -> None:
    """Journal "paused, flushed"; engine 0 restarted and serving traffic; the new controller's offload pauses it before
    its release (with its client's ``/ready`` read, and without any read): no engine dies, and onload brings both back."""
    path = tmp_path / "barrier.journal"
    clients = _clients(engines)
    try:
        _journal_paused_flushed(path, clients)
        engines.engines[0].restart()
        since, released_before = _logs_at(engines), [_releases(e) for e in engines.engines]
        with Traffic(engines.direct_urls[:1]) as traffic:
            for _ in range(10_000):  # until the fresh engine 0 has answered traffic (bounded)
                if traffic.counts["answered"] >= 3:
                    break
                engines.engines[0].state()
            group: list[Any] = [ControlOnly(c) for c in clients] if wrap else list(clients)
            orch = Orchestrator(EngineGroup(group), deadlines=DEADLINES, journal=path)
            try:
                report = orch.offload()
                assert _deaths(engines, since) == {}
                assert [_releases(e) - b for e, b in zip(engines.engines, released_before, strict=True)] == [1, 1]
                if not wrap:  # the client's /ready told: engine 0 is a fresh process
                    assert list(report.replaced) == [clients[0].engine]
                pause_calls = [c for c in engines.engines[0].record()["calls"] if c["path"] == "/pause_generation"]
                assert pause_calls, "engine 0 was released without a pause"
                orch.onload()
            finally:
                orch.close()
        assert _deaths(engines, since) == {}
        assert traffic.counts["error"] == 0, traffic.errors
        assert all(_serving(e) for e in engines.engines)
    finally:
        for c in clients:
            c.close()


# -- item: a write-ahead that failed ------------------------------------------------------------------------


def _release_write_ahead(record: bytes, failed_before: int) -> bool:
    """The release's write-ahead record, the first time only."""
    return failed_before == 0 and b"sending release_memory_occupation" in record


def test_a_release_whose_write_ahead_failed_is_not_maybe_sent(engines: EmulatedFleet, tmp_path: Path) -> None:
    """ENOSPC on the release's write-ahead: offload raises it, no release reached an engine, nothing is quarantined, and
    the same controller's onload, offload and onload work; every engine serves at the end."""
    store = FailingStore(tmp_path / "barrier.journal", _release_write_ahead)
    clients = _clients(engines)
    since, released_before = _logs_at(engines), [_releases(e) for e in engines.engines]
    events: list[Event] = []
    orch = Orchestrator(EngineGroup(clients), deadlines=DEADLINES, journal=store, observers=[events.append])
    try:
        with pytest.raises(OSError) as info:
            orch.offload()
        assert info.value.errno == errno.ENOSPC and len(store.failed) == 1
        assert [_releases(e) for e in engines.engines] == released_before  # no release left
        ended = [e for e in events if isinstance(e, PhaseEnded) and e.phase == "release"]
        assert len(ended) == 1 and {f.error_type for f in ended[0].failures} == {"OSError"}  # the phase ended for observers
        assert orch.quarantined() == {}
        orch.onload()
        assert orch.not_serving() == {}
        orch.offload()
        orch.onload()
        assert orch.quarantined() == {} and orch.not_serving() == {}
    finally:
        orch.close()
        for c in clients:
            c.close()
    assert _deaths(engines, since) == {}
    assert all(_serving(e) for e in engines.engines)
    assert Journal.read_only(tmp_path / "barrier.journal") != {}  # the journal kept going after the failed record


# -- item: a weight_sync whose hold record failed ------------------------------------------------------------------


def _nth_hold_record(n: int) -> Callable[[bytes, int], bool]:
    """The ``n``-th record a ``weight_sync`` writes (its holds come first), once."""
    seen = [0]

    def fails(record: bytes, failed_before: int) -> bool:
        if failed_before or b'"why":"weight_sync' not in record:
            return False
        seen[0] += 1
        return seen[0] == n

    return fails


@pytest.mark.parametrize("n", [1, 2], ids=["first-hold", "second-hold"])
def test_a_weight_sync_whose_hold_record_failed_leaves_no_hold(engines: EmulatedFleet, tmp_path: Path, n: int) -> None:
    """ENOSPC on the n-th hold record of a weight_sync: it raises before its body, no engine is held by it, and after the
    next offload and onload every engine serves."""
    store = FailingStore(tmp_path / "barrier.journal", _nth_hold_record(n))
    clients = _clients(engines)
    since = _logs_at(engines)
    orch = Orchestrator(EngineGroup(clients), deadlines=DEADLINES, journal=store)
    ran = False
    try:
        with pytest.raises(OSError):
            with orch.weight_sync():
                ran = True
        assert not ran and len(store.failed) == 1
        assert orch.held() == {}
        orch.offload()
        report = orch.onload()
        assert report.held == {} and orch.not_serving() == {}
    finally:
        orch.close()
        for c in clients:
            c.close()
    assert _deaths(engines, since) == {}
    assert all(_serving(e) for e in engines.engines), [e.state() for e in engines.engines]
    again = Journal(tmp_path / "barrier.journal")
    try:
        resumed = again.open([c.engine for c in clients])
        assert all(not k.holds for k in resumed.knowledge.values()), resumed.knowledge
    finally:
        again.close()


# -- the same on vLLM: /is_paused tells ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vllm_fleet() -> Iterator[EmulatedFleet]:
    """Two emulated vLLM 0.33.0 engines with sleep mode, for the module."""
    from resilience.testing.emulator.vllm import VLLMEngineConfig

    with EmulatedFleet(2, VLLMEngineConfig(dev_mode=True, enable_sleep_mode=True, token_rate=400.0)) as f:
        yield f


def test_a_restarted_vllm_engine_is_taken_as_new_by_its_is_paused_answer(vllm_fleet: EmulatedFleet, tmp_path: Path) -> None:
    """Offload two vLLM engines on a journal, let the controller go, restart engine 0: the next controller's onload
    takes engine 0 as new (it answers ``/is_paused`` false while the journal says asleep) and wakes engine 1 only."""
    from resilience.adapters.vllm import VLLMEngine
    from tests.vllm.conftest import FAST_VLLM

    path = tmp_path / "barrier.journal"
    made = [VLLMEngine(u, policies=FAST_VLLM) for u in vllm_fleet.direct_urls]
    try:
        first = Orchestrator(EngineGroup(made), deadlines=DEADLINES, journal=path)
        try:
            first.offload()
        finally:
            first.close()  # its journal says both engines are asleep
        vllm_fleet.engines[0].restart()
        wakes_before = [_calls(e, "/wake_up") for e in vllm_fleet.engines]
        second = Orchestrator(EngineGroup(made), deadlines=DEADLINES, journal=path)
        try:
            report = second.onload()
            assert list(report.replaced) == [made[0].engine], report.replaced
            assert second.not_serving() == {}
        finally:
            second.close()
        wakes = [_calls(e, "/wake_up") - b for e, b in zip(vllm_fleet.engines, wakes_before, strict=True)]
        assert wakes[0] == 0 and wakes[1] >= 1, wakes
        for e in vllm_fleet.engines:
            assert e.alive(), e.log()
            state = e.state()
            assert (state["pause_state"], state["sleeping_tags"]) == ("unpaused", []), state
    finally:
        for engine in made:
            engine.close()


# -- a fan-out that cannot send the read ----------------------------------------------------------------------------


class _ReadyFake(FakeEngine):
    """A fake SGLang engine with ``ready`` (``/ready``: 200 only when not paused)."""

    def ready(self) -> bool:
        return not self.paused


class _ControlCallsOnly(ThreadFanOut):
    """A fan-out that sends the five control calls only, as the smg gateway's does: any other raises, for the phase."""

    def call(self, calls: Calls, method: str, deadline: Deadline) -> list[EngineResult]:
        if method not in CONTROL_METHODS:
            raise ValueError(f"cannot send {method!r}: not a barrier control call")
        return super().call(calls, method, deadline)


def test_a_fan_out_that_cannot_send_the_read_leaves_the_journal_standing(tmp_path: Path) -> None:
    """Socket-free: the read raises in the fan-out; the onload goes on with the journal's knowledge (it resumes both
    engines, which really were released), and nothing is taken as new."""
    path = tmp_path / "barrier.journal"
    fakes = [_ReadyFake("http://fake-0:1"), _ReadyFake("http://fake-1:1")]
    first = Orchestrator(EngineGroup(fakes), deadlines=DEADLINES, journal=path)
    try:
        first.offload()
    finally:
        first.close()
    second = Orchestrator(EngineGroup(fakes), deadlines=DEADLINES, journal=path, fanout=_ControlCallsOnly())
    try:
        report = second.onload()
    finally:
        second.close()
    assert report.replaced == {}
    assert all(f.crash is None and f.serving for f in fakes), [f.crash for f in fakes]
