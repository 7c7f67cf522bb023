"""The SGLang emulator: real engine processes, real HTTP on 127.0.0.1, ``requests`` as the client.

One module-scoped fleet serves every test. Engine 0 survives every test (each test
leaves it serving); engines 1 to 4 are each killed by one crash test.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pytest
import requests

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("torch")

from resilience.testing.emulator import EmulatedFleet, EmulatorStartError, EngineConfig, EngineHandle
from resilience.testing.emulator.server import main
from tests.conftest import none_of_ours_listens, process_tree

CONFIG = EngineConfig(
    token_rate=100.0,
    health_hang_seconds=1.0,
    health_poll_seconds=0.05,
    abort_poll_seconds=0.05,
    swap_seconds=0.05,
)
LONG = 2000  # max_new_tokens of a request that stays in flight for 20 s at 100 tokens/s
TIMEOUT = 10.0  # seconds: a bound no healthy loopback exchange reaches
ALL_TAGS = ["kv_cache", "weights", "cuda_graph"]
SURVIVOR, BUG_B, DOUBLE_RELEASE, RESUME_ACTIVE, RELEASE_BUSY = range(5)


@pytest.fixture(scope="module")
def fleet() -> Iterator[EmulatedFleet]:
    with EmulatedFleet(5, CONFIG) as f:
        yield f


@pytest.fixture(scope="module")
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(max_workers=8) as executor:
        yield executor


@pytest.fixture
def http() -> Iterator[requests.Session]:
    with requests.Session() as session:
        session.trust_env = False
        yield session


@pytest.fixture
def engine(fleet: EmulatedFleet, http: requests.Session) -> Iterator[EngineHandle]:
    """Engine 0, left serving after the test: continued, memory resumed, no request in flight."""
    handle = fleet.engines[SURVIVOR]
    yield handle
    assert handle.alive(), handle.log()
    http.post(handle.url + "/continue_generation", json={}, timeout=TIMEOUT)
    http.post(handle.url + "/abort_request", json={"abort_all": True}, timeout=TIMEOUT)
    released = handle.state()["released_tags"]
    if released:
        http.post(handle.url + "/resume_memory_occupation", json={"tags": released}, timeout=TIMEOUT)
    if handle.state()["weight_update_session_open"]:
        http.post(handle.url + "/end_weight_update", json={}, timeout=TIMEOUT)
    # the scheduler may count an aborted request as running a moment after its answer: wait for that too
    wait_for(lambda: (state := handle.state())["in_flight"] == 0 and state["waiting_at_pause_gate"] == 0 and state["running"] == 0)


def wait_for(predicate: Callable[[], bool], timeout: float = TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():  # bounded by the deadline
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.02)


def generate(url: str, max_new_tokens: int, **body: Any) -> requests.Response:
    payload = {"text": "The capital of France is", "sampling_params": {"max_new_tokens": max_new_tokens}, **body}
    with requests.Session() as session:
        session.trust_env = False
        return session.post(url + "/generate", json=payload, timeout=60)


def start_generate(pool: ThreadPoolExecutor, url: str, max_new_tokens: int, **body: Any) -> Future[requests.Response]:
    return pool.submit(generate, url, max_new_tokens, **body)


def wait_running(handle: EngineHandle, n: int = 1) -> None:
    wait_for(lambda: handle.state()["running"] == n)


def wait_dead(handle: EngineHandle) -> int:
    code = handle.wait_exit(TIMEOUT)
    assert code is not None, "the engine should have died"
    return code


# ----- generation --------------------------------------------------------------------


def test_generate_answers_sglang_shape(engine: EngineHandle) -> None:
    """A /generate decodes max_new_tokens tokens and answers text, output_ids and meta_info."""
    response = generate(engine.url, 4)
    assert response.status_code == 200
    body = response.json()
    assert len(body["output_ids"]) == 4 and len(body["text"]) == 4
    meta = body["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 4}
    assert meta["prompt_tokens"] == len("The capital of France is") and meta["completion_tokens"] == 4
    assert meta["weight_version"] == "default"


def test_generate_streams_server_sent_events(engine: EngineHandle) -> None:
    """stream=true answers SSE: one `data: {json}` event per token, then `data: [DONE]`."""
    response = generate(engine.url, 3, stream=True)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = [chunk for chunk in response.text.split("\n\n") if chunk]
    assert events[-1] == "data: [DONE]"
    outs = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert [len(o["output_ids"]) for o in outs] == [1, 2, 3]
    assert [o["meta_info"]["finish_reason"] for o in outs] == [None, None, {"type": "length", "length": 3}]


def test_generate_batch_answers_a_list(engine: EngineHandle) -> None:
    """A batch of prompts answers one result per prompt, in order."""
    response = generate(engine.url, 2, text=["a", "bb", "ccc"])
    assert response.status_code == 200
    assert [r["meta_info"]["prompt_tokens"] for r in response.json()] == [1, 2, 3]


def test_unknown_sampling_param_is_400(engine: EngineHandle, http: requests.Session) -> None:
    """An unknown key inside sampling_params is rejected with 400."""
    response = http.post(engine.url + "/generate", json={"text": "x", "sampling_params": {"max_tokens": 3}}, timeout=TIMEOUT)
    assert response.status_code == 400
    assert "max_tokens" in response.json()["error"]["message"]


# ----- pause modes -------------------------------------------------------------------


def test_pause_abort_answers_in_flight_requests_as_aborted(engine: EngineHandle, http: requests.Session, pool: ThreadPoolExecutor) -> None:
    """pause(abort) answers every in-flight request 200 with finish_reason abort before it returns."""
    inflight = [start_generate(pool, engine.url, LONG) for _ in range(3)]
    wait_running(engine, 3)
    paused = http.post(engine.url + "/pause_generation", json={"mode": "abort"}, timeout=TIMEOUT)
    assert paused.status_code == 200
    assert paused.json() == {"message": "Generation paused successfully.", "status": "ok"}
    state = engine.state()
    assert state["in_flight"] == 0 and state["running"] == 0 and state["pause_mode"] == "abort"
    for future in inflight:
        response = future.result(timeout=TIMEOUT)
        assert response.status_code == 200
        assert response.json()["meta_info"]["finish_reason"]["type"] == "abort"
        assert len(response.json()["output_ids"]) < LONG


def test_generate_sent_while_paused_waits_until_continue(engine: EngineHandle, http: requests.Session, pool: ThreadPoolExecutor) -> None:
    """A /generate sent while paused is neither rejected nor run; it completes after continue."""
    http.post(engine.url + "/pause_generation", json={"mode": "abort"}, timeout=TIMEOUT).raise_for_status()
    waiting = start_generate(pool, engine.url, 3)
    wait_for(lambda: engine.state()["waiting_at_pause_gate"] == 1)
    time.sleep(0.2)
    assert not waiting.done() and engine.state()["running"] == 0
    http.post(engine.url + "/pause_generation", json={"mode": "abort"}, timeout=TIMEOUT).raise_for_status()
    resumed = http.post(engine.url + "/continue_generation", json={}, timeout=TIMEOUT)
    assert resumed.json() == {"message": "Generation continued successfully.", "status": "ok"}
    response = waiting.result(timeout=TIMEOUT)  # pause is one flag: the first continue reopens admission
    assert response.json()["meta_info"]["finish_reason"] == {"type": "length", "length": 3}


def test_retract_requeues_running_requests_and_reruns_them(engine: EngineHandle, http: requests.Session, pool: ThreadPoolExecutor) -> None:
    """pause(retract) requeues running requests, so flush and release are allowed; after continue they finish, nothing lost."""
    before = engine.state()["counts"]["retracted"]
    future = start_generate(pool, engine.url, 60)
    wait_running(engine)
    http.post(engine.url + "/pause_generation", json={"mode": "retract"}, timeout=TIMEOUT).raise_for_status()
    wait_for(lambda: engine.state()["waiting"] == 1)
    state = engine.state()
    assert state["running"] == 0 and state["counts"]["retracted"] == before + 1 and state["scheduler_paused"] == "retract"
    assert http.post(engine.url + "/flush_cache", timeout=TIMEOUT).status_code == 200  # waiting queue ignored while paused
    assert http.post(engine.url + "/release_memory_occupation", json={"tags": ["kv_cache"]}, timeout=TIMEOUT).status_code == 200
    assert http.post(engine.url + "/resume_memory_occupation", json={"tags": ["kv_cache"]}, timeout=TIMEOUT).status_code == 200
    assert not future.done()
    http.post(engine.url + "/continue_generation", json={}, timeout=TIMEOUT).raise_for_status()
    meta = future.result(timeout=TIMEOUT).json()["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 60} and meta["completion_tokens"] == 60
    assert meta["num_retractions"] == 1 and meta["weight_versions"] == [{"version": "default", "start": 0, "end": 60}]


def test_retract_pause_timed_flush_times_out_untimed_flush_succeeds(
    engine: EngineHandle, http: requests.Session, pool: ThreadPoolExecutor
) -> None:
    """After a retract pause that re-queued a request, flush?timeout>0 answers 400 (its wait counts the queue); timeout=0 flushes."""
    future = start_generate(pool, engine.url, LONG)
    wait_running(engine)
    http.post(engine.url + "/pause_generation", json={"mode": "retract"}, timeout=TIMEOUT).raise_for_status()
    wait_for(lambda: engine.state()["waiting"] == 1)
    timed = http.post(engine.url + "/flush_cache", params={"timeout": 0.3}, timeout=TIMEOUT)
    assert (timed.status_code, timed.text) == (400, "Timed out waiting for idle state.")
    untimed = http.post(engine.url + "/flush_cache", params={"timeout": 0}, timeout=TIMEOUT)
    assert untimed.status_code == 200 and untimed.text.startswith("Cache flushed.")
    assert engine.alive() and not future.done()


def test_in_place_keeps_requests_and_flush_fails_while_running(
    engine: EngineHandle, http: requests.Session, pool: ThreadPoolExecutor
) -> None:
    """pause(in_place) keeps KV and stops decoding; flush_cache answers 400 while a request runs."""
    future = start_generate(pool, engine.url, 30)
    wait_running(engine)
    http.post(engine.url + "/pause_generation", json={"mode": "in_place"}, timeout=TIMEOUT).raise_for_status()
    wait_for(lambda: engine.state()["scheduler_paused"] == "in_place")
    flush = http.post(engine.url + "/flush_cache", timeout=TIMEOUT)
    assert (flush.status_code, flush.text) == (400, "Flush cache failed.\n")
    flush = http.get(engine.url + "/flush_cache", params={"timeout": 0.2}, timeout=TIMEOUT)
    assert (flush.status_code, flush.text) == (400, "Timed out waiting for idle state.")
    assert engine.state()["running"] == 1 and not future.done()
    http.post(engine.url + "/continue_generation", json={}, timeout=TIMEOUT).raise_for_status()
    assert future.result(timeout=TIMEOUT).json()["meta_info"]["finish_reason"]["type"] == "length"
    flush = http.get(engine.url + "/flush_cache", timeout=TIMEOUT)
    assert flush.status_code == 200 and flush.text.startswith("Cache flushed.\n")


def test_health_hangs_then_503_and_ready_503_while_paused(engine: EngineHandle, http: requests.Session) -> None:
    """While paused, /health hangs health_hang_seconds then answers 503 and /ready answers 503."""
    assert http.get(engine.url + "/health", timeout=TIMEOUT).status_code == 200
    assert http.get(engine.url + "/ready", timeout=TIMEOUT).status_code == 200
    http.post(engine.url + "/pause_generation", json={"mode": "retract"}, timeout=TIMEOUT).raise_for_status()
    assert http.get(engine.url + "/ready", timeout=TIMEOUT).status_code == 503
    started = time.monotonic()
    response = http.get(engine.url + "/health", timeout=TIMEOUT)
    assert response.status_code == 503 and response.content == b""
    assert time.monotonic() - started >= CONFIG.health_hang_seconds
    http.post(engine.url + "/continue_generation", json={}, timeout=TIMEOUT).raise_for_status()
    assert http.get(engine.url + "/ready", timeout=TIMEOUT).status_code == 503  # unhealthy until a health check passes
    assert http.get(engine.url + "/health_generate", timeout=TIMEOUT).status_code == 200
    assert http.get(engine.url + "/ready", timeout=TIMEOUT).status_code == 200


# ----- request bodies and errors ---------------------------------------------------


@pytest.mark.parametrize("path", ["/pause_generation", "/continue_generation", "/release_memory_occupation", "/update_weight_version"])
def test_control_call_without_body_is_400_error_object(engine: EngineHandle, http: requests.Session, path: str) -> None:
    """A control endpoint sent no JSON body answers 400 with SGLang's error object, not 422."""
    response = http.post(engine.url + path, timeout=TIMEOUT)
    assert response.status_code == 400
    body = response.json()
    assert set(body) == {"object", "message", "type", "param", "code"}
    assert (body["object"], body["type"], body["param"], body["code"]) == ("error", "Bad Request", None, 400)


