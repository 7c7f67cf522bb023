"""What the barrier knows of each engine, as metrics: a mixed fleet of emulated engines (two SGLang, one vLLM) behind an
``Orchestrator`` whose fan-out goes through a ``WeightVersionTap`` and whose journal through a timed store, watched by a
``MetricsObserver`` and scraped by a real Prometheus loaded with the committed rules; an ``AsyncOrchestrator``'s weight
versions; ``CPREngineQuarantined`` pending and (with a copy whose ``for:`` is 2 s) firing and resolved on a live Prometheus.

Every figure is read back from the exposition (or from Prometheus), never from the collector's own fields.
"""

from __future__ import annotations

import threading
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from resilience.adapters.sglang import AsyncSGLangClient, SGLangClient
from resilience.adapters.vllm.engine import AsyncVLLMEngine, VLLMEngine
from resilience.barrier import AsyncOrchestrator, EngineGroup, Orchestrator, PhaseFailed, ThreadFanOut, WeightVersionCheck
from resilience.barrier.fanout import engine_name
from resilience.barrier.journal import Journal
from resilience.barrier.journal_store import FileJournalStore
from resilience.barrier.state import PhaseEnded
from resilience.engine_contract import EngineState, rules_of
from resilience.events import Event
from resilience.telemetry.engine_state import ENGINE_STATES, EngineStateCollector, WeightVersionTap
from resilience.telemetry.metrics import MetricsObserver, start_metrics_server
from resilience.testing.emulator import EmulatedFleet, EngineConfig
from resilience.testing.emulator.vllm import VLLMEngineConfig
from resilience.testing.faults import FaultPlan, FaultRule
from tests.barrier.async_facade import LoopThread
from tests.promserver import get_json, poll, prometheus_server
from tests.sglang.conftest import FAST_SGLANG

pytest.importorskip("fastapi")
pytest.importorskip("torch")

RULES = Path(__file__).resolve().parents[2] / "grafana" / "rules" / "controlplane-resilience.rules.yml"
VERSION = "step-7"
SGLANG = EngineConfig(token_rate=400.0, health_hang_seconds=1.0, health_poll_seconds=0.05, abort_poll_seconds=0.05, weight_version=VERSION)
VLLM = VLLMEngineConfig(dev_mode=True, enable_sleep_mode=True, token_rate=400.0, weight_version=VERSION)


def family(observer: MetricsObserver, name: str) -> list[tuple[dict[str, str], float]]:
    """The samples of one family in the observer's exposition: (labels, value)."""
    text = generate_latest(observer.registry).decode()
    return [(dict(s.labels), s.value) for f in text_string_to_metric_families(text) for s in f.samples if s.name == name]


def states_of(observer: MetricsObserver) -> dict[str, tuple[str, str, float]]:
    """engine -> (kind, state, value) from ``cpr_engine_state``; an engine with two series would fail here."""
    out: dict[str, tuple[str, str, float]] = {}
    for labels, value in family(observer, "cpr_engine_state"):
        assert labels["engine"] not in out, f"two series for {labels['engine']}"
        out[labels["engine"]] = (labels["kind"], labels["state"], value)
    return out


@pytest.fixture(scope="module")
def fleets() -> Iterator[tuple[EmulatedFleet, EmulatedFleet]]:
    with EmulatedFleet(2, SGLANG) as sglang, EmulatedFleet(1, VLLM) as vllm:
        yield sglang, vllm


@pytest.fixture
def watched(fleets: tuple[EmulatedFleet, EmulatedFleet], tmp_path: Path) -> Iterator[tuple[MetricsObserver, Any, WeightVersionTap]]:
    sglang, vllm = fleets
    metrics = MetricsObserver()
    tap = WeightVersionTap(ThreadFanOut())
    clients: list[Any] = [*(SGLangClient(url, flush_poll_s=0.05) for url in sglang.urls), VLLMEngine(vllm.urls[0])]
    journal = Journal(metrics.timed_journal_store(FileJournalStore(tmp_path / "barrier.journal")))
    orch = Orchestrator(EngineGroup(clients), fanout=tap, journal=journal, observers=[metrics])
    metrics.watch(orch, versions=tap)
    try:
        yield metrics, orch, tap
    finally:
        orch.close()
        for client in clients:
            client.close()


