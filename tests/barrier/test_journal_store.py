"""The journal's stores and records: durable appends, a torn tail cut off and named, a corrupt record refused, one writer,
other engines refused, orphaned holds named."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from resilience.barrier.journal import FORMAT, Journal, JournalError, JournalMismatch, RestartBudget, _boot_id, _me, _started, read_journal
from resilience.barrier.journal_store import FileJournalStore, JournalBusy, JournalCorrupt, frame, unframe
from resilience.barrier.state import EngineKnowledge
from tests.barrier.journal_faults import FaultyOS

ENGINES = ["http://127.0.0.1:1", "http://127.0.0.1:2"]
REPO = Path(__file__).resolve().parents[2]


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


def test_a_torn_tail_is_ignored_up_to_the_last_complete_record_and_named(tmp_path: Path) -> None:
    """The last record without its end of line (a crash cut its write): left out, and what was left out is said."""
    path = tmp_path / "j"
    data = b"".join(frame(b'{"i":%d}' % i) for i in range(3)) + frame(b'{"i":3}')[:-4]
    path.write_bytes(data)
    loaded = unframe(path.read_bytes(), str(path))
    assert [json.loads(r)["i"] for r in loaded.records] == [0, 1, 2]
    assert loaded.dropped is not None and "after record 3" in loaded.dropped and str(path) in loaded.dropped
    assert "no end of line" in loaded.dropped


@pytest.mark.parametrize("followed", [True, False])
def test_a_record_that_fails_its_checksum_is_corruption_not_a_torn_tail(tmp_path: Path, followed: bool) -> None:
    """A bit flip in a record that has its end of line, with or without a record after it: refused, naming record and offset."""
    path = tmp_path / "j"
    good = b"".join(frame(b'{"i":%d}' % i) for i in range(3))
    bad = bytearray(frame(b'{"i":3}'))
    bad[12] ^= 0x01
    data = good + bytes(bad) + (frame(b'{"i":4}') if followed else b"")
    path.write_bytes(data)
    with pytest.raises(JournalCorrupt, match=rf"record 3 \(the header is record 0\) at byte offset {len(good)} fails its checksum") as err:
        unframe(path.read_bytes(), str(path))
    assert (err.value.record, err.value.offset) == (3, len(good))
    store = FileJournalStore(path)
    try:
        with pytest.raises(JournalCorrupt):
            store.load()
        with pytest.raises(JournalCorrupt):
            store.append(b'{"i":5}')  # a store never writes after a damaged record
    finally:
        store.close()
    assert path.read_bytes() == data


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
        "from resilience.barrier.state import EngineKnowledge\n"
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


# -- who may open a journal ----------------------------------------------------------


def test_a_second_controller_through_a_symlink_is_refused(tmp_path: Path) -> None:
    """``current.journal -> run-42.journal``: one controller on each name would both write one journal; the second is refused."""
    (tmp_path / "current.journal").symlink_to("run-42.journal")
    first = FileJournalStore(tmp_path / "run-42.journal")
    try:
        with pytest.raises(JournalBusy, match=r"current\.journal \(-> .*run-42\.journal\) is open in another controller"):
            FileJournalStore(tmp_path / "current.journal")
    finally:
        first.close()
    second = FileJournalStore(tmp_path / "current.journal")
    try:
        with pytest.raises(JournalBusy):
            FileJournalStore(tmp_path / "run-42.journal")
    finally:
        second.close()


def test_a_compaction_through_a_symlink_rewrites_the_file_it_names_and_keeps_the_link(tmp_path: Path) -> None:
    """Compaction renames over what the link resolves to: the link stays a link, and both names read the compacted journal."""
    link = tmp_path / "current.journal"
    link.symlink_to("run-42.journal")
    journal = Journal(link, compact_after=3)
    journal.open(ENGINES)
    for i in range(4):
        journal.commit(_know(paused=bool(i % 2)), ENGINES, f"step {i}")
    journal.close()
    assert link.is_symlink() and os.readlink(link) == "run-42.journal"
    assert Journal.read_only(link)[ENGINES[0]].paused is True
    assert Journal.read_only(tmp_path / "run-42.journal")[ENGINES[0]].paused is True


def test_a_journal_with_a_second_name_is_refused(tmp_path: Path) -> None:
    """A hard link would give the journal a second lock file: refused, with what to do."""
    FileJournalStore(tmp_path / "j").close()
    os.link(tmp_path / "j", tmp_path / "other")
    with pytest.raises(JournalError, match="has 2 names"):
        FileJournalStore(tmp_path / "other")


def _unshare(*flags: str) -> list[str]:
    """``unshare`` with ``flags`` as an unprivileged user may run it; skips where user namespaces are not allowed."""
    probe = subprocess.run(["unshare", *flags, "true"], capture_output=True, timeout=30, check=False)
    if probe.returncode != 0:
        pytest.skip(f"unshare {' '.join(flags)} is not allowed here: {probe.stderr.decode(errors='replace').strip()}")
    return ["unshare", *flags]


def test_a_second_controller_through_a_bind_mount_of_the_folder_is_refused(tmp_path: Path) -> None:
    """The lock file lives in the journal's folder: a bind mount of the folder reaches the same lock, and flock holds across it."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    script = (
        "import sys\n"
        "from resilience.barrier.journal_store import FileJournalStore, JournalBusy\n"
        "first = FileJournalStore(sys.argv[1] + '/a/j')\n"
        "try:\n"
        "    FileJournalStore(sys.argv[1] + '/b/j')\n"
        "except JournalBusy as exc:\n"
        "    print('refused', exc)\n"
    )
    cmd = _unshare("--mount", "--map-root-user")
    shell = f'mount --bind "$1/a" "$1/b" && exec "{sys.executable}" -c "$2" "$1"'
    out = subprocess.run([*cmd, "sh", "-c", shell, "sh", str(tmp_path), script], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("refused") and "is open in another controller" in out.stdout, out.stdout


def test_a_journal_in_a_read_only_folder_is_refused_with_the_journals_own_error(tmp_path: Path) -> None:
    """No bare OSError naming ``journal.lock``: a JournalError naming the journal and what to do."""
    folder = tmp_path / "ro"
    folder.mkdir()
    script = (
        "import sys\n"
        "from resilience.barrier.journal import Journal, JournalError\n"
        "try:\n"
        "    Journal(sys.argv[1] + '/run.journal')\n"
        "except JournalError as exc:\n"
        "    print('refused', exc)\n"
    )
    if os.geteuid() == 0:  # root writes through permissions: make the folder a read-only mount instead
        cmd = _unshare("--mount", "--map-root-user")
        shell = f'mount --bind "$1" "$1" && mount -o remount,bind,ro "$1" && exec "{sys.executable}" -c "$2" "$1"'
        argv = [*cmd, "sh", "-c", shell, "sh", str(folder), script]
    else:
        folder.chmod(0o555)
        argv = [sys.executable, "-c", script, str(folder)]
    try:
        out = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=60)
    finally:
        folder.chmod(0o755)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"refused journal {folder}/run.journal: cannot create its folder or its lock file"), out.stdout
    assert "choose a writable folder for journal=" in out.stdout