def test_unknown_route_is_404_and_unknown_body_keys_are_ignored(engine: EngineHandle, http: requests.Session) -> None:
    """An unknown route is 404 {"detail": "Not Found"}; unknown keys in control bodies are ignored."""
    response = http.get(engine.url + "/no_such_route", timeout=TIMEOUT)
    assert (response.status_code, response.json()) == (404, {"detail": "Not Found"})
    assert http.post(engine.url + "/pause_generation", json={"mode": "retract", "extra": 1}, timeout=TIMEOUT).status_code == 200
    assert http.post(engine.url + "/pause_generation", json={"mode": "sideways"}, timeout=TIMEOUT).status_code == 400


def test_abort_request_ignores_empty_and_unknown_rids(engine: EngineHandle, http: requests.Session, pool: ThreadPoolExecutor) -> None:
    """/abort_request answers 200 empty; an empty rid (no abort_all) and a rid the engine does not know abort nothing.

    SGLang's tokenizer_manager.abort_request drops both before they reach the scheduler.
    """
    future = start_generate(pool, engine.url, LONG, rid="group7-sample3")
    wait_running(engine)
    for body in ({"rid": ""}, {}, {"rid": "group7-"}, {"rid": "nobody"}):
        response = http.post(engine.url + "/abort_request", json=body, timeout=TIMEOUT)
        assert (response.status_code, response.content) == (200, b"")
    http.get(engine.url + "/server_info", timeout=TIMEOUT).raise_for_status()  # a scheduler round trip after the aborts
    assert engine.state()["running"] == 1 and not future.done()
    assert "Ignore abort_request with empty rid and abort_all=False" in engine.log()
    http.post(engine.url + "/abort_request", json={"rid": "group7-sample3"}, timeout=TIMEOUT).raise_for_status()
    assert future.result(timeout=TIMEOUT).json()["meta_info"]["finish_reason"]["type"] == "abort"


