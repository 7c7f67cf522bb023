"""``RetryBudget``: retries per engine (the run's restart budget is the barrier's: ``resilience.barrier.journal``).

``RetryBudget`` is a token bucket after gRPC retry throttling and Finagle's
RetryBudget (each call deposits, each retry withdraws one token): it stops
retry storms against a dead engine.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from resilience.clock import SYSTEM_CLOCK, Clock
from resilience.errors import finite_number, require
from resilience.per_engine import PerEngine

__all__ = ["RetryBudget", "RetryBudgetConfig", "RetryBudgets"]


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
        self.full = True
        """The balance is at ``max_tokens``: a deposit changes nothing (``RetryCall`` then skips it). Set by a deposit,
        cleared by a withdrawal."""
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
        if self.full:  # at ``max_tokens``: a refill would change nothing (as in ``deposit``)
            return self._max
        with self._lock:
            self._refill()
            return self._tokens

    def deposit(self) -> None:
        """Credit one logical call's ``ratio``."""
        if self.full:  # a refill or a deposit would be capped to the same balance
            return
        with self._lock:
            self._refill()
            self._tokens = min(self._max, self._tokens + self.config.ratio)
            self.full = self._tokens >= self._max

    def try_withdraw(self) -> bool:
        """Take one token for a retry; False (and nothing taken) when under one token."""
        with self._lock:
            self._refill()
            if self._tokens < 1.0:
                return False
            self._tokens -= 1.0
            self.full = False
            return True


class RetryBudgets:
    """Hands out one ``RetryBudget`` per engine, created on first use."""

    def __init__(self, config: RetryBudgetConfig | None = None, *, clock: Clock = SYSTEM_CLOCK) -> None:
        self.config = config or RetryBudgetConfig()
        self.by_engine: PerEngine[RetryBudget] = PerEngine(lambda _engine: RetryBudget(self.config, clock=clock))
        """``engine -> its budget``, made on first lookup: ``by_engine[engine]``."""