# -- what a journal is ---------------------------------------------------------------


@pytest.mark.parametrize(
    "content",
    [
        b"engines:\n  - http://127.0.0.1:1\nfsync: true\n",
        b'{"level": "info", "msg": "started"}\n{"level": "info", "msg": "offload"}\n',
        b"a single line with no end of line",
        bytes(range(256)),
        frame(b'{"k":"state","engines":{}}') + frame(b'{"k":"state","engines":{}}'),
    ],
    ids=["yaml", "jsonl", "one-line", "binary", "no-header"],
)
def test_a_file_that_is_not_a_journal_is_refused_and_left_byte_for_byte(tmp_path: Path, content: bytes) -> None:
    """``journal=`` at a YAML config, a JSONL log, any non-empty file without our header: JournalError, the file as it was."""
    path = tmp_path / "config.yaml"
    path.write_bytes(content)
    with pytest.raises(JournalError, match="not a"):
        Journal(path).open(ENGINES)
    assert path.read_bytes() == content


def test_an_empty_or_missing_file_is_a_new_journal(tmp_path: Path) -> None:
    """Empty or absent: a new journal (its header written whole)."""
    (tmp_path / "empty").write_bytes(b"")
    for path in (tmp_path / "empty", tmp_path / "missing"):
        journal = Journal(path)
        assert not journal.open(ENGINES).recovery.resumed
        journal.close()
        assert json.loads(path.read_bytes().split(b" ", 1)[1])["k"] == "header"


# -- records that must not be forgotten when a write fails -----------------------------


def test_an_owner_and_a_budget_whose_record_failed_are_written_with_the_next_record(tmp_path: Path) -> None:
    """A hold's owner and a restart are marked written only once their record is durable, so a failed append is retried."""
    layer = FaultyOS()
    journal = Journal(FileJournalStore(tmp_path / "j", syscalls=layer))
    journal.open(ENGINES)
    know = _know(paused=True)
    for n in ENGINES:
        know[n].holds = {3: "weight_sync"}
    budget = RestartBudget(3)
    budget.record("oom", step=1)
    layer.arm({("write", 0): "ENOSPC"})
    with pytest.raises(JournalError, match="not durable"):
        journal.commit(know, ENGINES, "weight_sync pause", budget=budget)
    layer.arm()
    journal.commit(know, ENGINES, "weight_sync pause", budget=budget)
    journal.close()
    folded, _, _ = read_journal_file(tmp_path / "j")
    assert set(folded.owners) == {"3"} and folded.owners["3"]["pid"] == os.getpid()
    assert folded.budget is not None and [r["cause"] for r in folded.budget["restarts"]] == ["oom"]


