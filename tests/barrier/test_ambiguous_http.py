"""Random control loops on emulated engines, over real HTTP, through fault proxies that make calls ambiguous.

The socket-free state machine (``test_barrier_properties.py``, over ``fake_engine.py``) proves the barrier's rules;
this is the same kind of loop on the real stack: ``SGLangClient`` (or Ray engine
actors) -> ``FaultProxy`` -> emulated SGLang engine, whose crashes are SGLang 0.5.23's
(release of a released tag: ``exit(1)``; resume of a resumed tag: KeyError; continue
onto released memory: dies at the next prefill). The proxies inject, on pause, flush,
release, resume and continue, faults after the engine acted: ``drop_after`` (reset as
soon as the request is sent; the engine finishes it a moment later) and ``hang_after``
(the engine acts, the client reads until its attempt timeout); and ``status_after`` (502
after the engine acted) on the calls that are safe to re-send.

The caller draws random transitions (offload, onload, partial onload of ``weights``,
weight sync, a rollout on the serving engines) and keeps going after a ``PhaseFailed``:
it reconciles each quarantined engine from the engine's own state (what a controller
learns from its own memory check) or retires it. After every call it lets late calls
land (``FaultProxy.settle``) and checks, on the engines' real state:

- no engine ever dies;
- no engine serves while any of its memory is released (the next request would crash it);
- a normal return keeps its promise (offload: paused with every tag released; onload:
  the tags back, and serving unless the orchestrator says it holds the engine).

Three fan-outs run it: ``ThreadFanOut`` over ``SGLangClient``, ``AsyncFanOut`` over
``AsyncSGLangClient`` (aiohttp with the resilience middleware, one loop), and ``RayFanOut``
over engine actors. One small fleet and one set of proxies serve every example; each example starts
from engines put back in order and a fresh ``Orchestrator``.
"""

from __future__ import annotations

import os
import random
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("fastapi")
pytest.importorskip("torch")

from resilience.adapters.sglang import SGLANG_POLICIES, AsyncSGLangClient, SGLangClient
from resilience.barrier import EngineGroup, Orchestrator, PhaseDeadlines, PhaseFailed
from resilience.barrier.async_fanout import AsyncFanOut
from resilience.barrier.fanout import FanOut, ThreadFanOut
from resilience.engine_contract import ALL_TAGS
from resilience.testing import fast_policies
from resilience.testing.colocate import ColocateConfig, run_colocate
from resilience.testing.emulator import EmulatedFleet, EngineConfig, EngineHandle
from resilience.testing.faults import FaultPlan, FaultProxy, FaultRule

N_ENGINES = 3
CONFIG = EngineConfig(token_rate=400.0, health_hang_seconds=1.0, health_poll_seconds=0.05, abort_poll_seconds=0.05, swap_seconds=0.01)
ATTEMPT_S = 1.0
"""Each attempt's timeout: what a ``hang_after`` costs the client (a read timeout after sending)."""
POLICIES = fast_policies(SGLANG_POLICIES, attempt_timeout_s=ATTEMPT_S, deadline_s=6.0)
DEADLINES = PhaseDeadlines(transition_s=40, pause_s=10, flush_s=10, release_s=10, resume_s=10, continue_s=10)
TIMEOUT = 10.0  # seconds: a bound no healthy loopback exchange reaches
EXAMPLES = int(os.environ.get("CPR_AMBIGUOUS_HTTP_EXAMPLES", "12"))
"""Random loops per fan-out: 12 in the default run (about 17-25 s each), more with ``CPR_AMBIGUOUS_HTTP_EXAMPLES``."""

CONTROL = ("/pause_generation", "/flush_cache", "/release_memory_occupation", "/resume_memory_occupation", "/continue_generation")
SAFE_TO_RESEND = ("/pause_generation", "/flush_cache", "/continue_generation")
PLAN = FaultPlan(
    seed=9,
    rules=(
        *(FaultRule(path, "drop_after", probability=0.10) for path in CONTROL),
        *(FaultRule(path, "hang_after", probability=0.03, delay=3 * ATTEMPT_S) for path in CONTROL),
        *(FaultRule(path, "status_after", probability=0.06) for path in SAFE_TO_RESEND),
    ),
    max_streak=2,
)
"""Faults after the engine acted on every state-changing control call; at most two in a row per path and engine.

No ``status_after`` on release and resume: SGLANG_POLICIES re-send those on a 502 by design
(``retry_statuses_if_not_idempotent``: the seed's 502s came from a front end that never
handed the request on), so a 502 *after* the engine acted is outside what any client can
tell apart; the policy docs name that trade-off."""

