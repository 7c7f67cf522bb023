"""FaultPlan / FaultProxy: real sockets on 127.0.0.1, a tiny real upstream, no mocks."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import requests

from resilience.testing.faults import (
    AMBIGUOUS_PATHS,
    CONTROL_PATHS,
    VLLM_AMBIGUOUS_PATHS,
    VLLM_CONTROL_PATHS,
    FaultDecider,
    FaultPlan,
    FaultPlanError,
    FaultProxy,
    FaultRule,
)

TIMEOUT = 5.0  # seconds: bound on every client call and wait in this file


class Upstream:
    """A tiny engine: counts requests per path, echoes bodies, streams SSE on /generate_stream."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counts: Counter[str] = Counter()
        self.targets: list[str] = []
        self.headers: list[dict[str, str]] = []
        self.go = threading.Event()
        self.go_timed_out: bool | None = None
        self.slow_go = threading.Event()
        self.slow_timed_out: bool | None = None
        upstream = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _serve(self) -> None:
                path = self.path.split("?", 1)[0]
                n = int(self.headers.get("Content-Length", "0"))
                body = self.rfile.read(n)
                with upstream.lock:
                    upstream.counts[path] += 1
                    upstream.targets.append(self.path)
                    upstream.headers.append(dict(self.headers.items()))
                if path == "/generate_stream":
                    self._stream()
                    return
                if path == "/slow":  # the engine acts only once the test says go
                    upstream.slow_timed_out = not upstream.slow_go.wait(TIMEOUT)
                    with upstream.lock:
                        upstream.counts["/slow:done"] += 1
                self.send_response(200)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _stream(self) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()

                def chunk(data: bytes) -> None:
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                    self.wfile.flush()

                chunk(b"data: 1\n\n")
                upstream.go_timed_out = not upstream.go.wait(TIMEOUT)
                chunk(b"data: 2\n\n")
                chunk(b"data: [DONE]\n\n")
                self.wfile.write(b"0\r\n\r\n")

            do_GET = do_POST = _serve

        class Server(ThreadingHTTPServer):
            daemon_threads = True
            block_on_close = False

        self.server = Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def count(self, path: str) -> int:
        with self.lock:
            return self.counts[path]

    def close(self) -> None:
        self.go.set()
        self.slow_go.set()
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(TIMEOUT)


@pytest.fixture
def upstream() -> Iterator[Upstream]:
    up = Upstream()
    try:
        yield up
    finally:
        up.close()


@pytest.fixture
def session() -> Iterator[requests.Session]:
    s = requests.Session()
    s.trust_env = False  # no HTTP_PROXY from the environment
    try:
        yield s
    finally:
        s.close()


def plan(*rules: FaultRule, seed: int = 1, max_streak: int | None = None) -> FaultPlan:
    return FaultPlan(seed=seed, rules=rules, max_streak=max_streak)


def proxy_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("faultproxy")]


def wait_until(pred: Any) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not pred():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


# -- the fault kinds over real connections ---------------------------------------------


def test_status_before_never_reaches_upstream(upstream: Upstream, session: requests.Session) -> None:
    """status_before answers 502 with an empty body and the engine never sees the request."""
    with FaultProxy(upstream.url, plan(FaultRule("/pause_generation", "status_before"))) as proxy:
        r = session.post(proxy.url + "/pause_generation", json={"mode": "abort"}, timeout=TIMEOUT)
        assert (r.status_code, r.content) == (502, b"")
        assert upstream.count("/pause_generation") == 0
        [fault] = proxy.injected
        assert (fault.kind, fault.status, fault.path, fault.method, fault.call_index) == (
            "status_before",
            502,
            "/pause_generation",
            "POST",
            1,
        )
        [seen] = proxy.seen
        assert (seen.fault, seen.client_status, seen.upstream_status, seen.upstream_error) == ("status_before", 502, None, None)
        assert proxy.counts() == {"status_before:502:/pause_generation": 1}


def test_status_after_reaches_upstream_exactly_once(upstream: Upstream, session: requests.Session) -> None:
    """status_after forwards once, drops the engine's 200 and answers 502: the engine acted."""
    with FaultProxy(upstream.url, plan(FaultRule("/release_memory_occupation", "status_after", status=503))) as proxy:
        r = session.post(proxy.url + "/release_memory_occupation", json={"tags": None}, timeout=TIMEOUT)
        assert (r.status_code, r.content) == (503, b"")
        assert upstream.count("/release_memory_occupation") == 1
        [seen] = proxy.seen
        assert (seen.fault, seen.upstream_status, seen.client_status) == ("status_after", 200, 503)


