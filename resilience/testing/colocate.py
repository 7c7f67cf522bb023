"""The colocate comparison: one loop of RL steps on emulated engines, for every engine kind and route, the old way and ours.

``run_colocate`` runs ``config.steps`` steps of one way and scores them alike: a step that raised, or in which an
engine died, is a failed step and spends one restart of the run's ``RestartBudget`` (the seed's
max_global_restart); the lab then puts the fleet back in order and the run goes on until the budget is spent. A
step is the lab's (:class:`~resilience.testing.lab.Lab`) of the engine kind and route: ``lab_sglang`` (sglang,
direct), ``lab_vllm`` (vllm, direct), ``lab_smg`` (sglang behind smg).

An interrupt (Ctrl-C, or SIGINT to this process alone) ends the run within about a second: the run's
:class:`~resilience.testing.lab.StopClock` is stopped, the lab closes without waiting for calls in flight, and the
interrupt propagates.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, Literal

from resilience.barrier.journal import RestartBudget
from resilience.events import Observer
from resilience.testing.lab import ColocateReport, Lab, LabSetup, StopClock

if TYPE_CHECKING:
    from resilience.policy import PolicyTable
    from resilience.testing.emulator import EmulatedFleet
    from resilience.testing.faultplan import FaultPlan
    from resilience.testing.faults import FaultProxy

__all__ = ["ColocateConfig", "EngineKind", "Route", "StepProgress", "run_colocate", "score_step"]

EngineKind = Literal["sglang", "vllm"]
"""The emulated engines a run drives."""
Route = Literal["direct", "smg"]
"""How the control plane reaches them: straight to each engine (through its fault proxy), or behind an smg gateway."""
_LABS: Final = frozenset({("sglang", "direct"), ("vllm", "direct"), ("sglang", "smg")})
"""The (engine kind, route) pairs with a lab; vLLM behind smg is not offered (smg 1.13.0 fans out SGLang's routes)."""
_WAYS: Final[dict[str, tuple[str, ...]]] = {"direct": ("old", "ours"), "smg": ("smg", "ours", "ours-smg")}
"""The ways of each route (behind smg: ``lab_smg.PEER_WAYS``' names, in table order)."""


def _lab(engine: str, route: str) -> Callable[[LabSetup], Lab]:
    """The lab class of a pair of ``_LABS``, imported on demand (a soak's process stays as small as its loop)."""
    if (engine, route) == ("sglang", "direct"):
        from resilience.testing.lab_sglang import SGLangLab

        return SGLangLab
    if engine == "vllm":
        from resilience.testing.lab_vllm import VLLMLab

        return VLLMLab
    from resilience.testing.lab_smg import SmgLab

    return SmgLab


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
    """The step (0-based) at which the controller dies while the engines train, after its offload; a new one runs
    that step again from its offload (the baseline's knowing nothing, ours on its journal). None (default): never."""
    controller_kill_every: int | None = None
    """Every K-th step the controller dies: ours inside a seeded phase with its calls sent (a new one runs the
    transition again on the journal as it was), the baseline's after its offload. None (default): never."""

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
    step: int
    steps: int
    ok: bool
    restarts: int
    deaths: int
    error: str | None = None
    started_ns: int | None = None
    """``time.monotonic_ns()`` when the step began (its rollout)."""
    ended_ns: int | None = None
    """``time.monotonic_ns()`` when the step's last call returned, before any recovery."""


_ERROR_CHARS = 2000
"""Characters of a failed step's error kept in ``ColocateReport.failures`` (a PhaseFailed names every engine's cause)."""
_TRANSPORT_REASONS = frozenset({"connect_error", "read_timeout", "connection_reset"})
"""Retry reasons of a transport failure (no HTTP answer): what ``resent_after_error`` counts of ours."""
_AMBIGUOUS_KINDS = frozenset({"drop_after", "hang_after", "reset_after", "status_after"})


def _injected_502s(proxies: Sequence[FaultProxy | None]) -> int:
    return sum(proxy.injected_count(502) for proxy in proxies if proxy is not None)


def _injected_ambiguous(proxies: Sequence[FaultProxy | None]) -> int:
    """Faults injected after the engine acted, from the proxies' exact counts (keys ``kind:status:path``)."""
    return sum(n for p in proxies if p is not None for key, n in p.counts().items() if key.split(":", 1)[0] in _AMBIGUOUS_KINDS)


def score_step(report: ColocateReport, budget: RestartBudget, n: int, error: str | None, deaths: int, cause: str) -> None:
    """Count step ``n``: finished when it raised nothing (``error`` None) and no engine died, else failed and named in
    ``report.failures``, spending one restart of ``budget`` (recorded with ``cause``) or, once it is spent, ending the
    run (``report.stopped_early``)."""
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
    way: str,
    *,
    engine: EngineKind = "sglang",
    route: Route = "direct",
    observers: Sequence[Observer] = (),
    restart_budget: RestartBudget | None = None,
    policies: PolicyTable | None = None,
    progress: Callable[[StepProgress], None] | None = None,
    proxies: Sequence[FaultProxy] | None = None,
    plan: FaultPlan | None = None,
    recover_when_spent: bool = True,
) -> ColocateReport:
    """Run ``config.steps`` colocate steps of ``way`` on ``fleet``; stops early when the restart budget is spent.

    ``way``: direct ``"old"`` or ``"ours"``; behind smg ``"smg"``, ``"ours"`` or ``"ours-smg"``. ``engine``:
    ``"sglang"`` (default) or ``"vllm"`` (``VLLMEngineConfig(dev_mode=True, enable_sleep_mode=True, ...)``
    engines). ``route``: ``"direct"`` (default) or ``"smg"`` (SGLang only; needs the ``[smg]`` extra and ``plan``).

    ``proxies`` (direct route): fault proxies to send every call through instead of the fleet's own, one per engine
    in fleet order; faults are counted from them (fresh proxies give a run fresh call counters, so one fleet serves
    several runs with the same faults). Default None: the fleet's own. ``plan`` (smg route): the faults of the
    proxies the run starts between the gateway and the engines.

    ``policies``: our clients' (default: the lab's demo table). ``restart_budget``: default
    ``RestartBudget(config.restart_limit)``. ``progress``: told after each step. ``recover_when_spent``: whether the
    step that finds the budget spent still puts the fleet back in order (default True; False saves those restarts
    when the caller stops the fleet next, the deaths still counted).
    """
    if (engine, route) not in _LABS:
        raise ValueError(f"no colocate lab for engine {engine!r} on route {route!r}: there are {sorted(_LABS)}")
    if way not in _WAYS[route]:
        raise ValueError(f"`way` must be one of {list(_WAYS[route])} on route {route!r}, but was {way!r}")
    if proxies is not None and len(proxies) != len(fleet.engines):
        raise ValueError(f"`proxies` must hold one proxy per engine ({len(fleet.engines)}), but held {len(proxies)}")
    if route == "smg" and (plan is None or proxies is not None):
        raise ValueError("route 'smg' takes a `plan` (its run starts its own proxies) and no `proxies`")
    budget = restart_budget if restart_budget is not None else RestartBudget(config.restart_limit)
    clock = StopClock()
    lab = _lab(engine, route)(LabSetup(fleet, config, way, observers, budget, clock, policies, proxies, plan))
    report, counted = lab.report, lab.counted
    before_502, before_ambiguous = _injected_502s(counted), _injected_ambiguous(counted)
    t0 = time.monotonic()
    ended = False
    try:
        for n in range(config.steps):
            if _run_step(lab, fleet, config, budget, n, recover_when_spent, progress):
                break
        ended = True
    finally:
        if not ended:  # an interrupt (or a failed recovery): no lab thread retries on, nothing waits for calls in flight
            clock.stop()
        lab.close(interrupted=not ended)
    counter = lab.counter
    report.http_502_seen = _injected_502s(counted) - before_502
    report.ambiguous_faults_seen = _injected_ambiguous(counted) - before_ambiguous
    report.http_502_absorbed = counter.absorbed
    report.retried_502 = counter.retries.get("status_502", 0)
    report.resent_after_error = sum(n for why, n in counter.retries.items() if why in _TRANSPORT_REASONS)
    lab.tally()
    report.wall_s = time.monotonic() - t0
    return report


