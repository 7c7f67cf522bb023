"""The engine contract: the five control calls the barrier sends, as a ``Protocol`` mypy checks every engine against.

``SGLangClient`` (``resilience.adapters.sglang``), the Ray engine actor and
``RayEngine`` (``resilience.adapters.ray``) satisfy ``ControlPlaneEngine``;
so does any object with these methods, named and typed as here (a test fake,
your own client). ``AsyncControlPlaneEngine`` is the same contract with
``async`` methods. The barrier reads nothing from what a call returns: a call
that returns has been applied, one that raises is judged by its error
(``resilience.barrier.effect``). The names follow SGLang 0.5.23's HTTP routes
(``sglang/srt/entrypoints/http_server.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final, Literal, Protocol, TypeAlias, get_args

__all__ = [
    "ALL_TAGS",
    "CONTROL_METHODS",
    "AnyEngine",
    "AsyncControlPlaneEngine",
    "ControlMethod",
    "ControlPlaneEngine",
    "PauseMode",
]

ALL_TAGS: Final[tuple[str, ...]] = ("kv_cache", "weights", "cuda_graph")
"""The memory tags SGLang releases or resumes when ``tags`` is None or empty (``GPU_MEMORY_ALL_TYPES``)."""

PauseMode = Literal["abort", "retract", "in_place"]
"""How ``pause_generation`` treats running requests: abort them, retract them to the queue, or keep them in place."""

ControlMethod = Literal[
    "pause_generation", "flush_cache", "release_memory_occupation", "resume_memory_occupation", "continue_generation"
]
"""The name of one control call."""

CONTROL_METHODS: Final[tuple[ControlMethod, ...]] = get_args(ControlMethod)
"""The five control calls, in the order an offload then an onload sends them."""


class ControlPlaneEngine(Protocol):
    """One engine as the barrier drives it (synchronous calls).

    The barrier passes arguments by keyword, so their names are part of the
    contract (mypy checks them). Each call may block until the engine answered, and should honour the
    ``resilience.Deadline`` in force in the caller's context (the fan-out runs
    each phase call under the phase deadline). An engine is known by its
    ``engine`` attribute (``scheme://host:port``), else its ``name``, else its repr.
    """

    def pause_generation(self, *, mode: PauseMode = "abort") -> object:
        """Stop admitting requests; ``mode`` says what happens to running ones."""
        ...

    def flush_cache(self, *, deadline_s: float | None = None) -> object:
        """Flush the KV cache, waiting up to ``deadline_s`` (None = the engine's default) for the engine to be idle."""
        ...

    def release_memory_occupation(self, *, tags: Sequence[str] | None = None) -> object:
        """Release GPU memory for ``tags`` (None = ``ALL_TAGS``); only on a paused, flushed engine."""
        ...

    def resume_memory_occupation(self, *, tags: Sequence[str] | None = None) -> object:
        """Occupy GPU memory again for ``tags`` (None = ``ALL_TAGS``); only for tags released."""
        ...

    def continue_generation(self, *, torch_empty_cache: bool = True) -> object:
        """Admit requests again; only when no memory is released."""
        ...


class AsyncControlPlaneEngine(Protocol):
    """``ControlPlaneEngine`` with ``async`` calls (same names, arguments and meaning)."""

    async def pause_generation(self, *, mode: PauseMode = "abort") -> object:
        """See ``ControlPlaneEngine.pause_generation``."""
        ...

    async def flush_cache(self, *, deadline_s: float | None = None) -> object:
        """See ``ControlPlaneEngine.flush_cache``."""
        ...

    async def release_memory_occupation(self, *, tags: Sequence[str] | None = None) -> object:
        """See ``ControlPlaneEngine.release_memory_occupation``."""
        ...

    async def resume_memory_occupation(self, *, tags: Sequence[str] | None = None) -> object:
        """See ``ControlPlaneEngine.resume_memory_occupation``."""
        ...

    async def continue_generation(self, *, torch_empty_cache: bool = True) -> object:
        """See ``ControlPlaneEngine.continue_generation``."""
        ...


AnyEngine: TypeAlias = ControlPlaneEngine | AsyncControlPlaneEngine
"""An engine with synchronous or ``async`` control calls (``ThreadFanOut`` drives the first kind, ``AsyncFanOut`` both)."""