@pytest.mark.parametrize(("kind", "reached"), [("reset_before", 0), ("reset_after", 1)])
def test_reset_gives_connection_error(upstream: Upstream, session: requests.Session, kind: Any, reached: int) -> None:
    """reset_before/reset_after reset the client connection; only reset_after reaches the engine."""
    with FaultProxy(upstream.url, plan(FaultRule("/flush_cache", kind))) as proxy:
        with pytest.raises(requests.ConnectionError):
            session.post(proxy.url + "/flush_cache", data=b"x", timeout=TIMEOUT)
        assert upstream.count("/flush_cache") == reached
        assert [f.kind for f in proxy.injected] == [kind]
        r = session.post(proxy.url + "/other", data=b"after", timeout=TIMEOUT)  # the proxy still serves
        assert r.content == b"after"


def test_drop_after_resets_the_client_before_the_engine_answers(upstream: Upstream, session: requests.Session) -> None:
    """drop_after resets the client once the request is sent; the engine still finishes the call, and settle() waits for it."""
    with FaultProxy(upstream.url, plan(FaultRule("/slow", "drop_after", calls={1}))) as proxy:
        with pytest.raises(requests.ConnectionError) as info:
            session.post(proxy.url + "/slow", data=b"release", timeout=TIMEOUT)
        assert "reset" in str(info.value).lower() or "aborted" in str(info.value).lower()
        wait_until(lambda: upstream.count("/slow") == 1)  # the engine has the request...
        assert upstream.count("/slow:done") == 0  # ...and has not answered: the client was reset before the answer
        assert proxy.settle(timeout=0.2) is False  # still in flight to the engine
        assert proxy.settle(timeout=TIMEOUT, paths={"/pause_generation"}) is True  # only other paths counted
        [seen] = proxy.seen
        assert (seen.fault, seen.client_status, seen.upstream_status) == ("drop_after", None, None)
        upstream.slow_go.set()
        assert proxy.settle(timeout=TIMEOUT) is True
        assert upstream.count("/slow:done") == 1 and upstream.slow_timed_out is False
        [seen] = proxy.seen
        assert (seen.fault, seen.client_status, seen.upstream_status, seen.upstream_error) == ("drop_after", None, 200, None)
        r = session.post(proxy.url + "/slow", data=b"again", timeout=TIMEOUT)  # call 2 is not selected; the proxy still serves
        assert (r.status_code, r.content) == (200, b"again")
        assert upstream.count("/slow") == 2
        assert proxy.counts() == {"drop_after:-:/slow": 1}


def test_hang_after_engine_acts_client_times_out(upstream: Upstream, session: requests.Session) -> None:
    """hang_after: the engine answers, the client never does: a read timeout after sending; the thread ends when the client leaves."""
    with FaultProxy(upstream.url, plan(FaultRule("/resume_memory_occupation", "hang_after"))) as proxy:
        with pytest.raises(requests.ReadTimeout):
            session.post(proxy.url + "/resume_memory_occupation", json={"tags": ["weights"]}, timeout=0.5)
        assert upstream.count("/resume_memory_occupation") == 1  # the engine carried it out
        assert proxy.settle(timeout=TIMEOUT) is True
        [seen] = proxy.seen
        assert (seen.fault, seen.upstream_status, seen.client_status) == ("hang_after", 200, None)
        session.close()
        wait_until(lambda: not [t for t in proxy_threads() if "-conn-" in t])
        assert proxy.counts() == {"hang_after:-:/resume_memory_occupation": 1}


def test_hang_after_is_released_by_stop_within_its_bound(upstream: Upstream, session: requests.Session) -> None:
    """A hang_after request still held is closed by stop(), which returns with every proxy thread joined."""
    proxy = FaultProxy(upstream.url, plan(FaultRule("/continue_generation", "hang_after")))
    proxy.start()
    errors: list[BaseException] = []

    def call() -> None:
        try:
            session.post(proxy.url + "/continue_generation", json={}, timeout=30)
        except BaseException as exc:
            errors.append(exc)

    client = threading.Thread(target=call)
    client.start()
    try:
        wait_until(lambda: upstream.count("/continue_generation") == 1 and proxy.seen and proxy.seen[0].upstream_status == 200)
        assert client.is_alive()  # the engine answered; the client still waits
    finally:
        proxy.stop(timeout=TIMEOUT)
    client.join(TIMEOUT)
    assert not client.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], requests.ConnectionError)
    assert proxy_threads() == []


