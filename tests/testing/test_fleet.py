"""Fleets forked from one zygote: each engine its own process and failure domain, restartable alone.

Real engines on 127.0.0.1, real SGLang deaths (``crash.py``): one engine's crash ends
that process only, its port refuses connections like a dead SGLang server's, and its
neighbours, forked from the same zygote, keep serving.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from resilience.testing.emulator import EmulatedFleet, EmulatorStartError, EngineConfig, EngineHandle
from resilience.testing.emulator.ready import READY_PREFIX, print_ready, ready_url
from resilience.testing.faults import FaultPlan
from tests.conftest import none_of_ours_listens, process_tree

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("torch")
psutil = pytest.importorskip("psutil")

CONFIG = EngineConfig(token_rate=100.0, health_hang_seconds=1.0, health_poll_seconds=0.05, abort_poll_seconds=0.05, swap_seconds=0.01)
LONG = 2000  # max_new_tokens of a request that stays in flight for 20 s at 100 tokens/s
TIMEOUT = 10.0  # seconds: a bound no healthy loopback exchange reaches
N = 4


def session() -> requests.Session:
    s = requests.Session()
    s.trust_env = False
    return s


def generate(url: str, max_new_tokens: int) -> requests.Response:
    with session() as s:
        return s.post(url + "/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": max_new_tokens}}, timeout=60)


def wait_for(predicate: Callable[[], bool], timeout: float = TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():  # bounded by the deadline
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.02)


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


# ----- the three SGLang deaths, each sent to one engine --------------------------------------


def double_release(handle: EngineHandle, pool: ThreadPoolExecutor) -> int:
    """torch_memory_saver's exit(1) on a second release of the same tag."""
    with session() as s:
        assert s.post(handle.url + "/release_memory_occupation", json={"tags": ["kv_cache"]}, timeout=TIMEOUT).status_code == 200
        assert handle.state()["allocated_bytes"]["kv_cache"] == 0  # the storage is really freed in this engine
        with pytest.raises(requests.ConnectionError):
            s.post(handle.url + "/release_memory_occupation", json={"tags": ["kv_cache"]}, timeout=TIMEOUT)
    return 1


def prefill_into_released(handle: EngineHandle, pool: ThreadPoolExecutor) -> int:
    """Bug B: release with no pause, then a /generate is prefilled into the freed pool: the scheduler dies."""
    with session() as s:
        assert s.post(handle.url + "/release_memory_occupation", json={"tags": ["kv_cache"]}, timeout=TIMEOUT).status_code == 200
    with pytest.raises(requests.ConnectionError):
        generate(handle.url, 3)
    return -signal.SIGKILL


def release_with_work_in_flight(handle: EngineHandle, pool: ThreadPoolExecutor) -> int:
    """release_memory_occupation while a request runs: the scheduler's idle assertion fails, the engine dies."""
    future: Future[requests.Response] = pool.submit(generate, handle.url, LONG)
    wait_for(lambda: handle.state()["running"] == 1)
    with session() as s, pytest.raises(requests.ConnectionError):
        s.post(handle.url + "/release_memory_occupation", json={"tags": None}, timeout=TIMEOUT)
    with pytest.raises(requests.ConnectionError):
        future.result(timeout=TIMEOUT)
    return -signal.SIGKILL


DEATHS: dict[str, Callable[[EngineHandle, ThreadPoolExecutor], int]] = {
    "double release": double_release,
    "prefill into released memory": prefill_into_released,
    "release with work in flight": release_with_work_in_flight,
}


# ----- fixtures ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fleet() -> Iterator[EmulatedFleet]:
    with EmulatedFleet(N, CONFIG) as f:
        yield f


@pytest.fixture(scope="module")
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(max_workers=4) as executor:
        yield executor


def assert_serves(handle: EngineHandle) -> None:
    """The engine is alive, answers control reads and decodes a request."""
    assert handle.alive(), handle.log()
    response = generate(handle.url, 2)
    assert response.status_code == 200 and len(response.json()["output_ids"]) == 2
    assert all(handle.state()["allocated_bytes"].values())


# ----- tests -------------------------------------------------------------------------------------