OPS = ("offload", "onload", "onload_weights", "weight_sync", "rollout")


# -- fixtures -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fleet() -> Iterator[EmulatedFleet]:
    """Three emulated engines for the whole module (the tests leave them alive, or fail)."""
    with EmulatedFleet(N_ENGINES, CONFIG) as f:
        yield f


@dataclass
class Rig:
    """One fan-out's view of the fleet: proxies in front of the engines, and the engines as the orchestrator sees them."""

    backend: str
    fleet: EmulatedFleet
    proxies: list[FaultProxy]
    engines: list[Any]
    make_fanout: Callable[[], FanOut]
    by_name: dict[str, EngineHandle] = field(default_factory=dict)
    stats: Counter[str] = field(default_factory=Counter)
    """What the loops did, over all examples: ``op:ok``, ``op:failed``, ``reconciled``, ``retired``."""

    def settle(self) -> None:
        """Let every call still in flight to an engine land (a drop_after's late effect)."""
        for proxy in self.proxies:
            assert proxy.settle(TIMEOUT), f"a call to engine {proxy.engine_index} still in flight after {TIMEOUT} s"

    def state(self, name: str) -> dict[str, Any]:
        """The engine's real state, read directly (not through the proxy)."""
        return self.by_name[name].state()


@pytest.fixture(scope="module", params=["threads", "async", "ray"])
def rig(request: pytest.FixtureRequest, fleet: EmulatedFleet) -> Iterator[Rig]:
    """Proxies playing PLAN in front of the fleet, and the engines through them: clients, or Ray engine actors."""
    proxies = [FaultProxy(e.direct_url, PLAN, e.index, seen_limit=200) for e in fleet.engines]
    for proxy in proxies:
        proxy.start()
    engines: list[Any] = []
    try:
        urls = [p.url for p in proxies]
        if request.param == "threads":
            engines = [SGLangClient(u, policies=POLICIES, flush_poll_s=0.05) for u in urls]
            make_fanout: Callable[[], FanOut] = ThreadFanOut
        elif request.param == "async":  # one loop for the module: each client's session lives on it
            shared = AsyncFanOut()
            engines = [AsyncSGLangClient(u, policies=POLICIES, flush_poll_s=0.05) for u in urls]
            make_fanout = lambda: shared  # noqa: E731
        else:
            request.getfixturevalue("ray_runtime")
            from resilience.adapters.ray import RayFanOut, ray_engines

            engines = list(ray_engines(urls, client_kwargs={"policies": POLICIES, "flush_poll_s": 0.05}))
            make_fanout = RayFanOut
        rig = Rig(request.param, fleet, proxies, engines, make_fanout)
        rig.by_name = {_name(engine): handle for engine, handle in zip(engines, fleet.engines, strict=True)}
        yield rig
    finally:
        if request.param == "async":
            for engine in engines:
                shared.run(engine.aclose())
            shared.close()
        for engine in engines:
            if isinstance(engine, AsyncSGLangClient):
                continue
            if hasattr(engine, "kill"):
                engine.kill()
            elif hasattr(engine, "close"):
                engine.close()
        for proxy in proxies:
            proxy.stop()


def _name(engine: Any) -> str:
    return str(engine.engine)


# -- the caller -----------------------------------------------------------------------