def _run_step(
    lab: Lab,
    fleet: EmulatedFleet,
    config: ColocateConfig,
    budget: RestartBudget,
    n: int,
    recover_when_spent: bool,
    progress: Callable[[StepProgress], None] | None,
) -> bool:
    """Run, recover from and score step ``n``; returns whether the run is over (the restart budget spent)."""
    report = lab.report
    error: str | None = None
    cause = "engine death"  # what the restart budget records for a failed step: the exception's type, if one
    started_ns = time.monotonic_ns()
    try:
        lab.step(n)
    except Exception as exc:
        cause = type(exc).__name__
        text = " ".join(str(exc).split())  # whole (a display cuts it between clauses), bounded for a long soak's report
        error = f"step {n}: {cause}: {text if len(text) <= _ERROR_CHARS else text[: _ERROR_CHARS - 4] + ' ...'}"
    ended_ns = time.monotonic_ns()
    dead_now = sum(1 for e in fleet.engines if not e.alive())
    if (error or dead_now) and budget.remaining == 0 and not recover_when_spent:
        deaths = dead_now  # the run is over: no restart (the caller stops the fleet)
    else:
        deaths = lab.recover(bool(error or dead_now))
    report.engine_deaths += deaths
    if lab.restarted_controller_in == n:
        report.controller_restart_deaths += deaths
    score_step(report, budget, n, error, deaths, cause)
    if progress is not None:
        ok = error is None and deaths == 0
        failure = report.failures[-1] if not ok else None
        progress(StepProgress(report.way, n + 1, config.steps, ok, report.restarts, report.engine_deaths, failure, started_ns, ended_ns))
    return report.stopped_early is not None