def test_default_fleet_forks_every_engine_from_one_zygote(fleet: EmulatedFleet) -> None:
    """EmulatedFleet(N) forks its engines from a zygote: N distinct processes, children of it, on N ports."""
    assert fleet.start_method == "zygote" and fleet.zygote_pid is not None
    pids = fleet.pids
    assert len(pids) == N and len(set(pids)) == N and fleet.zygote_pid not in pids
    assert all(psutil.Process(pid).ppid() == fleet.zygote_pid for pid in pids)
    assert len({url for url in fleet.urls}) == N
    for handle in fleet.engines:
        assert handle.state()["pid"] == handle.pid
        assert_serves(handle)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(victim=st.integers(0, N - 1), death=st.sampled_from(sorted(DEATHS)))
def test_one_engines_death_ends_that_process_alone_and_restart_brings_it_back(
    fleet: EmulatedFleet, pool: ThreadPoolExecutor, victim: int, death: str
) -> None:
    """Any engine, any SGLang death: that process alone ends, its port refuses, the others serve; restart serves again."""
    handle = fleet.engines[victim]
    others = [e for e in fleet.engines if e is not handle]
    before = {e.index: e.pid for e in fleet.engines}
    url = handle.url
    tree = process_tree(before[victim])
    expected = DEATHS[death](handle, pool)
    assert handle.wait_exit(TIMEOUT) == expected, handle.log()
    assert gone(before[victim]) and none_of_ours_listens(url, tree)
    assert psutil.Process(fleet.zygote_pid).is_running()
    for other in others:
        assert other.pid == before[other.index]
        assert_serves(other)
    handle.restart()
    assert handle.url == url and handle.pid != before[victim]
    assert psutil.Process(handle.pid).ppid() == fleet.zygote_pid
    assert handle.state()["released_tags"] == [] and handle.state()["counts"]["prefilled"] == 0
    assert_serves(handle)


def test_restart_of_a_live_engine_keeps_its_url_and_leaves_the_neighbours(fleet: EmulatedFleet) -> None:
    """restart() of a serving engine: a new process on the same URL with fresh state; the neighbours keep their PIDs."""
    handle = fleet.engines[0]
    assert generate(handle.url, 1).status_code == 200
    assert handle.state()["counts"]["completed"] >= 1
    pids = fleet.pids
    handle.restart()
    assert handle.pid != pids[0] and gone(pids[0])
    assert fleet.pids[1:] == pids[1:]
    assert handle.state()["counts"]["completed"] == 0
    assert_serves(handle)


def test_progress_then_a_killed_zygote_takes_its_engines_with_it_and_stop_leaves_no_process() -> None:
    """progress(ready, n) climbs to (n, n) and on_ready sees every index; SIGKILL to the zygote ends every engine (no
    orphan keeps a port), the fleet sees them dead, a restart says the zygote is gone, and stop() leaves no process."""
    seen: list[tuple[int, int]] = []
    served: list[int] = []
    f = EmulatedFleet(3, CONFIG, progress=lambda ready, n: seen.append((ready, n)))
    try:
        f.start(on_ready=served.append)
        assert seen and seen[-1] == (3, 3) and sorted(served) == [0, 1, 2]
        assert [r for r, _ in seen] == sorted({r for r, _ in seen}) and {n for _, n in seen} == {3}
        zygote, pids, urls = f.zygote_pid, f.pids, f.urls
        assert zygote is not None and all(generate(url, 1).status_code == 200 for url in urls)
        tree = process_tree(zygote)
        assert set(pids) <= set(tree)
        os.kill(zygote, signal.SIGKILL)
        for handle in f.engines:
            assert handle.wait_exit(TIMEOUT) is not None
        wait_for(lambda: all(gone(pid) for pid in tree))  # no orphan: every process of the fleet ended
        assert all(none_of_ours_listens(url, tree) for url in urls)
        with pytest.raises(EmulatorStartError, match="zygote"):
            f.engines[0].restart(timeout=TIMEOUT)
    finally:
        f.stop()
    assert all(gone(pid) for pid in [*pids, zygote])


def test_spawn_start_method_runs_a_fresh_interpreter_per_engine() -> None:
    """start_method='spawn' (the way before the zygote) still works: the engine is our own child, no zygote."""
    with EmulatedFleet(1, CONFIG, start_method="spawn") as f:
        assert f.zygote_pid is None
        assert psutil.Process(f.pids[0]).ppid() == os.getpid()
        assert_serves(f.engines[0])


