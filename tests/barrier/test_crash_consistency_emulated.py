"""Crash consistency on real emulated engines: a controller may die at any instant, and no engine dies.

Three emulated engines (``EmulatedFleet``, each its own process, children of the test and not
of any controller) take generation traffic the whole time (``crash_rig.Traffic``). Controller
processes (``controller_main.py``) run transitions on them and are SIGKILLed at random moments,
calls in flight included (the engines' swaps take ``SWAP_S``, and kills land up to
``KILL_WINDOW_S`` after a transition began). Each new controller starts on the same journal.

- With the journal: no engine ever dies (alive, ``/health`` answers, nothing in its crash log),
  and the last controller runs to an end: a normal return, or ``PhaseFailed`` naming every
  engine that is not serving. Without a memory probe, a kill during a release leaves it "maybe
  applied" and the engines quarantined; with the emulator's probe (a side channel, not HTTP) the
  controllers ask it, and the last one returns normally with every engine serving. Both
  orchestrators run it (``--async``).
- Without it (a fresh controller each restart, as before Barrier v3): an offload, a kill while
  training, and the next controller's offload release the engines' memory a second time; the
  engines die. That test asserts the deaths: the rig can see the failure it guards against.

``CPR_CRASH_ROUNDS`` sets the random kills per test (default 8: the file runs in under a minute; 50 for a long run).
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("torch")

from resilience.testing.emulator import EmulatedFleet, EngineConfig
from tests.barrier.crash_rig import Controller, Traffic, crash_causes, health, put_in_order

N_ENGINES = 3
SWAP_S = 0.15
"""How long each release or resume holds an engine's scheduler: the window where a kill cuts a call in flight."""
CONFIG = EngineConfig(token_rate=400.0, health_hang_seconds=1.0, health_poll_seconds=0.05, abort_poll_seconds=0.05, swap_seconds=SWAP_S)
ROUNDS = int(os.environ.get("CPR_CRASH_ROUNDS", "8"))
"""Controllers SIGKILLed at random moments before the last one runs to its end."""
KILL_WINDOW_S = 0.5
"""A kill lands uniformly within this many seconds after the chosen transition began."""
READY_S = 60.0
"""Seconds a controller may take to import, read its journal and print ``ready`` (a loaded CI box)."""
FINAL_S = 120.0


@pytest.fixture(scope="module")
def fleet() -> Iterator[EmulatedFleet]:
    """Three emulated engines for the module; they outlive every controller (the fleet stops them by PID)."""
    with EmulatedFleet(N_ENGINES, CONFIG) as f:
        yield f


@pytest.fixture
def engines(fleet: EmulatedFleet) -> Iterator[EmulatedFleet]:
    """The fleet, every engine alive and serving with all its memory at the start of the test."""
    put_in_order(fleet)
    yield fleet


def _logs_at(fleet: EmulatedFleet) -> list[int]:
    return [len(e.log()) for e in fleet.engines]


def _new_causes(fleet: EmulatedFleet, since: list[int]) -> dict[int, list[str]]:
    """Per engine, what killed it since ``since`` (its log length then); engines that never crashed left out."""
    from resilience.cli.story import death_causes

    out = {}
    for engine, start in zip(fleet.engines, since, strict=True):
        causes = death_causes(engine.log()[start:])
        if causes:
            out[engine.index] = causes
    return out


def _releases(fleet: EmulatedFleet) -> list[int]:
    """Per engine, the releases it received so far (its server-side record)."""
    return [sum(1 for c in e.record()["calls"] if c["path"] == "/release_memory_occupation") for e in fleet.engines]


def _kill_in_release(controller: Controller, rng: random.Random) -> str:
    """SIGKILL the controller a random moment within ``SWAP_S`` after its first release phase began (the engines swap)."""
    line = controller.wait_for("phase", READY_S, phase="release")
    assert line is not None, f"no release phase: {controller.seen} {controller.stderr}"
    controller.next_line(rng.uniform(0.0, SWAP_S))  # the release's own end comes after SWAP_S at the earliest
    controller.kill()
    return "kill mid-transition (offload:release)"


