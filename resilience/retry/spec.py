"""What a driver tells the loop about one call and each attempt, and the rules decided from that alone.

The functions below decide from ``CallSpec`` and ``AttemptResult`` alone,
with no I/O, and are the only place their rules live: which timeout wins
(``attempt_timeouts``, ``deadline_times``) and what a result means (``classify``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from resilience.backoff import parse_retry_after
from resilience.deadline import CURRENT_DEADLINE
from resilience.outcome import Delivery, Outcome
from resilience.policy import EndpointMatch, EndpointPolicy

__all__ = [
    "RETRY_AFTER_STATUSES",
    "AttemptResult",
    "CallSpec",
    "Timeouts",
    "attempt_timeouts",
    "classify",
    "deadline_times",
    "is_success_status",
    "responded",
]

R = TypeVar("R")
Timeouts = tuple[float | None, float | None]
"""(connect, read) seconds; None = no limit."""
_SUCCESS = Outcome.SUCCESS
"""``Outcome.SUCCESS`` as a module global, for ``classify``'s every call: CPython 3.11 specializes a global's load, not a
class attribute's, which costs about 0.1 us in a real call (``benchmarks/NOTES.md``, "Core v3, sixth pass")."""
_outer_deadline = CURRENT_DEADLINE.get
"""The outer ``Deadline`` of the running context (None: none), ``ContextVar.get`` bound once: ``CURRENT_DEADLINE.get()``
looks the method up and binds it on every call (CPython 3.11 does not specialize that lookup)."""


@dataclass(slots=True)
class AttemptResult(Generic[R]):
    """What the transport saw on one attempt (the driver's report: built once, read by the core, never changed)."""

    response: R | None = None
    """The response object, when one came back."""
    status: int | None = None
    error: BaseException | None = None
    """The transport error, when no response came back."""
    delivery: Delivery = Delivery.RESPONDED
    error_kind: str | None = None
    """A bounded name for a transport error: ``connect_error``, ``connect_timeout``, ``read_timeout``, ``connection_reset``, ``error``."""
    retry_after: float | None = None
    """Seconds from a Retry-After header."""


@dataclass(slots=True)
class CallSpec:
    """One logical call as the loop needs to know it (the driver's word: built once per call, never changed)."""

    method: str
    url: object
    """The URL as the driver holds it (a ``str``, an ``httpx.URL``, a ``yarl.URL``): ``str()`` of it goes to probes only
    (built then, not on every call); never put in events."""
    match: EndpointMatch
    engine: str
    server_address: str
    server_port: int
    request_timeout: Timeouts | None = None
    """The caller's own (connect, read) timeout; ``(None, None)`` = no limit; None = the caller said nothing."""
    request: Any = None
    """Attached to raised errors as ``request=`` (requests convention)."""
    replayable: bool = True
    """False when the body cannot be sent twice (a pipe, a generator): exactly one attempt."""
    body: bytes | None = None
    """The request body, when the driver holds it as bytes; handed to probes (``ProbeContext.body``), never put in events.
    None = no body, or one the driver cannot read without consuming it."""


RETRY_AFTER_STATUSES = frozenset({429, 503})
"""The statuses whose ``Retry-After`` header the loop reads (RFC 9110: it means something on 503, and on 429 by RFC 6585)."""


def responded(response: R, status: int, headers: Mapping[str, str]) -> AttemptResult[R]:
    """What a driver reports for an attempt that got a response: ``status``, and the ``Retry-After`` header's seconds on 429/503.

    ``headers`` is the response's header mapping (requests, httpx and aiohttp all
    look names up case-insensitively); it is read only on those two statuses.
    """
    if status in RETRY_AFTER_STATUSES:
        return AttemptResult(response=response, status=status, retry_after=parse_retry_after(headers.get("Retry-After")))
    return AttemptResult(response, status)  # by position: a class called with keywords builds a dict of them (CPython 3.11)


