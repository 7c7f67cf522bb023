"""``AsyncFanOut``: one phase across engines whose control calls are coroutines, on one event loop.

- ``PhaseRun``: one phase's calls as tasks on the *running* loop, awaited together up to the phase deadline, then
  read. ``AsyncOrchestrator`` runs it on the caller's loop; ``AsyncFanOut`` on its own loop thread.
- ``TaskCall``: the ``LateCall`` of a call still running at its phase deadline (its task keeps running).
- ``AsyncFanOut``: the synchronous ``FanOut`` the ``Orchestrator`` takes, over an event loop on a thread of its own
  (started by the first ``call``, stopped by ``close()``). An engine is bound to the loop of its first call: close
  it there too (``fanout.run(client.aclose())``) before ``fanout.close()``.
- ``pause_collector``: Python's automatic garbage collection paused while a phase runs, for a bounded time. What a
  phase allocates stays alive until its calls end, so collecting then frees nothing (at 1024 engines it took about a
  third of the round's CPU: ``benchmarks/NOTES.md``, "Fan-out at scale, third pass"). The pause is process-wide; a
  watchdog thread ends each at its bound; a collector disabled before the first phase stays disabled (docs/barrier.md,
  "The garbage collector during a phase").
"""

from __future__ import annotations

import asyncio
import contextvars
import gc
import inspect
import itertools
import math
import os
import threading
import time
from collections.abc import Coroutine, Iterable, Mapping
from concurrent.futures import Future
from types import CoroutineType, TracebackType
from typing import Any, TypeVar

from resilience.barrier.fanout import Calls, EngineResult, PhaseTimeout, attach_results, check_calls
from resilience.deadline import Deadline
from resilience.engine_contract import AnyEngine, engine_name
from resilience.errors import ConfigError

__all__ = [
    "AsyncFanOut", "CollectorPause", "DEFAULT_GC_PAUSE_S", "PhaseRun", "TaskCall", "check_gc_pause",
    "collector_paused_by_us", "pause_collector",
]


DEFAULT_GC_PAUSE_S = 2.0
"""The longest one phase keeps the collector paused. It covers a phase's sends and answers at fan-out scale on
loopback (a 1024-engine phase takes about 0.3 s here); a longer phase (an engine taking seconds to release its
memory) waits for the rest with the collector running, as before, so cyclic garbage made meanwhile by anything
in the process waits at most this long."""

_cond = threading.Condition()
"""Guards everything below; the watchdog waits on it."""
_holds: dict[int, float] = {}
"""Each held pause, by id: the ``time.monotonic()`` reading at which it ends at the latest."""
_ids = itertools.count()
_ours = False
"""True while the collector is disabled because of a pause (it was enabled when the first one came)."""
_watchdog: threading.Thread | None = None
_wakes_at = math.inf
"""When the watchdog looks next (inf: when woken): a hold ending later than that needs no wake-up."""
_paused_at = 0.0
"""When the current pause began (read while ``_ours``): no hold taken during it ends later than this plus its bound."""


def _resume_if_free() -> None:
    global _ours
    if not _holds and _ours:
        _ours = False
        gc.enable()


def _watch() -> None:
    """The watchdog thread: ends every pause at its bound, whatever became of the loop or thread that took it."""
    global _wakes_at
    with _cond:
        while True:
            now = time.monotonic()
            for hold in [h for h, ends in _holds.items() if ends <= now]:
                del _holds[hold]
            _resume_if_free()
            _wakes_at = min(_holds.values(), default=math.inf)
            _cond.wait(None if math.isinf(_wakes_at) else _wakes_at - now)