# ----- weights -----------------------------------------------------------------------


def test_weight_update_session_rules(engine: EngineHandle, http: requests.Session) -> None:
    """update_weights_from_tensor needs a begin/end session; begin twice or end without begin is 400."""
    tensors = {"serialized_named_tensors": ["opaque"]}
    assert http.post(engine.url + "/end_weight_update", json={}, timeout=TIMEOUT).status_code == 400
    outside = http.post(engine.url + "/update_weights_from_tensor", json=tensors, timeout=TIMEOUT)
    assert outside.status_code == 400 and outside.json()["success"] is False
    begin = http.post(engine.url + "/begin_weight_update", json={"selector": "all"}, timeout=TIMEOUT)
    assert (begin.status_code, begin.json()) == (200, {"success": True, "message": "Success"})
    assert http.post(engine.url + "/begin_weight_update", json={}, timeout=TIMEOUT).status_code == 400
    inside = http.post(engine.url + "/update_weights_from_tensor", json={**tensors, "weight_version": "s1"}, timeout=TIMEOUT)
    assert inside.status_code == 200 and inside.json()["success"] is True
    assert http.post(engine.url + "/end_weight_update", json={}, timeout=TIMEOUT).status_code == 200
    assert http.get(engine.url + "/model_info", timeout=TIMEOUT).json()["weight_version"] == "s1"


