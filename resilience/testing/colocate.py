"""A colocated RL training loop on emulated engines, run as the baseline (``"old"``) or the resilient loop (``"ours"``).

Each step: rollout (generation on every engine, plus stragglers that arrive
around the offload), offload, a training pause, onload, weight sync. The
baseline is the seeds' "before" code: bare ``requests`` calls with
``raise_for_status()``, flush then release with no pause, a bare weight sync.
The resilient loop is ``SGLangClient`` + ``Orchestrator``. Where a control call may have
been applied (a reset or a read timeout after sending), the baseline does what
verl does with every control call (re-send it on a connection error or a
timeout, 3 attempts), which kills an engine whose release or resume had been
applied; the resilient loop raises ``AmbiguousOutcome``, the orchestrator quarantines the
engine, and this driver reconciles it from the emulator's memory probe (a side channel,
as NVML would be on a GPU node; see ``_Loop._reconcile``) and runs the transition again. A failed step is what makes a
controller trigger a global restart: it is recorded in a ``RestartBudget``,
engines are put back in order (dead ones restarted), and the run goes on
until the budget is spent. With ``ColocateConfig.controller_crash_step`` the
controller dies once while the engines train and a new one runs that step again
from its offload: the baseline's new controller knows nothing and releases
again (the engines die, torch_memory_saver's ``exit(1)``); ours starts on the
dead one's journal (``Orchestrator(journal=...)``) and knows the offload is done.
With ``ColocateConfig.controller_kill_every`` the resilient loop's controller is
killed every K steps inside a seeded phase, its calls on the wire
(``resilience.testing.controller_kill``), and a new one starts on a copy of the
journal as it was at the kill; the engines it left unknown are reconciled from
the memory probe (``Orchestrator(memory_probe=...)``, then ``_Loop._reconcile``).
``cpr demo``, ``cpr soak`` and the chaos tests drive this loop.
"""

from __future__ import annotations

import random
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Literal

import requests

from resilience.adapters.sglang import SGLANG_POLICIES, GenerateResult, SGLangClient
from resilience.barrier import EngineGroup, Orchestrator, PhaseDeadlines, PhaseFailed
from resilience.barrier.holds import WEIGHT_SYNC_HOLD
from resilience.budget import RestartBudget
from resilience.events import AttemptEnded, CallEnded, Event, Observer, RetryScheduled
from resilience.outcome import CallOutcome
from resilience.policy import PolicyTable
from resilience.testing.controller_kill import ControllerKilled, KillPoint, KillSwitchFanOut
from resilience.testing.counting_probe import CountingProbe
from resilience.testing.emulator import EmulatedFleet, EngineHandle
from resilience.testing.faultplan import CONTROL_PATHS
from resilience.testing.memory_probe import EmulatorMemoryProbe
from resilience.testing.policies import fast_policies

if TYPE_CHECKING:
    from resilience.testing.faults import FaultProxy

__all__ = [
    "BASELINE",
    "RESILIENT",
    "ColocateConfig",
    "ColocateReport",
    "LoopKind",
    "StepProgress",
    "demo_policies",
    "run_colocate",
    "score_step",
]

LoopKind = Literal["old", "ours"]
"""Which loop runs: :data:`BASELINE` or :data:`RESILIENT` (the values name the runs in reports and in ``cpr soak --way``)."""
BASELINE: Final = "old"
"""The baseline loop: bare ``requests`` as the seeds' "before" code calls the engines."""
RESILIENT: Final = "ours"
"""The resilient loop: ``SGLangClient`` + ``Orchestrator``."""
_DEADLINES = PhaseDeadlines(transition_s=60, pause_s=20, flush_s=20, release_s=20, resume_s=20, continue_s=20, in_transit_s=5)
"""``in_transit_s``: an emulated engine applies a control call within milliseconds of its arrival, and the proxy hands a
request on at once; 5 s covers a loaded machine without waiting out a 20 s phase limit after every ambiguous reset."""
CONTROL_TIMEOUT_S = 3.0
"""Seconds each attempt of a pause, continue, release or resume may take in demo and soak runs, both loops
(time-scaled: SGLANG_POLICIES allow 30-120 s; an emulated control call answers in milliseconds)."""
_SCALED_ROUTES = ("/pause_generation", "/continue_generation", "/release_memory_occupation", "/resume_memory_occupation")
_BASELINE_ATTEMPTS = 3
"""The baseline's attempts on a connection error or a timeout: verl's ``max_attempts=3`` (statuses are not retried)."""
_RECONCILE_ROUNDS = 3
"""How many times the resilient loop runs one transition, reconciling the engines it quarantined in between."""


