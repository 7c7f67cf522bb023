"""The vLLM emulator, dev mode on: real engine processes, real HTTP on 127.0.0.1, ``requests`` as the client.

One module-scoped fleet (forked from the shared zygote, each engine behind the shared
fault proxy) serves every test. Engine 0 survives every test (each test leaves it
awake, unpaused, idle, with intact weights); engines 1 and 2 are each killed by one
crash test; the plan's faults touch engine 3 alone; engine 4 is wedged by a re-sent weight chunk; engine 5 dies of a weight
update while asleep. Each behaviour names the vLLM
0.33.0 source line it follows (paths under ``vllm/``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pytest
import requests

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from resilience.testing.emulator import EmulatedFleet, EngineHandle
from resilience.testing.emulator.vllm import VLLMEngineConfig, expected_completion
from resilience.testing.faults import FaultPlan, FaultRule

CONFIG = VLLMEngineConfig(dev_mode=True, enable_sleep_mode=True, weight_transfer_backend="nccl", token_rate=100.0)
LONG = 2000  # max_tokens of a request that stays in flight for 20 s at 100 tokens/s
TIMEOUT = 10.0  # seconds: a bound no healthy loopback exchange reaches
SURVIVOR, CRASH_RESUME_ASLEEP, CRASH_HALF_AWAKE, PROXIED, WEDGED, CRASH_WEIGHTS_ASLEEP = range(6)
PROMPT = "the quick brown fox"
PLAN = FaultPlan(
    seed=7,
    rules=(
        FaultRule("/sleep", "status_after", engines=frozenset({PROXIED}), calls=frozenset({1})),
        FaultRule("/wake_up", "reset_before", engines=frozenset({PROXIED}), calls=frozenset({1})),
        FaultRule("/update_weights", "drop_after", engines=frozenset({PROXIED}), calls=frozenset({1})),
    ),
)


@pytest.fixture(scope="module")
def fleet() -> Iterator[EmulatedFleet]:
    with EmulatedFleet(6, CONFIG, PLAN) as f:
        yield f


@pytest.fixture(scope="module")
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(max_workers=4) as executor:
        yield executor


@pytest.fixture
def http() -> Iterator[requests.Session]:
    with requests.Session() as session:
        session.trust_env = False
        yield session


def wait_for(predicate: Callable[[], bool], timeout: float = TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():  # bounded by the deadline
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.02)


@pytest.fixture
def engine(fleet: EmulatedFleet, http: requests.Session) -> Iterator[EngineHandle]:
    """Engine 0, left awake, unpaused, idle, outside a weight session, with the checkpoint's weights as "default"."""
    handle = fleet.engines[SURVIVOR]
    yield handle
    assert handle.alive(), handle.log()
    http.post(handle.url + "/abort_requests", json={}, timeout=TIMEOUT)
    http.post(handle.url + "/wake_up", timeout=TIMEOUT)  # wakes every tag and resumes (core.py l.1053-1055)
    if handle.state()["weight_update_active"]:
        http.post(handle.url + "/finish_weight_update", json={}, timeout=TIMEOUT)
    http.post(handle.url + "/collective_rpc", json={"method": "reload_weights"}, timeout=TIMEOUT)
    http.post(handle.url + "/update_weight_version", json={"new_version": "default"}, timeout=TIMEOUT)
    wait_for(lambda: (s := handle.state())["running"] == 0 and s["waiting"] == 0)
    state = handle.state()
    assert (state["pause_state"], state["sleeping_tags"], state["weights"]) == ("unpaused", [], "weights:default")


def complete(http: requests.Session, url: str, max_tokens: int = 4, prompt: str = PROMPT, **kw: Any) -> requests.Response:
    body = {"prompt": prompt, "max_tokens": max_tokens}
    return http.post(url + "/v1/completions", json=body, timeout=kw.pop("timeout", TIMEOUT), **kw)


def in_flight(pool: ThreadPoolExecutor, http: requests.Session, handle: EngineHandle, max_tokens: int = LONG) -> Future[requests.Response]:
    """A completion that is running on the engine when this returns."""
    before = handle.state()["running"]
    future = pool.submit(complete, http, handle.url, max_tokens, timeout=60.0)
    wait_for(lambda: handle.state()["running"] > before)
    return future


