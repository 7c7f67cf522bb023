"""API keys end to end: the emulator checks them as SGLang 0.5.23 does, SGLangClient sends the one each route needs.

One module-scoped engine started with both keys and one with the API key only. Keys
never appear in errors, reprs, events, log records or the engine's own log.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import requests
from hypothesis import given, settings
from hypothesis import strategies as st
from pytest_httpserver import HTTPServer

from resilience.adapters.sglang import SGLangAppliedButRefused, SGLangAuthError, SGLangClient
from resilience.events import Event
from resilience.testing.emulator import EmulatedFleet, EngineConfig
from resilience.testing.emulator.app import create_app
from resilience.testing.emulator.auth import AuthLevel, decide_request_auth
from tests.sglang.conftest import FAST_ENGINE, FAST_SGLANG
from tests.testing.sglang_contract import EmulatorRoute, emulator_routes

API_KEY = "sk-api-7f3c1e"
ADMIN_KEY = "sk-admin-9b2d44"
TIMEOUT = 10.0


@pytest.fixture(scope="module")
def both_keys() -> Iterator[EmulatedFleet]:
    with EmulatedFleet(1, dataclasses.replace(FAST_ENGINE, api_key=API_KEY, admin_api_key=ADMIN_KEY)) as fleet:
        yield fleet


@pytest.fixture(scope="module")
def api_key_only() -> Iterator[EmulatedFleet]:
    with EmulatedFleet(1, dataclasses.replace(FAST_ENGINE, api_key=API_KEY)) as fleet:
        yield fleet


def wait_until(predicate: Callable[[], bool]) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not predicate():  # bounded by the deadline
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def status(url: str, method: str = "GET", key: str | None = None, **kwargs: object) -> int:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    with requests.Session() as session:
        session.trust_env = False
        return session.request(method, url, headers=headers, timeout=TIMEOUT, **kwargs).status_code  # type: ignore[arg-type]


def test_emulator_checks_keys_by_auth_level(both_keys: EmulatedFleet) -> None:
    """Normal routes need the API key, admin routes the admin key (the API key is refused), probes need none."""
    url = both_keys.urls[0]
    assert [status(url + p) for p in ("/health", "/ready", "/_emulator/state")] == [200, 200, 200]
    assert [status(url + "/model_info", key=k) for k in (None, "wrong", ADMIN_KEY, API_KEY)] == [401, 401, 401, 200]
    with requests.Session() as session:
        session.trust_env = False
        refused = session.post(url + "/pause_generation", json={"mode": "abort"}, headers={"Authorization": f"Bearer {API_KEY}"})
    assert (refused.status_code, refused.json()) == (401, {"error": "Unauthorized"})
    assert status(url + "/flush_cache", "POST", key=ADMIN_KEY) == 200
    assert status(url + "/flush_cache", "POST", key=f"bearer-less {ADMIN_KEY}") == 401


def test_api_key_alone_opens_admin_routes(api_key_only: EmulatedFleet) -> None:
    """Without an admin key configured, admin routes take the API key (ADMIN_OPTIONAL), and refuse no key."""
    url = api_key_only.urls[0]
    assert status(url + "/flush_cache", "POST", key=API_KEY) == 200
    assert status(url + "/flush_cache", "POST") == 401
    client = SGLangClient(url, api_key=API_KEY, policies=FAST_SGLANG)
    client.pause_generation("retract")
    client.continue_generation()
    assert client.model_info().weight_version == "default"


def test_client_sends_each_route_its_key_through_a_whole_offload(both_keys: EmulatedFleet) -> None:
    """pause, flush, release, resume, continue (admin key) and reads (API key) all pass; probes go without a key."""
    with SGLangClient(both_keys.urls[0], api_key=API_KEY, admin_api_key=ADMIN_KEY, policies=FAST_SGLANG) as client:
        client.pause_generation("abort")
        client.flush_cache(deadline_s=5)
        client.release_memory_occupation(["kv_cache"])
        client.resume_memory_occupation(["kv_cache"])
        client.continue_generation()
        assert client.model_info().weight_version == "default" and client.loads() and client.health().healthy
    calls = both_keys.engines[0].record()["calls"]
    assert len(calls) >= 8 and {c["status"] for c in calls if c["path"] != "/health"} <= {200, 401}


def test_refused_key_is_named_not_shown_and_never_retried(both_keys: EmulatedFleet, caplog: pytest.LogCaptureFixture) -> None:
    """A wrong admin key: one attempt, SGLangAuthError says which key was refused; no key appears anywhere."""
    events: list[Event] = []
    url = both_keys.urls[0]
    client = SGLangClient(url, api_key=API_KEY, admin_api_key="sk-admin-WRONG-5150", policies=FAST_SGLANG, observers=[events.append])
    before = len(both_keys.engines[0].record()["calls"])
    with caplog.at_level(logging.DEBUG), pytest.raises(SGLangAuthError) as info:
        client.pause_generation("abort")
    err = info.value
    assert (err.status, err.key, err.endpoint) == (401, "admin_api_key", "POST /pause_generation")
    assert "refused the admin api key" in str(err)
    calls = both_keys.engines[0].record()["calls"][before:]
    assert [(c["path"], c["status"]) for c in calls] == [("/pause_generation", 401)]  # never re-sent
    keyless = SGLangClient(url, policies=FAST_SGLANG)
    with pytest.raises(SGLangAuthError, match="no key was sent") as none_sent:
        keyless.model_info()
    assert none_sent.value.key is None
    texts = [str(err), repr(err), repr(client), str(none_sent.value), caplog.text, repr(events), both_keys.engines[0].log()]
    assert events and caplog.records  # there is something to search
    for secret in (API_KEY, ADMIN_KEY, "sk-admin-WRONG-5150"):
        assert not any(secret in text for text in texts), secret


def test_forbidden_is_named_and_not_retried(httpserver: HTTPServer) -> None:
    """403 (an ADMIN_FORCE route on a server without an admin key) raises SGLangAuthError at once."""
    httpserver.expect_request("/pause_generation", method="POST").respond_with_json({"error": "Forbidden"}, status=403)
    client = SGLangClient(httpserver.url_for("/").rstrip("/"), api_key=API_KEY, policies=FAST_SGLANG)
    with pytest.raises(SGLangAuthError, match="started without --admin-api-key") as info:
        client.pause_generation("abort")
    assert info.value.status == 403 and len(httpserver.log) == 1


def test_retract_offload_flushes_without_a_server_side_wait(both_keys: EmulatedFleet) -> None:
    """After our retract pause re-queued a request, flush_cache sends timeout=0 and succeeds; release and resume follow."""
    engine = both_keys.engines[0]
    client = SGLangClient(both_keys.urls[0], api_key=API_KEY, admin_api_key=ADMIN_KEY, policies=FAST_SGLANG)
    out: list[object] = []
    t = threading.Thread(target=lambda: out.append(client.generate("x", sampling_params={"max_new_tokens": 400})))
    t.start()
    try:
        wait_until(lambda: engine.state()["running"] == 1)
        client.pause_generation("retract")
        wait_until(lambda: engine.state()["waiting"] == 1)
        result = client.flush_cache(deadline_s=5)
        assert result.polls == 1 and result.message.startswith("Cache flushed")
        flush = [c for c in engine.record()["calls"] if c["path"] == "/flush_cache"][-1]
        assert flush["query"] == "timeout=0.000"
        client.release_memory_occupation(["kv_cache"])
        client.resume_memory_occupation(["kv_cache"])
        client.continue_generation()
    finally:
        t.join(TIMEOUT)
    assert len(out) == 1 and out[0].meta_info["num_retractions"] == 1  # type: ignore[attr-defined]
    assert engine.alive()


def test_applied_but_refused_update_is_its_own_error(both_keys: EmulatedFleet) -> None:
    """in_place pause with a running request: the update raises SGLangAppliedButRefused (weights_applied), not a plain refusal."""
    engine = both_keys.engines[0]
    client = SGLangClient(both_keys.urls[0], api_key=API_KEY, admin_api_key=ADMIN_KEY, policies=FAST_SGLANG)
    t = threading.Thread(target=lambda: client.generate("y", sampling_params={"max_new_tokens": 2000}))
    t.start()
    try:
        wait_until(lambda: engine.state()["running"] == 1)
        client.pause_generation("in_place")
        with pytest.raises(SGLangAppliedButRefused) as info:
            client.update_weights_from_disk("/ckpt/9", weight_version="w9")
        assert info.value.weights_applied and info.value.status == 400 and "cache was not flushed" in info.value.body_excerpt
        assert client.model_info().weight_version == "default"
    finally:
        client.abort_request(abort_all=True)
        client.continue_generation()
        t.join(TIMEOUT)
    client.update_weight_version("default")


def test_probe_sends_the_api_key_only_where_asked_and_says_when_refused(both_keys: EmulatedFleet) -> None:
    """cpr probe: with the API key every check passes; without it the keyed checks say a key is required."""
    from resilience.cli.probe import probe_engines

    url = both_keys.urls[0]
    keyed = probe_engines([url], 5.0, API_KEY)[0].results
    assert [keyed[c].status for c in ("health", "ready", "model_info", "loads", "server_info")] == [200, 200, 200, 200, 200]
    assert not keyed["health"].key_sent and keyed["model_info"].key_sent
    bare = probe_engines([url], 5.0)[0].results
    assert bare["health"].status == 200 and bare["model_info"].cell() == "401: a key is required (--api-key-env)"
    wrong = probe_engines([url], 5.0, "sk-not-it")[0].results
    assert wrong["server_info"].cell() == "401: the API key was refused"


def test_emulate_flags_carry_keys_and_the_memory_saver_switch() -> None:
    """cpr emulate takes SGLang's --api-key and --admin-api-key, and --no-memory-saver; the config hides the keys."""
    from resilience.testing.emulator.config import config_from_namespace
    from resilience.testing.emulator.server import build_parser

    args = build_parser("cpr emulate").parse_args(["--api-key", API_KEY, "--admin-api-key", ADMIN_KEY, "--no-memory-saver"])
    config = config_from_namespace(args)
    assert (config.api_key, config.admin_api_key, config.memory_saver) == (API_KEY, ADMIN_KEY, False)
    assert API_KEY not in repr(config) and ADMIN_KEY not in repr(config)
    assert config_from_namespace(build_parser().parse_args(config.to_argv())) == config