def demo_policies() -> PolicyTable:
    """SGLANG_POLICIES' decisions with backoffs scaled down 10x and control attempts capped at ``CONTROL_TIMEOUT_S``.

    Demo and soak runs are time-scaled; what is retried and what is never re-sent is SGLANG_POLICIES'.
    """
    table = fast_policies(SGLANG_POLICIES, base_s=0.05, cap_s=0.4)
    scaled = {
        key: replace(policy, attempt_timeout_s=CONTROL_TIMEOUT_S)
        for key, policy in table.entries.items()
        if any(key.endswith(" " + route) for route in _SCALED_ROUTES)
    }
    assert len(scaled) == len(_SCALED_ROUTES), f"SGLANG_POLICIES routes changed: {sorted(scaled)}"
    return table.with_entries(scaled)


@dataclass(frozen=True, slots=True)
class ColocateConfig:
    """One run of the colocate loop."""

    steps: int = 20
    """Training steps to run."""
    seed: int = 0
    """Seeds straggler timing (the fault plan has its own seed)."""
    rollout_requests: int = 3
    """Generation requests per engine per step, all awaited before the offload."""
    stragglers: int = 2
    """Requests per engine per step that arrive around the offload (the second seed's Bug B)."""
    straggler_window_s: float = 0.15
    """Stragglers arrive uniformly within this many seconds after the offload starts."""
    max_new_tokens: int = 12
    """Tokens per generation request."""
    train_s: float = 0.05
    """The training pause between offload and onload."""
    restart_limit: int = 3
    """Restarts the run may take (the seed's max_global_restart)."""
    baseline_flush_polls: int = 20
    """The baseline's flush loop: tries, 0.05 s apart (slime polls 60 times, 1 s apart)."""
    controller_crash_step: int | None = None
    """The step (0-based) at which the controller dies while the engines train, after its offload returned;
    a new controller starts and runs that step again from its offload, not knowing how far it got. The
    baseline's new controller knows nothing; ours resumes from its journal. None (default): never."""
    controller_kill_every: int | None = None
    """Every this many steps (the K-th, 2K-th, ... step) the controller dies: ours inside a seeded phase of the step,
    with that phase's calls sent (``KillSwitchFanOut``), and a new controller on the journal as it was at that
    instant runs the transition again; the baseline's after its offload, as with ``controller_crash_step``.
    None (default): never."""

    def __post_init__(self) -> None:
        for name in ("steps", "rollout_requests", "stragglers", "max_new_tokens", "baseline_flush_polls"):
            if getattr(self, name) < 0:
                raise ValueError(f"ColocateConfig.{name} must be >= 0, but was {getattr(self, name)}")
        if self.restart_limit < 0:
            raise ValueError(f"ColocateConfig.restart_limit must be >= 0, but was {self.restart_limit}")
        crash = self.controller_crash_step
        if crash is not None and (isinstance(crash, bool) or not isinstance(crash, int) or crash < 0):
            raise ValueError(f"ColocateConfig.controller_crash_step must be None or a step >= 0, but was {crash!r}")
        every = self.controller_kill_every
        if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
            raise ValueError(f"ColocateConfig.controller_kill_every must be None or a number of steps >= 1, but was {every!r}")

    def kills_at(self, step: int) -> bool:
        """Whether the controller is killed in ``step`` (0-based) by ``controller_kill_every``."""
        every = self.controller_kill_every
        return every is not None and step % every == every - 1


@dataclass(frozen=True, slots=True)
class StepProgress:
    """Told to the progress callback after each step."""

    way: str
    """The loop that ran the step: ``"old"`` (:data:`BASELINE`) or ``"ours"`` (:data:`RESILIENT`)."""
    step: int
    steps: int
    ok: bool
    restarts: int
    deaths: int
    error: str | None = None
    started_ns: int | None = None
    """``time.monotonic_ns()`` when the step began (its rollout), or None."""
    ended_ns: int | None = None
    """``time.monotonic_ns()`` when the step's last call returned, before any recovery, or None."""


