"""What each engine kind's memory calls do to the facts: the part of an engine kind's table the knowledge model reads.

``resilience.barrier.kinds.EngineRules`` (the table of an engine kind) holds one
``MemoryModel``; ``EngineKnowledge`` folds every release and resume through its
engine's (``EngineKnowledge.memory``). A leaf module, so that the knowledge model
and the tables (which read the knowledge) import it without a circle.

=========================  =============================================  ==============================================
field                      SGLang 0.5.23                                  vLLM 0.33.0 (``VLLMEngine``)
=========================  =============================================  ==============================================
``tags``                   kv_cache, weights, cuda_graph                  weights, kv_cache (``abstract.py`` l.36)
``release_whole``          no: a release names its tags                   yes: ``/sleep`` sleeps both, whatever is asked
``flush_before_release``   yes: the scheduler asserts it is idle          no: ``/sleep`` at level >= 1 clears the caches
``release_pauses``         no                                             yes: ``EngineCore.sleep`` pauses first (l.993)
``resend``                 no: a second release or a resume of an         yes: a second sleep and a wake of an awake tag
                           unreleased tag kills it (quarantine instead)   are no-ops (l.400, l.416-422)
``wake_one_tag``           no: one resume names every tag                 yes: a wake naming a tag not asleep wakes
                                                                          nothing at all, so one tag per call makes a
                                                                          re-send exact; weights first (RFC #48310)
``last_wake_resumes``      no                                             yes: a wake that leaves nothing asleep
                                                                          resumes scheduling, whoever paused (l.1053)
=========================  =============================================  ==============================================
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from resilience.barrier.engine import ALL_TAGS

__all__ = ["MEMORY_MODELS", "RESEND_ROUNDS", "SGLANG_MEMORY", "VLLM_MEMORY", "MemoryModel"]

RESEND_ROUNDS: Final = 2
"""How many times a transition re-sends, at once, a release or resume whose effect was ambiguous on a ``resend`` kind
(then the next transition sends it again)."""


@dataclass(frozen=True, slots=True)
class MemoryModel:
    """One engine kind's memory semantics (see the module's table for each field's meaning and values)."""

    kind: str
    tags: tuple[str, ...]
    """The memory tags, in the order onload brings them back."""
    release_whole: bool
    """A release releases every tag, whatever it names."""
    flush_before_release: bool
    """A release needs a flush first (the engine must be idle)."""
    release_pauses: bool
    """A release pauses the engine itself."""
    resend: bool
    """Unknown released tags are settled by re-sending the call (idempotent), not quarantined."""
    wake_one_tag: bool
    """A resume names one tag per call (a call naming a tag not released does nothing at all)."""
    last_wake_resumes: bool
    """A resume that leaves nothing released reopens scheduling, like a continue."""
    all_tags: frozenset[str] = field(init=False, repr=False, compare=False)
    """``tags`` as a set (derived once: read several times per engine per phase)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "all_tags", frozenset(self.tags))

    def release_tags(self, kwargs: Mapping[str, Any]) -> frozenset[str]:
        """The tags a release call with ``kwargs`` releases (None or empty: all of them)."""
        tags = kwargs.get("tags")
        if self.release_whole or not tags:
            return self.all_tags
        return frozenset(tags) & self.all_tags

    def resume_tags(self, kwargs: Mapping[str, Any]) -> frozenset[str]:
        """The tags a resume call with ``kwargs`` names (None or empty: all of them)."""
        tags = kwargs.get("tags")
        return frozenset(tags) & self.all_tags if tags else self.all_tags

    def release_kwargs(self, tags: frozenset[str]) -> dict[str, Any]:
        """The arguments of a release of ``tags`` (None when it is every tag, or on a ``release_whole`` kind)."""
        return {"tags": None if self.release_whole or tags >= self.all_tags else sorted(tags)}


SGLANG_MEMORY: Final = MemoryModel(
    kind="sglang",
    tags=ALL_TAGS,
    release_whole=False,
    flush_before_release=True,
    release_pauses=False,
    resend=False,
    wake_one_tag=False,
    last_wake_resumes=False,
)
"""SGLang 0.5.23: what the barrier always did."""

VLLM_MEMORY: Final = MemoryModel(
    kind="vllm",
    tags=("weights", "kv_cache"),
    release_whole=True,
    flush_before_release=False,
    release_pauses=True,
    resend=True,
    wake_one_tag=True,
    last_wake_resumes=True,
)
"""vLLM 0.33.0 driven through ``resilience.adapters.vllm.VLLMEngine`` (``v1/engine/core.py`` l.993-1055,
``v1/executor/abstract.py`` l.400-422)."""

MEMORY_MODELS: Final[Mapping[str, MemoryModel]] = {m.kind: m for m in (SGLANG_MEMORY, VLLM_MEMORY)}
"""Every memory model, by kind (what a journal's ``kind`` names)."""
