"""TracingObserver driven by hand-built events: span shapes, attributes, state hygiene."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, MutableMapping

import pytest
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from resilience.barrier.state import PhaseEnded, PhaseFailure, PhaseStarted, TransitionEnded, TransitionStarted
from resilience.events import (
    AttemptStarted,
    BreakerRejected,
    CallStarted,
    Event,
    ProbeCompleted,
    RetryBudgetExhaustedEvent,
    RetryScheduled,
)
from resilience.outcome import CallOutcome, Outcome
from resilience.telemetry.tracing import TracingObserver
from tests.telemetry.events_factory import ENGINE, attempt_ended, attempt_started, call_ended

ENDPOINT = "POST /flush_cache"


def call_events(
    call_id: int, statuses: list[int | None], *, endpoint: str = ENDPOINT, method: str = "POST"
) -> Iterator[tuple[Event, dict[str, str]]]:
    """The events of one call whose attempts answer ``statuses`` (None = read timeout), with each attempt's carrier."""
    yield CallStarted(call_id=call_id, method=method, endpoint=endpoint, engine=ENGINE, deadline_s=30.0), {}
    for n, status in enumerate(statuses):
        carrier: dict[str, str] = {}
        started = attempt_started(
            call_id=call_id, attempt=n, method=method, endpoint=endpoint, server_address="127.0.0.1", server_port=30000, carrier=carrier
        )
        yield started, carrier
        ok = status is not None and status < 400
        outcome = Outcome.SUCCESS if ok else Outcome.RETRYABLE if status is not None else Outcome.AMBIGUOUS
        error_type = None if ok else ("ReadTimeout" if status is None else str(status))
        yield (
            attempt_ended(
                call_id=call_id, attempt=n, method=method, endpoint=endpoint, status=status, outcome=outcome, error_type=error_type
            ),
            {},
        )
        if not ok and n + 1 < len(statuses):
            reason = "read_timeout" if status is None else f"status_{status}"
            yield RetryScheduled(call_id=call_id, attempt=n, endpoint=endpoint, engine=ENGINE, reason=reason, delay_s=0.005), {}
    last = statuses[-1]
    success = last is not None and last < 400
    ended = (CallOutcome.RETRIED_SUCCESS if len(statuses) > 1 else CallOutcome.SUCCESS) if success else CallOutcome.FAILED
    error_type = None if success else "502"
    yield (
        call_ended(
            call_id=call_id, method=method, endpoint=endpoint, outcome=ended, status=last, attempts=len(statuses), error_type=error_type
        ),
        {},
    )


def run_call(obs: TracingObserver, call_id: int, statuses: list[int | None], **kw: str) -> list[dict[str, str]]:
    """Feed one call's events to ``obs``; return the carriers of its attempts."""
    carriers = []
    for event, carrier in call_events(call_id, statuses, **kw):
        obs(event)
        if isinstance(event, AttemptStarted):
            carriers.append(carrier)
    return carriers


def by_kind(spans: tuple[ReadableSpan, ...], kind: SpanKind) -> list[ReadableSpan]:
    """The spans of one kind, in start order."""
    return sorted((s for s in spans if s.kind is kind), key=lambda s: s.start_time or 0)


def test_one_logical_span_and_one_client_span_per_attempt(provider: TracerProvider, exporter: InMemorySpanExporter) -> None:
    """502, 502, 200 gives one INTERNAL call span and three CLIENT attempt spans under it."""
    obs = TracingObserver(provider)
    run_call(obs, 1, [502, 502, 200])
    spans = exporter.get_finished_spans()
    [call] = by_kind(spans, SpanKind.INTERNAL)
    attempts = by_kind(spans, SpanKind.CLIENT)
    assert len(attempts) == 3
    assert call.name == "resilient POST /flush_cache"
    assert all(a.parent is not None and a.parent.span_id == call.context.span_id for a in attempts)
    assert [a.attributes.get("http.request.resend_count") for a in attempts] == [None, 1, 2]  # type: ignore[union-attr]
    assert [a.attributes["http.response.status_code"] for a in attempts] == [502, 502, 200]  # type: ignore[index]
    assert [a.status.status_code for a in attempts] == [StatusCode.ERROR, StatusCode.ERROR, StatusCode.UNSET]
    assert call.status.status_code is StatusCode.UNSET
    assert obs.in_flight == 0