def test_an_engine_handle_puts_a_proxy_in_front_and_lets_go_by_its_public_methods() -> None:
    """start_proxy: url goes through the proxy (direct_url still reaches the engine), one proxy per engine; stop_proxy
    stops it (idempotent); close() ends the process, keeps the log readable after the log folder is gone, and is idempotent."""
    f = EmulatedFleet(1, CONFIG)
    try:
        f.start()
        handle = f.engines[0]
        direct = handle.url
        proxy = handle.start_proxy(FaultPlan(seed=0))
        assert handle.proxy is proxy and handle.url == proxy.url != direct == handle.direct_url
        assert generate(handle.url, 1).status_code == 200
        with pytest.raises(RuntimeError, match=r"engine 0 already has a fault proxy in front of it"):
            handle.start_proxy(FaultPlan(seed=0))
        handle.stop_proxy()
        handle.stop_proxy()
        with pytest.raises(requests.ConnectionError):
            generate(handle.url, 1)
        with session() as s:  # a double release, straight to the engine: it dies and says why on stderr
            assert s.post(direct + "/release_memory_occupation", json={"tags": ["kv_cache"]}, timeout=TIMEOUT).status_code == 200
            with pytest.raises(requests.ConnectionError):
                s.post(direct + "/release_memory_occupation", json={"tags": ["kv_cache"]}, timeout=TIMEOUT)
        assert handle.wait_exit(TIMEOUT) == 1
        pid, log = handle.pid, handle.log()
        assert "Cannot pause allocation that is not active" in log, log
        handle.close()
        assert not handle.alive() and gone(pid)
        handle.close()
    finally:
        f.stop()
    assert not f.memory_state_dir.parent.exists()  # the fleet removed its own log folder
    assert handle.log() == log


def test_the_ready_line_is_printed_and_read_back(capsys: pytest.CaptureFixture[str]) -> None:
    """print_ready writes the line ready_url reads (whitespace and the newline ignored); any other line is not one."""
    print_ready("http://127.0.0.1:30000")
    line = capsys.readouterr().out
    assert line == f"{READY_PREFIX}http://127.0.0.1:30000\n" and ready_url(line) == "http://127.0.0.1:30000"
    assert ready_url("INFO: Uvicorn running on http://127.0.0.1:30000") is None and ready_url("") is None


def test_bad_start_method_is_named() -> None:
    """An unknown start_method is a ValueError naming it."""
    with pytest.raises(ValueError, match="start_method"):
        EmulatedFleet(1, CONFIG, start_method="thread")  # type: ignore[arg-type]


def test_a_fleet_that_misses_its_deadline_leaves_no_zygote() -> None:
    """A startup deadline the zygote's imports cannot meet: EmulatorStartError naming READY, and the zygote is gone."""
    f = EmulatedFleet(2, CONFIG, startup_timeout=0.01)
    with pytest.raises(EmulatorStartError, match="READY"):
        f.start()
    assert f.zygote_pid is not None and gone(f.zygote_pid)
    assert all(gone(pid) for pid in f.pids)


@pytest.mark.slow
def test_chaos_on_64_forked_engines_kills_only_the_victims(pool: ThreadPoolExecutor) -> None:
    """64 engines from one zygote; six die of SGLang's three deaths: exactly those six end, the 58 others serve."""
    victims = [3, 11, 22, 37, 48, 60]
    deaths = [DEATHS[name] for name in sorted(DEATHS)] * 2
    with EmulatedFleet(64, CONFIG) as f:
        pids = f.pids
        assert len(set(pids)) == 64
        trees = [pid for index in victims for pid in process_tree(pids[index])]
        for index, death in zip(victims, deaths, strict=True):
            handle = f.engines[index]
            assert handle.wait_exit(0) is None
            expected = death(handle, pool)
            assert handle.wait_exit(TIMEOUT) == expected, handle.log()
        assert [e.index for e in f.engines if not e.alive()] == victims
        assert all(none_of_ours_listens(f.engines[i].url, trees) for i in victims)
        survivors = [e for e in f.engines if e.index not in victims]
        answers = list(pool.map(lambda e: generate(e.url, 1).status_code, survivors))
        assert len(answers) == 58 and set(answers) == {200}
        assert [e.pid for e in survivors] == [pids[e.index] for e in survivors]