def test_model_info_weight_version_follows_update_weight_version(engine: EngineHandle, http: requests.Session) -> None:
    """/update_weight_version sets the version /model_info and /generate report; /get_weight_version is gone."""
    response = http.post(engine.url + "/update_weight_version", json={"new_version": "v7"}, timeout=TIMEOUT)
    assert response.status_code == 200 and response.json()["new_version"] == "v7"
    assert http.get(engine.url + "/model_info", timeout=TIMEOUT).json()["weight_version"] == "v7"
    assert generate(engine.url, 1).json()["meta_info"]["weight_version"] == "v7"
    for gone in ("/get_weight_version", "/weight_version", "/get_load"):  # not in SGLang 0.5.23
        assert http.get(engine.url + gone, timeout=TIMEOUT).status_code == 404
    http.post(engine.url + "/update_weight_version", json={"new_version": "default"}, timeout=TIMEOUT).raise_for_status()


def test_info_routes_answer(engine: EngineHandle, http: requests.Session) -> None:
    """/server_info, /v1/loads and /v1/models answer SGLang's shapes."""
    info = http.get(engine.url + "/server_info", timeout=TIMEOUT).json()
    assert info["version"] == "0.5.23" and info["internal_states"][0]["memory_usage"]["token_capacity"] == CONFIG.kv_pool_tokens
    loads = http.get(engine.url + "/v1/loads", params={"include": "core"}, timeout=TIMEOUT).json()["loads"]
    assert {"num_running_reqs", "num_waiting_reqs", "num_used_tokens"} <= set(loads[0]) and "memory" not in loads[0]
    full = http.get(engine.url + "/v1/loads", timeout=TIMEOUT).json()["loads"][0]
    assert set(full["queues"]) == {"waiting", "grammar", "paused", "retracted", "prealloc_ready"} and "memory" in full
    bad = http.get(engine.url + "/v1/loads", params={"include": "core,bogus"}, timeout=TIMEOUT)
    assert (bad.status_code, bad.text) == (500, "Internal Server Error")  # SGLang's ValueError escapes the handler
    models = http.get(engine.url + "/v1/models", timeout=TIMEOUT).json()
    assert models["data"][0]["id"] == CONFIG.model_path


