"""``CircuitBreaker`` per engine: closed, open, half-open (when each moves: ``BreakerConfig``).

Only transport errors and retryable statuses count as failures; a 4xx is the
caller's fault and does not. Half-open, one failed probe opens it again.
"""

from __future__ import annotations

import enum
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from resilience.clock import SYSTEM_CLOCK, Clock
from resilience.errors import finite_number, integer, require
from resilience.events import BreakerTransitioned, Observer, emit
from resilience.per_engine import PerEngine

__all__ = ["BreakerConfig", "BreakerRegistry", "BreakerState", "CircuitBreaker", "IllegalTransition", "Permit"]


class BreakerState(enum.StrEnum):
    """The breaker's states."""

    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


_ALLOWED: Final = frozenset(
    {
        (BreakerState.CLOSED, BreakerState.OPEN),
        (BreakerState.OPEN, BreakerState.HALF_OPEN),
        (BreakerState.HALF_OPEN, BreakerState.CLOSED),
        (BreakerState.HALF_OPEN, BreakerState.OPEN),
    }
)


class IllegalTransition(RuntimeError):
    """A transition outside the breaker's table was attempted (a bug)."""


@dataclass(frozen=True, slots=True)
class Permit:
    """A call's admission by a breaker: the period it was let in (``epoch``: every state change starts a new one), and
    whether it holds a half-open probe slot. A verdict given with an older period's permit is stale and changes nothing."""

    epoch: int
    probe: bool


@dataclass(frozen=True, slots=True)
class BreakerConfig:
    """When a breaker opens and how it recovers."""

    failure_threshold: int = 5
    """Consecutive failures that open the breaker. 0 = this trigger is off."""
    failure_rate_threshold: float = 0.5
    """Failure fraction over the last ``window_size`` calls that opens it (0 < x <= 1), once ``minimum_calls`` were seen."""
    window_size: int = 20
    """Calls in the count-based sliding window."""
    minimum_calls: int = 10
    """Calls needed in the window before the rate trigger can fire."""
    open_seconds: float = 5.0
    """How long the breaker stays open (failing fast) before half-open probes."""
    half_open_max_calls: int = 1
    """Probe calls let through at once while half-open."""
    half_open_successes: int = 1
    """Successful probes that close the breaker."""
    open_on_unreachable: bool = True
    """Open at once when a call was refused for its whole ``connect_window_s`` (a dead or mistyped engine), so the next
    call fails fast with ``CircuitOpen`` instead of waiting out its own window. False: such a call counts as one failure."""

    def __post_init__(self) -> None:
        def need(ok: bool, name: str, rule: str) -> None:
            require(ok, "BreakerConfig", name, rule, getattr(self, name))

        for name in ("failure_threshold", "window_size", "minimum_calls", "half_open_max_calls", "half_open_successes"):
            need(integer(getattr(self, name)), name, "an integer")
        for name in ("failure_rate_threshold", "open_seconds"):
            need(finite_number(getattr(self, name)), name, "a finite number")
        need(self.failure_threshold >= 0, "failure_threshold", ">= 0")
        need(0 < self.failure_rate_threshold <= 1, "failure_rate_threshold", "within (0, 1]")
        need(self.window_size >= 1, "window_size", ">= 1")
        need(1 <= self.minimum_calls <= self.window_size, "minimum_calls", f"within [1, window_size={self.window_size}]")
        need(self.open_seconds >= 0, "open_seconds", ">= 0")
        need(self.half_open_max_calls >= 1, "half_open_max_calls", ">= 1")
        need(1 <= self.half_open_successes, "half_open_successes", ">= 1")
        need(isinstance(self.open_on_unreachable, bool), "open_on_unreachable", "true or false")