def test_hang_after_with_delay_closes_without_an_answer(upstream: Upstream, session: requests.Session) -> None:
    """hang_after with a delay closes the connection, unanswered, once the delay passed; the engine acted once."""
    with FaultProxy(upstream.url, plan(FaultRule("/flush_cache", "hang_after", delay=0.2))) as proxy:
        with pytest.raises(requests.ConnectionError):
            session.post(proxy.url + "/flush_cache", data=b"x", timeout=TIMEOUT)
        assert upstream.count("/flush_cache") == 1
        assert [f.kind for f in proxy.injected] == ["hang_after"]


def test_ambiguous_kinds_count_toward_max_streak() -> None:
    """drop_after and hang_after are failures to the client: max_streak lets the next attempt through."""
    for kind in ("drop_after", "hang_after"):
        d = FaultDecider(plan(FaultRule("/p", kind), max_streak=1))
        decisions = [d.decide("/p") for _ in range(4)]
        assert [x.kind for x in decisions] == [kind, None, kind, None]
        assert all(x.forwards for x in decisions)


def test_latency_delays_then_forwards(upstream: Upstream, session: requests.Session) -> None:
    """latency sleeps `delay` seconds, then forwards and relays the engine's answer."""
    with FaultProxy(upstream.url, plan(FaultRule("/resume_memory_occupation", "latency", delay=0.3))) as proxy:
        t0 = time.monotonic()
        r = session.post(proxy.url + "/resume_memory_occupation", data=b"tags", timeout=TIMEOUT)
        assert time.monotonic() - t0 >= 0.3
        assert (r.status_code, r.content) == (200, b"tags")
        assert upstream.count("/resume_memory_occupation") == 1


def test_hang_is_released_by_stop(upstream: Upstream, session: requests.Session) -> None:
    """hang without delay holds the connection until stop(), which closes it."""
    proxy = FaultProxy(upstream.url, plan(FaultRule("/health", "hang")))
    proxy.start()
    errors: list[BaseException] = []

    def call() -> None:
        try:
            session.get(proxy.url + "/health", timeout=30)
        except BaseException as exc:
            errors.append(exc)

    client = threading.Thread(target=call)
    client.start()
    try:
        wait_until(lambda: proxy.injected)
        assert client.is_alive()
    finally:
        proxy.stop()
    client.join(TIMEOUT)
    assert not client.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], requests.ConnectionError)
    assert upstream.count("/health") == 0
    assert proxy_threads() == []


def test_hang_with_delay_closes_after_delay(upstream: Upstream, session: requests.Session) -> None:
    """hang with a delay closes the connection, without an answer, once the delay passed."""
    with FaultProxy(upstream.url, plan(FaultRule("/health", "hang", delay=0.2))) as proxy:
        with pytest.raises(requests.ConnectionError):
            session.get(proxy.url + "/health", timeout=TIMEOUT)
        assert upstream.count("/health") == 0


def test_hang_ends_when_the_client_gives_up(upstream: Upstream, session: requests.Session) -> None:
    """A hung request's connection thread ends once its client closes the connection."""
    with FaultProxy(upstream.url, plan(FaultRule("/health", "hang"))) as proxy:
        with pytest.raises(requests.ReadTimeout):
            session.get(proxy.url + "/health", timeout=0.2)
        session.close()
        wait_until(lambda: not [t for t in proxy_threads() if "-conn-" in t])


def test_window_answers_502_after_trigger_then_passes(upstream: Upstream, session: requests.Session) -> None:
    """After a forwarded trigger, requests to `paths` get 502 for `delay` seconds, then pass."""
    rule = FaultRule("/release_memory_occupation", "window", delay=1.0, paths={"/pause_generation", "/flush_cache"})
    with FaultProxy(upstream.url, plan(rule)) as proxy:

        def post(path: str) -> int:
            return session.post(proxy.url + path, json={}, timeout=TIMEOUT).status_code

        assert post("/pause_generation") == 200
        assert post("/release_memory_occupation") == 200
        t_open = time.monotonic()
        assert [post("/pause_generation"), post("/flush_cache"), post("/pause_generation")] == [502, 502, 502]
        assert post("/continue_generation") == 200  # not in `paths`
        assert time.monotonic() - t_open < 1.0, "loopback too slow for this window"
        assert upstream.count("/pause_generation") == 1 and upstream.count("/flush_cache") == 0
        time.sleep(max(0.0, t_open + 1.05 - time.monotonic()))
        assert post("/pause_generation") == 200
        assert proxy.counts() == {"window:502:/flush_cache": 1, "window:502:/pause_generation": 2}


