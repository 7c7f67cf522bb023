"""The scheduler thread: admission queue, running batch, decode at ``token_rate``, control messages.

It follows SGLang's scheduler where the control plane can see it:

- ``retract`` pause: running requests free their KV and go back to the front of the waiting queue; ``in_place``: a
  flag, KV kept, no decode (``managers/scheduler.py``, ``pause_generation``). While paused nothing is admitted.
- Idleness is ``is_fully_idle(ignore_waiting)`` (``managers/scheduler.py``): the flush itself and the release assert
  ignore the waiting queue while paused; the timed flush (``?timeout>0``) waits with ``is_fully_idle()`` that does
  *not* (``managers/scheduler_components/flush_wrapper.py``), so after a retract pause that re-queued requests it can
  only time out: 400 "Timed out waiting for idle state.".
- ``release_memory_occupation`` asserts idleness, records the tags (unknown ones too), flushes when releasing
  ``kv_cache`` and frees the tags' tensors (only with the memory saver on); ``resume_memory_occupation`` removes the
  tags from that record first, so a tag that is not released raises KeyError and kills the process
  (``managers/scheduler_components/weight_updater.py``).
- A weight update writes the weights, records the new version, then flushes; a flush refused there fails the call
  although the weights changed (``weight_updater.py``, ``flush_cache_after_weight_update``).
- A load snapshot is published every ``_SNAPSHOT_SECONDS`` for ``/v1/loads``, which reads it without waiting on this
  thread (``managers/load_snapshot.py``).
- Any exception in here kills the process (:func:`crash.die_from_scheduler_exception`): a release with work in flight,
  a resume of a tag that is not released, and a prefill or decode that writes into a released pool.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from typing import Any

from . import crash
from . import messages as msg
from .allocator import TokenAllocator
from .config import EngineConfig
from .memory_state import MemoryStateWriter
from .messages import HEALTH_CHECK_RID_PREFIX, ControlMessage, Message, Req, SchedulerOutput
from .pools import ALL_TAGS, KV_CACHE, MemoryPools, sample_next

__all__ = ["Scheduler"]

Emit = Callable[[SchedulerOutput], None]
_SNAPSHOT_SECONDS = 0.05
WEIGHTS_UPDATED_NOT_FLUSHED = (
    "Weights were updated, but the cache was not flushed because requests are still running or queued. "
    "Retract or finish them, then call /flush_cache."
)
"""SGLang's message when a weight update's flush is refused (the weights *were* written)."""


class Scheduler:
    """One engine's scheduler; :meth:`start` runs it in a daemon thread."""

    def __init__(self, config: EngineConfig, pools: MemoryPools, emit: Emit) -> None:
        self._config = config
        self._pools = pools
        self._emit = emit
        self._alloc = TokenAllocator(config)
        self._inbox: queue.Queue[Message] = queue.Queue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="emulated-scheduler", daemon=True)
        self._step_seconds = 1.0 / config.token_rate
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.engine_paused: str | None = None
        self.counts: Counter[str] = Counter()
        self._pending_flush: tuple[msg.FlushCache, float] | None = None
        self._tokens_generated = 0
        self._throughput_window: deque[tuple[float, int]] = deque(maxlen=64)
        self.offload_tags: set[str] = set()
        self.weight_version = config.weight_version
        self.load_snapshot: dict[str, Any] = self._loads()
        """The latest published load numbers (replaced whole, so readers on other threads see one snapshot)."""
        self._snapshot_at = 0.0
        self.memory_state: MemoryStateWriter | None = None
        """Where the released tags are published for ``EmulatorMemoryProbe`` (set before :meth:`start`); None = nowhere."""

    # ----- called from other threads -------------------------------------------------
    def start(self) -> None:
        """Start the scheduler thread (publishing the memory state first, when there is a writer)."""
        if self.memory_state is not None:
            self.memory_state.started(self.released_tags())
        self._thread.start()

    def stop(self, timeout: float = 2.0) -> None:
        """Ask the thread to end and wait for it (bounded)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def submit(self, message: Message) -> None:
        """Queue a message for the scheduler thread (thread-safe, never blocks)."""
        if self.memory_state is not None and isinstance(message, (msg.ReleaseMemory, msg.ResumeMemory)):
            self.memory_state.call_began()  # before it can run: a reader never sees the change unannounced
        self._inbox.put(message)

    def released_tags(self) -> list[str]:
        """The tags recorded as released (SGLang's ``offload_tags``): known ones in SGLang's order, then unknown ones sorted."""
        tags = set(self.offload_tags)
        return [t for t in ALL_TAGS if t in tags] + sorted(tags - set(ALL_TAGS))

    def snapshot(self) -> dict[str, Any]:
        """A racy but safe read of the scheduler's numbers (for the debug routes)."""
        return {
            "scheduler_paused": self.engine_paused,
            "running": len(self.running),
            "waiting": len(self.waiting),
            "released_tags": self.released_tags(),
            "allocated_bytes": self._pools.allocated_bytes(),
            "counts": {k: self.counts[k] for k in ("completed", "aborted", "retracted", "prefilled")},
        }

    # ----- the loop ---------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # any scheduler exception kills the engine, as in SGLang
            crash.die_from_scheduler_exception(exc)

    def _loop(self) -> None:
        next_step = time.monotonic()
        while not self._stop.is_set():
            self._drain_inbox(self._wait_seconds(next_step))
            self._check_pending_flush()
            self._publish_snapshot()
            if self.engine_paused is not None:
                continue
            self._admit()
            now = time.monotonic()
            if self.running and now >= next_step:
                self._decode_step()
                next_step = max(next_step + self._step_seconds, now)
            elif not self.running:
                next_step = now

    def _wait_seconds(self, next_step: float) -> float:
        if self.engine_paused is None and self.running:
            return max(0.0, next_step - time.monotonic())
        return self._config.tick_seconds

    def _drain_inbox(self, timeout: float) -> None:
        try:
            message = self._inbox.get(timeout=timeout) if timeout > 0 else self._inbox.get_nowait()
        except queue.Empty:
            return
        self._handle(message)
        for _ in range(self._inbox.qsize()):
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                return
            self._handle(message)

    def _handle(self, message: Message) -> None:
        if isinstance(message, msg.AddRequest):
            self.waiting.append(message.req)
        elif isinstance(message, msg.AbortRequests):
            self._abort(message)
        elif isinstance(message, msg.FlushCache):
            self._flush_request(message)
        elif isinstance(message, ControlMessage):
            message.reply.set_result(self._control(message))
        else:  # pragma: no cover - the Message union is closed
            raise TypeError(f"unknown scheduler message {message!r}")

    def _control(self, message: ControlMessage) -> Any:
        if isinstance(message, msg.PauseScheduler):
            self._pause(message.mode)
            return None
        if isinstance(message, msg.ContinueScheduler):
            self.engine_paused = None
            return None
        if isinstance(message, msg.ReleaseMemory):
            self._release(message.tags)
            self._memory_call_ended()
            return None
        if isinstance(message, msg.ResumeMemory):
            self._resume(message.tags)
            self._memory_call_ended()
            return None
        if isinstance(message, msg.LoadWeights):
            return self._load_weights(message)
        if isinstance(message, msg.SetWeightVersion):
            self._record_weight_version(message.version)
            return None
        if isinstance(message, msg.GetLoads):
            return self._loads()
        raise TypeError(f"unknown control message {message!r}")

    # ----- pause, abort, flush ----------------------------------------------------
    def _pause(self, mode: str) -> None:
        self.engine_paused = mode
        if mode == "retract":
            for req in reversed(self.running):
                self._retract(req)
            self.running = []

    def _abort(self, message: msg.AbortRequests) -> None:
        for queue_, why in ((self.waiting, "Abort in waiting queue"), (self.running, "Abort running request")):
            for req in [r for r in queue_ if message.abort_all or r.rid.startswith(message.rid)]:
                queue_.remove(req)
                self._free_req(req, keep_cache=False)
                self._finish(req, {"type": "abort", "message": why})

    def _is_fully_idle(self, ignore_waiting: bool = False) -> bool:
        return not self.running and (ignore_waiting or not self.waiting)

    def _flush_cache(self) -> bool:
        if not self._is_fully_idle(ignore_waiting=self.engine_paused is not None):
            crash.log_line(
                f"Cache not flushed because there are pending requests. #queue-req: {len(self.waiting)}, #running-req: {len(self.running)}"
            )
            return False
        self._alloc.reset()
        crash.log_line("Cache flushed successfully!")
        return True

    def _flush_request(self, message: msg.FlushCache) -> None:
        if self._pending_flush is not None:
            message.reply.set_result(msg.FlushResult(False, "Another flush_cache is already in progress."))
        elif message.timeout_s <= 0 or self._is_fully_idle():  # the timed wait does not ignore waiting requests
            message.reply.set_result(msg.FlushResult(self._flush_cache()))
        else:
            self._pending_flush = (message, time.monotonic() + message.timeout_s)

    def _check_pending_flush(self) -> None:
        if self._pending_flush is None:
            return
        message, deadline = self._pending_flush
        if self._is_fully_idle():
            self._pending_flush = None
            message.reply.set_result(msg.FlushResult(self._flush_cache()))
        elif time.monotonic() >= deadline:
            self._pending_flush = None
            crash.log_line("Deferred flush_cache timed out while waiting for idle state.")
            message.reply.set_result(msg.FlushResult(False, "Timed out waiting for idle state."))

    # ----- memory occupation ------------------------------------------------------
    def _release(self, tags: tuple[str, ...]) -> None:
        if not self._is_fully_idle(ignore_waiting=self.engine_paused is not None):
            raise AssertionError(
                "release_memory_occupation should be called only when server is idle. "
                f"#running-req: {len(self.running)}, #queue-req: {len(self.waiting)}"
            )
        self.offload_tags.update(tags)  # unknown tags too: they are recorded and otherwise ignored
        for tag in ALL_TAGS:
            if tag not in tags:
                continue
            if self._config.memory_saver:  # without it SGLang's adapter is a no-op: nothing is freed
                self._pools.release(tag)
            if tag == KV_CACHE:
                self._flush_cache()
        time.sleep(self._config.swap_seconds)

    def _resume(self, tags: tuple[str, ...]) -> None:
        for tag in tags:
            self.offload_tags.remove(tag)  # KeyError for a tag not released: the scheduler dies, as in SGLang
        for tag in ALL_TAGS:
            if tag in tags and self._config.memory_saver:
                self._pools.resume(tag)
        time.sleep(self._config.swap_seconds)

    def _memory_call_ended(self) -> None:
        """Publish the tags after a release or resume was carried out, before it is answered (a crash never gets here)."""
        if self.memory_state is not None:
            self.memory_state.call_ended(self.released_tags())

    # ----- weights ----------------------------------------------------------------
    def _load_weights(self, message: msg.LoadWeights) -> tuple[bool, str]:
        self._pools.write_weights(message.seed)
        self._record_weight_version(message.weight_version)
        if message.flush_cache and not self._flush_cache():
            crash.log_line(WEIGHTS_UPDATED_NOT_FLUSHED)
            return (False, WEIGHTS_UPDATED_NOT_FLUSHED)
        return (True, "Success")

    def _record_weight_version(self, version: str | None) -> None:
        """SGLang's ``record_weight_version_change``: live requests with output remember the old version."""
        if version is None or version == self.weight_version:
            return
        for req in (*self.running, *self.waiting):
            if req.output_ids:
                req.version_events.append((self.weight_version, len(req.output_ids)))
        self.weight_version = version

    # ----- prefill and decode -----------------------------------------------------
    def _admit(self) -> None:
        for _ in range(len(self.waiting)):
            if len(self.running) >= self._config.max_running_requests:
                return
            req = self.waiting[0]
            prompt = req.input_ids + req.output_ids
            if not self._alloc.can_fit(len(prompt)):
                return
            self.waiting.popleft()
            req.slot = self._alloc.alloc_slot()
            req.kv_indices = self._alloc.alloc_kv(len(prompt))
            self._pools.write_prefill(req.slot, req.kv_indices, prompt)
            self.counts["prefilled"] += 1
            if req.finished_length:
                self._free_req(req, keep_cache=True)
                self._finish(req, {"type": "length", "length": req.max_new_tokens})
            else:
                self.running.append(req)

    def _decode_step(self) -> None:
        for req in list(self.running):
            if req.slot is None:  # pragma: no cover - running requests always hold a slot
                raise RuntimeError(f"running request {req.rid} holds no req_to_token slot")
            if not self._alloc.can_fit(1):
                self.running.remove(req)
                self._retract(req)
                continue
            kv_index = self._alloc.alloc_kv(1)[0]
            req.kv_indices.append(kv_index)
            last = req.output_ids[-1] if req.output_ids else req.input_ids[-1]
            token = sample_next(last, req.seq_len)
            self._pools.write_decode(req.slot, req.seq_len, kv_index, token)
            req.output_ids.append(token)
            self._tokens_generated += 1
            if req.finished_length:
                self.running.remove(req)
                self._free_req(req, keep_cache=True)
                self._finish(req, {"type": "length", "length": req.max_new_tokens})
            elif req.stream:
                self._send(req, None)
        self._throughput_window.append((time.monotonic(), self._tokens_generated))

    def _retract(self, req: Req) -> None:
        """Back to the front of the waiting queue, its KV freed (the caller takes it out of the running batch)."""
        self._free_req(req, keep_cache=False)
        req.retractions += 1
        self.counts["retracted"] += 1
        self.waiting.appendleft(req)

    def _free_req(self, req: Req, *, keep_cache: bool) -> None:
        if req.slot is not None:
            self._alloc.free_slot(req.slot)
            req.slot = None
        if keep_cache:
            self._alloc.cache_kv(req.kv_indices)
        else:
            self._alloc.free_kv(req.kv_indices)
        req.kv_indices = []

    def _finish(self, req: Req, reason: dict[str, Any]) -> None:
        if not req.rid.startswith(HEALTH_CHECK_RID_PREFIX):
            self.counts["aborted" if reason["type"] == "abort" else "completed"] += 1
        self._send(req, reason)

    def _send(self, req: Req, finish_reason: dict[str, Any] | None) -> None:
        new_ids = tuple(req.output_ids[req.sent :])
        req.sent = len(req.output_ids)
        spans = None if finish_reason is None else self._version_spans(req)
        self._emit(SchedulerOutput(req.rid, new_ids, finish_reason, len(req.input_ids), len(req.output_ids), req.retractions, spans))

    def _version_spans(self, req: Req) -> tuple[dict[str, Any], ...]:
        """``compute_weight_version_spans`` + ``add_weight_versions_to_meta_info`` (``sglang/srt/utils/weight_versions.py``)."""
        n = len(req.output_ids)
        spans: list[dict[str, Any]] = []
        for version, end in [*req.version_events, (self.weight_version, n)]:
            end = min(end, n)
            if spans and end <= spans[-1]["end"]:
                continue
            if spans and version == spans[-1]["version"]:
                spans[-1]["end"] = end
                continue
            spans.append({"version": version, "start": spans[-1]["end"] if spans else 0, "end": end})
        return tuple(s for s in spans if s["start"] < n or s["start"] == 0)

    # ----- numbers ----------------------------------------------------------------
    def _publish_snapshot(self) -> None:
        now = time.monotonic()
        if now - self._snapshot_at >= _SNAPSHOT_SECONDS:
            self._snapshot_at = now
            self.load_snapshot = self._loads()

    def _throughput(self) -> float:
        if len(self._throughput_window) < 2:
            return 0.0
        (t0, n0), (t1, n1) = self._throughput_window[0], self._throughput_window[-1]
        if time.monotonic() - t1 > 1.0 or t1 <= t0:
            return 0.0
        return (n1 - n0) / (t1 - t0)

    def _loads(self) -> dict[str, Any]:
        used = self._alloc.used_tokens
        total = self._alloc.total_tokens
        pending = sum(r.seq_len for r in self.waiting)
        return {
            "timestamp": time.time(),
            "num_running_reqs": len(self.running),
            "num_waiting_reqs": len(self.waiting),
            "num_used_tokens": used,
            "num_total_tokens": used + pending,
            "max_total_num_tokens": total,
            "token_usage": round(used / total, 4),
            "gen_throughput": round(self._throughput(), 2),
            "cache_hit_rate": 0.0,
            "utilization": round(len(self.running) / self._config.max_running_requests, 4),
            "max_running_requests": self._config.max_running_requests,
            "num_retracted_reqs": sum(1 for r in self.waiting if r.retractions),
            "memory": {
                "weight_gb": self._pools.nbytes("weights") / 2**30,
                "kv_cache_gb": self._pools.nbytes("kv_cache") / 2**30,
                "graph_gb": self._pools.nbytes("cuda_graph") / 2**30,
                "token_capacity": total,
            },
        }
