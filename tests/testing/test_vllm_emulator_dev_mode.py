"""The vLLM emulator's mounting, keys and flags: ``VLLM_SERVER_DEV_MODE`` from the environment, ``--api-key``, no sleep mode.

Two single-engine fleets in fresh interpreters (``start_method="spawn"``), so each
engine reads the environment it was started with: one without the variable, one with
``VLLM_SERVER_DEV_MODE=1``, an API key, no ``--enable-sleep-mode`` and no
``--weight-transfer-config``.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import requests

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from resilience.testing.emulator import EmulatedFleet, EngineHandle
from resilience.testing.emulator.server import main
from resilience.testing.emulator.vllm import DEV_MODE_ENV, VLLMEngineConfig, expected_completion

TIMEOUT = 10.0
KEY = "sk-test-vllm"
CONTROL = (
    ("POST", "/sleep"), ("POST", "/wake_up"), ("GET", "/is_sleeping"), ("POST", "/release_kv_cache_memory"),
    ("POST", "/reset_prefix_cache"), ("POST", "/collective_rpc"), ("GET", "/server_info"), ("POST", "/pause"),
    ("POST", "/resume"), ("GET", "/is_paused"), ("POST", "/abort_requests"), ("POST", "/start_weight_update"),
    ("POST", "/update_weights"), ("POST", "/finish_weight_update"), ("GET", "/weight_info"), ("POST", "/weight_checker"),
)  # fmt: skip


def _fleet(env: str | None, config: VLLMEngineConfig) -> Iterator[EngineHandle]:
    with pytest.MonkeyPatch.context() as mp:
        if env is None:
            mp.delenv(DEV_MODE_ENV, raising=False)
        else:
            mp.setenv(DEV_MODE_ENV, env)
        fleet = EmulatedFleet(1, config, start_method="spawn").start()  # the child copies this environment
    try:
        yield fleet.engines[0]
    finally:
        fleet.stop()


@pytest.fixture(scope="module")
def plain() -> Iterator[EngineHandle]:
    """No ``VLLM_SERVER_DEV_MODE``: only the serve routes."""
    yield from _fleet(None, VLLMEngineConfig(enable_sleep_mode=True, weight_transfer_backend="nccl"))


@pytest.fixture(scope="module")
def keyed() -> Iterator[EngineHandle]:
    """``VLLM_SERVER_DEV_MODE=1``, ``--api-key``, no sleep mode, no weight transfer."""
    yield from _fleet("1", VLLMEngineConfig(api_key=KEY, token_rate=1000.0))


@pytest.fixture
def http() -> Iterator[requests.Session]:
    with requests.Session() as session:
        session.trust_env = False
        yield session


def test_without_dev_mode_every_control_route_is_a_plain_404(plain: EngineHandle, http: requests.Session) -> None:
    """launchers/api_server/routers.py l.46-53: dev and RL routers only with VLLM_SERVER_DEV_MODE."""
    for method, path in CONTROL:
        answer = http.request(method, plain.url + path, timeout=TIMEOUT)
        assert (answer.status_code, answer.json()) == (404, {"detail": "Not Found"}), (method, path)
    assert http.get(plain.url + "/health", timeout=TIMEOUT).status_code == 200
    assert http.get(plain.url + "/version", timeout=TIMEOUT).json() == {"version": "0.33.0"}
    answer = http.post(plain.url + "/v1/completions", json={"prompt": "p", "max_tokens": 2}, timeout=TIMEOUT)
    assert answer.json()["choices"][0]["text"] == expected_completion("p", "default", 2)
    assert plain.state()["dev_mode"] is False
    assert "SECURITY WARNING" not in plain.log()


def test_with_dev_mode_from_the_environment_the_routes_exist(keyed: EngineHandle, http: requests.Session) -> None:
    """envs.py l.1468: ``bool(int(os.getenv("VLLM_SERVER_DEV_MODE", "0")))``; the mount logs its warning (serve/__init__.py l.44)."""
    assert http.get(keyed.url + "/is_paused", timeout=TIMEOUT).json() == {"is_paused": False}
    assert keyed.state()["dev_mode"] is True
    assert "SECURITY WARNING: Development endpoints are enabled!" in keyed.log()


def test_the_api_key_guards_v1_only_and_never_the_control_routes(keyed: EngineHandle, http: requests.Session) -> None:
    """serve/middleware/authenticate.py l.11, l.59: only /v1, /v2, /inference, /cohere need the key."""
    body = {"prompt": "p", "max_tokens": 2}
    refused = http.post(keyed.url + "/v1/completions", json=body, timeout=TIMEOUT)
    assert (refused.status_code, refused.json()) == (401, {"error": "Unauthorized"})
    wrong = http.post(keyed.url + "/v1/completions", json=body, headers={"Authorization": "Bearer nope"}, timeout=TIMEOUT)
    assert wrong.status_code == 401
    ok = http.post(keyed.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=TIMEOUT)
    assert ok.status_code == 200
    for method, path in (("POST", "/pause"), ("POST", "/resume"), ("GET", "/health"), ("GET", "/weight_info")):
        assert http.request(method, keyed.url + path, timeout=TIMEOUT).status_code == 200, path  # no key sent
    assert KEY not in keyed.log()


def test_without_sleep_mode_nothing_is_released_so_nothing_crashes(keyed: EngineHandle, http: requests.Session) -> None:
    """Without --enable-sleep-mode the cumem pool holds nothing (gpu_worker.py l.301): tags are kept, memory is not freed."""
    headers = {"Authorization": f"Bearer {KEY}"}
    assert http.post(keyed.url + "/sleep", params={"level": 2}, timeout=TIMEOUT).json() == {"status": "sleeping", "level": 2}
    assert http.get(keyed.url + "/is_sleeping", timeout=TIMEOUT).json() == {"is_sleeping": True}
    http.post(keyed.url + "/resume", timeout=TIMEOUT)  # scheduling reopens while the tags still sleep
    answer = http.post(keyed.url + "/v1/completions", json={"prompt": "p", "max_tokens": 3}, headers=headers, timeout=TIMEOUT)
    assert answer.json()["choices"][0]["text"] == expected_completion("p", "default", 3)
    assert http.post(keyed.url + "/wake_up", timeout=TIMEOUT).json() == {"status": "awake", "tags": None}
    answer = http.post(keyed.url + "/v1/completions", json={"prompt": "p", "max_tokens": 3}, headers=headers, timeout=TIMEOUT)
    assert answer.json()["choices"][0]["text"] == expected_completion("p", "default", 3)  # level 2 corrupted nothing
    assert keyed.alive()


def test_weight_routes_without_a_weight_transfer_config_answer_500(keyed: EngineHandle, http: requests.Session) -> None:
    """gpu_worker.py l.1512-1516: "Weight transfer not configured", a utility failure (core.py l.1850): 500, the engine lives."""
    bodies: dict[str, dict[str, object]] = {
        "/init_weight_transfer_engine": {"init_info": {}},
        "/start_weight_update": {},
        "/update_weights": {"update_info": {}},
        "/finish_weight_update": {},
    }
    for path, body in bodies.items():
        answer = http.post(keyed.url + path, json=body, timeout=TIMEOUT)
        assert answer.status_code == 500, path
        error = answer.json()["error"]
        assert error["type"] == "InternalServerError"
        assert "Weight transfer not configured" in error["message"]
    assert keyed.alive()


@pytest.mark.parametrize(
    ("argv", "env", "needle"),
    [
        (["--weight-transfer-config", "nccl"], None, "--weight-transfer-config"),
        (["--weight-transfer-config", '{"backend": "carrier-pigeon"}'], None, "weight_transfer_backend"),
        (["--server-dev-mode", "yes"], None, "--server-dev-mode"),
        ([], "yes", DEV_MODE_ENV),
        (["--port", "70000"], None, "--port"),
    ],
)
def test_bad_flags_and_environment_are_named_in_one_line(
    argv: list[str], env: str | None, needle: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A bad flag or a bad ``VLLM_SERVER_DEV_MODE`` exits 2 before binding, naming what is wrong."""
    if env is not None:
        monkeypatch.setenv(DEV_MODE_ENV, env)
    assert main(["--engine", "vllm", *argv]) == 2  # the one entry reads --engine vllm's flags
    assert needle in capsys.readouterr().err
    assert main(["--engine", "vllm", *argv], prog="cpr emulate") == 2
    err = capsys.readouterr().err
    assert needle in err and "cpr emulate: error:" in err


def test_dev_mode_flag_overrides_the_environment() -> None:
    """``--server-dev-mode`` (the emulator's) wins over the environment; None reads it, as vLLM does."""
    config = VLLMEngineConfig(dev_mode=False)
    assert config.to_argv() == ["--engine", "vllm", "--server-dev-mode", "0"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(DEV_MODE_ENV, "1")
        assert config.resolved_dev_mode() is False
        assert VLLMEngineConfig().resolved_dev_mode() is True
        mp.setenv(DEV_MODE_ENV, "0")
        assert VLLMEngineConfig().resolved_dev_mode() is False
    full = VLLMEngineConfig(enable_sleep_mode=True, weight_transfer_backend="nccl", max_num_seqs=4)
    assert full.to_argv() == [
        "--engine",
        "vllm",
        "--enable-sleep-mode",
        "--weight-transfer-config",
        '{"backend": "nccl"}',
        "--max-num-seqs",
        "4",
    ]
    with pytest.raises(ValueError, match="max_num_seqs"):
        VLLMEngineConfig(max_num_seqs=0)
