"""``MemoryProbeCheck``: a ``MemoryProbe`` asked, on the transport, whether a release or resume was applied.

The retry loop asks an endpoint's probe before it re-sends a non-idempotent call after a gateway status (502/503/504) or
an ambiguous failure (a read timeout, a connection dropped after sending). For ``/release_memory_occupation`` and
``/resume_memory_occupation`` this check reads the request's tags from its body (``ProbeContext.body``; null or [] =
every tag, as SGLang 0.5.23's ``WeightUpdater.release_memory_occupation`` / ``resume_memory_occupation``,
``sglang/srt/managers/scheduler_components/weight_updater.py``) and compares them with the tags the memory probe says
are released on the engine now:

- **applied** ("done", the call returns as applied): a release whose tags are
  all released; a resume whose tags are all active;
- **not applied** ("not done", the call is re-sent): a release whose tags are all
  active, a resume whose tags are all released, and only after a 502 or 503;
- **unknown** otherwise: the probe answered None (it cannot prove it, or the engine is dead), the tags are partly in
  each state, the body is unreadable, the path is neither call; and "not applied" after a 504 or an ambiguous failure.
  Those mean the request was handed on and may still be on its way or running (a gateway timeout, a reset right after
  sending): "active now" does not prove it will stay so, and a re-send could be the second release that kills the
  engine. Unknown falls back to the endpoint's own choice (``SGLANG_POLICIES``: re-send after a gateway status,
  ``AmbiguousOutcome`` after an ambiguous failure).

So the check never re-sends where the preset would not, and it turns the preset's one dangerous re-send (a 502 given
after the release was applied) into an applied answer.
"""

from __future__ import annotations

import json
from urllib.parse import urlsplit

from resilience.engine_contract import ALL_TAGS, MemoryProbe
from resilience.policy import ProbeAnswer, ProbeContext

__all__ = ["RELEASE_PATH", "RESUME_PATH", "MemoryProbeCheck", "probe_verdict", "requested_tags"]

RELEASE_PATH = "/release_memory_occupation"
RESUME_PATH = "/resume_memory_occupation"
_NOT_APPLIED_TRUSTED: frozenset[int] = frozenset({502, 503})
"""Statuses after which "the tags are as before" is taken to mean the call will not be applied later."""


def requested_tags(body: bytes | None) -> frozenset[str] | None:
    """The tags a release or resume body asks for (``{"tags": null}``, ``[]`` or no ``tags`` = all); None when unreadable."""
    if body is None:
        return None
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(data, dict):
        return None
    tags = data.get("tags")
    if tags is None or tags == []:
        return frozenset(ALL_TAGS)
    if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
        return None
    return frozenset(tags)


class MemoryProbeCheck:
    """A ``resilience.policy.Probe`` for SGLang's release and resume calls, answered from ``memory_probe``.

    ``memory_probe``: any ``resilience.engine_contract.MemoryProbe`` (NVML on the engine's node, the
    emulator's side channel). A probe that raises counts as "cannot prove" (unknown).
    """

    def __init__(self, memory_probe: MemoryProbe) -> None:
        if not isinstance(memory_probe, MemoryProbe):
            raise TypeError(
                f"memory_probe must have released_tags(engine) (a resilience.engine_contract.MemoryProbe), but was {memory_probe!r}"
            )
        self.memory_probe = memory_probe
        """The probe asked."""

    def __repr__(self) -> str:
        return f"MemoryProbeCheck({self.memory_probe!r})"

    def __call__(self, context: ProbeContext) -> ProbeAnswer:
        path = urlsplit(context.url).path.rstrip("/")
        releasing = path.endswith(RELEASE_PATH)
        if not (releasing or path.endswith(RESUME_PATH)):
            return ProbeAnswer.UNKNOWN
        tags = requested_tags(context.body)
        if tags is None:
            return ProbeAnswer.UNKNOWN
        return probe_verdict(self.memory_probe, context.engine, tags, releasing=releasing, status=context.status)


def probe_verdict(memory_probe: MemoryProbe, engine: str, tags: frozenset[str], *, releasing: bool, status: int | None) -> ProbeAnswer:
    """What ``memory_probe`` proves of a release (``releasing``) or resume of ``tags`` on ``engine`` that got ``status``
    (None = no answer), by the module docstring's rules; a probe that raises or answers None proves nothing."""
    try:
        released = memory_probe.released_tags(engine)
    except Exception:
        return ProbeAnswer.UNKNOWN
    if released is None:
        return ProbeAnswer.UNKNOWN
    now_released, now_active = tags <= released, not (tags & released)
    applied, as_before = (now_released, now_active) if releasing else (now_active, now_released)
    if applied:
        return ProbeAnswer.DONE
    if as_before and status in _NOT_APPLIED_TRUSTED:
        return ProbeAnswer.NOT_DONE
    return ProbeAnswer.UNKNOWN
