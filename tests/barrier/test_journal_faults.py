"""The file journal under the faults a storage engine is tested with: every write point is a failure point and a crash point.

- A write or fsync that fails (``ENOSPC``, ``EIO``), at each of an append's and a compaction's calls: the call
  raises ``JournalError``, and the next open resumes exactly what was durable before it.
- A short write, from the fault layer and from the kernel itself (``RLIMIT_FSIZE`` in a subprocess): every byte is
  written, or the file is cut back and the record is not counted.
- A SIGKILL just before each system call of an append and of a compaction (a real subprocess, killed at the k-th
  call, for every k): the next open resumes the state before or the state after, never anything else, and the state
  after whenever the call had returned.
- A bit flip at each bit of a small journal: the next open resumes exactly what was written, or refuses with a
  ``JournalError`` and leaves the file as it was.

The faults come from ``tests/barrier/journal_faults.py``'s ``os`` layer (the kernel cannot fail a chosen call on demand).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from resilience.barrier.journal import Journal, JournalError
from resilience.barrier.journal_store import FileJournalStore, frame
from resilience.barrier.state import EngineKnowledge
from tests.barrier.journal_faults import BytesStore, FaultyOS, summary

ENGINES = ["http://127.0.0.1:1", "http://127.0.0.1:2"]
REPO = Path(__file__).resolve().parents[2]
_MAX_CALLS = 64
"""Bound on the system calls one append or compaction makes (the crash loops stop long before)."""


def _before() -> dict[str, EngineKnowledge]:
    return {n: EngineKnowledge(n, paused=True, flushed=True) for n in ENGINES}


def _after() -> dict[str, EngineKnowledge]:
    know = _before()
    know[ENGINES[0]].released = {"kv_cache"}
    know[ENGINES[1]].unknown = {"kv_cache"}
    know[ENGINES[1]].holds = {5: "weight_sync"}
    return know


def _resumed(path: Path) -> dict[str, tuple[Any, ...]]:
    journal = Journal(path)
    try:
        return summary(journal.open(ENGINES).knowledge)
    finally:
        journal.close()


def _journal_at_before(path: Path, layer: FaultyOS | None = None, compact_after: int = 2000) -> Journal:
    journal = Journal(FileJournalStore(path, syscalls=layer or FaultyOS()), compact_after=compact_after)
    journal.open(ENGINES)
    journal.commit(_before(), ENGINES, "flush outcome")
    return journal


@pytest.mark.parametrize("error", ["ENOSPC", "EIO"])
@pytest.mark.parametrize("call", [("write", 0), ("fsync", 0)])
def test_a_failed_write_or_fsync_of_an_append_raises_and_leaves_the_journal_as_it_was(
    tmp_path: Path, error: str, call: tuple[str, int]
) -> None:
    """ENOSPC or EIO on an append's write or fsync: JournalError, the file cut back, the record not counted; the store goes on."""
    path = tmp_path / "j"
    layer = FaultyOS()
    journal = _journal_at_before(path, layer)
    size = path.stat().st_size
    layer.arm({call: error})
    with pytest.raises(JournalError, match="not durable"):
        journal.commit(_after(), ENGINES, "release outcome")
    assert path.stat().st_size == size
    assert _resumed_beside(journal, path) == summary(_before())
    layer.arm()
    journal.commit(_after(), ENGINES, "release outcome")  # the same facts are written again: nothing was marked written
    journal.close()
    assert _resumed(path) == summary(_after())


def _resumed_beside(journal: Journal, path: Path) -> dict[str, tuple[Any, ...]]:
    """What the next controller would resume, read while ``journal`` still holds the lock."""
    return summary(Journal.read_only(path))


def test_a_short_write_is_continued_until_the_record_is_down(tmp_path: Path) -> None:
    """A write that writes half its bytes: the rest follows, and the record is whole and durable."""
    path = tmp_path / "j"
    layer = FaultyOS()
    journal = _journal_at_before(path, layer)
    layer.arm({("write", 0): "short", ("write", 1): "short"})
    journal.commit(_after(), ENGINES, "release outcome")
    assert layer.counts["write"] >= 3
    journal.close()
    assert _resumed(path) == summary(_after())


