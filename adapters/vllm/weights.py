"""One vLLM weight-transfer session, with each route's real idempotence: ``push_weights`` / ``apush_weights``.

The session (``v1/worker/gpu_worker.py`` l.1542-1650, reference section 4.5) is
``/start_weight_update`` -> ``/update_weights`` per chunk -> ``/finish_weight_update``.
None of the three is idempotent, and ``VLLM_POLICIES`` sends each at most once
once it may have arrived. What an answer that was lost means, and what is done:

- an ambiguous ``start``: sent again. A session already open answers 500
  "start_weight_update called while a weight update is already active", which
  proves the first start arrived (the engine lives; a utility failure, core.py
  l.1850); a 200 means it had not.
- an ambiguous ``update_weights``: **never sent again** (a re-send of an NCCL
  collective queues behind the first and waits for a broadcast that never
  comes, prime-rl #3599). With ``expected`` checksums the session is finished
  and ``/weight_checker`` compares the engine's weights with them: a match
  settles it; otherwise ``WeightPushAmbiguous`` names the engine and chunk.
- an ambiguous ``finish``: ``/weight_info`` is asked; the pushed version there
  proves it arrived; otherwise the session is still open and it is sent again.

A chunk is whatever your backend's ``update_info`` is (``{"names": ..., ...}`` for NCCL).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from resilience.adapters.vllm.types import VLLMError, VLLMVersionError
from resilience.outcome import Delivery, attempts_of

if TYPE_CHECKING:
    from resilience.adapters.vllm.async_client import AsyncVLLMClient
    from resilience.adapters.vllm.client import VLLMClient

__all__ = ["WeightPush", "WeightPushAmbiguous", "WeightPushFailed", "apush_weights", "maybe_applied", "push_weights"]

_ALREADY_ACTIVE = "already active"


@dataclass(frozen=True, slots=True)
class WeightPush:
    """A finished session: ``version`` pushed in ``chunks`` chunks; ``settled``: lost answers settled, and how."""

    engine: str
    version: str
    chunks: int
    settled: tuple[str, ...] = ()


class WeightPushFailed(RuntimeError):
    """The engine refused a call of the session (``cause`` is its error); nothing of it needs re-sending to be known."""

    def __init__(self, engine: str, step: str, cause: BaseException) -> None:
        super().__init__(f"{engine}: weight push failed at {step}: {type(cause).__name__}: {cause}")
        self.engine, self.step, self.cause = engine, step, cause


class WeightPushAmbiguous(RuntimeError):
    """An ``/update_weights`` whose answer was lost, not sent again and not proven by ``/weight_checker``: the engine's
    weights are unknown. Push the version again in a new session (after ``finish``), or restart the engine."""

    def __init__(self, engine: str, chunk: int, cause: BaseException, detail: str) -> None:
        super().__init__(f"{engine}: /update_weights chunk {chunk} may or may not have been applied ({detail}); it was not re-sent")
        self.engine, self.chunk, self.cause = engine, chunk, cause


def maybe_applied(error: BaseException) -> bool:
    """The driver's record says the call may have reached the engine and been acted on (no record: it may)."""
    if isinstance(error, VLLMVersionError):
        return False  # refused before sending (the version gate)
    attempts = attempts_of(error)
    if attempts is None:
        return True
    for a in attempts:
        if a.delivery is Delivery.MAYBE_APPLIED:
            return True
        if a.delivery is Delivery.RESPONDED and (a.status is None or a.status < 400 or a.status in (502, 503, 504)):
            return True
    return False


def _already_active(error: BaseException) -> bool:
    return isinstance(error, VLLMError) and error.status == 500 and _ALREADY_ACTIVE in str(error)


def _check(chunks: Sequence[Mapping[str, Any]], version: str) -> list[Mapping[str, Any]]:
    if not isinstance(version, str) or not version:
        raise ValueError(f"push_weights version must be a non-empty string, but was {version!r}")
    out = list(chunks)
    if not out:
        raise ValueError("push_weights needs at least one chunk (an update_info)")
    return out


