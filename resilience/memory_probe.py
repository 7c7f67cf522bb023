"""``MemoryProbe``: where a deployment can prove it, which memory tags are released on an engine right now.

SGLang 0.5.23 has no route that tells which tags are released (the scheduler
keeps them in ``WeightUpdater.offload_tags``,
``sglang/srt/managers/scheduler_components/weight_updater.py``), so an
ambiguous release or resume leaves the barrier and the transport guessing. A
probe answers from outside the HTTP control plane: NVML's per-process GPU
memory on the engine's node (``resilience.adapters.nvml``), or the emulator's
own truth over a side channel (``resilience.testing``).

A probe never guesses: ``None`` means "I know this engine but cannot prove it
now" (no reading: it is dead, restarting, mid-swap), and the caller then behaves
as it would without a probe (the barrier quarantines the engine and names it;
the transport follows its preset). An engine the probe has no way to read at all
(not among an ``NvmlMemoryProbe``'s engines, a proxy URL an
``EmulatorMemoryProbe`` has no alias for) is a different answer: ``released_tags``
raises ``UnknownEngine``, so a mount can refuse to start with a probe that would
answer None for ever (``covers``; ``SGLangInstrumentor.instrument`` checks every
engine it is given). Probes are synchronous and quick (a local read); async
callers may call them directly.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

__all__ = ["MemoryProbe", "UnknownEngine", "covers"]


class UnknownEngine(LookupError):
    """Raised by ``MemoryProbe.released_tags`` for an engine the probe knows nothing of (distinct from None: no reading now)."""

    def __init__(self, probe: object, engine: str) -> None:
        super().__init__(f"{probe!r} knows no engine {engine!r}")
        self.engine = engine
        """The engine asked about."""


@runtime_checkable
class MemoryProbe(Protocol):
    """Answers which memory tags (``kv_cache``, ``weights``, ``cuda_graph``) are released on an engine."""

    def released_tags(self, engine: str) -> frozenset[str] | None:
        """The tags released on ``engine`` (its name, ``scheme://host:port``) now, or None when this probe cannot prove it.

        Raises ``UnknownEngine`` when the probe has no way to read ``engine`` at all.
        """
        ...


def covers(probe: MemoryProbe, engine: str) -> bool:
    """Whether ``probe`` knows ``engine``: its answer now is a reading or None (no reading), not ``UnknownEngine``.

    One ``released_tags`` call (a local read). Any other error the probe raises
    counts as known (it may read the engine later), as the callers treat it.
    """
    try:
        probe.released_tags(engine)
    except UnknownEngine:
        return False
    except Exception:
        return True
    return True