def test_a_short_write_then_a_full_disk_cuts_the_file_back(tmp_path: Path) -> None:
    """Half the record lands, then ENOSPC: the half is cut off (and that fsynced), the record is not counted."""
    path = tmp_path / "j"
    layer = FaultyOS()
    journal = _journal_at_before(path, layer)
    intact = path.read_bytes()
    layer.arm({("write", 0): "short", ("write", 1): "ENOSPC"})
    with pytest.raises(JournalError, match=f"cut back to its {len(intact)} bytes"):
        journal.commit(_after(), ENGINES, "release outcome")
    assert path.read_bytes() == intact
    assert layer.calls[-2:] == ["ftruncate", "fsync"]
    journal.close()


def test_when_the_cut_back_fails_too_the_store_writes_nothing_more_and_the_next_open_drops_the_torn_record(tmp_path: Path) -> None:
    """ENOSPC mid-record, then EIO on the truncate: every later write refuses; the next controller resumes what was durable."""
    path = tmp_path / "j"
    layer = FaultyOS()
    journal = _journal_at_before(path, layer)
    layer.arm({("write", 0): "short", ("write", 1): "ENOSPC", ("ftruncate", 0): "EIO"})
    with pytest.raises(JournalError, match="could not be cut back"):
        journal.commit(_after(), ENGINES, "release outcome")
    layer.arm()
    with pytest.raises(JournalError, match="unusable"):
        journal.commit(_after(), ENGINES, "release outcome")
    journal.close()
    again = Journal(path)
    resumed = again.open(ENGINES)
    assert resumed.recovery.dropped is not None and "torn record" in resumed.recovery.dropped
    assert summary(resumed.knowledge) == summary(_before())
    again.commit(_after(), ENGINES, "release outcome")  # the torn record was cut off: the next one reads back
    again.close()
    assert _resumed(path) == summary(_after())