def _kill_at_random(controller: Controller, rng: random.Random, transitions: int) -> str:
    """SIGKILL the controller at a random moment; says where it landed.

    Two times in three, while a phase's calls are in flight: a random moment within ``SWAP_S`` after
    the k-th phase began (k drawn from 0-5). Else a random moment within ``KILL_WINDOW_S`` after a
    random transition began (between calls, or after it ended).
    """
    if controller.wait_for("ready", READY_S) is None:
        controller.wait(READY_S)
        return "ended before ready"
    if rng.random() < 2 / 3:
        target, window = rng.randrange(6), SWAP_S
        line: dict[str, Any] | None = None
        for _ in range(target + 1):
            line = controller.wait_for("phase", READY_S)
            if line is None:
                break
        where = f"{line['transition']}:{line['phase']}" if line is not None else None
    else:
        index, window = rng.randrange(transitions), KILL_WINDOW_S
        line = controller.wait_for("begin", READY_S, i=index)
        where = f"{line['op']} {index}" if line is not None else None
    if line is None:  # it ended (or failed) first: nothing to kill
        controller.wait(READY_S)
        return "ended before the kill"
    deadline = time.monotonic() + rng.uniform(0.0, window)
    ended = False
    for _ in range(1000):  # lines that arrive before the kill: did the transition end first?
        left = deadline - time.monotonic()
        if left <= 0:
            break
        seen = controller.next_line(left)
        if seen is None:
            break
        ended = ended or seen.get("event") == "end"
    controller.kill()
    return f"kill {'after the transition ended' if ended else 'mid-transition'} ({where})"


def _check_alive(fleet: EmulatedFleet, since: list[int], traffic: Traffic, log: list[str], *, health_too: bool = False) -> None:
    """No engine died: its process runs, its crash log is empty, traffic met no refused connection; ``health_too``: /health answers.

    ``/health`` on a paused engine hangs ``health_hang_seconds`` and answers 503 (SGLang's behaviour): an answer, asked at the end.
    """
    causes = _new_causes(fleet, since)
    dead = [e.index for e in fleet.engines if not e.alive()]
    assert not dead and not causes, f"engines died: {dead} causes {causes} after {log}"
    if health_too:
        statuses = [health(e) for e in fleet.engines]
        assert all(s is not None for s in statuses), f"/health did not answer: {statuses} after {log}"
    assert traffic.counts["error"] == 0, f"traffic errors {traffic.errors} after {log}"


def _check_final(fleet: EmulatedFleet, final: dict[str, Any] | None, log: list[str]) -> None:
    """The last controller reached an end: a normal return with every engine serving, or a PhaseFailed naming every engine not serving."""
    assert final is not None, f"the last controller printed no final line after {log}"
    urls = {e.direct_url: e for e in fleet.engines}
    not_serving = {url for url, e in urls.items() if e.state()["paused"] or e.state()["released_tags"]}
    if final["ok"]:
        assert not not_serving, f"the final onload returned but {sorted(not_serving)} do not serve; {final}; {log}"
    else:
        named = set(final["left_paused"]) | set(final["quarantined"]) | set(final["dead"])
        assert not_serving <= named, f"PhaseFailed left {sorted(not_serving - named)} unnamed: {final}; {log}"
    for url, engine in urls.items():
        state = engine.state()
        assert state["paused"] or not state["released_tags"], f"{url} serves with {state['released_tags']} released; {log}"


