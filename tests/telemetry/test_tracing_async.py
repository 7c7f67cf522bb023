"""Spans from ``Retrier.arun`` under concurrency: each task's call span hangs under that task's own current span."""

from __future__ import annotations

import asyncio
from collections.abc import MutableMapping

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from resilience.outcome import Delivery
from resilience.policy import EndpointPolicy, PolicyTable, RetryPolicy
from resilience.retry.retrier import Retrier
from resilience.retry.spec import AttemptResult, CallSpec
from resilience.telemetry.tracing import TracingObserver

ENGINE = "http://127.0.0.1:30000"
TASKS = 40
POLICY = EndpointPolicy(retry=RetryPolicy(max_attempts=3, base_s=0.001, cap_s=0.005))


@pytest.mark.asyncio
async def test_concurrent_async_calls_keep_their_own_parents_and_traceparents(
    provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    retrier = Retrier(observers=[TracingObserver(tracer_provider=provider)])
    tracer = provider.get_tracer("test")
    match = PolicyTable({"POST /pause_generation": POLICY}).match("POST", "/pause_generation")
    sent: dict[int, list[str]] = {}

    async def step(i: int) -> None:
        async def attempt(n: int, t: tuple[float | None, float | None], carrier: MutableMapping[str, str]) -> AttemptResult[str]:
            sent.setdefault(i, []).append(carrier["traceparent"])
            await asyncio.sleep(0.001 * (i % 5))  # interleave the tasks
            if n == 0:
                return AttemptResult(error=ConnectionResetError(), delivery=Delivery.AMBIGUOUS, error_kind="connection_reset")
            return AttemptResult(response=f"ok{i}", status=200)

        with tracer.start_as_current_span(f"step-{i}"):
            spec = CallSpec("POST", f"{ENGINE}/pause_generation", match, ENGINE, "127.0.0.1", 30000)
            response, attempts = await retrier.arun(spec, attempt)
            assert response == f"ok{i}" and len(attempts) == 2

    await asyncio.gather(*(step(i) for i in range(TASKS)))
    spans = exporter.get_finished_spans()
    steps = {s.name: s for s in spans if s.name.startswith("step-")}
    calls = [s for s in spans if s.name == "resilient POST /pause_generation"]
    attempts = [s for s in spans if s.kind is SpanKind.CLIENT]
    assert len(steps) == TASKS and len(calls) == TASKS and len(attempts) == 2 * TASKS
    by_id = {s.context.span_id: s for s in spans}
    for call in calls:  # each call span's parent is one step span, of its own trace
        assert call.parent is not None
        parent = by_id[call.parent.span_id]
        assert parent.name.startswith("step-") and parent.context.trace_id == call.context.trace_id
    assert len({c.parent.span_id for c in calls if c.parent is not None}) == TASKS
    for i, headers in sent.items():  # each attempt carried its own attempt span's traceparent, in its task's trace
        trace_id = format(steps[f"step-{i}"].context.trace_id, "032x")
        assert len(headers) == 2 and len(set(headers)) == 2
        assert all(h.split("-")[1] == trace_id for h in headers)
    assert len(sent) == TASKS
