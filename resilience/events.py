"""Typed events, and the one observer interface (``CallObserver``) that hears them.

Every decision the retry loop, the breaker, the budgets and the barrier
orchestrator take is announced to the observers: the four moments of every
call as plain values (``CallObserver``), every other moment as one frozen
event. Telemetry (spans, metrics, logs) is derived from these moments only;
it is never sprinkled through the retry loop. With no observer attached,
announcing costs a tuple check.

Events never carry credentials: they name an endpoint by its policy
template (``POST /pause_generation``) and an engine by ``scheme://host:port``,
never by a raw URL, header or body.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, MutableMapping
from dataclasses import dataclass, field, fields
from typing import Protocol

from resilience.outcome import CallOutcome, Outcome

__all__ = [
    "AttemptEnded",
    "AttemptStarted",
    "BreakerRejected",
    "BreakerTransitioned",
    "CallEnded",
    "CallObserver",
    "CallStarted",
    "EngineRefused",
    "Event",
    "Observer",
    "ProbeCompleted",
    "RetryBudgetExhaustedEvent",
    "RetryScheduled",
    "call_observer",
    "emit",
    "hearing",
]

log = logging.getLogger("resilience.events")


@dataclass(frozen=True, slots=True, kw_only=True)
class Event:
    """The base of every event: a frozen dataclass named for its moment, in the past tense.

    The retry core's and the breaker's events are here; the barrier's own (its transitions
    and phases, ``resilience.barrier.state``; the restart budget's, ``resilience.barrier.journal``)
    are defined beside what emits them, and the two a router reads (an engine's state, its
    holds) in ``resilience.engine_contract``, beside ``EngineState``.
    """


@dataclass(frozen=True, slots=True, kw_only=True)
class CallStarted(Event):
    """A logical call (one ``Session.send`` / one client method) began."""

    call_id: int
    method: str
    endpoint: str
    """The matched policy template, e.g. ``POST /pause_generation``: bounded."""
    engine: str
    """``scheme://host:port`` of the target: the breaker and budget key."""
    deadline_s: float | None
    """Seconds the whole call may take, or None when unbounded."""


@dataclass(frozen=True, slots=True, kw_only=True)
class AttemptStarted(Event):
    """One attempt is about to be sent.

    ``carrier`` is the outgoing request's header mapping: an observer may add
    propagation headers to it (``traceparent``); the transport sends them with
    this attempt. Observers must not read credentials from it.
    """

    call_id: int
    attempt: int
    """0 for the first attempt, then the resend count (1, 2, ...)."""
    method: str
    endpoint: str
    engine: str
    server_address: str
    server_port: int
    timeout_s: float | None
    carrier: MutableMapping[str, str] = field(default_factory=dict, compare=False, repr=False)


@dataclass(frozen=True, slots=True, kw_only=True)
class AttemptEnded(Event):
    """One attempt finished, with its classification."""

    call_id: int
    attempt: int
    method: str
    endpoint: str
    engine: str
    status: int | None
    """The HTTP status, or None when no response arrived."""
    outcome: Outcome
    error_type: str | None
    """``type(exc).__qualname__`` of a transport error, or the status as a string on failure."""
    sent: bool
    """False only when the request surely never reached the server."""
    duration_s: float


@dataclass(frozen=True, slots=True, kw_only=True)
class _OfCall(Event):
    """What every other event of one call names: the call, its endpoint and its engine (as ``CallStarted`` names them)."""

    call_id: int
    endpoint: str
    engine: str


@dataclass(frozen=True, slots=True, kw_only=True)
class RetryScheduled(_OfCall):
    """The loop will retry after ``delay_s`` seconds."""

    attempt: int
    """The attempt that failed (0-based)."""
    reason: str
    """Bounded: ``status_502``, ``connect_error``, ``read_timeout``, ``connection_reset``, ``probe_not_done``."""
    delay_s: float


@dataclass(frozen=True, slots=True, kw_only=True)
class CallEnded(Event):
    """A logical call finished."""

    call_id: int
    method: str
    endpoint: str
    engine: str
    outcome: CallOutcome
    status: int | None
    attempts: int
    duration_s: float
    error_type: str | None
    retry_budget_tokens: float | None
    """The engine's retry-budget balance after the call, when a budget is in use."""


@dataclass(frozen=True, slots=True, kw_only=True)
class BreakerTransitioned(Event):
    """An engine's circuit breaker changed state (closed/open/half_open)."""

    engine: str
    from_state: str
    to_state: str
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class BreakerRejected(_OfCall):
    """A call failed fast because the engine's breaker is open."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RetryBudgetExhaustedEvent(_OfCall):
    """A retry was refused because the engine's retry budget is spent."""

    tokens: float


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineRefused(_OfCall):
    """A call's first attempt that failed before sending (connection refused, DNS, connect timeout), announced once per call.

    Emitted when the call will keep trying; the same moment is logged once at
    WARNING on ``resilience.retry``.
    """

    error_type: str
    """``type(exc).__qualname__`` of the transport's error."""
    retry_for_s: float | None
    """The longest the call keeps trying: what is left of ``RetryPolicy.connect_window_s`` or the deadline, the sooner; None = unbounded."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ProbeCompleted(_OfCall):
    """An ambiguous attempt was resolved by the endpoint's probe."""

    answer: str
    """``done``, ``not_done`` or ``unknown``."""


