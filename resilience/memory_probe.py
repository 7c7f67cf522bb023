"""``MemoryProbe``: where a deployment can prove it, which memory tags are released on an engine right now.

SGLang 0.5.23 has no route that tells, so a probe answers from outside the HTTP
control plane (NVML: ``resilience.adapters.nvml``; the emulator's own truth:
``resilience.testing``); ``docs/failure-and-recovery.md`` says who asks it. A
probe never guesses: ``None`` means "I know this engine but cannot prove it
now", and the caller behaves as without a probe; an engine it cannot read at all
raises ``UnknownEngine`` instead (``covers``). Probes are synchronous and quick
(a local read); async callers may call them directly.
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
    """Whether ``probe`` knows ``engine``: one ``released_tags`` call answers a reading, None or another error, not ``UnknownEngine``.

    Another error counts as known (the probe may read the engine later), as the callers treat it.
    """
    try:
        probe.released_tags(engine)
    except UnknownEngine:
        return False
    except Exception:
        return True
    return True