KEYS = st.sampled_from([None, "sk-a", "sk-b"])


@functools.cache
def route_table() -> tuple[EmulatorRoute, ...]:
    """The emulator's routes (built once; the contract check proves they are SGLang's, with its auth levels)."""
    routes = tuple(sorted(emulator_routes(create_app(EngineConfig())[0]).values(), key=lambda r: r.path))
    assert len(routes) >= 20
    return routes


@settings(max_examples=300, deadline=None)
@given(api_key=KEYS, admin_api_key=KEYS, data=st.data())
def test_a_client_holding_the_server_keys_is_never_refused(api_key: str | None, admin_api_key: str | None, data: st.DataObject) -> None:
    """For every route and key setup, SGLangClient with the server's keys sends a key SGLang's rules accept.

    The admin key never goes to a route SGLang does not mark admin, and no key goes to the open probes.
    """
    route = data.draw(st.sampled_from(route_table()))
    client = SGLangClient("http://127.0.0.1:9", api_key=api_key, admin_api_key=admin_api_key)
    name, key = client._key_for(route.path)
    decision = decide_request_auth(
        method=sorted(route.methods)[0],
        path=route.path,
        authorization=f"Bearer {key}" if key else None,
        api_key=api_key,
        admin_api_key=admin_api_key,
        level=AuthLevel(route.auth),
    )
    assert decision is None, (route.path, name)
    if name == "admin_api_key":
        assert route.auth != "normal"
    if route.path.startswith(("/health", "/ready")):
        assert key is None