def test_weight_update_waits_for_inflight_generation_and_blocks_new_ones(
    engine: EngineHandle, http: requests.Session, pool: ThreadPoolExecutor
) -> None:
    """Unpaused, a weight update takes the writer lock: it waits for the running /generate, and one sent meanwhile waits for it."""
    first = start_generate(pool, engine.url, LONG, rid="before-update")
    wait_running(engine)
    update = pool.submit(
        http.post, engine.url + "/update_weights_from_disk", json={"model_path": "/ckpt/2", "weight_version": "w2"}, timeout=60
    )
    wait_for(lambda: engine.state()["model_update_lock"]["waiting_writers"] == 1)
    second = start_generate(pool, engine.url, 2)
    wait_for(lambda: engine.state()["in_flight"] == 2)
    http.get(engine.url + "/server_info", timeout=TIMEOUT).raise_for_status()
    assert engine.state()["running"] == 1 and not update.done() and not second.done()  # both wait on the first
    http.post(engine.url + "/abort_request", json={"rid": "before-update"}, timeout=TIMEOUT).raise_for_status()
    assert first.result(timeout=TIMEOUT).json()["meta_info"]["weight_version"] == "default"
    answer = update.result(timeout=TIMEOUT)
    assert answer.status_code == 200 and answer.json()["success"] is True
    assert second.result(timeout=TIMEOUT).json()["meta_info"]["weight_version"] == "w2"  # admitted after the update
    http.post(engine.url + "/update_weight_version", json={"new_version": "default"}, timeout=TIMEOUT).raise_for_status()


