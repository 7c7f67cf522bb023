"""Where the barrier's journal lives: ``JournalStore``, a local file (``FileJournalStore``), Ray's internal KV (``RayKVJournalStore``).

A store keeps an ordered list of opaque records (bytes): it appends one durably, reads them all back, and replaces
them all atomically (compaction); ``resilience.barrier.journal`` decides what they say. Each record is framed as one
line, ``<crc32 as 8 hex digits> <payload>\\n``, in every store: a last line without its end of line is a torn tail
(ignored, described, cut off before the next append); any other record that fails its checksum is corruption, refused
(``unframe``). What a store promises, and why a log and not SQLite: docs/failure-and-recovery.md, "The journal's contract".
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from resilience.errors import ConfigError

__all__ = [
    "FileJournalStore", "JournalBusy", "JournalCorrupt", "JournalError", "JournalStore", "Loaded", "RayKVJournalStore",
    "frame", "unframe",
]


class JournalError(ConfigError):
    """A journal that cannot be used: unreadable, corrupt, foreign, for other engines, or written by another live controller."""


class JournalCorrupt(JournalError):
    """A damaged record that is not a torn tail: ``record`` (the header is 0) and ``offset`` (its first byte in the store)."""

    def __init__(self, message: str, *, record: int, offset: int) -> None:
        super().__init__(message)
        self.record = record
        self.offset = offset


class JournalBusy(JournalError):
    """Another controller holds the journal open (a journal has one writer at a time)."""


@dataclass(frozen=True, slots=True)
class Loaded:
    """What a store read back: the complete records in order, what it ignored (None when nothing), and where it ignored it.

    ``kept``: the byte length of the complete records (where a torn tail starts; the whole length when none).
    """

    records: tuple[bytes, ...]
    dropped: str | None = None
    kept: int = 0


@runtime_checkable
class JournalStore(Protocol):
    """An ordered, durable list of records with one writer at a time.

    The contract every store keeps (``tests/barrier/test_journal_contract.py`` runs it on each):
    ``append`` returns only once the record is durable, and raises ``JournalError`` otherwise, leaving the
    records as they were before it; ``load`` returns every durable record, leaves out only a torn last record
    (and says so in ``Loaded.dropped``), and raises ``JournalError`` on anything else that is damaged; of two
    controllers on one journal, at most one writes (the other gets ``JournalBusy``).
    """

    @property
    def name(self) -> str:
        """Where the records live, for messages (a path, a KV key)."""
        ...

    def load(self) -> Loaded:
        """Every complete record, oldest first; a torn last record is left out and described; corruption raises ``JournalError``."""
        ...

    def append(self, record: bytes) -> None:
        """Add one record; durable when this returns; on failure ``JournalError``, and the records are as they were."""
        ...

    def rewrite(self, records: Sequence[bytes]) -> None:
        """Replace every record with ``records`` atomically (all old or all new after a crash)."""
        ...

    def close(self) -> None:
        """Let go of the store (its lock, its files)."""
        ...


def frame(payload: bytes) -> bytes:
    """One record as stored: its checksum, a space, the payload (no newline in it), a newline."""
    if b"\n" in payload:
        raise ValueError("a journal record must not contain a newline")
    return b"%08x %s\n" % (zlib.crc32(payload), payload)


def _payload(line: bytes) -> bytes | None:
    """The payload of one framed line (without its newline), or None when the framing or the checksum is wrong."""
    crc, sep, payload = line.partition(b" ")
    try:
        ok = sep == b" " and len(crc) == 8 and int(crc, 16) == zlib.crc32(payload)
    except ValueError:
        ok = False
    return payload if ok else None


def unframe(data: bytes, where: str) -> Loaded:
    """Split stored bytes into payloads: a torn last record is left out and described; any other damage raises.

    A torn record is the last one with no end of line (a crash cut its write). A line that has its end of line
    but fails its checksum, or a last record that is complete but whose end of line is damaged, is corruption:
    ``JournalError`` naming the record (the header is record 0) and its byte offset.
    """
    records: list[bytes] = []
    pos = 0
    while pos < len(data):
        end = data.find(b"\n", pos)
        if end < 0:
            tail = data[pos:]
            if len(tail) > 1 and _payload(tail[:-1]) is not None:
                raise _corrupt(where, len(records), pos, "is complete but its end of line is damaged")
            return Loaded(tuple(records), _dropped(where, records, len(tail), "a torn record (no end of line)"), pos)
        payload = _payload(data[pos:end])
        if payload is None:
            after = data.count(b"\n", end + 1)
            follows = f" with {after} more line(s) after it" if after else " though it is complete (it has its end of line)"
            what = "fails its checksum" + follows
            raise _corrupt(where, len(records), pos, what)
        records.append(payload)
        pos = end + 1
    return Loaded(tuple(records), None, pos)


def _corrupt(where: str, record: int, offset: int, what: str) -> JournalCorrupt:
    if record == 0:
        head = f"journal {where} is not a barrier journal, or its header is damaged: its first record (byte offset 0) {what}"
    else:
        head = f"journal {where} is corrupt: record {record} (the header is record 0) at byte offset {offset} {what}"
    return JournalCorrupt(
        f"{head}. A crash can only tear the last record, and leaves it without its end of line, so this is damage, "
        "not a crash: the journal is refused and the file left as it was. Restore it from a copy, or move it aside "
        "and start a new journal once you have checked every engine by hand",
        record=record,
        offset=offset,
    )


def _dropped(where: str, records: Sequence[bytes], size: int, what: str) -> str:
    return f"{where}: ignored the last {size} byte(s) after record {len(records)}: {what}; the journal resumes from record {len(records)}"


class FileJournalStore:
    """The embedded default: an append-only file, fsynced on every record, with a lock file held while open.

    ``path``: the journal file (created with its folder), used as what it resolves to (``os.path.realpath``), so a
    symlink to a journal is the journal itself. One controller at a time: an ``flock`` on ``<resolved path>.lock``
    (``JournalBusy`` for a second one; a file with hard links is refused), and before each append a check that the
    file is the one it opened, at the length it left it (a second writer past the lock stops it with ``JournalBusy``);
    docs/failure-and-recovery.md, "Who may open a journal". ``fsync``: flush each record to the disk before returning
    (default True; False only for benchmarks that measure what it costs). ``syscalls``: the module the store makes its
    writes through (default ``os``); the storage tests pass one that fails or kills the process at a chosen call.
    """

    def __init__(self, path: str | os.PathLike[str], *, fsync: bool = True, syscalls: Any = os) -> None:
        self.given = Path(path)
        self.path = Path(os.path.realpath(path))
        self.fsync = fsync
        self._os = syscalls
        self._fd: int | None = None
        self._size = 0
        self._loaded = False
        self._torn: int | None = None
        self._broken: str | None = None
        lock = f"{self.path}.lock"
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._lock_fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            raise JournalError(
                f"journal {self._shown}: cannot create its folder or its lock file {lock} ({exc.strerror or exc}); the controller "
                "needs to write in the journal's folder (the journal, its lock file and the compaction's temporary file live "
                "there): choose a writable folder for journal=, or make this one writable"
            ) from exc
        try:
            self._lock()
            self._fd = self._os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            st = self._os.fstat(self._fd)
        except OSError as exc:
            self.close()
            why = exc.strerror or exc
            raise JournalError(f"journal {self._shown}: cannot open it for writing ({why}); the controller must be able to") from exc
        except BaseException:
            self.close()
            raise
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
            self.close()
            what = "is not a regular file" if not stat.S_ISREG(st.st_mode) else f"has {st.st_nlink} names (hard links)"
            raise JournalError(
                f"journal {self._shown} {what}; a journal must be one regular file with one name, so that every controller "
                "that opens it takes the same lock"
            )
        self._size = st.st_size

    @property
    def _shown(self) -> str:
        return str(self.path) if str(self.given) == str(self.path) else f"{self.given} (-> {self.path})"

    def _lock(self) -> None:
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self._lock_fd, 64, 0).decode(errors="replace").strip() or "unknown"
            raise JournalBusy(
                f"journal {self._shown} is open in another controller ({holder}); one controller writes a journal at a time"
            ) from None
        except OSError as exc:  # ENOLCK and the like: a file system without flock (some network ones)
            raise JournalError(
                f"journal {self._shown}: cannot lock {self.path}.lock ({exc.strerror or exc}); the journal's folder must be "
                "on a file system that supports flock (a local disk), since the lock is what keeps a second controller out"
            ) from exc
        os.ftruncate(self._lock_fd, 0)
        os.pwrite(self._lock_fd, f"pid {os.getpid()} on {os.uname().nodename}".encode(), 0)  # who holds it, for JournalBusy

    @property
    def name(self) -> str:
        """The journal file's path (what the given path resolves to)."""
        return str(self.path)

    def load(self) -> Loaded:
        """Read the file's records (see ``unframe``); a torn tail is cut off before the next append."""
        try:
            data = self.path.read_bytes()
        except OSError as exc:
            raise JournalError(f"journal {self._shown} is unreadable: {exc}") from exc
        loaded = unframe(data, str(self.path))
        self._loaded, self._torn = True, (loaded.kept if loaded.dropped else None)
        return loaded

    def _usable(self) -> int:
        if self._broken is not None:
            raise JournalError(f"journal {self._shown} is unusable: {self._broken}")
        if self._fd is None:
            raise JournalError(f"journal {self._shown} is closed")
        return self._fd

    def _still_mine(self, fd: int) -> None:
        """The file is the one this store opened, at the length it left it (else a second writer got past the lock)."""
        mine, named = self._os.fstat(fd), self._os.stat(self.path)
        if (mine.st_dev, mine.st_ino) != (named.st_dev, named.st_ino) or mine.st_size != self._size:
            self._broken = (
                f"the file changed behind this controller (it is {named.st_size} bytes, inode {named.st_ino}; this controller "
                f"left {self._size} bytes, inode {mine.st_ino}): another controller writes it (a lock that does not hold: a "
                "network file system, or the journal reached by another host); stop both controllers"
            )
            raise JournalBusy(f"journal {self._shown}: {self._broken}")

    def _write_all(self, fd: int, data: bytes) -> None:
        view = memoryview(data)
        while view:
            n = self._os.write(fd, view)
            if n <= 0:
                raise OSError(errno.EIO, f"write wrote {n} bytes")
            view = view[n:]

    def append(self, record: bytes) -> None:
        """Append one framed record, every byte (a short write is continued), and fsync it; on any failure cut the file
        back to its length before it (fsynced) and raise ``JournalError``; if the cut fails, refuse every later write."""
        data = frame(record)
        fd = self._usable()
        try:
            if not self._loaded:
                self.load()
            if self._torn is not None:
                self._cut(fd, self._torn)
                self._size, self._torn = self._torn, None
            self._still_mine(fd)
        except OSError as exc:
            raise JournalError(f"journal {self._shown}: cannot append ({exc.strerror or exc}); nothing was written") from exc
        start = self._size
        try:
            self._write_all(fd, data)
            if self.fsync:
                self._os.fsync(fd)
        except OSError as exc:
            try:
                self._cut(fd, start)
            except OSError as cut:
                self._broken = f"a record's write failed ({exc.strerror or exc}) and the file could not be cut back ({cut.strerror or cut})"
                raise JournalError(
                    f"journal {self._shown}: {self._broken}; this controller writes nothing more; the next controller started "
                    "on the journal drops the torn record (it was never durable)"
                ) from exc
            raise JournalError(
                f"journal {self._shown}: a record of {len(data)} bytes could not be written ({exc.strerror or exc}); the file "
                f"was cut back to its {start} bytes before it, and the record is not durable"
            ) from exc
        self._size = start + len(data)

    def _cut(self, fd: int, size: int) -> None:
        self._os.ftruncate(fd, size)
        if self.fsync:
            self._os.fsync(fd)

    def rewrite(self, records: Sequence[bytes]) -> None:
        """Write ``records`` to a new file beside the old one, fsync it, rename it over the old one, fsync the folder; a
        failure after the rename leaves the store refusing every later write (they could be lost with the rename)."""
        fd = self._usable()
        data = b"".join(frame(r) for r in records)
        tmp = self.path.with_name(f".{self.path.name}.rewrite")
        try:
            self._still_mine(fd)
            out = self._os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                self._write_all(out, data)
                self._os.fsync(out)
            finally:
                self._os.close(out)
            self._os.replace(tmp, self.path)
        except OSError as exc:
            with contextlib.suppress(OSError):
                self._os.unlink(tmp)
            raise JournalError(f"journal {self._shown}: compaction failed ({exc.strerror or exc}); the journal is as it was") from exc
        try:
            dir_fd = self._os.open(self.path.parent, os.O_RDONLY)
            try:
                self._os.fsync(dir_fd)
            finally:
                self._os.close(dir_fd)
            new = self._os.open(self.path, os.O_WRONLY | os.O_APPEND)
        except OSError as exc:
            self._broken = f"a compaction's rename could not be made durable ({exc.strerror or exc})"
            raise JournalError(f"journal {self._shown}: {self._broken}; this controller writes nothing more") from exc
        self._fd, self._size, self._torn, self._loaded = new, len(data), None, True
        with contextlib.suppress(OSError):
            self._os.close(fd)

    def close(self) -> None:
        """Close the file and let go of the lock."""
        if self._fd is not None:
            with contextlib.suppress(OSError):
                self._os.close(self._fd)
            self._fd = None
        with contextlib.suppress(OSError):
            os.close(self._lock_fd)
        self._lock_fd = -1


