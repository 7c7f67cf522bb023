"""``VLLMEngine`` and ``AsyncVLLMEngine``: one vLLM server as the barrier drives it (``resilience.engine_contract``).

The barrier's five control calls map onto vLLM 0.33.0's routes (``shared/reference/vllm-control-plane.md``) as each
method of ``VLLMEngine`` says, and as ``docs/vllm.md``, "The barrier on vLLM fleets", lays out (a release sleeps both
tags, ``VLLM_TAGS``; the barrier wakes one tag per call, so a re-send is exact).

Why ``mode=keep`` on the sleep: the barrier has paused the engine already;
``EngineCore.sleep`` (``v1/engine/core.py`` l.993) pauses the scheduler again
with the mode it is given, and ``abort`` would abort what a ``retract`` pause
kept, ``wait`` would let frozen requests step. ``keep`` freezes whatever the
barrier's pause left (``PAUSED_ALL``) and, at level >= 1, clears the caches
(preempting running requests, recomputed after the wake, ``_finish_pause``
l.948). It does not touch ``reject_new_requests`` (only ``pause_generation``
does, l.2225), so an ``abort`` pause keeps answering new requests 503.

Level 2, and the hazards the barrier's vLLM rules (not this adapter) keep away (``/resume`` and a wake that leaves
nothing asleep end every pause, l.985, l.1053-1055): ``docs/vllm.md``, "The barrier on vLLM fleets".

``control_rules`` (``resilience.engine_contract.VLLM_RULES``) tells the barrier
which table applies; ``tags`` are the memory tags the engine has. The weight-transfer session
(``start_weight_update`` ...) is on ``client``, and ``push_weights`` runs one
(``resilience.adapters.vllm.weights``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final, Generic, Literal, TypeVar

from resilience.adapters.vllm.answers import VLLMPauseMode
from resilience.adapters.vllm.async_client import AsyncVLLMClient
from resilience.adapters.vllm.client import VLLMClient
from resilience.adapters.vllm.results import CommandResult, CompletionResult, SleepResult, WakeResult, WeightInfo
from resilience.adapters.vllm.versions import VLLMApi
from resilience.adapters.vllm.weights import WeightPush, apush_weights, push_weights
from resilience.engine_contract import VLLM_MEMORY, VLLM_RULES

__all__ = ["VLLM_PAUSE_MODES", "VLLM_TAGS", "AsyncVLLMEngine", "VLLMEngine", "sleep_args", "wake_args"]

VLLM_TAGS: Final[tuple[str, ...]] = VLLM_MEMORY.tags
"""vLLM's sleep tags (``v1/executor/abstract.py`` l.36), in the order a wake brings them back (RFC #48310: weights first)."""

VLLM_PAUSE_MODES: Final[Mapping[str, tuple[VLLMPauseMode, bool]]] = {
    "abort": ("abort", True),
    "retract": ("keep", True),
    "in_place": ("keep", False),
}
"""The barrier's pause modes as vLLM ``(mode, clear_cache)``.

- ``abort``: abort running requests, reject new ones with 503 until resumed.
- ``retract``: SGLang puts running requests back in the queue; vLLM's ``keep`` with ``clear_cache`` freezes them and
  frees their KV (preempted, recomputed on resume): the same promise. New requests queue.
- ``in_place``: ``keep`` without clearing: requests keep their KV (computed
  with the old weights if weights change meanwhile, PR #57970).
"""

_SLEEP_MODE: Final[VLLMPauseMode] = "keep"
SleepLevel = Literal[1, 2]


def pause_args(mode: str) -> tuple[VLLMPauseMode, bool]:
    """``(mode, clear_cache)`` for a barrier pause mode; ``ValueError`` naming the modes for any other."""
    try:
        return VLLM_PAUSE_MODES[mode]
    except KeyError:
        raise ValueError(f"vLLM pause mode must be one of {sorted(VLLM_PAUSE_MODES)} (the barrier's modes), but was {mode!r}") from None


