"""``Orchestrator``'s synchronous API over an ``AsyncOrchestrator`` whose loop runs on a thread of its own.

The state machine of ``test_barrier_properties.py`` calls the orchestrator from
test threads; this facade lets the same rules drive ``AsyncOrchestrator``: each
call is a task on one long-lived loop (``LoopThread``), and a ``weight_sync``
body runs on the calling thread while the task that entered the ``async with``
waits for it to end, so entry and exit happen in one task as they would in a
controller.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Iterator, Sequence
from concurrent.futures import CancelledError, Future
from contextlib import contextmanager
from typing import Any, TypeVar

from resilience.barrier import AsyncOrchestrator, HoldToken, TransitionReport

T = TypeVar("T")


class LoopThread:
    """One event loop on a daemon thread; ``run`` a coroutine on it from any other thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="facade-loop", daemon=True)
        self.thread.start()

    def submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 60.0) -> T:
        return self.submit(coro).result(timeout)

    def close(self) -> None:
        async def cancel_rest() -> None:
            rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in rest:
                task.cancel()
            await asyncio.gather(*rest, return_exceptions=True)

        self.run(cancel_rest())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


class SyncFacade:
    """The calls ``BarrierMachine`` makes, as ``Orchestrator`` spells them, onto ``orch`` on ``loop``."""

    def __init__(self, orch: AsyncOrchestrator[Any], loop: LoopThread) -> None:
        self.orch = orch
        self.loop = loop
        self.current: asyncio.Task[Any] | None = None
        """The task awaiting the latest transition (what ``cancel_current`` cancels)."""

    def cancel_current(self) -> None:
        """Cancel the task awaiting the transition now running (call it on the loop: an engine's interrupt hook)."""
        if self.current is not None:
            self.current.cancel()

    async def _tracked(self, coro: Coroutine[Any, Any, T]) -> T:
        self.current = asyncio.current_task()
        return await coro

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.loop.run(self._tracked(coro))

    def offload(self, tags: Sequence[str] | None = None, mode: Any = "abort") -> TransitionReport:
        return self._run(self.orch.offload(tags, mode))

    def onload(self, tags: Sequence[str] | None = None) -> TransitionReport:
        return self._run(self.orch.onload(tags))

    def pause(self, reason: str, mode: Any = "retract") -> TransitionReport:
        return self._run(self.orch.pause(reason, mode))

    def unpause(self, hold: HoldToken | str) -> TransitionReport:
        return self._run(self.orch.unpause(hold))

    def reconcile(self, engine: Any, *, released: Any, paused: bool | None) -> None:
        self.loop.run(self.orch.reconcile(engine, released=released, paused=paused))

    def retire(self, engine: Any) -> None:
        self.loop.run(self.orch.retire(engine))

    @contextmanager
    def weight_sync(self, mode: Any = "retract") -> Iterator[list[Any]]:
        entered: Future[list[Any]] = Future()
        leave = threading.Event()

        async def hold() -> None:
            self.current = asyncio.current_task()
            async with self.orch.weight_sync(mode) as engines:
                entered.set_result(engines)
                while not leave.is_set():  # the body runs on the caller's thread
                    await asyncio.sleep(0.001)

        def failed_on_entry(task: Future[None]) -> None:
            if not entered.done():
                if task.cancelled():  # cancelled on entry (an interrupt hook): the caller sees the cancellation
                    entered.set_exception(CancelledError("weight_sync was cancelled on entry"))
                    return
                error = task.exception()
                entered.set_exception(error or RuntimeError("weight_sync ended before its body"))

        task = self.loop.submit(hold())
        task.add_done_callback(failed_on_entry)
        engines = entered.result(60)  # entry failed: its PhaseFailed is raised here
        try:
            yield engines
        finally:
            leave.set()
            task.result(60)  # the exit's PhaseFailed, if any

    def __getattr__(self, name: str) -> Any:
        """The queries (``states``, ``held``, ``not_serving``, ...): thread-safe, called directly."""
        return getattr(self.orch, name)
