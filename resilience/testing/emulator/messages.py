"""What the HTTP side (the tokenizer manager) sends the scheduler thread, and what comes back.

Control messages carry a ``concurrent.futures.Future`` the scheduler resolves; the HTTP side awaits it with
``asyncio.wrap_future``. Messages are handled in the order they were sent, as SGLang's ZMQ channel does.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = [
    "HEALTH_CHECK_RID_PREFIX", "AbortRequests", "AddRequest", "ContinueScheduler", "ControlMessage", "FlushCache", "FlushResult",
    "GetLoads", "LoadWeights", "Message", "PauseScheduler", "ReleaseMemory", "Req", "ResumeMemory", "SchedulerOutput",
    "SetWeightVersion",
]  # fmt: skip

HEALTH_CHECK_RID_PREFIX = "HEALTH_CHECK"
"""rid prefix of the requests ``/health`` sends (not counted as completed or aborted)."""


@dataclass(eq=False)
class Req:
    """One generation request as the scheduler holds it."""

    rid: str
    input_ids: list[int]
    max_new_tokens: int
    stream: bool
    output_ids: list[int] = field(default_factory=list)
    slot: int | None = None
    kv_indices: list[int] = field(default_factory=list)
    retractions: int = 0
    version_events: list[tuple[str, int]] = field(default_factory=list)
    """(old weight version, output tokens so far) at each version change while the request lived."""
    sent: int = 0
    """How many of ``output_ids`` were already handed to the tokenizer side."""

    @property
    def seq_len(self) -> int:
        """Prompt plus generated tokens so far."""
        return len(self.input_ids) + len(self.output_ids)

    @property
    def finished_length(self) -> bool:
        """Whether the request has generated all the tokens it asked for."""
        return len(self.output_ids) >= self.max_new_tokens


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    """New tokens of one request (cumulative count in ``completion_tokens``), final when ``finish_reason`` is set."""

    rid: str
    new_ids: tuple[int, ...]
    finish_reason: dict[str, Any] | None
    prompt_tokens: int
    completion_tokens: int
    retractions: int = 0
    """``meta_info["num_retractions"]``: how often the request went back to the waiting queue."""
    weight_versions: tuple[dict[str, Any], ...] | None = None
    """``meta_info["weight_versions"]`` spans ``{"version", "start", "end"}`` (final output only)."""


@dataclass(frozen=True, slots=True)
class FlushResult:
    """Answer to :class:`FlushCache`; an empty message means SGLang's default text."""

    success: bool
    message: str = ""


@dataclass(eq=False)
class AddRequest:
    """A request that passed the tokenizer's pause gate."""

    req: Req


@dataclass(eq=False)
class AbortRequests:
    """Abort by rid prefix, or every request when ``abort_all``."""

    rid: str
    abort_all: bool


@dataclass(eq=False)
class ControlMessage:
    """Base of the messages that are answered through ``reply``."""

    reply: Future[Any] = field(default_factory=Future, kw_only=True)


@dataclass(eq=False)
class PauseScheduler(ControlMessage):
    """``retract`` or ``in_place`` pause (``abort`` never reaches the scheduler)."""

    mode: Literal["retract", "in_place"]


@dataclass(eq=False)
class ContinueScheduler(ControlMessage):
    """Clear the scheduler's pause."""


@dataclass(eq=False)
class FlushCache(ControlMessage):
    """Flush the cache when idle; wait up to ``timeout_s`` for idleness (0 = check once)."""

    timeout_s: float


@dataclass(eq=False)
class ReleaseMemory(ControlMessage):
    """Release the tags' memory (asserts an idle scheduler)."""

    tags: tuple[str, ...]


@dataclass(eq=False)
class ResumeMemory(ControlMessage):
    """Resume the tags' memory (KeyError for a tag that is not released)."""

    tags: tuple[str, ...]


@dataclass(eq=False)
class LoadWeights(ControlMessage):
    """Write new weights (by index), record the new version, then flush the cache when asked.

    Answered ``(success, message)``: a flush refused after the weights were written is
    ``(False, "Weights were updated, but the cache was not flushed ...")``.
    """

    seed: int
    flush_cache: bool
    weight_version: str | None = None


@dataclass(eq=False)
class SetWeightVersion(ControlMessage):
    """``/update_weight_version``: record a new version for the requests alive now."""

    version: str


@dataclass(eq=False)
class GetLoads(ControlMessage):
    """Ask for the load numbers of ``/v1/loads`` and ``/server_info``."""


Message = AddRequest | AbortRequests | ControlMessage
"""Anything the scheduler's inbox holds."""
