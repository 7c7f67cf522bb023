"""Fan-outs: how one barrier phase reaches many engines at once (the public home of the barrier's fan-outs).

- ``ThreadFanOut``: a bounded thread pool, for engines with synchronous calls (``SGLangClient``).
- ``AsyncFanOut``: one event loop on a thread of its own, for engines whose calls are coroutines
  (``AsyncSGLangClient``); the synchronous ``Orchestrator`` takes it like any other fan-out.
- ``SequentialFanOut``: one engine after another (a baseline for benchmarks).
- ``FanOut``: the protocol they satisfy; ``EngineResult``: one engine's answer to one phase call.

They live in ``resilience.barrier.fanout`` and ``resilience.barrier.async_fanout``; Ray's is
``resilience.adapters.ray.RayFanOut``, and the smg gateway's (each phase one ``/v1/rl`` fan-out) is
``resilience.adapters.smg_fanout.SmgFanOut``.
"""

from resilience.barrier.async_fanout import AsyncFanOut
from resilience.barrier.fanout import EngineResult, FanOut, SequentialFanOut, ThreadFanOut

__all__ = ["AsyncFanOut", "EngineResult", "FanOut", "SequentialFanOut", "ThreadFanOut"]
