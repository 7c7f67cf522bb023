"""A fault-injecting ``os`` layer for ``FileJournalStore(path, syscalls=...)``, and journal states to compare.

The real kernel cannot be made to fail a chosen ``write`` or ``fsync`` on demand, so the storage tests hand the
store this layer: it passes every call to ``os`` unchanged, except the ones it was armed to break (an ``ENOSPC`` or
``EIO`` raised, a short write), or it SIGKILLs its own process just before its k-th call (a crash between any two
system calls). Calls are counted from ``arm``. One real short write is in the tests as well (``RLIMIT_FSIZE`` in a
subprocess), where the kernel itself cuts the write.
"""

from __future__ import annotations

import errno
import os
import signal
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from resilience.barrier.journal_store import Loaded, frame, unframe
from resilience.barrier.state import EngineKnowledge

CALLS = frozenset({"open", "write", "fsync", "ftruncate", "fstat", "stat", "replace", "unlink", "close"})
"""The calls the store makes through its ``syscalls`` (``FileJournalStore``'s docstring names them)."""
ERRORS = {"ENOSPC": errno.ENOSPC, "EIO": errno.EIO, "EFBIG": errno.EFBIG}


class FaultyOS:
    """``os``, with ``faults``: (call name, its n-th use since ``arm``, from 0) -> "ENOSPC", "EIO", "EFBIG" or "short"
    (a write that writes half its bytes); ``kill_at``: SIGKILL this process just before its k-th call since ``arm``."""

    def __init__(self) -> None:
        self.faults: dict[tuple[str, int], str] = {}
        self.kill_at: int | None = None
        self.counts: Counter[str] = Counter()
        self.calls: list[str] = []

    def arm(self, faults: Mapping[tuple[str, int], str] | None = None, *, kill_at: int | None = None) -> FaultyOS:
        """Start counting calls from here, with these faults."""
        self.faults, self.kill_at = dict(faults or {}), kill_at
        self.counts.clear()
        self.calls.clear()
        return self

    def __getattr__(self, name: str) -> Any:
        real = getattr(os, name)
        if name not in CALLS:
            return real
        return self._wrap(name, real)

    def _wrap(self, name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            n = self.counts[name]
            self.counts[name] += 1
            if self.kill_at is not None and len(self.calls) == self.kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            self.calls.append(name)
            fault = self.faults.get((name, n))
            if fault in ERRORS:
                raise OSError(ERRORS[fault], os.strerror(ERRORS[fault]))
            if fault == "short":
                data = args[1]
                return real(args[0], data[: max(1, len(data) // 2)])
            return real(*args, **kwargs)

        return call


def summary(know: Mapping[str, EngineKnowledge]) -> dict[str, tuple[Any, ...]]:
    """What a journal says of each engine, in a form two journals can be compared by."""
    return {n: (k.paused, k.flushed, sorted(k.released), sorted(k.unknown), dict(k.holds)) for n, k in sorted(know.items())}


class BytesStore:
    """A ``JournalStore`` over bytes in memory (the file store's framing, no file): for opening thousands of damaged copies fast."""

    def __init__(self, data: bytes) -> None:
        self.data = bytes(data)

    @property
    def name(self) -> str:
        return "memory"

    def load(self) -> Loaded:
        return unframe(self.data, self.name)

    def append(self, record: bytes) -> None:
        self.data += frame(record)

    def rewrite(self, records: Sequence[bytes]) -> None:
        self.data = b"".join(frame(r) for r in records)

    def close(self) -> None:
        pass
