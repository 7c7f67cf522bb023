"""Answers an emulator of vLLM 0.33.0 never gives: malformed bodies, foreign versions, what the client sends where.

pytest-httpserver on 127.0.0.1 plays the server for these only (``test_client_http.py`` runs everything vLLM does
answer against the emulator). Each case runs on the three transports.
"""

from __future__ import annotations

import pickle

import pytest
from pytest_httpserver import HTTPServer

from resilience.adapters.vllm import VLLMAuthError, VLLMProtocolError, VLLMRefused, VLLMVersionError
from resilience.outcome import Delivery, attempts_of
from tests.vllm.conftest import TRANSPORTS, do, open_vllm

SECRET = "sk-vllm-secret-4242"


def url(httpserver: HTTPServer) -> str:
    return f"http://127.0.0.1:{httpserver.port}"


def serve_version(httpserver: HTTPServer, version: str = "0.33.0") -> None:
    httpserver.expect_request("/version").respond_with_json({"version": version})


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", TRANSPORTS)
async def test_a_malformed_answer_names_endpoint_status_and_an_excerpt(httpserver: HTTPServer, kind: str) -> None:
    """A 200 that is not JSON, or lacks its field, raises VLLMProtocolError with endpoint, status, what is wrong and an excerpt."""
    serve_version(httpserver)
    httpserver.expect_request("/weight_info").respond_with_data("<html>gateway page</html>", status=200)
    httpserver.expect_request("/is_paused").respond_with_json({"paused": True})
    httpserver.expect_request("/sleep", method="POST").respond_with_json({"status": "sleeping", "level": "two"})
    async with open_vllm(kind, url(httpserver)) as client:
        with pytest.raises(VLLMProtocolError) as not_json:
            await do(client, "weight_info")
        with pytest.raises(VLLMProtocolError, match="no 'is_paused' field") as missing:
            await do(client, "is_paused")
        with pytest.raises(VLLMProtocolError, match="'level' is not int"):
            await do(client, "sleep", 2)
    text = str(not_json.value)
    assert "GET /weight_info" in text and "HTTP 200" in text and "not a JSON object" in text and "gateway page" in text
    assert "GET /is_paused" in str(missing.value) and '"paused": true' in str(missing.value)
    shipped = pickle.loads(pickle.dumps(not_json.value))  # errors travel pickled (Ray)
    assert type(shipped) is VLLMProtocolError and str(shipped) == text and shipped.status == 200
    assert [(r.delivery, r.status) for r in attempts_of(shipped) or ()] == [(Delivery.RESPONDED, 200)]


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", TRANSPORTS)
async def test_a_version_outside_the_range_is_named_and_nothing_else_is_sent(httpserver: HTTPServer, kind: str) -> None:
    """``GET /version`` says 0.8.5: the control call raises VLLMVersionError naming it and the range; /sleep never goes out."""
    serve_version(httpserver, "0.8.5")
    async with open_vllm(kind, url(httpserver)) as client:
        with pytest.raises(VLLMVersionError) as info:
            await do(client, "sleep", 1)
        assert (await do(client, "version")).text == "0.8.5"  # version() itself reports what the server said
    assert "vLLM 0.8.5 is outside the supported range 0.12.0 to 0.33.x" in str(info.value)
    assert [req.path for req, _ in httpserver.log] == ["/version", "/version"]


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", TRANSPORTS)
async def test_a_version_that_names_no_release_is_a_protocol_error(httpserver: HTTPServer, kind: str) -> None:
    """``{"version": "banana"}`` is not a release: VLLMProtocolError, and the control call is not sent."""
    serve_version(httpserver, "banana")
    async with open_vllm(kind, url(httpserver)) as client:
        with pytest.raises(VLLMProtocolError, match="names no vLLM release"):
            await do(client, "pause")
    assert [req.path for req, _ in httpserver.log] == ["/version"]


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", TRANSPORTS)
async def test_the_api_key_goes_only_to_v1_routes_and_never_into_errors(httpserver: HTTPServer, kind: str) -> None:
    """vLLM guards only /v1 with --api-key: the key is sent there as a Bearer header, not to /sleep; a 401 names no key."""
    serve_version(httpserver)
    httpserver.expect_request("/sleep", method="POST").respond_with_json({"status": "sleeping", "level": 1})
    httpserver.expect_request("/v1/completions", method="POST").respond_with_json({"error": "Unauthorized"}, status=401)
    async with open_vllm(kind, url(httpserver), api_key=SECRET) as client:
        assert (await do(client, "sleep", 1)).level == 1
        with pytest.raises(VLLMAuthError) as info:
            await do(client, "complete", "hi")
        shown = [repr(client), str(info.value), repr(info.value.args)]
    headers = {req.path: req.headers.get("Authorization") for req, _ in httpserver.log}
    assert headers == {"/version": None, "/sleep": None, "/v1/completions": f"Bearer {SECRET}"}
    assert "refused the API key" in str(info.value) and info.value.status == 401
    assert not any(SECRET in text for text in shown) and "api_key=***" in shown[0]
    assert len(httpserver.log) == 3  # a 401 is not retried


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", TRANSPORTS)
async def test_success_false_on_a_route_that_may_not_retry_it_is_raised_at_once(httpserver: HTTPServer, kind: str) -> None:
    """``/update_weight_version`` answering ``{"success": false}`` (0.33.0 never does) is raised after one ask, never a success."""
    serve_version(httpserver)
    httpserver.expect_request("/update_weight_version", method="POST").respond_with_json({"success": False, "new_version": "v2"})
    async with open_vllm(kind, url(httpserver)) as client:
        with pytest.raises(VLLMRefused) as info:
            await do(client, "update_weight_version", "v2")
    assert info.value.polls == 1 and '"success": false' in str(info.value)
    assert [req.path for req, _ in httpserver.log] == ["/version", "/update_weight_version"]


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", TRANSPORTS)
async def test_an_older_server_gets_requests_in_its_own_dialect(httpserver: HTTPServer, kind: str) -> None:
    """0.30.0: ``mode`` is sent, sleep/wake answer empty 200s; 0.14.0: pause sends ``wait_for_inflight_requests`` and the
    weight session (0.23.0) is refused without sending. The server sees exactly these query strings."""
    serve_version(httpserver, "0.30.0")
    httpserver.expect_request("/sleep", method="POST").respond_with_data("")
    httpserver.expect_request("/wake_up", method="POST").respond_with_data("")
    async with open_vllm(kind, url(httpserver)) as client:
        assert (await do(client, "sleep", 2, "keep")).level == 2
        woke = await do(client, "wake_up", ["weights", "kv_cache"])
        assert (woke.awake, woke.tags) == (None, ("weights", "kv_cache"))
    sent = [(req.path, req.query_string.decode()) for req, _ in httpserver.log]
    assert sent == [("/version", ""), ("/sleep", "level=2&mode=keep"), ("/wake_up", "tags=weights&tags=kv_cache")]

    httpserver.clear()
    serve_version(httpserver, "0.14.0")
    httpserver.expect_request("/pause", method="POST").respond_with_json({"status": "paused"})
    async with open_vllm(kind, url(httpserver)) as old:
        assert (await do(old, "pause", "wait")).message == "paused"
        with pytest.raises(VLLMVersionError, match="has no POST /start_weight_update"):
            await do(old, "start_weight_update")
        with pytest.raises(VLLMVersionError, match="takes no mode="):
            await do(old, "sleep", 1, "abort")
    sent = [(req.path, req.query_string.decode()) for req, _ in httpserver.log]
    assert sent == [("/version", ""), ("/pause", "wait_for_inflight_requests=true")]
