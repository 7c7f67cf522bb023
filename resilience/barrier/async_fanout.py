"""``AsyncFanOut``: one phase across engines whose control calls are coroutines, on one event loop.

The pieces, from the bottom:

- ``PhaseRun``: one phase's calls as tasks on the *running* loop: started at
  once, awaited together up to the phase deadline, then read. ``AsyncOrchestrator``
  runs it on the caller's loop; ``AsyncFanOut`` on its own loop thread.
- ``TaskCall``: the ``LateCall`` of a call still running at its phase deadline
  (its task keeps running, as ``ThreadFanOut``'s thread does; the orchestrator
  waits for it to land before it sends that engine anything else).
- ``AsyncFanOut``: the synchronous ``FanOut`` the ``Orchestrator`` takes. It owns
  an event loop on a thread of its own (started by the first ``call``, stopped by
  ``close()``) and runs every phase there.

Engines are used on the loop that runs their calls. An async client that opens
its connection pool lazily on first use (``AsyncSGLangClient`` creates its
``aiohttp`` session inside the loop of its first call) is therefore bound to
``AsyncFanOut``'s loop after its first phase: build it anywhere, but close it
there too (``fanout.run(client.aclose())``) before ``fanout.close()``, and do not
share it with another loop.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import threading
import time
from collections.abc import Coroutine, Iterable, Mapping
from concurrent.futures import Future
from types import TracebackType
from typing import Any, TypeVar

from resilience.barrier.collector import DEFAULT_GC_PAUSE_S, check_gc_pause, pause_collector
from resilience.barrier.fanout import Calls, EngineResult, PhaseTimeout, attach_results, vllm_hint
from resilience.deadline import Deadline
from resilience.engine_contract import CONTROL_METHODS, AnyEngine, engine_name
from resilience.errors import ConfigError

__all__ = ["AsyncFanOut", "PhaseRun", "TaskCall", "engine_problem"]

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


async def _invoke_gated(call: _Call, deadline: Deadline, gate: asyncio.Semaphore) -> EngineResult:
    """``_invoke`` once ``gate`` (the fan-out's concurrency limit) lets the call in."""
    async with gate:
        return await _invoke(call, deadline)


async def _invoke(call: _Call, deadline: Deadline) -> EngineResult:
    """Call the engine under the phase deadline; every ``Exception`` becomes the result's error (as ``fanout._invoke``)."""
    t0 = time.monotonic()
    if deadline.expired():
        return EngineResult(call.name, error=PhaseTimeout(f"no time left for {call.method}", maybe_sent=False))
    call.started = True
    try:
        with Deadline(deadline.remaining() if deadline.bounded else None):  # this task's own context: caps its HTTP calls
            value = getattr(call.engine, call.method)(**call.kwargs)
            if inspect.isawaitable(value):
                value = await value
    except Exception as exc:
        return EngineResult(call.name, error=exc, duration_s=time.monotonic() - t0)
    return EngineResult(call.name, value=value, duration_s=time.monotonic() - t0)


class TaskCall:
    """A ``LateCall`` over the task of a call that missed its phase deadline (``EngineResult.late``).

    ``wait`` may be called from any thread; on the task's own loop thread it
    only polls (blocking there would stop the loop the task runs on), so code
    on that loop uses ``wait_async``. A task cancelled while it may have been
    running (``AsyncFanOut.close``, the loop shutting down) lands as a
    ``PhaseTimeout`` that says so: the call may have run.
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
            return PhaseTimeout(
                f"{self.engine}: a late {self._call.method} was cancelled; it may have run", maybe_sent=self._call.started
            )
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

    ``await wait()`` returns when every call answered or the deadline passed;
    ``results()`` reads them at any moment (also after the waiting task was
    cancelled): a call not started yet is cancelled and reported as not sent
    (``PhaseTimeout(maybe_sent=False)``); one still running keeps running and is
    reported late (``PhaseTimeout`` with a ``TaskCall``), never cancelled, so what
    it does is learnt when it lands. ``gate``: a semaphore bounding the calls
    running at once (None: no bound). ``gc_pause_s``: the longest Python's
    automatic garbage collection stays paused for the phase, from the tasks'
    creation until ``wait`` returns (``resilience.barrier.collector``; default
    ``DEFAULT_GC_PAUSE_S`` = 2.0 s; 0 leaves the collector alone).
    ``linger_s``: how much longer the pause lasts once ``wait`` returned, so
    that the caller folds the results in before the collector runs again
    (default 0; never past the pause's bound). Interrupted while it creates
    the tasks, it cancels those it made (none has started: the constructor
    runs on the loop) and re-raises, so the phase sent nothing.
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
        self._pause = pause_collector(gc_pause_s if self.calls else 0.0)
        self.tasks: list[asyncio.Task[EngineResult]] = []
        try:
            for c in self.calls:
                coro = _invoke(c, deadline) if gate is None else _invoke_gated(c, deadline, gate)
                self.tasks.append(asyncio.create_task(coro, name=f"cpr-{method}-{c.name}"))
        except BaseException:  # an interrupt while the tasks are made: none has run yet (this runs on the loop), so none will
            for task in self.tasks:
                task.cancel()
            self._pause.end()
            raise

    async def wait(self) -> None:
        """Until every call answered or the phase deadline passed (the tasks are never cancelled by this)."""
        try:
            if self.tasks:
                await asyncio.wait(self.tasks, timeout=self.deadline.remaining() if self.deadline.bounded else None)
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


def engine_problem(engine: object) -> str | None:
    """Why ``engine`` cannot be driven at all (a control method missing), or None."""
    for method in CONTROL_METHODS:
        if not callable(getattr(engine, method, None)):
            return f"{engine_name(engine)}: it has no {method}() method{vllm_hint(engine)}"
    return None


class AsyncFanOut:
    """A ``FanOut`` that runs each phase's calls as tasks on one event loop, owned by a thread of its own.

    For engines whose control calls are coroutines (``AsyncSGLangClient``, any
    ``AsyncControlPlaneEngine``); a synchronous engine also works, but its calls
    run one after another on the loop, so use ``ThreadFanOut`` for those. Same
    semantics as ``ThreadFanOut``: each call runs under the phase deadline (a
    ``Deadline`` in its task's context, copied from the caller's); a call not
    started by the deadline is not sent (``PhaseTimeout(maybe_sent=False)``); one
    still running is a ``PhaseTimeout`` with ``EngineResult.late``, and keeps
    running on the loop until it lands (its own deadline ends it); an exception
    is the engine's error. The loop thread starts on the first ``call`` and stops
    on ``close()`` (also a context manager); a ``call`` after ``close`` starts a
    new loop, to which engines bound to the old one cannot move.

    ``max_concurrency``: calls running at once (default None: all of a phase at
    once, the point of one loop; a bound makes the rest queue, and those still
    queued at the deadline are not sent). ``close_timeout_s``: how long ``close``
    waits for tasks it cancels to end (default 5.0). ``gc_pause_s``: the longest
    Python's automatic garbage collection stays paused during a phase, from its
    tasks' creation until they all answered (``resilience.barrier.collector``:
    what a phase allocates stays alive until it ends, so collecting then frees
    nothing; default ``DEFAULT_GC_PAUSE_S`` = 2.0 s; 0 leaves the collector alone).
    The pause lasts ``FOLD_LINGER_S`` (0.25 s) past the phase's end, while the
    calling thread folds the results in (the next phase's pause takes over).
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
        for engine in engines:
            problem = engine_problem(engine)
            if problem is not None:
                raise TypeError(f"AsyncFanOut cannot drive {problem}")

    def call(self, calls: Calls, method: str, deadline: Deadline) -> list[EngineResult]:
        """Run the call on every engine at once on the loop; engines past the deadline get ``PhaseTimeout``.

        Interrupted while it waits (``KeyboardInterrupt`` in the caller's
        thread), it reads the phase back on the loop (up to ``close_timeout_s``),
        attaches it to the error (``interrupted_results``: running calls come
        back late with their handle, queued ones as never sent) and re-raises.
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

    def _queue_read_back(
        self, loop: asyncio.AbstractEventLoop, slot: _Slot, calls: Calls, method: str
    ) -> Future[list[EngineResult]]:
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