def test_each_engine_state_kind_version_and_the_journal_commit_time_are_published(
    fleets: tuple[EmulatedFleet, EmulatedFleet], watched: tuple[MetricsObserver, Any, WeightVersionTap]
) -> None:
    sglang, vllm = fleets
    metrics, orch, tap = watched
    names = [*sglang.urls, vllm.urls[0]]
    kinds = {sglang.urls[0]: "sglang", sglang.urls[1]: "sglang", vllm.urls[0]: "vllm"}
    assert states_of(metrics) == {n: (kinds[n], "serving", 1.0) for n in names}  # one series per engine, from the start
    assert family(metrics, "cpr_engine_weight_version") == []  # nothing read yet: no version is made up

    orch.offload()
    assert states_of(metrics) == {n: (kinds[n], "released", 1.0) for n in names}
    appends = {labels["op"]: value for labels, value in family(metrics, "cpr_journal_commit_duration_seconds_count")}
    assert appends["append"] > 0  # every phase committed durably, each commit timed
    (total,) = [v for labels, v in family(metrics, "cpr_journal_commit_duration_seconds_sum") if labels["op"] == "append"]
    assert 0 < total < 60

    orch.onload(verify=WeightVersionCheck(VERSION))
    assert states_of(metrics) == {n: (kinds[n], "serving", 1.0) for n in names}
    versions = {labels["engine"]: (labels["kind"], labels["version"], v) for labels, v in family(metrics, "cpr_engine_weight_version")}
    assert versions == {n: (kinds[n], VERSION, 1.0) for n in names}  # read through the tap: model_info and weight_info
    assert tap.versions() == dict.fromkeys(names, VERSION)
    assert orch.weight_versions() == tap.versions()  # the orchestrator's own record (the default source) agrees

    orch.retire(sglang.urls[1])
    states = states_of(metrics)
    assert states[sglang.urls[1]] == ("sglang", "retired", 1.0)
    assert {states[n][1] for n in names if n != sglang.urls[1]} == {"serving"}
    assert sglang.urls[1] not in {labels["engine"] for labels, _ in family(metrics, "cpr_engine_weight_version")}
    assert {state for _kind, state, _ in states.values()} <= set(ENGINE_STATES)


def test_a_scrape_during_a_transition_answers_at_once_with_the_phases_so_far(
    watched: tuple[MetricsObserver, Any, WeightVersionTap],
) -> None:
    """The threaded orchestrator holds its lock for the whole offload; a scrape from another thread between its
    phases neither waits for the transition nor shows the state before it: it shows what the phases did so far."""
    metrics, orch, _tap = watched
    seen: dict[str, Any] = {}

    def scrape_from_another_thread(event: Event) -> None:
        if isinstance(event, PhaseEnded) and event.transition == "offload" and event.phase == "pause":
            scraper = threading.Thread(target=lambda: seen.update(states=states_of(metrics), at=time.monotonic()))
            t0 = time.monotonic()
            scraper.start()
            scraper.join(timeout=10)
            seen["took"] = time.monotonic() - t0

    orch.observers = (*orch.observers, scrape_from_another_thread)
    orch.offload()
    assert seen["took"] < 5, seen  # well under the transition's length: it did not wait for the lock to be free
    assert {state for _kind, state, _ in seen["states"].values()} == {"paused"}, seen  # the pause phase, heard
    assert {state for _kind, state, _ in states_of(metrics).values()} == {"released"}  # after it: states() again
    orch.onload()
    assert {state for _kind, state, _ in states_of(metrics).values()} == {"serving"}


def test_engines_past_the_bound_are_counted_under_other(watched: tuple[MetricsObserver, Any, WeightVersionTap]) -> None:
    _metrics, orch, _tap = watched
    bounded = EngineStateCollector(orch, max_engines=1)
    (state_family, _versions) = list(bounded.collect())
    first = sorted(orch.states())[0]
    named = [(s.labels["engine"], s.labels["state"], s.value) for s in state_family.samples if s.labels["engine"] != "other"]
    assert named == [(first, "serving", 1.0)]
    folded = {s.labels["kind"]: (s.labels["state"], s.value) for s in state_family.samples if s.labels["engine"] == "other"}
    kinds = [rules_of(e).kind for e in orch.groups[0].engines if engine_name(e) != first]
    assert folded == {kind: ("serving", float(kinds.count(kind))) for kind in kinds}  # one series per (kind, state), a count
    with pytest.raises(ValueError, match="max_engines must be an integer >= 1"):
        EngineStateCollector(orch, max_engines=0)
    with pytest.raises(TypeError, match="versions must have a versions"):
        EngineStateCollector(orch, versions={"a": "b"})


