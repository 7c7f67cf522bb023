"""The HTTP process's side of the engine, as SGLang's TokenizerManager: pause gate, request states, control calls.

Runs on the uvicorn event loop. Follows ``managers/tokenizer_manager.py`` and ``managers/tokenizer_control_mixin.py``:

- Requests pass the pause gate (``is_pause`` under an ``asyncio.Condition``), then hold the reader side of
  ``model_update_lock`` until answered, so a ``/generate`` sent while paused is neither rejected nor run: it waits
  until ``continue_generation``. Pause is one flag: the first continue reopens the gate.
- A weight update on an engine that is not paused takes the writer side: it waits for every in-flight generation and
  blocks new ones until it is done. On a paused engine it runs at once (whoever paused holds the engine).
- ``abort_request`` with an empty rid and ``abort_all=False`` is ignored with a warning; a rid this side does not know
  is a no-op (single tokenizer process).
- ``server_status``: Starting (``startup_seconds``), then Up; a failed ``/health`` makes it UnHealthy and a passing
  one Up again. ``/ready`` is 200 only when Up and not paused.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from . import crash
from . import messages as msg
from .config import EngineConfig
from .rwlock import RWLock
from .scheduler import Scheduler

__all__ = ["Disconnected", "Frontend", "NewRequest"]

IsDisconnected = Callable[[], Awaitable[bool]]
_DISCONNECT_CHECK_SECONDS = 4.0  # SGLang's _wait_one_response checks the client every 4 s
_MAX_ABORT_ROUNDS = 100_000
STARTING, UP, UNHEALTHY = "Starting", "Up", "UnHealthy"
"""SGLang's ``ServerStatus`` values this emulator uses."""


@dataclass(frozen=True, slots=True)
class NewRequest:
    """A validated single generation request."""

    rid: str
    input_ids: list[int]
    max_new_tokens: int
    stream: bool


@dataclass(eq=False)
class _ReqState:
    request: NewRequest
    created: float
    outputs: asyncio.Queue[dict[str, Any]] = field(default_factory=asyncio.Queue)
    output_ids: list[int] = field(default_factory=list)
    finished: bool = False


class Disconnected(ValueError):
    """The client went away before its request finished (a ValueError, as SGLang raises)."""


