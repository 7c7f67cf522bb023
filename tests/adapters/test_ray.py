"""The barrier on Ray: engine actors on a local Ray, emulated SGLang engines behind them, real HTTP on 127.0.0.1.

One module-scoped Ray (``ray.init(num_cpus=2)``) and one module-scoped fleet of
emulated engines serve every test; each test leaves every engine serving with
its memory back. Ordering is read from the engines' own server-side records
(arrival and answer times on the system-wide monotonic clock), never from mocks.
"""

from __future__ import annotations

import functools
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pytest
import requests

if os.environ.get("CI", "").lower() == "true":
    import ray  # CI must have Ray: fail, don't skip
else:
    ray = pytest.importorskip("ray", reason="Ray is not installed (pip install controlplane-resilience[ray])")
pytest.importorskip("fastapi")
pytest.importorskip("torch")

from resilience.adapters.ray import RayEngine, RayFanOut, TimedValue, _unwrap, ray_engines
from resilience.adapters.sglang import SGLANG_POLICIES, SGLangClient, SGLangError
from resilience.barrier import EngineGroup, Orchestrator, PhaseDeadlines, PhaseFailed
from resilience.barrier.fanout import FanOut, PhaseTimeout, ThreadFanOut
from resilience.barrier.state import Effect, PhaseEnded, effect_of
from resilience.deadline import Deadline
from resilience.engine_contract import EngineDied, EngineUnavailable
from resilience.events import Event
from resilience.outcome import Delivery, attempts_of
from resilience.policy import EndpointPolicy, RetryPolicy
from resilience.testing.emulator import EmulatedFleet, EngineConfig, EngineHandle

CONFIG = EngineConfig(
    token_rate=100.0,
    health_hang_seconds=1.0,
    health_poll_seconds=0.05,
    abort_poll_seconds=0.3,  # a pause(abort) with a request in flight takes >= 0.3 s: the slow engine of a phase
    swap_seconds=0.05,
)
CLIENT_KWARGS: dict[str, Any] = {"flush_poll_s": 0.05}
LONG_TOKENS = 2000  # a request that stays in flight for 20 s at 100 tokens/s, until a pause aborts it
TIMEOUT = 10.0  # seconds: a bound no healthy loopback exchange reaches
N_ENGINES = 3
BACKENDS = ("ray", "threads", "threads_over_ray_engines")


@pytest.fixture(scope="module")
def local_ray(ray_runtime: Any) -> Iterator[None]:
    """The session's local Ray (2 CPUs, loopback, no dashboard)."""
    yield


@pytest.fixture(scope="module")
def fleet(request: pytest.FixtureRequest) -> Iterator[EmulatedFleet]:
    """Emulated engines, started while Ray starts (both take seconds), stopped after the module."""
    f = EmulatedFleet(N_ENGINES, CONFIG)
    try:
        with ThreadPoolExecutor(max_workers=1) as starter:  # leaving the block waits for the start
            started = starter.submit(f.start)
            request.getfixturevalue("local_ray")
        started.result()
        yield f
    finally:
        f.stop()


@pytest.fixture(scope="module")
def actors(fleet: EmulatedFleet) -> Iterator[list[RayEngine]]:
    """One engine actor per emulated engine, shared by the tests that leave them alive."""
    engines = ray_engines(fleet.urls, client_kwargs=CLIENT_KWARGS)
    try:
        yield engines
    finally:
        drop_engines(engines)


@pytest.fixture(scope="module")
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(max_workers=4) as executor:
        yield executor


@pytest.fixture
def serving(fleet: EmulatedFleet) -> Iterator[EmulatedFleet]:
    """The fleet, every engine left serving afterwards: continued, memory resumed, nothing in flight."""
    yield fleet
    with requests.Session() as http:
        http.trust_env = False
        for handle in fleet.engines:
            assert handle.alive(), handle.log()
            released = handle.state()["released_tags"]
            if released:
                http.post(handle.url + "/resume_memory_occupation", json={"tags": released}, timeout=TIMEOUT)
            http.post(handle.url + "/continue_generation", json={}, timeout=TIMEOUT)
            wait_for(functools.partial(idle, handle))