def test_version_health_and_a_completion(engine: EngineHandle, http: requests.Session) -> None:
    """``/version`` is 0.33.0 (serve/instrumentator/basic.py l.53); the text follows the weights' version."""
    assert http.get(engine.url + "/version", timeout=TIMEOUT).json() == {"version": "0.33.0"}
    health = http.get(engine.url + "/health", timeout=TIMEOUT)
    assert (health.status_code, health.content) == (200, b"")  # serve/instrumentator/health.py l.30
    answer = complete(http, engine.url, 6)
    assert answer.status_code == 200
    body = answer.json()
    assert body["object"] == "text_completion"
    assert body["choices"][0]["text"] == expected_completion(PROMPT, "default", 6)
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 6
    assert expected_completion(PROMPT, "other", 6) != expected_completion(PROMPT, "default", 6)


def test_sleep_twice_is_a_no_op_and_health_stays_200(engine: EngineHandle, http: requests.Session) -> None:
    """Executor.sleep: a second sleep only warns (v1/executor/abstract.py l.400-403); /health 200 while asleep."""
    first = http.post(engine.url + "/sleep", params={"level": 1}, timeout=TIMEOUT)
    assert (first.status_code, first.json()) == (200, {"status": "sleeping", "level": 1})  # serve/dev/sleep/api_router.py l.34
    again = http.post(engine.url + "/sleep", params={"level": 2}, timeout=TIMEOUT)
    assert (again.status_code, again.json()) == (200, {"status": "sleeping", "level": 2})
    assert engine.state()["sleeping_tags"] == ["kv_cache", "weights"]
    assert not engine.state()["weights_discarded"]  # the level-2 call did nothing: level 1's weights are kept
    assert http.get(engine.url + "/health", timeout=TIMEOUT).status_code == 200
    assert http.get(engine.url + "/is_sleeping", timeout=TIMEOUT).json() == {"is_sleeping": True}
    woke = http.post(engine.url + "/wake_up", timeout=TIMEOUT)
    assert woke.json() == {"status": "awake", "tags": None}  # api_router.py l.47-55: no tags = all, reported as null
    assert complete(http, engine.url).json()["choices"][0]["text"] == expected_completion(PROMPT, "default", 4)


def test_wake_tags_one_by_one_and_an_awake_tag_makes_the_whole_call_a_no_op(engine: EngineHandle, http: requests.Session) -> None:
    """A tag not asleep stops the whole wake (abstract.py l.416-422), still 200 "sleeping"; scheduling waits for all (core.py l.1051)."""
    http.post(engine.url + "/sleep", params={"level": 1}, timeout=TIMEOUT)
    weights = http.post(engine.url + "/wake_up", params={"tags": "weights"}, timeout=TIMEOUT)
    assert weights.json() == {"status": "sleeping", "tags": ["weights"]}
    assert engine.state()["sleeping_tags"] == ["kv_cache"]
    assert http.get(engine.url + "/is_paused", timeout=TIMEOUT).json() == {"is_paused": True}
    both = http.post(engine.url + "/wake_up?tags=weights&tags=kv_cache", timeout=TIMEOUT)
    assert (both.status_code, both.json()) == (200, {"status": "sleeping", "tags": ["weights", "kv_cache"]})
    assert engine.state()["sleeping_tags"] == ["kv_cache"]  # kv_cache was not woken either
    kv = http.post(engine.url + "/wake_up", params={"tags": "kv_cache"}, timeout=TIMEOUT)
    assert kv.json() == {"status": "awake", "tags": ["kv_cache"]}
    assert http.get(engine.url + "/is_paused", timeout=TIMEOUT).json() == {"is_paused": False}


def test_level_0_pauses_only_and_scheduling_wakes_it(engine: EngineHandle, http: requests.Session) -> None:
    """Level 0 = pause scheduling only (core.py l.1009-1011); ``tags=scheduling`` is dropped and wakes it (l.1040-1042)."""
    assert http.post(engine.url + "/sleep", params={"level": 0}, timeout=TIMEOUT).json() == {"status": "sleeping", "level": 0}
    state = engine.state()
    assert (state["sleeping_tags"], state["pause_state"]) == ([], "paused_new")
    assert http.get(engine.url + "/is_sleeping", timeout=TIMEOUT).json() == {"is_sleeping": True}
    woke = http.post(engine.url + "/wake_up", params={"tags": "scheduling"}, timeout=TIMEOUT)
    assert woke.json() == {"status": "awake", "tags": ["scheduling"]}
    assert engine.state()["pause_state"] == "unpaused"


