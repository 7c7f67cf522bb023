"""Label cardinality: 10,000 real calls to distinct raw paths -> how many label sets the metrics hold.

Run: ``python benchmarks/bench_label_cardinality.py [--calls 10000]``

A keep-alive HTTP/1.1 server in its own process on 127.0.0.1 answers every
request 200. A ``resilient_session`` with a ``MetricsObserver`` sends
``--calls`` requests, each to a distinct raw path (``/v1/models/model-17``,
``/engines/e18/flush_cache``, ``/jobs/19/steps/133``, ...) matching one of
three policy templates. The table counts, per ``cpr_`` metric, the label sets
(series) in the exposition, next to what labelling by the raw path would
have produced, plus the exposition's size.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

from _loopback import SERVER
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from resilience.adapters.requests import resilient_session
from resilience.policy import EndpointPolicy, PolicyTable
from resilience.telemetry.metrics import MetricsObserver

TEMPLATES = PolicyTable({
    "GET /v1/models/{model}": EndpointPolicy(),
    "POST /engines/{engine}/flush_cache": EndpointPolicy(),
    "GET /jobs/{job}/steps/{step}": EndpointPolicy(),
})  # fmt: skip


def raw_request(i: int) -> tuple[str, str]:
    """The i-th distinct (method, raw path)."""
    choices = [("GET", f"/v1/models/model-{i}"), ("POST", f"/engines/e{i}/flush_cache"), ("GET", f"/jobs/{i}/steps/{i * 7}")]
    return choices[i % 3]


def main(argv: list[str] | None = None) -> None:
    """Send the calls, count label sets, print a markdown table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=10_000, help="calls, each to a distinct raw path (default 10000)")
    args = ap.parse_args(argv)

    server = subprocess.Popen([sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        base = f"http://127.0.0.1:{int(server.stdout.readline())}"
        observer = MetricsObserver()
        session = resilient_session(TEMPLATES, observers=[observer])
        session.trust_env = False
        raw_paths = set()
        t0 = time.perf_counter()
        for i in range(args.calls):
            method, path = raw_request(i)
            raw_paths.add(path)
            response = session.request(method, base + path, timeout=5)
            if response.status_code != 200:
                raise RuntimeError(f"unexpected status {response.status_code} for {path}")
        elapsed = time.perf_counter() - t0
    finally:
        server.terminate()
        server.wait(10)

    text = generate_latest(observer.registry).decode()
    series: dict[str, set[frozenset[tuple[str, str]]]] = {}
    endpoints: set[str] = set()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.endswith("_created"):
                continue
            labels = {k: v for k, v in s.labels.items() if k != "le"}
            series.setdefault(family.name, set()).add(frozenset(labels.items()))
            if "endpoint" in labels:
                endpoints.add(labels["endpoint"])

    print(f"<!-- {args.calls} real calls to {len(raw_paths)} distinct raw paths over 3 templates in {elapsed:.1f} s -->")
    print()
    print("| metric | label sets | label sets if labelled by raw path |")
    print("|---|---:|---:|")
    for name in ("cpr_requests", "cpr_attempts", "cpr_attempt_duration_seconds"):
        print(f"| {name} | {len(series.get(name, ()))} | {len(raw_paths)} |")
    print(f"| distinct `endpoint` values | {len(endpoints)} | {len(raw_paths)} |")
    print()
    print(f"Endpoint label values: {', '.join(sorted(endpoints))}. Exposition size: {len(text.encode())} bytes.")


if __name__ == "__main__":
    main()
