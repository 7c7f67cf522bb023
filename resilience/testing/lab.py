"""What every colocate lab shares: its report, the retry counter, the stop clock, the reconcile rounds, the ``Lab`` shape.

``colocate.run_colocate`` drives one ``Lab`` per run (``lab_sglang``, ``lab_vllm``, ``lab_smg``). Each lab's
clients retry on the run's :class:`StopClock`: an interrupted run stops it, and every retry backing off on a lab
thread ends at once with :class:`LabStopped`.
"""

from __future__ import annotations

import random
import statistics
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Executor, Future
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Final, Literal, Protocol

import requests

from resilience.barrier import PhaseDeadlines, PhaseFailed
from resilience.events import AttemptEnded, CallEnded, Event, Observer, RetryScheduled
from resilience.outcome import CallOutcome
from resilience.testing.faultplan import CONTROL_PATHS

if TYPE_CHECKING:
    from resilience.barrier.journal import RestartBudget
    from resilience.policy import PolicyTable
    from resilience.testing.colocate import ColocateConfig
    from resilience.testing.emulator import EmulatedFleet, EngineHandle
    from resilience.testing.faultplan import FaultPlan
    from resilience.testing.faults import FaultProxy

__all__ = [
    "BASELINE",
    "CONTROL_TIMEOUT_S",
    "DEADLINES",
    "RESILIENT",
    "ColocateReport",
    "Lab",
    "LabSetup",
    "LabStopped",
    "LoopKind",
    "RetryCounter",
    "StopClock",
    "bare_session",
    "lost_stragglers",
    "put_in_order",
    "reconcile_from_probe",
    "restart_engines",
    "restore_fleet",
    "rollout",
    "run_rounds",
]

LoopKind = Literal["old", "ours"]
"""Which loop runs: :data:`BASELINE` or :data:`RESILIENT` (the values name the runs in reports and in ``cpr soak --way``)."""
BASELINE: Final = "old"
"""The baseline loop: the engine's usual client code (bare ``requests`` for SGLang, SkyRL's gather for vLLM)."""
RESILIENT: Final = "ours"
"""The resilient loop: our clients + ``Orchestrator``."""
CONTROL_TIMEOUT_S: Final = 3.0
"""Seconds each attempt of a control call may take in demo and soak runs, every loop (time-scaled: the engines'
policies allow 30-120 s; an emulated control call answers in milliseconds)."""
DEADLINES: Final = PhaseDeadlines(transition_s=60, pause_s=20, flush_s=20, release_s=20, resume_s=20, continue_s=20)
"""The orchestrators' phase limits in every lab (the SGLang loop adds ``in_transit_s``)."""
RECONCILE_ROUNDS: Final = 3
"""How many times a resilient loop runs one transition, reconciling the engines it quarantined in between."""


class LabStopped(Exception):
    """The run was interrupted: a call that would back off and retry ends here instead."""


class StopClock:
    """The system clock whose sleeps raise :class:`LabStopped` once :meth:`stop` is called (from any thread)."""

    monotonic = staticmethod(time.monotonic)

    def __init__(self) -> None:
        self._stopped = threading.Event()

    def sleep(self, seconds: float) -> None:
        """Wait ``seconds``; raise :class:`LabStopped` at once if the run is stopped (before or during the wait)."""
        if self._stopped.wait(max(0.0, seconds)) or self._stopped.is_set():
            raise LabStopped("the colocate run was interrupted")

    def stop(self) -> None:
        self._stopped.set()

    @property
    def stopped(self) -> bool:
        return self._stopped.is_set()


