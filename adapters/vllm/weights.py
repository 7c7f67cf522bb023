"""One vLLM weight-transfer session, with each route's real idempotence: ``push_weights`` / ``apush_weights``.

The session (``v1/worker/gpu_worker.py`` l.1542-1650, reference section 4.5) is ``/start_weight_update`` ->
``/update_weights`` per chunk -> ``/finish_weight_update``. None of the three is idempotent, and ``VLLM_POLICIES`` sends
each at most once once it may have arrived. What an answer that was lost means, and what is done:

- an ambiguous ``start``: sent again (at most ``RESENDS`` times). A session already open answers 500
  "start_weight_update called while a weight update is already active", which proves the first start arrived (the engine
  lives; a utility failure, core.py l.1850); a 200 means it had not.
- an ambiguous ``update_weights``: **never sent again in that session** (a re-send of an NCCL collective queues behind
  the first and waits for a broadcast that never comes, prime-rl #3599). With ``expected`` checksums the session is
  finished and ``/weight_checker`` compares the engine's weights with them: a match settles it; a mismatch proves the
  push did not land, and a new session pushes it again (at most ``sessions`` in all). Without them, or when every
  session is spent, ``WeightPushAmbiguous`` names the engine and chunk.
- an ambiguous ``finish``: sent again (at most ``RESENDS`` times): a 200 closes the session, a 500 "finish_weight_update
  called without a matching start_weight_update" proves the first one had (``/weight_info`` cannot tell: a finish labels
  the weights with its version even when no chunk arrived, so after a lost ``update_weights`` only ``/weight_checker``
  tells; when it never matches, ``WeightPushAmbiguous`` says so, and the engine may report the version while holding
  other weights: verify with a canary, or push again).

A chunk is whatever your backend's ``update_info`` is (``{"names": ..., ...}`` for NCCL).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from resilience.adapters.engine_steps import Steps, drive, run_now, value_of
from resilience.adapters.vllm.results import VLLMError, VLLMVersionError
from resilience.outcome import Delivery, attempts_of

if TYPE_CHECKING:
    from resilience.adapters.vllm.async_client import AsyncVLLMClient
    from resilience.adapters.vllm.client import VLLMClient

__all__ = ["RESENDS", "WeightPush", "WeightPushAmbiguous", "WeightPushFailed", "apush_weights", "is_ambiguous", "push_weights"]

RESENDS = 3
"""How many times an ambiguous ``start`` or ``finish`` is sent again (each re-send may itself be answered ambiguously)."""


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


def is_ambiguous(error: BaseException) -> bool:
    """The driver's record says the call may have reached the engine and been acted on (no record: it may)."""
    if isinstance(error, VLLMVersionError):
        return False  # refused before sending (the version gate)
    attempts = attempts_of(error)
    if attempts is None:
        return True
    for a in attempts:
        if a.delivery is Delivery.AMBIGUOUS:
            return True
        if a.delivery is Delivery.RESPONDED and (a.status is None or a.status < 400 or a.status in (502, 503, 504)):
            return True
    return False


def _answered_500(words: str) -> Callable[[BaseException], bool]:
    """Whether an error is the engine's 500 saying ``words``: a start "... already active", a finish "... without a
    matching start ...": either proves the first one arrived."""
    return lambda error: isinstance(error, VLLMError) and error.status == 500 and words in str(error)


def _check(chunks: Sequence[Mapping[str, Any]], version: str, sessions: int) -> list[Mapping[str, Any]]:
    if isinstance(sessions, bool) or not isinstance(sessions, int) or sessions < 1:
        raise ValueError(f"push_weights sessions must be an int >= 1, but was {sessions!r}")
    if not isinstance(version, str) or not version:
        raise ValueError(f"push_weights version must be a non-empty string, but was {version!r}")
    out = list(chunks)
    if not out:
        raise ValueError("push_weights needs at least one chunk (an update_info)")
    return out


Chunks = Sequence[Mapping[str, Any]]
"""A push's chunks: one ``update_info`` per ``/update_weights`` (``{"names": ..., ...}`` for NCCL)."""


