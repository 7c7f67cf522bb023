"""The churn loop (``cpr soak --churn``): RL steps while engines are killed, restarted, added and retired.

``run_churn(fleet, config)`` drives one ``Orchestrator`` over the first ``config.engines`` engines of the fleet (the
others are spares). Each step: a rollout on every engine the barrier calls serving, ``offload(min_engines=...)``,
``onload(tags=["weights"], ...)``, a weight sync and ``onload(...)``, with the group changing underneath:

- every ``kill_every`` steps one serving engine is SIGKILLed as the offload's flush starts; the offload completes
  for the others and fences it; its process is restarted and ``add`` brings it into the offloaded group;
- every ``add_every`` steps a spare joins, alternately into the offloaded group and the serving one;
- every ``retire_every`` steps one engine leaves (``retire``) and goes back to the spares.

Every kill lands after the rollout ended, so a request lost is a defect. ``ChurnReport`` counts the steps, the
deaths of barrier calls (``death_causes``), requests sent and lost, kills, restarts, joins, leaves and fences.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from resilience.adapters.sglang import SGLangClient
from resilience.barrier import EngineGroup, EngineState, Orchestrator, PhaseDeadlines, PhaseFailed, WeightVersionCheck
from resilience.barrier.state import PhaseStarted
from resilience.events import Event
from resilience.testing.lab_sglang import demo_policies

if TYPE_CHECKING:
    from resilience.testing.emulator import EmulatedFleet

__all__ = ["ChurnConfig", "ChurnReport", "run_churn"]

DEADLINES = PhaseDeadlines(transition_s=60, pause_s=10, flush_s=10, release_s=10, resume_s=10, continue_s=10)
"""Phase limits for emulated engines on loopback (a killed engine's calls are refused at once)."""


@dataclass(frozen=True, slots=True)
class ChurnConfig:
    """One churn run. ``engines``: the group at the start (the fleet's other engines are spares); ``steps``; ``seed``
    (which engine is killed or retired); ``kill_every``, ``add_every``, ``retire_every``: steps between such events
    (0: never); ``rollout_requests``: generations per serving engine per step; ``min_engines``: the partial progress
    each offload and onload asks (default 1)."""

    engines: int = 8
    steps: int = 100
    seed: int = 0
    kill_every: int = 5
    add_every: int = 7
    retire_every: int = 11
    rollout_requests: int = 2
    min_engines: int = 1

    def __post_init__(self) -> None:
        for name in ("engines", "steps", "rollout_requests", "min_engines"):
            if getattr(self, name) < 1:
                raise ValueError(f"ChurnConfig.{name} must be >= 1, but was {getattr(self, name)!r}")
        for name in ("kill_every", "add_every", "retire_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"ChurnConfig.{name} must be >= 0 (0: never), but was {getattr(self, name)!r}")


@dataclass
class ChurnReport:
    """What a churn run did and found (see the module docstring)."""

    steps: int = 0
    failed_steps: int = 0
    engine_deaths: int = 0
    requests_sent: int = 0
    requests_lost: int = 0
    kills: int = 0
    restarts: int = 0
    joins: int = 0
    leaves: int = 0
    fenced: int = 0
    replaced: int = 0
    restarted_back: bool = True
    """Every engine restarted during the run serves at the end (or left afterwards on purpose)."""
    errors: list[str] = field(default_factory=list)
    """The first errors of failed steps (at most 20)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class _Churn:
    def __init__(self, fleet: EmulatedFleet, config: ChurnConfig, deaths: Callable[[str], list[str]]) -> None:
        self.config, self.deaths = config, deaths
        self.rng = random.Random(config.seed)
        self.handles = {h.direct_url: h for h in fleet.engines}
        urls = list(self.handles)
        if len(urls) <= config.engines:
            raise ValueError(f"run_churn needs spare engines: the fleet has {len(urls)}, the group {config.engines}")
        self.clients = {u: self.client(u) for u in urls}
        self.spares = urls[config.engines :]
        self.report = ChurnReport()
        self.victim: str | None = None
        self.restarted: set[str] = set()
        self.seen_log = {u: 0 for u in urls}
        self.pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="churn-rollout")
        group = EngineGroup([self.clients[u] for u in urls[: config.engines]])
        self.orch: Orchestrator[SGLangClient] = Orchestrator(group, deadlines=DEADLINES, observers=[self.observe])

    @staticmethod
    def client(url: str) -> SGLangClient:
        return SGLangClient(url, policies=demo_policies(), flush_poll_s=0.05)

    def observe(self, event: Event) -> None:
        """Kill the chosen engine as the offload's flush phase starts: it dies mid-transition."""
        if isinstance(event, PhaseStarted) and event.transition == "offload" and event.phase == "flush" and self.victim:
            victim, self.victim = self.victim, None
            self.count_deaths(victim)
            self.handles[victim].kill()
            self.report.kills += 1

    def count_deaths(self, url: str) -> None:
        """Deaths in ``url``'s log since last read (before a restart replaces the process)."""
        log = self.handles[url].log()
        self.report.engine_deaths += len(self.deaths(log[self.seen_log[url] :]))
        self.seen_log[url] = len(log)

    def serving(self) -> list[str]:
        return [n for n, s in self.orch.states().items() if s is EngineState.SERVING]

    def rollout(self, n: int) -> None:
        def one(url: str, i: int) -> bool:
            try:
                self.clients[url].generate(f"step {n} request {i}", sampling_params={"max_new_tokens": 4})
                return True
            except Exception:
                return False

        futures = [self.pool.submit(one, u, i) for u in self.serving() for i in range(self.config.rollout_requests)]
        self.report.requests_sent += len(futures)
        self.report.requests_lost += sum(1 for f in futures if not f.result())

    def join(self, url: str) -> None:
        try:
            report = self.orch.add(self.clients[url], verify=WeightVersionCheck(self.group_version(url)))
        except PhaseFailed as err:
            self.note(f"join of {url}: {err}")
            return
        self.report.joins += 1
        self.report.replaced += len(report.replaced)

    def group_version(self, joining: str) -> str:
        """The weight version the group's engines report (``/model_info``, answered while paused too): what the joining
        engine must report."""
        states = self.orch.states()
        members = [u for u, s in states.items() if u != joining and s not in (EngineState.FENCED, EngineState.JOINING)]
        version = getattr(self.clients[members[0]].model_info(), "weight_version", None)
        if not isinstance(version, str) or not version:
            raise RuntimeError(f"{members[0]} reports no weight_version in /model_info: {version!r}")
        return version

    def note(self, error: str) -> None:
        if len(self.report.errors) < 20:
            self.report.errors.append(" ".join(error.split())[:300])

    def step(self, n: int) -> None:
        cfg = self.config
        self.rollout(n)
        if cfg.kill_every and n % cfg.kill_every == cfg.kill_every - 1:
            live = self.serving()
            if len(live) > cfg.min_engines:
                self.victim = self.rng.choice(live)
        killed = self.victim
        offload = self.orch.offload(min_engines=cfg.min_engines)
        self.report.fenced += len(offload.fenced)
        if killed is not None and self.victim is None:  # it was killed mid-offload: restart it and add it back
            self.handles[killed].restart()
            self.clients[killed].close()  # a new process gets a new client (the old one's breaker is open on its URL)
            self.clients[killed] = self.client(killed)
            self.restarted.add(killed)
            self.report.restarts += 1
            self.join(killed)
        self.victim = None
        adding = cfg.add_every and n % cfg.add_every == cfg.add_every - 1 and self.spares
        if adding and n // cfg.add_every % 2 == 0:
            self.join(self.spares.pop(0))  # into the offloaded group
            adding = False
        weights = self.orch.onload(tags=["weights"], min_engines=cfg.min_engines)
        self.report.fenced += len(weights.fenced)
        with self.orch.weight_sync():
            pass  # the trainer would push its weights here; the emulated engines need none
        onload = self.orch.onload(min_engines=cfg.min_engines)
        self.report.fenced += len(onload.fenced)
        if adding:
            self.join(self.spares.pop(0))  # into the serving group
        if cfg.retire_every and n % cfg.retire_every == cfg.retire_every - 1:
            live = self.serving()
            if len(live) > cfg.min_engines + 1:
                leaving = self.rng.choice(live)
                self.orch.retire(leaving)
                self.spares.append(leaving)
                self.report.leaves += 1
        for url in [u for u, s in self.orch.states().items() if s is EngineState.FENCED]:
            self.join(url)  # a fenced engine is checked and brought back

    def run(self, progress: Callable[[int, ChurnReport], None] | None) -> ChurnReport:
        try:
            for n in range(self.config.steps):
                try:
                    self.step(n)
                except PhaseFailed as err:
                    self.report.failed_steps += 1
                    self.note(f"step {n}: {err}")
                self.report.steps += 1
                if progress is not None:
                    progress(n, self.report)
            for url in self.handles:
                self.count_deaths(url)
            states = self.orch.states()
            self.report.restarted_back = all(states.get(u) in (EngineState.SERVING, None) for u in self.restarted)
            return self.report
        finally:
            self.pool.shutdown(wait=True)
            self.orch.close()
            for client in self.clients.values():
                client.close()


def run_churn(
    fleet: EmulatedFleet,
    config: ChurnConfig,
    *,
    deaths: Callable[[str], list[str]],
    progress: Callable[[int, ChurnReport], None] | None = None,
) -> ChurnReport:
    """Run ``config.steps`` churn steps on ``fleet`` (started; engines past ``config.engines`` are spares). ``deaths``:
    an engine log's death causes (``death_causes``); ``progress``: told each step's index and the report so far."""
    return _Churn(fleet, config, deaths).run(progress)