def test_is_sleeping_while_merely_paused_and_a_wake_up_clears_the_pause(engine: EngineHandle, http: requests.Session) -> None:
    """is_sleeping = paused or asleep (core.py l.1078-1078); a wake on an awake engine resumes it (l.1053-1055, abstract.py l.414)."""
    assert http.post(engine.url + "/pause", params={"mode": "keep"}, timeout=TIMEOUT).json() == {"status": "paused"}
    assert http.get(engine.url + "/is_sleeping", timeout=TIMEOUT).json() == {"is_sleeping": True}
    assert engine.state()["sleeping_tags"] == []
    woke = http.post(engine.url + "/wake_up", params={"tags": "weights"}, timeout=TIMEOUT)  # not asleep: executor no-op
    assert woke.json() == {"status": "awake", "tags": ["weights"]}
    assert http.get(engine.url + "/is_paused", timeout=TIMEOUT).json() == {"is_paused": False}


def test_pause_abort_aborts_in_flight_and_rejects_new_requests_with_503(
    engine: EngineHandle, http: requests.Session, pool: ThreadPoolExecutor
) -> None:
    """abort mode: requests finish "abort" (core.py l.2208-2212); new ones get 503 until resume (l.2232, l.1796-1806)."""
    running = in_flight(pool, http, engine)
    assert http.post(engine.url + "/pause", timeout=TIMEOUT).json() == {"status": "paused"}  # mode defaults to abort
    aborted = running.result(timeout=TIMEOUT)
    assert (aborted.status_code, aborted.json()["choices"][0]["finish_reason"]) == (200, "abort")
    refused = complete(http, engine.url)
    assert refused.status_code == 503
    assert refused.json()["error"]["message"] == "Generation is paused. Please retry after it resumes."
    assert refused.json()["error"]["type"] == "ServiceUnavailableError"
    assert http.get(engine.url + "/health", timeout=TIMEOUT).status_code == 200  # paused: still healthy
    assert http.post(engine.url + "/resume", timeout=TIMEOUT).json() == {"status": "resumed"}  # rl/online/api_router.py l.86
    assert complete(http, engine.url).status_code == 200


def test_pause_wait_drains_in_flight_then_answers(engine: EngineHandle, http: requests.Session, pool: ThreadPoolExecutor) -> None:
    """wait mode: the call returns once running requests are done (core.py l.2214-2223); new ones get 503 meanwhile."""
    running = in_flight(pool, http, engine, max_tokens=50)  # 0.5 s at 100 tokens/s
    paused = pool.submit(http.post, engine.url + "/pause", params={"mode": "wait"}, timeout=TIMEOUT)
    wait_for(lambda: engine.state()["reject_new_requests"])
    assert complete(http, engine.url).status_code == 503
    assert paused.result(timeout=TIMEOUT).json() == {"status": "paused"}
    done = running.result(timeout=TIMEOUT).json()["choices"][0]
    assert (done["finish_reason"], len(done["text"].split())) == ("length", 50)
    http.post(engine.url + "/resume", timeout=TIMEOUT)


def test_pause_keep_queues_new_requests_until_resume(engine: EngineHandle, http: requests.Session, pool: ThreadPoolExecutor) -> None:
    """keep mode: PAUSED_ALL, new requests accepted and queued (core.py l.2232: no rejection), run after /resume."""
    assert http.post(engine.url + "/pause", params={"mode": "keep"}, timeout=TIMEOUT).json() == {"status": "paused"}
    queued = pool.submit(complete, http, engine.url)
    wait_for(lambda: engine.state()["waiting"] == 1)
    assert not queued.done()
    http.post(engine.url + "/resume", timeout=TIMEOUT)
    answer = queued.result(timeout=TIMEOUT)
    assert (answer.status_code, answer.json()["choices"][0]["text"]) == (200, expected_completion(PROMPT, "default", 4))


