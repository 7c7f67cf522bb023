"""Where the barrier's journal lives: ``JournalStore``, a local file (``FileJournalStore``), Ray's internal KV (``RayKVJournalStore``).

A store keeps an ordered list of opaque records (bytes) and nothing else: it
appends one record durably, reads them all back, and replaces them all
atomically (compaction). ``resilience.barrier.journal`` decides what the
records say.

Each record is framed as one line, ``<crc32 as 8 hex digits> <payload>\\n``,
in every store, so a torn or corrupt record is recognised the same way
wherever it was kept: reading stops at the first record that is incomplete or
fails its checksum, and says what it ignored.

Why an append-only file with fsync rather than SQLite: the journal is written
by one controller at a time, read whole at start, and must say exactly which
tail it dropped after a crash; a line per record with its checksum does that
in a few lines, stays readable with ``cat`` and ``cpr journal show``, and has
the same shape as a key-value store's records (Ray's GCS, etcd, Redis), so the
distributed stores share the framing. SQLite would hide a torn tail inside its
own rollback (fine) but could not tell the user what was lost, and gives
nothing the single-writer log needs.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from resilience.errors import ConfigError

__all__ = [
    "FileJournalStore",
    "JournalBusy",
    "JournalError",
    "JournalStore",
    "Loaded",
    "RayKVJournalStore",
    "frame",
    "unframe",
]


class JournalError(ConfigError):
    """A journal that cannot be used: unreadable, foreign, for other engines, or written by another live controller."""


class JournalBusy(JournalError):
    """Another controller holds the journal open (a journal has one writer at a time)."""


@dataclass(frozen=True, slots=True)
class Loaded:
    """What a store read back: the complete records in order, and what it ignored (None when nothing)."""

    records: tuple[bytes, ...]
    dropped: str | None = None


@runtime_checkable
class JournalStore(Protocol):
    """An ordered, durable list of records with one writer at a time."""

    @property
    def name(self) -> str:
        """Where the records live, for messages (a path, a KV key)."""
        ...

    def load(self) -> Loaded:
        """Every complete record, oldest first; a torn or corrupt tail is left out and described."""
        ...

    def append(self, record: bytes) -> None:
        """Add one record; durable when this returns."""
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


def unframe(data: bytes, where: str) -> Loaded:
    """Split stored bytes into payloads, stopping at the first torn or corrupt record."""
    records: list[bytes] = []
    pos = 0
    while pos < len(data):
        end = data.find(b"\n", pos)
        if end < 0:
            return Loaded(tuple(records), _dropped(where, records, len(data) - pos, "a torn record (no end of line)"))
        line = data[pos:end]
        crc, sep, payload = line.partition(b" ")
        try:
            ok = sep == b" " and len(crc) == 8 and int(crc, 16) == zlib.crc32(payload)
        except ValueError:
            ok = False
        if not ok:
            return Loaded(tuple(records), _dropped(where, records, len(data) - pos, "a record that fails its checksum"))
        records.append(payload)
        pos = end + 1
    return Loaded(tuple(records))


def _dropped(where: str, records: Sequence[bytes], size: int, what: str) -> str:
    return f"{where}: ignored the last {size} byte(s) after record {len(records)}: {what}; the journal resumes from record {len(records)}"


class FileJournalStore:
    """The embedded default: an append-only file, fsynced on every record, with a lock file held while open.

    ``path``: the journal file (created with its folder). A second controller
    opening the same path while the first lives gets ``JournalBusy``; a
    controller killed outright loses the lock with its process. ``fsync``:
    flush each record to the disk before returning (default True; False only
    for benchmarks that measure what it costs).
    """

    def __init__(self, path: str | os.PathLike[str], *, fsync: bool = True) -> None:
        self.path = Path(path)
        self.fsync = fsync
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock_fd = os.open(f"{self.path}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self._lock_fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(self._lock_fd)
            raise JournalBusy(
                f"journal {self.path} is open in another controller ({holder}); one controller writes a journal at a time"
            ) from None
        os.ftruncate(self._lock_fd, 0)
        os.pwrite(self._lock_fd, f"pid {os.getpid()} on {os.uname().nodename}".encode(), 0)
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)

    @property
    def name(self) -> str:
        """The journal file's path."""
        return str(self.path)

    def load(self) -> Loaded:
        """Read the file's records (see ``unframe``)."""
        try:
            data = self.path.read_bytes()
        except OSError as exc:
            raise JournalError(f"journal {self.path} is unreadable: {exc}") from exc
        return unframe(data, str(self.path))

    def append(self, record: bytes) -> None:
        """Append one framed record and fsync it."""
        assert self._fd is not None, f"journal {self.path} is closed"
        os.write(self._fd, frame(record))
        if self.fsync:
            os.fsync(self._fd)

    def rewrite(self, records: Sequence[bytes]) -> None:
        """Write ``records`` to a new file beside the old one, fsync it, and rename it over the old one."""
        tmp = self.path.with_name(f".{self.path.name}.rewrite")
        with open(tmp, "wb") as fh:
            fh.write(b"".join(frame(r) for r in records))
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, self.path)
        dir_fd = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
        if self._fd is not None:
            os.close(self._fd)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)

    def close(self) -> None:
        """Close the file and let go of the lock."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        with contextlib.suppress(OSError):
            os.close(self._lock_fd)


class RayKVJournalStore:
    """The journal in Ray's GCS-backed internal KV, for a controller that Ray may restart on another node.

    ``key``: the journal's name in the KV (records live under ``key/<generation>/<seq>``, and ``key/head``
    names the live generation, so a rewrite is one atomic put). ``namespace``: Ray's KV namespace (default
    "controlplane-resilience"). Needs a connected Ray runtime (``ray.init`` in the driver, or inside an actor).
    It keeps what the GCS keeps: with GCS fault tolerance (an external Redis) it outlives the head node too.
    One writer at a time is the caller's duty here (Ray's KV has no lock): run one controller per key.
    """

    def __init__(self, key: str, *, namespace: str = "controlplane-resilience") -> None:
        if not key or "/" in key:
            raise JournalError(f"RayKVJournalStore.key must be a non-empty name without '/', but was {key!r}")
        self.key = key
        self.namespace = namespace
        self._kv = _ray_kv()
        head = self._kv._internal_kv_get(self._head, namespace=namespace)
        self._generation = int(head) if head else 0
        self._seq = len(self._keys())

    @property
    def _head(self) -> bytes:
        return f"{self.key}/head".encode()

    def _prefix(self, generation: int) -> bytes:
        return f"{self.key}/{generation}/".encode()

    def _keys(self) -> list[bytes]:
        keys: list[bytes] = self._kv._internal_kv_list(self._prefix(self._generation), namespace=self.namespace)
        return sorted(keys)

    @property
    def name(self) -> str:
        """``ray-kv://namespace/key``."""
        return f"ray-kv://{self.namespace}/{self.key}"

    def load(self) -> Loaded:
        """Every record of the live generation, in order."""
        data = b"".join(self._kv._internal_kv_get(k, namespace=self.namespace) or b"" for k in self._keys())
        return unframe(data, self.name)

    def append(self, record: bytes) -> None:
        """Put one record under the next sequence number (durable once the GCS acknowledged it)."""
        key = self._prefix(self._generation) + b"%012d" % self._seq
        self._kv._internal_kv_put(key, frame(record), overwrite=True, namespace=self.namespace)
        self._seq += 1

    def rewrite(self, records: Sequence[bytes]) -> None:
        """Write a new generation, switch ``head`` to it in one put, then delete the old one."""
        old, new = self._generation, self._generation + 1
        for seq, record in enumerate(records):
            self._kv._internal_kv_put(self._prefix(new) + b"%012d" % seq, frame(record), overwrite=True, namespace=self.namespace)
        self._kv._internal_kv_put(self._head, str(new).encode(), overwrite=True, namespace=self.namespace)
        self._generation, self._seq = new, len(records)
        self._kv._internal_kv_del(self._prefix(old), del_by_prefix=True, namespace=self.namespace)

    def close(self) -> None:
        """Nothing to let go of (the KV lives in the GCS)."""


def _ray_kv() -> Any:
    try:
        import ray
        from ray.experimental import internal_kv
    except ImportError as exc:
        raise ConfigError("RayKVJournalStore needs Ray: pip install 'controlplane-resilience[ray]'") from exc
    if not ray.is_initialized():
        raise ConfigError("RayKVJournalStore needs a connected Ray runtime: call ray.init() first (or build it inside an actor)")
    return internal_kv
