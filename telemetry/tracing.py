"""OpenTelemetry spans derived from resilience events: ``TracingObserver``.

One INTERNAL span per logical call, one CLIENT span per attempt (whose
``traceparent`` goes into the attempt's ``carrier``) and INTERNAL spans per
barrier transition and phase: the tree, every attribute and the coexistence
with ``opentelemetry-instrumentation-requests`` are in ``telemetry/METRICS.md``
("Traces"). It needs only ``opentelemetry-api``. A call whose span has no valid
context (no SDK, a provider that makes nothing) keeps no span tree: its
attempts inject only the caller's baggage, if any. Spans get explicit parents
and are never attached to the current context; the state of a call or a
transition is dropped at its end.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, MutableMapping
from functools import lru_cache
from types import MappingProxyType
from typing import Any, Final

from opentelemetry import baggage, trace
from opentelemetry.context import _SUPPRESS_INSTRUMENTATION_KEY, get_current, get_value
from opentelemetry.propagate import get_global_textmap
from opentelemetry.propagators.textmap import TextMapPropagator
from opentelemetry.trace import NoOpTracer, Span, SpanKind, Status, StatusCode, TracerProvider
from opentelemetry.util.types import AttributeValue

from resilience import __version__
from resilience.barrier.state import PhaseEnded, PhaseStarted, TransitionEnded, TransitionStarted
from resilience.events import (
    AttemptEnded,
    AttemptStarted,
    BreakerRejected,
    CallEnded,
    CallStarted,
    ProbeCompleted,
    RetryBudgetExhaustedEvent,
    RetryScheduled,
)
from resilience.outcome import CallOutcome, Outcome

from ._dispatch import Dispatcher
from ._labels import HTTP_METHODS, scrub_engine, scrub_message, url_template

__all__ = ["TracingObserver"]

log = logging.getLogger("resilience.telemetry")

INSTRUMENTATION_NAME: Final = "resilience.telemetry"

_CACHE_MAX: Final = 4096
"""Static span names and attributes cached (least recently used dropped first): distinct endpoints x engines or servers."""

_OK_CALL_OUTCOMES: Final = frozenset({CallOutcome.SUCCESS, CallOutcome.RETRIED_SUCCESS})


class _Call:
    """What one in-flight logical call keeps: its span, its context, its open attempt."""

    __slots__ = ("attempt", "ctx", "span")

    def __init__(self, span: Span) -> None:
        self.span = span
        self.ctx = trace.set_span_in_context(span)
        self.attempt: Span | None = None


class _Transition:
    """What one in-flight barrier transition keeps: its span, its context, its open phases."""

    __slots__ = ("ctx", "phases", "span")

    def __init__(self, span: Span) -> None:
        self.span = span
        self.ctx = trace.set_span_in_context(span)
        self.phases: dict[str, Span] = {}


def _http(method: str, endpoint: str) -> tuple[str, dict[str, AttributeValue]]:
    """An attempt span's name (``HTTP`` for an unknown method) and its method and ``url.template`` attributes."""
    attrs: dict[str, AttributeValue] = {"http.request.method": method}
    name = method
    if method not in HTTP_METHODS:
        name = "HTTP"
        attrs["http.request.method"] = "_OTHER"
        attrs["http.request.method_original"] = method
    template = url_template(endpoint)
    if template is not None:
        attrs["url.template"] = template
        name = f"{name} {template}"
    return name, attrs


@lru_cache(maxsize=_CACHE_MAX)
def _call_static(method: str, endpoint: str, engine: str) -> tuple[str, Mapping[str, AttributeValue]]:
    """Name and start attributes of a logical call's span."""
    attrs = _http(method, endpoint)[1]
    attrs["resilience.endpoint"] = endpoint
    attrs["resilience.engine"] = scrub_engine(engine)
    return f"resilient {endpoint}", MappingProxyType(attrs)


@lru_cache(maxsize=_CACHE_MAX)
def _attempt_static(method: str, endpoint: str, address: str, port: int) -> tuple[str, Mapping[str, AttributeValue]]:
    """Name and start attributes of a first attempt's span."""
    name, attrs = _http(method, endpoint)
    attrs["server.address"] = address
    attrs["server.port"] = port
    return name, MappingProxyType(attrs)