@dataclass
class ColocateReport:
    """What a run did; the side-by-side table and the JSON report are made of these fields."""

    way: str
    """The loop that ran: ``"old"`` (:data:`BASELINE`) or ``"ours"`` (:data:`RESILIENT`); a key of the JSON report."""
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
    """Times the orchestrator quarantined an engine (its released memory unknown); the resilient loop only."""
    engines_reconciled: int = 0
    """Quarantined engines this driver reconciled from the emulator's memory probe (a side channel); the resilient loop only."""
    controller_restarts: int = 0
    """Times the controller died while the engines trained and a new one took over (``controller_crash_step``)."""
    controller_restart_deaths: int = 0
    """Engines that died in the step a new controller ran again after a controller restart."""
    controller_kills: int = 0
    """Of ``controller_restarts``, the kills inside a phase with its calls on the wire (``controller_kill_every``)."""
    restarts_clean: int = 0
    """Controller kills after which the journal left no engine's memory unknown: no reconcile was needed."""
    reconciles_probe: int = 0
    """Engines whose unknown released memory the barrier reconciled from the memory probe (its own probing and ``_reconcile``'s)."""
    probe_verdicts: int = 0
    """Releases and resumes whose client settled a gateway status or a reset from the memory probe (applied or not) instead
    of re-sending blindly; the resilient loop only."""
    retried_502: int = 0
    """Calls re-sent after a 502: ours from its retry events (``status_502``); the baseline only re-sends
    ``update_weights_from_tensor`` on a gateway status (the seed's ``_make_request(max_attempts=3)``)."""
    resent_after_error: int = 0
    """Calls re-sent after a connection error, reset or read timeout: ours from its retry events (an idempotent call, or
    one that never reached the engine); the baseline re-sends any control call so (verl's 3 attempts), whether or not
    the engine had acted on it."""
    requests_aborted_rerun: int = 0
    requests_lost: int = 0
    garbage_completions: int = 0
    """Completions answered 200 with text no intact weights give (vLLM after a level-2 sleep woken without an update); vLLM runs only."""
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


class _Counter:
    """Counts the 502s absorbed from the retry loop's events: each 502 answer inside a call that ended well.

    A 502 is absorbed by a retry (``status_502``), or, on a release or resume whose client asks the memory
    probe, by the probe's verdict: "done" ends the call as applied, "not done" re-sends it (``probe_not_done``).
    """

    def __init__(self) -> None:
        self.absorbed = 0
        self.retries: dict[str, int] = {}
        """Retries by reason (``RetryScheduled.reason``: ``status_502``, ``connection_reset``, ...)."""
        self._pending: dict[int, int] = {}
        """call_id -> its 502 answers so far (removed when the call ends: bounded by the calls in flight)."""
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


def _json_post(session: requests.Session, url: str, body: dict[str, Any], timeout: float = 30.0) -> requests.Response:
    r = session.post(url, json=body, timeout=timeout)
    r.raise_for_status()
    return r


_TRANSPORT_REASONS = frozenset({"connect_error", "read_timeout", "connection_reset"})
"""Retry reasons of a transport failure (no HTTP answer): what ``resent_after_error`` counts of ours."""


class _BaselineResends:
    """What the baseline re-sent (it has no retry events to count them by); thread-safe."""

    def __init__(self) -> None:
        self.after_error = 0
        """Control calls re-sent after a connection error or timeout."""
        self.after_502 = 0
        """``update_weights_from_tensor`` calls re-sent after a 502."""
        self.absorbed_502 = 0
        """502s followed by a good answer to the same call."""
        self._lock = threading.Lock()

    def add(self, *, after_error: int = 0, after_502: int = 0, absorbed_502: int = 0) -> None:
        with self._lock:
            self.after_error += after_error
            self.after_502 += after_502
            self.absorbed_502 += absorbed_502


def _baseline_control(
    session: requests.Session, url: str, body: dict[str, Any], resends: _BaselineResends | None = None
) -> requests.Response:
    """The baseline's control call: raise_for_status, and like verl 3 attempts on connection errors and timeouts."""
    for attempt in range(_BASELINE_ATTEMPTS):
        try:
            return _json_post(session, url, body, timeout=CONTROL_TIMEOUT_S)
        except (requests.ConnectionError, requests.Timeout):
            if attempt == _BASELINE_ATTEMPTS - 1:
                raise
            if resends is not None:
                resends.add(after_error=1)
            time.sleep(0.05)
    raise AssertionError("unreachable")


def _bare_session() -> requests.Session:
    """The baseline's session: no proxy from the environment, a pool for every engine's calls at once."""
    session = requests.Session()
    session.trust_env = False
    session.mount("http://", requests.adapters.HTTPAdapter(pool_maxsize=64))
    return session