class Frontend:
    """Pause gate, request bookkeeping and control calls of one emulated engine."""

    def __init__(self, config: EngineConfig, scheduler: Scheduler) -> None:
        self._config = config
        self._scheduler = scheduler
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pause_cond: asyncio.Condition | None = None
        self.weight_version = config.weight_version
        self.is_pause = False
        self.pause_mode: str | None = None
        self.weight_update_session_open = False
        self.weight_update_groups: set[str] = set()
        self.rid_states: dict[str, _ReqState] = {}
        self.gate_waiters = 0
        self.last_receive_ns = 0
        self._weight_loads = 0
        self.model_update_lock = RWLock()
        self.server_status = STARTING

    # ----- wiring -----------------------------------------------------------------
    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Bind to the running event loop (call from it, at startup)."""
        self._loop = loop
        self._pause_cond = asyncio.Condition()
        if self._config.startup_seconds > 0:
            loop.call_later(self._config.startup_seconds, self._warmed_up)
        else:
            self._warmed_up()

    def _warmed_up(self) -> None:
        if self.server_status == STARTING:
            self.server_status = UP

    @property
    def _cond(self) -> asyncio.Condition:
        if self._pause_cond is None:
            raise RuntimeError("Frontend.attach() was not called")
        return self._pause_cond

    def on_scheduler_output(self, out: msg.SchedulerOutput) -> None:
        """Scheduler-thread callback: hand the output to the event loop."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return  # shutting down: nobody is waiting for it
        loop.call_soon_threadsafe(self._deliver, out)

    def _deliver(self, out: msg.SchedulerOutput) -> None:
        self.last_receive_ns = time.monotonic_ns()
        state = self.rid_states.get(out.rid)
        if state is None:
            return
        state.output_ids.extend(out.new_ids)
        if out.finish_reason is not None:
            state.finished = True
        if out.finish_reason is not None or state.request.stream:
            state.outputs.put_nowait(self._response(state, out))

    def _response(self, state: _ReqState, out: msg.SchedulerOutput) -> dict[str, Any]:
        text = "".join(chr(ord("a") + t % 26) for t in state.output_ids)  # a stand-in detokenizer: one letter per token
        return {"text": text, "output_ids": list(state.output_ids), "meta_info": self._meta_info(state, out)}

    def _meta_info(self, state: _ReqState, out: msg.SchedulerOutput) -> dict[str, Any]:
        """SGLang's ``meta_info`` (``tokenizer_manager.py``, ``_handle_batch_output``; spans: ``utils/weight_versions.py``)."""
        meta: dict[str, Any] = {
            "id": state.request.rid,
            "finish_reason": out.finish_reason,
            "prompt_tokens": out.prompt_tokens,
            "weight_version": self.weight_version,
            "num_retractions": out.retractions,
            "reasoning_tokens": 0,
            "completion_tokens": out.completion_tokens,
            "cached_tokens": 0,
            "e2e_latency": round(time.monotonic() - state.created, 6),
        }
        if out.weight_versions is not None:  # final output: spans, and the version of the last one
            meta["weight_versions"] = [dict(span) for span in out.weight_versions]
            if out.weight_versions:
                meta["weight_version"] = out.weight_versions[-1]["version"]
        return meta

    async def _call(self, message: msg.ControlMessage) -> Any:
        self._scheduler.submit(message)
        return await asyncio.wrap_future(message.reply)

    # ----- generation ---------------------------------------------------------------
    async def generate(self, request: NewRequest, is_disconnected: IsDisconnected | None = None) -> AsyncGenerator[dict[str, Any], None]:
        """Yield the request's outputs (one, or one per token when streaming) once it passed the pause gate.

        ``is_disconnected`` is an async callable; a non-streaming request whose client
        left is aborted, as SGLang does.
        """
        self.gate_waiters += 1
        try:
            async with self._cond:
                await self._cond.wait_for(lambda: not self.is_pause)
        finally:
            self.gate_waiters -= 1
        if request.rid in self.rid_states:
            raise ValueError(f"Duplicate request ID: {request.rid}")
        state = _ReqState(request, time.monotonic())
        self.rid_states[request.rid] = state
        try:
            async with self.model_update_lock.reader_lock():
                req = msg.Req(request.rid, list(request.input_ids), request.max_new_tokens, request.stream)
                self._scheduler.submit(msg.AddRequest(req))
                for _ in itertools.count():
                    out = await self._next_output(state, is_disconnected)
                    yield out
                    if out["meta_info"]["finish_reason"] is not None:
                        return
        finally:
            if not state.finished:
                self.abort_request(request.rid, abort_all=False)
            self.rid_states.pop(request.rid, None)

    async def _next_output(self, state: _ReqState, is_disconnected: IsDisconnected | None) -> dict[str, Any]:
        for _ in itertools.count():
            try:
                return await asyncio.wait_for(state.outputs.get(), timeout=_DISCONNECT_CHECK_SECONDS)
            except TimeoutError:
                if is_disconnected is not None and await is_disconnected():
                    crash.log_line(f"Request is disconnected from the client side (type 1). Abort request rid={state.request.rid}")
                    raise Disconnected(f"Request is disconnected from the client side. Abort request rid={state.request.rid}") from None
        raise AssertionError("unreachable")  # pragma: no cover

    def new_request(
        self, input_ids: list[int] | None, text: str | None, sampling: dict[str, Any], rid: str | None, stream: bool
    ) -> NewRequest:
        """Validate one request like SGLang's tokenizer manager (ValueError becomes a 400)."""
        # a stand-in tokenizer: a prompt's UTF-8 bytes (an empty one is one BOS token, id 0)
        ids = list(input_ids) if input_ids is not None else (list((text or "").encode("utf-8")) or [0])
        if not ids:  # only an explicit empty input_ids
            raise ValueError("The input_ids is empty.")
        max_new = sampling.get("max_new_tokens", self._config.default_max_new_tokens)
        if max_new is None:
            max_new = self._config.default_max_new_tokens
        if isinstance(max_new, bool) or not isinstance(max_new, int) or max_new < 0:
            raise ValueError(f"max_new_tokens must be at least 0, got {max_new}.")
        ctx = self._config.context_length
        if len(ids) >= ctx:
            raise ValueError(f"The input ({len(ids)} tokens) is longer than the model's context length ({ctx} tokens).")
        if len(ids) + max_new > ctx:
            raise ValueError(
                f"Requested token count exceeds the model's maximum context length of {ctx} tokens. "
                f"You requested a total of {len(ids) + max_new} tokens: {len(ids)} tokens from the input "
                f"messages and {max_new} tokens for the completion. Please reduce the number of tokens in "
                "the input messages or the completion to fit within the limit."
            )
        return NewRequest(rid or uuid.uuid4().hex, ids, max_new, stream)

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        """Abort one request this side knows (the scheduler matches its rid as a prefix), or all of them.

        An empty rid without ``abort_all`` is ignored with SGLang's warning (it would match
        every request); an unknown rid is a no-op (``tokenizer_manager.py``, ``abort_request``).
        """
        if not abort_all and not rid:
            crash.log_line("Ignore abort_request with empty rid and abort_all=False")
            return
        if not abort_all and rid not in self.rid_states:
            return
        self._scheduler.submit(msg.AbortRequests(rid, abort_all))

    # ----- pause ------------------------------------------------------------------
    async def pause_generation(self, mode: Literal["abort", "retract", "in_place"]) -> None:
        """Close the gate; ``abort`` aborts in-flight requests and returns once all were answered."""
        async with self._cond:
            self.is_pause = True
            self.pause_mode = mode
            if mode != "abort":
                self._scheduler.submit(msg.PauseScheduler(mode))
                return
            for _ in range(_MAX_ABORT_ROUNDS):  # SGLang: until model_update_lock is free (no generation holds it)
                self.abort_request(abort_all=True)
                if not self.model_update_lock.is_locked():
                    return
                await asyncio.sleep(self._config.abort_poll_seconds)

    async def continue_generation(self) -> None:
        """Open the gate (one flag, not a count) and clear the scheduler's pause."""
        async with self._cond:
            self.is_pause = False
            self.pause_mode = None
            self._scheduler.submit(msg.ContinueScheduler())  # fire and forget, as SGLang
            self._cond.notify_all()

    # ----- cache and memory ---------------------------------------------------------
    async def flush_cache(self, timeout_s: float) -> msg.FlushResult:
        """Flush through the scheduler (succeeds only when idle)."""
        result: msg.FlushResult = await self._call(msg.FlushCache(timeout_s))
        return result

    async def release_memory_occupation(self, tags: tuple[str, ...]) -> None:
        """Release the tags' memory; the scheduler dies if it is not idle or a tag is released already."""
        await self._call(msg.ReleaseMemory(tags))

    async def resume_memory_occupation(self, tags: tuple[str, ...]) -> None:
        """Resume the tags' memory; the scheduler dies on a tag that is not released."""
        await self._call(msg.ResumeMemory(tags))

    # ----- weights ----------------------------------------------------------------
    async def exclusive(self, message: msg.ControlMessage) -> Any:
        """Send ``message`` holding the engine: at once when paused, else under the writer lock.

        SGLang's weight-update calls (``tokenizer_control_mixin.py``): a paused engine is held by
        whoever paused it; otherwise the update waits for every in-flight generation and blocks new ones.
        """
        async with self._cond:
            if self.is_pause:
                return await self._call(message)
        async with self.model_update_lock.writer_lock():
            return await self._call(message)

    async def load_weights(self, *, flush_cache: bool, weight_version: str | None, success_message: str) -> tuple[bool, str]:
        """Write new weights in the scheduler, holding the engine; answers SGLang's ``(success, message)``.

        A flush refused after the weights were written answers ``(False, "Weights were updated, but
        the cache was not flushed ...")`` and leaves the version this side reports unchanged.
        """
        self._weight_loads += 1
        success, message = await self.exclusive(msg.LoadWeights(self._weight_loads, flush_cache, weight_version))
        if success:
            message = success_message
            if weight_version is not None:
                self.weight_version = weight_version
                message += f" Weight version updated to {weight_version}."
        return success, message

    async def weight_update_session(self, begin: bool) -> tuple[bool, str]:
        """Open (``begin``) or close the weight-update session, holding the engine as an update does.

        Messages are SGLang's (``scheduler_components/weight_updater.py``).
        """

        def toggle() -> tuple[bool, str]:
            if begin and self.weight_update_session_open:
                return False, "a weight-update session is already open; call end_weight_update() first"
            if not begin and not self.weight_update_session_open:
                return False, "no weight-update session is open; call begin_weight_update() first"
            self.weight_update_session_open = begin
            return True, "Success"

        async with self._cond:
            if self.is_pause:
                return toggle()
        async with self.model_update_lock.writer_lock():
            return toggle()

    async def set_weight_version(self, version: str) -> None:
        """``/update_weight_version``: the scheduler records it for live requests, then this side reports it."""
        await self._call(msg.SetWeightVersion(version))
        self.weight_version = version

    async def loads(self) -> dict[str, Any]:
        """The scheduler's load numbers, asked through the scheduler (``/server_info``'s internal state)."""
        loads: dict[str, Any] = await self._call(msg.GetLoads())
        return loads

    def load_snapshot(self) -> dict[str, Any]:
        """The latest load numbers the scheduler published (``/v1/loads``: never waits on the scheduler)."""
        return self._scheduler.load_snapshot

    # ----- health ------------------------------------------------------------------
    async def health(self) -> bool:
        """SGLang's health check: send a 1-token request, healthy if any scheduler output arrives in time.

        A starting server answers unhealthy at once; the answer sets ``server_status`` (``http_server.py``).
        """
        if self.server_status == STARTING:
            return False
        tic = time.monotonic_ns()
        request = NewRequest(f"{msg.HEALTH_CHECK_RID_PREFIX}_{time.time()}", [0], 1, False)

        async def run() -> None:
            outputs = self.generate(request)
            try:
                await anext(outputs)
            finally:
                await outputs.aclose()

        task = asyncio.create_task(run())
        deadline = time.monotonic() + self._config.health_hang_seconds
        try:
            for _ in itertools.count():
                if time.monotonic() >= deadline:
                    break
                await asyncio.sleep(self._config.health_poll_seconds)
                if self.last_receive_ns > tic:
                    self.server_status = UP
                    return True
        finally:
            task.cancel()
        self.server_status = UNHEALTHY
        crash.log_line(
            f"Health check failed. Server couldn't get a response from detokenizer for last {self._config.health_hang_seconds} seconds."
        )
        return False

    def is_ready(self) -> bool:
        """``/ready``: not paused and Up (``tokenizer_manager.py``, ``is_ready``)."""
        return not self.is_pause and self.server_status == UP

    def state(self) -> dict[str, Any]:
        """The tokenizer-side state for the debug routes."""
        return {
            "server_status": self.server_status,
            "paused": self.is_pause,
            "pause_mode": self.pause_mode,
            "weight_version": self.weight_version,
            "weight_update_session_open": self.weight_update_session_open,
            "in_flight": len(self.rid_states),
            "model_update_lock": {
                "readers": self.model_update_lock.readers,
                "writer_active": self.model_update_lock.writer_active,
                "waiting_writers": self.model_update_lock.waiting_writers,
            },
            "waiting_at_pause_gate": self.gate_waiters,
        }