def test_sleep_modes_with_a_request_in_flight(engine: EngineHandle, http: requests.Session, pool: ThreadPoolExecutor) -> None:
    """Sleep pauses first (core.py l.1005-1008): abort aborts it, wait lets it finish before sleeping, keep preempts and freezes it."""
    aborted = in_flight(pool, http, engine)
    assert http.post(engine.url + "/sleep", params={"level": 1, "mode": "abort"}, timeout=TIMEOUT).status_code == 200
    assert aborted.result(timeout=TIMEOUT).json()["choices"][0]["finish_reason"] == "abort"
    http.post(engine.url + "/wake_up", timeout=TIMEOUT)

    drained = in_flight(pool, http, engine, max_tokens=50)  # 0.5 s at 100 tokens/s
    slept = http.post(engine.url + "/sleep", params={"level": 1, "mode": "wait"}, timeout=TIMEOUT)  # returns once drained
    assert slept.json() == {"status": "sleeping", "level": 1}
    # finished in full before the wake below: an engine asleep generates nothing, so it ran to its end before sleeping
    # (read with a timeout: the client thread may still be reading the answer the engine sent before /sleep returned)
    assert drained.result(timeout=TIMEOUT).json()["choices"][0]["finish_reason"] == "length"
    assert engine.state()["sleeping_tags"] == ["kv_cache", "weights"]
    http.post(engine.url + "/wake_up", timeout=TIMEOUT)

    kept = in_flight(pool, http, engine, max_tokens=30)
    assert http.post(engine.url + "/sleep", params={"level": 1, "mode": "keep"}, timeout=TIMEOUT).status_code == 200
    state = engine.state()  # level >= 1 clears the caches: the running request is preempted (l.948-952, l.932-946)
    assert (state["pause_state"], state["running"], state["waiting"], state["counts"]["preempted"] >= 1) == ("paused_all", 0, 1, True)
    assert not kept.done()
    assert http.post(engine.url + "/wake_up", timeout=TIMEOUT).json()["status"] == "awake"
    answer = kept.result(timeout=TIMEOUT).json()["choices"][0]
    assert (answer["finish_reason"], answer["text"]) == ("length", expected_completion(PROMPT, "default", 30))


def test_abort_requests_by_id_leaves_the_others_running(engine: EngineHandle, http: requests.Session, pool: ThreadPoolExecutor) -> None:
    """``/abort_requests`` with ids aborts those, without pausing (rl/online/api_router.py l.97-136); "aborted" counts the ids sent."""
    other = in_flight(pool, http, engine)
    mine = pool.submit(complete, http, engine.url, LONG, headers={"X-Request-Id": "mine"}, timeout=60.0)
    wait_for(lambda: engine.state()["running"] == 2)
    answer = http.post(engine.url + "/abort_requests", json={"request_ids": ["mine", "unknown"]}, timeout=TIMEOUT)
    assert answer.json() == {"status": "aborted", "aborted": 2}
    finished = mine.result(timeout=TIMEOUT).json()
    assert (finished["id"], finished["choices"][0]["finish_reason"]) == ("cmpl-mine", "abort")
    assert engine.state()["running"] == 1 and not other.done() and engine.state()["pause_state"] == "unpaused"


def test_a_request_while_asleep_waits_for_the_wake(engine: EngineHandle, http: requests.Session, pool: ThreadPoolExecutor) -> None:
    """Sleep pauses without rejecting (core.py l.2228-2230: only pause_generation rejects): a request hangs until the wake."""
    http.post(engine.url + "/sleep", params={"level": 1}, timeout=TIMEOUT)
    queued = pool.submit(complete, http, engine.url)
    wait_for(lambda: engine.state()["waiting"] == 1)
    assert engine.alive() and not queued.done()
    assert http.post(engine.url + "/wake_up", timeout=TIMEOUT).json()["status"] == "awake"
    assert queued.result(timeout=TIMEOUT).json()["choices"][0]["text"] == expected_completion(PROMPT, "default", 4)