class _Loop:
    def __init__(
        self,
        fleet: EmulatedFleet,
        config: ColocateConfig,
        kind: LoopKind,
        observers: Sequence[Observer],
        budget: RestartBudget,
        policies: PolicyTable,
        urls: Sequence[str] | None = None,
        proxies: Sequence[FaultProxy | None] = (),
    ) -> None:
        self.fleet, self.config, self.kind = fleet, config, kind
        self.urls = list(urls) if urls is not None else fleet.urls
        self.rng = random.Random(f"{config.seed}:{kind}")
        self.budget = budget
        self.counter = _Counter()
        self.resends = _BaselineResends()
        self._count_lock = threading.Lock()
        self.report = ColocateReport(kind, config.steps, restart_limit=budget.limit, restart_budget_left=budget.remaining)
        self.pool = ThreadPoolExecutor(
            max(4, len(fleet.engines) * (config.stragglers + config.rollout_requests)), thread_name_prefix=f"colocate-{kind}"
        )
        self.bare = _bare_session()
        self._policies, self._client_observers = policies, (*observers, self.counter)
        self.proxy_of: dict[str, FaultProxy] = {}
        aliases = {u: h.direct_url for u, h in zip(self.urls, fleet.engines, strict=True)}
        truth = EmulatorMemoryProbe(fleet.memory_state_dir, aliases=aliases)
        self.probe = CountingProbe(truth)
        """Where the orchestrator and ``_reconcile`` learn an engine's released tags: the emulator's side channel, not HTTP."""
        self.client_probe = CountingProbe(truth)
        """The same, asked by the clients' release and resume before re-sending after a gateway status or a reset."""
        self.clients = self._new_clients()
        self.handles = {client.engine: handle for client, handle in zip(self.clients, fleet.engines, strict=True)}
        self.proxy_of.update({client.engine: proxy for client, proxy in zip(self.clients, proxies, strict=False) if proxy is not None})
        restarts = config.controller_crash_step is not None or config.controller_kill_every is not None
        self._journal_dir = Path(tempfile.mkdtemp(prefix="cpr-journal-")) if restarts else None
        self._journals = 0
        self._journal_path = self._new_journal_path()
        self._snapshot: Path | None = None
        self.fanout = KillSwitchFanOut(on_kill=self._snapshot_journal)
        """Every orchestrator's fan-out; armed in the steps ``controller_kill_every`` names."""
        self.kill_rng = random.Random(f"{config.seed}:kill")
        """Where each kill lands (phase, delay): its own stream, so kills do not move the stragglers."""
        self._old_clients: list[SGLangClient] = []
        self.restarted_controller_in: int | None = None
        """The step a new controller ran again after the old one died (``controller_crash_step``), once it did."""
        self.orch = self._orchestrator(observers)

    def _new_journal_path(self) -> Path | None:
        """A fresh journal file in the run's folder (None when the run restarts no controller: knowledge in memory)."""
        if self._journal_dir is None:
            return None
        self._journals += 1
        return self._journal_dir / f"barrier-{self._journals}.journal"

    def _orchestrator(self, observers: Sequence[Observer]) -> Orchestrator[SGLangClient]:
        """An Orchestrator over the current clients on ``self._journal_path``, with the memory probe and the kill switch."""
        return Orchestrator(
            EngineGroup(self.clients),
            observers=observers,
            deadlines=_DEADLINES,
            restart_budget=self.budget,
            fanout=self.fanout,
            memory_probe=self.probe,
            journal=self._journal_path,
        )

    def _snapshot_journal(self) -> None:
        """At the instant of a kill: copy the journal as it is, what a killed process leaves on disk (the next controller's)."""
        path = self._new_journal_path()
        if path is not None and self._journal_path is not None:
            shutil.copyfile(self._journal_path, path)
        self._snapshot = path

    def _new_clients(self) -> list[SGLangClient]:
        return [
            SGLangClient(
                u,
                policies=self._policies,
                observers=self._client_observers,
                flush_poll_s=0.05,
                pool_maxsize=64,
                memory_probe=self.client_probe,
            )
            for u in self.urls
        ]

    # -- generation ------------------------------------------------------------------

    def _generate(self, i: int, tag: str) -> GenerateResult | None:
        body = {"text": tag, "sampling_params": {"max_new_tokens": self.config.max_new_tokens}}
        if self.kind == BASELINE:
            r = self.bare.post(f"{self.urls[i]}/generate", json=body, timeout=60)
            r.raise_for_status()
            data = r.json()
            finish = (data.get("meta_info") or {}).get("finish_reason") or {}
            return GenerateResult(
                data.get("text", ""), (), finish.get("type") if isinstance(finish, dict) else finish, data.get("meta_info", {})
            )
        return self.clients[i].generate(tag, sampling_params={"max_new_tokens": self.config.max_new_tokens})

    def _straggler(self, i: int, delay: float, tag: str) -> str:
        time.sleep(delay)
        for _ in range(3):  # an aborted request is re-submitted by the rollout, as RL rollouts do
            try:
                out = self._generate(i, tag)
            except requests.RequestException:
                return "lost"
            if out is None or not out.aborted:
                return "done"
            with self._count_lock:  # stragglers run on many threads
                self.report.requests_aborted_rerun += 1
        return "lost"

    # -- the two loops -----------------------------------------------------------------

    def _timed(self, phase: str, fn: Callable[[], object]) -> None:
        t0 = time.monotonic()
        fn()
        self.report.phase_seconds.setdefault(phase, []).append(time.monotonic() - t0)

    def _baseline_offload(self) -> None:
        def one(url: str) -> None:
            for _ in range(self.config.baseline_flush_polls):  # slime/Relax: poll flush until it says flushed
                r = self.bare.get(f"{url}/flush_cache", timeout=30)
                if r.status_code == 200:
                    break
                time.sleep(0.05)
            else:
                raise TimeoutError(f"{url}: timeout while flushing cache")
            _baseline_control(self.bare, f"{url}/release_memory_occupation", {"tags": None}, self.resends)

        list(self.pool.map(one, self.urls))

    def _baseline_onload(self) -> None:
        list(
            self.pool.map(lambda u: _baseline_control(self.bare, f"{u}/resume_memory_occupation", {"tags": None}, self.resends), self.urls)
        )

    def _baseline_weight_sync(self, version: str) -> None:
        def one(url: str) -> None:
            _baseline_control(self.bare, f"{url}/pause_generation", {}, self.resends)
            _json_post(self.bare, f"{url}/begin_weight_update", {"selector": "all"})
            got_502 = 0
            for attempt in range(3):  # the seed's _make_request(max_attempts=3) on this one call
                r = self.bare.post(f"{url}/update_weights_from_tensor", json={"serialized_named_tensors": ["w"], "weight_version": version})
                if r.status_code not in (502, 503, 504) or attempt == 2:
                    r.raise_for_status()
                    self.resends.add(absorbed_502=got_502)
                    break
                if r.status_code == 502:
                    got_502 += 1
                    self.resends.add(after_502=1)
                time.sleep(0.05)
            _json_post(self.bare, f"{url}/end_weight_update", {})
            _baseline_control(self.bare, f"{url}/continue_generation", {}, self.resends)

        list(self.pool.map(one, self.urls))

    def _resilient_weight_sync(self, version: str) -> None:
        with self.orch.weight_sync(mode="retract") as engines:

            def one(client: SGLangClient) -> None:
                client.begin_weight_update()
                client.update_weights_from_tensor(["w"], weight_version=version)
                client.end_weight_update()

            list(self.pool.map(one, engines))

    def _resilient(self, transition: Callable[[], object]) -> None:
        """Run one of the resilient loop's transitions (see ``_rounds``); killed inside it, a new controller runs it again."""
        try:
            self._rounds(transition)
        except ControllerKilled:
            self._controller_killed()
            self._rounds(transition)

    def _rounds(self, transition: Callable[[], object]) -> None:
        """Run a transition; after a PhaseFailed that quarantined engines, reconcile them and run it again.

        Gives up (re-raises) when an engine died, when nothing was quarantined (the failure is not about
        unknown memory), or after ``_RECONCILE_ROUNDS`` runs: then the step fails, as before.
        """
        for round_ in range(1, _RECONCILE_ROUNDS + 1):
            try:
                transition()
                return
            except PhaseFailed as exc:
                names = sorted(set(exc.quarantined) | set(self.orch.quarantined()))
                if not names or exc.dead or round_ == _RECONCILE_ROUNDS:
                    raise
                self.report.engines_quarantined += len(names)
                self._reconcile(names)

    def _reconcile(self, names: Sequence[str]) -> None:
        """Tell the orchestrator each quarantined engine's released memory, asked of a memory probe.

        A real controller asks a ``MemoryProbe`` too (NVML's per-process GPU memory on the engine's
        node, ``resilience.adapters.nvml``); here it is the emulator's own truth through its side channel
        (``EmulatorMemoryProbe``: each engine publishes its released tags to a state file), never an
        HTTP route. The probe answers None while a release or resume is being carried out (a release
        whose client saw a reset finishes a moment later), and the orchestrator refuses while a call it
        sent is still running: then this asks again, for at most 10 s. An engine with memory released is
        paused (one that served would have died at its next prefill); with none released, whether it is
        paused is left unknown, and the next transition that needs it paused pauses it again (safe).
        """
        for name in names:
            deadline = time.monotonic() + 10.0
            while True:
                proxy = self.proxy_of.get(name)
                if proxy is not None:  # control calls only: generation held at a paused engine's gate is not waited for
                    proxy.settle(paths=CONTROL_PATHS)
                released = self.probe.released_tags(name)
                try:
                    if released is None:
                        raise RuntimeError(f"the memory probe cannot prove {name}'s released tags yet")
                    self.orch.reconcile(name, released=released, paused=True if released else None)
                    break
                except RuntimeError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
            self.report.engines_reconciled += 1

    def step(self, n: int) -> None:
        cfg = self.config
        engines = range(len(self.urls))
        rollout = [self.pool.submit(self._generate, i, f"s{n}-e{i}-r{k}") for i in engines for k in range(cfg.rollout_requests)]
        for f in rollout:
            f.result(timeout=120)
        stragglers = [
            self.pool.submit(self._straggler, i, self.rng.uniform(0, cfg.straggler_window_s), f"s{n}-e{i}-late{k}")
            for i in engines
            for k in range(cfg.stragglers)
        ]
        kill = cfg.kills_at(n)
        if kill and self.kind != BASELINE:  # any of the step's phases (offload 3, onload 2, weight sync 2), 0-50 ms in
            self.fanout.arm(KillPoint(phase=self.kill_rng.randrange(7), after_s=round(self.kill_rng.uniform(0.0, 0.05), 4)))
        try:
            if self.kind == BASELINE:
                offload: Callable[[], None] = self._baseline_offload
                onload: Callable[[], None] = self._baseline_onload
                sync: Callable[[], None] = lambda: self._baseline_weight_sync(f"v{n}")  # noqa: E731
            else:  # self.orch is read when each runs: a controller restart replaces it
                offload = lambda: self._resilient(lambda: self.orch.offload(mode="abort"))  # noqa: E731
                onload = lambda: self._resilient(lambda: self.orch.onload())  # noqa: E731
                sync = lambda: self._resilient(lambda: self._resilient_weight_sync(f"v{n}"))  # noqa: E731
            self._timed("offload", offload)
            if n == cfg.controller_crash_step or (kill and self.kind == BASELINE):
                time.sleep(cfg.train_s)  # the controller dies while the engines train
                self._controller_restart(n)
                self._timed("offload", offload)  # the new controller runs the step again from its offload
            time.sleep(cfg.train_s)
            self._timed("onload", onload)
            self._timed("weight_sync", sync)
        finally:
            self.fanout.disarm()  # a kill point the step did not reach (a step with fewer phases) is not carried over
            lost = sum(1 for f in stragglers if f.result(timeout=120) == "lost")
            self.report.requests_lost += lost
            for client in self._old_clients:  # a dead controller's clients: closed once its stragglers are in
                client.close()
            self._old_clients.clear()

    # -- recovery: what a global restart does here ------------------------------------------

    @staticmethod
    def _restart(engines: Sequence[EngineHandle]) -> None:
        for engine in engines:  # restart in parallel: stop all, spawn all, then wait for all
            engine.stop()
            engine.spawn()
        ready_by = time.monotonic() + 120
        for engine in engines:
            engine.wait_ready(ready_by)

    def _put_in_order(self, engine: EngineHandle) -> None:
        state = engine.state()
        if state.get("released_tags"):
            self.bare.post(f"{engine.direct_url}/resume_memory_occupation", json={"tags": state["released_tags"]}, timeout=30)
        if state.get("paused"):
            self.bare.post(f"{engine.direct_url}/continue_generation", json={}, timeout=30)
        if state.get("weight_update_session_open"):
            self.bare.post(f"{engine.direct_url}/end_weight_update", json={}, timeout=30)

    def recover(self) -> int:
        """Restart dead engines; continue/resume live ones left paused or released. Returns deaths found."""
        dead = [e for e in self.fleet.engines if not e.alive()]
        self._restart(dead)
        for engine in self.fleet.engines:
            if engine in dead:
                continue
            try:
                self._put_in_order(engine)
            except requests.RequestException:
                # A crash lands a moment after the call that caused it: the engine may have died after the check above.
                if engine.wait_exit(5.0) is None:
                    raise
                self._restart([engine])
                dead.append(engine)
        for client in self.clients:  # a global restart starts the controller afresh: new clients, new orchestrator
            client.close()
        self.clients = self._new_clients()
        self._replace_orchestrator(self._new_journal_path())  # every engine in order: nothing to resume
        return len(dead)

    def _replace_orchestrator(self, journal: Path | None) -> None:
        """Let go of the old orchestrator's journal and build a new one (over ``self.clients``) on ``journal``."""
        old, observers = self.orch, self.orch.observers
        old.close()
        if old.journal is not None and self._journal_path is not None and self._journal_path != journal:
            self._journal_path.unlink(missing_ok=True)  # one journal file at a time on disk
        self._journal_path = journal
        self.orch = self._orchestrator(observers)

    def _controller_killed(self) -> None:
        """The controller died inside a phase (``KillSwitchFanOut``); a new one takes over on the journal's copy from that instant.

        What the dead one sent still lands: the new controller starts once those calls ended (a dead
        process sends nothing more, but its requests on the wire reach the engines). It has new clients and
        knows only what the copy says: a call in flight at the kill is "maybe applied", and an engine whose
        tags it leaves unknown is reconciled from the memory probe (the orchestrator's own, then
        ``_reconcile``). A weight-sync hold the dead one took is released by the new one (it knows the owner
        is gone; the owner's PID here is this process's, so the journal cannot tell).
        """
        self.report.controller_restarts += 1
        self.report.controller_kills += 1
        self.fanout.drain(30.0)
        self._old_clients.extend(self.clients)  # stragglers may still be generating through them
        self.clients = self._new_clients()
        self._replace_orchestrator(self._snapshot)
        self._snapshot = None
        for _ in range(8):  # bounded: one unpause per hold the dead controller left
            if not any(WEIGHT_SYNC_HOLD in reasons for reasons in self.orch.held().values()):
                break
            self._rounds(lambda: self.orch.unpause(WEIGHT_SYNC_HOLD))
        if not self.orch.quarantined():
            self.report.restarts_clean += 1

    def _controller_restart(self, n: int) -> None:
        """The controller dies while the engines train, and a new one takes over; the engines keep their state.

        The baseline's new controller is a new process that knows nothing (a new session). Ours is one too
        (new clients, a new Orchestrator), started on the dead one's journal: it resumes what the old one knew.
        """
        self.report.controller_restarts += 1
        self.restarted_controller_in = n
        if self.kind == BASELINE:
            self.bare.close()
            self.bare = _bare_session()
            return
        for client in self.clients:
            client.close()
        self.clients = self._new_clients()
        self._replace_orchestrator(self._journal_path)

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.bare.close()
        for client in [*self.clients, *self._old_clients]:
            client.close()
        self.orch.close()
        self.fanout.close()
        if self._journal_dir is not None:
            shutil.rmtree(self._journal_dir, ignore_errors=True)