def test_prometheus_scrapes_the_engine_states_and_a_held_engine_after_an_onload_goes_pending(
    fleets: tuple[EmulatedFleet, EmulatedFleet], watched: tuple[MetricsObserver, Any, WeightVersionTap], tmp_path: Path
) -> None:
    """A real Prometheus reads one series per engine, the dashboard's state-code query gives each its number, and an
    engine held paused after the last onload makes CPREnginesNotServingAfterOnload pending (``for: 5m``)."""
    from grafana.dashboard.promql import ENGINE_STATE_CODES, engine_state_code

    metrics, orch, _tap = watched
    server = start_metrics_server(0, registry=metrics.registry)
    try:
        with prometheus_server(tmp_path, [f"127.0.0.1:{server.port}"], [RULES]) as (base, log):
            orch.offload()
            orch.onload()
            orch.pause("drain")  # the last offload/onload was an onload, and the engines are held paused
            assert {s.value for s in orch.states().values()} == {"paused"}
            codes = {state: code for state, code, _ in ENGINE_STATE_CODES}
            query = urllib.parse.urlencode({"query": engine_state_code()})

            def timeline() -> dict[str, float] | None:
                result = get_json(f"{base}/api/v1/query?{query}")["data"]["result"]
                seen = {r["metric"]["engine"]: float(r["value"][1]) for r in result}
                return seen if len(seen) == 3 and set(seen.values()) == {codes["paused"]} else None

            assert set(poll(timeline, "every engine's state code in Prometheus", log)) == set(orch.states())

            def pending() -> set[str] | None:
                alerts = get_json(f"{base}/api/v1/alerts")["data"]["alerts"]
                named = {a["labels"]["engine"] for a in alerts if a["labels"]["alertname"] == "CPREnginesNotServingAfterOnload"}
                return named if len(named) == 3 else None

            assert poll(pending, "CPREnginesNotServingAfterOnload pending for the held engines", log) == set(orch.states())
            alerts = get_json(f"{base}/api/v1/alerts")["data"]["alerts"]
            assert {a["state"] for a in alerts if a["labels"]["alertname"] == "CPREnginesNotServingAfterOnload"} == {"pending"}
            groups = {g["name"]: g["rules"] for g in get_json(f"{base}/api/v1/rules")["data"]["groups"]}
            assert {r["name"] for r in groups["cpr-engines"]} == {"CPREngineQuarantined", "CPREnginesNotServingAfterOnload"}
            assert all(r["health"] in ("ok", "unknown") for r in groups["cpr-engines"]), groups["cpr-engines"]
            orch.unpause("drain")
            assert {s.value for s in orch.states().values()} == {"serving"}
    finally:
        server.close()


def test_a_quarantined_engine_is_published_as_quarantined_until_reconciled() -> None:
    """A release that may have been applied (it lands after the client gave up) quarantines the engine: the gauge says
    so with its kind, and says what reconcile and the onload after it make of it."""
    plan = FaultPlan(seed=3, rules=(FaultRule("/release_memory_occupation", "latency", delay=1.0),))
    release = FAST_SGLANG.match("POST", "/release_memory_occupation").policy
    policies = FAST_SGLANG.with_entries({"GET|POST /release_memory_occupation": replace(release, attempt_timeout_s=0.4)})
    with EmulatedFleet(1, SGLANG, fault_plan=plan) as fleet, SGLangClient(fleet.urls[0], policies=policies) as client:
        metrics = MetricsObserver()
        orch = Orchestrator(EngineGroup([client]), observers=[metrics])
        metrics.watch(orch)
        with pytest.raises(PhaseFailed) as info:
            orch.offload()
        assert info.value.quarantined == (client.engine,)
        assert states_of(metrics) == {client.engine: ("sglang", "quarantined", 1.0)}

        def landed() -> bool:
            return bool(fleet.engines[0].state()["released_tags"])

        deadline = time.monotonic() + 10
        while not landed():  # the delayed release lands on the engine
            assert time.monotonic() < deadline, "the delayed release never landed"
            time.sleep(0.05)
        orch.reconcile(client, released=fleet.engines[0].state()["released_tags"], paused=True)
        assert states_of(metrics) == {client.engine: ("sglang", "released", 1.0)}
        orch.onload()
        assert states_of(metrics) == {client.engine: ("sglang", "serving", 1.0)}


