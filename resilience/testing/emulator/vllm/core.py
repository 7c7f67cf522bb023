"""The emulated vLLM EngineCore: scheduler pause state, sleep tags, weight session, requests.

Everything runs on the server's event loop (one thread), so no lock is needed: a route calls a method, and the
scheduler task calls :meth:`EngineCore.step` every tick. Paths and lines below are vLLM 0.33.0's (``vllm/...``).

- Pause is one state (``v1/core/sched/scheduler.py`` l.3073 ``set_pause_state``): ``UNPAUSED``, ``PAUSED_NEW`` (no new
  request is scheduled; running ones keep decoding) or ``PAUSED_ALL`` (nothing steps). ``pause_scheduler``
  (``v1/engine/core.py`` l.2181) aborts everything in ``abort`` mode, sets ``PAUSED_NEW`` for abort/wait and
  ``PAUSED_ALL`` for keep, and completes once the running requests are done (``_pause_complete`` l.2239,
  ``get_num_unfinished_requests`` l.3147: queued requests do not count under ``PAUSED_NEW``); then ``_finish_pause``
  (l.948) clears the caches if asked, which preempts running requests (``_reset_caches`` l.932,
  ``reset_running_requests=True``). A user pause (``pause_generation`` l.2225) also rejects new requests in abort and
  wait mode (``reject_new_requests``); a sleep does not (it calls ``pause_scheduler`` only). ``resume_scheduler``
  (l.2235, l.985) sets ``UNPAUSED`` and stops rejecting, whoever paused.
- Sleep (``EngineCore.sleep`` l.993) pauses with ``clear_cache = level >= 1`` and then ``Executor.sleep``
  (``v1/executor/abstract.py`` l.400): a no-op when ``weights`` is asleep already, else both tags go to
  ``sleeping_tags``. Level 0 only pauses.
- Wake (``EngineCore.wake_up`` l.1031): ``scheduling`` is dropped from the tags; ``Executor.wake_up`` (abstract.py
  l.413) does nothing when nothing sleeps, and nothing at all when one of the tags is not asleep (l.416-422); the
  scheduler resumes whenever nothing sleeps any more, also when nothing slept (l.1053-1055).
- ``is_sleeping`` (l.1078) = scheduler paused or any tag asleep.
- With ``--enable-sleep-mode`` the slept memory is really gone (cumem unmaps it): a step that runs a request while any
  tag sleeps, or a weight load into slept weights, is an illegal memory access (``crash.py``). Level 2 discards the
  weights (``gpu_worker.py`` l.301-320 saves only buffers), so woken weights are garbage until an update or
  ``reload_weights``.
- The weight session is per worker (``v1/worker/gpu_worker.py`` l.1542-1650): a failed call raises
  :class:`UtilityError` and the engine lives (a utility failure, ``v1/engine/core.py`` l.1850: HTTP 500).
- ``/update_weights`` over NCCL is a collective with the trainer (``vllm-control-plane.md`` 4.5, code reading;
  prime-rl#3599): a re-sent chunk (the same ``update_info`` again in one session) waits for a broadcast that never
  comes. The engine is then *wedged*: that call never answers, the EngineCore's loop is stuck in it, so no request is
  stepped and every call that needs the core (all dev and RL routes but ``/abort_requests``, ``/get_world_size``,
  ``/server_info``) hangs; ``/health`` still answers 200 (``AsyncLLM.check_health`` only looks for a dead core).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from enum import Enum
from typing import Literal, get_args

from ..crash import die_of_engine_error, die_of_illegal_memory_access
from ..memory_state import MemoryStateWriter
from .config import VLLMEngineConfig
from .fault_tolerance import FaultTolerance
from .text import ZERO_CONTENT, garbage_content, token, weight_checksums, weights_content

__all__ = ["SLEEP_TAGS", "EngineCore", "EnginePausedError", "PauseMode", "PauseState", "Request", "UtilityError"]

log = logging.getLogger("vllm.emulator")

PauseMode = Literal["abort", "wait", "keep"]
"""``vllm/v1/engine/__init__.py`` ``PauseMode``."""
SLEEP_TAGS = frozenset(("weights", "kv_cache"))
"""``v1/executor/abstract.py`` l.36."""
FinishReason = Literal["length", "abort"]


class PauseState(Enum):
    """``v1/core/sched/scheduler.py`` ``PauseState``."""

    UNPAUSED = "unpaused"
    PAUSED_NEW = "paused_new"
    PAUSED_ALL = "paused_all"


class UtilityError(Exception):
    """A control call the engine refused: HTTP 500 ``Call to <method> method failed: <message>``; the engine lives."""

    def __init__(self, method: str, message: str) -> None:
        super().__init__(f"Call to {method} method failed: {message}")


class EnginePausedError(Exception):
    """A new request while a user pause (abort or wait mode) rejects them: HTTP 503 (``core.py`` l.1796)."""

    def __init__(self) -> None:
        super().__init__("Generation is paused. Please retry after it resumes.")


@dataclass(eq=False)
class Request:
    """One completion request inside the engine."""

    request_id: str
    prompt: str
    max_tokens: int
    done: asyncio.Future[FinishReason]
    tokens: list[str] = field(default_factory=list)
    progress: float = 0.0

    def finish(self, reason: FinishReason) -> None:
        if not self.done.done():
            self.done.set_result(reason)


@dataclass(eq=False)
class _PauseWaiter:
    future: asyncio.Future[None]
    clear_cache: bool


class EngineCore:
    """One engine's state; every method is called on the event loop."""

    def __init__(self, config: VLLMEngineConfig) -> None:
        self.config = config
        self.pause_state = PauseState.UNPAUSED
        self.reject_new_requests = False
        self.sleeping_tags: set[str] = set()
        self.weight_version = config.weight_version
        self.weights = weights_content(config.weight_version)
        """The content the weights hold (``text.py``): what completions are computed with."""
        self.weights_discarded = False
        """Level-2 sleep dropped the weights: the next wake of ``weights`` maps garbage."""
        self.garbage_wakes = 0
        self.transfer_initialized = False
        self.weight_update_active = False
        self.update_chunks = 0
        self._last_update: object | None = None
        self.wedged = False
        """A re-sent ``/update_weights`` waits for a broadcast that never comes: the core is stuck for good."""
        self.fault_tolerance = FaultTolerance(config.engine_recovery_timeout_s) if config.enable_fault_tolerance else None
        """``--enable-fault-tolerance``: the sentinel that keeps a faulted busy loop waiting for ``retry`` (None = off)."""
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.counts = {"completed": 0, "aborted": 0, "rejected": 0, "preempted": 0}
        self.memory_state: MemoryStateWriter | None = None
        """Publishes the sleeping tags (``--memory-state-dir``); set before the scheduler starts."""
        self._pause_waiters: list[_PauseWaiter] = []

    # ----- requests -------------------------------------------------------------------
    def add_request(self, prompt: str, max_tokens: int, request_id: str) -> Request:
        """Queue one request; EnginePausedError while a user pause rejects new work (``core.py`` l.1759, l.1796)."""
        if self.reject_new_requests:
            self.counts["rejected"] += 1
            raise EnginePausedError()
        request = Request(request_id, prompt, max_tokens, asyncio.get_running_loop().create_future())
        self.waiting.append(request)
        self.requests[request_id] = request
        return request

    def abort(self, request_ids: Iterable[str] | None) -> list[str]:
        """Abort the given requests (all of them for None); returns the ids this engine tracked."""
        ids = list(self.requests) if request_ids is None else [r for r in request_ids if r in self.requests]
        for rid in ids:
            request = self.requests.pop(rid)
            if request in self.running:
                self.running.remove(request)
            elif request in self.waiting:
                self.waiting.remove(request)
            self.counts["aborted"] += 1
            request.finish("abort")
        return ids

    def _finished(self, request: Request) -> None:
        self.requests.pop(request.request_id, None)
        self.counts["completed"] += 1
        request.finish("length")

    # ----- pause ----------------------------------------------------------------------
    def _pause_scheduler(self, mode: str, clear_cache: bool) -> asyncio.Future[None]:
        """``EngineCoreProc.pause_scheduler`` (l.2181); the future completes once the pause does."""
        if mode not in get_args(PauseMode):
            raise ValueError(f"Invalid pause mode: {mode}")
        if mode == "abort":
            self.abort(None)
        self.pause_state = PauseState.PAUSED_ALL if mode == "keep" else PauseState.PAUSED_NEW
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if self._pause_complete():
            self._finish_pause(clear_cache)
            future.set_result(None)
        else:
            self._pause_waiters.append(_PauseWaiter(future, clear_cache))
        return future

    def _pause_complete(self) -> bool:
        # PAUSED_ALL steps nothing, so it is complete at once; PAUSED_NEW once the running requests are done (l.3147)
        return self.pause_state is PauseState.PAUSED_ALL or not self.running

    def _finish_pause(self, clear_cache: bool) -> None:
        """``_finish_pause`` (l.948): with ``clear_cache``, ``_reset_caches`` preempts running requests (l.932)."""
        if clear_cache:
            self.reset_prefix_cache(reset_running_requests=True)

    async def pause_generation(self, mode: str, clear_cache: bool) -> None:
        """``/pause``: ``pause_generation`` (l.2225) = pause_scheduler, then reject new requests unless ``keep``."""
        future = self._pause_scheduler(mode, clear_cache)
        self.reject_new_requests = mode != "keep"
        await future

    def resume_scheduler(self) -> None:
        """``EngineCoreProc.resume_scheduler`` (l.2235): stop rejecting, ``UNPAUSED``, whoever paused and whatever sleeps."""
        self.reject_new_requests = False
        self.pause_state = PauseState.UNPAUSED

    def is_paused(self) -> bool:
        """``/is_paused``: ``pause_state != UNPAUSED`` (``is_scheduler_paused`` l.989)."""
        return self.pause_state is not PauseState.UNPAUSED

    # ----- sleep ----------------------------------------------------------------------
    async def sleep(self, level: int, mode: str) -> None:
        """``EngineCore.sleep`` (l.993): pause (caches cleared for level >= 1), then the executor's sleep."""
        with self._memory_call():
            await self._pause_scheduler(mode, clear_cache=level >= 1)
            if level >= 1:
                self._executor_sleep(level)

    def _executor_sleep(self, level: int) -> None:
        """``Executor.sleep`` (abstract.py l.400): already sleeping -> warning, no-op."""
        if "weights" in self.sleeping_tags:
            log.warning("Executor is already sleeping.")
            return
        self.sleeping_tags |= SLEEP_TAGS
        if level == 2 and self.config.enable_sleep_mode:
            self.weights_discarded = True  # gpu_worker.py l.306-311: only named_buffers() are saved

    def wake_up(self, tags: list[str] | None) -> bool:
        """``EngineCore.wake_up`` (l.1031); returns whether nothing sleeps any more (and then resumes)."""
        with self._memory_call():
            if tags is not None and "scheduling" in tags:
                tags = [t for t in tags if t != "scheduling"]
            if tags is None or tags:
                self._executor_wake(tags)
            fully_awake = not self.sleeping_tags
            if fully_awake:
                self.resume_scheduler()
            return fully_awake

    def _executor_wake(self, tags: list[str] | None) -> None:
        """``Executor.wake_up`` (abstract.py l.412-435)."""
        if not self.sleeping_tags:
            log.warning("Executor is not sleeping.")
            return
        if tags:
            for tag in tags:
                if tag not in self.sleeping_tags:
                    log.warning("Tag %s is not in sleeping tags %s", tag, self.sleeping_tags)
                    return
        woken = set(tags) if tags else set(self.sleeping_tags)
        if "weights" in woken and self.weights_discarded:
            self.weights_discarded = False
            self.garbage_wakes += 1
            self.weights = garbage_content(self.garbage_wakes)
        self.sleeping_tags -= woken

    def is_sleeping(self) -> bool:
        """``/is_sleeping``: paused or any tag asleep (``EngineCore.is_sleeping`` l.1078)."""
        return self.is_paused() or bool(self.sleeping_tags)

    def release_kv_cache_memory(self) -> None:
        """``EngineCore.release_kv_cache_memory`` (l.1058)."""
        with self._memory_call():
            if not (self.is_paused() and not self.running and not self.waiting):
                raise UtilityError("release_kv_cache_memory", "release_kv_cache_memory() requires a completed pause first")
            if self.sleeping_tags:
                raise UtilityError("release_kv_cache_memory", "release_kv_cache_memory() requires all executor memory to be resident")
            self.reset_prefix_cache(reset_running_requests=True)
            self.sleeping_tags.add("kv_cache")  # Executor.discard (abstract.py l.437-446)

    def _memory_gone(self, tags: Iterable[str] = SLEEP_TAGS) -> str | None:
        """The first of ``tags`` whose memory is really released now (only with sleep mode), else None."""
        if not self.config.enable_sleep_mode:
            return None
        return next((t for t in sorted(tags) if t in self.sleeping_tags), None)

    @contextlib.contextmanager
    def _memory_call(self) -> Iterator[None]:
        """A sleep, wake or release in progress for the memory side channel, published again once it is over."""
        if self.memory_state is not None:
            self.memory_state.call_began()
        try:
            yield
        finally:
            if self.memory_state is not None:
                self.memory_state.call_ended(sorted(self.sleeping_tags))

    def _touch_weights(self, what: str) -> None:
        """``what`` reads or writes the weights: an illegal memory access (the engine dies) while they sleep."""
        if self._memory_gone(("weights",)):
            die_of_illegal_memory_access(what)

    # ----- caches ---------------------------------------------------------------------
    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """``Scheduler.reset_prefix_cache`` (scheduler.py l.3184): False while running requests hold blocks."""
        if reset_running_requests:
            while self.running:  # preempted in reverse order, so they go back in FIFO order (l.3200-3204)
                request = self.running.pop()
                self.waiting.appendleft(request)
                self.counts["preempted"] += 1
        return not self.running

    # ----- weights --------------------------------------------------------------------
    def _check_transfer(self, method: str) -> None:
        """``Worker._check_weight_transfer_engine`` (gpu_worker.py l.1512)."""
        if self.config.weight_transfer_backend is None:
            raise UtilityError(method, "Weight transfer not configured. Please set weight_transfer_config to enable weight transfer.")

    def init_weight_transfer_engine(self, init_info: dict[str, object]) -> None:
        """``Worker.init_weight_transfer_engine`` (l.1519); re-creating the group is allowed."""
        self._check_transfer("init_weight_transfer_engine")
        self.transfer_initialized = True

    def shutdown_weight_transfer_engine(self) -> None:
        """``Worker.shutdown_weight_transfer_engine`` (l.1533)."""
        if self.weight_update_active:
            raise UtilityError("shutdown_weight_transfer_engine", "Cannot release a trainer connection during a weight update")
        self.transfer_initialized = False

    def start_weight_update(self, draft: bool = False) -> None:
        """``Worker._start_weight_update`` (l.1559): a second start is refused."""
        method = "start_draft_weight_update" if draft else "start_weight_update"
        self._check_transfer(method)
        if draft:
            # base.py l.451 says True by default; the emulator has no draft model, so the call is refused as a backend without it
            raise UtilityError(method, f"{self._backend_class()} does not support draft model weight updates.")
        if self.weight_update_active:
            raise UtilityError(
                method, "start_weight_update called while a weight update is already active. Call finish_weight_update first."
            )
        self.weight_update_active = True
        self.update_chunks = 0
        self._last_update = None

    def update_weights(self, update_info: object) -> None:
        """``Worker.update_weights`` (l.1592): needs a session; loading into slept weights is an illegal access."""
        self._check_transfer("update_weights")
        if not self.weight_update_active:
            raise UtilityError("update_weights", "start_weight_update must be called before update_weights.")
        if not self.transfer_initialized:  # the backend has no group to receive on: the exception ends the session (l.1624)
            self.weight_update_active = False
            raise UtilityError("update_weights", f"{self._backend_class()} is not initialized; call init_weight_transfer_engine first.")
        self._touch_weights("a weight update loaded into slept weights")
        if self._last_update is not None and update_info == self._last_update:
            log.error("update_weights: the same chunk again; its NCCL broadcast from the trainer never comes (the core waits for good)")
            self.wedged = True
            return
        self._last_update = update_info
        self.update_chunks += 1

    def finish_weight_update(self, weight_version: str | None) -> None:
        """``Worker.finish_weight_update`` (l.1633) then ``AsyncLLM.update_weight_version`` (async_llm.py l.1432-1436)."""
        self._check_transfer("finish_weight_update")
        if not self.weight_update_active:
            raise UtilityError("finish_weight_update", "finish_weight_update called without a matching start_weight_update.")
        self.weight_update_active = False
        if weight_version is not None:
            self.weight_version = weight_version
        if self.update_chunks:
            self.weights = weights_content(self.weight_version)
            self.weights_discarded = False

    def update_weight_version(self, new_version: str) -> None:
        """``/update_weight_version``: the label only; the weights stay what they are."""
        self.weight_version = new_version

    def reload_weights(self) -> None:
        """``collective_rpc("reload_weights")``: the checkpoint again (its version label is kept)."""
        self._touch_weights("reload_weights loaded into slept weights")
        self.weights = weights_content(self.config.weight_version)
        self.weights_discarded = False

    def zero_weights(self) -> None:
        """``collective_rpc("reset_weights")`` = ``zero_weights(model)`` (``gpu_worker.py`` l.393-394): every weight is 0."""
        self._touch_weights("reset_weights wrote into slept weights")
        self.weights = ZERO_CONTENT
        self.weights_discarded = False

    def weight_checksums(self) -> dict[str, str]:
        """``compute_weight_checksums``: one checksum per parameter, from the weights' content; reading slept weights is fatal."""
        self._touch_weights("compute_weight_checksums read slept weights")
        return weight_checksums(self.weights)

    def _backend_class(self) -> str:
        backend = self.config.weight_transfer_backend or "nccl"
        return {"nccl": "NCCLWeightTransferEngine", "ipc": "IPCWeightTransferEngine"}.get(backend, f"{backend} engine")

    async def utility_gate(self) -> None:
        """Wait forever once the core is wedged (a call that needs the EngineCore never gets its turn), and while a fault
        waits for recovery (``fault_tolerance.py``); else return at once."""
        if self.fault_tolerance is not None:
            await self.fault_tolerance.wait_until_healthy()
        if self.wedged:
            await asyncio.Event().wait()  # never set: the request is cancelled when the client or the server goes

    # ----- faults ---------------------------------------------------------------------
    def fault(self, error_type: str = "RuntimeError") -> None:
        """The busy loop raises ``error_type`` now: without fault tolerance the engine dies; with it every request is
        aborted (``EngineCoreSentinel.on_fault``, ``engine_core_sentinel.py`` l.82-104) and the core waits for ``retry``."""
        if self.fault_tolerance is None:
            die_of_engine_error(error_type)
        self.abort(None)
        self.fault_tolerance.on_fault(error_type)

    # ----- the scheduler step ---------------------------------------------------------
    def step(self, seconds: float) -> None:
        """One scheduler step of ``seconds``: admit (only ``UNPAUSED``), decode, finish, complete pauses."""
        if self.wedged:
            return  # the busy loop is stuck in the collective
        ft = self.fault_tolerance
        if ft is not None and ft.unhealthy:
            if ft.timed_out():  # fault_tolerant_wrapper: "[FT] No recovery within %ds timeout.", then the error is raised
                die_of_engine_error(ft.fault_info or "RuntimeError", f"no recovery within {ft.recovery_timeout_s:g} s")
            return  # the busy loop waits for an instruction
        if self.pause_state is PauseState.PAUSED_ALL:
            return  # scheduler.py l.723: no token budget
        if self.pause_state is PauseState.UNPAUSED:
            while self.waiting and len(self.running) < self.config.max_num_seqs:
                self.running.append(self.waiting.popleft())
        if self.running:
            gone = self._memory_gone()
            if gone is not None:
                die_of_illegal_memory_access(f"a forward was scheduled onto slept {gone}")
        for request in list(self.running):
            request.progress += seconds * self.config.token_rate
            while len(request.tokens) < min(request.max_tokens, int(request.progress)):
                request.tokens.append(token(self.weights, request.prompt, len(request.tokens)))
            if len(request.tokens) >= request.max_tokens:
                self.running.remove(request)
                self._finished(request)
        if self._pause_waiters and self._pause_complete():
            waiters, self._pause_waiters = self._pause_waiters, []
            for waiter in waiters:
                self._finish_pause(waiter.clear_cache)
                if not waiter.future.done():
                    waiter.future.set_result(None)

    def state(self) -> dict[str, object]:
        """What ``/_emulator/state`` answers about the core."""
        return {
            "pause_state": self.pause_state.value,
            "reject_new_requests": self.reject_new_requests,
            "sleeping_tags": sorted(self.sleeping_tags),
            "weight_version": self.weight_version,
            "weights": self.weights,
            "weights_discarded": self.weights_discarded,
            "transfer_initialized": self.transfer_initialized,
            "weight_update_active": self.weight_update_active,
            "update_chunks": self.update_chunks,
            "wedged": self.wedged,
            "fault_tolerance": None if self.fault_tolerance is None else self.fault_tolerance.status,
            "running": len(self.running),
            "waiting": len(self.waiting),
            "counts": dict(self.counts),
        }