def _take(max_s: float) -> tuple[int, float]:
    """Register a hold ending ``max_s`` from now, capped so that no pause outlasts its own start by more than ``max_s``.

    The order makes every interruption safe: the watchdog runs before anything is taken (if it cannot start, this
    raises and nothing is taken); the hold is registered before the collector is disabled (whatever lands after, the
    watchdog ends the hold and enables the collector again); ``_ours`` is set before ``gc.disable()``.
    """
    global _ours, _watchdog, _paused_at
    with _cond:
        if _watchdog is None:
            watchdog = threading.Thread(target=_watch, name="cpr-gc-pause-watchdog", daemon=True)
            watchdog.start()
            _watchdog = watchdog
        now = time.monotonic()
        if not _ours:
            _paused_at = now
        hold, ends = next(_ids), _paused_at + max_s  # holds back to back never chain a pause past its bound
        _holds[hold] = ends
        if len(_holds) == 1 and gc.isenabled():
            _ours = True
            gc.disable()
        if ends < _wakes_at:
            _cond.notify()
        return hold, ends


def _move(hold: int, ends: float | None) -> None:
    """End ``hold`` now (``ends`` None) or move its end to ``ends``."""
    with _cond:
        if hold not in _holds:
            return
        if ends is None:
            del _holds[hold]
            _resume_if_free()
        else:
            _holds[hold] = ends
            if ends < _wakes_at:
                _cond.notify()


def _after_fork_in_child() -> None:
    """A forked child has no watchdog and holds no pause of its parent's: start clean, the collector as it was before."""
    global _cond, _watchdog, _ours, _wakes_at
    _cond = threading.Condition()
    _holds.clear()
    _watchdog = None
    _wakes_at = math.inf
    if _ours:
        _ours = False
        gc.enable()


os.register_at_fork(after_in_child=_after_fork_in_child)


def collector_paused_by_us() -> bool:
    """True while some phase holds the collector paused (it was enabled before, and will be again)."""
    with _cond:
        return _ours


class CollectorPause:
    """One phase's hold on the pause (``pause_collector``); ``end()`` lets go of it, once, however often it is called."""

    __slots__ = ("_bound", "_hold")

    def __init__(self, hold: int | None, bound: float) -> None:
        self._hold = hold
        self._bound = bound

    @property
    def held(self) -> bool:
        """True until ``end()`` ran or the bound passed; False from the start for a pause of 0 s."""
        if self._hold is None:
            return False
        with _cond:
            return self._hold in _holds

    def end(self) -> None:
        """Let go of the pause (the collector runs again once no other phase holds it); idempotent, from any thread."""
        if self._hold is not None:
            _move(self._hold, None)
            self._hold = None

    def end_after(self, seconds: float) -> None:
        """Let go ``seconds`` from now instead (0 or less: now), never later than the bound it was taken with."""
        if self._hold is None or not seconds > 0:
            self.end()
        else:
            _move(self._hold, min(time.monotonic() + seconds, self._bound))


def pause_collector(max_s: float) -> CollectorPause:
    """Pause automatic garbage collection until the returned hold's ``end()``, or ``max_s`` seconds, whichever is first.

    ``max_s``: the bound in seconds; 0 (or less) pauses nothing. A watchdog thread (one per process) ends each pause at
    its bound, whatever became of the loop that took it. Holds taken while the collector is already paused end no later
    than that pause's start plus their own bound, so phases back to back never keep it paused longer than the longest
    bound among them. When the watchdog cannot be started, nothing is paused.
    """
    if not max_s > 0:
        return CollectorPause(None, 0.0)
    try:
        hold, ends = _take(max_s)
    except RuntimeError:  # no thread for the watchdog ("can't start new thread", interpreter shutdown): no pause
        return CollectorPause(None, 0.0)
    return CollectorPause(hold, ends)


def check_gc_pause(owner: str, gc_pause_s: float) -> float:
    """``gc_pause_s`` as a float when it is a finite number >= 0 (a pause is always bounded); a ``ConfigError`` naming
    ``owner`` otherwise."""
    if isinstance(gc_pause_s, bool) or not isinstance(gc_pause_s, (int, float)) or not 0 <= gc_pause_s < math.inf:
        raise ConfigError(
            f"{owner} gc_pause_s must be a finite number of seconds >= 0 (0 = leave the collector alone), but was {gc_pause_s!r}"
        )
    return float(gc_pause_s)


T = TypeVar("T")