def test_attempt_span_attributes_follow_http_semconv(provider: TracerProvider, exporter: InMemorySpanExporter) -> None:
    """A resend that got a 502 carries exactly the HTTP client semconv attributes plus our outcome."""
    obs = TracingObserver(provider)
    run_call(obs, 2, [502, 502])
    second = by_kind(exporter.get_finished_spans(), SpanKind.CLIENT)[1]
    assert second.name == "POST /flush_cache"
    assert dict(second.attributes or {}) == {
        "http.request.method": "POST",
        "server.address": "127.0.0.1",
        "server.port": 30000,
        "url.template": "/flush_cache",
        "http.request.resend_count": 1,
        "http.response.status_code": 502,
        "error.type": "502",
        "resilience.attempt_outcome": "retryable",
    }


def test_first_attempt_success_has_no_error_type_or_resend_count(provider: TracerProvider, exporter: InMemorySpanExporter) -> None:
    """A first attempt answered 200 has neither error.type nor http.request.resend_count."""
    obs = TracingObserver(provider)
    run_call(obs, 3, [200])
    [attempt] = by_kind(exporter.get_finished_spans(), SpanKind.CLIENT)
    attrs = dict(attempt.attributes or {})
    assert "error.type" not in attrs and "http.request.resend_count" not in attrs
    assert attempt.status.status_code is StatusCode.UNSET


def test_call_span_attributes(provider: TracerProvider, exporter: InMemorySpanExporter) -> None:
    """The logical span names endpoint, engine, deadline, and at its end outcome, attempts and status."""
    obs = TracingObserver(provider)
    run_call(obs, 4, [503, 200])
    [call] = by_kind(exporter.get_finished_spans(), SpanKind.INTERNAL)
    assert dict(call.attributes or {}) == {
        "http.request.method": "POST",
        "url.template": "/flush_cache",
        "resilience.endpoint": "POST /flush_cache",
        "resilience.engine": ENGINE,
        "resilience.deadline_s": 30.0,
        "resilience.outcome": "retried_success",
        "resilience.attempts": 2,
        "http.response.status_code": 200,
    }


def test_backoff_sleeps_are_events_on_the_call_span(provider: TracerProvider, exporter: InMemorySpanExporter) -> None:
    """Each RetryScheduled becomes a ``resilience.backoff`` event with its reason and delay."""
    obs = TracingObserver(provider)
    run_call(obs, 5, [502, None, 200])
    [call] = by_kind(exporter.get_finished_spans(), SpanKind.INTERNAL)
    backoffs = [e for e in call.events if e.name == "resilience.backoff"]
    assert [dict(e.attributes or {}) for e in backoffs] == [
        {"resilience.retry.reason": "status_502", "resilience.backoff.delay_s": 0.005, "resilience.failed_attempt": 0},
        {"resilience.retry.reason": "read_timeout", "resilience.backoff.delay_s": 0.005, "resilience.failed_attempt": 1},
    ]


def test_transport_error_sets_error_type_to_exception_class(provider: TracerProvider, exporter: InMemorySpanExporter) -> None:
    """An attempt without a response has error.type = the exception class, status Error and no status code."""
    obs = TracingObserver(provider)
    run_call(obs, 6, [None, 200])
    first = by_kind(exporter.get_finished_spans(), SpanKind.CLIENT)[0]
    attrs = dict(first.attributes or {})
    assert attrs["error.type"] == "ReadTimeout"
    assert "http.response.status_code" not in attrs
    assert first.status.status_code is StatusCode.ERROR


def test_failed_call_span_is_error(provider: TracerProvider, exporter: InMemorySpanExporter) -> None:
    """A call handed back as failed has status Error and error.type on the logical span."""
    obs = TracingObserver(provider)
    run_call(obs, 7, [502, 502])
    [call] = by_kind(exporter.get_finished_spans(), SpanKind.INTERNAL)
    assert call.status.status_code is StatusCode.ERROR
    assert call.attributes is not None and call.attributes["error.type"] == "502"
    assert call.attributes["resilience.outcome"] == "failed"


def test_traceparent_is_the_attempt_span(provider: TracerProvider, exporter: InMemorySpanExporter) -> None:
    """Every attempt's carrier gets a traceparent naming that attempt's span id and the call's trace id."""
    obs = TracingObserver(provider)
    carriers = run_call(obs, 8, [502, 502, 200])
    attempts = by_kind(exporter.get_finished_spans(), SpanKind.CLIENT)
    for carrier, span in zip(carriers, attempts, strict=True):
        version, trace_id, span_id, flags = carrier["traceparent"].split("-")
        assert version == "00" and int(flags, 16) & 1  # sampled
        assert int(trace_id, 16) == span.context.trace_id
        assert int(span_id, 16) == span.context.span_id
    assert len({c["traceparent"] for c in carriers}) == 3