def _barrier_attrs(ev: TransitionStarted | PhaseStarted) -> dict[str, AttributeValue]:
    """Start attributes of a transition's or a phase's span."""
    attrs: dict[str, AttributeValue] = {"resilience.transition": ev.transition}
    if isinstance(ev, PhaseStarted):
        attrs["resilience.phase"] = ev.phase
    attrs["resilience.engines"] = [scrub_engine(e) for e in ev.engines]
    if ev.deadline_s is not None:
        attrs["resilience.deadline_s"] = ev.deadline_s
    return attrs


class TracingObserver(Dispatcher):
    """A ``CallObserver`` that records every call's moments and the barrier's events as OpenTelemetry spans.

    ``tracer_provider``: the provider spans come from. Default None: the global
    provider (``opentelemetry.trace.set_tracer_provider``), looked up lazily,
    so an SDK configured after this observer is built is still used; with no
    SDK at all, spans are no-ops.

    ``propagator``: the propagator that writes the attempt span's context into
    each attempt's outgoing headers. Default None: the global one
    (``opentelemetry.propagate``; W3C ``traceparent`` + baggage unless
    ``OTEL_PROPAGATORS`` says otherwise), looked up on each attempt.

    Attach it like any observer: ``resilient_session(policies, observers=[TracingObserver()])``.
    """

    def __init__(
        self,
        tracer_provider: TracerProvider | None = None,
        *,
        propagator: TextMapPropagator | None = None,
    ) -> None:
        self._tracer = trace.get_tracer(INSTRUMENTATION_NAME, __version__, tracer_provider=tracer_provider)
        self._noop = type(self._tracer) is NoOpTracer
        """The provider makes no spans, ever (the API's ``NoOpTracerProvider``): a call keeps no state at all, and its
        attempts inject only the caller's baggage. A global provider is looked up per call, so an SDK set later counts."""
        self._propagator = propagator
        self._lock = threading.Lock()
        self._calls: dict[int, _Call] = {}
        self._untraced: set[int] = set()
        """Calls whose span came back invalid (no SDK, or a provider that makes nothing): no span tree is kept for them."""
        self._transitions: dict[int, _Transition] = {}
        self._handlers: dict[type[Any], Callable[[Any], None]] = {
            CallStarted: self.replay,
            AttemptStarted: self.replay,
            AttemptEnded: self.replay,
            RetryScheduled: self._retry_scheduled,
            BreakerRejected: self._breaker_rejected,
            RetryBudgetExhaustedEvent: self._budget_exhausted,
            ProbeCompleted: self._probe_completed,
            CallEnded: self.replay,
            TransitionStarted: self._transition_started,
            PhaseStarted: self._phase_started,
            PhaseEnded: self._phase_ended,
            TransitionEnded: self._transition_ended,
        }

    @property
    def in_flight(self) -> int:
        """Calls (traced or not) plus transitions still open (0 once every call and transition ended)."""
        with self._lock:
            return len(self._calls) + len(self._untraced) + len(self._transitions)

    # -- logical calls -----------------------------------------------------------

    def hears(self, moment: str) -> bool:
        """Every moment; on a provider that makes no spans, ``attempt_started`` (the caller's baggage) and what a subclass overrides."""
        return not self._noop or moment == "attempt_started" or getattr(type(self), moment) is not getattr(TracingObserver, moment)

    def call_started(self, call_id: int, method: str, endpoint: str, engine: str, deadline_s: float | None) -> None:
        """The call's INTERNAL span, unless instrumentation is suppressed or the span is not valid (then no tree is kept)."""
        if self._noop:
            return
        try:
            if get_value(_SUPPRESS_INSTRUMENTATION_KEY):
                return
            name, attrs = _call_static(method, endpoint, engine)
            if deadline_s is not None:
                attrs = {**attrs, "resilience.deadline_s": deadline_s}
            span = self._tracer.start_span(name, kind=SpanKind.INTERNAL, attributes=attrs)
            if not span.get_span_context().is_valid:  # nothing records, and no trace id to propagate: skip the call's tree
                self._untraced.add(call_id)
                return
            call = _Call(span)
            with self._lock:
                stale = self._calls.pop(call_id, None)
                self._calls[call_id] = call
            if stale is not None:  # a call id reused before its CallEnded: close the orphan
                self._close_call(stale, Status(StatusCode.ERROR, "call ended without CallEnded"))
        except Exception:
            log.warning("TracingObserver failed on CallStarted", exc_info=True)

    def attempt_started(
        self,
        call_id: int,
        attempt: int,
        method: str,
        endpoint: str,
        engine: str,
        server_address: str,
        server_port: int,
        timeout_s: float | None,
        carrier: MutableMapping[str, str],
    ) -> None:
        """The attempt's CLIENT span under the call's, its context injected into ``carrier``; untraced: the baggage only."""
        try:
            call = None if self._noop else self._calls.get(call_id)
            if call is None:
                if self._noop or call_id in self._untraced:  # no span: the caller's baggage still travels
                    context = get_current()
                    if context and baggage.get_all(context):  # an empty context (the common case) holds none: not asked
                        (self._propagator or get_global_textmap()).inject(carrier)
                return
            if call.attempt is not None:  # the previous attempt never ended: close it
                call.attempt.end()
            name, attrs = _attempt_static(method, endpoint, server_address, server_port)
            if attempt:
                attrs = {**attrs, "http.request.resend_count": attempt}
            span = self._tracer.start_span(name, context=call.ctx, kind=SpanKind.CLIENT, attributes=attrs)
            call.attempt = span
            (self._propagator or get_global_textmap()).inject(carrier, context=trace.set_span_in_context(span))
        except Exception:
            log.warning("TracingObserver failed on AttemptStarted", exc_info=True)

    def attempt_ended(
        self,
        call_id: int,
        attempt: int,
        method: str,
        endpoint: str,
        engine: str,
        status: int | None,
        outcome: Outcome,
        error_type: str | None,
        sent: bool,
        duration_s: float,
    ) -> None:
        """End the attempt's span: its status, and on a failure its outcome and error type."""
        if self._noop:
            return
        try:
            call = self._calls.get(call_id)
            if call is None or call.attempt is None:
                return
            span, call.attempt = call.attempt, None
            if status is not None and status < 400 and outcome is Outcome.SUCCESS:
                span.set_attribute("http.response.status_code", status)
                span.end()
                return
            attrs: dict[str, AttributeValue] = {"resilience.attempt_outcome": outcome.value}
            if status is not None:
                attrs["http.response.status_code"] = status
            attrs["error.type"] = error_type or (str(status) if status is not None else "_OTHER")
            span.set_attributes(attrs)
            if status is None or status >= 400:
                span.set_status(Status(StatusCode.ERROR))
            span.end()
        except Exception:
            log.warning("TracingObserver failed on AttemptEnded", exc_info=True)

    def _call_event(self, call_id: int, name: str, attrs: dict[str, AttributeValue]) -> None:
        call = self._calls.get(call_id)
        if call is not None:
            call.span.add_event(name, attrs)

    def _retry_scheduled(self, ev: RetryScheduled) -> None:
        attrs: dict[str, AttributeValue] = {
            "resilience.retry.reason": ev.reason,
            "resilience.backoff.delay_s": ev.delay_s,
            "resilience.failed_attempt": ev.attempt,
        }
        self._call_event(ev.call_id, "resilience.backoff", attrs)

    def _breaker_rejected(self, ev: BreakerRejected) -> None:
        self._call_event(ev.call_id, "resilience.breaker_rejected", {"resilience.engine": scrub_engine(ev.engine)})

    def _budget_exhausted(self, ev: RetryBudgetExhaustedEvent) -> None:
        attrs: dict[str, AttributeValue] = {"resilience.engine": scrub_engine(ev.engine), "resilience.retry_budget.tokens": ev.tokens}
        self._call_event(ev.call_id, "resilience.retry_budget_exhausted", attrs)

    def _probe_completed(self, ev: ProbeCompleted) -> None:
        self._call_event(ev.call_id, "resilience.probe_completed", {"resilience.probe.answer": ev.answer})

    def call_ended(
        self,
        call_id: int,
        method: str,
        endpoint: str,
        engine: str,
        outcome: CallOutcome,
        status: int | None,
        attempts: int,
        duration_s: float,
        error_type: str | None,
        retry_budget_tokens: float | None,
    ) -> None:
        """End the call's span with its outcome; the call's state is dropped."""
        if self._noop:
            return
        try:
            if call_id in self._untraced:
                self._untraced.discard(call_id)
                return
            with self._lock:
                call = self._calls.pop(call_id, None)
            if call is None:
                return
            attrs: dict[str, AttributeValue] = {"resilience.outcome": outcome.value, "resilience.attempts": attempts}
            if status is not None:
                attrs["http.response.status_code"] = status
            failed = outcome not in _OK_CALL_OUTCOMES
            if failed:
                attrs["error.type"] = error_type or outcome.value
            call.span.set_attributes(attrs)
            self._close_call(call, Status(StatusCode.ERROR, outcome.value) if failed else None)
        except Exception:
            log.warning("TracingObserver failed on CallEnded", exc_info=True)

    def _close_call(self, call: _Call, error: Status | None) -> None:
        """End the attempt still open (an error), then the call's span, with ``error`` as its status if any."""
        if call.attempt is not None:
            call.attempt.set_status(Status(StatusCode.ERROR, "attempt still open when the call ended"))
            call.attempt.end()
        if error is not None:
            call.span.set_status(error)
        call.span.end()

    # -- barrier transitions -----------------------------------------------------

    def _transition_started(self, ev: TransitionStarted) -> None:
        if get_value(_SUPPRESS_INSTRUMENTATION_KEY):
            return
        span = self._tracer.start_span(f"barrier {ev.transition}", kind=SpanKind.INTERNAL, attributes=_barrier_attrs(ev))
        tr = _Transition(span)
        with self._lock:
            stale = self._transitions.pop(ev.transition_id, None)
            self._transitions[ev.transition_id] = tr
        if stale is not None:
            self._close_transition(stale, Status(StatusCode.ERROR, "transition ended without TransitionEnded"))

    def _phase_started(self, ev: PhaseStarted) -> None:
        tr = self._transitions.get(ev.transition_id)
        if tr is None:
            return
        attrs = _barrier_attrs(ev)
        span = self._tracer.start_span(f"barrier {ev.transition} {ev.phase}", context=tr.ctx, kind=SpanKind.INTERNAL, attributes=attrs)
        with self._lock:
            previous = tr.phases.pop(ev.phase, None)
            tr.phases[ev.phase] = span
        if previous is not None:
            previous.end()

    def _phase_ended(self, ev: PhaseEnded) -> None:
        tr = self._transitions.get(ev.transition_id)
        if tr is None:
            return
        with self._lock:
            span = tr.phases.pop(ev.phase, None)
        if span is None:
            return
        span.set_attribute("resilience.phase.ok", ev.ok)
        if ev.failures:
            span.set_attribute("resilience.failed_engines", [scrub_engine(f.engine) for f in ev.failures])
            for failure in ev.failures:
                span.add_event(
                    "exception",
                    {
                        "exception.type": failure.error_type,
                        "exception.message": scrub_message(failure.message),
                        "resilience.engine": scrub_engine(failure.engine),
                    },
                )
            span.set_status(Status(StatusCode.ERROR, f"{len(ev.failures)} of {len(ev.engines)} engines failed"))
        span.end()

    def _transition_ended(self, ev: TransitionEnded) -> None:
        with self._lock:
            tr = self._transitions.pop(ev.transition_id, None)
        if tr is None:
            return
        tr.span.set_attribute("resilience.ok", ev.ok)
        if ev.failed_phase is not None:
            tr.span.set_attribute("resilience.failed_phase", ev.failed_phase)
        for key, engines in (("resilience.rolled_back", ev.rolled_back), ("resilience.left_paused", ev.left_paused)):
            if engines:
                tr.span.set_attribute(key, [scrub_engine(e) for e in engines])
        self._close_transition(tr, None if ev.ok else Status(StatusCode.ERROR, f"failed in phase {ev.failed_phase or 'unknown'}"))

    def _close_transition(self, tr: _Transition, error: Status | None) -> None:
        """End the phases still open (errors), then the transition's span, with ``error`` as its status if any."""
        with self._lock:
            phases, tr.phases = list(tr.phases.values()), {}
        for phase in phases:
            phase.set_status(Status(StatusCode.ERROR, "phase still open when the transition ended"))
            phase.end()
        if error is not None:
            tr.span.set_status(error)
        tr.span.end()