FOLD_LINGER_S = 0.25
"""How long ``AsyncFanOut`` keeps the collector paused after a phase, while the caller's thread folds its results in
(at N = 1024 the fold takes tens of ms here; the collections it would trigger walk the phase's results)."""


class _Call:
    """One engine's call in a phase; ``started`` once it got past the concurrency gate (it may reach the engine)."""

    __slots__ = ("engine", "kwargs", "method", "name", "started")

    def __init__(self, engine: AnyEngine, method: str, kwargs: Mapping[str, Any]) -> None:
        self.engine = engine
        self.name = engine_name(engine)
        self.method = method
        self.kwargs = kwargs
        self.started = False


async def _invoke(call: _Call, deadline: Deadline, gate: asyncio.Semaphore | None = None) -> EngineResult:
    """Call the engine under the phase deadline, once ``gate`` (the concurrency limit; None: none) lets it in; every
    ``Exception`` becomes the result's error (as ``fanout._invoke``). The task runs in a copy of ``_phase_context``, so
    the phase deadline caps the call's HTTP requests."""
    if gate is not None:
        async with gate:
            return await _invoke(call, deadline)
    t0 = time.monotonic()
    if deadline.expired():
        return EngineResult(call.name, error=PhaseTimeout(f"no time left for {call.method}", maybe_sent=False))
    call.started = True
    try:
        value = getattr(call.engine, call.method)(**call.kwargs)
        if type(value) is CoroutineType or inspect.isawaitable(value):  # the type test first: no call for a coroutine
            value = await value
    except Exception as exc:
        return EngineResult(call.name, error=exc, duration_s=time.monotonic() - t0)
    return EngineResult(call.name, value=value, duration_s=time.monotonic() - t0)


def _phase_context(deadline: Deadline) -> contextvars.Context:
    """A copy of the current context with the phase deadline in force: a ``Deadline`` on the system clock (the phase's
    own may be on an injected one), capped by any deadline already in force. Each call's task runs in a copy of it
    (one ``Deadline`` a phase, not one a call)."""
    context = contextvars.copy_context()
    context.run(Deadline(deadline.remaining() if deadline.bounded else None).__enter__)
    return context


class TaskCall:
    """A ``LateCall`` over the task of a call that missed its phase deadline (``EngineResult.late``).

    ``wait`` may be called from any thread; on the task's own loop thread it only polls (blocking there would stop the
    loop the task runs on), so code on that loop uses ``wait_async``. A task cancelled while it may have been running
    (``AsyncFanOut.close``, the loop shutting down) lands as a ``PhaseTimeout`` that says so: the call may have run.
    """

    def __init__(self, task: asyncio.Task[EngineResult], call: _Call) -> None:
        self.task = task
        self.loop = task.get_loop()
        self.engine = call.name
        self._call = call
        self._landed = threading.Event()
        task.add_done_callback(lambda _task: self._landed.set())  # created on the task's loop: the callback runs there

    def _outcome(self) -> BaseException | None:
        if self.task.cancelled():
            return PhaseTimeout(f"{self.engine}: a late {self._call.method} was cancelled; it may have run", maybe_sent=self._call.started)
        return self.task.result().error

    def _on_own_loop(self) -> bool:
        try:
            return asyncio.get_running_loop() is self.loop
        except RuntimeError:
            return False

    def wait(self, timeout: float | None) -> tuple[bool, BaseException | None]:
        """Wait up to ``timeout`` s (None: no limit); (landed, its error or None). Not landed: (False, None)."""
        if not self.task.done():
            if self.loop.is_closed():  # its loop is gone and the task never ended: it may have run
                return True, PhaseTimeout(f"{self.engine}: the loop of a late {self._call.method} closed; it may have run")
            if self._on_own_loop() or not self._landed.wait(timeout):
                return False, None
        return True, self._outcome()

    async def wait_async(self, timeout: float | None) -> tuple[bool, BaseException | None]:
        """``wait`` for code running on an event loop: awaits the task on its own loop, else waits in a worker thread."""
        if not self.task.done():
            if not self._on_own_loop():
                return await asyncio.to_thread(self.wait, timeout)
            await asyncio.wait({self.task}, timeout=timeout)  # never cancels the task, even when this waiter is
            if not self.task.done():
                return False, None
        return True, self._outcome()