def test_upstream_refused_is_502_not_injected(session: requests.Session) -> None:
    """An engine that refuses connections gets the client nginx's empty 502, recorded as upstream-caused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"  # bound, not listening: refused
        with FaultProxy(dead) as proxy:
            r = session.post(proxy.url + "/pause_generation", json={}, timeout=TIMEOUT)
            assert (r.status_code, r.content) == (502, b"")
            assert proxy.injected == []
            [seen] = proxy.seen
            assert (seen.fault, seen.upstream_error, seen.client_status) == (None, "ConnectionRefusedError", 502)


# -- selection: calls, max_count, engines, determinism -----------------------------------


def test_calls_hits_exactly_those_call_indices(upstream: Upstream, session: requests.Session) -> None:
    """calls={1, 2} faults the first two calls of that path and no other."""
    with FaultProxy(upstream.url, plan(FaultRule("/pause_generation", "status_before", calls={1, 2}))) as proxy:
        codes = [session.post(proxy.url + "/pause_generation", json={}, timeout=TIMEOUT).status_code for _ in range(5)]
        assert codes == [502, 502, 200, 200, 200]
        assert [f.call_index for f in proxy.injected] == [1, 2]
        assert upstream.count("/pause_generation") == 3


def test_max_count_caps_per_engine(upstream: Upstream, session: requests.Session) -> None:
    """max_count caps injections per engine; `engines` limits which engines a rule touches."""
    rules = (FaultRule("*", "status_before", max_count=2), FaultRule("*", "status_before", status=503, engines={1}))
    for engine, expected in [(0, [502, 502, 200, 200]), (1, [502, 502, 503, 503])]:
        with FaultProxy(upstream.url, plan(*rules), engine_index=engine) as proxy:
            codes = [session.get(proxy.url + "/flush_cache", timeout=TIMEOUT).status_code for _ in range(4)]
            assert codes == expected


def test_same_seed_same_faults_other_seed_differs(upstream: Upstream, session: requests.Session) -> None:
    """The same seed and request sequence give the same injected list; another seed does not."""
    rules = (FaultRule("*", "status_before", probability=0.5),)
    paths = ["/pause_generation", "/flush_cache", "/resume_memory_occupation"] * 12

    def run(seed: int) -> list[tuple[str, str, int]]:
        with FaultProxy(upstream.url, plan(*rules, seed=seed)) as proxy:
            for p in paths:
                session.post(proxy.url + p, json={}, timeout=TIMEOUT)
            return [(f.path, f.kind, f.call_index) for f in proxy.injected]

    first, again, other = run(7), run(7), run(8)
    assert first == again
    assert 0 < len(first) < len(paths)
    assert first != other


def test_decisions_do_not_depend_on_other_paths() -> None:
    """Per-path decisions are the same however other paths interleave; each engine has its own stream."""
    p = plan(FaultRule("*", "status_before", probability=0.4), FaultRule("*", "reset_before", probability=0.3), seed=3)
    a, b = FaultDecider(p, 2), FaultDecider(p, 2)
    seq_a = [d for _ in range(20) for d in (a.decide("/x"), a.decide("/y"))]
    seq_b = [b.decide("/y") for _ in range(20)] + [b.decide("/x") for _ in range(20)]
    assert sorted((d.path, d.call_index, d.kind) for d in seq_a) == sorted((d.path, d.call_index, d.kind) for d in seq_b)
    other_engine = FaultDecider(p, 3)
    assert [other_engine.decide("/x").kind for _ in range(20)] != [d.kind for d in seq_a if d.path == "/x"]


def test_window_timing_with_fake_clock() -> None:
    """A window opens only when its trigger is forwarded and closes exactly `delay` s later."""
    now = [100.0]
    p = plan(FaultRule("/release_memory_occupation", "window", delay=2.0, calls={2}))
    d = FaultDecider(p, clock=lambda: now[0])
    first = d.decide("/release_memory_occupation")
    d.forwarded(first)
    assert d.decide("/pause_generation").kind is None  # call 1 is not a selected trigger
    second = d.decide("/release_memory_occupation")
    assert second.opens == (0,)
    assert d.decide("/pause_generation").kind is None  # not forwarded yet
    d.forwarded(second)
    now[0] = 101.9
    assert (d.decide("/pause_generation").kind, d.decide("/anything").status) == ("window", 502)
    now[0] = 102.0
    assert d.decide("/pause_generation").kind is None


def test_max_streak_lets_the_next_attempt_through() -> None:
    """max_streak=N: after N failures in a row on a path, the next request passes."""
    d = FaultDecider(plan(FaultRule("/p", "status_before"), max_streak=2))
    assert [d.decide("/p").kind for _ in range(6)] == ["status_before", "status_before", None] * 2


def test_seed_like_fails_plain_client_and_spares_retrying_client() -> None:
    """seed_like: a client without retries meets a failure; one with 3 attempts never fails."""
    p = FaultPlan.seed_like(seed=1234)
    plain, retrying = FaultDecider(p, 0), FaultDecider(p, 0)
    failing = {"status_before", "status_after", "reset_before", "reset_after", "hang", "window"}
    plain_failures = sum(plain.decide(path).kind in failing for _ in range(30) for path in CONTROL_PATHS)
    assert plain_failures > 0
    for _ in range(30):
        for path in CONTROL_PATHS:
            assert any(retrying.decide(path).kind not in failing for _ in range(3))
    kinds = {r.kind for r in p.rules}
    assert kinds == {"status_before", "reset_before", "latency"}
    assert all(r.path not in ("/release_memory_occupation", "/resume_memory_occupation") for r in p.rules if r.kind == "reset_before")


def test_vllm_like_fails_plain_client_spares_retrying_client_and_resets_only_idempotent_calls() -> None:
    """vllm_like: seed_like's faults on vLLM's control calls; resets only where a repeat is a no-op; ambiguous faults first."""
    p = FaultPlan.vllm_like(seed=1234)
    plain, retrying = FaultDecider(p, 0), FaultDecider(p, 0)
    failing = {"status_before", "reset_before"}
    assert sum(plain.decide(path).kind in failing for _ in range(30) for path in VLLM_CONTROL_PATHS) > 0
    for _ in range(30):
        for path in VLLM_CONTROL_PATHS:
            assert any(retrying.decide(path).kind not in failing for _ in range(3))
    assert {r.path for r in p.rules if r.kind == "status_before"} == set(VLLM_CONTROL_PATHS)
    assert {r.path for r in p.rules if r.kind == "reset_before"} == {"/pause", "/resume", "/sleep", "/wake_up", "/reset_prefix_cache"}
    ambiguous = FaultPlan.vllm_like(seed=3, ambiguous=0.2)
    added = [r for r in ambiguous.rules if r.kind in ("drop_after", "hang_after")]
    assert ambiguous.rules[: len(added)] == tuple(added) and {r.path for r in added} == set(VLLM_AMBIGUOUS_PATHS)
    assert "/update_weights" in VLLM_AMBIGUOUS_PATHS
    assert ambiguous.rules[len(added) :] == FaultPlan.vllm_like(seed=3).rules
    with pytest.raises(FaultPlanError, match=r"`rate` must be a number between 0 and 1, but was -1"):
        FaultPlan.vllm_like(seed=3, rate=-1)


def test_seed_like_ambiguous_adds_faults_after_the_engine_acted_on_release_resume_continue() -> None:
    """seed_like(ambiguous=p): drop_after (p) and hang_after (p/4) on release, resume and continue, tried first; 0 adds none."""
    p = FaultPlan.seed_like(seed=3, ambiguous=0.2)
    added = [r for r in p.rules if r.kind in ("drop_after", "hang_after")]
    assert len(added) == 2 * len(AMBIGUOUS_PATHS) and p.rules[: len(added)] == tuple(added)
    assert {(r.path, r.kind, r.probability) for r in added} == {
        *((path, "drop_after", 0.2) for path in AMBIGUOUS_PATHS),
        *((path, "hang_after", 0.05) for path in AMBIGUOUS_PATHS),
    }
    assert p.rules[len(added) :] == FaultPlan.seed_like(seed=3).rules
    decider = FaultDecider(p, 0)
    kinds = Counter(decider.decide(path).kind for _ in range(200) for path in AMBIGUOUS_PATHS)
    assert kinds["drop_after"] > 0 and kinds["hang_after"] > 0
    with pytest.raises(FaultPlanError, match=r"`ambiguous` must be a number between 0 and 1, but was 1\.5"):
        FaultPlan.seed_like(seed=3, ambiguous=1.5)


def test_ambiguous_release_engine_acts_client_sees_502(upstream: Upstream, session: requests.Session) -> None:
    """ambiguous_release: the first release reaches the engine, the client gets 502; the second passes."""
    with FaultProxy(upstream.url, FaultPlan.ambiguous_release(seed=5)) as proxy:
        url = proxy.url + "/release_memory_occupation"
        assert session.post(url, json={"tags": None}, timeout=TIMEOUT).status_code == 502
        assert upstream.count("/release_memory_occupation") == 1
        assert session.post(url, json={"tags": None}, timeout=TIMEOUT).status_code == 200
        assert upstream.count("/release_memory_occupation") == 2


# -- forwarding -------------------------------------------------------------------------


def test_streaming_passes_through_incrementally(upstream: Upstream, session: requests.Session) -> None:
    """SSE events reach the client before the engine sends the next one (no buffering)."""
    with FaultProxy(upstream.url) as proxy:
        with session.post(proxy.url + "/generate_stream", json={"stream": True}, stream=True, timeout=TIMEOUT) as r:
            assert r.headers["Content-Type"] == "text/event-stream"
            assert r.headers.get("Transfer-Encoding") == "chunked"
            pieces = r.iter_content(chunk_size=None)
            assert next(pieces) == b"data: 1\n\n"
            upstream.go.set()  # the engine sends the rest only now
            rest = b"".join(pieces)
        assert rest == b"data: 2\n\ndata: [DONE]\n\n"
        assert upstream.go_timed_out is False


def test_keep_alive_framing_across_faults(upstream: Upstream, session: requests.Session) -> None:
    """One keep-alive session sees correct answers across passes, 502s and chunked bodies."""
    rule = FaultRule("/pause_generation", "status_before", calls={2})
    with FaultProxy(upstream.url, plan(rule)) as proxy:
        r1 = session.post(proxy.url + "/pause_generation?x=1", data=b"one", timeout=TIMEOUT)
        r2 = session.post(proxy.url + "/pause_generation", data=b"two", timeout=TIMEOUT)
        r3 = session.post(proxy.url + "/echo", data=iter([b"chun", b"ked"]), timeout=TIMEOUT)
        r4 = session.get(proxy.url + "/model_info", timeout=TIMEOUT)
        assert [(r.status_code, r.content) for r in (r1, r2, r3, r4)] == [(200, b"one"), (502, b""), (200, b"chunked"), (200, b"")]
        assert upstream.targets[0] == "/pause_generation?x=1"  # query kept, rule matched on path
        assert len({t for t in proxy_threads() if "-conn-" in t}) == 1  # one reused client connection


def test_headers_forwarded_without_hop_by_hop(upstream: Upstream, session: requests.Session) -> None:
    """Host is the engine's, hop-by-hop and Connection-listed headers are dropped, others pass."""
    with FaultProxy(upstream.url) as proxy:
        headers = {"Connection": "keep-alive, X-Hop", "X-Hop": "1", "X-Keep": "2", "Authorization": "Bearer s3cret"}
        session.get(proxy.url + "/server_info", headers=headers, timeout=TIMEOUT)
        [got] = upstream.headers
        assert got["Host"] == upstream.url.removeprefix("http://")
        assert "X-Hop" not in got and got["X-Keep"] == "2" and got["Authorization"] == "Bearer s3cret"