def _crash_rounds(engines: EmulatedFleet, tmp_path: Path, seed: int, rounds: int, *extra: str) -> dict[str, Any]:
    journal = str(tmp_path / "barrier.journal")
    rng = random.Random(seed)
    since = _logs_at(engines)
    log: list[str] = []
    with Traffic(engines.direct_urls) as traffic:
        first = Controller(engines.direct_urls, "--journal", journal, "--ops", "offload,onload", *extra)
        try:  # the first kill always lands while a release is in flight: its outcome is what the journal must not forget
            log.append(f"round first: {_kill_in_release(first, rng)}")
        finally:
            first.kill()
        _check_alive(engines, since, traffic, log)
        for n in range(rounds):
            controller = Controller(engines.direct_urls, "--journal", journal, "--seed", str(seed * 1000 + n), "--transitions", "4", *extra)
            try:
                log.append(f"round {n}: {_kill_at_random(controller, rng, 4)}")
                log.extend(f"  {line}" for line in controller.seen if line.get("event") == "end" and not line.get("ok"))
            finally:
                controller.kill()
            assert "Traceback" not in controller.stderr, controller.stderr
            _check_alive(engines, since, traffic, log)
        last = Controller(engines.direct_urls, "--journal", journal, "--seed", str(seed), "--transitions", "2", "--final", *extra)
        try:
            rc = last.wait(FINAL_S)
        finally:
            last.kill()
        assert rc == 0, last.stderr
        final = next((line for line in last.seen if line.get("event") == "final"), None)
        log.append(f"final: {final}")
        _check_alive(engines, since, traffic, log, health_too=True)
        _check_final(engines, final, log)
    assert traffic.counts["answered"] > 0, traffic.counts  # the engines really served between the controllers
    assert any("mid-transition" in line for line in log), log  # kills cut transitions, not only the gaps between them
    assert final is not None
    return final


def test_sigkilled_controllers_on_one_journal_never_kill_an_engine(engines: EmulatedFleet, tmp_path: Path) -> None:
    """Controllers SIGKILLed at random moments on one journal, no probe: no engine dies; the last names what it cannot prove.

    The first kill lands while every engine releases: those releases stay "ambiguous" in the journal, so every
    later controller skips the engines as quarantined (it sends them nothing), and the last one's PhaseFailed names them.
    """
    final = _crash_rounds(engines, tmp_path, 1, ROUNDS)
    assert final["ok"] is False and set(final["quarantined"]) == set(engines.direct_urls), final


@pytest.mark.parametrize(("seed", "orchestrator"), [(3, "Orchestrator"), (4, "AsyncOrchestrator")])
def test_with_the_memory_probe_the_last_controller_brings_every_engine_back(
    engines: EmulatedFleet, tmp_path: Path, seed: int, orchestrator: str
) -> None:
    """The same kills, controllers with the emulator's memory probe: what a kill left unknown is asked, and the end is a normal return."""
    flags = ("--probe-dir", str(engines.memory_state_dir), *(("--async",) if orchestrator == "AsyncOrchestrator" else ()))
    final = _crash_rounds(engines, tmp_path, seed, ROUNDS, *flags)
    assert final["ok"] is True, final


def test_restart_after_offload_resumes_from_the_journal(engines: EmulatedFleet, tmp_path: Path) -> None:
    """Offload, a kill while training, a new controller on the journal: its offload sends no second release; its onload serves."""
    journal = str(tmp_path / "barrier.journal")
    since, releases_before = _logs_at(engines), _releases(engines)
    with Traffic(engines.direct_urls) as traffic:
        first = Controller(engines.direct_urls, "--journal", journal, "--ops", "offload,train")
        try:
            assert first.wait_for("end", READY_S, op="offload") is not None, first.stderr
        finally:
            first.kill()
        second = Controller(engines.direct_urls, "--journal", journal, "--ops", "offload,onload")
        try:
            assert second.wait(FINAL_S) == 0, second.stderr
        finally:
            second.kill()
        ends = [line for line in second.seen if line.get("event") == "end"]
        assert [(e["op"], e["ok"]) for e in ends] == [("offload", True), ("onload", True)], ends
        _check_alive(engines, since, traffic, [str(ends)], health_too=True)
    sent = [after - before for before, after in zip(releases_before, _releases(engines), strict=True)]
    assert sent == [1] * N_ENGINES, sent  # one release per engine: the restarted offload knew it was done
    for engine in engines.engines:
        state = engine.state()
        assert not state["paused"] and not state["released_tags"], state