def test_a_real_short_write_at_a_file_size_limit_is_not_counted_durable(tmp_path: Path) -> None:
    """RLIMIT_FSIZE in a subprocess: the kernel writes 40 bytes of the record, then refuses (EFBIG); append raises, the file is cut back."""
    path = tmp_path / "j"
    script = (
        "import resource, sys\n"
        "from resilience.barrier.journal_store import FileJournalStore, JournalError\n"
        "store = FileJournalStore(sys.argv[1])\n"
        "store.append(b'{\"i\":0}')\n"
        "size = len(open(sys.argv[1], 'rb').read())\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (size + 40, size + 40))\n"
        "try:\n"
        "    store.append(b'{\"i\":1,\"pad\":\"' + b'x' * 200 + b'\"}')\n"
        "except JournalError as exc:\n"
        "    print('refused', exc)\n"
        "else:\n"
        "    print('appended')\n"
    )
    out = subprocess.run([sys.executable, "-c", script, str(path)], cwd=REPO, capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.startswith("refused"), out.stdout + out.stderr
    assert "File too large" in out.stdout and "not durable" in out.stdout
    assert path.read_bytes() == frame(b'{"i":0}')
    store = FileJournalStore(path)
    try:
        loaded = store.load()
    finally:
        store.close()
    assert loaded.records == (b'{"i":0}',) and loaded.dropped is None


APPEND = ["fstat", "stat", "write", "fsync"]
"""An append's calls: is the file still this store's, at its length; the record; its fsync."""
COMPACT = ["fstat", "stat", "open", "write", "fsync", "close", "replace", "open", "fsync", "close", "open", "close"]
"""A compaction's calls: the same check; the new file written, fsynced, closed and renamed over the old; the folder
fsynced; the new file opened for appends, the old one closed."""
_BEFORE_RENAME = [("fstat", 1), ("stat", 1), ("open", 0), ("write", 1), ("fsync", 1), ("close", 0), ("replace", 0)]
"""The compaction's calls up to its rename, counted from the append that starts it: a failure leaves the old file."""
_AFTER_RENAME = [("open", 1), ("fsync", 2), ("open", 2)]


def test_the_calls_an_append_and_a_compaction_make(tmp_path: Path) -> None:
    """The call lists the fault tests below name (so that a change to the store's calls shows here first)."""
    layer = FaultyOS()
    journal = _journal_at_before(tmp_path / "j", layer, compact_after=3)
    layer.arm()
    journal.commit(_after(), ENGINES, "release outcome")
    calls = list(layer.calls)
    journal.close()
    assert calls == APPEND + COMPACT


@pytest.mark.parametrize("error", ["ENOSPC", "EIO"])
@pytest.mark.parametrize("call", _BEFORE_RENAME)
def test_a_compaction_that_fails_before_its_rename_leaves_the_journal_as_it_was(tmp_path: Path, error: str, call: tuple[str, int]) -> None:
    """A compaction runs after a durable append: its failure is logged, the append stands, the old file is intact."""
    path = tmp_path / "j"
    layer = FaultyOS()
    journal = _journal_at_before(path, layer, compact_after=3)
    layer.arm({call: error})
    journal.commit(_after(), ENGINES, "release outcome")  # durable; the compaction it starts fails
    assert not (tmp_path / ".j.rewrite").exists()
    assert path.read_bytes().count(b"\n") == 3  # header, before, after: not compacted
    assert _resumed_beside(journal, path) == summary(_after())
    layer.arm()
    journal.commit(_before(), ENGINES, "resume outcome")  # the store goes on, and compacts this time
    journal.close()
    assert path.read_bytes().count(b"\n") == 2
    assert _resumed(path) == summary(_before())


@pytest.mark.parametrize("call", _AFTER_RENAME)
def test_a_compaction_whose_rename_cannot_be_made_durable_stops_the_store(tmp_path: Path, call: tuple[str, int]) -> None:
    """After the rename (the folder's fsync, the reopen): the new file stands, and the store refuses every later write."""
    path = tmp_path / "j"
    layer = FaultyOS()
    journal = _journal_at_before(path, layer, compact_after=3)
    layer.arm({call: "EIO"})
    journal.commit(_after(), ENGINES, "release outcome")
    with pytest.raises(JournalError, match="rename could not be made durable"):
        journal.commit(_before(), ENGINES, "resume outcome")
    journal.close()
    assert _resumed(path) == summary(_after())


_CHILD = """
import sys
from resilience.barrier.journal import Journal
from resilience.barrier.journal_store import FileJournalStore
from tests.barrier.journal_faults import FaultyOS
from tests.barrier.test_journal_faults import ENGINES, _after, _before
path, op, k = sys.argv[1], sys.argv[2], int(sys.argv[3])
layer = FaultyOS()
journal = Journal(FileJournalStore(path, syscalls=layer), compact_after=3 if op == "compact" else 2000)
journal.open(ENGINES)
journal.commit(_before(), ENGINES, "flush outcome")
layer.arm(kill_at=k)
journal.commit(_after(), ENGINES, "release outcome")  # "compact": the append, then the compaction it starts
print("returned", len(layer.calls), flush=True)
"""


@pytest.mark.parametrize("op", ["append", "compact"])
def test_a_controller_killed_before_any_system_call_of_an_append_or_a_compaction_resumes_before_or_after(tmp_path: Path, op: str) -> None:
    """SIGKILL just before the k-th call, for every k: the next open resumes the state before or after (after once it returned)."""
    seen: list[str] = []
    for k in range(_MAX_CALLS):
        path = tmp_path / f"j{k}"
        out = subprocess.run([sys.executable, "-c", _CHILD, str(path), op, str(k)], cwd=REPO, capture_output=True, text=True, timeout=60)
        assert out.returncode in (0, -9), out.stderr
        now = _resumed(path)  # never refused: a crash can only tear the last record
        assert now in (summary(_before()), summary(_after())), (k, now)
        seen.append("after" if now == summary(_after()) else "before")
        if out.returncode == 0:
            assert now == summary(_after()), out.stdout
            calls = int(out.stdout.split()[1])
            break
    else:
        pytest.fail(f"the {op} made more than {_MAX_CALLS} calls")
    assert k == calls and seen[0] == "before" and seen[-1] == "after", seen
    assert seen == sorted(seen, key=["before", "after"].index), seen  # once durable, it stays so


def _small_journal(path: Path) -> bytes:
    journal = Journal(path)
    journal.open(ENGINES)
    journal.commit(_before(), ENGINES, "flush outcome")
    journal.commit(_after(), ENGINES, "release outcome")
    journal.close()
    return path.read_bytes()


def test_a_bit_flip_anywhere_is_resumed_exactly_or_refused_with_the_bytes_left_alone(tmp_path: Path) -> None:
    """Every bit of a three-record journal flipped in turn: the open resumes exactly what was written, or refuses naming the record.

    The damaged copies are opened over ``BytesStore`` (the file store's framing and reading, in memory: 8 opens per byte);
    the tests below open damaged files.
    """
    intact = _small_journal(tmp_path / "j")
    expected = summary(_after())
    refused = resumed = 0
    for offset in range(len(intact)):
        for bit in range(8):
            damaged = bytearray(intact)
            damaged[offset] ^= 1 << bit
            store = BytesStore(bytes(damaged))
            try:
                now = summary(Journal(store).open(ENGINES).knowledge)
            except JournalError as exc:
                assert "byte offset" in str(exc), (offset, bit, str(exc))
                assert store.data == damaged, (offset, bit)
                refused += 1
                continue
            assert now == expected, (offset, bit)
            resumed += 1
    assert refused + resumed == 8 * len(intact)
    assert resumed < 0.05 * 8 * len(intact)  # only flips that leave the payload as it was (a checksum's hex letter's case)


def test_a_record_after_a_corrupt_one_makes_the_open_refuse_naming_the_record_and_offset(tmp_path: Path) -> None:
    """One flipped byte in the release's record with a record after it: refused, never resumed from before it; the file untouched."""
    path = tmp_path / "j"
    intact = _small_journal(path)
    lines = intact.splitlines(keepends=True)
    offset = len(lines[0]) + len(lines[1])  # record 2: the release outcome
    journal = Journal(path)
    journal.open(ENGINES)
    journal.commit(_before(), ENGINES, "resume outcome")
    journal.close()
    damaged = bytearray(path.read_bytes())
    damaged[offset + 20] ^= 0x04
    path.write_bytes(bytes(damaged))
    named = rf"record 2 \(the header is record 0\) at byte offset {offset} fails its checksum with 1 more line"
    with pytest.raises(JournalError, match=named):
        Journal(path).open(ENGINES)
    assert path.read_bytes() == damaged


def test_a_corrupt_header_is_refused_not_taken_for_a_new_journal(tmp_path: Path) -> None:
    """One flipped byte in the header: refused (v3 rewrote the file as a new journal, every engine serving)."""
    path = tmp_path / "j"
    damaged = bytearray(_small_journal(path))
    damaged[30] ^= 0x01
    path.write_bytes(bytes(damaged))
    with pytest.raises(JournalError, match="not a barrier journal, or its header is damaged"):
        Journal(path).open(ENGINES)
    assert path.read_bytes() == damaged


def test_a_complete_last_record_whose_end_of_line_is_damaged_is_refused(tmp_path: Path) -> None:
    """The last newline flipped: the record is complete, so this is damage, not a torn tail (dropping it would forget the release)."""
    path = tmp_path / "j"
    damaged = bytearray(_small_journal(path))
    damaged[-1] ^= 0x01
    path.write_bytes(bytes(damaged))
    with pytest.raises(JournalError, match="is complete but its end of line is damaged"):
        Journal(path).open(ENGINES)
    assert path.read_bytes() == damaged