def test_stop_leaves_no_thread(upstream: Upstream, session: requests.Session) -> None:
    """stop() closes idle keep-alive connections and hung requests and joins every thread."""
    before = set(threading.enumerate())
    proxy = FaultProxy(upstream.url, plan(FaultRule("/hang", "hang")))
    proxy.start()
    session.get(proxy.url + "/idle", timeout=TIMEOUT)  # leaves a keep-alive connection open
    errors: list[BaseException] = []

    def hang() -> None:
        with requests.Session() as other:
            other.trust_env = False
            try:
                other.get(proxy.url + "/hang", timeout=30)
            except requests.ConnectionError as exc:
                errors.append(exc)

    hung = threading.Thread(target=hang)
    hung.start()
    wait_until(lambda: proxy.injected)
    proxy.stop()
    proxy.stop()  # idempotent
    hung.join(TIMEOUT)
    assert proxy_threads() == []
    assert not hung.is_alive() and len(errors) == 1
    assert {t for t in threading.enumerate() if t.name.startswith("faultproxy")} - before == set()


# -- plans: files, validation -----------------------------------------------------------

EXPECTED = FaultPlan(
    seed=7,
    max_streak=2,
    rules=(
        FaultRule("/pause_generation", "status_before", probability=0.25, engines={0, 1}),
        FaultRule("/release_memory_occupation", "window", delay=0.5, paths={"/pause_generation"}, status=503),
        FaultRule("/flush_cache", "reset_before", calls={1, 2}, max_count=1),
        FaultRule("/release_memory_occupation", "drop_after", calls={1}),
        FaultRule("/resume_memory_occupation", "hang_after", probability=0.5, delay=3.0),
    ),
)

