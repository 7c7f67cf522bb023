"""MetricsObserver: the metric contract, counts after real calls, bounded labels, the exporter."""

from __future__ import annotations

import logging
import re
import socket

import pytest
import requests
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as openmetrics_latest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as openmetrics_families
from prometheus_client.parser import text_string_to_metric_families
from pytest_httpserver import HTTPServer

from resilience.adapters.requests import resilient_session
from resilience.barrier.journal import RestartBudget
from resilience.barrier.state import PhaseEnded, PhaseFailure, TransitionEnded
from resilience.engine_contract import HoldChanged
from resilience.events import BreakerRejected, BreakerTransitioned, RetryBudgetExhaustedEvent, RetryScheduled
from resilience.outcome import CallOutcome, Outcome
from resilience.policy import EndpointPolicy, PolicyTable, RetryPolicy
from resilience.telemetry.metrics import MetricsObserver, start_metrics_server
from tests.telemetry.events_factory import ENGINE, attempt_ended, call_ended

CONTRACT = {
    "cpr_requests": ("counter", {"endpoint", "method", "outcome"}),
    "cpr_attempts": ("counter", {"endpoint", "engine", "status"}),
    "cpr_attempt_duration_seconds": ("histogram", {"endpoint"}),
    "cpr_retries": ("counter", {"endpoint", "reason"}),
    "cpr_breaker_state": ("gauge", {"engine"}),
    "cpr_breaker_rejections": ("counter", {"endpoint", "engine"}),
    "cpr_retry_budget_tokens": ("gauge", {"engine"}),
    "cpr_retry_budget_exhausted": ("counter", {"endpoint", "engine"}),
    "cpr_barrier_phase_duration_seconds": ("histogram", {"transition", "phase"}),
    "cpr_barrier_phase_failures": ("counter", {"transition", "phase"}),
    "cpr_barrier_transitions": ("counter", {"transition", "result"}),
    "cpr_engines_held_paused": ("gauge", {"engine"}),
    "cpr_barrier_transition_last_end_timestamp_seconds": ("gauge", {"transition"}),
    "cpr_journal_commit_duration_seconds": ("histogram", {"op"}),
    "cpr_restarts": ("counter", {"cause"}),
    "cpr_restart_budget_limit": ("gauge", set()),
    "cpr_restart_budget_remaining": ("gauge", set()),
    "cpr_restart_budget_planned_run_seconds": ("gauge", set()),
}
"""The metric contract: family name (as the parser reports it, ``_total`` stripped) -> (type, label names)."""

ATTEMPT_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 30.0]


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample of an exposition, keyed by (sample name, labels)."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(text: str, name: str, **labels: str) -> float | None:
    """One sample's value, or None when absent."""
    return samples(text).get((name, frozenset(labels.items())))


def feed_everything(obs: MetricsObserver) -> None:
    """One event of every kind the observer counts."""
    ep = "POST /flush_cache"
    obs(call_ended(method="POST", endpoint=ep, engine=ENGINE, outcome=CallOutcome.RETRIED_SUCCESS, attempts=2, retry_budget_tokens=8.5))
    obs(attempt_ended(method="POST", endpoint=ep, engine=ENGINE, status=502, outcome=Outcome.RETRYABLE, error_type="502", duration_s=0.02))
    obs(attempt_ended(method="POST", endpoint=ep, engine=ENGINE, attempt=1, status=200, duration_s=0.003))
    obs(RetryScheduled(call_id=1, attempt=0, endpoint="POST /flush_cache", engine=ENGINE, reason="status_502", delay_s=0.1))
    obs(BreakerTransitioned(engine=ENGINE, from_state="closed", to_state="open", reason="consecutive_failures"))
    obs(BreakerRejected(call_id=2, endpoint="POST /flush_cache", engine=ENGINE))
    obs(RetryBudgetExhaustedEvent(call_id=3, endpoint="POST /flush_cache", engine=ENGINE, tokens=0.2))
    failures = (
        PhaseFailure(engine=ENGINE, error_type="ReadTimeout", message="timed out"),
        PhaseFailure(engine="http://127.0.0.2:30000", error_type="X", message="y"),
    )
    engines = (ENGINE, "http://127.0.0.2:30000")
    obs(PhaseEnded(transition_id=1, transition="offload", phase="flush", engines=engines, duration_s=1.5, failures=failures))
    obs(TransitionEnded(transition_id=1, transition="offload", engines=(ENGINE,), duration_s=2.0, ok=False, failed_phase="flush"))
    obs(HoldChanged(engine=ENGINE, reason="offload", acquired=True, holds=("offload", "weight_sync")))


