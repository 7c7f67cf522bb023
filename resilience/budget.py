"""Budgets: ``RetryBudget`` (retries per engine) and ``RestartBudget`` (restarts per run).

``RetryBudget`` is a token bucket after gRPC retry throttling and Finagle's
RetryBudget (each call deposits, each retry withdraws one token): it stops
retry storms against a dead engine. ``RestartBudget`` keeps its record in a
file, because the global restart it counts re-initialises the process that
holds it.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from resilience.clock import SYSTEM_CLOCK, Clock
from resilience.errors import ConfigError, finite_number, integer, require
from resilience.events import Observer, RestartRecorded, emit
from resilience.per_engine import PerEngine

__all__ = ["RestartBudget", "RestartBudgetError", "RestartRecord", "RetryBudget", "RetryBudgetConfig", "RetryBudgets"]


@dataclass(frozen=True, slots=True)
class RetryBudgetConfig:
    """How many retries an engine may absorb."""

    ratio: float = 0.2
    """Tokens each logical call deposits (Finagle ``percentCanRetry``): 0.2 = retries up to 20 % of calls."""
    min_retries_per_second: float = 10.0
    """The floor: tokens refilled per second regardless of traffic (Finagle ``minRetriesPerSec``, 10), so a quiet
    control plane can still retry through a burst of 502s. 0 = no floor."""
    max_tokens: float = 100.0
    """Bucket size, also the starting balance: 100 = Finagle's 10 s ``ttl`` at the floor rate."""

    def __post_init__(self) -> None:
        for name in ("ratio", "min_retries_per_second", "max_tokens"):
            require(finite_number(getattr(self, name)), "RetryBudgetConfig", name, "a finite number", getattr(self, name))
        require(0 <= self.ratio <= 1, "RetryBudgetConfig", "ratio", "within [0, 1]", self.ratio)
        require(self.min_retries_per_second >= 0, "RetryBudgetConfig", "min_retries_per_second", ">= 0", self.min_retries_per_second)
        require(self.max_tokens >= 1, "RetryBudgetConfig", "max_tokens", ">= 1", self.max_tokens)


class RetryBudget:
    """A thread-safe token bucket for one engine's retries."""

    def __init__(self, config: RetryBudgetConfig | None = None, *, clock: Clock = SYSTEM_CLOCK) -> None:
        self.config = config or RetryBudgetConfig()
        self._clock = clock
        self._max = self._tokens = self.config.max_tokens
        self._at = clock.monotonic()
        self._lock = threading.Lock()

    def _refill(self) -> None:
        now = self._clock.monotonic()
        elapsed = max(0.0, now - self._at)
        self._at = now
        self._tokens = min(self._max, self._tokens + elapsed * self.config.min_retries_per_second)

    @property
    def tokens(self) -> float:
        """The current balance."""
        with self._lock:
            self._refill()
            return self._tokens

    def deposit(self) -> None:
        """Credit one logical call's ``ratio``."""
        if self._tokens >= self._max:  # full: a refill or a deposit would be capped to the same balance
            return
        with self._lock:
            self._refill()
            self._tokens = min(self._max, self._tokens + self.config.ratio)

    def try_withdraw(self) -> bool:
        """Take one token for a retry; False (and nothing taken) when under one token."""
        with self._lock:
            self._refill()
            if self._tokens < 1.0:
                return False
            self._tokens -= 1.0
            return True


class RestartBudgetError(ValueError):
    """A restart-budget file is unreadable, corrupt or belongs to something else."""


_FORMAT = "controlplane-resilience/restart-budget"
_VERSION = 1


@dataclass(frozen=True, slots=True)
class RestartRecord:
    """One recorded restart."""

    cause: str
    at: float
    """Wall-clock seconds since the epoch."""
    step: int | None = None