def test_breaker_budget_and_probe_are_call_events(provider: TracerProvider, exporter: InMemorySpanExporter) -> None:
    """Breaker rejections, retry-budget refusals and probe answers are events on the logical span."""
    obs = TracingObserver(provider)
    obs(CallStarted(call_id=9, method="POST", endpoint=ENDPOINT, engine=ENGINE, deadline_s=None))
    obs(ProbeCompleted(call_id=9, endpoint=ENDPOINT, engine=ENGINE, answer="not_done"))
    obs(RetryBudgetExhaustedEvent(call_id=9, endpoint=ENDPOINT, engine=ENGINE, tokens=0.4))
    obs(BreakerRejected(call_id=9, endpoint=ENDPOINT, engine=ENGINE))
    obs(
        call_ended(
            call_id=9, method="POST", endpoint=ENDPOINT, outcome=CallOutcome.CIRCUIT_OPEN, status=None, attempts=0, error_type="CircuitOpen"
        )
    )
    [call] = exporter.get_finished_spans()
    assert [e.name for e in call.events] == [
        "resilience.probe_completed",
        "resilience.retry_budget_exhausted",
        "resilience.breaker_rejected",
    ]
    assert call.events[2].attributes == {"resilience.engine": ENGINE}
    assert call.status.status_code is StatusCode.ERROR
    assert call.attributes is not None and call.attributes["error.type"] == "CircuitOpen"
    assert "resilience.deadline_s" not in call.attributes


def test_default_endpoint_has_no_url_template(provider: TracerProvider, exporter: InMemorySpanExporter) -> None:
    """A request no policy entry matched (``GET *``) gets no url.template and a method-only span name."""
    obs = TracingObserver(provider)
    run_call(obs, 10, [200], endpoint="GET *", method="GET")
    [attempt] = by_kind(exporter.get_finished_spans(), SpanKind.CLIENT)
    assert attempt.name == "GET"
    assert "url.template" not in (attempt.attributes or {})


def test_unknown_method_is_other(provider: TracerProvider, exporter: InMemorySpanExporter) -> None:
    """A method semconv does not know is reported as ``_OTHER`` with the original kept aside."""
    obs = TracingObserver(provider)
    run_call(obs, 11, [200], endpoint="PURGE /cache", method="PURGE")
    [attempt] = by_kind(exporter.get_finished_spans(), SpanKind.CLIENT)
    assert attempt.name == "HTTP /cache"
    assert attempt.attributes is not None
    assert attempt.attributes["http.request.method"] == "_OTHER"
    assert attempt.attributes["http.request.method_original"] == "PURGE"


def test_engine_user_info_is_stripped(provider: TracerProvider, exporter: InMemorySpanExporter) -> None:
    """An engine string that carries user-info never reaches a span attribute with it."""
    obs = TracingObserver(provider)
    obs(CallStarted(call_id=12, method="GET", endpoint="GET /x", engine="http://admin:hunter2@127.0.0.1:30000", deadline_s=None))
    obs(call_ended(call_id=12, method="GET", endpoint="GET /x", engine="http://admin:hunter2@127.0.0.1:30000"))
    [call] = exporter.get_finished_spans()
    assert call.attributes is not None and call.attributes["resilience.engine"] == "http://127.0.0.1:30000"


def test_call_ended_closes_an_open_attempt(provider: TracerProvider, exporter: InMemorySpanExporter) -> None:
    """An attempt still open when its call ends is ended (status Error) and no state is left behind."""
    obs = TracingObserver(provider)
    obs(CallStarted(call_id=13, method="POST", endpoint=ENDPOINT, engine=ENGINE, deadline_s=None))
    obs(attempt_started(call_id=13, method="POST", endpoint=ENDPOINT))
    assert obs.in_flight == 1
    obs(call_ended(call_id=13, method="POST", endpoint=ENDPOINT, outcome=CallOutcome.FAILED, status=None, error_type="KeyboardInterrupt"))
    attempt = by_kind(exporter.get_finished_spans(), SpanKind.CLIENT)[0]
    assert attempt.status.status_code is StatusCode.ERROR
    assert obs.in_flight == 0


def test_events_for_unknown_calls_are_ignored(provider: TracerProvider, exporter: InMemorySpanExporter) -> None:
    """Attempt, retry and end events of a call never started make no span and leave no state."""
    obs = TracingObserver(provider)
    obs(attempt_started(call_id=99))
    obs(attempt_ended(call_id=99))
    obs(RetryScheduled(call_id=99, attempt=0, endpoint="GET /x", engine=ENGINE, reason="status_502", delay_s=0.1))
    obs(call_ended(call_id=99))
    obs(PhaseEnded(transition_id=99, transition="offload", phase="pause", engines=(ENGINE,), duration_s=0.1))
    obs(TransitionEnded(transition_id=99, transition="offload", engines=(ENGINE,), duration_s=0.1, ok=True))
    assert exporter.get_finished_spans() == ()
    assert obs.in_flight == 0