TOML = """
seed = 7
max_streak = 2
[[rules]]
path = "/pause_generation"
kind = "status_before"
probability = 0.25
engines = [0, 1]
[[rules]]
path = "/release_memory_occupation"
kind = "window"
delay = 0.5
paths = ["/pause_generation"]
status = 503
[[rules]]
path = "/flush_cache"
kind = "reset_before"
calls = [1, 2]
max_count = 1
[[rules]]
path = "/release_memory_occupation"
kind = "drop_after"
calls = [1]
[[rules]]
path = "/resume_memory_occupation"
kind = "hang_after"
probability = 0.5
delay = 3.0
"""

YAML = """
seed: 7
max_streak: 2
rules:
  - {path: /pause_generation, kind: status_before, probability: 0.25, engines: [0, 1]}
  - {path: /release_memory_occupation, kind: window, delay: 0.5, paths: [/pause_generation], status: 503}
  - {path: /flush_cache, kind: reset_before, calls: [1, 2], max_count: 1}
  - {path: /release_memory_occupation, kind: drop_after, calls: [1]}
  - {path: /resume_memory_occupation, kind: hang_after, probability: 0.5, delay: 3.0}
"""


@pytest.mark.parametrize(("name", "text"), [("p.toml", TOML), ("p.yaml", YAML), ("p.json", json.dumps(EXPECTED.to_dict()))])
def test_plan_loads_from_toml_yaml_json(tmp_path: Path, name: str, text: str) -> None:
    """A plan file in TOML, YAML or JSON loads to the same plan, and to_dict round-trips."""
    f = tmp_path / name
    f.write_text(text)
    assert FaultPlan.load(f) == EXPECTED
    assert FaultPlan.from_dict(EXPECTED.to_dict()) == EXPECTED


