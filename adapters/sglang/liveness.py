"""Is an engine behind a proxy dead? The check both SGLang clients run after a control call met only gateway statuses.

No I/O here: a client sends ``GET /model_info`` itself (``SGLangClientState._alive_steps``)
and these functions decide when to ask and what the answer means.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from resilience.adapters.sglang.calls import Call
from resilience.adapters.sglang.policies import SGLANG_ADMIN_PATHS
from resilience.adapters.sglang.results import SGLangError
from resilience.deadline import CURRENT_DEADLINE, Deadline
from resilience.engine_contract import GATEWAY_STATUSES, EngineDied
from resilience.errors import CircuitOpen, ResilienceError
from resilience.outcome import AttemptRecord, attempts_of
from resilience.policy import PolicyTable

__all__ = ["call_deadline", "engine_died", "gateway_error_records", "liveness_verdict", "needs_liveness_check"]


def call_deadline(policies: PolicyTable, call: Call, started_at: float) -> Deadline:
    """The deadline ``call`` runs under: its policy's ``deadline_s`` from its start, capped by any ``Deadline`` in context.

    ``started_at``: the ``time.monotonic()`` reading when the call started. A client reads the clock when it sends and
    builds this only when it needs it, after a gateway status (a success never looks the policy up for it).
    """
    seconds = policies.match(call.method, call.path).policy.deadline_s
    if seconds is not None:
        seconds = max(0.0, seconds - (time.monotonic() - started_at))
    outer = CURRENT_DEADLINE.get()
    return outer.cap(seconds) if outer is not None else Deadline(seconds)


def needs_liveness_check(call: Call, status: int | None, records: Sequence[AttemptRecord]) -> bool:
    """A control call whose every attempt got a gateway status: the front end may stand in front of a dead engine.

    ``status``: the answer's status (None when the call raised); ``records``: its attempts. A call that
    raised needs a record of them; an answer without one (no resilience layer) counts as its one attempt.
    """
    if call.path not in SGLANG_ADMIN_PATHS or (status is not None and status not in GATEWAY_STATUSES):
        return False
    if status is None and not records:
        return False
    return all(r.status in GATEWAY_STATUSES for r in records)


def gateway_error_records(error: BaseException) -> tuple[AttemptRecord, ...]:
    """The attempts on an error the retry loop raised (deadline, budget, retries exhausted); () for any other error."""
    return (attempts_of(error) or ()) if isinstance(error, ResilienceError) else ()


def liveness_verdict(check_error: BaseException | None) -> bool | None:
    """What ``GET /model_info`` says of the engine: True = it answers, False = dead, None = not checked.

    SGLang's HTTP process answers ``/model_info`` from the tokenizer manager's own fields without asking the scheduler
    (0.5.23 ``sglang/srt/entrypoints/http_server.py``, ``model_info()``), which is why the router recipe checks a held
    engine with it. Any answer other than a gateway status (200, or even a 401/404/500) means something behind the front
    end answers: alive. A gateway status, a transport error or the deadline running out means nothing does: dead. An
    open circuit breaker sent nothing: not checked.
    """
    if check_error is None:
        return True
    if isinstance(check_error, CircuitOpen):
        return None
    if isinstance(check_error, SGLangError):
        return check_error.status not in GATEWAY_STATUSES
    return False


def engine_died(
    engine: str, endpoint: str, records: Sequence[AttemptRecord], original: BaseException, check_error: BaseException
) -> EngineDied:
    """The ``EngineDied`` for a control call answered only by gateway statuses whose ``/model_info`` check failed too.

    ``.attempts`` is the call's record; its cause is ``original``, the error the call would have raised.
    """
    statuses = ", ".join(str(r.status) for r in records) or str(getattr(original, "status", "?"))
    died = EngineDied(
        f"{engine}: every attempt of {endpoint} got a gateway status ({statuses}) and GET /model_info failed too "
        f"({type(check_error).__name__}): nothing behind the front end answers, the engine is gone"
    )
    died.attempts = tuple(records)  # type: ignore[attr-defined]
    died.__cause__ = original
    died.__suppress_context__ = True
    return died