@dataclass
class ColocateReport:
    """What a run did; the side-by-side table and the JSON report are made of these fields."""

    way: str
    """``"old"``, ``"ours"``, or behind smg ``"smg"``, ``"ours"``, ``"ours-smg"``; a key of the JSON report."""
    steps_planned: int
    steps_finished: int = 0
    failed_steps: int = 0
    restarts: int = 0
    restart_limit: int = 3
    restart_budget_left: int = 3
    engine_deaths: int = 0
    http_502_seen: int = 0
    http_502_absorbed: int = 0
    ambiguous_faults_seen: int = 0
    """Faults injected after the engine acted (reset once sent, never answered, 502 or reset after the answer)."""
    engines_quarantined: int = 0
    """Times the orchestrator quarantined an engine (its released memory unknown)."""
    engines_reconciled: int = 0
    """Quarantined engines the lab reconciled from the emulator's memory probe."""
    controller_restarts: int = 0
    """Times the controller died while the engines trained and a new one took over (``controller_crash_step``)."""
    controller_restart_deaths: int = 0
    """Engines that died in the step a new controller ran again after a controller restart."""
    controller_kills: int = 0
    """Of ``controller_restarts``, the kills inside a phase with its calls on the wire (``controller_kill_every``)."""
    restarts_clean: int = 0
    """Controller kills after which the journal left no engine's memory unknown: no reconcile was needed."""
    reconciles_probe: int = 0
    """Engines whose unknown released memory the barrier reconciled from the memory probe."""
    probe_verdicts: int = 0
    """Releases and resumes whose client settled a gateway status or a reset from the memory probe instead of re-sending."""
    retried_502: int = 0
    """Calls re-sent after a 502 (the baseline re-sends only ``update_weights_from_tensor``, the seed's 3 attempts)."""
    resent_after_error: int = 0
    """Calls re-sent after a connection error, reset or read timeout (the baseline: any control call, verl's 3 attempts)."""
    requests_aborted_rerun: int = 0
    requests_lost: int = 0
    garbage_completions: int = 0
    """vLLM: completions answered 200 with text no intact weights give (a level-2 sleep woken without an update)."""
    phase_seconds: dict[str, list[float]] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    stopped_early: str | None = None
    wall_s: float = 0.0

    def percentile(self, phase: str, q: float) -> float | None:
        """The ``q`` quantile (0-1) of a phase's durations, or None without samples."""
        values = sorted(self.phase_seconds.get(phase, []))
        if not values:
            return None
        if len(values) == 1:
            return values[0]
        return float(statistics.quantiles(values, n=100, method="inclusive")[max(0, min(98, round(q * 100) - 1))])

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready, with p50/p99 per phase."""
        data = asdict(self)
        data["phase_latency_s"] = {
            phase: {"p50": self.percentile(phase, 0.5), "p99": self.percentile(phase, 0.99), "n": len(v)}
            for phase, v in self.phase_seconds.items()
        }
        del data["phase_seconds"]
        return data

    def timed(self, phase: str, fn: Callable[[], object]) -> None:
        """Run ``fn`` and add its duration to ``phase_seconds[phase]``."""
        t0 = time.monotonic()
        fn()
        self.phase_seconds.setdefault(phase, []).append(time.monotonic() - t0)


class RetryCounter:
    """Counts, from the retry events, the retries by reason and the 502s absorbed (502 answers inside a call that ended well)."""

    def __init__(self) -> None:
        self.absorbed = 0
        self.retries: dict[str, int] = {}
        """Retries by reason (``RetryScheduled.reason``: ``status_502``, ``connection_reset``, ...)."""
        self._pending: dict[int, int] = {}  # call_id -> its 502s so far, while the call runs
        self._lock = threading.Lock()

    def __call__(self, event: Event) -> None:
        if isinstance(event, RetryScheduled):
            with self._lock:
                self.retries[event.reason] = self.retries.get(event.reason, 0) + 1
        if isinstance(event, AttemptEnded) and event.status == 502:
            with self._lock:
                self._pending[event.call_id] = self._pending.get(event.call_id, 0) + 1
        elif isinstance(event, CallEnded):
            with self._lock:
                n = self._pending.pop(event.call_id, 0)
                if event.outcome in (CallOutcome.SUCCESS, CallOutcome.RETRIED_SUCCESS):
                    self.absorbed += n


@dataclass(frozen=True)
class LabSetup:
    """What ``run_colocate`` hands the lab it builds, for every engine kind and route."""

    fleet: EmulatedFleet
    config: ColocateConfig
    way: str
    observers: Sequence[Observer]
    budget: RestartBudget
    clock: StopClock
    """The clock every client of the lab retries on."""
    policies: PolicyTable | None = None
    """Our clients' policies; None: the lab's demo table."""
    proxies: Sequence[FaultProxy] | None = None
    """Fault proxies in front of the engines, one per engine in fleet order (direct route); None: the fleet's own."""
    plan: FaultPlan | None = None
    """The fault plan of the proxies the smg lab starts itself (the smg route only)."""

    def direct_urls(self) -> tuple[list[str], Sequence[FaultProxy | None]]:
        """The direct route's engine URLs and the proxies whose faults the report counts (``proxies``, else the fleet's)."""
        if self.proxies is not None:
            return [p.url for p in self.proxies], list(self.proxies)
        return list(self.fleet.urls), [e.proxy for e in self.fleet.engines]

    def new_report(self) -> ColocateReport:
        return ColocateReport(self.way, self.config.steps, restart_limit=self.budget.limit, restart_budget_left=self.budget.remaining)