@pytest.mark.parametrize(
    ("rule", "message"),
    [
        ({"path": "/p", "kind": "status_before", "colour": "red"}, "rules[0] (path='/p', kind='status_before'): unknown key `colour`"),
        ({"path": "/p", "kind": "status_before", "probability": 1.5}, "`probability` must be a number between 0 and 1, but was 1.5"),
        ({"path": "/p", "kind": "boom"}, "`kind` must be one of status_before, status_after"),
        ({"path": "/p", "kind": "latency"}, "`delay` must be set (seconds > 0) for kind 'latency'"),
        ({"path": "/p", "kind": "reset_before", "status": 503}, "`status` must be unset for kind 'reset_before'"),
        ({"path": "/p", "kind": "status_before", "calls": [0]}, "`calls` must be a non-empty set of integers >= 1"),
        ({"path": "p", "kind": "hang"}, '`path` must be an exact path starting with "/"'),
        ({"path": "/p", "kind": "drop_after", "status": 502}, "`status` must be unset for kind 'drop_after'"),
        ({"path": "/p", "kind": "drop_after", "delay": 1}, "`delay` must be unset for kind 'drop_after'"),
        ({"path": "/p", "kind": "hang_after", "delay": -1}, "`delay` must be a finite number of seconds > 0"),
    ],
)
def test_bad_plan_file_errors_name_file_rule_and_field(tmp_path: Path, rule: dict[str, Any], message: str) -> None:
    """A bad plan file fails with a message naming the file, the rule and the field."""
    f = tmp_path / "bad.json"
    f.write_text(json.dumps({"seed": 1, "rules": [rule]}))
    with pytest.raises(FaultPlanError) as info:
        FaultPlan.load(f)
    assert str(f) in str(info.value) and "rules[0]" in str(info.value) and message in str(info.value)


def test_bad_plan_top_level() -> None:
    """Unknown top-level keys, a missing seed and a non-integer seed are rejected."""
    with pytest.raises(FaultPlanError, match="unknown key `rulez`"):
        FaultPlan.from_dict({"seed": 1, "rulez": []})
    with pytest.raises(FaultPlanError, match="`seed` is required"):
        FaultPlan.from_dict({"rules": []})
    with pytest.raises(FaultPlanError, match="`seed` must be an integer"):
        FaultPlan(seed="1")  # type: ignore[arg-type]
    with pytest.raises(FaultPlanError, match="`paths` must be empty for kind 'latency'"):
        FaultRule("/p", "latency", delay=1.0, paths={"/q"})


