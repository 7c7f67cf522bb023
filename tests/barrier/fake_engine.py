"""A socket-free SGLang engine with SGLang 0.5.23's crash semantics, and per-call fault injection.

What kills a real engine (``sglang/srt/managers/scheduler_components/weight_updater.py``,
torch_memory_saver) is recorded in ``crash`` instead:

- release while serving or before a flush (the scheduler asserts it is idle);
- release of a tag already released (torch_memory_saver: ``exit(1)``);
- resume of a tag not released (``offload_tags.remove``: ``KeyError``, the server dies);
- continue while memory is released (the next prefill writes into freed KV);
- weights pushed into released weight memory.

Faults are armed per (method): the next call of that method on this engine
gets it. No sleeps: a "late" call blocks until the test lets it land. Every
error a fault raises carries the record a driver would attach
(``.attempts``: ``AttemptRecord``s), except a dead or unavailable Ray actor,
for which no driver writes one. An interrupt fault calls the engine's
``interrupt`` hook (default: raise ``KeyboardInterrupt`` in the calling thread,
or ``asyncio.CancelledError`` in an async call); a test sets it to reach the
caller's thread (a signal) or the awaiting task (``cancel``).
``FakeEngine``'s calls are synchronous (for ``ThreadFanOut``), ``AsyncFakeEngine``'s
are coroutines (for ``AsyncFanOut`` and ``AsyncOrchestrator``); same state, faults
and crash rules.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import threading
from collections.abc import Callable, Sequence
from typing import Any

from resilience.clock import SYSTEM_CLOCK, Clock
from resilience.engine_contract import ALL_TAGS, EngineDied, EngineUnavailable
from resilience.errors import AmbiguousOutcome
from resilience.outcome import AttemptRecord, Delivery, Outcome

ALL = frozenset(ALL_TAGS)
LATE_LIMIT_S = 5.0
"""A late call lands on its own after this long if the test never lets it (a safety net, not a timing)."""


class Fault(enum.StrEnum):
    """What goes wrong with one call."""

    AMBIGUOUS_APPLIED = "ambiguous_applied"
    """Applied, then the answer is lost (read timeout after sending): ``AmbiguousOutcome``."""
    AMBIGUOUS_NOT_APPLIED = "ambiguous_not_applied"
    """Not applied, but the caller cannot tell: ``AmbiguousOutcome``."""
    FAILED = "failed"
    """Refused with an error answer: not applied."""
    LATE_APPLIED = "late_applied"
    """Still running at the phase deadline; applied when it lands."""
    LATE_FAILED = "late_failed"
    """Still running at the phase deadline; refused when it lands."""
    ACTOR_DIED = "actor_died"
    """Applied, then the Ray actor holding the engine died (``EngineDied``)."""
    ACTOR_UNAVAILABLE = "actor_unavailable"
    """Not applied; Ray cannot reach the actor (``EngineUnavailable``)."""
    APPLIED_THEN_502 = "applied_then_502"
    """Applied, then a proxy answered 502 (the record: RESPONDED 502)."""
    APPLIED_THEN_504 = "applied_then_504"
    """Applied, then a proxy answered 504 (the record: RESPONDED 504)."""
    GATEWAY_NOT_FORWARDED = "gateway_not_forwarded"
    """Not applied: a proxy answered 502 without forwarding (the record cannot tell: RESPONDED 502)."""
    CONNECTION_REFUSED = "connection_refused"
    """Not applied: the connection was refused (the record: NOT_SENT)."""
    INTERRUPT_BEFORE = "interrupt_before"
    """The ``interrupt`` hook fires before the engine applied the call; if it returns, the call lands late and is applied."""
    INTERRUPT_AFTER = "interrupt_after"
    """Applied, then the ``interrupt`` hook fires; if it returns, the call answers normally."""
    SYSTEM_EXIT_BEFORE = "system_exit_before"
    """``SystemExit`` raised inside the call before the engine applied it."""
    SYSTEM_EXIT_AFTER = "system_exit_after"
    """Applied, then ``SystemExit`` raised inside the call."""
    DELIVERED_LATE = "delivered_late"
    """The connection drops right after sending (``AmbiguousOutcome``, the record: AMBIGUOUS) while the request is still
    on its way: it reaches the engine, and is applied, only at the next ``deliver()``: after the memory probe answered
    (the probes in these tests call it), at the engine's next call (a later request arrives after it), or at ``land()``."""
    APPLIES_LATER = "applies_later"
    """The connection drops right after sending (``AmbiguousOutcome``, the record: AMBIGUOUS) and the engine applies
    the call ``apply_after_s`` seconds later on the engine's ``clock`` (a release that takes time to free memory, as
    torch_memory_saver's pause does): seen from the next observation (``snapshot``, ``serving``) once due, or at once
    at the engine's next call (served after it), ``wait_idle`` or ``land()``."""


