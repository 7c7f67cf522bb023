"""``Orchestrator``: the barrier driven from the caller's thread, each phase through a ``FanOut``.

It holds its state (``.state``, a ``BarrierState``: the engines and what it knows of them) and drives the
transitions, written once as steps in ``resilience.barrier.transitions`` (shared with ``AsyncOrchestrator``). What a
transition promises and what it does when a phase fails: docs/barrier.md and docs/failure-and-recovery.md.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Literal, TypeVar, Unpack

from resilience.barrier import membership, transitions
from resilience.barrier.async_fanout import AsyncFanOut
from resilience.barrier.fanout import FanOut, ThreadFanOut
from resilience.barrier.state import BarrierBusy, BarrierKeywords, BarrierOptions, BarrierState, EngineGroup, HoldToken, TransitionReport
from resilience.barrier.verify import EngineCheck, checks_arg, verify_steps
from resilience.barrier.view import BarrierView
from resilience.engine_contract import AnyEngine, PauseMode

__all__ = ["Orchestrator"]

E = TypeVar("E", bound=AnyEngine)
T = TypeVar("T")


class Orchestrator(BarrierView[E]):
    """Drives phases across engine groups with owned pauses, explicit knowledge and rollback.

    ``groups``: one ``EngineGroup`` or several. Engines satisfy ``ControlPlaneEngine`` and have an ``engine`` name
    (``SGLangClient``, ``VLLMEngine``, Ray engine handles through ``resilience.adapters.ray``), or
    ``AsyncControlPlaneEngine`` with an ``AsyncFanOut``; they are assumed serving with nothing released when the
    orchestrator is built (else ``reconcile`` them). An engine the fan-out cannot drive is refused here with a
    ``TypeError`` naming it. ``fanout``: how a phase reaches the engines (default ``ThreadFanOut()``, or
    ``AsyncFanOut()`` when the engines' calls are coroutines). ``deadlines``: the transition and phase limits.
    ``restart_budget``: when given, errors say what a restart would leave. ``rollback``: after a failed transition,
    resume what it released and continue engines where that is known safe (default True). ``clock``: times transitions
    and phases and sets their deadlines (default the system clock; waits on threads and late calls use real time).
    ``memory_probe``: a ``MemoryProbe`` that proves which tags are released on an engine; an engine whose tags became
    unknown is reconciled from it right after the phase and again at the start of the next transition (default None:
    it stays quarantined and named in ``PhaseFailed`` until ``reconcile``). ``journal``: a path (or a ``Journal``, or a
    ``JournalStore`` such as ``RayKVJournalStore``) where the knowledge is written before each command is sent and after
    each answer, so that a new orchestrator on the same journal resumes it after a crash (default None: in memory
    only); ``recovery`` then says what was resumed; ``close()`` lets go of the journal.

    Thread-safe: transitions run one at a time; ``weight_sync`` bodies may run concurrently with each other (each holds
    its own token), and ``offload``/``onload`` wait for every running body to end (up to ``transition_s``) before they
    start, else raise ``BarrierBusy``.
    """

    def __init__(
        self,
        groups: EngineGroup[E] | Sequence[EngineGroup[E]],
        *,
        fanout: FanOut | None = None,
        **options: Unpack[BarrierKeywords],
    ) -> None:
        self.state: BarrierState[E] = BarrierState(groups, BarrierOptions.of("Orchestrator", options), owner="Orchestrator")
        engines = self.state.engines
        if fanout is None:  # AsyncFanOut when any engine's control calls are coroutines (AsyncSGLangClient)
            coroutines = any(inspect.iscoroutinefunction(getattr(e, "pause_generation", None)) for e in engines.values())
            fanout = AsyncFanOut() if coroutines else ThreadFanOut()
        self.fanout: FanOut = fanout
        self._check(engines.values())
        transitions.resume(self.state)
        self._bodies_ended = threading.Condition(self.state.lock)
        self._bodies: dict[int, int] = {}
        """Thread id -> weight_sync bodies running on it."""

    # -- recovery ----------------------------------------------------------------

    def retire(self, engine: str | E) -> None:
        """Stop sending anything to ``engine`` (dead, or replaced): no transition covers or names it again."""
        membership.retire(self.state, engine)

    def reconcile(self, engine: str | E, *, released: Iterable[str] | None, paused: bool | None) -> None:
        """Tell the orchestrator ``engine``'s real state, after you checked its memory or restarted it.

        ``released``: the tags released on it now (``()`` for none; None keeps what is known and leaves unknown tags
        unknown). ``paused``: True, False, or None when you do not know (the next transition that needs it paused pauses
        it again, which is safe). This lifts the quarantine and a "dead" mark. An engine with released memory cannot be
        serving: ``paused=False`` is refused with released tags, and with ``released=None`` on an engine with tags known
        released or unknown (each a state SGLang crashes in). Refused too while a call sent to it earlier is still
        running (reconcile after it lands: it could change the state you report).
        """
        transitions.reconcile(self.state, engine, released=released, paused=paused)

    def add(self, engine: E, *, group: str | int | None = None, verify: EngineCheck | Sequence[EngineCheck] = ()) -> TransitionReport:
        """Bring ``engine`` (new, restarted at a known URL, fenced or retired) into ``group``'s current state; it counts
        only once there (docs/barrier.md, "Engines that join and leave").

        ``group``: a group's name or index (default None: the first group, or the group a known engine is in).
        ``verify``: checks asked as it joins a serving group (``WeightVersionCheck`` while paused, ``CanaryCheck`` once
        continued; a mismatch pauses it again; default none). A join that fails fences the engine and raises
        ``PhaseFailed`` naming it. Waits for running ``weight_sync`` bodies first; refused (``BarrierBusy``) while a
        ``pause`` hold is held. The fan-out must be able to drive it (``TypeError``).
        """
        checks = checks_arg(verify)
        self._check([engine])
        with self.state.lock:
            self._wait_for_bodies("add")
            name, target = membership.admit(self.state, engine, group)
            return self._run(membership.join_steps(self.state, name, target, checks))

    # -- transitions -------------------------------------------------------------

    def offload(
        self, tags: Sequence[str] | None = None, mode: Literal["abort", "retract"] = "abort", *, min_engines: int | None = None
    ) -> TransitionReport:
        """Pause all offloaded engines, then flush all, then release ``tags`` (None = all) on all.

        Returns only when every offloaded engine (not retired) is known paused with ``tags`` released. Idempotent: tags
        already released are not released again. Engines that are dead, quarantined or still busy with a late call are
        skipped and named in ``PhaseFailed`` after the others are done. ``mode="in_place"`` is refused: it keeps running
        requests' KV, so flush would fail. Waits for running ``weight_sync`` bodies first. ``min_engines``: partial
        progress, opt-in (default None: off). When the offload fails and at least this many of its engines are not among
        those it failed on, those are fenced (named in ``TransitionReport.fenced``) and the offload completes for the
        rest (``resilience.barrier.membership``).
        """
        wanted = transitions.offload_args(tags, mode)
        need = membership.min_engines_arg(min_engines, "offload")
        with self.state.lock:
            self._wait_for_bodies("offload")
            return self._run(membership.partial(self.state, lambda: transitions.offload_steps(self.state, wanted, mode), need))

    def onload(
        self, tags: Sequence[str] | None = None, *, verify: EngineCheck | Sequence[EngineCheck] = (), min_engines: int | None = None
    ) -> TransitionReport:
        """Resume ``tags`` (None = everything released) on all offloaded engines, then continue those whose memory is all back.

        Returns only when every offloaded engine (not retired) serves, or is held paused on purpose (tags still
        released, or another hold such as a weight sync) and named in ``TransitionReport.held``. Idempotent. Engines
        that are dead, quarantined or busy with a late call are skipped and named in ``PhaseFailed``. Waits for running
        ``weight_sync`` bodies first. ``verify``: checks asked of every offloaded engine afterwards
        (``resilience.barrier.verify``: ``WeightVersionCheck``, ``CanaryCheck``; default none); a mismatch raises
        ``VerificationFailed`` naming the engine. ``min_engines``: partial progress, as for ``offload`` (default None:
        off).
        """
        wanted = transitions.tags_arg(tags, "onload")
        need = membership.min_engines_arg(min_engines, "onload")
        with self.state.lock:
            self._wait_for_bodies("onload")
            report = self._run(membership.partial(self.state, lambda: transitions.onload_steps(self.state, wanted), need))
            return self._run(verify_steps(self.state, "onload", report, verify, self.state.offloaded)) if verify else report

    def pause(self, reason: str, mode: PauseMode = "retract") -> TransitionReport:
        """Take a hold named ``reason`` on every engine (all groups) and pause the ones not known paused.

        Returns the token in ``TransitionReport.hold``; pass it to ``unpause``. Holds are owned and counted: two pauses
        with the same reason are two holds. Refused (``PhaseFailed``, nothing sent) when an engine is dead, quarantined
        or busy with a late call; on a failed pause the hold is released and the engines it paused are continued where
        safe.
        """
        with self.state.lock:
            return self._run(transitions.pause_steps(self.state, reason, mode))

    def unpause(self, hold: HoldToken | str) -> TransitionReport:
        """Release one hold (a token from ``pause``, or the latest hold with that reason); continue the engines it held
        that no other hold keeps paused and whose memory is back."""
        with self.state.lock:
            return self._run(transitions.unpause_steps(self.state, hold))

    @contextmanager
    def weight_sync(self, mode: PauseMode = "retract", *, verify: EngineCheck | Sequence[EngineCheck] = ()) -> Iterator[list[E]]:
        """Hold every engine paused while the body updates weights; the hold (this sync's own token) is released on exit.

        Yields the engines (not retired), every one known paused. Re-entrant and thread-safe: nested or concurrent syncs
        each hold their own token, and admission reopens only when the last one ends (and memory is back: inside an
        offloaded window the engines stay paused until onload). ``offload``/``onload`` never run while a body runs: they
        wait for it. Refused (``PhaseFailed``, nothing sent, the body never runs) while an engine's weights are
        released: a weight update into them would kill it (``onload(tags=["weights"])`` first). ``verify``: checks asked
        of the synced engines once the body returned and the hold ended (``resilience.barrier.verify``; default none); a
        mismatch raises ``VerificationFailed`` naming the engine.
        """
        me = threading.get_ident()
        with self.state.lock:
            report = self._run(transitions.pause_steps(self.state, transitions.WEIGHT_SYNC_HOLD, mode))
            self._bodies[me] = self._bodies.get(me, 0) + 1
        token = report.hold
        assert token is not None
        try:
            yield [self.state.engines[n] for n in token.engines]
        finally:
            with self.state.lock:
                self._bodies[me] -= 1
                if not self._bodies[me]:
                    del self._bodies[me]
                self._bodies_ended.notify_all()
            ended = self.unpause(token)
        if verify:  # only after a body that returned; no checks: no step to drive
            self._run(verify_steps(self.state, "weight_sync", ended, verify, token.engines))

    # -- the driver ------------------------------------------------------------------

    def _run(self, steps: transitions.Steps[T]) -> T:
        """Drive a transition's steps on this thread (under the lock): phases through the fan-out, settles by waiting.

        Whatever stops it (the fan-out raising, an interruption, an observer
        raising while a step is folded), the last step is handed to ``transitions.abandon``.
        """
        step: transitions.Step | None = None
        try:
            step = next(steps)
            while True:
                self._serve(step)
                step = steps.send(None)
        except StopIteration as stop:
            result: T = stop.value
            return result
        except BaseException as exc:
            if step is not None:
                transitions.abandon(self.state, steps, step, exc)
            raise

    def _serve(self, step: transitions.Step) -> None:
        if isinstance(step, transitions.PhaseStep):
            step.results = self.fanout.call(step.engines, step.method, step.deadline)
        elif isinstance(step, transitions.SettleStep):
            for name, call in step.late.items():
                landed, error = call.wait(max(0.0, step.deadline.remaining()))
                if landed:
                    step.landed[name] = error
        elif isinstance(step, transitions.WaitStep):
            self.clock.sleep(max(0.0, step.deadline.remaining()))
        elif isinstance(step, transitions.ReadStep):
            try:
                step.results = self.fanout.call(step.engines, step.method, step.deadline)
            except Exception as exc:  # a fan-out that cannot send this read: the answers are unknown (ReadStep)
                step.error = exc

    def _check(self, engines: Iterable[object]) -> None:
        """The fan-out's ``check_engines``, when it has one: refuses an engine it cannot drive before anything is sent."""
        check: Callable[[Iterable[object]], None] | None = getattr(self.fanout, "check_engines", None)
        if check is not None:
            check(engines)

    def _wait_for_bodies(self, transition: str) -> None:
        """Exclusion: wait (up to ``transition_s``) until no ``weight_sync`` body runs; called under the lock."""
        if self._bodies.get(threading.get_ident()):
            raise BarrierBusy(f"{transition}() was called inside a weight_sync() body on the same thread: it would wait for itself")
        limit = self.deadlines.transition_s
        if not self._bodies_ended.wait_for(lambda: not self._bodies, timeout=limit):
            running = sum(self._bodies.values())
            raise BarrierBusy(f"{transition}() waited {limit} s for {running} weight_sync() body(ies) to end; none was sent anything")
