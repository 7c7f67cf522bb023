"""Why engines died, read from real emulated engines' logs; what a slow step waits for; the demo's sentence."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import requests

pytest.importorskip("torch")

from resilience.cli.story import death_causes, per_step, rates_note, story
from resilience.cli.watch import StepWatch
from resilience.testing.colocate import StepProgress
from resilience.testing.emulator import EmulatedFleet, EngineConfig
from resilience.testing.lab import ColocateReport

TIMEOUT = 30
PREFILL, DOUBLE, RESUME, BUSY = range(4)


def _post(url: str, path: str, body: dict[str, object]) -> None:
    with requests.Session() as s:
        s.trust_env = False
        try:
            s.post(url + path, json=body, timeout=TIMEOUT)
        except requests.ConnectionError:
            pass  # the call that kills the engine gets a dropped connection


@pytest.fixture(scope="module")
def killed() -> Iterator[EmulatedFleet]:
    """Four engines, each killed by one of SGLang's crash paths; stopped by PID after the module."""
    with EmulatedFleet(4, EngineConfig(health_poll_seconds=0.05)) as fleet:
        url = [e.url for e in fleet.engines]
        _post(url[PREFILL], "/flush_cache", {})
        _post(url[PREFILL], "/release_memory_occupation", {"tags": ["kv_cache"]})
        _post(url[PREFILL], "/generate", {"text": "late", "sampling_params": {"max_new_tokens": 2}})  # bug B: a straggler
        _post(url[DOUBLE], "/release_memory_occupation", {"tags": ["kv_cache"]})
        _post(url[DOUBLE], "/release_memory_occupation", {"tags": ["kv_cache"]})
        _post(url[RESUME], "/resume_memory_occupation", {"tags": ["weights"]})
        busy = threading.Thread(target=_post, args=(url[BUSY], "/generate", {"text": "long", "sampling_params": {"max_new_tokens": 2000}}))
        busy.start()
        for _ in range(200):  # bounded: until the request is queued or running
            state = fleet.engines[BUSY].state()
            if state["running"] or state["waiting"]:
                break
            time.sleep(0.02)
        else:
            raise AssertionError(f"the long /generate never queued: {state}")
        _post(url[BUSY], "/release_memory_occupation", {"tags": ["kv_cache"]})  # SGLang's idle assert
        busy.join(TIMEOUT)
        for engine in fleet.engines:
            assert engine.wait_exit(TIMEOUT) is not None, engine.log()
        yield fleet


def test_each_crash_path_is_named(killed: EmulatedFleet) -> None:
    """A real engine's log gives one cause per death, in words: prefill after release, double release, bad resume."""
    got = [death_causes(e.log()) for e in killed.engines]
    assert got == [
        ["prefill scheduled after release"],
        ["release sent twice"],
        ["resume of memory that was not released"],
        ["release while requests were running"],
    ]


def test_a_log_without_a_death_has_no_cause(killed: EmulatedFleet) -> None:
    """Ordinary log lines (cache flushed, ...) are not deaths."""
    log = killed.engines[PREFILL].log()
    before = log[: log.index("Scheduler hit an exception")]
    assert "Cache flushed" in before
    assert death_causes(before) == []


def test_step_watch_says_which_engine_died_and_why(killed: EmulatedFleet) -> None:
    """While a step waits, the watch names the dead engines and what killed them."""
    said: list[str] = []
    watch = StepWatch(killed, said.append, quiet_s=0.0, period_s=0.05)
    watch(StepProgress("old", 2, 5, False, 1, 1))  # step 2 ended: step 3 runs now
    text = watch.waiting_for()
    assert text.startswith("step 3 waits: engine 0 died (prefill scheduled after release)")
    assert "engine 1 died (release sent twice)" in text
    with watch:
        deadline = time.monotonic() + 10
        while not said and time.monotonic() < deadline:  # the thread tells the display within a period or two
            time.sleep(0.05)
    assert said and said[0] == text


def _report(way: str, steps: int, finished: int, failed: int, deaths: int, seen: int, absorbed: int) -> ColocateReport:
    return ColocateReport(
        way, steps, steps_finished=finished, failed_steps=failed, restarts=failed, restart_budget_left=3 - failed,
        engine_deaths=deaths, http_502_seen=seen, http_502_absorbed=absorbed,
    )  # fmt: skip


def test_rates_are_per_step_run() -> None:
    """Rates divide by the steps a run went through, so a run stopped early is not flattered by its short length."""
    old, ours = _report("old", 20, 1, 3, 4, 19, 0), _report("ours", 20, 20, 0, 0, 480, 480)
    assert per_step(old.http_502_seen, old) == "19 (4.8/step)"
    assert per_step(ours.http_502_seen, ours) == "480 (24.0/step)"
    told = story({"old": old, "ours": ours}, {"old": ["prefill scheduled after release"] * 4}, {"old": "old way", "ours": "ours"})
    assert told == (
        "Old way met 4.8 502s per step, and retried none of them; 4 engines died (prefill scheduled after release x4), "
        "and its restart budget (3) was spent after 4 steps. "
        "Ours met 24.0 502s per step, all absorbed by retries; no engine died, and it finished 20 of 20 steps with no restart."
    )


def test_the_story_says_what_each_way_re_sent() -> None:
    """A way that re-sent calls after resets is not told as 'none retried': the count comes from what it did."""
    old = _report("old", 20, 0, 4, 17, 17, 0)
    old.resent_after_error = 9
    ours = _report("ours", 20, 20, 0, 0, 474, 474)
    ours.retried_502, ours.resent_after_error = 470, 3
    told = story({"old": old, "ours": ours}, {}, {"old": "old way", "ours": "ours"})
    assert told.startswith(
        "Old way met 4.2 502s per step, and retried none of them; it re-sent 9 calls after a connection reset or timeout, "
        "not knowing whether the engine had acted; 17 engines died"
    )
    assert "Ours met 23.7 502s per step, all absorbed by retries; it re-sent 3 calls after a connection reset or timeout; no" in told
    old.retried_502 = 2
    assert "Old way met 4.2 502s per step, re-sent 2 calls after one and absorbed none;" in story({"old": old}, {}, {"old": "old way"})


def test_rates_note_says_why_the_per_step_figures_differ() -> None:
    """Different step counts, a way whose steps all failed (time to fail), and what ours' finished steps include."""
    old = _report("old", 20, 0, 4, 17, 17, 0)
    old.stopped_early, old.wall_s = "restart budget spent at step 3", 1.3
    ours = _report("ours", 20, 20, 0, 0, 474, 474)
    ours.wall_s, ours.retried_502, ours.requests_aborted_rerun = 47.7, 470, 17
    ours.phase_seconds = {"weight_sync": [0.2] * 20}
    note = rates_note({"old": old, "ours": ours}, {"old": "old way", "ours": "ours"})
    assert note == (
        "The per-step rates divide by the steps each way ran: old way 4 (its restart budget was spent), ours 20. "
        "Old way failed all 4 of its steps at the first error before finishing a weight sync, so its 0.33 s per "
        "step is the time to fail, not to train. "
        "Ours finished each of its 20 steps in 2.39 s on average, retries' backoff and re-run requests included."
    )
    assert rates_note({"ours": ours}, {"ours": "ours"}) == ""
