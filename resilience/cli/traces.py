"""``--traces``: where a cpr run's OpenTelemetry spans go, and saying once when they cannot.

- ``console``: one JSON object per span per line, into ``--traces-file`` (never the progress on stderr).
- ``otlp``: OTLP/HTTP to ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``, else ``OTEL_EXPORTER_OTLP_ENDPOINT`` +
  ``/v1/traces``, else ``http://localhost:4318/v1/traces``. :func:`check_collector` first opens one TCP connection
  to it (none answering is a :class:`CliError` before any engine starts); a collector that goes away during the
  run is said once (:func:`once_exporter`) and the rest of the spans dropped.

Imported only when ``--traces`` is not ``off`` (it imports the OpenTelemetry SDK).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any
from urllib.parse import urlsplit

from resilience.cli.common import CliError, need
from resilience.cli.errors_text import safe_url

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import ReadableSpan
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

__all__ = ["COLLECTOR_CONNECT_S", "DEFAULT_OTLP_TRACES", "check_collector", "once_exporter", "otlp_endpoint", "tracer_provider"]

DEFAULT_OTLP_TRACES = "http://localhost:4318/v1/traces"
"""The OTLP/HTTP traces endpoint when no variable names one (the OpenTelemetry specification's default)."""

COLLECTOR_CONNECT_S = 1.0
"""Seconds :func:`check_collector` waits for the collector's TCP connection."""

_SDK_LOGGERS = ("opentelemetry.exporter.otlp", "opentelemetry.sdk.trace.export")
"""Loggers whose per-batch export errors :func:`once_exporter` replaces with its one line."""


def otlp_endpoint(environ: dict[str, str] | None = None) -> str:
    """The OTLP/HTTP traces URL the exporter will post to, resolved as the OpenTelemetry specification says."""
    env = os.environ if environ is None else environ
    traces = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip()
    if traces:
        return traces
    base = env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip()
    return base.rstrip("/") + "/v1/traces" if base else DEFAULT_OTLP_TRACES


def check_collector(endpoint: str, timeout: float = COLLECTOR_CONNECT_S) -> None:
    """Open (and close) one TCP connection to ``endpoint``'s host and port; a :class:`CliError` when nothing answers
    (a listener, not proved a collector: a wrong one fails its first export, reported once)."""
    parts = urlsplit(endpoint)
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        raise CliError(f"--traces otlp: the endpoint {safe_url(endpoint)!r} has an invalid port", 2) from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise CliError(f"--traces otlp: the endpoint {safe_url(endpoint)!r} is not an http:// or https:// URL", 2)
    try:
        with socket.create_connection((parts.hostname, port), timeout=timeout):
            return
    except OSError as exc:
        why = "connection refused" if isinstance(exc, ConnectionRefusedError) else (exc.strerror or type(exc).__name__)
        if isinstance(exc, TimeoutError):
            why = f"no connection in {timeout:g} s"
    raise CliError(
        f"--traces otlp: no OTLP collector answers at {safe_url(endpoint)} ({why}); start one, point "
        "OTEL_EXPORTER_OTLP_ENDPOINT or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT at yours, or use --traces console or off"
    )


def _once_exporter_class() -> type[Any]:
    """:func:`once_exporter`, built on the SDK's ``SpanExporter`` (imported only now)."""
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

    class _Once(SpanExporter):
        def __init__(self, inner: SpanExporter, where: str, say: Callable[[str], None]) -> None:
            self.inner, self.where, self.say = inner, where, say
            self.exported = 0
            """Spans handed to the inner exporter that it took."""
            self.dropped = 0
            """Spans not exported: the batch that failed and every one after it."""
            self._failed = False
            self._lock = threading.Lock()

        def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
            with self._lock:
                if self._failed:
                    self.dropped += len(spans)
                    return SpanExportResult.FAILURE
            try:
                result = self.inner.export(spans)
            except Exception:  # an exporter that raises is treated as one that failed
                result = SpanExportResult.FAILURE
            with self._lock:
                if result == SpanExportResult.SUCCESS:
                    self.exported += len(spans)
                    return result
                self.dropped += len(spans)
                first, self._failed = not self._failed, True
            if first:
                self.say(f"traces: exporting to {self.where} failed; the rest of this run's spans are dropped")
            return result

        def shutdown(self) -> None:
            self.inner.shutdown()

        def force_flush(self, timeout_millis: int = 30000) -> bool:
            return self._failed or bool(self.inner.force_flush(timeout_millis))

    return _Once


def once_exporter(inner: Any, where: str, say: Callable[[str], None]) -> Any:
    """A ``SpanExporter`` around ``inner`` that says once (``say(line)``, naming ``where``) when an export fails, then drops
    every later span; ``exported`` and ``dropped`` count spans."""
    return _once_exporter_class()(inner, where, say)


def tracer_provider(kind: str, spans_file: Path | None, say: Callable[[str], None]) -> tuple[Any, Callable[[], str]]:
    """A ``TracerProvider`` for ``--traces kind`` (``"console"``: into ``spans_file``; ``"otlp"``: checked first) and a
    ``close()`` that flushes it and returns a summary line; ``say`` gets the one line about a failed export."""
    sdk_trace = need("opentelemetry.sdk.trace", "otel", "--traces")
    export = need("opentelemetry.sdk.trace.export", "otel", "--traces")
    resources = need("opentelemetry.sdk.resources", "otel", "--traces")
    attributes = {} if os.environ.get("OTEL_SERVICE_NAME") else {"service.name": "cpr"}
    provider = sdk_trace.TracerProvider(resource=resources.Resource.create(attributes))
    stream: IO[str] | None = None
    if kind == "console":
        assert spans_file is not None  # cpr demo passes --traces-file (it has a default) with --traces console
        try:
            stream = spans_file.open("w", encoding="utf-8")
        except OSError as exc:
            raise CliError(f"cannot write --traces-file {str(spans_file)!r}: {exc.strerror or exc}") from None
        inner = export.ConsoleSpanExporter(out=stream, formatter=lambda span: span.to_json(indent=None) + "\n")
        where = str(spans_file)
    else:
        endpoint = otlp_endpoint()
        check_collector(endpoint)
        otlp = need("opentelemetry.exporter.otlp.proto.http.trace_exporter", "otel", "--traces otlp")
        inner = otlp.OTLPSpanExporter(endpoint=endpoint)
        where = safe_url(endpoint)
        for name in _SDK_LOGGERS:  # the one line of OnceExporter replaces the SDK's line per failed batch
            logging.getLogger(name).setLevel(logging.CRITICAL)
    exporter = once_exporter(inner, where, say)
    provider.add_span_processor(export.BatchSpanProcessor(exporter))

    def close() -> str:
        try:
            provider.shutdown()
        finally:
            if stream is not None:
                stream.close()
        into = f"written to {where} (one JSON object per line)" if kind == "console" else f"exported to {where}"
        dropped = f", {exporter.dropped} dropped" if exporter.dropped else ""
        return f"traces: {exporter.exported} spans {into}{dropped}"

    return provider, close