@dataclass
class Caller:
    """A training loop's controller: runs transitions, and after a PhaseFailed reconciles or retires."""

    rig: Rig
    rng: random.Random
    orch: Orchestrator
    log: list[str] = field(default_factory=list)
    retired: set[str] = field(default_factory=set)
    reconciled: int = 0

    def active(self) -> list[str]:
        return [n for n in self.rig.by_name if n not in self.retired]

    def run(self, op: str) -> None:
        """One transition; a PhaseFailed is handled as a controller would, anything else fails the test."""
        try:
            if op == "offload":
                self.orch.offload()
                self.rig.settle()
                self.check_offloaded(ALL_TAGS)
            elif op == "onload":
                report = self.orch.onload()
                self.rig.settle()
                self.check_onloaded(ALL_TAGS, report)
            elif op == "onload_weights":
                report = self.orch.onload(tags=["weights"])
                self.rig.settle()
                self.check_onloaded(("weights",), report)
            elif op == "weight_sync":
                with self.orch.weight_sync(mode="retract") as engines:
                    self.rig.settle()
                    for engine in engines:
                        assert self.rig.state(_name(engine))["paused"], f"{self.log}: weight_sync body runs while {_name(engine)} serves"
            elif op == "rollout":
                self.rollout()
            self.log.append(f"{op}: ok")
            self.rig.stats[f"{op}:ok"] += 1
        except PhaseFailed as exc:
            self.log.append(f"{op}: PhaseFailed {' '.join(str(exc).split())[:300]}")
            self.rig.stats[f"{op}:failed"] += 1
            self.rig.settle()
            self.recover(exc)
        self.rig.settle()
        self.check_safe()

    def recover(self, exc: PhaseFailed) -> None:
        """Reconcile every quarantined engine from its real state (4 in 5) or retire it."""
        for name in quarantined(self.orch, exc):
            if self.rng.random() < 0.2:
                self.orch.retire(name)
                self.retired.add(name)
                self.rig.stats["retired"] += 1
                self.log.append(f"  retired {name}")
                continue
            released, paused = reconcile(self.rig, self.orch, name)
            self.reconciled += 1
            self.rig.stats["reconciled"] += 1
            self.log.append(f"  reconciled {name}: released={sorted(released)} paused={paused}")

    def rollout(self) -> None:
        """A short generation on every engine that serves (what the trainer's rollout would send)."""
        with requests.Session() as http:
            http.trust_env = False
            for name, handle in self.rig.by_name.items():
                if not handle.state()["paused"]:
                    r = http.post(
                        handle.direct_url + "/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}}, timeout=TIMEOUT
                    )
                    assert r.status_code == 200, f"{self.log}: rollout on {name}: {r.status_code} {r.text[:200]}"

    # -- invariants ---------------------------------------------------------------

    def check_safe(self) -> None:
        """No engine died; none serves with memory released."""
        for name, handle in self.rig.by_name.items():
            assert handle.alive(), f"engine {name} died after {self.log}\n{handle.log()[-2000:]}"
            state = handle.state()
            assert state["paused"] or not state["released_tags"], f"{name} serves with {state['released_tags']} released after {self.log}"

    def check_offloaded(self, tags: Sequence[str]) -> None:
        """offload returned normally: every active engine is paused with ``tags`` released."""
        active = self.active()
        assert active, "an offload that returns normally has engines to offload"
        for name in active:
            state = self.rig.state(name)
            assert state["paused"], f"offload returned but {name} serves; {self.log}"
            released = state["released_tags"]
            assert set(tags) <= set(released), f"offload returned but {name} released only {released}; {self.log}"

    def check_onloaded(self, tags: Sequence[str], report: Any) -> None:
        """onload returned normally: ``tags`` are back on every active engine; an engine with nothing released serves unless held."""
        for name in self.active():
            state = self.rig.state(name)
            back = set(tags) & set(state["released_tags"])
            assert not back, f"onload returned but {name} still has {sorted(back)} released; {self.log}"
            if not state["released_tags"] and state["paused"]:
                assert self.orch.paused_by_us(name), f"onload returned; {name} is paused with all memory back and no hold; {self.log}"


def quarantined(orch: Orchestrator, exc: PhaseFailed) -> list[str]:
    """The engines the orchestrator quarantined (unknown released tags): the caller must reconcile or retire them."""
    return sorted(exc.quarantined)


def reconcile(rig: Rig, orch: Orchestrator, name: str) -> tuple[frozenset[str], bool]:
    """Tell the orchestrator the engine's real state, read from the engine; returns what was told.

    The orchestrator refuses while a call it sent the engine earlier still runs (it could change the
    state read): then let it land, read again and retry, bounded.
    """
    deadline = time.monotonic() + TIMEOUT
    while True:
        rig.settle()
        state = rig.state(name)
        released, paused = frozenset(state["released_tags"]), bool(state["paused"])
        try:
            orch.reconcile(name, released=released, paused=paused)
            return released, paused
        except RuntimeError as exc:
            if "still running" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def put_in_order(rig: Rig) -> None:
    """Every engine serving with all its memory, directly (not through the proxies): an example's starting point.

    An engine a failing example killed is restarted (same port), so each example, shrunk ones included, starts alike.
    """
    rig.settle()
    with requests.Session() as http:
        http.trust_env = False
        for handle in rig.by_name.values():
            if not handle.alive():
                handle.restart()
            state = handle.state()
            if state["released_tags"]:
                http.post(handle.direct_url + "/resume_memory_occupation", json={"tags": state["released_tags"]}, timeout=TIMEOUT)
            if state["weight_update_session_open"]:
                http.post(handle.direct_url + "/end_weight_update", json={}, timeout=TIMEOUT)
            if state["paused"]:
                http.post(handle.direct_url + "/continue_generation", json={}, timeout=TIMEOUT)
            state = handle.state()
            assert not state["paused"] and not state["released_tags"], f"{handle.direct_url} not back in order: {state}"