class PhaseRun:
    """One phase's calls as tasks on the running loop: created at once by the constructor, each under the phase deadline.

    ``await wait()`` returns when every call answered or the deadline passed; ``results()`` reads them at any moment
    (also after the waiting task was cancelled): a call not started yet is cancelled and reported as not sent
    (``PhaseTimeout(maybe_sent=False)``); one still running keeps running and is reported late (``PhaseTimeout`` with a
    ``TaskCall``). ``gate``: a semaphore bounding the calls running at once (None: no bound). ``gc_pause_s``: the
    bound of the collector's pause for the phase, from the tasks' creation until ``wait`` returns (``pause_collector``;
    default ``DEFAULT_GC_PAUSE_S``; 0 leaves the collector alone). ``linger_s``: how much longer the pause lasts once
    ``wait`` returned, while the caller folds the results in (default 0). Interrupted while it creates the tasks, it
    cancels those it made (none has started) and re-raises, so the phase sent nothing.
    """

    def __init__(
        self,
        calls: Calls,
        method: str,
        deadline: Deadline,
        *,
        gate: asyncio.Semaphore | None = None,
        gc_pause_s: float = DEFAULT_GC_PAUSE_S,
        linger_s: float = 0.0,
    ) -> None:
        self.method = method
        self.deadline = deadline
        self._linger_s = linger_s  # ``end_after`` keeps it within the pause's bound
        self._waited = False
        self.calls = [_Call(engine, method, kwargs) for engine, kwargs in calls]
        self._left = len(self.calls)
        """Calls whose task has not ended yet (``_ended`` counts them down, and resolves ``_all_ended`` at 0)."""
        self._all_ended: asyncio.Future[None] | None = None
        self._pause = pause_collector(gc_pause_s if self.calls else 0.0)
        self.tasks: list[asyncio.Task[EngineResult]] = []
        try:
            if self.calls:
                loop = asyncio.get_running_loop()
                self._all_ended = loop.create_future()
                context = _phase_context(deadline)
                for c in self.calls:
                    task = loop.create_task(_invoke(c, deadline, gate), name=f"cpr-{method}-{c.name}", context=context.copy())
                    task.add_done_callback(self._ended)
                    self.tasks.append(task)
        except BaseException:  # an interrupt while the tasks are made: none has run yet (this runs on the loop), so none will
            for task in self.tasks:
                task.cancel()
            self._pause.end()
            raise

    def _ended(self, _task: asyncio.Task[EngineResult]) -> None:
        """Each task's done callback: one call fewer to wait for."""
        self._left -= 1
        if not self._left and self._all_ended is not None:
            self._all_ended.set_result(None)

    async def wait(self) -> None:
        """Until every call answered or the phase deadline passed (the tasks are never cancelled by this).

        It waits for one future that the tasks' done callbacks resolve when the last one ends: ``asyncio.wait`` over
        the tasks themselves would check each one and add and remove a callback on each, every phase.
        """
        try:
            if self._all_ended is not None:
                await asyncio.wait((self._all_ended,), timeout=self.deadline.remaining() if self.deadline.bounded else None)
        finally:
            self._waited = True
            self._pause.end_after(self._linger_s)

    def results(self) -> list[EngineResult]:
        """One result per call, in the order given: answered, not sent, or late."""
        if not self._waited:  # read without waiting (the caller was cancelled): the phase is over for the collector too
            self._pause.end()
        results = []
        for call, task in zip(self.calls, self.tasks, strict=True):
            if task.done() and not task.cancelled():
                results.append(task.result())
            elif not call.started:  # queued at the gate (or never scheduled): it will never reach the engine
                task.cancel()
                unsent = PhaseTimeout(f"{self.method} not started before the phase deadline", maybe_sent=False)
                results.append(EngineResult(call.name, error=unsent))
            elif task.done():  # cancelled from outside while it may have been running
                results.append(EngineResult(call.name, error=PhaseTimeout(f"{self.method} was cancelled; it may have run")))
            else:  # running: it may still land; the orchestrator waits for it before sending anything else
                late = PhaseTimeout(f"no answer to {self.method} before the phase deadline")
                results.append(EngineResult(call.name, error=late, late=TaskCall(task, call)))
        return results