def test_weight_update_after_in_place_pause_is_applied_yet_refused(
    engine: EngineHandle, http: requests.Session, pool: ThreadPoolExecutor
) -> None:
    """in_place pause with a running request: an update with flush answers 400 success=false, though the weights changed."""
    future = start_generate(pool, engine.url, 150, rid="kept-kv")
    wait_running(engine)
    http.post(engine.url + "/pause_generation", json={"mode": "in_place"}, timeout=TIMEOUT).raise_for_status()
    answer = http.post(engine.url + "/update_weights_from_disk", json={"model_path": "/ckpt/3", "weight_version": "w3"}, timeout=TIMEOUT)
    assert answer.status_code == 400
    assert answer.json()["success"] is False and answer.json()["message"].startswith("Weights were updated, but the cache was not flushed")
    assert http.get(engine.url + "/model_info", timeout=TIMEOUT).json()["weight_version"] == "default"  # not recorded as updated
    http.post(engine.url + "/continue_generation", json={}, timeout=TIMEOUT).raise_for_status()
    meta = future.result(timeout=TIMEOUT).json()["meta_info"]
    spans = meta["weight_versions"]  # yet the tokens after the update came from the new weights
    assert [s["version"] for s in spans] == ["default", "w3"] and spans[-1]["end"] == 150 and meta["weight_version"] == "w3"
    http.post(engine.url + "/update_weight_version", json={"new_version": "default"}, timeout=TIMEOUT).raise_for_status()


def test_distributed_update_outside_a_session_is_400(engine: EngineHandle, http: requests.Session) -> None:
    """update_weights_from_distributed needs begin_weight_update first, as in SGLang 0.5.23."""
    body = {"names": ["w"], "dtypes": ["bfloat16"], "shapes": [[2]]}
    answer = http.post(engine.url + "/update_weights_from_distributed", json=body, timeout=TIMEOUT)
    assert answer.status_code == 400
    assert answer.json() == {
        "success": False,
        "message": "update_weights_from_distributed must run between begin_weight_update() and end_weight_update()",
    }


def test_unknown_tags_release_is_a_no_op_and_resume_after_it_too(engine: EngineHandle, http: requests.Session) -> None:
    """A tag SGLang does not know is recorded on release (200, nothing freed) and removed on resume (200)."""
    before = engine.state()["allocated_bytes"]
    http.post(engine.url + "/pause_generation", json={"mode": "abort"}, timeout=TIMEOUT).raise_for_status()
    release = http.post(engine.url + "/release_memory_occupation", json={"tags": ["lora"]}, timeout=TIMEOUT)
    assert (release.status_code, release.content) == (200, b"null")
    assert engine.state()["released_tags"] == ["lora"] and engine.state()["allocated_bytes"] == before
    resume = http.post(engine.url + "/resume_memory_occupation", json={"tags": ["lora"]}, timeout=TIMEOUT)
    assert (resume.status_code, resume.content) == (200, b"null")
    assert engine.state()["released_tags"] == [] and engine.alive()


# ----- memory occupation and Bug B -------------------------------------------------


def test_offload_with_pause_first_survives_a_straggler(engine: EngineHandle, http: requests.Session, pool: ThreadPoolExecutor) -> None:
    """pause(abort) -> flush -> release -> resume -> continue survives a straggler, which waits and completes."""
    url = engine.url
    http.post(url + "/pause_generation", json={"mode": "abort"}, timeout=TIMEOUT).raise_for_status()
    assert http.post(url + "/flush_cache", timeout=TIMEOUT).status_code == 200
    release = http.post(url + "/release_memory_occupation", json={"tags": None}, timeout=TIMEOUT)
    assert (release.status_code, release.content) == (200, b"null")
    state = engine.state()
    assert state["released_tags"] == ALL_TAGS and set(state["allocated_bytes"].values()) == {0}
    straggler = start_generate(pool, url, 3)
    wait_for(lambda: engine.state()["waiting_at_pause_gate"] == 1)
    resume = http.post(url + "/resume_memory_occupation", json={"tags": ALL_TAGS}, timeout=TIMEOUT)
    assert (resume.status_code, resume.content) == (200, b"null")
    assert not straggler.done()
    http.post(url + "/continue_generation", json={}, timeout=TIMEOUT).raise_for_status()
    assert straggler.result(timeout=TIMEOUT).json()["meta_info"]["finish_reason"]["type"] == "length"
    assert engine.alive() and all(engine.state()["allocated_bytes"].values())
    calls = [c["path"] for c in engine.record()["calls"]]
    sequence = ["/pause_generation", "/flush_cache", "/release_memory_occupation", "/resume_memory_occupation", "/continue_generation"]
    assert calls[-5:] == sequence