def test_exposition_has_exactly_the_contract(tmp_path: pytest.TempPathFactory) -> None:
    """Every cpr_ family, its type and its label names are exactly the contract's, and nothing else is exported."""
    budget = RestartBudget(3, path=f"{tmp_path}/budget.json")
    budget.record("oom")
    obs = MetricsObserver(restart_budget=budget)
    feed_everything(obs)
    # OpenMetrics keeps prometheus-client's ``_created`` companion samples inside their counter/histogram family.
    text = openmetrics_latest(obs.registry).decode()  # type: ignore[no-untyped-call]
    families = {f.name: f for f in openmetrics_families(text)}  # type: ignore[no-untyped-call]
    assert set(families) == set(CONTRACT)
    for name, (kind, labels) in CONTRACT.items():
        family = families[name]
        assert family.type == kind, name
        assert family.samples, name
        for s in family.samples:
            assert set(s.labels) - {"le"} == labels, (name, s.labels)


def test_event_counts(tmp_path: pytest.TempPathFactory) -> None:
    """Each event moves exactly its metric, with the contract's label values."""
    obs = MetricsObserver()
    feed_everything(obs)
    text = generate_latest(obs.registry).decode()
    ep = "POST /flush_cache"
    assert value(text, "cpr_requests_total", endpoint=ep, method="POST", outcome="retried_success") == 1
    assert value(text, "cpr_attempts_total", endpoint=ep, engine=ENGINE, status="502") == 1
    assert value(text, "cpr_attempts_total", endpoint=ep, engine=ENGINE, status="200") == 1
    assert value(text, "cpr_attempt_duration_seconds_count", endpoint=ep) == 2
    assert value(text, "cpr_attempt_duration_seconds_bucket", endpoint=ep, le="0.005") == 1
    assert value(text, "cpr_retries_total", endpoint=ep, reason="status_502") == 1
    assert value(text, "cpr_breaker_state", engine=ENGINE) == 2
    assert value(text, "cpr_breaker_rejections_total", endpoint=ep, engine=ENGINE) == 1
    assert value(text, "cpr_retry_budget_tokens", engine=ENGINE) == 8.5
    assert value(text, "cpr_retry_budget_exhausted_total", endpoint=ep, engine=ENGINE) == 1
    assert value(text, "cpr_barrier_phase_duration_seconds_count", transition="offload", phase="flush") == 1
    assert value(text, "cpr_barrier_phase_failures_total", transition="offload", phase="flush") == 2
    assert value(text, "cpr_barrier_transitions_total", transition="offload", result="failed") == 1
    assert value(text, "cpr_engines_held_paused", engine=ENGINE) == 2
    assert "cpr_restarts_total" not in text  # no budget attached: nothing published


def test_attempt_duration_buckets_are_the_contract() -> None:
    """cpr_attempt_duration_seconds uses the contract's 15 buckets (plus +Inf)."""
    obs = MetricsObserver()
    obs(attempt_ended())
    text = generate_latest(obs.registry).decode()
    les = [dict(k[1])["le"] for k in samples(text) if k[0] == "cpr_attempt_duration_seconds_bucket"]
    assert sorted(float(le) for le in les) == [*ATTEMPT_BUCKETS, float("inf")]


def test_breaker_state_values() -> None:
    """cpr_breaker_state is 0 closed, 1 half_open, 2 open."""
    obs = MetricsObserver()
    text = ""
    for state, expected in (("open", 2), ("half_open", 1), ("closed", 0)):
        obs(BreakerTransitioned(engine=ENGINE, from_state="x", to_state=state, reason="r"))
        text = generate_latest(obs.registry).decode()
        assert value(text, "cpr_breaker_state", engine=ENGINE) == expected
    assert text