def test_reset_prefix_cache_is_false_while_blocks_are_held(engine: EngineHandle, http: requests.Session, pool: ThreadPoolExecutor) -> None:
    """``{"success": false}`` while running requests hold blocks (serve/dev/cache/api_router.py l.31-44, scheduler.py l.3212)."""
    assert http.post(engine.url + "/reset_prefix_cache", timeout=TIMEOUT).json() == {"success": True}
    running = in_flight(pool, http, engine)
    held = http.post(engine.url + "/reset_prefix_cache", timeout=TIMEOUT)
    assert (held.status_code, held.json()) == (200, {"success": False})
    preempting = http.post(engine.url + "/reset_prefix_cache", params={"reset_running_requests": "true"}, timeout=TIMEOUT)
    assert preempting.json() == {"success": True}  # scheduler.py l.3194-3204: running requests preempted first
    assert http.post(engine.url + "/abort_requests", json={}, timeout=TIMEOUT).json() == {"status": "aborted", "aborted": 1}
    assert running.result(timeout=TIMEOUT).json()["choices"][0]["finish_reason"] == "abort"
    for path in ("/reset_mm_cache", "/reset_encoder_cache"):  # l.47-64: empty 200
        answer = http.post(engine.url + path, timeout=TIMEOUT)
        assert (answer.status_code, answer.content) == (200, b"")


def test_weight_session_state_machine(engine: EngineHandle, http: requests.Session) -> None:
    """start, update..., finish (v1/worker/gpu_worker.py l.1559-1650); refusals are 500 and the engine lives."""
    url = engine.url
    no_start = http.post(url + "/finish_weight_update", json={}, timeout=TIMEOUT)
    assert no_start.status_code == 500
    assert "finish_weight_update called without a matching start_weight_update." in no_start.json()["error"]["message"]
    early = http.post(url + "/update_weights", json={"update_info": {"names": []}}, timeout=TIMEOUT)
    assert (early.status_code, "start_weight_update must be called before update_weights." in early.text) == (500, True)
    init = http.post(url + "/init_weight_transfer_engine", json={"init_info": {"master_port": 1}}, timeout=TIMEOUT)
    assert init.json() == {"message": "Weight transfer initialized"}
    assert http.post(url + "/start_weight_update", timeout=TIMEOUT).json() == {"message": "Weight update started"}
    second = http.post(url + "/start_weight_update", timeout=TIMEOUT)
    assert second.status_code == 500 and "already active" in second.json()["error"]["message"]
    busy = http.post(url + "/shutdown_weight_transfer_engine", timeout=TIMEOUT)
    assert busy.status_code == 500 and "during a weight update" in busy.text  # gpu_worker.py l.1535-1538
    for layer in range(2):  # two different chunks (the same one twice would wedge the engine: the last test)
        chunk = {"update_info": {"names": [f"layer.{layer}"]}}
        assert http.post(url + "/update_weights", json=chunk, timeout=TIMEOUT).json() == {"message": "Weights updated"}
    finished = http.post(url + "/finish_weight_update", json={"weight_version": "step-1"}, timeout=TIMEOUT)
    assert finished.json() == {"message": "Weight update finished"}
    assert http.get(url + "/weight_info", timeout=TIMEOUT).json() == {"weight_version": "step-1"}
    assert complete(http, url).json()["choices"][0]["text"] == expected_completion(PROMPT, "step-1", 4)
    assert engine.alive()
    label = http.post(url + "/update_weight_version", json={"new_version": "label-only"}, timeout=TIMEOUT)
    assert label.json() == {"success": True, "new_version": "label-only"}  # api_router.py l.223; the weights stay step-1's
    assert complete(http, url).json()["choices"][0]["text"] == expected_completion(PROMPT, "step-1", 4)