def test_bug_b_release_without_pause_then_straggler_kills_engine(fleet: EmulatedFleet, http: requests.Session) -> None:
    """Bug B: flush + release with no pause, then a straggler /generate is prefilled into the freed pool: the engine dies."""
    handle = fleet.engines[BUG_B]
    tree = process_tree(handle.pid)
    assert http.post(handle.url + "/flush_cache", timeout=TIMEOUT).status_code == 200
    assert http.post(handle.url + "/release_memory_occupation", json={"tags": ["kv_cache"]}, timeout=TIMEOUT).status_code == 200
    with pytest.raises(requests.ConnectionError):
        generate(handle.url, 3)
    assert wait_dead(handle) == -9
    assert none_of_ours_listens(handle.url, tree)
    log = handle.log()
    assert "Scheduler hit an exception" in log and "RuntimeError" in log and "write_prefill" in log


def test_double_release_kills_engine(fleet: EmulatedFleet, http: requests.Session) -> None:
    """Releasing a tag that is already released ends the engine with exit(1), as torch_memory_saver does."""
    handle = fleet.engines[DOUBLE_RELEASE]
    body = {"tags": ["kv_cache"]}
    assert http.post(handle.url + "/release_memory_occupation", json=body, timeout=TIMEOUT).status_code == 200
    with pytest.raises(requests.ConnectionError):
        http.post(handle.url + "/release_memory_occupation", json=body, timeout=TIMEOUT)
    assert wait_dead(handle) == 1
    assert "Cannot pause allocation that is not active" in handle.log()


def test_resume_of_active_tag_kills_engine(fleet: EmulatedFleet, http: requests.Session) -> None:
    """Resuming a tag that was not released (known or not) is a KeyError in the scheduler: the engine dies."""
    handle = fleet.engines[RESUME_ACTIVE]
    with pytest.raises(requests.ConnectionError):
        http.post(handle.url + "/resume_memory_occupation", json={"tags": ["weights", "lora"]}, timeout=TIMEOUT)
    assert wait_dead(handle) == -9
    assert "Scheduler hit an exception" in handle.log() and "KeyError" in handle.log()


def test_release_with_request_running_kills_engine(fleet: EmulatedFleet, http: requests.Session, pool: ThreadPoolExecutor) -> None:
    """release_memory_occupation while a request runs fails the scheduler's idle assertion: the engine dies."""
    handle = fleet.engines[RELEASE_BUSY]
    future = start_generate(pool, handle.url, LONG)
    wait_running(handle)
    with pytest.raises(requests.ConnectionError):
        http.post(handle.url + "/release_memory_occupation", json={"tags": None}, timeout=TIMEOUT)
    with pytest.raises(requests.ConnectionError):
        future.result(timeout=TIMEOUT)
    assert wait_dead(handle) == -9
    assert "AssertionError" in handle.log()


