"""On the success path the adapter is invisible: requests still behaves as requests."""

from __future__ import annotations

import ssl
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests
import trustme
from pytest_httpserver import HTTPServer
from urllib3.util import Timeout as Urllib3Timeout
from werkzeug import Request, Response

from resilience import AmbiguousOutcome, EndpointPolicy, PolicyTable, RetryPolicy
from resilience.adapters.requests import resilient_session
from tests.conftest import SHORT_TIMEOUT
from tests.servers import Hang, Reply, scripted


@pytest.fixture
def session() -> Iterator[requests.Session]:
    s = resilient_session(PolicyTable({"GET /flaky": EndpointPolicy(retry=RetryPolicy(max_attempts=3, base_s=0.01, cap_s=0.02))}))
    yield s
    s.close()


def test_hooks_run_once_per_logical_call(httpserver: HTTPServer, session: requests.Session) -> None:
    """Response hooks see the final response once, not each attempt."""
    httpserver.expect_ordered_request("/flaky").respond_with_data("", status=502)
    httpserver.expect_ordered_request("/flaky").respond_with_data("fine")
    calls: list[int] = []
    r = session.get(httpserver.url_for("/flaky"), hooks={"response": lambda resp, **kw: calls.append(resp.status_code)})
    assert r.text == "fine" and calls == [200]


def test_redirects_followed(httpserver: HTTPServer, session: requests.Session) -> None:
    """Redirects are followed by the session as usual, with history."""
    httpserver.expect_request("/old").respond_with_data("", status=302, headers={"Location": "/new"})
    httpserver.expect_request("/new").respond_with_data("moved")
    r = session.get(httpserver.url_for("/old"))
    assert r.text == "moved" and [h.status_code for h in r.history] == [302]


def test_auth_and_cookies(httpserver: HTTPServer, session: requests.Session) -> None:
    """Basic auth headers and cookies set by the server are sent as usual."""
    httpserver.expect_request("/login").respond_with_data("", headers={"Set-Cookie": "sid=abc; Path=/"})

    def check(request: Request) -> Response:
        return Response(f"{request.authorization.username if request.authorization else None}:{request.cookies.get('sid')}")

    httpserver.expect_request("/me").respond_with_handler(check)
    session.get(httpserver.url_for("/login"))
    assert session.get(httpserver.url_for("/me"), auth=("alice", "pw")).text == "alice:abc"


def test_streaming_response(httpserver: HTTPServer, session: requests.Session) -> None:
    """stream=True hands back an unread body that iterates in chunks."""
    httpserver.expect_request("/stream").respond_with_data(b"x" * 100_000)
    with session.get(httpserver.url_for("/stream"), stream=True) as r:
        assert r.raw is not None and not r.raw.closed
        assert sum(len(c) for c in r.iter_content(8192)) == 100_000


def test_timeout_argument_is_honoured(session: requests.Session) -> None:
    """A plain timeout= bounds the call when no policy deadline applies."""
    policy = EndpointPolicy(retry=RetryPolicy(max_attempts=1), attempt_timeout_s=None, deadline_s=None)
    s = resilient_session(PolicyTable({"GET /slow": policy}))
    with scripted(Hang(3)) as srv:
        with pytest.raises(requests.Timeout):
            s.get(f"{srv.url}/slow", timeout=SHORT_TIMEOUT)
        with pytest.raises(requests.Timeout):
            s.get(f"{srv.url}/slow", timeout=(1.0, SHORT_TIMEOUT))


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[HTTPServer, Path]]:
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    cert.configure_cert(ctx)
    ca_file = tmp_path_factory.mktemp("tls") / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    server = HTTPServer(host="127.0.0.1", port=0, ssl_context=ctx)
    server.start()
    try:
        yield server, ca_file
    finally:
        server.clear()
        server.stop()


def test_verify_uses_given_ca_and_rejects_unknown(tls_server: tuple[HTTPServer, Path], session: requests.Session) -> None:
    """verify= works: a trusted CA succeeds; an untrusted cert fails at once with SSLError, never retried."""
    server, ca_file = tls_server
    server.expect_request("/secure").respond_with_data("tls ok")
    assert session.get(server.url_for("/secure"), verify=str(ca_file)).text == "tls ok"
    before = len(server.log)
    with pytest.raises(requests.exceptions.SSLError):
        session.get(server.url_for("/secure"))
    assert len(server.log) == before


