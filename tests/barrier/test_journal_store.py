"""The journal's stores and records: durable appends, a torn or corrupt tail cut off and named, one writer, other engines refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from resilience.barrier.journal import Journal, JournalError, JournalMismatch
from resilience.barrier.journal_store import FileJournalStore, JournalBusy, RayKVJournalStore, frame, unframe
from resilience.barrier.knowledge import EngineKnowledge
from resilience.budget import RestartBudget

ENGINES = ["http://127.0.0.1:1", "http://127.0.0.1:2"]


def _know(**facts: Any) -> dict[str, EngineKnowledge]:
    return {n: EngineKnowledge(n, **facts) for n in ENGINES}


def test_records_round_trip_through_a_file_and_survive_reopening(tmp_path: Path) -> None:
    store = FileJournalStore(tmp_path / "j")
    for i in range(5):
        store.append(json.dumps({"i": i}).encode())
    store.close()
    again = FileJournalStore(tmp_path / "j")
    loaded = again.load()
    again.close()
    assert [json.loads(r)["i"] for r in loaded.records] == [0, 1, 2, 3, 4]
    assert loaded.dropped is None


@pytest.mark.parametrize("damage", ["torn", "bitflip"])
def test_a_torn_or_corrupt_tail_is_ignored_up_to_the_last_complete_record_and_named(tmp_path: Path, damage: str) -> None:
    path = tmp_path / "j"
    data = b"".join(frame(b'{"i":%d}' % i) for i in range(3))
    if damage == "torn":
        data += frame(b'{"i":3}')[:-4]
    else:
        bad = bytearray(frame(b'{"i":3}'))
        bad[12] ^= 0x01
        data += bytes(bad) + frame(b'{"i":4}')
    path.write_bytes(data)
    loaded = unframe(path.read_bytes(), str(path))
    assert [json.loads(r)["i"] for r in loaded.records] == [0, 1, 2]
    assert loaded.dropped is not None and "after record 3" in loaded.dropped and str(path) in loaded.dropped
    assert ("no end of line" in loaded.dropped) == (damage == "torn")
    assert ("fails its checksum" in loaded.dropped) == (damage == "bitflip")


def test_a_second_controller_on_the_same_journal_is_refused_while_the_first_lives(tmp_path: Path) -> None:
    first = FileJournalStore(tmp_path / "j")
    try:
        with pytest.raises(JournalBusy, match=f"pid {os.getpid()}"):
            FileJournalStore(tmp_path / "j")
    finally:
        first.close()
    FileJournalStore(tmp_path / "j").close()  # free again once the first let go


def test_a_controller_killed_outright_leaves_the_journal_usable(tmp_path: Path) -> None:
    path = tmp_path / "j"
    script = (
        "import os, sys\n"
        "from resilience.barrier.journal_store import FileJournalStore\n"
        "s = FileJournalStore(sys.argv[1])\n"
        "s.append(b'{\"i\":0}')\n"
        "os.kill(os.getpid(), 9)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script, str(path)], timeout=60, check=False)
    assert proc.returncode == -9
    store = FileJournalStore(path)  # the kernel dropped the dead process's lock
    try:
        assert [json.loads(r) for r in store.load().records] == [{"i": 0}]
    finally:
        store.close()


def test_a_journal_resumes_knowledge_holds_and_the_restart_budget(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "j")
    resumed = journal.open(ENGINES)
    assert not resumed.recovery.resumed and resumed.knowledge == {}
    know = _know(paused=True, flushed=True)
    know[ENGINES[0]].released = {"kv_cache"}
    know[ENGINES[1]].unknown = {"weights"}
    know[ENGINES[1]].holds = {7: "weight_sync"}
    budget = RestartBudget(3)
    budget.record("oom", step=4)
    journal.commit(know, ENGINES, "release outcome", budget=budget)
    journal.close()

    again = Journal(tmp_path / "j")
    resumed = again.open(list(reversed(ENGINES)))
    again.close()
    recovery, known = resumed.recovery, resumed.knowledge
    assert recovery.resumed and recovery.records == 2 and recovery.dropped is None
    assert known[ENGINES[0]].released == {"kv_cache"} and known[ENGINES[0]].paused is True
    assert known[ENGINES[1]].unknown == {"weights"} and known[ENGINES[1]].holds == {7: "weight_sync"}
    assert recovery.orphaned_holds == {}  # the owner (this process) is alive
    assert str(recovery.states[ENGINES[1]]) == "quarantined"
    assert resumed.budget is not None and resumed.budget["restarts"][0]["cause"] == "oom"


def test_a_hold_whose_owner_process_is_gone_is_named(tmp_path: Path) -> None:
    script = (
        "import sys\n"
        "from resilience.barrier.journal import Journal\n"
        "from resilience.barrier.knowledge import EngineKnowledge\n"
        "j = Journal(sys.argv[1]); names = sys.argv[2:]; j.open(names)\n"
        "know = {n: EngineKnowledge(n, paused=True, holds={3: 'weight_sync'}) for n in names}\n"
        "j.commit(know, names, 'weight_sync pause')\n"
    )
    subprocess.run([sys.executable, "-c", script, str(tmp_path / "j"), *ENGINES], timeout=60, check=True)
    journal = Journal(tmp_path / "j")
    recovery = journal.open(ENGINES).recovery
    journal.close()
    assert set(recovery.orphaned_holds) == set(ENGINES)
    assert all("weight_sync (pid" in h[0] and "gone" in h[0] for h in recovery.orphaned_holds.values())
    assert "holds whose owner is gone" in recovery.summary()


def test_a_journal_for_other_engines_is_refused_naming_the_difference(tmp_path: Path) -> None:
    first = Journal(tmp_path / "j")
    first.open(ENGINES)
    first.close()
    with pytest.raises(JournalMismatch, match=r"not given: http://127.0.0.1:2.*not in the journal: http://127.0.0.1:3"):
        Journal(tmp_path / "j").open([ENGINES[0], "http://127.0.0.1:3"])


def test_a_file_that_is_not_a_journal_is_refused_and_left_alone(tmp_path: Path) -> None:
    path = tmp_path / "j"
    path.write_bytes(frame(b'{"something":"else"}'))
    before = path.read_bytes()
    with pytest.raises(JournalError, match="not a controlplane-resilience/barrier-journal journal"):
        Journal(path).open(ENGINES)
    assert path.read_bytes() == before


def test_a_dropped_tail_is_cut_off_so_later_records_are_not_lost_behind_it(tmp_path: Path) -> None:
    path = tmp_path / "j"
    journal = Journal(path)
    journal.open(ENGINES)
    journal.commit(_know(paused=True), ENGINES, "pause outcome")
    journal.close()
    with open(path, "ab") as fh:
        fh.write(b'deadbeef {"k":"st')  # a record torn by a crash
    again = Journal(path)
    resumed = again.open(ENGINES)
    recovery, known = resumed.recovery, resumed.knowledge
    assert recovery.dropped is not None and known[ENGINES[0]].paused is True
    know = _know(paused=False)
    again.commit(know, ENGINES, "continue outcome")
    again.close()
    third = Journal(path)
    resumed = third.open(ENGINES)
    third.close()
    recovery, known = resumed.recovery, resumed.knowledge
    assert recovery.dropped is None and known[ENGINES[0]].paused is False


def test_compaction_keeps_what_the_journal_knows(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "j", compact_after=4)
    journal.open(ENGINES)
    for i in range(9):
        know = _know(paused=bool(i % 2))
        journal.commit(know, ENGINES, f"step {i}")
    journal.close()
    lines = (tmp_path / "j").read_bytes().count(b"\n")
    assert lines < 4
    again = Journal(tmp_path / "j")
    known = again.open(ENGINES).knowledge
    again.close()
    assert known[ENGINES[0]].paused is False  # step 8


def test_a_commit_that_changes_nothing_writes_nothing(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "j")
    journal.open(ENGINES)
    know = _know(paused=True)
    journal.commit(know, ENGINES, "a")
    size = (tmp_path / "j").stat().st_size
    journal.commit(know, ENGINES, "b")
    journal.close()
    assert (tmp_path / "j").stat().st_size == size


def test_the_ray_kv_store_keeps_records_across_store_objects(ray_runtime: Any) -> None:
    key = f"test-journal-{os.getpid()}"
    store = RayKVJournalStore(key)
    journal = Journal(store, compact_after=3)
    journal.open(ENGINES)
    for i in range(4):
        journal.commit(_know(paused=bool(i % 2)), ENGINES, f"step {i}")
    again = Journal(RayKVJournalStore(key))
    resumed = again.open(ENGINES)
    recovery, known = resumed.recovery, resumed.knowledge
    assert recovery.resumed and recovery.records >= 2
    assert known[ENGINES[0]].paused is True  # step 3
    assert again.name == f"ray-kv://controlplane-resilience/{key}"


def test_the_ray_kv_store_refuses_a_bad_key() -> None:
    with pytest.raises(JournalError, match=r"RayKVJournalStore\.key"):
        RayKVJournalStore("a/b")