@pytest.fixture
def hung_url() -> Iterator[str]:
    """A loopback server that accepts connections and never answers, until the test ends."""
    release = threading.Event()
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(16)
    lsock.settimeout(0.1)
    conns: list[socket.socket] = []

    def accept() -> None:
        while not release.is_set():
            try:
                conn, _ = lsock.accept()
            except TimeoutError:
                continue
            conns.append(conn)

    thread = threading.Thread(target=accept, name="hung-server", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{lsock.getsockname()[1]}"
    finally:
        release.set()
        thread.join(TIMEOUT)
        for conn in conns:
            conn.close()
        lsock.close()


def idle(handle: EngineHandle) -> bool:
    state = handle.state()
    return bool(state["in_flight"] == 0 and state["waiting_at_pause_gate"] == 0)


def wait_for(predicate: Callable[[], bool], timeout: float = TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():  # bounded by the deadline
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.02)


def make_engines(backend: str, urls: Sequence[str], actors: list[RayEngine]) -> tuple[list[Any], FanOut]:
    if backend == "ray":
        return actors, RayFanOut()
    if backend == "threads_over_ray_engines":
        return actors, ThreadFanOut()
    return [SGLangClient(url, **CLIENT_KWARGS) for url in urls], ThreadFanOut()


def drop_engines(engines: Sequence[Any]) -> None:
    for engine in engines:
        if isinstance(engine, RayEngine):
            engine.kill()
        else:
            engine.close()


def calls_since(handle: EngineHandle, since_ns: int, path: str) -> list[dict[str, Any]]:
    return [c for c in handle.record()["calls"] if c["path"] == path and c["received_ns"] >= since_ns]


def start_long_request(pool: ThreadPoolExecutor, handle: EngineHandle) -> Future[Any]:
    """A /generate that stays in flight until a pause aborts it."""
    client = SGLangClient(handle.url)
    future = pool.submit(client.generate, "keep me busy", sampling_params={"max_new_tokens": LONG_TOKENS, "ignore_eos": True})
    wait_for(lambda: handle.state()["in_flight"] == 1)
    return future


def assert_barrier(fleet: EmulatedFleet, since_ns: int, before: str, after: str) -> None:
    """Every engine answered ``before`` before any engine received ``after``."""
    firsts = [calls_since(h, since_ns, before) for h in fleet.engines]
    seconds = [calls_since(h, since_ns, after) for h in fleet.engines]
    assert all(len(c) == 1 and c[0]["status"] == 200 for c in firsts), firsts
    assert all(len(c) == 1 and c[0]["status"] == 200 for c in seconds), seconds
    last_answer = max(c[0]["answered_ns"] for c in firsts)
    first_receipt = min(c[0]["received_ns"] for c in seconds)
    assert last_answer < first_receipt, (
        f"{after} reached an engine {(last_answer - first_receipt) / 1e6:.1f} ms before the last {before} answer"
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_offload_and_onload_keep_the_barrier(
    backend: str, serving: EmulatedFleet, actors: list[RayEngine], pool: ThreadPoolExecutor
) -> None:
    """Offload: all pauses answered before any flush, all flushes before any release; onload: all resumes before any continue."""
    engines, fanout = make_engines(backend, serving.urls, actors)
    try:
        orch = Orchestrator(EngineGroup(engines), fanout=fanout)
        since = time.monotonic_ns()
        busy = start_long_request(pool, serving.engines[0])  # engine 0's pause takes >= abort_poll_seconds
        report = orch.offload()
        assert busy.result(TIMEOUT).finish_reason == "abort"
        assert [p.phase for p in report.phases] == ["pause", "flush", "release"]
        assert_barrier(serving, since, "/pause_generation", "/flush_cache")
        assert_barrier(serving, since, "/flush_cache", "/release_memory_occupation")
        slow_pause = calls_since(serving.engines[0], since, "/pause_generation")[0]
        assert slow_pause["answered_ns"] - slow_pause["received_ns"] >= 0.25e9  # the barrier really waited for it
        assert all(sorted(h.state()["released_tags"]) == ["cuda_graph", "kv_cache", "weights"] for h in serving.engines)

        report = orch.onload()
        assert [p.phase for p in report.phases] == ["resume", "continue"]
        assert_barrier(serving, since, "/resume_memory_occupation", "/continue_generation")
        assert all(h.state()["released_tags"] == [] and not h.state()["paused"] for h in serving.engines)
        assert report.ideal_s <= report.duration_s
    finally:
        if backend == "threads":
            drop_engines(engines)


def test_killed_actor_during_offload_is_named_and_the_others_roll_back(serving: EmulatedFleet) -> None:
    """An actor killed between pause and flush fails the flush as EngineDied by its engine name; the others are continued and serve."""
    engines = ray_engines(serving.urls, client_kwargs=CLIENT_KWARGS)
    victim = engines[1]

    def kill_after_pause(event: Event) -> None:
        if isinstance(event, PhaseEnded) and event.phase == "pause":
            ray.kill(victim.actor, no_restart=True)
            wait_for(lambda: _actor_dead(victim))

    try:
        orch = Orchestrator(EngineGroup(engines), fanout=RayFanOut(), observers=[kill_after_pause])
        since = time.monotonic_ns()
        with pytest.raises(PhaseFailed) as info:
            orch.offload()
        err = info.value
        assert err.phase == "flush"
        assert set(err.failures) == {victim.engine}
        assert isinstance(err.failures[victim.engine], EngineDied)
        assert victim.engine in str(err) and "EngineDied" in str(err)
        assert err.dead == (victim.engine,)
        survivors = [e.engine for e in engines if e is not victim]
        assert sorted(err.rolled_back) == sorted(survivors)
        assert list(err.left_paused) == [victim.engine] and "dead" in err.left_paused[victim.engine]  # v2: every engine not serving
        assert calls_since(serving.engines[1], since, "/flush_cache") == []  # the dead actor sent nothing more
        for i in (0, 2):
            handle = serving.engines[i]
            assert calls_since(handle, since, "/release_memory_occupation") == []
            assert calls_since(handle, since, "/continue_generation")[0]["status"] == 200
            done = SGLangClient(handle.url).generate("hello again", sampling_params={"max_new_tokens": 4})
            assert done.finish_reason == "length" and len(done.output_ids) == 4
        assert serving.engines[1].state()["paused"]  # its actor died, not the engine: still paused, as the error says (dead)
    finally:
        drop_engines(engines)


def _actor_dead(engine: RayEngine) -> bool:
    try:
        ray.get(engine.actor.engine.remote(), timeout=TIMEOUT)
    except ray.exceptions.RayActorError:
        return True
    return False


def test_errors_raised_in_the_actor_arrive_as_themselves(serving: EmulatedFleet, actors: list[RayEngine]) -> None:
    """An SGLang error raised inside the actor reaches the caller as SGLangError (not RayTaskError), directly and through the fan-out."""
    engine = actors[0]
    with pytest.raises(SGLangError) as info:
        engine.end_weight_update()  # no session open: 400
    assert info.value.status == 400 and info.value.engine == engine.engine
    assert not isinstance(info.value, ray.exceptions.RayTaskError)
    [result] = RayFanOut().call([(engine, {})], "end_weight_update", Deadline(TIMEOUT))
    assert isinstance(result.error, SGLangError) and result.error.status == 400
    for error in (info.value, result.error):  # the delivery record crossed Ray with the error
        records = attempts_of(error)
        assert records and (records[-1].delivery, records[-1].status) == (Delivery.RESPONDED, 400), error
    assert engine.model_info().model_path == CONFIG.model_path


def test_a_dead_actor_is_engine_died(serving: EmulatedFleet) -> None:
    """Calls on a killed actor raise EngineDied naming the engine, directly and through the fan-out."""
    engines = ray_engines(serving.urls[:1])
    engines[0].kill()
    wait_for(lambda: _actor_dead(engines[0]))
    with pytest.raises(EngineDied, match=engines[0].engine):
        engines[0].health()
    [result] = RayFanOut().call([(engines[0], {})], "health", Deadline(TIMEOUT))
    assert isinstance(result.error, EngineDied) and engines[0].engine in str(result.error)


def test_an_engine_refusing_connections_is_dead_with_its_attempts(
    serving: EmulatedFleet, actors: list[RayEngine], refusing_port: int
) -> None:
    """Connection refused inside the actor reaches the barrier as the client's error with its attempts (all not sent): a dead engine."""
    fast = SGLANG_POLICIES.with_entries(  # refusals are retried until the deadline (issue 10), so a short one
        {
            "POST /pause_generation": EndpointPolicy(
                retry=RetryPolicy(max_attempts=2, base_s=0.01, cap_s=0.01), attempt_timeout_s=0.5, deadline_s=0.5
            )
        }
    )
    [gone] = ray_engines([f"http://127.0.0.1:{refusing_port}"], client_kwargs={"policies": fast})
    try:
        orch = Orchestrator(EngineGroup([actors[0], gone]), fanout=RayFanOut())
        with pytest.raises(PhaseFailed) as info:
            orch.offload()
        err = info.value
        assert err.phase == "pause" and set(err.failures) == {gone.engine} and err.dead == (gone.engine,)
        cause = err.failures[gone.engine]
        assert isinstance(cause, requests.ConnectionError) and not isinstance(cause, ray.exceptions.RayError)
        attempts = attempts_of(cause)
        assert attempts is not None and len(attempts) >= 2 and all(a.delivery is Delivery.NOT_SENT for a in attempts)
        assert err.rolled_back == (actors[0].engine,) and not serving.engines[0].state()["paused"]
    finally:
        drop_engines([gone])


def test_the_phase_deadline_caps_http_calls_inside_the_actor(local_ray: None, hung_url: str) -> None:
    """A call to an engine that never answers ends with the deadline passed into the actor, not the policy's 30 s attempt timeout."""
    engines = ray_engines([hung_url])
    try:
        t0 = time.monotonic()
        with pytest.raises(ray.exceptions.RayTaskError) as info:
            ray.get(engines[0].actor.call.remote("continue_generation", {}, 0.5), timeout=TIMEOUT)
        assert time.monotonic() - t0 < TIMEOUT
        assert isinstance(info.value.cause, requests.Timeout), repr(info.value.cause)
        records = attempts_of(info.value.cause)  # crossed Ray: the engine read the call and never answered
        assert records and records[0].delivery is Delivery.AMBIGUOUS, records
    finally:
        drop_engines(engines)


def _slow_actor_class() -> Any:
    """An actor class answering ``timed_call`` after ``delay_s``, whatever the deadline (local: Ray ships it by value)."""

    class Slow:
        def __init__(self, delay_s: float) -> None:
            self.delay_s = delay_s

        def timed_call(self, method: str, kwargs: dict[str, Any], deadline_s: float | None) -> TimedValue:
            time.sleep(self.delay_s)
            return TimedValue(method, self.delay_s)

    return ray.remote(Slow)


class _SlowEngine:
    def __init__(self, engine: str, delay_s: float) -> None:
        self.engine = engine
        self.actor = _slow_actor_class().options(num_cpus=0, max_concurrency=2).remote(delay_s)


def test_refs_not_ready_by_the_deadline_are_phase_timeouts(local_ray: None) -> None:
    """The fan-out waits for all refs at once: the fast engine answers, the one past the deadline is PhaseTimeout."""
    fast, slow = _SlowEngine("http://127.0.0.1:1", 0.0), _SlowEngine("http://127.0.0.1:2", 30.0)
    try:
        ray.get(fast.actor.timed_call.remote("warm", {}, None), timeout=TIMEOUT)
        results = RayFanOut().call([(fast, {}), (slow, {})], "pause_generation", Deadline(1.0))
        assert [r.engine for r in results] == [fast.engine, slow.engine]
        assert results[0].ok and results[0].value == "pause_generation"
        assert isinstance(results[1].error, PhaseTimeout) and slow.engine in str(results[1].error)
    finally:
        ray.kill(fast.actor)
        ray.kill(slow.actor)


def test_a_late_ref_is_handed_back_and_lands(local_ray: None) -> None:
    """A call past the phase deadline comes back with a handle: the barrier can wait for it to land and read its outcome."""
    slow = _SlowEngine("http://127.0.0.1:2", 0.6)
    try:
        ray.get(slow.actor.timed_call.remote("warm", {}, None), timeout=TIMEOUT)
        [result] = RayFanOut(cancel_late=False).call([(slow, {})], "pause_generation", Deadline(0.2))
        assert isinstance(result.error, PhaseTimeout) and effect_of(result.error) is Effect.AMBIGUOUS
        assert result.late is not None
        assert result.late.wait(TIMEOUT) == (True, None)  # it landed, applied
    finally:
        ray.kill(slow.actor)


def test_the_barrier_waits_for_a_late_ray_call_before_the_next_command(local_ray: None) -> None:
    """A pause still running at the phase deadline is named as in flight, and awaited before that engine gets anything else."""
    fast, slow = _SlowEngine("http://127.0.0.1:1", 0.0), _SlowEngine("http://127.0.0.1:2", 0.6)
    try:
        ray.get([e.actor.timed_call.remote("warm", {}, None) for e in (fast, slow)], timeout=TIMEOUT)  # both actors up
        orch = Orchestrator(EngineGroup([fast, slow]), fanout=RayFanOut(cancel_late=False),
                            deadlines=PhaseDeadlines(transition_s=30, pause_s=0.2, continue_s=10))
        with pytest.raises(PhaseFailed) as info:
            orch.offload()
        assert "late pause_generation" in info.value.left_paused[slow.engine] and info.value.rolled_back == (fast.engine,)
        with orch.weight_sync():  # settles the late pause first: the slow engine is known paused, not paused again
            assert orch.states()[slow.engine] == "paused"
        assert orch.not_serving() == {}
    finally:
        ray.kill(fast.actor)
        ray.kill(slow.actor)


def test_an_unavailable_actor_is_ambiguous(local_ray: None) -> None:
    """Ray's ActorUnavailableError (the call may have run) reaches the barrier as EngineUnavailable: unknown, not "not applied"."""
    error = _unwrap(ray.exceptions.ActorUnavailableError("the actor's node is unreachable", None), "http://127.0.0.1:3")
    assert isinstance(error, EngineUnavailable) and "http://127.0.0.1:3" in str(error)
    assert effect_of(error) is Effect.AMBIGUOUS


def test_fan_out_refuses_engines_without_an_actor(local_ray: None) -> None:
    """RayFanOut only drives Ray engine handles; a plain client is a programming error, said at once."""
    with pytest.raises(TypeError, match="ray_engines"):
        RayFanOut().call([(SGLangClient("http://127.0.0.1:1"), {})], "health", Deadline(1.0))


def test_partial_offload_with_tight_phase_deadlines(serving: EmulatedFleet, actors: list[RayEngine]) -> None:
    """Offload of one tag in retract mode under tight phase deadlines, then onload: only that tag moves, and every engine serves."""
    orch = Orchestrator(EngineGroup(actors), fanout=RayFanOut(), deadlines=PhaseDeadlines(transition_s=30, pause_s=5, flush_s=5))
    orch.offload(tags=["kv_cache"], mode="retract")
    assert all(h.state()["released_tags"] == ["kv_cache"] for h in serving.engines)
    assert all(e.health().paused_by_us for e in actors)  # answered at once by the actor's client, no 20 s hang
    orch.onload()
    assert all(e.health().healthy and not e.health().paused_by_us for e in actors)