def test_level_2_leaves_garbage_weights_that_still_answer_200(engine: EngineHandle, http: requests.Session) -> None:
    """Level 2 keeps only buffers (gpu_worker.py l.306-311): woken weights answer 200 but wrong until an update."""
    url = engine.url
    baseline = http.post(url + "/weight_checker", json={"action": "checksum"}, timeout=TIMEOUT).json()["checksums"]
    assert len(baseline) >= 1
    http.post(url + "/sleep", params={"level": 2}, timeout=TIMEOUT)
    assert http.post(url + "/wake_up", timeout=TIMEOUT).json()["status"] == "awake"
    wrong = complete(http, url)
    assert wrong.status_code == 200
    assert wrong.json()["choices"][0]["text"] != expected_completion(PROMPT, "default", 4)
    assert http.get(url + "/weight_info", timeout=TIMEOUT).json() == {"weight_version": "default"}  # the label does not know
    compare = http.post(url + "/weight_checker", json={"action": "compare", "baseline": baseline}, timeout=TIMEOUT).json()
    assert compare == {"match": False, "mismatches": sorted(baseline)}  # rl/online/api_router.py l.261-266
    no_baseline = http.post(url + "/weight_checker", json={"action": "compare"}, timeout=TIMEOUT)
    assert no_baseline.status_code == 400  # l.243-247
    http.post(url + "/init_weight_transfer_engine", json={"init_info": {}}, timeout=TIMEOUT)
    http.post(url + "/start_weight_update", timeout=TIMEOUT)
    http.post(url + "/update_weights", json={"update_info": {"names": ["w"]}}, timeout=TIMEOUT)
    http.post(url + "/finish_weight_update", json={"weight_version": "step-2"}, timeout=TIMEOUT)
    assert complete(http, url).json()["choices"][0]["text"] == expected_completion(PROMPT, "step-2", 4)
    reset = http.post(url + "/weight_checker", json={"action": "reset"}, timeout=TIMEOUT)
    assert reset.json() == {"status": "reset"}  # rl/online/api_router.py l.240-242: reset_weights zeroes them (gpu_worker.py l.393)
    assert complete(http, url).json()["choices"][0]["text"] != expected_completion(PROMPT, "step-2", 4)


def test_release_kv_cache_memory_needs_a_completed_pause_and_resident_memory(engine: EngineHandle, http: requests.Session) -> None:
    """core.py l.1058-1075: 500 without a pause, 200 after one, 500 again once kv_cache is released."""
    url = engine.url
    unpaused = http.post(url + "/release_kv_cache_memory", timeout=TIMEOUT)
    assert unpaused.status_code == 500 and "requires a completed pause first" in unpaused.text
    http.post(url + "/pause", params={"mode": "keep"}, timeout=TIMEOUT)
    released = http.post(url + "/release_kv_cache_memory", timeout=TIMEOUT)
    assert released.json() == {"status": "kv_cache_released"}
    assert engine.state()["sleeping_tags"] == ["kv_cache"]
    again = http.post(url + "/release_kv_cache_memory", timeout=TIMEOUT)
    assert again.status_code == 500 and "requires all executor memory to be resident" in again.text
    assert http.post(url + "/wake_up", params={"tags": "kv_cache"}, timeout=TIMEOUT).json()["status"] == "awake"
    assert engine.alive()


def test_query_parameters_are_validated_as_vllm_validates_them(engine: EngineHandle, http: requests.Session) -> None:
    """Bad query values are 400 (handlers/validation.py l.149), never 422; /pause's ValueError path is 400 too."""
    for path, params in (
        ("/sleep", {"level": 3}),
        ("/sleep", {"mode": "later"}),
        ("/pause", {"mode": "later"}),
        ("/get_world_size", {"include_dp": "maybe"}),
    ):
        answer = (
            http.post(engine.url + path, params=params, timeout=TIMEOUT)
            if path != "/get_world_size"
            else http.get(engine.url + path, params=params, timeout=TIMEOUT)
        )
        assert answer.status_code == 400, (path, params, answer.text)
        assert answer.json()["error"]["code"] == 400
    assert http.get(engine.url + "/get_world_size", params={"include_dp": "false"}, timeout=TIMEOUT).json() == {"world_size": 1}
    missing = http.post(engine.url + "/collective_rpc", json={}, timeout=TIMEOUT)
    # serve/dev/rpc/api_router.py l.37-42
    assert (missing.status_code, missing.json()["error"]["message"]) == (400, "Missing 'method' in request body")
    assert engine.state()["pause_state"] == "unpaused"