def test_without_memory_saver_double_release_is_harmless_and_status_starts_503(http: requests.Session) -> None:
    """--no-memory-saver: nothing is freed, a double release and a straggler live; /health is 503 while starting.

    A resume of a tag that is not released still kills it (the KeyError is SGLang's own bookkeeping).
    """
    with EmulatedFleet(1, dataclasses.replace(CONFIG, memory_saver=False, startup_seconds=2.0)) as f:
        handle = f.engines[0]
        url = handle.url
        if handle.state()["server_status"] == "Starting":  # the fleet's READY line comes before warm-up ends
            assert http.get(url + "/health", timeout=TIMEOUT).status_code == 503
            assert http.get(url + "/ready", timeout=TIMEOUT).status_code == 503
        wait_for(lambda: http.get(url + "/health", timeout=TIMEOUT).status_code == 200)
        assert http.get(url + "/ready", timeout=TIMEOUT).status_code == 200
        assert http.get(url + "/server_info", timeout=TIMEOUT).json()["enable_memory_saver"] is False
        before = handle.state()["allocated_bytes"]
        for _ in range(2):
            assert http.post(url + "/release_memory_occupation", json={"tags": ["kv_cache"]}, timeout=TIMEOUT).status_code == 200
        assert handle.state()["allocated_bytes"] == before and handle.state()["released_tags"] == ["kv_cache"]
        assert generate(url, 3).json()["meta_info"]["finish_reason"]["type"] == "length"  # the straggler lives
        assert http.post(url + "/resume_memory_occupation", json={"tags": ["kv_cache"]}, timeout=TIMEOUT).status_code == 200
        with pytest.raises(requests.ConnectionError):
            http.post(url + "/resume_memory_occupation", json={"tags": ["kv_cache"]}, timeout=TIMEOUT)
        assert wait_dead(handle) == -9 and "KeyError" in handle.log()


# ----- fleet and process entry ---------------------------------------------------


def test_fleet_with_fault_plan_proxies_and_leaves_no_process() -> None:
    """With a fault plan, urls are proxies in front of the engines; stop() ends every engine process."""
    from resilience.testing.faults import FaultPlan

    with EmulatedFleet(2, CONFIG, fault_plan=FaultPlan(seed=0)) as f:
        pids = f.pids
        ours = [os.getpid(), *(pid for engine in pids for pid in process_tree(engine))]  # the proxies run in this process
        assert f.urls != f.direct_urls
        with requests.Session() as session:
            session.trust_env = False
            for url in f.urls:
                assert session.get(url + "/model_info", timeout=TIMEOUT).status_code == 200
        assert [e.proxy is not None and len(e.proxy.seen) == 1 for e in f.engines] == [True, True]
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert all(none_of_ours_listens(url, ours) for url in f.direct_urls + f.urls)


def test_fleet_that_fails_to_start_stops_every_engine() -> None:
    """A fleet whose engines miss the startup deadline raises EmulatorStartError and leaves no process."""
    f = EmulatedFleet(2, CONFIG, startup_timeout=0.01)
    with pytest.raises(EmulatorStartError, match="READY"):
        f.start()
    for pid in f.pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_main_reports_a_port_in_use_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    """The process entry answers a port in use or a bad knob with one error line and a non-zero status."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        assert main(["--port", str(busy.getsockname()[1])]) == 1
    err = capsys.readouterr().err
    assert err.startswith("python -m resilience.testing.emulator: error: cannot listen on 127.0.0.1:") and err.count("\n") == 1
    assert main(["--token-rate", "0"]) == 2
    assert "`token_rate` must be > 0" in capsys.readouterr().err


def test_engine_config_names_the_bad_field() -> None:
    """EngineConfig validates every knob and names the field in the error."""
    with pytest.raises(ValueError, match="`health_hang_seconds`"):
        EngineConfig(health_hang_seconds=-1)
    with pytest.raises(ValueError, match="`max_req_slots`"):
        EngineConfig(max_running_requests=8, max_req_slots=4)
    assert EngineConfig(token_rate=5.0).to_argv() == ["--token-rate", "5.0"]
    assert EngineConfig(memory_saver=False).to_argv() == ["--no-memory-saver"]
    with pytest.raises(ValueError, match="`api_key`") as info:
        EngineConfig(api_key=" sk-spaced ")
    assert "sk-spaced" not in str(info.value) and "sk-" not in repr(EngineConfig(api_key="sk-hidden"))
