"""``EngineRefused`` reaches the telemetry observers without breaking them, on a real call to a port that refuses."""

from __future__ import annotations

import logging

import pytest
import requests
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry

from resilience.adapters.requests import resilient_session
from resilience.events import EngineRefused, Event
from resilience.policy import EndpointPolicy, PolicyTable, RetryPolicy
from resilience.telemetry.metrics import MetricsObserver
from resilience.telemetry.tracing import TracingObserver

POLICIES = PolicyTable({"GET /health": EndpointPolicy(retry=RetryPolicy(base_s=0.02, cap_s=0.05, connect_window_s=0.3), deadline_s=10)})


def test_metrics_and_tracing_take_the_refusal_event_in_stride(
    refusing_port: int, provider: TracerProvider, exporter: InMemorySpanExporter, caplog: pytest.LogCaptureFixture
) -> None:
    """A refused call with both observers mounted: the event is emitted, no observer fails on it, the spans still end."""
    seen: list[Event] = []
    observers = [MetricsObserver(CollectorRegistry()), TracingObserver(provider), seen.append]
    with caplog.at_level(logging.WARNING), resilient_session(POLICIES, observers=observers) as session:
        with pytest.raises(requests.ConnectionError):
            session.get(f"http://127.0.0.1:{refusing_port}/health", timeout=2)
    assert [type(e) for e in seen].count(EngineRefused) == 1
    failures = [r.getMessage() for r in caplog.records if "failed on" in r.getMessage()]
    assert failures == []
    assert exporter.get_finished_spans()  # the call's spans ended as for any failed call