class Lab(Protocol):
    """One way's colocate steps on a fleet, driven step by step by ``run_colocate``."""

    report: ColocateReport
    counter: RetryCounter
    counted: Sequence[FaultProxy | None]
    """The proxies whose injected faults the report counts."""
    restarted_controller_in: int | None
    """The step a new controller ran again after the old one died, once one did."""

    def step(self, n: int) -> None:
        """Run step ``n`` (0-based); raises what failed it."""

    def recover(self, failed: bool) -> int:
        """After a step (``failed``: it raised or an engine died): put the fleet back in order; returns the deaths found."""

    def tally(self) -> None:
        """At the end of the run: add the lab's own counts to the report."""

    def close(self, *, interrupted: bool) -> None:
        """Stop the lab's threads and clients (``interrupted``: without waiting for calls in flight). Idempotent."""


def run_rounds(
    transition: Callable[[], object],
    quarantined: Callable[[], Iterable[str]],
    reconcile: Callable[[Sequence[str]], None] | None,
    report: ColocateReport,
    *,
    again_unquarantined: bool = False,
) -> None:
    """Run a transition; after a ``PhaseFailed`` that no engine died of, reconcile the engines it quarantined
    (``reconcile``; None: nothing to reconcile) and run it again, at most :data:`RECONCILE_ROUNDS` times in all.

    ``quarantined``: the orchestrator's quarantined engines now. ``again_unquarantined``: whether a failure that
    quarantined nothing is run again too (default False: it is re-raised at once).
    """
    for round_ in range(1, RECONCILE_ROUNDS + 1):
        try:
            transition()
            return
        except PhaseFailed as exc:
            names = sorted(set(exc.quarantined) | set(quarantined()))
            if exc.dead or round_ == RECONCILE_ROUNDS or (not names and not again_unquarantined):
                raise
            if names and reconcile is not None:
                report.engines_quarantined += len(names)
                reconcile(names)


def reconcile_from_probe(
    names: Sequence[str],
    reconcile: Callable[..., None],
    released_tags: Callable[[str], frozenset[str] | None],
    proxies: Mapping[str, FaultProxy],
    report: ColocateReport,
    *,
    within_s: float = 10.0,
) -> None:
    """Tell the orchestrator (``reconcile``) each quarantined engine's released memory, from a memory probe.

    ``released_tags`` is the emulator's truth through its side channel (as NVML would be on a GPU node), never HTTP.
    Each engine's proxy (``proxies``, by engine name) first settles its control calls. While the probe answers None
    or the orchestrator refuses (a call it sent still runs), this asks again, for at most ``within_s`` seconds. An
    engine with memory released is paused; with none, whether it is paused stays unknown (the next transition
    pauses it again).
    """
    for name in names:
        deadline = time.monotonic() + within_s
        while True:
            proxy = proxies.get(name)
            if proxy is not None:  # control calls only: generation held at a paused engine's gate is not waited for
                proxy.settle(paths=CONTROL_PATHS)
            released = released_tags(name)
            try:
                if released is None:
                    raise RuntimeError(f"the memory probe cannot prove {name}'s released tags yet")
                reconcile(name, released=released, paused=True if released else None)
                break
            except RuntimeError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        report.engines_reconciled += 1