def read_journal_file(path: Path) -> Any:
    store = FileJournalStore(path)
    try:
        return read_journal(store)
    finally:
        store.close()


# -- whose holds are orphaned ----------------------------------------------------------


def _journal_with_owner(path: Path, owner: dict[str, Any]) -> None:
    """A journal as a controller that took hold 3 (``weight_sync``) and was then killed would leave it."""
    facts = {"paused": True, "holds": {"3": "weight_sync"}}
    path.write_bytes(
        frame(json.dumps({"k": "header", "format": FORMAT, "version": 1, "engines": ENGINES}).encode())
        + frame(json.dumps({"k": "state", "why": "pause", "engines": dict.fromkeys(ENGINES, facts), "owners": {"3": owner}}).encode())
    )


def _orphaned(path: Path) -> dict[str, tuple[str, ...]]:
    journal = Journal(path)
    try:
        return dict(journal.open(ENGINES).recovery.orphaned_holds)
    finally:
        journal.close()


def test_a_predecessor_with_this_processs_pid_owns_orphaned_holds(tmp_path: Path) -> None:
    """A restarted container's controller is PID 1 again on the same host: the holds its predecessor wrote are orphaned."""
    me = _me()
    _journal_with_owner(tmp_path / "j", {**me, "id": "0123456789abcdef"})
    assert set(_orphaned(tmp_path / "j")) == set(ENGINES)
    _journal_with_owner(tmp_path / "k", me)  # the same owner, id and all: this process, alive
    assert _orphaned(tmp_path / "k") == {}


def test_a_reused_pid_does_not_keep_a_dead_owners_holds_alive(tmp_path: Path) -> None:
    """The owner's PID now names another process (another start time, or another boot): its holds are orphaned."""
    parent = os.getppid()
    live = {"host": os.uname().nodename, "pid": parent, "id": "feedfacefeedface", "start": _started(parent), "boot": _boot_id()}
    _journal_with_owner(tmp_path / "j", live)
    assert _orphaned(tmp_path / "j") == {}  # that process is alive
    _journal_with_owner(tmp_path / "k", {**live, "start": "1"})
    assert set(_orphaned(tmp_path / "k")) == set(ENGINES)
    _journal_with_owner(tmp_path / "m", {**live, "boot": "00000000-0000-0000-0000-000000000000"})
    assert set(_orphaned(tmp_path / "m")) == set(ENGINES)


def test_an_owner_written_before_owners_had_ids_is_judged_by_its_pid(tmp_path: Path) -> None:
    """A v3 journal's owner (host and PID only) still reads: alive while that PID lives, orphaned once it is gone."""
    _journal_with_owner(tmp_path / "j", {"host": os.uname().nodename, "pid": os.getpid()})
    assert _orphaned(tmp_path / "j") == {}
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True, timeout=60)
    _journal_with_owner(tmp_path / "k", {"host": os.uname().nodename, "pid": int(gone.stdout)})
    assert set(_orphaned(tmp_path / "k")) == set(ENGINES)


def test_a_controller_that_is_pid_1_twice_sees_its_predecessors_holds_orphaned(tmp_path: Path) -> None:
    """Two controllers, each PID 1 of its own PID namespace on this host (a restarted container): the second names the first's holds."""
    take = (
        "import os, sys\n"
        "from resilience.barrier.journal import Journal\n"
        "from resilience.barrier.state import EngineKnowledge\n"
        "assert os.getpid() == 1\n"
        "j = Journal(sys.argv[1]); names = sys.argv[2:]; j.open(names)\n"
        "j.commit({n: EngineKnowledge(n, paused=True, holds={3: 'weight_sync'}) for n in names}, names, 'weight_sync pause')\n"
        "os.kill(os.getpid(), 9)\n"
    )
    look = (
        "import os, sys\n"
        "from resilience.barrier.journal import Journal\n"
        "assert os.getpid() == 1\n"
        "print(sorted(Journal(sys.argv[1]).open(sys.argv[2:]).recovery.orphaned_holds))\n"
    )
    cmd = _unshare("--pid", "--fork", "--mount-proc", "--map-root-user")
    args = [str(tmp_path / "j"), *ENGINES]
    first = subprocess.run([*cmd, sys.executable, "-c", take, *args], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert "Traceback" not in first.stderr, first.stderr
    second = subprocess.run([*cmd, sys.executable, "-c", look, *args], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert second.returncode == 0, second.stderr
    assert second.stdout.strip() == str(sorted(ENGINES))