_ERROR_CHARS = 2000
"""Characters of a failed step's error kept in ``ColocateReport.failures`` (a PhaseFailed names every engine's cause)."""


def _injected_502s(proxies: Sequence[FaultProxy | None]) -> int:
    return sum(proxy.injected_count(502) for proxy in proxies if proxy is not None)


_AMBIGUOUS_KINDS = frozenset({"drop_after", "hang_after", "reset_after", "status_after"})


def _injected_ambiguous(proxies: Sequence[FaultProxy | None]) -> int:
    """Faults injected after the engine acted, from the proxies' exact counts (keys ``kind:status:path``)."""
    return sum(n for p in proxies if p is not None for key, n in p.counts().items() if key.split(":", 1)[0] in _AMBIGUOUS_KINDS)


def score_step(report: ColocateReport, budget: RestartBudget, n: int, error: str | None, deaths: int, cause: str) -> None:
    """Count step ``n`` in ``report``: finished when it raised nothing (``error`` None) and no engine died, else failed
    and named in ``report.failures``; a failed step spends one restart of ``budget`` (recorded with ``cause``), or ends
    the run (``report.stopped_early``) once the budget is spent. Every colocate loop (SGLang, vLLM, behind smg) scores
    its steps here, so their tables count alike."""
    if error is None and deaths == 0:
        report.steps_finished += 1
    else:
        report.failed_steps += 1
        report.failures.append(error or f"step {n}: {deaths} engine(s) died")
        if budget.remaining == 0:
            report.stopped_early = f"restart budget spent at step {n}: the run is over"
        else:
            budget.record(cause, step=n)
            report.restarts += 1
    report.restart_budget_left = budget.remaining