def test_concurrent_calls_keep_their_own_spans(provider: TracerProvider, exporter: InMemorySpanExporter) -> None:
    """Calls on 16 threads at once: every attempt span parents under its own call span, and nothing leaks."""
    obs = TracingObserver(provider)
    start = threading.Barrier(16)

    def worker(t: int) -> None:
        start.wait()
        for i in range(25):
            run_call(obs, 1000 * t + i, [502, 200])

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(16)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    spans = exporter.get_finished_spans()
    calls = {s.context.span_id: s for s in spans if s.kind is SpanKind.INTERNAL}
    attempts = [s for s in spans if s.kind is SpanKind.CLIENT]
    assert len(calls) == 400 and len(attempts) == 800
    per_call: dict[int, int] = {}
    for a in attempts:
        assert a.parent is not None and a.parent.span_id in calls
        assert a.context.trace_id == calls[a.parent.span_id].context.trace_id
        per_call[a.parent.span_id] = per_call.get(a.parent.span_id, 0) + 1
    assert set(per_call.values()) == {2}
    assert obs.in_flight == 0


def test_barrier_transition_and_phase_spans(provider: TracerProvider, exporter: InMemorySpanExporter) -> None:
    """A transition span holds one child span per phase; engines are attributes, failures are events."""
    obs = TracingObserver(provider)
    engines = ("http://127.0.0.1:30000", "http://127.0.0.2:30000")
    obs(TransitionStarted(transition_id=1, transition="offload", engines=engines, deadline_s=120.0))
    obs(PhaseStarted(transition_id=1, transition="offload", phase="pause", engines=engines, deadline_s=30.0))
    obs(PhaseEnded(transition_id=1, transition="offload", phase="pause", engines=engines, duration_s=0.2))
    obs(PhaseStarted(transition_id=1, transition="offload", phase="flush", engines=engines, deadline_s=30.0))
    failure = PhaseFailure(
        engine=engines[1],
        error_type="ReadTimeout",
        message="read timed out; Authorization: Bearer SECRET-abc; url http://u:pw@h:1/x?api_key=SECRET-q",
    )
    obs(PhaseEnded(transition_id=1, transition="offload", phase="flush", engines=engines, duration_s=30.0, failures=(failure,)))
    obs(
        TransitionEnded(
            transition_id=1,
            transition="offload",
            engines=engines,
            duration_s=30.3,
            ok=False,
            failed_phase="flush",
            rolled_back=(engines[0],),
            left_paused=(engines[1],),
        )
    )
    spans = {s.name: s for s in exporter.get_finished_spans()}
    transition = spans["barrier offload"]
    pause, flush = spans["barrier offload pause"], spans["barrier offload flush"]
    for phase in (pause, flush):
        assert phase.parent is not None and phase.parent.span_id == transition.context.span_id
        assert phase.attributes is not None and phase.attributes["resilience.engines"] == engines
    assert pause.status.status_code is StatusCode.UNSET
    assert flush.status.status_code is StatusCode.ERROR
    [event] = flush.events
    assert event.name == "exception"
    assert event.attributes is not None
    assert event.attributes["exception.type"] == "ReadTimeout"
    assert event.attributes["resilience.engine"] == engines[1]
    message = str(event.attributes["exception.message"])
    assert "SECRET" not in message and "pw@" not in message and "read timed out" in message
    assert transition.status.status_code is StatusCode.ERROR
    assert dict(transition.attributes or {}) == {
        "resilience.transition": "offload",
        "resilience.engines": engines,
        "resilience.deadline_s": 120.0,
        "resilience.ok": False,
        "resilience.failed_phase": "flush",
        "resilience.rolled_back": (engines[0],),
        "resilience.left_paused": (engines[1],),
    }
    assert obs.in_flight == 0


def test_transition_end_closes_open_phases(provider: TracerProvider, exporter: InMemorySpanExporter) -> None:
    """A phase still open when its transition ends is ended with status Error; no state is left."""
    obs = TracingObserver(provider)
    obs(TransitionStarted(transition_id=2, transition="onload", engines=("e",), deadline_s=None))
    obs(PhaseStarted(transition_id=2, transition="onload", phase="resume", engines=("e",), deadline_s=None))
    obs(TransitionEnded(transition_id=2, transition="onload", engines=("e",), duration_s=1.0, ok=True))
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert spans["barrier onload resume"].status.status_code is StatusCode.ERROR
    assert spans["barrier onload"].status.status_code is StatusCode.UNSET
    assert obs.in_flight == 0