_SEAL = frame(b"")
"""The record a Ray KV compaction puts in the old generation's next slot before it writes the new one (nothing follows it)."""
_MAX_GENERATIONS = 1_000_000
"""Bound on the generations a Ray KV journal's pointers are followed through (a loop among them is corruption)."""


class RayKVJournalStore:
    """The journal in Ray's GCS-backed internal KV, for a controller that Ray may restart on another node.

    ``key``: the journal's name in the KV. Records live under ``key/g/<generation>/<seq>``; generation ``0`` is the
    first, and a compaction writes a new one and links it with ``key/next/<old generation>``. ``namespace``: Ray's
    KV namespace (default "controlplane-resilience"). ``kv``: the module the store calls (default
    ``ray.experimental.internal_kv``, which needs a connected Ray runtime); the contract tests pass one whose puts fail.

    One writer at a time, without a lock (it would outlive a controller killed outright): every record is put only if
    its slot is still empty (``overwrite=False``, atomic in the GCS), and a compaction seals the old generation's next
    slot and links the new generation only if no link exists; after each put the store checks that its generation has
    no link yet. So the first write of whichever controller is behind raises ``JournalBusy`` before the command it
    announces is sent. Each append is one put and one get.
    """

    def __init__(self, key: str, *, namespace: str = "controlplane-resilience", kv: Any = None) -> None:
        if not key or "/" in key:
            raise JournalError(f"RayKVJournalStore.key must be a non-empty name without '/', but was {key!r}")
        self.key = key
        self.namespace = namespace
        self._kv = kv if kv is not None else _ray_kv()
        self._generation = "0"
        self._seq = 0
        self._sealed: list[bytes] | None = None
        self._doubt: tuple[int, bytes] | None = None
        self._token = os.urandom(6).hex()
        if self._get(f"{key}/head".encode()) is not None:
            raise JournalError(
                f"journal {self.name} was written by an older version (its records hang from {key}/head); "
                "this version reads journals whose generations are linked by key/next: use a new key"
            )
        self._loaded = False

    def _get(self, key: bytes) -> bytes | None:
        try:
            value: bytes | None = self._kv._internal_kv_get(key, namespace=self.namespace)
        except Exception as exc:  # Ray raises its own RPC errors; any of them means the read did not happen
            raise JournalError(f"journal {self.name}: reading {key.decode()} failed ({exc})") from exc
        return value

    def _put_new(self, key: bytes, value: bytes) -> bool:
        """Put ``value`` under ``key`` only if it is empty; True when it was empty (now ours)."""
        existed = self._kv._internal_kv_put(key, value, overwrite=False, namespace=self.namespace)
        return not existed

    def _list(self, prefix: bytes) -> list[bytes]:
        try:
            keys: list[bytes] = self._kv._internal_kv_list(prefix, namespace=self.namespace)
        except Exception as exc:
            raise JournalError(f"journal {self.name}: listing {prefix.decode()} failed ({exc})") from exc
        return sorted(keys)

    def _slot(self, generation: str, seq: int) -> bytes:
        return f"{self.key}/g/{generation}/{seq:012d}".encode()

    @property
    def name(self) -> str:
        """``ray-kv://namespace/key``."""
        return f"ray-kv://{self.namespace}/{self.key}"

    def _live_generation(self) -> str:
        prefix = f"{self.key}/next/".encode()
        links = {k[len(prefix) :].decode(): self._get(k) for k in self._list(prefix)}
        generation = "0"
        for _ in range(_MAX_GENERATIONS):
            nxt = links.get(generation)
            if nxt is None:
                return generation
            generation = nxt.decode()
        raise JournalError(f"journal {self.name} is corrupt: its generations' links loop")

    def load(self) -> Loaded:
        """Every record of the live generation, in order; a missing or damaged record, or a link to an empty generation, raises."""
        generation = self._live_generation()
        prefix = f"{self.key}/g/{generation}/".encode()
        keys = self._list(prefix)
        records: list[bytes] = []
        sealed = False
        for i, key in enumerate(keys):
            where = f"journal {self.name} is corrupt: record {i} (the header is record 0)"
            if key != self._slot(generation, i):
                raise JournalError(f"{where} is missing (the next key is {key.decode()})")
            value = self._get(key)
            if sealed or value is None:
                raise JournalError(f"{where} is {'after the seal of a compaction' if sealed else 'missing'}")
            if value == _SEAL:
                sealed = True
                continue
            loaded = unframe(value, f"{self.name} record {i}")
            if len(loaded.records) != 1 or loaded.dropped:
                raise JournalError(f"{where} is not one complete record (a put is whole, so this is damage)")
            records.append(loaded.records[0])
        if generation != "0" and not keys:
            raise JournalError(f"journal {self.name} is corrupt: it links to generation {generation}, which has no records")
        self._generation, self._seq = generation, len(keys)
        self._sealed = records if sealed else None
        self._doubt, self._loaded = None, True
        return Loaded(tuple(records))

    def _busy(self, what: str) -> JournalBusy:
        return JournalBusy(
            f"journal {self.name}: {what}: another controller writes this journal (one controller per key); "
            "this one writes nothing more"
        )

    def append(self, record: bytes) -> None:
        """Put one record in the next empty slot (durable once the GCS acknowledged it); a taken slot raises ``JournalBusy``."""
        if not self._loaded:  # the slots follow the records read
            self.load()
        if self._sealed is not None:  # a compaction sealed the generation and stopped before linking the new one: finish it
            self.rewrite(self._sealed)
        framed = frame(record)
        key = self._slot(self._generation, self._seq)
        try:
            if self._doubt is not None and self._doubt[0] == self._seq and self._get(key) == self._doubt[1]:
                self._seq += 1  # the put that raised had landed: that record is durable, this one goes after it
                key = self._slot(self._generation, self._seq)
            self._doubt = (self._seq, framed)
            ours = self._put_new(key, framed)
        except JournalError:
            raise
        except Exception as exc:
            raise JournalError(f"journal {self.name}: the put of record {self._seq} failed ({exc}); the record is not durable") from exc
        if not ours:
            raise self._busy(f"record {self._seq}'s slot was taken")
        if self._get(f"{self.key}/next/{self._generation}".encode()) is not None:  # compacted past (its old slots deleted)
            raise self._busy(f"generation {self._generation} was compacted by another controller")
        self._doubt = None
        self._seq += 1

    def rewrite(self, records: Sequence[bytes]) -> None:
        """Seal the live generation, write a new one, and link it (the link is the atomic switch); then delete the old one."""
        if not self._loaded:
            self.load()
        old = self._generation
        new = f"{int(old.split('.')[0]) + 1}.{self._token}"
        try:
            if self._sealed is None:  # a seal already there is ours from a put that raised, or a rival's: the link decides
                seal = self._slot(old, self._seq)
                if not self._put_new(seal, _SEAL) and self._get(seal) != _SEAL:
                    raise self._busy(f"record {self._seq}'s slot was taken")
                self._sealed = list(records)
            self._kv._internal_kv_del(f"{self.key}/g/{new}/".encode(), del_by_prefix=True, namespace=self.namespace)
            for seq, record in enumerate(records):
                self._kv._internal_kv_put(self._slot(new, seq), frame(record), overwrite=True, namespace=self.namespace)
            link = f"{self.key}/next/{old}".encode()
            linked = self._put_new(link, new.encode()) or self._get(link) == new.encode()
        except JournalError:
            raise
        except Exception as exc:
            what = f"compaction failed ({exc}); the journal is as it was (the next write ends it)"
            raise JournalError(f"journal {self.name}: {what}") from exc
        if not linked:
            raise self._busy(f"generation {old} was compacted by another controller")
        self._generation, self._seq, self._sealed, self._doubt = new, len(records), None, None
        with contextlib.suppress(Exception):
            self._kv._internal_kv_del(f"{self.key}/g/{old}/".encode(), del_by_prefix=True, namespace=self.namespace)

    def close(self) -> None:
        """Nothing to let go of (the KV lives in the GCS, and there is no lock)."""


def _ray_kv() -> Any:
    try:
        import ray
        from ray.experimental import internal_kv
    except ImportError as exc:
        raise ConfigError("RayKVJournalStore needs Ray: pip install 'controlplane-resilience[ray]'") from exc
    if not ray.is_initialized():
        raise ConfigError("RayKVJournalStore needs a connected Ray runtime: call ray.init() first (or build it inside an actor)")
    return internal_kv
