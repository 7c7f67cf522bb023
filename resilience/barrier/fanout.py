"""Fan-outs: send one phase's call to many engines at once and wait for all of them.

``ThreadFanOut`` (default) runs each engine's call on a bounded thread pool
with the caller's context copied, so the phase Deadline caps every HTTP call
made inside it. ``SequentialFanOut`` runs them one after another (a baseline
for benchmarks). ``resilience.barrier.async_fanout.AsyncFanOut`` runs engines
whose control calls are coroutines on one event loop, and
``resilience.adapters.ray.RayFanOut`` does the same with Ray actors and ObjectRefs.
"""

from __future__ import annotations

import contextvars
import inspect
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, Protocol

from resilience.barrier.engine import AnyEngine
from resilience.barrier.knowledge import LateCall
from resilience.deadline import Deadline

__all__ = [
    "Calls",
    "EngineDied",
    "EngineResult",
    "EngineUnavailable",
    "FanOut",
    "FutureCall",
    "PhaseTimeout",
    "SequentialFanOut",
    "ThreadFanOut",
    "engine_name",
]


class EngineDied(ConnectionError):
    """The engine (or the actor holding it) is gone: it will not answer again.

    The call that saw it may still have run (Ray says so of a dead actor), so
    the facts it touches are unknown.
    """


class EngineUnavailable(ConnectionError):
    """The engine's actor is unreachable for now (Ray's ``ActorUnavailableError``); the call may have run."""


class PhaseTimeout(TimeoutError):
    """An engine did not acknowledge a phase before the phase deadline.

    ``maybe_sent``: False when the call surely never started (it was still
    queued and was cancelled, or no time was left): nothing was applied.
    """

    def __init__(self, message: str, *, maybe_sent: bool = True) -> None:
        super().__init__(message)
        self.maybe_sent = maybe_sent


@dataclass(frozen=True, slots=True)
class EngineResult:
    """One engine's answer to one phase call.

    ``late``: for a call still running at the phase deadline (``error`` is
    then a ``PhaseTimeout``), a handle to wait for it to land; None otherwise.
    """

    engine: str
    value: Any = None
    error: BaseException | None = None
    duration_s: float = 0.0
    late: LateCall | None = None

    @property
    def ok(self) -> bool:
        """True when the call returned without error."""
        return self.error is None


def engine_name(engine: object) -> str:
    """The name an engine is known by: its ``engine`` attribute (``scheme://host:port``), else ``name``, else repr."""
    for attr in ("engine", "name"):
        value = getattr(engine, attr, None)
        if isinstance(value, str) and value:
            return value
    return repr(engine)


Calls = Sequence[tuple[AnyEngine, Mapping[str, Any]]]
"""(engine, keyword arguments) pairs: one call each."""


class FanOut(Protocol):
    """Calls ``method(**kwargs)`` on every engine at once and waits until all answered or the deadline passed."""

    def call(self, calls: Calls, method: str, deadline: Deadline) -> list[EngineResult]:
        """One result per (engine, kwargs) pair, in the order given."""
        ...


def _invoke(engine: AnyEngine, method: str, kwargs: Mapping[str, Any], deadline: Deadline) -> EngineResult:
    name = engine_name(engine)
    t0 = time.monotonic()
    if deadline.expired():
        return EngineResult(name, error=PhaseTimeout(f"no time left for {method}", maybe_sent=False))
    try:
        with Deadline(deadline.remaining() if deadline.bounded else None):
            value = getattr(engine, method)(**kwargs)
    except Exception as exc:
        return EngineResult(name, error=exc, duration_s=time.monotonic() - t0)
    if inspect.isawaitable(value):  # an async engine: nothing was sent, and a coroutine is not an answer
        if inspect.iscoroutine(value):
            value.close()
        error = TypeError(f"{name}.{method} is a coroutine function: drive async engines with AsyncFanOut, not a thread fan-out")
        return EngineResult(name, error=error, duration_s=time.monotonic() - t0)
    return EngineResult(name, value=value, duration_s=time.monotonic() - t0)


class FutureCall:
    """A ``LateCall`` over a ``Future`` of an ``EngineResult`` (what ``ThreadFanOut`` hands back for a late call)."""

    def __init__(self, future: Future[EngineResult]) -> None:
        self.future = future

    def wait(self, timeout: float | None) -> tuple[bool, BaseException | None]:
        """Wait up to ``timeout`` s for the call; (landed, its error or None)."""
        wait([self.future], timeout=timeout)
        if not self.future.done():
            return False, None
        return True, self.future.result().error


class ThreadFanOut:
    """A bounded thread pool fan-out.

    ``max_workers``: threads at most (default 256: one per engine for fleets
    up to that size, so a phase takes the slowest engine's time, not a sum).
    Threads are created on demand and reused across phases.
    """

    def __init__(self, max_workers: int = 256) -> None:
        if max_workers < 1:
            raise ValueError(f"ThreadFanOut max_workers must be >= 1, but was {max_workers}")
        self.max_workers = max_workers
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.max_workers, thread_name_prefix="cpr-fanout")
            return self._pool

    def call(self, calls: Calls, method: str, deadline: Deadline) -> list[EngineResult]:
        """Run the call on every engine concurrently; engines past the deadline get ``PhaseTimeout``."""
        if not calls:
            return []
        pool = self._executor()
        seconds = deadline.remaining() if deadline.bounded else None
        futures: list[Future[EngineResult]] = [
            pool.submit(contextvars.copy_context().run, _invoke, engine, method, kwargs, deadline) for engine, kwargs in calls
        ]
        wait(futures, timeout=seconds)
        results = []
        for (engine, _kwargs), future in zip(calls, futures, strict=True):
            if future.done():
                results.append(future.result())
            elif future.cancel():  # not started yet: it will never reach the engine
                unsent = PhaseTimeout(f"{method} not started before the phase deadline", maybe_sent=False)
                results.append(EngineResult(engine_name(engine), error=unsent))
            else:  # running: it may still land; the orchestrator waits for it before sending anything else
                timeout = PhaseTimeout(f"no answer to {method} before the phase deadline")
                results.append(EngineResult(engine_name(engine), error=timeout, late=FutureCall(future)))
        return results

    def close(self) -> None:
        """Stop the pool's threads (running calls finish on their own deadline)."""
        with self._lock:
            if self._pool is not None:
                self._pool.shutdown(wait=False, cancel_futures=True)
                self._pool = None


class SequentialFanOut:
    """One engine after another: the baseline a barrier's fan-out is compared with."""

    def call(self, calls: Calls, method: str, deadline: Deadline) -> list[EngineResult]:
        """Run the call on each engine in turn, each capped by what is left of the deadline."""
        results = []
        for engine, kwargs in calls:
            if deadline.expired():
                results.append(EngineResult(engine_name(engine), error=PhaseTimeout(f"no time left for {method}", maybe_sent=False)))
                continue
            results.append(_invoke(engine, method, kwargs, deadline))
        return results