def _unknown_tags(what: str, tags: Sequence[str]) -> list[str]:
    if isinstance(tags, str):
        raise TypeError(f"{what} tags must be a sequence of tag names, but was the string {tags!r}")
    return sorted(set(tags) - set(VLLM_TAGS))


def sleep_args(tags: Sequence[str] | None) -> None:
    """Check a release's tags: None, or a subset of ``VLLM_TAGS`` (both go to sleep whatever is named)."""
    unknown = _unknown_tags("release", () if tags is None else tags)
    if unknown:
        raise ValueError(f"vLLM release tags must be among {VLLM_TAGS} (a sleep releases both), but got {unknown}")


def wake_args(tags: Sequence[str] | None) -> list[str] | None:
    """A wake's tags as sent: None (a full wake: every tag that sleeps) or the tags, checked against ``VLLM_TAGS``."""
    if tags is not None and (_unknown_tags("wake", tags) or not tags):
        raise ValueError(f"vLLM wake tags must be a non-empty subset of {VLLM_TAGS} (None = every tag), but got {list(tags)}")
    return None if tags is None else list(tags)


def _has_mm_resets(api: VLLMApi | None) -> bool:
    return api is not None and api.at_least((0, 33, 0))


def _check_level(level: int) -> SleepLevel:
    if level not in (1, 2) or isinstance(level, bool):
        raise ValueError(f"VLLMEngine sleep_level must be 1 or 2, but was {level!r} (level 0 releases nothing)")
    return 1 if level == 1 else 2


C = TypeVar("C", VLLMClient, AsyncVLLMClient)


class _Engine(Generic[C]):
    """What both engines hold: the client (made from a URL with ``client_kwargs``, else checked) and ``sleep_level``."""

    control_rules: Final = VLLM_RULES
    tags: Final = VLLM_TAGS
    _client_type: type[C]

    def __init__(self, client: C | str, *, sleep_level: int = 1, **client_kwargs: Any) -> None:
        name, kind = type(self).__name__, self._client_type
        if isinstance(client, str):
            client = kind(client, **client_kwargs)
        elif client_kwargs:
            raise TypeError(f"{name}: client keyword arguments {sorted(client_kwargs)} given with a client already built")
        if not isinstance(client, kind):
            raise TypeError(f"{name} needs an {kind.__name__} or a URL, but got {client!r}".replace("an V", "a V"))
        self.client: C = client
        self.engine = client.engine
        self.base_url = client.base_url
        self.sleep_level = _check_level(sleep_level)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.base_url!r}, sleep_level={self.sleep_level})"


class VLLMEngine(_Engine[VLLMClient]):
    """One vLLM server with the barrier's five control calls (synchronous), over a ``VLLMClient``.

    ``client``: a ``VLLMClient``, or the server's URL (a client is made with ``client_kwargs``: ``policies``,
    ``api_key``, ``api_version``, ...). ``sleep_level``: 1 (default: weights to CPU, KV discarded) or 2 (both discarded:
    the weights are garbage until a weight update).
    """

    _client_type = VLLMClient

    def close(self) -> None:
        """Close the client (its session, if it made one)."""
        self.client.close()

    def pause_generation(self, *, mode: str = "abort") -> CommandResult:
        """``/pause`` with the barrier's ``mode`` mapped by ``VLLM_PAUSE_MODES``."""
        vmode, clear = pause_args(mode)
        return self.client.pause(vmode, clear_cache=clear)

    def flush_cache(self, *, deadline_s: float | None = None) -> object:
        """``/reset_prefix_cache`` (refusals asked again up to ``deadline_s``, default the client's), then the mm and encoder
        caches (on 0.33.0 and later, which have them)."""
        result = self.client.reset_prefix_cache(deadline_s=deadline_s)
        if _has_mm_resets(self.client.api):
            self.client.reset_mm_cache()
            self.client.reset_encoder_cache()
        return result

    def release_memory_occupation(self, *, tags: Sequence[str] | None = None) -> SleepResult:
        """``/sleep?level=L&mode=keep``: every tag goes to sleep (``tags`` are only checked). Idempotent on vLLM."""
        sleep_args(tags)
        return self.client.sleep(self.sleep_level, _SLEEP_MODE)

    def resume_memory_occupation(self, *, tags: Sequence[str] | None = None) -> WakeResult:
        """``/wake_up?tags=...`` (None: a full wake). A wake that leaves nothing asleep also resumes the scheduler."""
        return self.client.wake_up(wake_args(tags))

    def continue_generation(self, *, torch_empty_cache: bool = True) -> CommandResult:
        """``/resume`` (``torch_empty_cache`` has no vLLM counterpart and is ignored)."""
        return self.client.resume()

    def push_weights(
        self, chunks: Sequence[Mapping[str, Any]], *, version: str, expected: Mapping[str, str] | None = None
    ) -> WeightPush:
        """One weight-transfer session: start, ``update_weights`` per chunk, finish with ``version`` (``weights.push_weights``)."""
        return push_weights(self.client, chunks, version=version, expected=expected)

    def weight_info(self) -> WeightInfo:
        """``GET /weight_info`` (what ``resilience.barrier.verify.WeightVersionCheck`` reads)."""
        return self.client.weight_info()

    def is_paused(self) -> bool:
        """``GET /is_paused`` (paused or asleep: True). What a controller that resumed a journal asks (``VLLM_RULES.serving_read``)."""
        return self.client.is_paused()

    def complete(
        self, prompt: str, *, max_tokens: int = 16, temperature: float = 0.0, extra: Mapping[str, Any] | None = None
    ) -> CompletionResult:
        """``POST /v1/completions`` (what ``resilience.barrier.verify.CanaryCheck`` sends)."""
        return self.client.complete(prompt, max_tokens=max_tokens, temperature=temperature, extra=extra)