INTERRUPTS = frozenset({Fault.INTERRUPT_BEFORE, Fault.INTERRUPT_AFTER, Fault.SYSTEM_EXIT_BEFORE, Fault.SYSTEM_EXIT_AFTER})
"""The faults that raise a ``BaseException`` (or fire the interrupt hook) inside the call."""


def record(delivery: Delivery, status: int | None = None, error_type: str | None = None) -> tuple[AttemptRecord, ...]:
    """A one-attempt record, as a driver attaches it."""
    if delivery is Delivery.AMBIGUOUS:
        outcome = Outcome.AMBIGUOUS
    else:
        outcome = Outcome.RETRYABLE if status in (None, 502, 503, 504) else Outcome.FATAL
    return (AttemptRecord(0, status, outcome, delivery, error_type, 0.0),)


class Refused(Exception):
    """The engine answered with an error (HTTP 500): nothing was applied."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.status = 500
        self.attempts = record(Delivery.RESPONDED, 500)


class Answered(Exception):
    """An error answer with the driver's record: ``status`` and ``attempts`` (a gateway's 502/504, a refused connection)."""

    def __init__(self, message: str, status: int | None, attempts: tuple[AttemptRecord, ...]) -> None:
        super().__init__(message)
        self.status = status
        self.attempts = attempts


def _keyboard_interrupt() -> None:
    raise KeyboardInterrupt("fake engine: interrupted")


class _Landing:
    """Where a late call waits until the test lets it land: a thread event, or an asyncio event on the call's loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.loop = loop
        self.thread_event = threading.Event()
        self.async_event = asyncio.Event() if loop is not None else None

    def set(self) -> None:
        self.thread_event.set()
        if self.loop is not None and self.async_event is not None and not self.loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                self.loop.call_soon_threadsafe(self.async_event.set)

    async def wait_async(self) -> None:
        assert self.async_event is not None
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.async_event.wait(), LATE_LIMIT_S)