class _Slot:
    """Where ``AsyncFanOut.call`` finds its phase on the loop when the caller is interrupted (read and set on the loop thread)."""

    __slots__ = ("abandoned", "run")

    def __init__(self) -> None:
        self.run: PhaseRun | None = None
        self.abandoned = False


def _unsent(calls: Calls, method: str) -> list[EngineResult]:
    why = f"{method} not sent: the phase was interrupted"
    return [EngineResult(engine_name(e), error=PhaseTimeout(why, maybe_sent=False)) for e, _ in calls]


class AsyncFanOut:
    """A ``FanOut`` that runs each phase's calls as tasks on one event loop, owned by a thread of its own.

    For engines whose control calls are coroutines (a synchronous engine works too, one call after another on the
    loop: use ``ThreadFanOut`` for those). ``ThreadFanOut``'s meaning: each call runs under the phase deadline; one not
    started by then is not sent; one still running is late (``EngineResult.late``) and keeps running on the loop until
    it lands. The loop thread starts on the first ``call`` and stops on ``close()`` (also a context manager).

    ``max_concurrency``: calls running at once (default None: all of a phase at once; with a bound, those still queued
    at the deadline are not sent). ``close_timeout_s``: how long ``close`` waits for the tasks it cancels (default
    5.0). ``gc_pause_s``: the bound of the collector's pause during a phase (``pause_collector``; default
    ``DEFAULT_GC_PAUSE_S``; 0 leaves the collector alone); it lasts ``FOLD_LINGER_S`` past the phase's end, while the
    calling thread folds the results in.
    """

    def __init__(self, *, max_concurrency: int | None = None, close_timeout_s: float = 5.0, gc_pause_s: float = DEFAULT_GC_PAUSE_S) -> None:
        if max_concurrency is not None and max_concurrency < 1:
            raise ConfigError(f"AsyncFanOut max_concurrency must be >= 1 or None, but was {max_concurrency}")
        if not close_timeout_s >= 0:
            raise ConfigError(f"AsyncFanOut close_timeout_s must be >= 0, but was {close_timeout_s!r}")
        self.max_concurrency = max_concurrency
        self.close_timeout_s = close_timeout_s
        self.gc_pause_s = check_gc_pause("AsyncFanOut", gc_pause_s)
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._gate: asyncio.Semaphore | None = None

    # -- the loop thread -------------------------------------------------------------------

    def _start(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                thread = threading.Thread(target=self._serve, args=(loop,), name="cpr-async-fanout", daemon=True)
                thread.start()
                self._loop, self._thread = loop, thread
                self._gate = None if self.max_concurrency is None else asyncio.Semaphore(self.max_concurrency)
            return self._loop

    def _serve(self, loop: asyncio.AbstractEventLoop) -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_forever()
            pending = asyncio.all_tasks(loop)
            for task in pending:
                task.cancel()
            if pending:
                loop.run_until_complete(asyncio.wait(pending, timeout=self.close_timeout_s))
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            loop.close()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The fan-out's event loop (started if it was not running)."""
        return self._start()

    def _submit(self, coro: Coroutine[Any, Any, T], context: contextvars.Context | None = None) -> Future[T]:
        loop = self._start()
        if self._thread is threading.current_thread():
            coro.close()
            raise RuntimeError("AsyncFanOut was called from its own loop thread: it would wait for itself (await the engines instead)")
        future: Future[T] = Future()

        def start() -> None:  # on the loop thread, in ``context``: the task copies it
            if not future.set_running_or_notify_cancel():
                coro.close()
                return
            task = loop.create_task(coro)

            def done(task: asyncio.Task[T]) -> None:
                if task.cancelled():
                    future.set_exception(RuntimeError("AsyncFanOut was closed while the call ran"))
                elif (error := task.exception()) is not None:
                    future.set_exception(error)
                else:
                    future.set_result(task.result())

            task.add_done_callback(done)

        loop.call_soon_threadsafe(start, context=context)
        return future

    # -- FanOut ----------------------------------------------------------------------------

    def check_engines(self, engines: Iterable[object]) -> None:
        """Refuse an engine with a control method missing: ``TypeError`` naming it (coroutine and plain calls both run here)."""
        check_calls("AsyncFanOut", engines, coroutines=None)

    def call(self, calls: Calls, method: str, deadline: Deadline) -> list[EngineResult]:
        """Run the call on every engine at once on the loop; engines past the deadline get ``PhaseTimeout``.

        Interrupted while it waits (``KeyboardInterrupt`` in the caller's thread), it reads the phase back on the loop
        (up to ``close_timeout_s``), attaches it to the error (``interrupted_results``: running calls come back late
        with their handle, queued ones as never sent) and re-raises.
        """
        if not calls:
            return []
        slot = _Slot()
        try:
            # the submit is inside the try: an interrupt that lands in it once the phase is queued on the loop (its
            # self-pipe write, say) must still mark the phase abandoned, or the phase would run unseen
            future = self._submit(self._phase(calls, method, deadline, slot), contextvars.copy_context())
            return future.result()
        except BaseException as exc:
            self._read_back(exc, slot, calls, method)
            raise

    def _read_back(self, exc: BaseException, slot: _Slot, calls: Calls, method: str) -> None:
        loop = self._loop
        if loop is None or loop.is_closed() or self._thread is threading.current_thread():  # on the loop: it cannot answer
            return
        try:
            read = self._queue_read_back(loop, slot, calls, method)
            attach_results(exc, read.result(self.close_timeout_s))
        except Exception:  # the loop is gone or too slow: nothing attached, the barrier stays pessimistic
            pass

    def _queue_read_back(self, loop: asyncio.AbstractEventLoop, slot: _Slot, calls: Calls, method: str) -> Future[list[EngineResult]]:
        """Queue, on the loop, the marking of the phase as abandoned and the reading of its results; their future.

        Whichever of the phase's start and this runs first on the loop decides: the phase not started yet never starts
        (every call comes back not sent); one that started is read as it stands (answered, late or not sent).
        """
        read: Future[list[EngineResult]] = Future()

        def on_loop() -> None:
            slot.abandoned = True
            try:
                read.set_result(slot.run.results() if slot.run is not None else _unsent(calls, method))
            except BaseException as error:  # handed to the waiting thread
                read.set_exception(error)

        loop.call_soon_threadsafe(on_loop)
        return read

    async def _phase(self, calls: Calls, method: str, deadline: Deadline, slot: _Slot | None = None) -> list[EngineResult]:
        if slot is not None and slot.abandoned:  # the caller was interrupted before the phase started: nothing is sent
            return _unsent(calls, method)
        run = PhaseRun(calls, method, deadline, gate=self._gate, gc_pause_s=self.gc_pause_s, linger_s=FOLD_LINGER_S)
        if slot is not None:
            slot.run = run
        try:
            await run.wait()
        except asyncio.CancelledError:  # close() during the phase: report every call as it stands, late ones with a handle
            pass
        return run.results()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the fan-out's loop and return its result: build or close engines there (``fanout.run(c.aclose())``).

        ``timeout``: seconds to wait for it (None: no limit); past it, ``TimeoutError`` (the coroutine keeps running).
        """
        return self._submit(coro, contextvars.copy_context()).result(timeout)

    def close(self) -> None:
        """Stop the loop thread: tasks still running (late calls) are cancelled, and waited for up to ``close_timeout_s``."""
        with self._lock:
            loop, thread = self._loop, self._thread
            self._loop = self._thread = self._gate = None
        if loop is None or thread is None:
            return
        loop.call_soon_threadsafe(loop.stop)
        if thread is not threading.current_thread():
            thread.join(self.close_timeout_s + 5.0)

    def __enter__(self) -> AsyncFanOut:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()