def test_transport_failures_get_bounded_status_labels() -> None:
    """Attempts without a response are labelled connect_error, read_timeout, connection_reset or error."""
    obs = MetricsObserver()
    for error_type, sent, outcome in (
        ("ConnectTimeout", False, Outcome.RETRYABLE),
        ("ConnectionError", False, Outcome.RETRYABLE),
        ("ReadTimeout", True, Outcome.AMBIGUOUS),
        ("ConnectionError", True, Outcome.AMBIGUOUS),
        ("ChunkedEncodingError", True, Outcome.FATAL),
        ("WeirdError", True, Outcome.FATAL),
    ):
        obs(attempt_ended(status=None, outcome=outcome, error_type=error_type, sent=sent))
    text = generate_latest(obs.registry).decode()
    got = {dict(k[1])["status"]: v for k, v in samples(text).items() if k[0] == "cpr_attempts_total"}
    assert got == {"connect_error": 2, "read_timeout": 1, "connection_reset": 2, "error": 1}


def test_real_calls_count_exactly_the_502s(httpserver: HTTPServer) -> None:
    """After real calls answered 502, 502, 200 and 502, 200 the attempts counter shows exactly three 502s."""
    policies = PolicyTable({"POST /flush": EndpointPolicy(idempotent=True, retry=RetryPolicy(max_attempts=5, base_s=0.001, cap_s=0.01))})
    for status in (502, 502, 200, 502, 200):
        httpserver.expect_ordered_request("/flush", method="POST").respond_with_data("", status=status)
    obs = MetricsObserver()
    session = resilient_session(policies, observers=[obs])
    for _ in range(2):
        assert session.post(httpserver.url_for("/flush"), data=b"x", timeout=5).status_code == 200
    httpserver.check_assertions()
    server = start_metrics_server(registry=obs.registry)
    try:
        text = requests.get(f"http://127.0.0.1:{server.port}/metrics", timeout=5).text
    finally:
        server.close()
    engine = f"http://{httpserver.host}:{httpserver.port}"
    assert value(text, "cpr_attempts_total", endpoint="POST /flush", engine=engine, status="502") == 3
    assert value(text, "cpr_attempts_total", endpoint="POST /flush", engine=engine, status="200") == 2
    assert value(text, "cpr_retries_total", endpoint="POST /flush", reason="status_502") == 3
    assert value(text, "cpr_requests_total", endpoint="POST /flush", method="POST", outcome="retried_success") == 2
    assert value(text, "cpr_attempt_duration_seconds_count", endpoint="POST /flush") == 5
    assert value(text, "cpr_retry_budget_tokens", engine=engine) is not None


TEMPLATES = PolicyTable({
    "GET /v1/models/{model}": EndpointPolicy(),
    "POST /engines/{engine}/flush_cache": EndpointPolicy(),
    "GET /jobs/{job}/steps/{step}": EndpointPolicy(),
})  # fmt: skip


def raw_path(i: int) -> tuple[str, str]:
    """The i-th of 10,000 distinct raw requests spread over three templates."""
    return [("GET", f"/v1/models/model-{i}"), ("POST", f"/engines/e{i}/flush_cache"), ("GET", f"/jobs/{i}/steps/{i * 7}")][i % 3]


def test_distinct_raw_paths_stay_a_few_label_values() -> None:
    """10,000 calls to distinct raw paths matching three templates give exactly three endpoint label values."""
    obs = MetricsObserver()
    for i in range(10_000):
        method, path = raw_path(i)
        endpoint = TEMPLATES.match(method, path).endpoint
        obs(attempt_ended(call_id=i, method=method, endpoint=endpoint))
        obs(call_ended(call_id=i, method=method, endpoint=endpoint))
    s = samples(generate_latest(obs.registry).decode())
    endpoints = {dict(labels)["endpoint"] for name, labels in s if "endpoint" in dict(labels)}
    assert endpoints == {"GET /v1/models/{model}", "POST /engines/{engine}/flush_cache", "GET /jobs/{job}/steps/{step}"}
    assert len([k for k in s if k[0] == "cpr_requests_total"]) == 3


def test_real_distinct_paths_use_the_template(httpserver: HTTPServer) -> None:
    """Real calls to 50 distinct raw paths are labelled by their one template."""
    httpserver.expect_request(re.compile(r"^/v1/models/.+$"), method="GET").respond_with_data("ok")
    obs = MetricsObserver()
    session = resilient_session(TEMPLATES, observers=[obs])
    for i in range(50):
        assert session.get(httpserver.url_for(f"/v1/models/model-{i}"), timeout=5).status_code == 200
    s = samples(generate_latest(obs.registry).decode())
    endpoints = {dict(labels)["endpoint"] for name, labels in s if "endpoint" in dict(labels)}
    assert endpoints == {"GET /v1/models/{model}"}


