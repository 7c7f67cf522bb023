"""Credentials never reach spans, metrics or logs."""

from __future__ import annotations

import base64
import logging

import pytest
import requests
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import generate_latest
from pytest_httpserver import HTTPServer

from resilience.adapters.requests import resilient_session
from resilience.policy import EndpointPolicy, PolicyTable, RetryPolicy
from resilience.telemetry.metrics import MetricsObserver
from resilience.telemetry.tracing import TracingObserver

BEARER = "SECRET-xyz"
API_KEY = "SECRET-key"
POLICIES = PolicyTable({
    "POST /flush": EndpointPolicy(retry=RetryPolicy(max_attempts=3, base_s=0.001, cap_s=0.01)),
    "GET /health": EndpointPolicy(retry=RetryPolicy(max_attempts=2, base_s=0.001, cap_s=0.01)),
})  # fmt: skip


def test_secrets_appear_in_no_span_metric_or_log(
    httpserver: HTTPServer,
    provider: TracerProvider,
    exporter: InMemorySpanExporter,
    caplog: pytest.LogCaptureFixture,
    refusing_port: int,
) -> None:
    """A bearer token and a URL user-info API key, through retries and a refused connection, leave no trace anywhere."""
    for status in (502, 200, 503, 200):
        httpserver.expect_ordered_request("/flush", method="POST").respond_with_data("", status=status)
    metrics = MetricsObserver()
    session = resilient_session(POLICIES, observers=[TracingObserver(provider), metrics])
    caplog.set_level(logging.DEBUG)
    base = f"http://{httpserver.host}:{httpserver.port}"
    with_userinfo = f"http://apikey:{API_KEY}@{httpserver.host}:{httpserver.port}"
    assert session.post(f"{base}/flush", headers={"Authorization": f"Bearer {BEARER}"}, timeout=5).status_code == 200
    assert session.post(f"{with_userinfo}/flush", timeout=5).status_code == 200
    with pytest.raises(requests.ConnectionError):
        session.get(f"http://apikey:{API_KEY}@127.0.0.1:{refusing_port}/health",
                    headers={"Authorization": f"Bearer {BEARER}"}, timeout=2)  # fmt: skip
    httpserver.check_assertions()

    # The server really got both credentials: the test sends what it claims to.
    auths = [req.headers.get("Authorization", "") for req, _ in httpserver.log]
    assert f"Bearer {BEARER}" in auths[0] and auths[2].startswith("Basic ")

    basic = base64.b64encode(f"apikey:{API_KEY}".encode()).decode()
    needles = (BEARER, API_KEY, basic, "SECRET")
    spans = exporter.get_finished_spans()
    assert len(spans) >= 9  # 3 calls, 5 attempts + 2 refused attempts
    span_text = "\n".join(s.to_json() for s in spans)
    metrics_text = generate_latest(metrics.registry).decode()
    log_text = "\n".join(f"{r.name} {r.getMessage()} {r.exc_text or ''}" for r in caplog.records) + caplog.text
    assert caplog.records, "DEBUG logging was captured"
    assert "cpr_attempts_total" in metrics_text
    for needle in needles:
        assert needle not in span_text, f"{needle} leaked into a span"
        assert needle not in metrics_text, f"{needle} leaked into the metrics"
        assert needle not in log_text, f"{needle} leaked into a log record"
