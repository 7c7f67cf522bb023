"""EmulatorMemoryProbe: the emulated engines' own truth about released tags, read through the side channel (no HTTP route).

Black-box over real emulated engines: whatever release and resume calls the engines
carried out, the probe answers exactly the tags their schedulers recorded (their
``/_emulator/state``), for zygote-forked engines, engines in their own interpreter,
proxied engines and ``cpr emulate``; ``UnknownEngine`` for an engine it does not know; None for one that
died, or one carrying out a memory call right now.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from resilience.engine_contract import MemoryProbe, UnknownEngine, covers
from resilience.testing import EmulatorMemoryProbe
from resilience.testing.emulator import EmulatedFleet, EngineConfig
from resilience.testing.faults import FaultPlan
from tests.cli.cpr_testlib import CPR

pytest.importorskip("torch")

CONFIG = EngineConfig(health_hang_seconds=1.0, health_poll_seconds=0.05, abort_poll_seconds=0.05, swap_seconds=0.0)
TAGS = ("kv_cache", "weights", "cuda_graph")
TIMEOUT = 10.0


def post(url: str, path: str, tags: list[str] | None) -> requests.Response:
    with requests.Session() as s:
        s.trust_env = False
        return s.post(url + path, json={"tags": tags}, timeout=TIMEOUT)


def truth(url: str) -> frozenset[str]:
    """What the engine's scheduler recorded, from its debug route (the test's view, never the probe's)."""
    with requests.Session() as s:
        s.trust_env = False
        return frozenset(s.get(url + "/_emulator/state", timeout=TIMEOUT).json()["released_tags"])


def wait_for(predicate: Callable[[], bool], timeout: float = TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():  # bounded by the deadline
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.02)


@pytest.fixture(scope="module")
def fleet() -> Iterator[EmulatedFleet]:
    """Two zygote-forked engines, each behind a pass-through FaultProxy."""
    with EmulatedFleet(2, CONFIG, fault_plan=FaultPlan(seed=0)) as f:
        yield f


def test_fleet_probe_is_a_memory_probe_and_starts_empty(fleet: EmulatedFleet) -> None:
    """A fresh engine has nothing released, under its proxy URL and its own URL alike."""
    probe = fleet.memory_probe()
    assert isinstance(probe, MemoryProbe)
    for engine in fleet.engines:
        assert probe.released_tags(engine.url) == frozenset() == probe.released_tags(engine.direct_url)
        assert probe.released_tags(engine.url + "/") == frozenset()
        assert engine.record()["dropped"] == 0  # the record's bound (record.MAX_CALLS) is far away


def _legal_ops(draw: st.DrawFn) -> list[tuple[int, str, list[str] | None]]:
    """A sequence of release/resume calls that never crashes an engine: release only active tags, resume only released ones."""
    released: list[set[str]] = [set(), set()]
    ops: list[tuple[int, str, list[str] | None]] = []
    for _ in range(draw(st.integers(1, 6))):
        i = draw(st.integers(0, 1))
        active = [t for t in (*TAGS, "extra_tag") if t not in released[i]]
        can_resume = sorted(released[i])
        if can_resume and (not active or draw(st.booleans())):
            tags = draw(st.lists(st.sampled_from(can_resume), min_size=1, unique=True))
            whole = set(tags) == set(TAGS) and released[i] == set(TAGS)
            ops.append((i, "/resume_memory_occupation", None if whole and draw(st.booleans()) else tags))
            released[i] -= set(tags)
        else:
            tags = draw(st.lists(st.sampled_from(active), min_size=1, unique=True))
            whole = set(tags) == set(TAGS) and not released[i]
            ops.append((i, "/release_memory_occupation", None if whole and draw(st.booleans()) else tags))
            released[i] |= set(tags)
    for i in (0, 1):  # end where we started, so examples do not depend on each other
        if released[i]:
            ops.append((i, "/resume_memory_occupation", sorted(released[i])))
    return ops


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.composite(_legal_ops)())
def test_probe_answers_exactly_the_schedulers_record(fleet: EmulatedFleet, ops: list[tuple[int, str, list[str] | None]]) -> None:
    """After every release or resume (named tags, unknown tags, or all), the probe answers each engine's recorded tags."""
    probe = fleet.memory_probe()
    for i, path, tags in ops:
        assert post(fleet.urls[i], path, tags).status_code == 200
        for engine in fleet.engines:
            assert engine.alive()
            assert probe.released_tags(engine.url) == truth(engine.direct_url)
    assert all(probe.released_tags(e.url) == frozenset() for e in fleet.engines)


def test_unknown_engines_and_bad_names_are_named(fleet: EmulatedFleet, tmp_path: Path) -> None:
    """An engine without a file, a name without a port, a non-string, or an empty folder: ``UnknownEngine``, not None."""
    probe = fleet.memory_probe()
    for name in ("http://127.0.0.1:1", "not a url", 42):
        with pytest.raises(UnknownEngine):
            probe.released_tags(name)  # type: ignore[arg-type]
        assert not covers(probe, name)  # type: ignore[arg-type]
    with pytest.raises(UnknownEngine, match=re.escape(fleet.engines[0].direct_url)):
        EmulatorMemoryProbe(tmp_path).released_tags(fleet.engines[0].direct_url)
    assert all(covers(probe, e.url) and covers(probe, e.direct_url) for e in fleet.engines)