# -- the property -----------------------------------------------------------------------


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(ops=st.lists(st.sampled_from(OPS), min_size=3, max_size=8), caller_seed=st.integers(0, 2**16))
def test_ambiguous_faults_over_http_never_kill_an_engine(rig: Rig, ops: list[str], caller_seed: int) -> None:
    """Random transitions through proxies making control calls ambiguous: no engine dies, a normal return keeps its promise."""
    put_in_order(rig)
    orch = Orchestrator(EngineGroup(rig.engines), fanout=rig.make_fanout(), deadlines=DEADLINES)
    caller = Caller(rig, random.Random(caller_seed), orch)
    for op in ops:
        caller.run(op)
    # finally back to serving, as a training loop ends: reconcile until onload returns (or every engine is retired)
    for _ in range(4):
        if not caller.active():
            break
        try:
            caller.orch.onload()
            break
        except PhaseFailed as exc:
            rig.settle()
            caller.recover(exc)
    caller.check_safe()


def test_the_faults_happened(rig: Rig) -> None:
    """The loops above really met ambiguous faults of every kind (runs after them: same module, same proxies)."""
    counts: dict[str, int] = {}
    for proxy in rig.proxies:
        for key, n in proxy.counts().items():
            kind = key.split(":")[0]
            counts[kind] = counts.get(kind, 0) + n
    assert set(counts) == {"drop_after", "status_after", "hang_after"}, counts
    assert counts["drop_after"] >= 3, counts
    stats = rig.stats
    assert stats["reconciled"] >= 2 and stats["retired"] >= 1, stats  # the caller's recovery ran, both ways
    assert all(stats[f"{op}:ok"] >= 2 for op in OPS), stats  # normal returns were checked for every transition
    assert sum(stats[f"{op}:failed"] for op in OPS) >= 3, stats


def test_colocate_ours_reconciles_ambiguous_swaps_where_the_old_way_kills_engines(fleet: EmulatedFleet) -> None:
    """The colocate loop under a reset-once-sent release, a never-answered resume and a reset continue on every engine:
    ours settles them from the emulator's memory probe (quarantining where it cannot) and finishes every step; the old way (verl's re-send
    on connection errors) releases twice and kills engines."""
    def plan(engines: set[int] | None) -> FaultPlan:
        return FaultPlan(
            seed=1,
            rules=(
                FaultRule("/release_memory_occupation", "drop_after", calls={1}, engines=engines),
                FaultRule("/resume_memory_occupation", "hang_after", calls={2}, delay=3 * ATTEMPT_S, engines=engines),
                FaultRule("/continue_generation", "drop_after", calls={1}, engines=engines),
            ),
        )

    config = ColocateConfig(steps=3, seed=1, rollout_requests=1, stragglers=0, max_new_tokens=4, train_s=0.0, restart_limit=0)
    plans = {"ours": plan(None), "old": plan({0})}  # the old way's faults on one engine: one engine to restart afterwards
    reports = {}
    for way in ("ours", "old"):
        proxies = [FaultProxy(e.direct_url, plans[way], e.index) for e in fleet.engines]
        for proxy in proxies:
            proxy.start()
        try:
            reports[way] = run_colocate(fleet, config, way, proxies=proxies, policies=POLICIES)
        finally:
            for proxy in proxies:
                proxy.stop()
    ours, old = reports["ours"], reports["old"]
    assert ours.ambiguous_faults_seen >= 2 * N_ENGINES  # a release and a continue per engine at least: the faults happened
    assert (ours.steps_finished, ours.failed_steps, ours.engine_deaths, ours.restarts) == (3, 0, 0, 0), ours.failures
    # every engine's first release was ambiguous: settled from the memory probe, by the client (probe_verdicts), by the
    # barrier's own probing (reconciles_probe), or after a quarantine by the loop (engines_reconciled)
    assert ours.engines_quarantined + ours.reconciles_probe + ours.probe_verdicts >= N_ENGINES, ours
    assert ours.engines_reconciled == ours.engines_quarantined
    assert old.ambiguous_faults_seen >= 1
    assert old.engine_deaths == 1 and old.stopped_early, old.failures  # engine 0's release, re-sent after the reset
    assert (old.engines_quarantined, old.engines_reconciled) == (0, 0)