def test_without_a_journal_a_restarted_controller_releases_twice_and_kills_the_engines(engines: EmulatedFleet) -> None:
    """The baseline: offload, a kill while training, a fresh controller's offload: every engine dies of a second release."""
    since = _logs_at(engines)
    first = Controller(engines.direct_urls, "--ops", "offload,train")
    try:
        assert first.wait_for("end", READY_S, op="offload") is not None, first.stderr
    finally:
        first.kill()
    second = Controller(engines.direct_urls, "--ops", "offload")
    try:
        second.wait(FINAL_S)
    finally:
        second.kill()
    for engine in engines.engines:
        engine.wait_exit(10.0)
    causes = _new_causes(engines, since)
    assert {i: c for i, c in causes.items()} == {e.index: ["release sent twice"] for e in engines.engines}, (causes, second.seen)
    assert not any(e.alive() for e in engines.engines)
    assert all(crash_causes(e) for e in engines.engines)


def _release_record_offset(journal: Path) -> tuple[int, int]:
    """(length of the header line, offset of the release's write-ahead record) in a journal an offload wrote."""
    lines = journal.read_bytes().splitlines(keepends=True)
    offset = 0
    for line in lines:
        if b"sending release_memory_occupation" in line:
            return len(lines[0]), offset
        offset += len(line)
    raise AssertionError(f"no release write-ahead record in {journal}: {lines}")


def test_a_disk_that_fills_inside_the_releases_write_ahead_record_stops_the_controller_before_the_release(
    engines: EmulatedFleet, tmp_path: Path
) -> None:
    """A real short write (RLIMIT_FSIZE set on the controller, 40 bytes into the release's write-ahead record): the record is
    cut back and not counted, so no release leaves; the next controller's offload releases once and its onload serves.

    Barrier v3 ignored ``os.write``'s count: the torn record counted as written, the releases went out, and the next
    controller (the torn tail dropped, "flushed" resumed) released a second time: every engine died.
    """
    import resource

    dry = tmp_path / "dry.journal"
    first = Controller(engines.direct_urls, "--journal", str(dry), "--ops", "offload")
    try:
        assert first.wait(FINAL_S) == 0, first.stderr
    finally:
        first.kill()
    dry_header, dry_release = _release_record_offset(dry)
    put_in_order(engines)
    since, releases_before = _logs_at(engines), _releases(engines)
    journal = tmp_path / "barrier.journal"
    with Traffic(engines.direct_urls) as traffic:
        limited = Controller(engines.direct_urls, "--journal", str(journal), "--ops", "train,offload", "--train-s", "2")
        try:
            assert limited.wait_for("ready", READY_S) is not None, limited.stderr
            limit = journal.stat().st_size - dry_header + dry_release + 40  # the same records before it, give or take a digit
            resource.prlimit(limited.proc.pid, resource.RLIMIT_FSIZE, (limit, limit))
            assert limited.wait_for("begin", READY_S, op="offload") is not None, limited.stderr
            rc = limited.wait(FINAL_S)
        finally:
            limited.kill()
        early = [after - before for before, after in zip(releases_before, _releases(engines), strict=True)]
        size = journal.stat().st_size
        second = Controller(engines.direct_urls, "--journal", str(journal), "--ops", "offload,onload")
        try:
            second.wait(FINAL_S)
        finally:
            second.kill()
        ends = [line for line in second.seen if line.get("event") == "end"]
        _check_alive(engines, since, traffic, [f"releases before the second controller: {early}", str(ends)], health_too=True)
        assert [(e["op"], e["ok"]) for e in ends] == [("offload", True), ("onload", True)], (ends, second.stderr)
    assert early == [0] * N_ENGINES, "a release left although its write-ahead record was not durable"
    assert rc != 0 and "JournalError" in limited.stderr and "not durable" in limited.stderr, (rc, limited.stderr[-2000:])
    assert size < limit  # cut back to the record before the release's
    sent = [after - before for before, after in zip(releases_before, _releases(engines), strict=True)]
    assert sent == [1] * N_ENGINES, sent
