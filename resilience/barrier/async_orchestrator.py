"""``AsyncOrchestrator``: the barrier for controllers that already run an event loop (AReaL-style).

The same transitions as ``Orchestrator`` (steps in ``resilience.barrier.transitions``), driven with ``await``: each
phase's calls are tasks on the caller's loop (``PhaseRun``), awaited together up to the phase deadline. The knowledge
lock is a short thread lock taken while a step is decided or folded, never across an ``await``; transitions exclude
each other with an ``asyncio.Lock``.

Cancelling the task that awaits a transition stops it from sending anything more; calls already sent are not
cancelled (answered ones are folded in, running ones are in flight until they land, as a late call is). Holds stay as
the transition left them: a cancelled offload keeps its "offload" hold; a cancelled pause drops the hold nobody
received; a ``weight_sync`` whose body is cancelled still ends its hold on the way out (cancelled again there, it
drops the hold without sending anything more).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from collections.abc import AsyncIterator, Iterable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Literal, TypeVar, Unpack

from resilience.barrier import membership, transitions
from resilience.barrier.async_fanout import DEFAULT_GC_PAUSE_S, PhaseRun, TaskCall, check_gc_pause, pause_collector
from resilience.barrier.fanout import LateCall, check_calls
from resilience.barrier.state import BarrierBusy, BarrierKeywords, BarrierOptions, BarrierState, EngineGroup, HoldToken, TransitionReport
from resilience.barrier.verify import EngineCheck, checks_arg, verify_steps
from resilience.barrier.view import BarrierView
from resilience.engine_contract import AsyncControlPlaneEngine, PauseMode
from resilience.errors import ConfigError

__all__ = ["AsyncOrchestrator"]

A = TypeVar("A", bound=AsyncControlPlaneEngine)
T = TypeVar("T")

_IN_BODY: contextvars.ContextVar[frozenset[int]] = contextvars.ContextVar("cpr_weight_sync_bodies", default=frozenset())
"""Ids of the orchestrators whose ``weight_sync`` body the current task (or a task it started) runs in."""


@dataclass
class _LoopState:
    """What is bound to the event loop the orchestrator runs on."""

    loop: asyncio.AbstractEventLoop
    lock: asyncio.Lock
    idle: asyncio.Event
    """Set while no ``weight_sync`` body runs."""
    gate: asyncio.Semaphore | None


class AsyncOrchestrator(BarrierView[A]):
    """``Orchestrator`` for an event loop: ``await offload()``, ``await onload()``, ``async with weight_sync()``.

    ``groups`` and the keywords of ``Orchestrator`` (``observers``, ``deadlines``, ``restart_budget``, ``rollback``,
    ``clock``, ``memory_probe``, ``journal``: its journal's writes are short blocking fsyncs on the loop's thread) mean
    the same here. Engines satisfy ``AsyncControlPlaneEngine`` (their control calls coroutines, else a ``TypeError``
    naming the engine); their calls run on the loop of the task that awaits the transition, so use the orchestrator
    and the engines from one loop. ``max_concurrency``: calls running at once within a phase (default None: all).
    ``gc_pause_s``: the bound of the collector's pause during a transition, from its start until it returns, and
    during each of its phases (``resilience.barrier.async_fanout.pause_collector``; default ``DEFAULT_GC_PAUSE_S`` =
    2.0 s; 0 leaves the collector alone).

    The queries are plain methods, safe from any thread; ``reconcile``, ``retire`` and ``add`` wait for a running
    transition. ``offload``/``onload`` wait for running ``weight_sync`` bodies (up to ``transition_s``, else
    ``BarrierBusy``), and raise ``BarrierBusy`` at once when awaited inside a body (by its task or a task it started).
    """

    def __init__(
        self,
        groups: EngineGroup[A] | Sequence[EngineGroup[A]],
        *,
        max_concurrency: int | None = None,
        gc_pause_s: float = DEFAULT_GC_PAUSE_S,
        **options: Unpack[BarrierKeywords],
    ) -> None:
        if max_concurrency is not None and max_concurrency < 1:
            raise ConfigError(f"AsyncOrchestrator max_concurrency must be >= 1 or None, but was {max_concurrency}")
        self.gc_pause_s = check_gc_pause("AsyncOrchestrator", gc_pause_s)
        self.state: BarrierState[A] = BarrierState(groups, BarrierOptions.of("AsyncOrchestrator", options), owner="AsyncOrchestrator")
        check_calls("AsyncOrchestrator", self.state.engines.values(), coroutines=True)
        self.max_concurrency = max_concurrency
        self._bodies = 0
        self._on: _LoopState | None = None
        transitions.resume(self.state)

    # -- recovery ----------------------------------------------------------------

    async def retire(self, engine: str | A) -> None:
        """Stop sending anything to ``engine`` (dead, or replaced): no transition covers or names it again."""
        async with self._loop_state().lock:
            membership.retire(self.state, engine)

    async def reconcile(self, engine: str | A, *, released: Iterable[str] | None, paused: bool | None) -> None:
        """Tell the orchestrator ``engine``'s real state; see ``Orchestrator.reconcile`` (the same rules and refusals)."""
        async with self._loop_state().lock:
            transitions.reconcile(self.state, engine, released=released, paused=paused)

    async def add(
        self, engine: A, *, group: str | int | None = None, verify: EngineCheck | Sequence[EngineCheck] = ()
    ) -> TransitionReport:
        """Bring ``engine`` into ``group``'s current state before it counts; see ``Orchestrator.add`` (its calls must be
        coroutines, as the constructor requires)."""
        checks = checks_arg(verify)
        check_calls("AsyncOrchestrator.add", [engine], coroutines=True)
        state = self._loop_state()
        async with self._exclusive(state, "add"):
            with self.state.lock:
                name, target = membership.admit(self.state, engine, group)
            return await self._run(membership.join_steps(self.state, name, target, checks), state)

    # -- transitions -------------------------------------------------------------

    async def offload(
        self, tags: Sequence[str] | None = None, mode: Literal["abort", "retract"] = "abort", *, min_engines: int | None = None
    ) -> TransitionReport:
        """Pause all offloaded engines, then flush all, then release ``tags`` (None = all); see ``Orchestrator.offload``
        (``min_engines`` too)."""
        wanted = transitions.offload_args(tags, mode)
        need = membership.min_engines_arg(min_engines, "offload")
        state = self._loop_state()
        async with self._exclusive(state, "offload"):
            return await self._run(membership.partial(self.state, lambda: transitions.offload_steps(self.state, wanted, mode), need), state)

    async def onload(
        self, tags: Sequence[str] | None = None, *, verify: EngineCheck | Sequence[EngineCheck] = (), min_engines: int | None = None
    ) -> TransitionReport:
        """Resume ``tags`` (None = everything released), then continue engines whose memory is back; see ``Orchestrator.onload``
        (``verify`` and ``min_engines`` too)."""
        wanted = transitions.tags_arg(tags, "onload")
        need = membership.min_engines_arg(min_engines, "onload")
        state = self._loop_state()
        async with self._exclusive(state, "onload"):
            report = await self._run(membership.partial(self.state, lambda: transitions.onload_steps(self.state, wanted), need), state)
            if not verify:  # no checks: no step to drive (nor a collector pause to take)
                return report
            return await self._run(verify_steps(self.state, "onload", report, verify, self.state.offloaded), state)

    async def pause(self, reason: str, mode: PauseMode = "retract") -> TransitionReport:
        """Take a hold named ``reason`` on every engine and pause them; see ``Orchestrator.pause``."""
        state = self._loop_state()
        async with state.lock:
            return await self._run(transitions.pause_steps(self.state, reason, mode), state)

    async def unpause(self, hold: HoldToken | str) -> TransitionReport:
        """Release one hold and continue the engines nothing else holds; see ``Orchestrator.unpause``."""
        state = self._loop_state()
        async with state.lock:
            return await self._run(transitions.unpause_steps(self.state, hold), state)

    @asynccontextmanager
    async def weight_sync(self, mode: PauseMode = "retract", *, verify: EngineCheck | Sequence[EngineCheck] = ()) -> AsyncIterator[list[A]]:
        """Hold every engine paused while the body updates weights; the hold is released on exit (see ``Orchestrator.weight_sync``,
        ``verify`` too)."""
        state = self._loop_state()
        async with state.lock:
            report = await self._run(transitions.pause_steps(self.state, transitions.WEIGHT_SYNC_HOLD, mode), state)
            self._bodies += 1
            state.idle.clear()
        token = report.hold
        assert token is not None
        inside = _IN_BODY.set(_IN_BODY.get() | {id(self)})
        try:
            yield [self.state.engines[n] for n in token.engines]
        finally:
            with contextlib.suppress(ValueError):  # exited in another context than entered: nothing to undo there
                _IN_BODY.reset(inside)
            self._bodies -= 1
            if not self._bodies:
                state.idle.set()
            try:
                ended = await self.unpause(token)
            except asyncio.CancelledError:  # cancelled again on the way out: the hold ends anyway, nothing more is sent
                with self.state.lock:
                    for n in token.engines:
                        transitions.unhold(self.state, n, token.id)
                raise
        if verify:  # only after a body that returned; no checks: no step to drive (nor a collector pause to take)
            await self._run(verify_steps(self.state, "weight_sync", ended, verify, token.engines), state)

    # -- the driver ------------------------------------------------------------------

    def _loop_state(self) -> _LoopState:
        loop = asyncio.get_running_loop()
        state = self._on
        if state is None or state.loop is not loop:
            if state is not None and not state.loop.is_closed() and (state.lock.locked() or self._bodies):
                raise RuntimeError("AsyncOrchestrator is in use on another event loop: drive it from one loop")
            gate = None if self.max_concurrency is None else asyncio.Semaphore(self.max_concurrency)
            state = _LoopState(loop, asyncio.Lock(), asyncio.Event(), gate)
            if not self._bodies:
                state.idle.set()
            self._on = state
        return state

    @asynccontextmanager
    async def _exclusive(self, state: _LoopState, transition: str) -> AsyncIterator[None]:
        """Hold the transition lock with no ``weight_sync`` body running (waiting up to ``transition_s`` for them)."""
        if id(self) in _IN_BODY.get():
            raise BarrierBusy(f"{transition}() was awaited inside a weight_sync() body: it would wait for itself")
        limit = self.deadlines.transition_s
        ends = state.loop.time() + limit
        while True:
            await state.lock.acquire()
            if not self._bodies:
                break
            state.lock.release()
            try:
                await asyncio.wait_for(state.idle.wait(), max(0.0, ends - state.loop.time()))
            except TimeoutError:
                raise BarrierBusy(
                    f"{transition}() waited {limit} s for {self._bodies} weight_sync() body(ies) to end; none was sent anything"
                ) from None
        try:
            yield
        finally:
            state.lock.release()

    async def _run(self, steps: transitions.Steps[T], state: _LoopState) -> T:
        """Drive a transition's steps on this loop; the knowledge lock is held only while the steps decide or fold.

        Whatever stops it (cancellation, an observer raising while a step is folded), the last step is handed to
        ``transitions.abandon``. The garbage collector stays paused from here until it returns (at most ``gc_pause_s``).
        """
        step: transitions.Step | None = None
        collector = pause_collector(self.gc_pause_s)
        try:
            with self.state.lock:
                step = next(steps)
            while True:
                await self._serve(step, state)
                with self.state.lock:
                    step = steps.send(None)
        except StopIteration as stop:
            result: T = stop.value
            return result
        except BaseException as exc:
            if step is not None:
                with self.state.lock:
                    transitions.abandon(self.state, steps, step, exc)
            raise
        finally:
            collector.end()

    async def _serve(self, step: transitions.Step, state: _LoopState) -> None:
        if isinstance(step, transitions.PhaseStep):
            run = PhaseRun(step.engines, step.method, step.deadline, gate=state.gate, gc_pause_s=self.gc_pause_s)
            try:
                await run.wait()
            finally:  # cancelled too: what was sent is read back (late calls keep running) for _abandon to fold
                step.results = run.results()
        elif isinstance(step, transitions.SettleStep):
            timeout = max(0.0, step.deadline.remaining())
            await asyncio.gather(*(self._settle_one(step, name, call, timeout) for name, call in step.late.items()))
        elif isinstance(step, transitions.WaitStep):
            await getattr(self.clock, "asleep", asyncio.sleep)(max(0.0, step.deadline.remaining()))  # Clock's contract
        elif isinstance(step, transitions.ReadStep):
            run = PhaseRun(step.engines, step.method, step.deadline, gate=state.gate, gc_pause_s=self.gc_pause_s)
            try:
                await run.wait()
            except Exception as exc:  # the answers are unknown (ReadStep); a cancellation goes on up
                step.error = exc
            else:
                step.results = run.results()

    @staticmethod
    async def _settle_one(step: transitions.SettleStep, name: str, call: LateCall, timeout: float) -> None:
        if isinstance(call, TaskCall):
            landed, error = await call.wait_async(timeout)
        else:  # a late call from elsewhere (not this loop's task): wait for it off the loop
            landed, error = await asyncio.to_thread(call.wait, timeout)
        if landed:
            step.landed[name] = error