def rollout(
    pool: Executor,
    n: int,
    config: ColocateConfig,
    rng: random.Random,
    generate: Callable[[int, str], object],
    straggler: Callable[[int, float, str], str],
    engines: int,
) -> list[Future[str]]:
    """Step ``n``'s rollout on ``pool``; returns the stragglers, not waited for.

    First ``config.rollout_requests`` calls ``generate(i, tag)`` per engine ``i``, all waited for (at most 120 s
    each); then ``config.stragglers`` calls ``straggler(i, delay, tag)`` per engine, ``delay`` drawn from ``rng`` in
    0..``config.straggler_window_s`` in engine order.
    """
    calls = [pool.submit(generate, i, f"s{n}-e{i}-r{k}") for i in range(engines) for k in range(config.rollout_requests)]
    for call in calls:
        call.result(timeout=120)
    return [
        pool.submit(straggler, i, rng.uniform(0, config.straggler_window_s), f"s{n}-e{i}-late{k}")
        for i in range(engines)
        for k in range(config.stragglers)
    ]


def lost_stragglers(futures: Sequence[Future[str]], interrupted: bool) -> int:
    """How many stragglers came back ``"lost"`` (each waited for at most 120 s); ``interrupted``: cancel, count none."""
    if interrupted:
        for future in futures:
            future.cancel()
        return 0
    return sum(1 for f in futures if f.result(timeout=120) == "lost")


def bare_session() -> requests.Session:
    """A baseline's session: no proxy from the environment, a pool for every engine's calls at once."""
    session = requests.Session()
    session.trust_env = False
    session.mount("http://", requests.adapters.HTTPAdapter(pool_maxsize=64))
    return session


def put_in_order(session: requests.Session, engine: EngineHandle, *, end_weight_session: bool = True) -> None:
    """Put a live SGLang ``engine`` back as a global restart leaves it (straight to its own URL): resume its released
    tags, continue it when paused, end an open weight-update session (``end_weight_session``, default True)."""
    state = engine.state()
    if state.get("released_tags"):
        session.post(f"{engine.direct_url}/resume_memory_occupation", json={"tags": state["released_tags"]}, timeout=30)
    if state.get("paused"):
        session.post(f"{engine.direct_url}/continue_generation", json={}, timeout=30)
    if end_weight_session and state.get("weight_update_session_open"):
        session.post(f"{engine.direct_url}/end_weight_update", json={}, timeout=30)


def restart_engines(engines: Sequence[EngineHandle]) -> None:
    """Restart ``engines`` in parallel: stop all, spawn all, then wait (at most 120 s) until all serve."""
    for engine in engines:
        engine.stop()
        engine.spawn()
    ready_by = time.monotonic() + 120
    for engine in engines:
        engine.wait_ready(ready_by)


def restore_fleet(engines: Sequence[EngineHandle], put_in_order: Callable[[EngineHandle], object]) -> int:
    """A global restart: restart the dead ``engines``, put the live ones in order; returns the deaths found.

    An engine that fails while being put in order and then exits (a crash lands a moment after the call that caused
    it) is restarted and counted too.
    """
    dead = [e for e in engines if not e.alive()]
    restart_engines(dead)
    for engine in engines:
        if engine in dead:
            continue
        try:
            put_in_order(engine)
        except requests.RequestException:
            if engine.wait_exit(5.0) is None:
                raise
            restart_engines([engine])
            dead.append(engine)
    return len(dead)