def test_a_joining_engine_is_published_as_joining_and_a_fenced_one_as_fenced(fleets: tuple[EmulatedFleet, EmulatedFleet]) -> None:
    """``add`` into an offloaded group: scraped from another thread while the join runs, the engine is ``joining``; a join
    whose weight-version check fails fences it (``fenced``, out of every transition); a join that passes brings it to the
    group's state (``released``), and the onload after it serves all three (``resilience.barrier.membership``)."""
    sglang, vllm = fleets
    group: list[Any] = [SGLangClient(sglang.urls[0], flush_poll_s=0.05), VLLMEngine(vllm.urls[0])]
    joiner = SGLangClient(sglang.urls[1], flush_poll_s=0.05)
    metrics = MetricsObserver()
    orch = Orchestrator(EngineGroup(group), observers=[metrics])
    metrics.watch(orch)
    seen: dict[str, dict[str, tuple[str, str, float]]] = {}

    def scrape_mid_join(event: Event) -> None:
        if isinstance(event, PhaseEnded) and event.transition == "join" and "mid_join" not in seen:
            scraper = threading.Thread(target=lambda: seen.update(mid_join=states_of(metrics)))
            scraper.start()
            scraper.join(timeout=10)

    orch.observers = (*orch.observers, scrape_mid_join)
    kinds = {sglang.urls[0]: "sglang", sglang.urls[1]: "sglang", vllm.urls[0]: "vllm"}
    try:
        orch.offload()
        with pytest.raises(PhaseFailed) as info:
            orch.add(joiner, verify=WeightVersionCheck("not-" + VERSION))
        assert joiner.engine in info.value.failures
        assert seen.pop("mid_join")[joiner.engine] == ("sglang", "joining", 1.0)
        assert states_of(metrics) == {**{n: (kinds[n], "released", 1.0) for n in (sglang.urls[0], vllm.urls[0])},
                                      joiner.engine: ("sglang", "fenced", 1.0)}
        orch.add(joiner, verify=WeightVersionCheck(VERSION))
        assert seen.pop("mid_join")[joiner.engine] == ("sglang", "joining", 1.0)
        assert states_of(metrics) == {n: (kinds[n], "released", 1.0) for n in kinds}
        orch.onload()
        assert states_of(metrics) == {n: (kinds[n], "serving", 1.0) for n in kinds}
        assert "mid_join" not in seen  # an onload never shows an engine as joining
    finally:
        orch.close()
        for client in (*group, joiner):
            client.close()


def test_an_async_orchestrator_publishes_the_weight_versions_its_reads_were_answered(fleets: tuple[EmulatedFleet, EmulatedFleet]) -> None:
    """``AsyncOrchestrator`` has no fan-out to tap: the versions come from the orchestrator itself (``weight_versions()``,
    kept from the answers its reads got: an onload's and a join's ``WeightVersionCheck``), the one source the collector
    reads for either orchestrator. Two emulated engines (SGLang ``model_info``, vLLM ``weight_info``) serve step-7; a
    third joins the serving group, verified; a retired one's series goes."""
    sglang, vllm = fleets
    loop = LoopThread()
    group: list[Any] = [AsyncSGLangClient(sglang.urls[0], flush_poll_s=0.05), AsyncVLLMEngine(vllm.urls[0])]
    joiner = AsyncSGLangClient(sglang.urls[1], flush_poll_s=0.05)
    kinds = {sglang.urls[0]: "sglang", sglang.urls[1]: "sglang", vllm.urls[0]: "vllm"}
    metrics = MetricsObserver()
    orch = AsyncOrchestrator(EngineGroup(group), observers=[metrics])
    metrics.watch(orch)  # no versions=: the orchestrator's own weight_versions()

    def versions() -> dict[str, tuple[str, str, float]]:
        return {labels["engine"]: (labels["kind"], labels["version"], v) for labels, v in family(metrics, "cpr_engine_weight_version")}

    try:
        loop.run(orch.offload())
        loop.run(orch.onload())
        assert versions() == {} and orch.weight_versions() == {}  # nothing read yet: no version is made up
        loop.run(orch.offload())
        loop.run(orch.onload(verify=WeightVersionCheck(VERSION)))
        both = (sglang.urls[0], vllm.urls[0])
        assert versions() == {n: (kinds[n], VERSION, 1.0) for n in both}  # model_info and weight_info, as answered
        loop.run(orch.add(joiner, verify=WeightVersionCheck(VERSION)))  # a serving group: paused, read, continued
        assert states_of(metrics) == {n: (kinds[n], "serving", 1.0) for n in kinds}
        assert versions() == {n: (kinds[n], VERSION, 1.0) for n in kinds}  # the join's own read
        assert orch.weight_versions() == dict.fromkeys(kinds, VERSION)
        loop.run(orch.retire(sglang.urls[0]))
        assert set(versions()) == {sglang.urls[1], vllm.urls[0]}
        assert states_of(metrics)[sglang.urls[0]] == ("sglang", "retired", 1.0)
    finally:
        for client in (*group, joiner):
            loop.run(client.aclose())
        orch.close()
        loop.close()


