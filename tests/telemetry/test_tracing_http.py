"""TracingObserver on real HTTP calls through ResilientAdapter, alone and under the requests instrumentation."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
import requests
from opentelemetry.instrumentation.requests import RequestsInstrumentor
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from pytest_httpserver import HTTPServer

import resilience
from resilience.adapters.requests import resilient_session
from resilience.policy import EndpointPolicy, PolicyTable, RetryPolicy
from resilience.telemetry.tracing import TracingObserver

POLICIES = PolicyTable({"POST /flush": EndpointPolicy(idempotent=True, retry=RetryPolicy(max_attempts=5, base_s=0.001, cap_s=0.01))})


@pytest.fixture
def server(httpserver: HTTPServer) -> Iterator[HTTPServer]:
    """A loopback server that answers POST /flush with 502, 502, then 200."""
    for status in (502, 502, 200):
        httpserver.expect_ordered_request("/flush", method="POST").respond_with_data("", status=status)
    yield httpserver
    httpserver.check_assertions()
    httpserver.clear()


def traceparents_seen(server: HTTPServer) -> list[tuple[int, int]]:
    """(trace id, parent span id) of the traceparent header of every request the server received."""
    seen = []
    for request, _response in server.log:
        _version, trace_id, span_id, _flags = request.headers["traceparent"].split("-")
        seen.append((int(trace_id, 16), int(span_id, 16)))
    return seen


def ours(spans: tuple[ReadableSpan, ...]) -> tuple[ReadableSpan, list[ReadableSpan]]:
    """Our logical span and our attempt spans (in start order)."""
    [call] = [s for s in spans if s.instrumentation_scope and s.instrumentation_scope.name == "resilience.telemetry"
              and s.kind is SpanKind.INTERNAL]  # fmt: skip
    attempts = sorted(
        (s for s in spans if s.parent is not None and s.parent.span_id == call.context.span_id),
        key=lambda s: s.start_time or 0,
    )
    return call, attempts


def test_real_call_502_502_200(server: HTTPServer, provider: TracerProvider, exporter: InMemorySpanExporter) -> None:
    """A real call answered 502, 502, 200 gives one logical span and three attempt spans the server saw, one each."""
    session = resilient_session(POLICIES, observers=[TracingObserver(provider)])
    response = session.post(server.url_for("/flush"), data=b"{}", timeout=5)
    assert response.status_code == 200
    spans = exporter.get_finished_spans()
    assert len(spans) == 4
    call, attempts = ours(spans)
    assert call.kind is SpanKind.INTERNAL and call.parent is None
    assert [a.kind for a in attempts] == [SpanKind.CLIENT] * 3
    assert [(a.attributes or {}).get("http.request.resend_count") for a in attempts] == [None, 1, 2]
    assert [(a.attributes or {})["http.response.status_code"] for a in attempts] == [502, 502, 200]
    assert [(a.attributes or {}).get("error.type") for a in attempts] == ["502", "502", None]
    assert [a.status.status_code for a in attempts] == [StatusCode.ERROR, StatusCode.ERROR, StatusCode.UNSET]
    assert {(a.attributes or {})["server.port"] for a in attempts} == {server.port}
    assert {(a.attributes or {})["url.template"] for a in attempts} == {"/flush"}
    assert [e.name for e in call.events] == ["resilience.backoff", "resilience.backoff"]
    assert (call.attributes or {})["resilience.outcome"] == "retried_success"
    seen = traceparents_seen(server)
    assert seen == [(a.context.trace_id, a.context.span_id) for a in attempts]
    assert len(set(seen)) == 3


def test_coexists_with_requests_instrumentation(server: HTTPServer, provider: TracerProvider, exporter: InMemorySpanExporter) -> None:
    """With opentelemetry-instrumentation-requests on, its CLIENT span parents our INTERNAL call span, whose
    three CLIENT attempt spans are still emitted, and the server sees our attempts' traceparents, not its."""
    RequestsInstrumentor().instrument(tracer_provider=provider)
    try:
        session = resilient_session(POLICIES, observers=[TracingObserver(provider)])
        assert session.post(server.url_for("/flush"), data=b"{}", timeout=5).status_code == 200
    finally:
        RequestsInstrumentor().uninstrument()
    spans = exporter.get_finished_spans()
    assert len(spans) == 5
    [outer] = [s for s in spans if s.instrumentation_scope and s.instrumentation_scope.name.startswith("opentelemetry.instrumentation")]
    call, attempts = ours(spans)
    assert outer.kind is SpanKind.CLIENT
    assert call.parent is not None and call.parent.span_id == outer.context.span_id
    assert [a.kind for a in attempts] == [SpanKind.CLIENT] * 3
    assert [(a.attributes or {}).get("http.request.resend_count") for a in attempts] == [None, 1, 2]
    assert {s.context.trace_id for s in spans} == {outer.context.trace_id}
    seen = traceparents_seen(server)
    assert seen == [(a.context.trace_id, a.context.span_id) for a in attempts]
    assert outer.context.span_id not in {span_id for _, span_id in seen}


def test_no_observer_sends_no_traceparent(server: HTTPServer) -> None:
    """Without the tracing observer the adapter adds no propagation header."""
    session = resilient_session(POLICIES)
    assert session.post(server.url_for("/flush"), data=b"{}", timeout=5).status_code == 200
    assert all("traceparent" not in request.headers for request, _ in server.log)


def test_refused_connection_attempts(provider: TracerProvider, exporter: InMemorySpanExporter) -> None:
    """Attempts to a port nobody listens on are CLIENT spans with error.type = the exception class and status Error."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    policies = PolicyTable({"GET /health": EndpointPolicy(retry=RetryPolicy(max_attempts=2, base_s=0.001, cap_s=0.01))})
    session = resilient_session(policies, observers=[TracingObserver(provider)])
    with resilience.set_testing(True, attempts=2), pytest.raises(requests.ConnectionError):  # refusals count only in testing mode
        session.get(f"http://127.0.0.1:{port}/health", timeout=2)
    call, attempts = ours(exporter.get_finished_spans())
    assert len(attempts) == 2
    for a in attempts:
        attrs = dict(a.attributes or {})
        assert attrs["error.type"] == "ConnectionError"
        assert "http.response.status_code" not in attrs
        assert a.status.status_code is StatusCode.ERROR
    assert call.status.status_code is StatusCode.ERROR
    assert (call.attributes or {})["resilience.outcome"] == "failed"