def test_environment_proxies_used(monkeypatch: pytest.MonkeyPatch, session: requests.Session) -> None:
    """HTTP_PROXY from the environment routes the request through the (loopback) proxy."""
    with scripted(Reply(200, b"via proxy")) as proxy:
        monkeypatch.setenv("HTTP_PROXY", proxy.url)
        r = session.get("http://127.0.0.1:9/target")
        assert r.text == "via proxy"
        assert proxy.seen[0].path == "http://127.0.0.1:9/target"


def test_one_adapter_shared_by_16_threads(httpserver: HTTPServer) -> None:
    """Sixteen threads sharing one adapter each get their own right answer, retries included."""
    lock = threading.Lock()
    counts: dict[str, int] = {}

    def handler(request: Request) -> Response:
        key = request.args["i"]
        with lock:
            counts[key] = counts.get(key, 0) + 1
            first = counts[key] == 1
        return Response("", status=502) if first else Response(f"answer-{key}")

    httpserver.expect_request("/flaky").respond_with_handler(handler)
    s = resilient_session(
        PolicyTable({"GET /flaky": EndpointPolicy(retry=RetryPolicy(max_attempts=3, base_s=0.001, cap_s=0.01))}),
        retry_budget=None,
        breaker=None,  # 16 simultaneous first-attempt 502s would rightly open it
        pool_maxsize=16,
    )
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda i: s.get(httpserver.url_for("/flaky"), params={"i": i}).text, range(64)))
    assert results == [f"answer-{i}" for i in range(64)]
    assert all(c == 2 for c in counts.values())


LATE_S = 1.0
"""Seconds a slow endpoint takes to answer: longer than the short defaults below, shorter than the caller's timeouts."""
SHORT_DEFAULTS = PolicyTable(default=lambda method: EndpointPolicy(idempotent=False, attempt_timeout_s=0.3, deadline_s=0.5))
"""No entries, and defaults that would cut a slow answer if they overruled the caller."""


@pytest.fixture
def slow(httpserver: HTTPServer) -> str:
    def late(_request: Request) -> Response:
        time.sleep(LATE_S)
        return Response("late")

    httpserver.expect_request("/slow").respond_with_handler(late)
    return httpserver.url_for("/slow")


@pytest.mark.parametrize(
    "timeout", [None, 3.0, (1.0, 3.0), Urllib3Timeout(connect=1.0, read=3.0)], ids=["none", "float", "pair", "urllib3"]
)
def test_caller_timeout_beats_the_defaults_for_every_shape(slow: str, timeout: object) -> None:
    """Without a table entry, the caller's timeout= governs as in plain requests: a slow POST within it succeeds."""
    s = resilient_session(SHORT_DEFAULTS)
    r = s.post(slow, json={}, timeout=timeout)
    assert r.text == "late" and len(r.attempts) == 1  # type: ignore[attr-defined]


def test_short_caller_timeout_raises_requests_read_timeout() -> None:
    """A POST whose read outlasts the caller's timeout raises requests' own ReadTimeout once, not a resilience error."""
    with scripted(Hang(3)) as srv:
        with pytest.raises(requests.exceptions.ReadTimeout) as info:
            resilient_session().post(f"{srv.url}/x", json={}, timeout=(1.0, SHORT_TIMEOUT))
        assert type(info.value) is requests.exceptions.ReadTimeout and srv.count == 1


def test_explicit_entry_beats_the_caller_timeout() -> None:
    """A table entry's attempt_timeout_s is the endpoint owner's word: it wins over timeout=."""
    entry = EndpointPolicy(idempotent=False, attempt_timeout_s=SHORT_TIMEOUT, deadline_s=2)
    with scripted(Hang(3)) as srv:
        with pytest.raises(AmbiguousOutcome):
            resilient_session(PolicyTable({"POST /release": entry})).post(f"{srv.url}/release", json={}, timeout=60)
        assert srv.count == 1


@pytest.mark.parametrize("timeout", [(3, 4, 5), "foo", (1, "x"), -1, (None, 0)], ids=["triple", "str", "pair-str", "negative", "zero"])
def test_invalid_timeouts_raise_requests_own_errors(httpserver: HTTPServer, timeout: object) -> None:
    """An invalid timeout= raises the same error type and message as plain requests."""
    httpserver.expect_request("/x").respond_with_data("ok")
    url = httpserver.url_for("/x")
    with requests.Session() as plain, pytest.raises(ValueError) as expected:
        plain.get(url, timeout=timeout)  # type: ignore[arg-type]
    with pytest.raises(ValueError) as got:
        resilient_session().get(url, timeout=timeout)  # type: ignore[arg-type]
    assert str(expected.value) and (type(got.value), str(got.value)) == (type(expected.value), str(expected.value))