class _Fake:
    """One engine: paused, flushed, released tags; ``crash`` says why it would have died (None: alive)."""

    def __init__(self, name: str) -> None:
        self.engine = name
        self.base_url = name
        self._lock = threading.Lock()
        self.paused = False
        self.flushed = False
        self.released: set[str] = set()
        self.crash: str | None = None
        self.violations: list[str] = []
        self.sync_bodies = 0
        self.faults: dict[str, Fault] = {}
        self.fired: list[str] = []
        """``method:fault`` of every fault that hit a call (read by the test for coverage statistics)."""
        self.landings: list[_Landing] = []
        self.deliveries: list[Callable[[], None]] = []
        """Calls on their way to the engine (``Fault.DELIVERED_LATE``), applied in order by ``deliver``."""
        self.clock: Clock = SYSTEM_CLOCK
        """The engine's clock: when a ``Fault.APPLIES_LATER`` call is applied (a test shares its ``FakeClock``)."""
        self.apply_after_s = 0.3
        """How long after its answer a ``Fault.APPLIES_LATER`` call is applied."""
        self.applying: list[tuple[float, Callable[[], None]]] = []
        """``Fault.APPLIES_LATER`` calls being applied: (clock time when applied, apply), in order."""
        self.started: list[str] = []
        self._running = 0
        self._idle = threading.Condition(self._lock)
        """Every call that reached the engine, in order (a late one as soon as it starts)."""
        self.interrupt: Callable[[], None] = _keyboard_interrupt
        """What an interrupt fault does: raise here (the default), or reach another thread or task and return."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.engine!r})"

    # -- the test's side ---------------------------------------------------------------------

    def arm(self, method: str, fault: Fault) -> None:
        """The next call of ``method`` gets ``fault``."""
        with self._lock:
            self.faults[method] = fault

    def disarm(self) -> None:
        """Drop faults not used."""
        with self._lock:
            self.faults.clear()

    def wait_idle(self, timeout: float = LATE_LIMIT_S) -> bool:
        """Wait until no call is being carried out (a landed late call has applied, a slow one too) and none is on its
        way (``deliver``): what a person reconciling from the engine's real state must wait for. True when idle."""
        self._apply_slow(everything=True)
        with self._idle:
            return self._idle.wait_for(lambda: self._running == 0 and not self.deliveries, timeout)

    def _finished(self) -> None:
        with self._idle:
            self._running -= 1
            self._idle.notify_all()

    def land(self) -> None:
        """Let every late call land, every slow one apply, and every delivery on its way arrive."""
        self._apply_slow(everything=True)
        self.deliver()
        with self._lock:
            landings, self.landings = self.landings, []
        for landing in landings:
            landing.set()

    def deliver(self) -> None:
        """The requests still on their way (``Fault.DELIVERED_LATE``) reach the engine now and are applied, in order."""
        with self._lock:
            deliveries, self.deliveries = self.deliveries, []
            for apply in deliveries:
                if self.crash is None:
                    apply()
            self._idle.notify_all()

    def _apply_slow(self, *, everything: bool = False) -> None:
        """Apply the ``Fault.APPLIES_LATER`` calls whose time has come (``everything``: all of them, in order)."""
        with self._lock:
            now = self.clock.monotonic()
            while self.applying and (everything or self.applying[0][0] <= now):
                _, apply = self.applying.pop(0)
                if self.crash is None:
                    apply()

    @property
    def serving(self) -> bool:
        """Not paused, nothing released."""
        self._apply_slow()
        with self._lock:
            return not self.paused and not self.released

    def snapshot(self) -> tuple[bool, bool, frozenset[str]]:
        """(paused, flushed, released) at once."""
        self._apply_slow()
        with self._lock:
            return self.paused, self.flushed, frozenset(self.released)

    def push_weights(self) -> None:
        """What a weight sync body does to each engine."""
        with self._lock:
            if not self.paused:
                self.violations.append("weights pushed while the engine serves")
            if "weights" in self.released:
                self._die("weights pushed into released memory")

    # -- the engine's side -------------------------------------------------------------------------

    def _die(self, why: str) -> None:
        if self.crash is None:
            self.crash = why

    def _enter(self, method: str, loop: asyncio.AbstractEventLoop | None) -> tuple[Fault | None, _Landing | None]:
        """A call arrives (after the requests still on their way, ``deliver``, and the slow ones being applied): take its
        fault; a late one gets a landing to wait on."""
        self._apply_slow(everything=True)
        self.deliver()
        with self._lock:
            self.started.append(method)
            fault = self.faults.pop(method, None)
            if fault is not None:
                self.fired.append(f"{method}:{fault}")
            if self.crash is not None:
                raise EngineDied(f"{self.engine} is down: {self.crash}")
            self._running += 1  # settled by _finished when the call ends
            landing = None
            if fault in (Fault.LATE_APPLIED, Fault.LATE_FAILED, Fault.INTERRUPT_BEFORE):
                landing = _Landing(loop)
                self.landings.append(landing)
        return fault, landing

    def _before(self, method: str, fault: Fault | None) -> None:
        """Before the call is applied: an interrupt fault fires."""
        if fault is Fault.INTERRUPT_BEFORE:
            self.interrupt()
        elif fault is Fault.SYSTEM_EXIT_BEFORE:
            raise SystemExit(f"{self.engine} {method}: SystemExit before applying")

    def _exit(self, method: str, fault: Fault | None, apply: Callable[[], None]) -> dict[str, Any]:
        """The call (landed, if it was late) is applied or refused as its fault says."""
        if fault is Fault.AMBIGUOUS_NOT_APPLIED:
            raise AmbiguousOutcome(
                f"{self.engine} {method}: read timeout (not applied)", engine=self.engine, attempts=record(Delivery.AMBIGUOUS)
            )
        if fault is Fault.ACTOR_UNAVAILABLE:
            raise EngineUnavailable(f"{self.engine} {method}: actor unavailable")
        if fault in (Fault.FAILED, Fault.LATE_FAILED):
            raise Refused(f"{self.engine} {method}: HTTP 500")
        if fault is Fault.GATEWAY_NOT_FORWARDED:
            raise Answered(f"{self.engine} {method}: HTTP 502 from the proxy (not forwarded)", 502, record(Delivery.RESPONDED, 502))
        if fault is Fault.CONNECTION_REFUSED:
            raise Answered(f"{self.engine} {method}: connection refused", None, record(Delivery.NOT_SENT, None, "ConnectionError"))
        if fault is Fault.APPLIES_LATER:
            with self._lock:
                self.applying.append((self.clock.monotonic() + self.apply_after_s, apply))
            raise AmbiguousOutcome(
                f"{self.engine} {method}: connection reset after sending (applies in {self.apply_after_s} s)",
                engine=self.engine,
                attempts=record(Delivery.AMBIGUOUS),
            )
        if fault is Fault.DELIVERED_LATE:
            with self._lock:
                self.deliveries.append(apply)
            raise AmbiguousOutcome(
                f"{self.engine} {method}: connection reset after sending (still on its way)",
                engine=self.engine,
                attempts=record(Delivery.AMBIGUOUS),
            )
        with self._lock:
            if self.crash is not None:
                raise EngineDied(f"{self.engine} is down: {self.crash}")
            apply()
        if fault is Fault.AMBIGUOUS_APPLIED:
            raise AmbiguousOutcome(
                f"{self.engine} {method}: read timeout (applied)", engine=self.engine, attempts=record(Delivery.AMBIGUOUS)
            )
        if fault is Fault.ACTOR_DIED:
            raise EngineDied(f"{self.engine}: actor died after {method}")
        if fault in (Fault.APPLIED_THEN_502, Fault.APPLIED_THEN_504):
            status = 502 if fault is Fault.APPLIED_THEN_502 else 504
            raise Answered(f"{self.engine} {method}: HTTP {status} from the proxy (applied)", status, record(Delivery.RESPONDED, status))
        if fault is Fault.INTERRUPT_AFTER:
            self.interrupt()
        elif fault is Fault.SYSTEM_EXIT_AFTER:
            raise SystemExit(f"{self.engine} {method}: SystemExit after applying")
        return {"engine": self.engine, "method": method}

    def _pause(self) -> None:
        if not self.paused:
            self.flushed = False
        self.paused = True

    def _flush(self) -> None:
        if self.paused:
            self.flushed = True

    def _release(self, tags: Sequence[str] | None) -> Callable[[], None]:
        wanted = set(tags) if tags else set(ALL)

        def apply() -> None:
            if not self.paused or not self.flushed:
                self._die("release while not idle (scheduler assert)")
            elif wanted & self.released:
                self._die(f"double release of {sorted(wanted & self.released)} (torch_memory_saver exit(1))")
            else:
                self.released |= wanted
            if self.sync_bodies:
                self.violations.append("release while a weight_sync body runs")

        return apply

    def _resume(self, tags: Sequence[str] | None) -> Callable[[], None]:
        wanted = set(tags) if tags else set(ALL)

        def apply() -> None:
            if wanted - self.released:
                self._die(f"resume of unreleased {sorted(wanted - self.released)} (KeyError in the scheduler)")
            else:
                self.released -= wanted
            if self.sync_bodies:
                self.violations.append("resume while a weight_sync body runs")

        return apply

    def _continue(self) -> None:
        if self.released:
            self._die(f"continue with {sorted(self.released)} released (prefill into freed memory)")
        self.paused = False
        self.flushed = False