class Observer(Protocol):
    """Anything called with each event (``observer(event)``): a ``CallObserver``, or a plain callable such as ``list.append``.

    An observer that raises is logged, never propagated.
    """

    def __call__(self, event: Event) -> None: ...


class CallObserver:
    """The observer interface: every call's four moments as plain values, every other moment as an event.

    Subclass it and override what you need; each method must return quickly
    and never block. The four per-call methods are called in this order for
    each logical call (``call_id`` ties them together): ``call_started``
    once, then per attempt ``attempt_started`` and ``attempt_ended``, then
    ``call_ended`` once. Their arguments are the fields of ``CallStarted``,
    ``AttemptStarted``, ``AttemptEnded`` and ``CallEnded``, in the same order
    (see each for its meaning), and the default of each builds that event and
    hands it to ``self(event)``: an observer that overrides ``__call__`` alone
    hears every moment as an event. ``__call__`` receives every other event
    (retries, refusals, probes, breakers, budgets, barrier transitions) and
    any per-call event another producer emits as an object.
    """

    __slots__ = ()

    def hears(self, moment: str) -> bool:
        """Whether the per-call method named ``moment`` does anything (default True); asked once, when a ``Retrier`` is built.

        An observer whose method for a moment does nothing answers False, and
        the core does not call it then (nor works out that moment's values
        when no observer hears it).
        """
        return True

    def __call__(self, event: Event) -> None:
        """Every moment not announced through the per-call methods; default: ignore it."""

    def call_started(self, call_id: int, method: str, endpoint: str, engine: str, deadline_s: float | None) -> None:
        """A logical call began (``CallStarted``)."""
        self(CallStarted(call_id=call_id, method=method, endpoint=endpoint, engine=engine, deadline_s=deadline_s))

    def attempt_started(  # the fields of AttemptStarted, in order
        self, call_id: int, attempt: int, method: str, endpoint: str, engine: str,
        server_address: str, server_port: int, timeout_s: float | None, carrier: MutableMapping[str, str],
    ) -> None:  # fmt: skip
        """An attempt is about to be sent (``AttemptStarted``); headers added to ``carrier`` go with it."""
        self(AttemptStarted(
            call_id=call_id, attempt=attempt, method=method, endpoint=endpoint, engine=engine,
            server_address=server_address, server_port=server_port, timeout_s=timeout_s, carrier=carrier,
        ))  # fmt: skip

    def attempt_ended(  # the fields of AttemptEnded, in order
        self, call_id: int, attempt: int, method: str, endpoint: str, engine: str,
        status: int | None, outcome: Outcome, error_type: str | None, sent: bool, duration_s: float,
    ) -> None:  # fmt: skip
        """An attempt finished, with its classification (``AttemptEnded``)."""
        self(AttemptEnded(
            call_id=call_id, attempt=attempt, method=method, endpoint=endpoint, engine=engine,
            status=status, outcome=outcome, error_type=error_type, sent=sent, duration_s=duration_s,
        ))  # fmt: skip

    def call_ended(  # the fields of CallEnded, in order
        self, call_id: int, method: str, endpoint: str, engine: str, outcome: CallOutcome, status: int | None,
        attempts: int, duration_s: float, error_type: str | None, retry_budget_tokens: float | None,
    ) -> None:  # fmt: skip
        """A logical call finished (``CallEnded``)."""
        self(CallEnded(
            call_id=call_id, method=method, endpoint=endpoint, engine=engine, outcome=outcome, status=status,
            attempts=attempts, duration_s=duration_s, error_type=error_type, retry_budget_tokens=retry_budget_tokens,
        ))  # fmt: skip

    def replay(self, event: Event) -> None:
        """Hand ``event`` to the method of its moment (a per-call event to its per-call method), else to ``self(event)``.

        For an observer that overrides the per-call methods and still receives
        per-call events as objects from other producers (its ``__call__``
        passes them here).
        """
        moment = _MOMENTS.get(type(event))
        if moment is None:
            self(event)
        else:  # the event's fields are the method's arguments, in order
            getattr(self, moment)(*(getattr(event, f.name) for f in fields(event)))


_MOMENTS: dict[type[Event], str] = {
    CallStarted: "call_started", AttemptStarted: "attempt_started", AttemptEnded: "attempt_ended", CallEnded: "call_ended"
}


class _Events(CallObserver):
    """A plain callable as a ``CallObserver``: every moment reaches it as an event."""

    __slots__ = ("_fn",)

    def __init__(self, fn: Callable[[Event], None]) -> None:
        self._fn = fn

    def __call__(self, event: Event) -> None:
        self._fn(event)

    def __repr__(self) -> str:
        return f"call_observer({self._fn!r})"


def hearing(observers: tuple[CallObserver, ...]) -> tuple[tuple[CallObserver, ...], ...]:
    """For ``call_started``, ``attempt_started``, ``attempt_ended`` and ``call_ended`` (``_MOMENTS``' order): the observers that hear it."""
    return tuple(tuple(o for o in observers if o.hears(moment)) for moment in _MOMENTS.values())


def call_observer(observer: Observer) -> CallObserver:
    """``observer`` itself when it is a ``CallObserver``; else a ``CallObserver`` that hands it every moment as an event."""
    return observer if isinstance(observer, CallObserver) else _Events(observer)


def emit(observers: Iterable[Observer], event: Event) -> None:
    """Deliver ``event`` to each observer; log (never raise) an observer's failure."""
    for observer in observers:
        try:
            observer(event)
        except Exception:  # an observer must never break a control call
            log.exception("observer %r failed on %s", observer, type(event).__name__)