def test_control_calls_are_recorded_and_completions_are_not(engine: EngineHandle, http: requests.Session) -> None:
    """The shared call record: control routes in arrival order, the data plane left out."""
    complete(http, engine.url)
    http.post(engine.url + "/sleep?level=1&mode=keep", timeout=TIMEOUT)
    calls = engine.record()["calls"]
    assert not any(c["path"] == "/v1/completions" for c in calls)
    last = calls[-1]
    assert (last["method"], last["path"], last["query"], last["status"]) == ("POST", "/sleep", "level=1&mode=keep", 200)


def test_resume_while_asleep_lets_a_request_onto_slept_memory_and_the_engine_dies(fleet: EmulatedFleet, http: requests.Session) -> None:
    """/resume does not look at sleeping tags (core.py l.2235, l.985): the next forward is an illegal memory access."""
    victim = fleet.engines[CRASH_RESUME_ASLEEP]  # straight to it: through the proxy a dead engine is a 502
    http.post(victim.direct_url + "/sleep", params={"level": 1}, timeout=TIMEOUT)
    assert http.post(victim.direct_url + "/resume", timeout=TIMEOUT).json() == {"status": "resumed"}
    with pytest.raises(requests.ConnectionError):
        complete(http, victim.direct_url)
    assert victim.wait_exit(TIMEOUT) == -9
    assert "illegal memory access" in victim.log()
    assert fleet.engines[SURVIVOR].alive()


def test_weights_woken_and_kv_cache_asleep_then_resume_kills_the_engine(
    fleet: EmulatedFleet, http: requests.Session, pool: ThreadPoolExecutor
) -> None:
    """vllm#44395: wake(weights), then a forward onto the slept KV cache once /resume reopens scheduling."""
    victim = fleet.engines[CRASH_HALF_AWAKE]
    http.post(victim.direct_url + "/sleep", params={"level": 2}, timeout=TIMEOUT)
    http.post(victim.direct_url + "/wake_up", params={"tags": "weights"}, timeout=TIMEOUT)
    queued = pool.submit(complete, http, victim.direct_url)
    wait_for(lambda: victim.state()["waiting"] == 1)  # the scheduler stays paused while kv_cache sleeps (core.py l.1051-1055)
    assert victim.alive() and not queued.done()
    try:
        http.post(victim.direct_url + "/resume", timeout=TIMEOUT)
    except requests.ConnectionError:
        pass  # the queued request may kill the engine before the answer is out
    with pytest.raises(requests.ConnectionError):
        queued.result(timeout=TIMEOUT)
    assert victim.wait_exit(TIMEOUT) == -9
    assert "slept kv_cache" in victim.log()


def test_a_weight_update_while_the_weights_sleep_kills_the_engine(fleet: EmulatedFleet, http: requests.Session) -> None:
    """vLLM #57853 / #57854: 0.33.0's ``Worker.update_weights`` (gpu_worker.py l.1592) never looks at the sleep state, and
    the load into unmapped weights segfaults the EngineCore; until then /health answers 200 and the session opens."""
    victim = fleet.engines[CRASH_WEIGHTS_ASLEEP]
    url = victim.direct_url
    http.post(url + "/init_weight_transfer_engine", json={"init_info": {}}, timeout=TIMEOUT)
    http.post(url + "/sleep", params={"level": 1}, timeout=TIMEOUT)
    assert http.get(url + "/health", timeout=TIMEOUT).status_code == 200
    assert http.post(url + "/start_weight_update", timeout=TIMEOUT).json() == {"message": "Weight update started"}
    with pytest.raises(requests.ConnectionError):
        http.post(url + "/update_weights", json={"update_info": {"names": ["w"]}}, timeout=TIMEOUT)
    assert victim.wait_exit(TIMEOUT) == -9
    assert "a weight update loaded into slept weights" in victim.log() and "illegal memory access" in victim.log()
    assert fleet.engines[SURVIVOR].alive()