class AsyncVLLMEngine(_Engine[AsyncVLLMClient]):
    """``VLLMEngine`` with ``async`` calls, over an ``AsyncVLLMClient`` (same arguments and meaning)."""

    _client_type = AsyncVLLMClient

    async def aclose(self) -> None:
        """Close the client's own session."""
        await self.client.aclose()

    async def pause_generation(self, *, mode: str = "abort") -> CommandResult:
        """See ``VLLMEngine.pause_generation``."""
        vmode, clear = pause_args(mode)
        return await self.client.pause(vmode, clear_cache=clear)

    async def flush_cache(self, *, deadline_s: float | None = None) -> object:
        """See ``VLLMEngine.flush_cache``."""
        result = await self.client.reset_prefix_cache(deadline_s=deadline_s)
        if _has_mm_resets(self.client.api):
            await self.client.reset_mm_cache()
            await self.client.reset_encoder_cache()
        return result

    async def release_memory_occupation(self, *, tags: Sequence[str] | None = None) -> SleepResult:
        """See ``VLLMEngine.release_memory_occupation``."""
        sleep_args(tags)
        return await self.client.sleep(self.sleep_level, _SLEEP_MODE)

    async def resume_memory_occupation(self, *, tags: Sequence[str] | None = None) -> WakeResult:
        """See ``VLLMEngine.resume_memory_occupation``."""
        return await self.client.wake_up(wake_args(tags))

    async def continue_generation(self, *, torch_empty_cache: bool = True) -> CommandResult:
        """See ``VLLMEngine.continue_generation``."""
        return await self.client.resume()

    async def push_weights(
        self, chunks: Sequence[Mapping[str, Any]], *, version: str, expected: Mapping[str, str] | None = None
    ) -> WeightPush:
        """See ``VLLMEngine.push_weights``."""
        return await apush_weights(self.client, chunks, version=version, expected=expected)

    async def weight_info(self) -> WeightInfo:
        """See ``VLLMEngine.weight_info``."""
        return await self.client.weight_info()

    async def is_paused(self) -> bool:
        """See ``VLLMEngine.is_paused``."""
        return await self.client.is_paused()

    async def complete(
        self, prompt: str, *, max_tokens: int = 16, temperature: float = 0.0, extra: Mapping[str, Any] | None = None
    ) -> CompletionResult:
        """See ``VLLMEngine.complete``."""
        return await self.client.complete(prompt, max_tokens=max_tokens, temperature=temperature, extra=extra)