SHORT_FOR = "2s"
"""The ``for:`` of the copy of ``CPREngineQuarantined`` a live Prometheus fires within seconds (the committed ``5m`` is
promtool's to check: ``grafana/rules/tests/engines.test.yml``)."""


def _quarantine_rule_with_a_short_for(tmp_path: Path) -> Path:
    """A rule file holding the committed ``CPREngineQuarantined`` with only its ``for:`` cut to ``SHORT_FOR`` (and its
    name and group's name changed, to tell it from the committed one loaded beside it)."""
    committed = yaml.safe_load(RULES.read_text(encoding="utf-8"))
    rules = [r for g in committed["groups"] for r in g["rules"] if r.get("alert") == "CPREngineQuarantined"]
    assert len(rules) == 1 and rules[0]["for"] == "5m", rules
    short = {**rules[0], "alert": "CPREngineQuarantinedShortFor", "for": SHORT_FOR}
    path = tmp_path / "quarantine-short-for.rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "cpr-engines-short-for", "rules": [short]}]}), encoding="utf-8")
    return path


def test_prometheus_fires_cpr_engine_quarantined_for_a_quarantined_engine_and_resolves_it_after_reconcile(tmp_path: Path) -> None:
    """A release that lands after the client gave up quarantines the engine; a real Prometheus scraping the gauge holds
    the committed ``CPREngineQuarantined`` pending (its ``for: 5m``), and fires the same rule with ``for: 2s``, labelled
    with the engine and its kind and its summary naming the engine; ``reconcile`` settles the engine and the alert goes."""
    plan = FaultPlan(seed=3, rules=(FaultRule("/release_memory_occupation", "latency", delay=1.0),))
    release = FAST_SGLANG.match("POST", "/release_memory_occupation").policy
    policies = FAST_SGLANG.with_entries({"GET|POST /release_memory_occupation": replace(release, attempt_timeout_s=0.4)})
    short = _quarantine_rule_with_a_short_for(tmp_path)
    with EmulatedFleet(1, SGLANG, fault_plan=plan) as fleet, SGLangClient(fleet.urls[0], policies=policies) as client:
        metrics = MetricsObserver()
        orch = Orchestrator(EngineGroup([client]), observers=[metrics])
        metrics.watch(orch)
        server = start_metrics_server(0, registry=metrics.registry)
        try:
            with prometheus_server(tmp_path, [f"127.0.0.1:{server.port}"], [RULES, short]) as (base, log):

                def alerts(name: str) -> list[dict[str, Any]]:
                    return [a for a in get_json(f"{base}/api/v1/alerts")["data"]["alerts"] if a["labels"]["alertname"] == name]

                with pytest.raises(PhaseFailed) as info:
                    orch.offload()
                assert info.value.quarantined == (client.engine,)
                assert orch.states() == {client.engine: EngineState.QUARANTINED}

                def firing() -> list[dict[str, Any]] | None:
                    fired = [a for a in alerts("CPREngineQuarantinedShortFor") if a["state"] == "firing"]
                    return fired or None

                (fired,) = poll(firing, "CPREngineQuarantined (for: 2s) firing for the quarantined engine", log)
                assert fired["labels"]["engine"] == client.engine and fired["labels"]["kind"] == "sglang", fired
                assert fired["labels"]["severity"] == "page" and client.engine in fired["annotations"]["summary"], fired
                committed = alerts("CPREngineQuarantined")
                assert [(a["labels"]["engine"], a["state"]) for a in committed] == [(client.engine, "pending")], committed

                deadline = time.monotonic() + 10
                while not fleet.engines[0].state()["released_tags"]:  # the delayed release lands on the engine
                    assert time.monotonic() < deadline, "the delayed release never landed"
                    time.sleep(0.05)
                orch.reconcile(client, released=fleet.engines[0].state()["released_tags"], paused=True)
                assert orch.states() == {client.engine: EngineState.RELEASED}

                def resolved() -> bool | None:
                    return True if not alerts("CPREngineQuarantinedShortFor") and not alerts("CPREngineQuarantined") else None

                assert poll(resolved, "CPREngineQuarantined resolved after reconcile", log)
                orch.onload()
        finally:
            server.close()
            orch.close()
