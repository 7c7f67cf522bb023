"""``--traces``: console spans go to a file of their own; an OTLP collector nobody runs is said once, before the run.

Only loopback addresses are dialled: the "no collector" endpoint is a refusing port on 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("opentelemetry.sdk.trace")

from resilience.cli.common import CliError
from resilience.cli.traces import DEFAULT_OTLP_TRACES, check_collector, once_exporter, otlp_endpoint
from tests.cli.cpr_testlib import CPR, error_lines, run_cpr


def test_the_endpoint_is_resolved_as_the_specification_says() -> None:
    """TRACES_ENDPOINT as is; else the base endpoint + /v1/traces; else localhost:4318."""
    assert otlp_endpoint({}) == DEFAULT_OTLP_TRACES == "http://localhost:4318/v1/traces"
    assert otlp_endpoint({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9/"}) == "http://127.0.0.1:9/v1/traces"
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:8/t"}
    assert otlp_endpoint(env) == "http://127.0.0.1:8/t"


def test_no_collector_is_one_clear_error_without_the_endpoints_secrets(refusing_port: int) -> None:
    """A refusing port: CliError naming the endpoint (no credentials, no query) and what to do."""
    with pytest.raises(CliError) as caught:
        check_collector(f"http://user:pw@127.0.0.1:{refusing_port}/v1/traces?token=abc")
    message = caught.value.message
    assert f"no OTLP collector answers at http://127.0.0.1:{refusing_port}/v1/traces (connection refused)" in message
    assert "pw" not in message and "token" not in message and "--traces console or off" in message


def test_a_listening_collector_passes_the_check() -> None:
    """Something listening on the endpoint's port: no error (the check proves a listener, no more)."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        check_collector(f"http://127.0.0.1:{listener.getsockname()[1]}/v1/traces")


def test_demo_with_otlp_and_no_collector_fails_before_any_engine_starts(refusing_port: int, tmp_path: Path) -> None:
    """`cpr demo --traces otlp` with the endpoint on a refusing loopback port: exit 1, one line, no engine started."""
    env = {**os.environ, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"http://127.0.0.1:{refusing_port}/v1/traces"}
    result = subprocess.run(
        [*CPR, "demo", "--traces", "otlp", "--report", "r.json"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 1, result.stderr
    [line] = error_lines(result.stderr)
    assert line.startswith(f"cpr demo: error: --traces otlp: no OTLP collector answers at http://127.0.0.1:{refusing_port}/v1/traces")
    assert "emulated engine" not in result.stderr and not (tmp_path / "r.json").exists()


def test_a_collector_that_goes_away_is_said_once_and_the_rest_dropped(refusing_port: int) -> None:
    """The real OTLP exporter against a refusing port, wrapped: one line at the first failed batch, later batches
    dropped without being sent (no second line, no second wait)."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    said: list[str] = []
    inner = OTLPSpanExporter(endpoint=f"http://127.0.0.1:{refusing_port}/v1/traces", timeout=1)
    exporter = once_exporter(inner, "the collector", said.append)
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    for name in ("a", "b", "c"):
        with tracer.start_as_current_span(name):
            pass
    provider.shutdown()
    assert said == ["traces: exporting to the collector failed; the rest of this run's spans are dropped"]
    assert (exporter.exported, exporter.dropped) == (0, 3)


def test_console_spans_go_to_their_file_not_into_the_progress(tmp_path: Path) -> None:
    """`--traces console --traces-file spans.jsonl` on one engine, one step: stderr holds no span, the file one JSON
    span per line, and the run says how many went where."""
    pytest.importorskip("torch")
    args = ["demo", "--engines", "1", "--steps", "1", "--traces", "console", "--traces-file", "spans.jsonl", "--report", "r.json"]
    result = run_cpr(*args, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert '"trace_id"' not in result.stderr and '"trace_id"' not in result.stdout
    assert "traces: one JSON object per span into spans.jsonl (not into this progress)" in result.stderr
    spans = [json.loads(line) for line in (tmp_path / "spans.jsonl").read_text().splitlines()]
    assert spans and all(span["context"]["trace_id"] for span in spans)
    assert f"traces: {len(spans)} spans written to spans.jsonl (one JSON object per line)" in result.stdout
    assert json.loads((tmp_path / "r.json").read_text())["traces_file"] == "spans.jsonl"