def test_suppressed_instrumentation_makes_no_spans(provider: TracerProvider, exporter: InMemorySpanExporter) -> None:
    """A call started under OpenTelemetry's suppress_instrumentation key gets no spans and no traceparent."""
    obs = TracingObserver(provider)
    token = otel_context.attach(otel_context.set_value(otel_context._SUPPRESS_INSTRUMENTATION_KEY, True))
    try:
        carriers = run_call(obs, 14, [200])
    finally:
        otel_context.detach(token)
    assert exporter.get_finished_spans() == ()
    assert carriers == [{}]
    assert obs.in_flight == 0


def test_call_span_parents_under_the_current_span(provider: TracerProvider, exporter: InMemorySpanExporter) -> None:
    """The logical span is a child of whatever span is current when the call starts."""
    obs = TracingObserver(provider)
    with provider.get_tracer("test").start_as_current_span("outer") as outer:
        run_call(obs, 15, [200])
    [call] = [s for s in exporter.get_finished_spans() if s.name.startswith("resilient")]
    assert call.parent is not None and call.parent.span_id == outer.get_span_context().span_id


def test_without_an_sdk_nothing_is_injected() -> None:
    """With the no-op provider there are no spans, no traceparent, and no error."""
    obs = TracingObserver(trace.NoOpTracerProvider())
    carriers = run_call(obs, 16, [502, 200])
    assert carriers == [{}, {}]
    assert obs.in_flight == 0


class _ExplodingCarrier(dict[str, str]):
    def __setitem__(self, key: str, value: str) -> None:
        raise RuntimeError("carrier refused")


def test_observer_never_raises(provider: TracerProvider, exporter: InMemorySpanExporter, caplog: pytest.LogCaptureFixture) -> None:
    """A failure inside the observer is logged as a warning, never raised to the retry loop."""
    obs = TracingObserver(provider)
    obs(CallStarted(call_id=17, method="GET", endpoint="GET /x", engine=ENGINE, deadline_s=None))
    carrier: MutableMapping[str, str] = _ExplodingCarrier()
    with caplog.at_level(logging.WARNING, logger="resilience.telemetry"):
        obs(attempt_started(call_id=17, method="GET", endpoint="GET /x", carrier=carrier))
    assert "TracingObserver failed on AttemptStarted" in caplog.text
    obs(call_ended(call_id=17, method="GET", endpoint="GET /x", outcome=CallOutcome.FAILED, status=None, error_type="RuntimeError"))
    assert obs.in_flight == 0


def test_without_an_sdk_a_call_keeps_no_span_tree_and_sends_only_baggage() -> None:
    """The API's no-op provider: no traceparent, nothing left in flight; the caller's baggage is still injected.

    A sampled-out SDK span (valid context, not recording) is not this case: its traceparent travels (see
    ``test_traceparent_is_the_attempt_span`` for the recording one).
    """
    from opentelemetry import baggage

    obs = TracingObserver(trace.NoOpTracerProvider())
    events = list(call_events(21, [502, 200]))
    obs(events[0][0])  # CallStarted
    assert obs._calls == {} and obs.in_flight == 0  # no span tree kept for it: the no-op provider keeps no state at all
    for event, _ in events[1:]:
        obs(event)
    assert [c for e, c in events if isinstance(e, AttemptStarted)] == [{}, {}]
    assert obs.in_flight == 0
    token = otel_context.attach(baggage.set_baggage("tenant", "rl-7"))
    try:
        carriers = run_call(obs, 22, [200])
    finally:
        otel_context.detach(token)
    assert carriers == [{"baggage": "tenant=rl-7"}]
    token = otel_context.attach(otel_context.set_value("unrelated", 1))  # a context that holds something, but no baggage
    try:
        assert run_call(obs, 24, [200]) == [{}]
    finally:
        otel_context.detach(token)
    assert obs.in_flight == 0


def test_a_sampled_out_call_still_propagates_its_trace_id() -> None:
    """An SDK that samples the call out (valid context, not recording) keeps the tree: the attempt's traceparent goes out."""
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF

    obs = TracingObserver(TracerProvider(sampler=ALWAYS_OFF))
    (carrier,) = run_call(obs, 23, [200])
    _version, trace_id, _span_id, flags = carrier["traceparent"].split("-")
    assert trace_id != "0" * 32 and int(flags, 16) & 1 == 0  # a real trace id, not sampled
    assert obs.in_flight == 0
