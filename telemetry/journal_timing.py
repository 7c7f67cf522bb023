"""``TimedJournalStore``: a ``JournalStore`` that times each durable write into ``cpr_journal_commit_duration_seconds``.

The barrier's journal (``resilience.barrier.journal.Journal``) commits by
appending one record to its store, which returns only once the record is
durable (fsynced, or stored in Ray's KV); a compaction rewrites the whole
store. Wrapping the store times exactly that, with no hook in the journal:
``op="append"`` for a commit, ``op="rewrite"`` for a compaction. A write that
raises is timed too (it held the transition up just as long).

    journal = Journal(metrics.timed_journal_store(FileJournalStore(path)))
    orch = Orchestrator(group, journal=journal, observers=[metrics])
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

from resilience.barrier.journal_store import JournalStore, Loaded

__all__ = ["JOURNAL_COMMIT_BUCKETS", "TimedJournalStore"]

JOURNAL_COMMIT_BUCKETS: Final = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
"""Buckets (seconds) of ``cpr_journal_commit_duration_seconds``: an fsync takes a fraction of a millisecond to tens of ms."""


class TimedJournalStore:
    """``store`` with ``append`` and ``rewrite`` timed into ``histogram`` (a prometheus-client ``Histogram`` labelled ``op``).

    ``store``: the store the records live in. ``histogram``: the family to
    observe (``MetricsObserver`` passes its ``cpr_journal_commit_duration_seconds``).
    ``load`` and ``close`` pass through untimed; ``name`` is the store's.
    """

    def __init__(self, store: JournalStore, histogram: Any) -> None:
        if not isinstance(store, JournalStore):
            raise TypeError(f"TimedJournalStore needs a JournalStore (load, append, rewrite, close, name), but got {store!r}")
        self.store = store
        self._append = histogram.labels("append")
        self._rewrite = histogram.labels("rewrite")

    @property
    def name(self) -> str:
        """The wrapped store's name (a path, a KV key)."""
        return self.store.name

    def load(self) -> Loaded:
        """The wrapped store's records."""
        return self.store.load()

    def append(self, record: bytes) -> None:
        """Append through the wrapped store, timed as ``op="append"``."""
        with self._append.time():
            self.store.append(record)

    def rewrite(self, records: Sequence[bytes]) -> None:
        """Rewrite through the wrapped store, timed as ``op="rewrite"``."""
        with self._rewrite.time():
            self.store.rewrite(records)

    def close(self) -> None:
        """Close the wrapped store."""
        self.store.close()
