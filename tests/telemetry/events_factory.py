"""Event factories for the telemetry tests: every field has a dull default, so a test names only the fields it cares about.

Each factory returns a copy of one default event with the given fields replaced. The defaults describe one successful
first attempt of ``GET /x`` on ``ENGINE``; the ``...Fields`` typed dicts keep the keyword arguments checked.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from dataclasses import replace
from typing import TypedDict, Unpack

from resilience.events import AttemptEnded, AttemptStarted, CallEnded
from resilience.outcome import CallOutcome, Outcome

ENGINE = "http://127.0.0.1:30000"
"""The default engine of every factory (``scheme://host:port``)."""


class CallFields(TypedDict, total=False):
    """The fields every call-level event has."""

    call_id: int
    method: str
    endpoint: str
    engine: str


class AttemptStartedFields(CallFields, total=False):
    attempt: int
    server_address: str
    server_port: int
    timeout_s: float | None
    carrier: MutableMapping[str, str]


class AttemptEndedFields(CallFields, total=False):
    attempt: int
    status: int | None
    outcome: Outcome
    error_type: str | None
    sent: bool
    duration_s: float


class CallEndedFields(CallFields, total=False):
    outcome: CallOutcome
    status: int | None
    attempts: int
    duration_s: float
    error_type: str | None
    retry_budget_tokens: float | None


_GET_X = CallFields(call_id=1, method="GET", endpoint="GET /x", engine=ENGINE)

_ATTEMPT_STARTED = AttemptStarted(**_GET_X, attempt=0, server_address="127.0.0.1", server_port=30000, timeout_s=None)
_ATTEMPT_ENDED = AttemptEnded(**_GET_X, attempt=0, status=200, outcome=Outcome.SUCCESS, error_type=None, sent=True, duration_s=0.001)
_CALL_ENDED = CallEnded(
    **_GET_X, outcome=CallOutcome.SUCCESS, status=200, attempts=1, duration_s=0.0, error_type=None, retry_budget_tokens=None
)


def attempt_started(**fields: Unpack[AttemptStartedFields]) -> AttemptStarted:
    """An ``AttemptStarted`` of the first attempt, 127.0.0.1:30000, no timeout; ``carrier`` is a fresh empty dict unless given."""
    fields.setdefault("carrier", {})
    return replace(_ATTEMPT_STARTED, **fields)


def attempt_ended(**fields: Unpack[AttemptEndedFields]) -> AttemptEnded:
    """An ``AttemptEnded``: by default the first attempt, sent and answered 200 (success) in 1 ms."""
    return replace(_ATTEMPT_ENDED, **fields)


def call_ended(**fields: Unpack[CallEndedFields]) -> CallEnded:
    """A ``CallEnded``: by default a call that succeeded on its one attempt, with no retry budget in use."""
    return replace(_CALL_ENDED, **fields)
