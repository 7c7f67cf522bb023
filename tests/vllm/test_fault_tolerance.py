"""vLLM 0.33.0's fault tolerance (``--enable-fault-tolerance``): the clients' two routes against emulated engines.

``POST /fault_tolerance/apply`` and ``GET /fault_tolerance/status`` (``entrypoints/serve/fault_tolerance/api_router.py``):
a fault of the busy loop (the emulator's ``POST /_emulator/fault``) aborts every request and leaves the engine
``unhealthy``, waiting for ``retry``; the retry answers 202 and recovers in the background; a retry to a healthy
engine is rejected and the status says so; no instruction within the recovery timeout and the engine dies
(``v1/fault_tolerance/engine_core_sentinel.py`` l.53-231). 0.33.0 has no 503 "Service is in faulted state".
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from pytest_httpserver import HTTPServer

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from resilience.adapters.vllm import ROUTES, FaultToleranceStatus, VLLMClient, VLLMError
from resilience.testing.emulator import EmulatedFleet, EngineHandle
from resilience.testing.emulator.vllm import VLLMEngineConfig
from tests.vllm.conftest import FAST_VLLM, TRANSPORTS, do, open_vllm

CONFIG = VLLMEngineConfig(dev_mode=True, enable_fault_tolerance=True, token_rate=100.0)
TIMEOUT = 10.0


@pytest.fixture(scope="module")
def engine() -> Iterator[EngineHandle]:
    with EmulatedFleet(1, CONFIG) as fleet:
        yield fleet.engines[0]


def until(predicate: object, what: str) -> None:
    """Poll (bounded: 10 s) until ``predicate()`` holds."""
    end = time.monotonic() + TIMEOUT
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < end, f"never: {what}"
        time.sleep(0.02)


def fault(handle: EngineHandle) -> None:
    requests.post(handle.direct_url + "/_emulator/fault", params={"error_type": "RuntimeError"}, timeout=TIMEOUT).raise_for_status()


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", TRANSPORTS)
async def test_a_fault_waits_for_retry_and_a_second_retry_is_rejected(engine: EngineHandle, kind: str) -> None:
    """on_fault aborts the running request and marks the engine unhealthy (engine_core_sentinel.py l.82-104); retry answers 202
    and recovers after (api_router.py l.54-70, sentinel l.156-170); a retry to a healthy engine is rejected (l.53-68) and the
    status keeps its id and reason (core_client.py l.1449-1459)."""
    async with open_vllm(kind, engine.direct_url) as client:
        status = await do(client, "fault_tolerance_status")
        assert isinstance(status, FaultToleranceStatus) and status.healthy and [e.id for e in status.engines] == [0]
        with ThreadPoolExecutor(1) as pool:
            running = pool.submit(_complete, engine.direct_url)
            until(lambda: engine.state()["running"] == 1, "the completion runs")
            fault(engine)
            assert running.result(TIMEOUT) == "abort"
        faulted = (await do(client, "fault_tolerance_status")).engines[0]
        assert (faulted.status, faulted.fault_info) == ("unhealthy", "RuntimeError") and engine.alive()
        accepted = await do(client, "fault_tolerance_apply", "retry")
        assert accepted.request_id and accepted.message.startswith("Request accepted")
        until(lambda: engine.state()["fault_tolerance"] == "healthy", "the retry recovers the engine")
        assert (await do(client, "fault_tolerance_status")).healthy
        assert await do(client, "is_paused") is False  # utility calls are answered again
        again = await do(client, "fault_tolerance_apply")
        until(lambda: _last_error(engine) is not None, "the rejected retry is in the status")  # rejected after the 202
        state = (await do(client, "fault_tolerance_status")).engines[0]
        assert state.status == "healthy" and state.last_ft_request_id == again.request_id
        assert state.ft_error == "[FT] Rejecting retry on engine 0: status is HEALTHY"
    assert engine.alive()


def test_an_instruction_0_33_does_not_know_is_refused_before_sending_and_by_the_engine(engine: EngineHandle) -> None:
    """0.33.0 takes ``retry`` only (api_router.py l.20): the client refuses anything else unsent; the engine answers 400."""
    with VLLMClient(engine.direct_url, policies=FAST_VLLM) as client:
        with pytest.raises(ValueError, match="must be one of \\['retry'\\], but was 'pause'"):
            client.fault_tolerance_apply("pause")  # type: ignore[arg-type]
    bad = requests.post(engine.direct_url + "/fault_tolerance/apply", json={"instruction": "pause"}, timeout=TIMEOUT)
    assert (bad.status_code, bad.json()["error"]["message"]) == (400, "Invalid instruction: 'pause'.")
    not_json = requests.post(engine.direct_url + "/fault_tolerance/apply", data="retry", timeout=TIMEOUT)
    assert not_json.status_code == 400  # validate_json_request (serve/utils/api_utils.py l.309-315)


def test_no_instruction_within_the_recovery_timeout_and_the_engine_dies() -> None:
    """fault_tolerant_wrapper (engine_core_sentinel.py l.207-231): after engine_recovery_timeout_sec the error is raised."""
    with EmulatedFleet(1, VLLMEngineConfig(dev_mode=True, enable_fault_tolerance=True, engine_recovery_timeout_s=0.3)) as fleet:
        victim = fleet.engines[0]
        fault(victim)
        assert victim.wait_exit(TIMEOUT) == -9
        assert "No recovery within 0.3 s" in victim.log()


def test_without_the_flag_a_404_names_it(httpserver: HTTPServer) -> None:
    """Both routes are mounted only with --enable-fault-tolerance (routers.py l.85-90): a 404 says so; never re-sent."""
    httpserver.expect_request("/version").respond_with_json({"version": "0.33.0"})
    httpserver.expect_request("/fault_tolerance/status").respond_with_json({"detail": "Not Found"}, status=404)
    with VLLMClient(httpserver.url_for("").rstrip("/"), policies=FAST_VLLM) as client, pytest.raises(VLLMError) as info:
        client.fault_tolerance_status()
    assert info.value.status == 404 and "only with --enable-fault-tolerance" in str(info.value)
    apply = ROUTES["fault_tolerance_apply"].policy
    assert not apply.idempotent and not apply.retry_statuses_if_not_idempotent


def _complete(url: str) -> str:
    with VLLMClient(url) as client:
        return client.complete("the quick brown fox", max_tokens=2000).finish_reason


def _last_error(handle: EngineHandle) -> str | None:
    status = requests.get(handle.direct_url + "/fault_tolerance/status", timeout=TIMEOUT).json()
    error = status["engines"][0].get("ft_error")
    return None if error is None else str(error)