class CircuitBreaker:
    """One engine's breaker. Thread-safe; state changes are announced as events."""

    def __init__(
        self,
        name: str,
        config: BreakerConfig | None = None,
        *,
        clock: Clock = SYSTEM_CLOCK,
        observers: Sequence[Observer] = (),
    ) -> None:
        self.name = name
        self.config = config or BreakerConfig()
        self._clock = clock
        self._observers = tuple(observers)
        self._lock = threading.Lock()
        self._state = BreakerState.CLOSED
        self._window: deque[bool] = deque(maxlen=self.config.window_size)
        self._consecutive = 0
        self._clean = 0
        """Successes counted since the last failure or close: at ``_clean_full`` the window holds only successes."""
        self._clean_full = self.config.window_size  # >= 1 (BreakerConfig checks)
        self._opened_at = 0.0
        self._half_open_in_flight = 0
        self._half_open_ok = 0
        self._epoch = 0
        self.closed_permit: Permit | None = Permit(0, probe=False)
        """While closed, the permit of every call let in during the current period (one object per period), else None: a
        new call's first admission reads it without the lock (``RetryCall.next_step``), and asks ``admit`` when it is None."""
        self.calm: Permit | None = None
        """``closed_permit`` while the window holds only successes, else None: a success of a call holding it changes
        nothing (``RetryCall`` then skips ``record_success``)."""

    @property
    def state(self) -> BreakerState:
        """The current state (moves open -> half-open when the wait is over)."""
        with self._lock:
            pending = self._maybe_half_open()
            state = self._state
        self._announce(pending)
        return state

    def retry_in(self) -> float:
        """Seconds until an open breaker lets a probe through (0 when not open)."""
        with self._lock:
            if self._state is not BreakerState.OPEN:
                return 0.0
            return max(0.0, self._opened_at + self.config.open_seconds - self._clock.monotonic())

    def admit(self, permit: Permit | None = None) -> Permit | None:
        """Let a call's next attempt through, or None when refused.

        A ``permit`` of the current period is kept. Otherwise, as for a new call: closed lets it in, open
        refuses, half-open takes one of ``half_open_max_calls`` probe slots (a call let in while closed and
        still retrying after the breaker went half-open needs one too).
        """
        with self._lock:
            pending = self._maybe_half_open()
            granted: Permit | None = None  # open, or half-open with every probe slot taken
            if permit is not None and permit.epoch == self._epoch:
                granted = permit
            elif self._state is BreakerState.CLOSED:
                granted = self.closed_permit
            elif self._state is BreakerState.HALF_OPEN and self._half_open_in_flight < self.config.half_open_max_calls:
                self._half_open_in_flight += 1
                granted = Permit(self._epoch, probe=True)
        self._announce(pending)
        return granted

    def _stale(self, permit: Permit | None) -> bool:
        return permit is not None and permit.epoch != self._epoch

    def _probe_done(self) -> None:
        self._half_open_in_flight = max(0, self._half_open_in_flight - 1)

    def record_success(self, permit: Permit | None = None) -> None:
        """Count a success (of the call holding ``permit``; a stale permit counts nothing)."""
        if permit is self.closed_permit and self._clean >= self._clean_full and self._state is BreakerState.CLOSED:
            return  # closed, and the window holds only successes: one more changes nothing (no lock taken)
        self._record(permit, ok=True)

    def record_failure(self, permit: Permit | None = None) -> None:
        """Count a failure (transport error or retryable status; a stale ``permit`` counts nothing)."""
        self._record(permit, ok=False)

    def _record(self, permit: Permit | None, *, ok: bool) -> None:
        pending: list[BreakerTransitioned] = []
        with self._lock:
            cfg = self.config
            if self._stale(permit):
                pass
            elif self._state is BreakerState.HALF_OPEN:
                self._probe_done()
                if not ok:
                    pending.append(self._move(BreakerState.OPEN, "half-open probe failed"))
                else:
                    self._half_open_ok += 1
                    if self._half_open_ok >= cfg.half_open_successes:
                        pending.append(self._move(BreakerState.CLOSED, "half-open probes succeeded"))
            elif ok:  # closed, or a late answer while open
                self._consecutive = 0
                self._window.append(True)
                self._clean += 1
                if self._clean >= self._clean_full and self._state is BreakerState.CLOSED:
                    self.calm = self.closed_permit
            elif self._state is BreakerState.CLOSED:
                self._clean = 0
                self.calm = None
                self._consecutive += 1
                self._window.append(False)
                failures, seen = self._window.count(False), len(self._window)
                if cfg.failure_threshold and self._consecutive >= cfg.failure_threshold:
                    pending.append(self._move(BreakerState.OPEN, f"{self._consecutive} consecutive failures"))
                elif seen >= cfg.minimum_calls and failures / seen >= cfg.failure_rate_threshold:
                    pending.append(self._move(BreakerState.OPEN, f"failure rate {failures}/{seen} >= {cfg.failure_rate_threshold}"))
        self._announce(pending)

    def record_unreachable(self, permit: Permit | None = None, *, window_s: float | None = None) -> None:
        """A call was refused for its whole connect window (``window_s`` seconds): open now, closed or half-open.

        With ``open_on_unreachable=False`` it counts as one failure instead. A
        stale ``permit`` counts nothing; an open breaker stays as it is.
        """
        if not self.config.open_on_unreachable:
            self.record_failure(permit)
            return
        pending: list[BreakerTransitioned] = []
        with self._lock:
            if not self._stale(permit) and self._state is not BreakerState.OPEN:
                self._probe_done()  # the count is read only while half-open (and reset on entering it)
                held = "" if window_s is None else f" for {window_s:g} s"
                pending.append(self._move(BreakerState.OPEN, f"connections refused{held}: nothing listens"))
        self._announce(pending)

    def release_probe(self, permit: Permit | None = None) -> None:
        """Give back a half-open probe slot whose call counted neither way (a 4xx, an interrupted call)."""
        with self._lock:
            if self._state is BreakerState.HALF_OPEN and not self._stale(permit) and (permit is None or permit.probe):
                self._probe_done()

    def _maybe_half_open(self) -> Sequence[BreakerTransitioned]:
        if self._state is BreakerState.OPEN and self._clock.monotonic() - self._opened_at >= self.config.open_seconds:
            return [self._move(BreakerState.HALF_OPEN, "open wait elapsed")]
        return ()

    def _move(self, to: BreakerState, reason: str) -> BreakerTransitioned:
        if (self._state, to) not in _ALLOWED:
            raise IllegalTransition(f"breaker {self.name}: {self._state} -> {to} is not allowed")
        event = BreakerTransitioned(engine=self.name, from_state=str(self._state), to_state=str(to), reason=reason)
        self._state = to
        self._epoch += 1
        self.closed_permit = Permit(self._epoch, probe=False) if to is BreakerState.CLOSED else None
        self.calm = None
        if to is BreakerState.OPEN:
            self._opened_at = self._clock.monotonic()
        elif to is BreakerState.HALF_OPEN:
            self._half_open_in_flight = 0
            self._half_open_ok = 0
        else:
            self._consecutive = 0
            self._clean = 0
            self._window.clear()
        return event

    def _announce(self, events: Sequence[BreakerTransitioned]) -> None:
        for event in events:
            emit(self._observers, event)


class BreakerRegistry:
    """Hands out one ``CircuitBreaker`` per engine name, created on first use."""

    def __init__(
        self,
        config: BreakerConfig | None = None,
        *,
        clock: Clock = SYSTEM_CLOCK,
        observers: Sequence[Observer] = (),
    ) -> None:
        self.config = config or BreakerConfig()
        observers = tuple(observers)
        self.by_engine: PerEngine[CircuitBreaker] = PerEngine(
            lambda engine: CircuitBreaker(engine, self.config, clock=clock, observers=observers)
        )
        """``engine -> its breaker`` (``scheme://host:port``), made on first lookup: ``by_engine[engine]``."""

    def states(self) -> dict[str, BreakerState]:
        """Every known engine's breaker state."""
        breakers = list(self.by_engine.values())  # one C call under the GIL: a consistent copy
        return {b.name: b.state for b in breakers}
