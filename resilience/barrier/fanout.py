"""Fan-outs: send one phase's call to many engines at once and wait for all of them.

``ThreadFanOut`` (default) runs each engine's call on a bounded thread pool with the caller's context copied, so the
phase Deadline caps every HTTP call made inside it. ``SequentialFanOut`` runs them one after another (a baseline for
benchmarks). ``resilience.barrier.async_fanout.AsyncFanOut`` runs engines whose control calls are coroutines on one
event loop, and ``resilience.adapters.ray.RayFanOut`` does the same with Ray actors and ObjectRefs.
"""

from __future__ import annotations

import contextvars
import inspect
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, Protocol

from resilience.deadline import Deadline
from resilience.engine_contract import CONTROL_METHODS, AnyEngine, engine_name

__all__ = [
    "Calls", "EngineNotDriven", "EngineResult", "FanOut", "FutureCall", "LateCall", "PhaseTimeout", "SequentialFanOut",
    "ThreadFanOut", "attach_results", "check_calls", "interrupted_results", "reported_versions", "vllm_hint",
]


class LateCall(Protocol):
    """A call still running after its phase gave up on it (a ``Future``, a Ray ObjectRef)."""

    def wait(self, timeout: float | None) -> tuple[bool, BaseException | None]:
        """Wait up to ``timeout`` s; (landed, its error or None). Not landed: (False, None)."""
        ...


class EngineNotDriven(TypeError):
    """The fan-out cannot drive this engine (a coroutine method on a thread fan-out): it sent nothing."""


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


def reported_versions(results: Iterable[EngineResult]) -> dict[str, str]:
    """Engine name -> the ``weight_version`` its answer carries (vLLM ``weight_info``, SGLang ``model_info``), for every
    answer without an error that has a non-empty one: what ``BarrierState.heard`` keeps per engine."""
    seen: dict[str, str] = {}
    for result in results:
        version = getattr(result.value, "weight_version", None) if result.error is None else None
        if isinstance(version, str) and version:
            seen[result.engine] = version
    return seen


_RESULTS_ATTR = "cpr_phase_results"


def attach_results(error: BaseException, results: Sequence[EngineResult | None]) -> None:
    """Hang what a fan-out read back on the ``error`` that interrupted it (``interrupted_results`` reads it)."""
    try:
        setattr(error, _RESULTS_ATTR, list(results))
    except (AttributeError, TypeError):  # an exception class with __slots__: the results are lost, the barrier stays pessimistic
        pass


def interrupted_results(error: BaseException) -> list[EngineResult | None] | None:
    """The results a fan-out read back when ``error`` (KeyboardInterrupt, SystemExit, ...) interrupted its phase, one per
    call in order: an answer, a call never sent, a late call with its handle, or None (unknown: it may have been applied).
    None when the fan-out attached nothing (then every call of the phase may have been applied)."""
    results = getattr(error, _RESULTS_ATTR, None)
    return list(results) if isinstance(results, list) else None


Calls = Sequence[tuple[AnyEngine, Mapping[str, Any]]]
"""(engine, keyword arguments) pairs: one call each."""


class FanOut(Protocol):
    """Calls ``method(**kwargs)`` on every engine at once and waits until all answered or the deadline passed.

    Two optional parts the ``Orchestrator`` uses when a fan-out has them: ``check_engines(engines)``, called when the
    orchestrator is built, raises ``TypeError`` naming an engine the fan-out cannot drive; and a fan-out interrupted
    part-way (KeyboardInterrupt, SystemExit) may hang what it read so far on the error (``attach_results``), else every
    call of the phase counts as ambiguous.
    """

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
        error = EngineNotDriven(f"{name}.{method} is a coroutine function: drive async engines with AsyncFanOut, not a thread fan-out")
        return EngineResult(name, error=error, duration_s=time.monotonic() - t0)
    return EngineResult(name, value=value, duration_s=time.monotonic() - t0)


def _run_into(
    future: Future[EngineResult],
    context: contextvars.Context,
    engine: AnyEngine,
    method: str,
    kwargs: Mapping[str, Any],
    deadline: Deadline,
) -> None:
    """On a pool thread: run the call into ``future`` unless it was cancelled first (then the call never starts)."""
    if not future.set_running_or_notify_cancel():
        return
    try:
        future.set_result(context.run(_invoke, engine, method, kwargs, deadline))
    except BaseException as exc:  # SystemExit and the like from the engine's call: the caller re-raises it
        future.set_exception(exc)


class FutureCall:
    """A ``LateCall`` over a ``Future`` of an ``EngineResult`` (what ``ThreadFanOut`` hands back for a late call)."""

    def __init__(self, future: Future[EngineResult]) -> None:
        self.future = future

    def wait(self, timeout: float | None) -> tuple[bool, BaseException | None]:
        """Wait up to ``timeout`` s for the call; (landed, its error or None)."""
        wait([self.future], timeout=timeout)
        if not self.future.done():
            return False, None
        if self.future.cancelled():
            return True, PhaseTimeout("a late call was cancelled before it started", maybe_sent=False)
        error = self.future.exception()
        if error is not None:  # a BaseException (SystemExit, ...) inside the engine's call: it may have been applied
            return True, error
        return True, self.future.result().error