def test_records_are_bounded_and_counts_stay_exact() -> None:
    """seen and injected keep only the latest seen_limit entries; counts() and injected_count() stay exact."""
    plan = FaultPlan(seed=1, rules=(FaultRule("/x", "status_before", probability=1.0),))
    with FaultProxy("http://127.0.0.1:9", plan, seen_limit=5) as proxy:
        for _ in range(12):
            assert requests.get(f"{proxy.url}/x", timeout=5).status_code == 502
        assert len(proxy.seen) == 5 and len(proxy.injected) == 5
        assert proxy.injected_count() == 12 and proxy.injected_count(502) == 12
        assert proxy.counts() == {"status_before:502:/x": 12}


def test_records_bounded_counts_exact_with_ambiguous_kinds(upstream: Upstream, session: requests.Session) -> None:
    """drop_after/hang_after injections are counted exactly past seen_limit; the engine got every request once."""
    rules = (FaultRule("/d", "drop_after", calls=set(range(1, 8))), FaultRule("/h", "hang_after", delay=0.05, calls=set(range(1, 5))))
    with FaultProxy(upstream.url, FaultPlan(seed=1, rules=rules), seen_limit=3) as proxy:
        for path, n in (("/d", 9), ("/h", 6)):
            for _ in range(n):
                try:
                    session.post(proxy.url + path, data=b"x", timeout=TIMEOUT)
                except requests.ConnectionError:
                    pass
        assert proxy.settle(timeout=TIMEOUT)
        assert len(proxy.seen) == 3 and len(proxy.injected) == 3
        assert proxy.counts() == {"drop_after:-:/d": 7, "hang_after:-:/h": 4}
        assert proxy.injected_count() == 11 and proxy.injected_count(502) == 0
        assert (upstream.count("/d"), upstream.count("/h")) == (9, 6)


def test_seed_like_status_after_adds_gateway_statuses_after_the_engine_applied() -> None:
    """seed_like(status_after=p): status_after 502 (p) and 504 (p/2) on release, resume and continue, after the ambiguous faults."""
    p = FaultPlan.seed_like(seed=3, ambiguous=0.1, status_after=0.2)
    ambiguous = FaultPlan.seed_like(seed=3, ambiguous=0.1).rules
    n_amb = 2 * len(AMBIGUOUS_PATHS)
    added = p.rules[n_amb : n_amb + 2 * len(AMBIGUOUS_PATHS)]
    assert p.rules[:n_amb] == ambiguous[:n_amb] and p.rules[n_amb + len(added) :] == ambiguous[n_amb:]
    assert {(r.path, r.kind, r.answer_status, r.probability) for r in added} == {
        *((path, "status_after", 502, 0.2) for path in AMBIGUOUS_PATHS),
        *((path, "status_after", 504, 0.1) for path in AMBIGUOUS_PATHS),
    }
    decider = FaultDecider(p, 0)
    seen = Counter((d.kind, d.status) for _ in range(300) for d in (decider.decide(path) for path in AMBIGUOUS_PATHS))
    assert seen[("status_after", 502)] > 0 and seen[("status_after", 504)] > 0
    assert FaultPlan.seed_like(seed=3, status_after=0.0).rules == FaultPlan.seed_like(seed=3).rules
    with pytest.raises(FaultPlanError, match=r"`status_after` must be a number between 0 and 1, but was -0\.1"):
        FaultPlan.seed_like(seed=3, status_after=-0.1)


def test_an_interrupt_between_building_and_starting_the_accept_thread_still_stops_cleanly(
    upstream: Upstream, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C can land inside ``start()`` after the listener is bound: ``stop()`` then closes it without joining an unstarted thread."""
    original = threading.Thread.start

    def interrupted(self: threading.Thread) -> None:
        if self.name.endswith("-accept"):
            raise KeyboardInterrupt
        original(self)

    proxy = FaultProxy(upstream.url, plan())
    monkeypatch.setattr(threading.Thread, "start", interrupted)
    with pytest.raises(KeyboardInterrupt):
        proxy.start()
    monkeypatch.undo()
    port = int(proxy.url.rsplit(":", 1)[1])
    proxy.stop()  # no "cannot join thread before it is started"
    probe = socket.socket()
    try:
        probe.settimeout(TIMEOUT)
        with pytest.raises(ConnectionRefusedError):
            probe.connect(("127.0.0.1", port))
    finally:
        probe.close()
