"""Per-call overhead of telemetry: both observers vs the observer-less ResilientAdapter vs a bare HTTPAdapter.

Run: ``python benchmarks/bench_telemetry_overhead.py [--calls 400] [--rounds 12]``

A keep-alive HTTP/1.1 server runs in its own process on 127.0.0.1 and answers
every request 200 with a 2-byte body. Each variant gets its own
``requests.Session`` (one pooled connection, warmed up first); the variants
run interleaved, in a shuffled order every round, ``--calls`` sequential
successful POSTs per round. The table reports, per variant, the median over
rounds of the mean wall time per call and of the client process's CPU time
per call (all its threads, the span processor's included; steadier than
wall time on a loaded machine), each with its ratio to the bare adapter.
Target: both observers on (SDK tracer provider, batch processor, discarding
exporter) at most 1.25x the bare adapter. A fifth variant samples 10 % of traces (parent-based), the
usual production setting, to show what the SDK's per-span cost becomes.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

import requests
from _loopback import SERVER
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from requests.adapters import HTTPAdapter

from resilience.adapters.requests import ResilientAdapter
from resilience.events import Observer
from resilience.policy import EndpointPolicy, PolicyTable
from resilience.telemetry.metrics import MetricsObserver
from resilience.telemetry.tracing import TracingObserver


class DiscardExporter(SpanExporter):
    """Accepts and drops every span: the cost of a real exporter's network I/O is not ours."""

    def __init__(self) -> None:
        self.exported = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        """Count and drop."""
        self.exported += len(spans)
        return SpanExportResult.SUCCESS


POLICIES = PolicyTable({"POST /flush_cache": EndpointPolicy()})


def session_with(adapter: HTTPAdapter) -> requests.Session:
    """A session with ``adapter`` mounted for http://."""
    s = requests.Session()
    s.trust_env = False
    s.mount("http://", adapter)
    return s


def main(argv: list[str] | None = None) -> None:
    """Run the interleaved benchmark and print a markdown table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=400, help="calls per variant per round (default 400)")
    ap.add_argument("--rounds", type=int, default=12, help="interleaved rounds (default 12)")
    args = ap.parse_args(argv)

    server = subprocess.Popen([sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())
        url = f"http://127.0.0.1:{port}/flush_cache"

        exporter = DiscardExporter()
        provider = TracerProvider()
        provider.add_span_processor(BatchSpanProcessor(exporter))
        sampled = TracerProvider(sampler=ParentBased(TraceIdRatioBased(0.1)))
        sampled.add_span_processor(BatchSpanProcessor(DiscardExporter()))
        both: list[Observer] = [TracingObserver(provider), MetricsObserver()]
        both_sampled: list[Observer] = [TracingObserver(sampled), MetricsObserver()]
        noop_tracing: list[Observer] = [TracingObserver(trace.NoOpTracerProvider()), MetricsObserver()]
        variants: dict[str, requests.Session] = {
            "bare HTTPAdapter": session_with(HTTPAdapter(max_retries=0)),
            "ResilientAdapter, no observers": session_with(ResilientAdapter(POLICIES)),
            "ResilientAdapter + metrics + tracing (no SDK)": session_with(ResilientAdapter(POLICIES, observers=noop_tracing)),
            "ResilientAdapter + metrics + tracing (SDK, 10 % sampled)": session_with(ResilientAdapter(POLICIES, observers=both_sampled)),
            "ResilientAdapter + metrics + tracing (SDK)": session_with(ResilientAdapter(POLICIES, observers=both)),
        }

        def run(session: requests.Session, n: int) -> tuple[float, float]:
            post: Callable[..., requests.Response] = session.post
            c0, t0 = time.process_time(), time.perf_counter()
            for _ in range(n):
                r = post(url, data=b"{}", timeout=5)
                if r.status_code != 200:
                    raise RuntimeError(f"unexpected status {r.status_code}")
            return (time.perf_counter() - t0) / n, (time.process_time() - c0) / n

        for s in variants.values():  # warm up: connections, caches, lazy imports
            run(s, 50)
        per_call: dict[str, list[float]] = {name: [] for name in variants}
        cpu_per_call: dict[str, list[float]] = {name: [] for name in variants}
        order = list(variants)
        rng = random.Random(1)
        started = time.perf_counter()
        for _ in range(args.rounds):
            rng.shuffle(order)
            for name in order:
                wall, cpu = run(variants[name], args.calls)
                per_call[name].append(wall)
                cpu_per_call[name].append(cpu)
        elapsed = time.perf_counter() - started
        provider.shutdown()
        sampled.shutdown()
    finally:
        server.terminate()
        server.wait(10)

    bare = statistics.median(per_call["bare HTTPAdapter"])
    bare_cpu = statistics.median(cpu_per_call["bare HTTPAdapter"])
    print(f"<!-- python {platform.python_version()}, {platform.machine()}, {os.cpu_count()} CPUs; "
          f"{args.rounds} rounds x {args.calls} calls per variant, interleaved; {elapsed:.1f} s; "
          f"{exporter.exported} spans exported -->")  # fmt: skip
    print()
    print("| variant | wall per call, median (us) | min-max round (us) | wall ratio to bare | client CPU per call (us) | CPU ratio |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, values in per_call.items():
        med, cpu = statistics.median(values), statistics.median(cpu_per_call[name])
        print(
            f"| {name} | {med * 1e6:.0f} | {min(values) * 1e6:.0f}-{max(values) * 1e6:.0f} | {med / bare:.2f}x "
            f"| {cpu * 1e6:.0f} | {cpu / bare_cpu:.2f}x |"
        )
    both_ratio = statistics.median(per_call["ResilientAdapter + metrics + tracing (SDK)"]) / bare
    print()
    print(f"Target: both observers (SDK) <= 1.25x bare. Result: {both_ratio:.2f}x ({'met' if both_ratio <= 1.25 else 'MISSED'}).")


if __name__ == "__main__":
    main()