def push_weights(
    client: VLLMClient, chunks: Sequence[Mapping[str, Any]], *, version: str, expected: Mapping[str, str] | None = None
) -> WeightPush:
    """Run one session on ``client``: start, one ``/update_weights`` per chunk, finish with ``version``.

    ``expected``: the checksums ``/weight_checker`` should report once the push
    applied (settles a lost ``update_weights`` answer; default None: surfaced).
    Raises ``WeightPushFailed`` (a call refused) or ``WeightPushAmbiguous``.
    """
    todo = _check(chunks, version)
    settled: list[str] = []
    try:
        client.start_weight_update()
    except Exception as exc:
        if not maybe_applied(exc):
            raise WeightPushFailed(client.engine, "start", exc) from exc
        try:
            client.start_weight_update()
        except Exception as again:
            if not _already_active(again):
                raise WeightPushFailed(client.engine, "start (sent again)", again) from again
        settled.append("start: sent again")
    for i, chunk in enumerate(todo):
        try:
            client.update_weights(chunk)
        except Exception as exc:
            if not maybe_applied(exc):
                raise WeightPushFailed(client.engine, f"update_weights chunk {i}", exc) from exc
            if expected is None:
                raise WeightPushAmbiguous(client.engine, i, exc, "no expected checksums to compare") from exc
            _finish(client, version, settled)
            check = client.weight_checker("compare", baseline=expected)
            if not check.match:
                raise WeightPushAmbiguous(client.engine, i, exc, f"/weight_checker mismatches: {list(check.mismatches)}") from exc
            settled.append(f"update_weights chunk {i}: /weight_checker matched")
            return WeightPush(client.engine, version, len(todo), tuple(settled))
    _finish(client, version, settled)
    return WeightPush(client.engine, version, len(todo), tuple(settled))


def _finish(client: VLLMClient, version: str, settled: list[str]) -> None:
    try:
        client.finish_weight_update(version)
    except Exception as exc:
        if not maybe_applied(exc):
            raise WeightPushFailed(client.engine, "finish", exc) from exc
        if client.weight_info().weight_version == version:
            settled.append("finish: /weight_info has the version")
            return
        try:
            client.finish_weight_update(version)
        except Exception as again:
            raise WeightPushFailed(client.engine, "finish (sent again)", again) from again
        settled.append("finish: sent again")


async def apush_weights(
    client: AsyncVLLMClient, chunks: Sequence[Mapping[str, Any]], *, version: str, expected: Mapping[str, str] | None = None
) -> WeightPush:
    """``push_weights`` on an ``AsyncVLLMClient`` (same rules)."""
    todo = _check(chunks, version)
    settled: list[str] = []
    try:
        await client.start_weight_update()
    except Exception as exc:
        if not maybe_applied(exc):
            raise WeightPushFailed(client.engine, "start", exc) from exc
        try:
            await client.start_weight_update()
        except Exception as again:
            if not _already_active(again):
                raise WeightPushFailed(client.engine, "start (sent again)", again) from again
        settled.append("start: sent again")
    for i, chunk in enumerate(todo):
        try:
            await client.update_weights(chunk)
        except Exception as exc:
            if not maybe_applied(exc):
                raise WeightPushFailed(client.engine, f"update_weights chunk {i}", exc) from exc
            if expected is None:
                raise WeightPushAmbiguous(client.engine, i, exc, "no expected checksums to compare") from exc
            await _afinish(client, version, settled)
            check = await client.weight_checker("compare", baseline=expected)
            if not check.match:
                raise WeightPushAmbiguous(client.engine, i, exc, f"/weight_checker mismatches: {list(check.mismatches)}") from exc
            settled.append(f"update_weights chunk {i}: /weight_checker matched")
            return WeightPush(client.engine, version, len(todo), tuple(settled))
    await _afinish(client, version, settled)
    return WeightPush(client.engine, version, len(todo), tuple(settled))


async def _afinish(client: AsyncVLLMClient, version: str, settled: list[str]) -> None:
    try:
        await client.finish_weight_update(version)
    except Exception as exc:
        if not maybe_applied(exc):
            raise WeightPushFailed(client.engine, "finish", exc) from exc
        if (await client.weight_info()).weight_version == version:
            settled.append("finish: /weight_info has the version")
            return
        try:
            await client.finish_weight_update(version)
        except Exception as again:
            raise WeightPushFailed(client.engine, "finish (sent again)", again) from again
        settled.append("finish: sent again")