def test_behind_the_fault_proxy_a_re_sent_sleep_or_wake_is_harmless(fleet: EmulatedFleet, http: requests.Session) -> None:
    """The shared fault proxy in front of a vLLM engine: a 502 after the sleep, a reset before the wake, both re-sent.

    Sleep and wake are idempotent on vLLM (abstract.py l.400-403, l.412-415), so the repeats are no-ops; the
    memory probe (the shared side channel) reads the sleeping tags the engine really has.
    """
    proxied = fleet.engines[PROXIED]
    assert proxied.proxy is not None and proxied.url != proxied.direct_url
    probe = fleet.memory_probe()
    assert probe.released_tags(proxied.url) == frozenset()
    ambiguous = http.post(proxied.url + "/sleep", params={"level": 1}, timeout=TIMEOUT)
    assert ambiguous.status_code == 502  # the engine slept, the client cannot know
    assert probe.released_tags(proxied.url) == frozenset({"weights", "kv_cache"})
    assert http.post(proxied.url + "/sleep", params={"level": 1}, timeout=TIMEOUT).json() == {"status": "sleeping", "level": 1}
    with pytest.raises(requests.ConnectionError):
        http.post(proxied.url + "/wake_up", timeout=TIMEOUT)  # reset before forwarding: the engine saw nothing
    assert proxied.state()["sleeping_tags"] == ["kv_cache", "weights"]
    assert http.post(proxied.url + "/wake_up", timeout=TIMEOUT).json() == {"status": "awake", "tags": None}
    assert probe.released_tags(proxied.direct_url) == frozenset()
    assert [f.kind for f in proxied.proxy.injected] == ["status_after", "reset_before"]
    assert proxied.alive()


def test_behind_the_fault_proxy_an_update_lost_after_sending_was_applied(fleet: EmulatedFleet, http: requests.Session) -> None:
    """``drop_after`` on /update_weights: the chunk was loaded though the client saw a reset (not idempotent: gpu_worker.py l.1592)."""
    proxied = fleet.engines[PROXIED]
    assert proxied.proxy is not None
    http.post(proxied.url + "/init_weight_transfer_engine", json={"init_info": {}}, timeout=TIMEOUT)
    http.post(proxied.url + "/start_weight_update", timeout=TIMEOUT)
    with pytest.raises(requests.ConnectionError):
        http.post(proxied.url + "/update_weights", json={"update_info": {"names": ["w"]}}, timeout=TIMEOUT)
    proxied.proxy.settle()
    assert proxied.state()["update_chunks"] == 1
    http.post(proxied.url + "/finish_weight_update", json={"weight_version": "step-9"}, timeout=TIMEOUT)
    assert http.get(proxied.url + "/weight_info", timeout=TIMEOUT).json() == {"weight_version": "step-9"}


def test_a_re_sent_weight_chunk_wedges_the_engine_while_health_stays_200(fleet: EmulatedFleet, http: requests.Session) -> None:
    """prime-rl#3599: the same ``/update_weights`` again waits for a broadcast that never comes (vllm-control-plane.md 4.5);
    every call that needs the EngineCore hangs behind it, completions too, while /health answers 200."""
    victim = fleet.engines[WEDGED]
    url = victim.direct_url
    http.post(url + "/init_weight_transfer_engine", json={"init_info": {}}, timeout=TIMEOUT)
    http.post(url + "/start_weight_update", timeout=TIMEOUT)
    chunk = {"update_info": {"names": ["layer.0"], "dtype_names": ["bfloat16"], "shapes": [[2, 2]]}}
    assert http.post(url + "/update_weights", json=chunk, timeout=TIMEOUT).json() == {"message": "Weights updated"}
    other = {"update_info": {"names": ["layer.1"], "dtype_names": ["bfloat16"], "shapes": [[2, 2]]}}
    assert http.post(url + "/update_weights", json=other, timeout=TIMEOUT).status_code == 200  # another chunk: fine
    with pytest.raises(requests.ReadTimeout):
        http.post(url + "/update_weights", json=other, timeout=0.5)  # the same chunk again
    assert victim.state()["wedged"] is True
    for method, path in (("GET", "/is_paused"), ("POST", "/finish_weight_update"), ("POST", "/sleep")):
        with pytest.raises(requests.ReadTimeout):
            http.request(method, url + path, json={}, timeout=0.5)
    with pytest.raises(requests.ReadTimeout):
        complete(http, url, timeout=0.5)
    assert http.get(url + "/health", timeout=TIMEOUT).status_code == 200
    assert http.get(url + "/get_world_size", timeout=TIMEOUT).json() == {"world_size": 1}  # read from the config
    assert victim.alive()