def attempt_timeouts(spec: CallSpec, cap_s: float = math.inf) -> Timeouts:
    """The (connect, read) timeout of the next attempt, ``cap_s`` being what is left of a deadline that caps attempts.

    The matched table entry's ``attempt_timeout_s`` when the entry names it
    (``EndpointPolicy.named``: given in Python or a policy file, not left at
    its default); else the caller's own timeout (``CallSpec.request_timeout``;
    ``(None, None)`` = wait as long as it takes); else the policy's value (an
    entry's default, or the default policy's). None = no limit. So an entry
    that never named a timeout never overrules the caller.
    """
    match = spec.match
    own = match.own_timeout_s  # the entry's own word, derived once per route (``EndpointMatch.own_timeout_s``)
    if own is not None:
        connect: float | None = own
        read: float | None = own
    elif spec.request_timeout is not None:
        connect, read = spec.request_timeout
    else:
        connect = read = match.fallback_timeout_s
    if cap_s == math.inf:
        return connect, read
    return (cap_s if connect is None or cap_s < connect else connect), (cap_s if read is None or cap_s < read else read)


def deadline_times(spec: CallSpec, now: float) -> tuple[float, float | None]:
    """A call's deadlines as clock readings for a call starting at ``now``: ``(window_at, hard_at)``, ``inf`` = never.

    No retry starts past ``window_at``. The policy's ``deadline_s`` (or, when
    it is None, the sum of the caller's timeouts) also caps attempts when a
    table entry names it or when the caller gave no timeout of its own:
    ``hard_at`` is then None (the window is the hard deadline). A
    ``deadline_s`` nobody named under a caller's own timeout only bounds the
    retries (when it ends the caller gets what plain requests would have
    given): ``hard_at`` is then the outer ``Deadline`` (``inf`` without one),
    which is always hard. No ``Deadline`` object is built.
    """
    rt = spec.request_timeout
    seconds = spec.match.deadline_s
    if seconds is None and rt is not None:
        connect, read = rt
        if connect is not None or read is not None:
            seconds = (connect or 0.0) + (read or 0.0)
    own_at = math.inf if seconds is None else now + seconds
    outer = _outer_deadline()
    outer_at = math.inf
    if outer is not None and outer.bounded:
        outer_at = now + outer.remaining()  # on the outer deadline's own clock, as ``Deadline.cap`` reads it
        if outer_at < own_at:
            own_at = outer_at
    if rt is None or spec.match.own_deadline:
        return own_at, None
    return own_at, outer_at


def is_success_status(policy: EndpointPolicy, status: int) -> bool:
    """2xx, or a status the endpoint accepts (``EndpointPolicy.accept_statuses``): what ``classify`` calls a success."""
    return 200 <= status < 300 or status in policy.accept_statuses


def classify(
    policy: EndpointPolicy,
    *,
    status: int | None,
    delivery: Delivery,
    retry_after: float | None = None,
) -> Outcome:
    """Classify one attempt under ``policy``.

    - a 2xx or accepted status: SUCCESS;
    - a status in ``retry.statuses`` (or 429 with Retry-After, when
      ``retry.respect_retry_after``): RETRYABLE when the endpoint is
      idempotent or explicitly retries statuses when it is not
      (``retry_statuses_if_not_idempotent``); otherwise FATAL (the response is
      handed back as plain requests would);
    - any other status: FATAL;
    - no response and never sent: RETRYABLE when ``retry.retry_before_send``, else FATAL;
    - no response and delivery ambiguous: AMBIGUOUS (the loop decides by idempotency).
    """
    if status is not None:
        if 200 <= status < 300 or status in policy.accept_statuses:  # ``is_success_status``, inline: every call asks
            return _SUCCESS
        gateway = status in policy.retry.statuses or (status == 429 and retry_after is not None and policy.retry.respect_retry_after)
        if gateway and (policy.idempotent or policy.retry_statuses_if_not_idempotent):
            return Outcome.RETRYABLE
        return Outcome.FATAL
    if delivery is Delivery.NOT_SENT:
        return Outcome.RETRYABLE if policy.retry.retry_before_send else Outcome.FATAL
    return Outcome.AMBIGUOUS