def test_proxy_urls_need_aliases(tmp_path: Path) -> None:
    """Without ``aliases=`` the probe knows the engines by their own URLs only: a proxy's URL is an unknown engine, and so
    it is for a fleet's probe taken before ``start()`` (no proxy had a URL yet). Taken after, it knows both."""
    with EmulatedFleet(1, CONFIG, fault_plan=FaultPlan(seed=0, rules=())) as started:
        assert started.urls != started.direct_urls
        bare = EmulatorMemoryProbe(started.memory_state_dir)
        assert covers(bare, started.direct_urls[0]) and not covers(bare, started.urls[0])
        assert covers(started.memory_probe(), started.urls[0])
    early = EmulatedFleet(1, CONFIG, fault_plan=FaultPlan(seed=0, rules=()))
    probe = early.memory_probe()
    with early:
        assert not covers(probe, early.urls[0])


def test_bad_arguments_are_refused(tmp_path: Path) -> None:
    """An empty folder name or an alias without a port is refused with the field named."""
    with pytest.raises(ValueError, match="`state_dir` must be a folder path"):
        EmulatorMemoryProbe("")
    with pytest.raises(ValueError, match=r"`aliases\['http://a:1'\]` must be an engine URL with a port"):
        EmulatorMemoryProbe(tmp_path, aliases={"http://a:1": "nowhere"})


def test_a_file_from_another_process_or_format_is_not_proved(fleet: EmulatedFleet, tmp_path: Path) -> None:
    """A state file whose PID is not running (or runs with another start time), or of another version: None."""
    source = fleet.memory_state_dir / f"engine-{fleet.direct_urls[0].rsplit(':', 1)[1]}.json"
    state = json.loads(source.read_text())
    url = "http://127.0.0.1:" + str(state["port"])
    for changed in ({"start_ticks": state["start_ticks"] + 1}, {"pid": 2**22 + 7}, {"version": 99}, {"released_tags": "kv_cache"}):
        (tmp_path / source.name).write_text(json.dumps({**state, **changed}))
        assert EmulatorMemoryProbe(tmp_path).released_tags(url) is None, changed
    (tmp_path / source.name).write_text(json.dumps(state))
    assert EmulatorMemoryProbe(tmp_path).released_tags(url) == frozenset()


def test_a_call_in_progress_is_not_proved_and_a_dead_engine_never_is() -> None:
    """While a release is carried out the probe answers None, then the new tags; after a double release kills it, None."""
    with EmulatedFleet(1, EngineConfig(swap_seconds=1.0, health_poll_seconds=0.05)) as f:
        probe, url = f.memory_probe(), f.urls[0]
        seen: list[frozenset[str] | None] = []
        worker = threading.Thread(target=post, args=(url, "/release_memory_occupation", ["kv_cache"]))
        worker.start()
        try:
            wait_for(lambda: seen.append(probe.released_tags(url)) or seen[-1] is None)  # the 1 s swap is under way
        finally:
            worker.join(TIMEOUT)
        assert probe.released_tags(url) == frozenset({"kv_cache"}) == truth(url)
        with pytest.raises(requests.ConnectionError):
            post(url, "/release_memory_occupation", ["kv_cache"])  # torch_memory_saver's exit(1)
        wait_for(lambda: not f.engines[0].alive())
        assert probe.released_tags(url) is None


def test_a_restarted_engine_is_proved_again_with_nothing_released() -> None:
    """An engine in its own interpreter (``start_method="spawn"``), restarted on its port: its old file stops counting."""
    with EmulatedFleet(1, CONFIG, start_method="spawn") as f:
        probe, url = f.memory_probe(), f.urls[0]
        assert post(url, "/release_memory_occupation", ["weights"]).status_code == 200
        assert probe.released_tags(url) == frozenset({"weights"})
        f.engines[0].kill()
        assert probe.released_tags(url) is None
        f.engines[0].restart()
        assert probe.released_tags(f.urls[0]) == frozenset() == truth(f.urls[0])


def test_cpr_emulate_publishes_into_the_folder_it_is_given(tmp_path: Path) -> None:
    """``cpr emulate --engines 2 --memory-state-dir DIR``: a probe over DIR follows both engines."""
    state_dir = tmp_path / "state"
    proc = subprocess.Popen(
        [*CPR, "emulate", "--engines", "2", "--swap-seconds", "0", "--memory-state-dir", str(state_dir)],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        stdin=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert proc.stdout is not None
        urls = [proc.stdout.readline().split()[-1] for _ in range(2)]  # bounded by the test timeout
        probe = EmulatorMemoryProbe(state_dir)
        assert [probe.released_tags(u) for u in urls] == [frozenset(), frozenset()]
        assert post(urls[1], "/release_memory_occupation", None).status_code == 200
        assert [probe.released_tags(u) for u in urls] == [frozenset(), frozenset(TAGS)]
        assert [truth(u) for u in urls] == [frozenset(), frozenset(TAGS)]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert [probe.released_tags(u) for u in urls] == [None, None]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