def push_weights(
    client: VLLMClient, chunks: Chunks, *, version: str, expected: Mapping[str, str] | None = None, sessions: int = 3
) -> WeightPush:
    """Run one session on ``client``: start, one ``/update_weights`` per chunk, finish with ``version``.

    ``expected``: the checksums ``/weight_checker`` reports once the push applied (settles a lost ``update_weights``
    answer; default None: it is surfaced). ``sessions``: sessions at most, when a lost answer was proven not applied
    (default 3). Raises ``WeightPushFailed`` (a call refused) or ``WeightPushAmbiguous``.
    """
    return run_now(drive(_push(client.engine, _check(chunks, version, sessions), version, expected, sessions), _calls(client)))


async def apush_weights(
    client: AsyncVLLMClient, chunks: Chunks, *, version: str, expected: Mapping[str, str] | None = None, sessions: int = 3
) -> WeightPush:
    """``push_weights`` on an ``AsyncVLLMClient`` (same rules and arguments)."""
    return await drive(_push(client.engine, _check(chunks, version, sessions), version, expected, sessions), _calls(client))


# -- the session as steps, without I/O: each step names a client call; ``engine_steps.drive`` makes it -------

Step = tuple[str, tuple[Any, ...], dict[str, Any]]
"""A client method's name, its arguments and keyword arguments."""


def _calls(client: VLLMClient | AsyncVLLMClient) -> Callable[[Step], Any]:
    """How ``drive`` performs a step on ``client``: the named method, called."""
    return lambda step: getattr(client, step[0])(*step[1], **step[2])


def _push(
    engine: str, todo: list[Mapping[str, Any]], version: str, expected: Mapping[str, str] | None, sessions: int
) -> Steps[Step, WeightPush]:
    """The sessions of one push as steps, by the module docstring's rules (``push_weights``' arguments, checked)."""
    settled: list[str] = []
    for session in range(1, sessions + 1):
        yield from _resent(engine, "start", ("start_weight_update", (), {}), settled, _answered_500("already active"))
        lost = None
        for i, chunk in enumerate(todo):
            _, exc = yield ("update_weights", (chunk,), {})
            if exc is not None:
                if not is_ambiguous(exc):
                    raise WeightPushFailed(engine, f"update_weights chunk {i}", exc) from exc
                if expected is None:
                    raise WeightPushAmbiguous(engine, i, exc, "no expected checksums to compare") from exc
                lost = (i, exc)
                break
        note = "; the engine had closed the session"
        finished = _answered_500("without a matching start")
        yield from _resent(engine, "finish", ("finish_weight_update", (version,), {}), settled, finished, note)
        if lost is None:
            return WeightPush(engine, version, len(todo), tuple(settled))
        assert expected is not None
        check = value_of((yield ("weight_checker", ("compare",), {"baseline": expected})))
        if check.match:
            settled.append(f"update_weights chunk {lost[0]}: /weight_checker matched")
            return WeightPush(engine, version, len(todo), tuple(settled))
        if session == sessions:
            detail = f"/weight_checker mismatches {list(check.mismatches)} after {sessions} session(s)"
            raise WeightPushAmbiguous(engine, lost[0], lost[1], detail) from lost[1]
        settled.append(f"update_weights chunk {lost[0]}: /weight_checker proved it missing; pushed again in a new session")
    raise AssertionError("unreachable")


def _resent(
    engine: str, name: str, step: Step, settled: list[str], proves_first: Callable[[BaseException], bool], note: str = ""
) -> Steps[Step, None]:
    """``step`` (``start`` or ``finish``), sent again after a lost answer (at most ``RESENDS`` times).

    A re-send that answers, or that fails in a way that ``proves_first`` the first one arrived, settles it
    (``settled`` says so, with ``note`` for the second case); a refusal raises ``WeightPushFailed``.
    """
    _, exc = yield step
    if exc is None:
        return
    if not is_ambiguous(exc):
        raise WeightPushFailed(engine, name, exc) from exc
    last: BaseException = exc
    for _ in range(RESENDS):
        _, again = yield step
        if again is None or proves_first(again):
            settled.append(f"{name}: sent again" + ("" if again is None else note))
            return
        if not is_ambiguous(again):
            raise WeightPushFailed(engine, f"{name} (sent again)", again) from again
        last = again
    raise WeightPushFailed(engine, f"{name} (sent {RESENDS + 1} times, every answer lost)", last) from last