def run_colocate(
    fleet: EmulatedFleet,
    config: ColocateConfig,
    kind: LoopKind,
    *,
    observers: Sequence[Observer] = (),
    restart_budget: RestartBudget | None = None,
    policies: PolicyTable | None = None,
    progress: Callable[[StepProgress], None] | None = None,
    proxies: Sequence[FaultProxy] | None = None,
    recover_when_spent: bool = True,
) -> ColocateReport:
    """Run ``config.steps`` colocate steps of the loop ``kind`` on ``fleet``; stops early when the restart budget is spent.

    ``kind``: :data:`BASELINE` (``"old"``) or :data:`RESILIENT` (``"ours"``).

    ``proxies``: fault proxies to send every call through instead of the fleet's own, one per engine in
    fleet order (each in front of that engine's ``direct_url``); 502s are counted from them. Fresh proxies
    per run give fresh call counters, so one fleet can serve several runs and the same plan seed still
    gives the same faults. Default None: the fleet's :attr:`~EmulatedFleet.urls` and proxies.

    ``recover_when_spent``: whether the step that finds the restart budget spent still puts the fleet back
    in order (restarts dead engines). False saves those restarts when the caller stops the fleet next;
    the deaths are still counted. Default True.
    """
    budget = restart_budget if restart_budget is not None else RestartBudget(config.restart_limit)
    if proxies is not None and len(proxies) != len(fleet.engines):
        raise ValueError(f"`proxies` must hold one proxy per engine ({len(fleet.engines)}), but held {len(proxies)}")
    counted: Sequence[FaultProxy | None] = proxies if proxies is not None else [e.proxy for e in fleet.engines]
    urls = [p.url for p in proxies] if proxies is not None else None
    loop = _Loop(fleet, config, kind, observers, budget, policies if policies is not None else demo_policies(), urls, counted)
    report = loop.report
    before_502, before_ambiguous = _injected_502s(counted), _injected_ambiguous(counted)
    t0 = time.monotonic()
    try:
        for n in range(config.steps):
            error: str | None = None
            cause = "engine death"  # what the restart budget records for a failed step: the exception's type, if one
            started_ns = time.monotonic_ns()
            try:
                loop.step(n)
            except Exception as exc:
                cause = type(exc).__name__
                text = " ".join(str(exc).split())  # whole (a display cuts it between clauses), bounded for a long soak's report
                error = f"step {n}: {cause}: {text if len(text) <= _ERROR_CHARS else text[: _ERROR_CHARS - 4] + ' ...'}"
            ended_ns = time.monotonic_ns()
            dead_now = sum(1 for e in fleet.engines if not e.alive())
            if (error or dead_now) and budget.remaining == 0 and not recover_when_spent:
                deaths = dead_now  # the run is over: no restart (the caller stops the fleet)
            else:
                deaths = loop.recover()
            report.engine_deaths += deaths
            if loop.restarted_controller_in == n:
                report.controller_restart_deaths += deaths
            score_step(report, budget, n, error, deaths, cause)
            if progress is not None:
                progress(
                    StepProgress(
                        kind,
                        n + 1,
                        config.steps,
                        error is None and deaths == 0,
                        report.restarts,
                        report.engine_deaths,
                        report.failures[-1] if report.failures and (error or deaths) else None,
                        started_ns,
                        ended_ns,
                    )
                )
            if report.stopped_early:
                break
    finally:
        loop.close()
    report.http_502_seen = _injected_502s(counted) - before_502
    report.ambiguous_faults_seen = _injected_ambiguous(counted) - before_ambiguous
    report.http_502_absorbed = loop.counter.absorbed + loop.resends.absorbed_502
    report.retried_502 = loop.counter.retries.get("status_502", 0) + loop.resends.after_502
    report.resent_after_error = sum(n for why, n in loop.counter.retries.items() if why in _TRANSPORT_REASONS) + loop.resends.after_error
    report.reconciles_probe = loop.probe.proved
    report.probe_verdicts = loop.client_probe.proved
    report.wall_s = time.monotonic() - t0
    return report
