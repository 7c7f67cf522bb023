"""``MemoryProbe``: where a deployment can prove it, which memory tags are released on an engine right now.

SGLang 0.5.23 has no route that tells which tags are released (the scheduler
keeps them in ``WeightUpdater.offload_tags``,
``sglang/srt/managers/scheduler_components/weight_updater.py``), so an
ambiguous release or resume leaves the barrier and the transport guessing. A
probe answers from outside the HTTP control plane: NVML's per-process GPU
memory on the engine's node (``resilience.adapters.nvml``), or the emulator's
own truth over a side channel (``resilience.testing``).

A probe never guesses: ``None`` means "I cannot prove it for this engine now",
and the caller then behaves as it would without a probe (the barrier
quarantines the engine and names it; the transport follows its preset).
Probes are synchronous and quick (a local read); async callers may call them
directly.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

__all__ = ["MemoryProbe"]


@runtime_checkable
class MemoryProbe(Protocol):
    """Answers which memory tags (``kv_cache``, ``weights``, ``cuda_graph``) are released on an engine."""

    def released_tags(self, engine: str) -> frozenset[str] | None:
        """The tags released on ``engine`` (its name, ``scheme://host:port``) now, or None when this probe cannot prove it."""
        ...