def test_overflowing_label_values_become_other(caplog: pytest.LogCaptureFixture) -> None:
    """Past max_label_values distinct endpoints, further ones are labelled ``other`` and a warning is logged once."""
    obs = MetricsObserver(max_label_values=3)
    with caplog.at_level(logging.WARNING, logger="resilience.telemetry"):
        for i in range(10):
            obs(call_ended(call_id=i, method="GET", endpoint=f"GET /raw/{i}"))
    got = {dict(k[1])["endpoint"]: v for k, v in samples(generate_latest(obs.registry).decode()).items()
           if k[0] == "cpr_requests_total"}  # fmt: skip
    assert got == {"GET /raw/0": 1, "GET /raw/1": 1, "GET /raw/2": 1, "other": 7}
    assert caplog.text.count("distinct endpoint label values") == 1


def test_engine_user_info_never_becomes_a_label() -> None:
    """An engine with user-info is published without it."""
    obs = MetricsObserver()
    obs(HoldChanged(engine="http://u:SECRET@127.0.0.9:30000", reason="offload", acquired=True, holds=("offload",)))
    text = generate_latest(obs.registry).decode()
    assert "SECRET" not in text
    assert value(text, "cpr_engines_held_paused", engine="http://127.0.0.9:30000") == 1


def test_observer_never_raises(caplog: pytest.LogCaptureFixture) -> None:
    """A failing metric operation is logged as a warning, never raised to the caller."""
    obs = MetricsObserver()
    bad = attempt_ended(duration_s="slow")  # type: ignore[arg-type]
    with caplog.at_level(logging.WARNING, logger="resilience.telemetry"):
        obs(bad)
    assert "MetricsObserver failed on AttemptEnded" in caplog.text


def test_registries_are_private_by_default() -> None:
    """Two observers coexist in one process: each owns a fresh registry unless given one."""
    a, b = MetricsObserver(), MetricsObserver()
    assert a.registry is not b.registry
    shared = CollectorRegistry()
    assert MetricsObserver(registry=shared).registry is shared
    with pytest.raises(ValueError, match="Duplicated"):
        MetricsObserver(registry=shared)
    with pytest.raises(ValueError, match="max_label_values must be >= 1, but was 0"):
        MetricsObserver(max_label_values=0)


def test_metrics_server_binds_loopback_and_stops() -> None:
    """start_metrics_server binds 127.0.0.1 on a free port, serves the registry, and stops on close()."""
    obs = MetricsObserver()
    obs(RetryScheduled(call_id=1, attempt=0, endpoint="GET /x", engine=ENGINE, reason="status_503", delay_s=0.1))
    server, port = start_metrics_server(registry=obs.registry)
    try:
        assert port > 0
        assert server.server_address[0] == "127.0.0.1"
        body = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
        assert 'cpr_retries_total{endpoint="GET /x",reason="status_503"} 1.0' in body
    finally:
        server.shutdown()
        server.server_close()
    with socket.socket() as probe, pytest.raises(OSError):
        probe.settimeout(1)
        probe.connect(("127.0.0.1", port))


ZERO_SERIES = ("cpr_breaker_state", "cpr_breaker_rejections_total", "cpr_retry_budget_exhausted_total", "cpr_barrier_phase_failures_total")
"""The series a healthy run never moves: they must still exist (at 0) so dashboards show "closed" / 0, not "No data"."""


def scrape(obs: MetricsObserver) -> str:
    """The exposition as a real scrape of a loopback /metrics serving ``obs.registry`` returns it."""
    server = start_metrics_server(registry=obs.registry)
    try:
        return requests.get(f"http://127.0.0.1:{server.port}/metrics", timeout=5).text
    finally:
        server.close()