class ThreadFanOut:
    """A bounded thread pool fan-out.

    ``max_workers``: threads at most (default 256: one per engine for fleets up to that size, so a phase takes the
    slowest engine's time, not a sum). Threads are created on demand and reused across phases.
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
        """Run the call on every engine concurrently; engines past the deadline get ``PhaseTimeout``.

        Interrupted while it waits (``KeyboardInterrupt`` reaches the caller's thread), or when an engine's call raised
        a ``BaseException`` that is not an ``Exception`` (``SystemExit`` on a worker), it re-raises that error with the
        results read so far attached (``interrupted_results``): calls still running come back late with their handle, so
        none is forgotten.
        """
        if not calls:
            return []
        pool = self._executor()
        seconds = deadline.remaining() if deadline.bounded else None
        futures: list[Future[EngineResult]] = [Future() for _ in calls]  # each exists before its call can start
        try:
            for (engine, kwargs), future in zip(calls, futures, strict=True):
                pool.submit(_run_into, future, contextvars.copy_context(), engine, method, kwargs, deadline)
            wait(futures, timeout=seconds)
        except BaseException as exc:
            attach_results(exc, self._read(calls, futures, method, "interrupted"))
            raise
        results = self._read(calls, futures, method, "no answer")
        for future in futures:
            error = None if future.cancelled() or not future.done() else future.exception()
            if error is not None:  # not an Exception (_invoke returns those): SystemExit or the like, from a worker
                attach_results(error, results)
                raise error
        return [r for r in results if r is not None]

    @staticmethod
    def _read(calls: Calls, futures: Sequence[Future[EngineResult]], method: str, why: str) -> list[EngineResult | None]:
        """One result per call, as things stand: answered, never sent, late (with a handle), or None (raised a BaseException)."""
        results: list[EngineResult | None] = []
        for (engine, _kwargs), future in zip(calls, futures, strict=True):
            name = engine_name(engine)
            if future.cancelled():
                results.append(EngineResult(name, error=PhaseTimeout(f"{method} never started ({why})", maybe_sent=False)))
            elif future.done():
                results.append(None if future.exception() is not None else future.result())
            elif future.cancel():  # not started yet: it will never reach the engine
                unsent = PhaseTimeout(f"{method} not started before the phase deadline ({why})", maybe_sent=False)
                results.append(EngineResult(name, error=unsent))
            else:  # running: it may still land; the orchestrator waits for it before sending anything else
                timeout = PhaseTimeout(f"{why} to {method} before the phase deadline")
                results.append(EngineResult(name, error=timeout, late=FutureCall(future)))
        return results

    def check_engines(self, engines: Iterable[object]) -> None:
        """Refuse an engine this fan-out cannot drive (a missing control method, coroutine calls): ``TypeError`` naming it."""
        check_calls(type(self).__name__, engines, coroutines=False)

    def close(self) -> None:
        """Stop the pool's threads (running calls finish on their own deadline)."""
        with self._lock:
            if self._pool is not None:
                self._pool.shutdown(wait=False, cancel_futures=True)
                self._pool = None


class SequentialFanOut:
    """One engine after another: the baseline a barrier's fan-out is compared with.

    Interrupted inside one engine's call (``KeyboardInterrupt``, ``SystemExit``), it re-raises with the results so far
    attached (``interrupted_results``): that call unknown, the ones after it never sent.
    """

    def check_engines(self, engines: Iterable[object]) -> None:
        """Refuse an engine this fan-out cannot drive (a missing control method, coroutine calls): ``TypeError`` naming it."""
        check_calls(type(self).__name__, engines, coroutines=False)

    def call(self, calls: Calls, method: str, deadline: Deadline) -> list[EngineResult]:
        """Run the call on each engine in turn, each capped by what is left of the deadline."""
        results: list[EngineResult] = []
        current = 0
        try:
            for i, (engine, kwargs) in enumerate(calls):
                current = i
                results.append(_invoke(engine, method, kwargs, deadline))  # past the deadline: not sent
        except BaseException as exc:
            partial: list[EngineResult | None] = [*results]
            for j in range(len(results), len(calls)):
                unsent = PhaseTimeout(f"{method} not sent: the phase was interrupted", maybe_sent=False)
                partial.append(None if j <= current else EngineResult(engine_name(calls[j][0]), error=unsent))
            attach_results(exc, partial)
            raise
        return results


def vllm_hint(engine: object) -> str:
    """A hint for a vLLM client given as an engine (it has vLLM's routes, not the barrier's calls)."""
    if callable(getattr(engine, "sleep", None)) and callable(getattr(engine, "wake_up", None)):
        return " (a vLLM client? the barrier drives resilience.adapters.vllm.VLLMEngine(client) / AsyncVLLMEngine(client))"
    return ""


def check_calls(owner: str, engines: Iterable[object], coroutines: bool | None) -> None:
    """Refuse, with a ``TypeError`` naming ``owner`` and the engine, an engine whose control calls ``owner`` cannot make:
    a method missing; with ``coroutines`` False, one that is a coroutine function (a thread cannot await it); True, one
    that is not (it would block the event loop); None: either kind runs."""
    for engine in engines:
        for method in CONTROL_METHODS:
            fn = getattr(engine, method, None)
            if not callable(fn):
                problem = f"it has no {method}() method{vllm_hint(engine)}"
            elif coroutines is False and inspect.iscoroutinefunction(fn):
                problem = f"its {method} is a coroutine function: drive async engines with AsyncFanOut or AsyncOrchestrator"
            elif coroutines and not inspect.iscoroutinefunction(fn):
                problem = f"its {method} is not a coroutine function (it would block the event loop; drive it with Orchestrator)"
            else:
                continue
            raise TypeError(f"{owner} cannot drive engine {engine_name(engine)}: {problem}")