class FakeEngine(_Fake):
    """A socket-free engine with synchronous control calls; a late call blocks its thread until the test lands it."""

    def _call(self, method: str, apply: Callable[[], None]) -> dict[str, Any]:
        fault, landing = self._enter(method, None)
        try:
            self._before(method, fault)
            if landing is not None:
                landing.thread_event.wait(LATE_LIMIT_S)
            return self._exit(method, fault, apply)
        finally:
            self._finished()

    def pause_generation(self, mode: str = "abort") -> dict[str, Any]:
        return self._call("pause_generation", self._pause)

    def flush_cache(self, deadline_s: float | None = None) -> dict[str, Any]:
        return self._call("flush_cache", self._flush)

    def release_memory_occupation(self, tags: Sequence[str] | None = None) -> dict[str, Any]:
        return self._call("release_memory_occupation", self._release(tags))

    def resume_memory_occupation(self, tags: Sequence[str] | None = None) -> dict[str, Any]:
        return self._call("resume_memory_occupation", self._resume(tags))

    def continue_generation(self, torch_empty_cache: bool = True) -> dict[str, Any]:
        return self._call("continue_generation", self._continue)


class AsyncFakeEngine(_Fake):
    """The same engine with ``async`` control calls; a late call awaits (on its own loop) until the test lands it.

    Its default ``interrupt`` raises ``asyncio.CancelledError`` inside the call (the call's task ends cancelled).
    """

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.interrupt = _cancelled

    async def _call(self, method: str, apply: Callable[[], None]) -> dict[str, Any]:
        fault, landing = self._enter(method, asyncio.get_running_loop())
        try:
            await asyncio.sleep(0)  # a real client yields to the loop at least once per call
            self._before(method, fault)
            if landing is not None:
                await landing.wait_async()
            return self._exit(method, fault, apply)
        finally:
            self._finished()

    async def pause_generation(self, mode: str = "abort") -> dict[str, Any]:
        return await self._call("pause_generation", self._pause)

    async def flush_cache(self, deadline_s: float | None = None) -> dict[str, Any]:
        return await self._call("flush_cache", self._flush)

    async def release_memory_occupation(self, tags: Sequence[str] | None = None) -> dict[str, Any]:
        return await self._call("release_memory_occupation", self._release(tags))

    async def resume_memory_occupation(self, tags: Sequence[str] | None = None) -> dict[str, Any]:
        return await self._call("resume_memory_occupation", self._resume(tags))

    async def continue_generation(self, torch_empty_cache: bool = True) -> dict[str, Any]:
        return await self._call("continue_generation", self._continue)


def _cancelled() -> None:
    raise asyncio.CancelledError("fake engine: cancelled")


AnyFake = FakeEngine | AsyncFakeEngine
"""Either kind of fake engine."""