class RestartBudget:
    """A run's allowed restarts: record each with its cause, read what is left. It never restarts anything.

    ``limit`` is the number of restarts the run may take (the seed's
    ``max_global_restart=3``). ``path`` (optional) is a JSON file that keeps
    the record across the very restarts it counts: loaded when it exists,
    replaced atomically on each record; a corrupt or foreign file raises
    ``RestartBudgetError``, never a silent reset. ``planned_run_seconds`` is
    the planned run length burn rates are measured against (default 24 h).
    """

    def __init__(
        self,
        limit: int = 3,
        *,
        path: str | os.PathLike[str] | None = None,
        planned_run_seconds: float = 86400.0,
        observers: Sequence[Observer] = (),
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        require(integer(limit) and limit >= 0, "RestartBudget", "limit", "an integer >= 0", limit)
        ok = finite_number(planned_run_seconds) and planned_run_seconds > 0
        require(ok, "RestartBudget", "planned_run_seconds", "a finite number > 0", planned_run_seconds)
        self._limit = limit
        self._planned_run_seconds = planned_run_seconds
        self.path = Path(path) if path is not None else None
        self._observers = tuple(observers)
        self._wall_clock = wall_clock
        self._lock = threading.Lock()
        self._restarts = self._load(self.path) if self.path is not None and self.path.exists() else []

    @staticmethod
    def _load(path: Path) -> list[RestartRecord]:
        try:
            raw: Any = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise RestartBudgetError(f"restart budget file {path} is unreadable or not JSON: {exc}") from exc
        if not isinstance(raw, dict) or raw.get("format") != _FORMAT:
            raise RestartBudgetError(
                f"restart budget file {path} is not a {_FORMAT} file (format field was "
                f"{raw.get('format') if isinstance(raw, dict) else type(raw).__name__!r}); refusing to overwrite it"
            )
        if raw.get("version") != _VERSION:
            raise RestartBudgetError(f"restart budget file {path} has version {raw.get('version')!r}, expected {_VERSION}")
        entries = raw.get("restarts")
        if not isinstance(entries, list):
            raise RestartBudgetError(f"restart budget file {path}: 'restarts' must be a list")
        records = []
        for i, entry in enumerate(entries):
            try:
                step = entry.get("step")
                records.append(RestartRecord(cause=str(entry["cause"]), at=float(entry["at"]), step=None if step is None else int(step)))
            except (AttributeError, KeyError, TypeError, ValueError) as exc:
                raise RestartBudgetError(f"restart budget file {path}: restarts[{i}] is malformed: {exc!r}") from exc
        return records

    def _save(self) -> None:
        if self.path is None:
            return
        payload = {
            "format": _FORMAT,
            "version": _VERSION,
            "limit": self._limit,
            "planned_run_seconds": self._planned_run_seconds,
            "restarts": [asdict(r) for r in self._restarts],
        }
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", dir=self.path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                json.dump(payload, fh, indent=2)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    @property
    def limit(self) -> int:
        """Restarts the run may take."""
        return self._limit

    @property
    def planned_run_seconds(self) -> float:
        """The planned run length burn rates are measured against."""
        return self._planned_run_seconds

    @property
    def records(self) -> tuple[RestartRecord, ...]:
        """Every restart recorded, oldest first (including earlier processes')."""
        with self._lock:
            return tuple(self._restarts)

    @property
    def used(self) -> int:
        """Restarts recorded so far."""
        return len(self.records)

    @property
    def remaining(self) -> int:
        """Restarts left (never negative)."""
        return max(0, self._limit - self.used)

    def record(self, cause: str, *, step: int | None = None) -> RestartRecord:
        """Record a restart the caller decided to take; persist it first, then announce it."""
        if not cause:
            raise ConfigError("RestartBudget.record: cause must be a non-empty string")
        rec = RestartRecord(cause=cause, at=self._wall_clock(), step=step)
        with self._lock:
            self._restarts.append(rec)
            try:
                self._save()
            except BaseException:
                self._restarts.pop()
                raise
            used = len(self._restarts)
        emit(self._observers, RestartRecorded(cause=cause, step=step, used=used, limit=self._limit))
        return rec

    def restore(self, records: Sequence[RestartRecord]) -> int:
        """Add the restarts in ``records`` that this budget lacks (a journal's copy, after a controller restart); returns how many.

        Nothing is announced (they were when they happened); the file, when there is one, is rewritten."""
        with self._lock:
            known = set(self._restarts)
            new = [r for r in records if r not in known]
            if new:
                self._restarts.extend(new)
                self._restarts.sort(key=lambda r: r.at)
                self._save()
            return len(new)

    def causes(self) -> dict[str, int]:
        """Restarts per cause."""
        return dict(Counter(rec.cause for rec in self.records))


class RetryBudgets:
    """Hands out one ``RetryBudget`` per engine, created on first use."""

    def __init__(self, config: RetryBudgetConfig | None = None, *, clock: Clock = SYSTEM_CLOCK) -> None:
        self.config = config or RetryBudgetConfig()
        self._clock = clock
        self.by_engine: PerEngine[RetryBudget] = PerEngine(lambda _engine: RetryBudget(self.config, clock=self._clock))
        """``engine -> its budget``, made on first lookup (``by_engine[engine]``: what ``get`` answers)."""

    def get(self, engine: str) -> RetryBudget:
        """The budget of ``engine``."""
        return self.by_engine[engine]