def test_healthy_real_calls_publish_zero_series(httpserver: HTTPServer) -> None:
    """After healthy real calls (no breaker event, no rejection, no exhaustion) the scrape shows those series at 0."""
    httpserver.expect_request("/flush", method="POST").respond_with_data("ok")
    obs = MetricsObserver()
    session = resilient_session(PolicyTable({"POST /flush": EndpointPolicy(idempotent=True)}), observers=[obs])
    assert session.post(httpserver.url_for("/flush"), data=b"x", timeout=5).status_code == 200
    obs(
        PhaseEnded(transition_id=1, transition="offload", phase="pause", engines=(ENGINE,), duration_s=0.1)
    )  # a barrier phase that failed on no engine
    text = scrape(obs)
    engine = f"http://{httpserver.host}:{httpserver.port}"
    assert value(text, "cpr_attempts_total", endpoint="POST /flush", engine=engine, status="200") == 1  # the call was counted
    assert value(text, "cpr_breaker_state", engine=engine) == 0
    assert value(text, "cpr_breaker_state", engine=ENGINE) == 0  # named by the phase
    assert value(text, "cpr_breaker_rejections_total", endpoint="POST /flush", engine=engine) == 0
    assert value(text, "cpr_retry_budget_exhausted_total", endpoint="POST /flush", engine=engine) == 0
    assert value(text, "cpr_barrier_phase_failures_total", transition="offload", phase="pause") == 0


def test_declare_creates_every_pair_before_any_call() -> None:
    """declare() creates the zero series of every engine and endpoint x engine pair, across calls."""
    obs = MetricsObserver()
    assert not [k for k in samples(scrape(obs)) if k[0] in ZERO_SERIES]  # nothing before
    obs.declare(engines=["http://127.0.0.1:1", "http://u:SECRET@127.0.0.1:2"], endpoints=["POST /a"])
    obs.declare(endpoints=["GET /b"])
    text = scrape(obs)
    assert "SECRET" not in text
    got = samples(text)
    engines = {"http://127.0.0.1:1", "http://127.0.0.1:2"}
    assert {dict(k[1])["engine"]: v for k, v in got.items() if k[0] == "cpr_breaker_state"} == dict.fromkeys(engines, 0.0)
    for name in ("cpr_breaker_rejections_total", "cpr_retry_budget_exhausted_total"):
        pairs = {(dict(k[1])["endpoint"], dict(k[1])["engine"]): v for k, v in got.items() if k[0] == name}
        assert pairs == {(ep, en): 0.0 for ep in ("POST /a", "GET /b") for en in engines}, name


def test_first_sight_never_overwrites_an_open_breaker() -> None:
    """A breaker that opened before the engine's first attempt stays open (2), not reset to closed by the zero series."""
    obs = MetricsObserver()
    obs(BreakerTransitioned(engine=ENGINE, from_state="closed", to_state="open", reason="consecutive_failures"))
    obs(attempt_ended(engine=ENGINE, status=200, outcome=Outcome.SUCCESS))
    obs.declare(engines=[ENGINE])
    assert value(scrape(obs), "cpr_breaker_state", engine=ENGINE) == 2


def test_zero_series_are_bounded_like_the_labels() -> None:
    """Past max_label_values engines no zero series is created for ``other`` (only real events may use it)."""
    obs = MetricsObserver(max_label_values=2)
    for i in range(6):
        obs(attempt_ended(call_id=i, engine=f"http://127.0.0.1:{i + 1}"))
    obs.declare(engines=[f"http://127.0.0.1:{i}" for i in range(100, 110)])
    got = samples(scrape(obs))
    states = {dict(k[1])["engine"] for k in got if k[0] == "cpr_breaker_state"}
    assert states == {"http://127.0.0.1:1", "http://127.0.0.1:2"}
    pairs = {dict(k[1])["engine"] for k in got if k[0] == "cpr_breaker_rejections_total"}
    assert pairs == states


def test_the_telemetry_observers_hear_what_they_use_and_what_a_subclass_overrides() -> None:
    """``CallObserver.hears``: the core calls each observer only for the moments it uses (``tests/core/test_events.py``)."""
    from opentelemetry.trace import NoOpTracerProvider

    from resilience.telemetry.tracing import TracingObserver

    class Counting(MetricsObserver):
        def call_started(self, call_id: int, method: str, endpoint: str, engine: str, deadline_s: float | None) -> None:
            pass

    moments = ("call_started", "attempt_started", "attempt_ended", "call_ended")
    assert [MetricsObserver().hears(m) for m in moments] == [False, False, True, True]
    assert [Counting().hears(m) for m in moments] == [True, False, True, True]
    assert [TracingObserver(NoOpTracerProvider()).hears(m) for m in moments] == [False, True, False, False]  # baggage only
